"""Sampling parameters and the sampler.

Log-probabilities returned with each sampled token are **log softmax(logits / temperature)** of
that token, computed before top-k / top-p truncation (greedy, temperature 0, reports plain
log softmax(logits)). This is the behaviour policy's density the PPO/GRPO importance ratio
needs (verl and slime use the same convention): truncation changes which tokens can be drawn,
not the policy's probability of the drawn one.

Randomness is per request: each sequence owns a `torch.Generator` seeded from its seed, and
draws from it only when it samples a new token, so batching, preemption and recompute never
change what a seeded request generates.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    max_new_tokens: int = 64
    """Tokens to generate at most (finish reason "length")."""
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 1.0
    """Nucleus mass kept, in (0, 1]; 1 = off."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 = off."""
    seed: int | None = None
    """Seed of this request's generator (fork i of a parallel request uses seed + i); None = from the
    engine seed and request id. Requests given the same seed draw the same random numbers."""
    n: int = 1
    """Parallel samples of the prompt (GRPO groups): prefilled once, then forked."""
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    """Tokens that end generation (finish reason "stop"), in addition to the model's eos."""
    ignore_eos: bool = False
    """Keep generating past eos (benchmarks)."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r}, expected an integer >= 1")
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature!r}, expected >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r}, expected a value in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r}, expected an integer >= 0 (0 = off)")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n={self.n!r}, expected an integer >= 1")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
           ) -> tuple[list[int], list[float]]:
    """Draw one token per row. logits: [B, vocab] -> (token ids, their logprobs as documented above).

    Stochastic rows draw one uniform number each from their own generator and invert their CDF in
    one batched search (the same draw whatever else is in the batch); truncation (top-k / top-p)
    runs on the whole block at once (`truncate_rows`). Everything is computed on `logits.device`;
    the generators are CPU generators. Two copies per call: the rows' settings and draws onto the
    device (one non-blocking copy from pinned memory on a GPU; none when every row is greedy), and
    tokens and logprobs back to the host (one copy).
    In a batch mixing greedy and stochastic rows, the greedy rows also run the (row-independent)
    sampling ops, their draws discarded: cheaper than gathering the stochastic rows by an index.
    """
    logits = logits.float()
    device, vocab = logits.device, logits.shape[-1]
    tokens = logits.argmax(dim=-1)  # greedy rows keep these
    rows = [b for b, p in enumerate(params) if p.temperature > 0]
    if not rows:  # all greedy: nothing to copy over (logits / 1.0 would be logits, bit for bit)
        logp = torch.log_softmax(logits, dim=-1)  # [B, vocab]
    else:
        # [B, 4] per row: temperature (0 = greedy), top_k (0 = keep all), top_p, uniform draw in
        # [0, 1); float64 holds each exactly as the float32 / int64 it becomes on the device.
        top_k = [p.top_k if 0 < p.top_k < vocab and p.temperature > 0 else 0 for p in params]
        top_p = [p.top_p if p.temperature > 0 else 1.0 for p in params]
        pinned = device.type == "cuda"  # a staging buffer for one non-blocking copy
        host = torch.tensor([[p.temperature, k, q, 0.0] for p, k, q in zip(params, top_k, top_p)],
                            dtype=torch.float64, device="cpu", pin_memory=pinned)  # [B, 4]
        for b in rows:  # drawn on the host from each request's CPU generator: a seed's numbers do
            host[b, 3] = torch.rand(1, generator=generators[b], device="cpu")  # not depend on the device
        settings = host.to(device, non_blocking=True) if pinned else host  # [B, 4]
        raw_temperature = settings[:, :1].float()  # [B, 1]
        logp = torch.log_softmax(logits / torch.where(raw_temperature > 0, raw_temperature, 1.0), dim=-1)
        kept = _truncate(logp, settings[:, 1:2].long(), settings[:, 2:3].float(), max(top_k), min(top_p) < 1.0)
        cdf = kept.exp().cumsum(dim=-1)  # [B, vocab]; dropped tokens add nothing
        u = settings[:, 3].float()  # [B]
        # side="right": the first token whose CDF exceeds u * total, never a zero-probability one.
        drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], side="right")[:, 0].clamp_(max=vocab - 1)
        tokens = drawn if len(rows) == len(params) else torch.where(raw_temperature[:, 0] > 0, drawn, tokens)
    chosen = logp.gather(1, tokens[:, None])[:, 0]  # [B]
    # One device-to-host copy for both: float64 holds every token id and every float32 logprob exactly.
    host_tokens, host_logprobs = torch.stack((tokens.to(torch.float64), chosen.to(torch.float64))).tolist()
    return [int(t) for t in host_tokens], host_logprobs


def truncate_rows(logp: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """`truncate` of every row at once: log-probs [R, vocab] with row r's top_k[r] (0 = off) and
    top_p[r] (1 = off) -> [R, vocab], dropped tokens -inf; equal to `truncate` row by row, ties
    included (on CPU the batched sort orders equal values as the one-row sort does: tested).
    Returns a new tensor, or logp itself when no row truncates."""
    vocab, device = logp.shape[-1], logp.device
    k = [kr if 0 < kr < vocab else 0 for kr in top_k]  # 0: this row keeps all (as truncate's guard)
    return _truncate(logp, torch.tensor(k, device=device)[:, None], torch.tensor(top_p, device=device)[:, None],
                     max(k), min(top_p) < 1.0)


def _truncate(logp: torch.Tensor, k_rows: torch.Tensor, p_rows: torch.Tensor, max_k: int, any_top_p: bool
              ) -> torch.Tensor:
    """`truncate_rows` given its settings on the device: k_rows [R, 1] int64 in [0, vocab) (0 = off),
    p_rows [R, 1] float32 (1 = off), and from the host the largest k and whether any row has
    top_p < 1 (which steps run at all). Top-k: one topk of the largest k, each row's threshold its
    own k-th value. Top-p: one sort of the block, each row's mask from its cumulative mass; rows
    with top_p = 1 come back as they went in (their sorted values scattered back)."""
    if max_k > 0:
        values = logp.topk(max_k, dim=-1).values  # [R, max k], descending
        kth = values.gather(1, (k_rows - 1).clamp_(min=0)).masked_fill_(k_rows == 0, float("-inf"))  # [R, 1]
        logp = logp.masked_fill(logp < kth, float("-inf"))
    if any_top_p:
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        probs = torch.softmax(sorted_logp, dim=-1)  # renormalised over what top-k kept
        # keep the smallest prefix reaching top_p (p_rows float32, as truncate's comparison with a float)
        drop = ((probs.cumsum(-1) - probs) >= p_rows) & (p_rows < 1.0)
        logp = logp.scatter(1, order, sorted_logp.masked_fill(drop, float("-inf")))
    return logp


def truncate(logp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then top-p filtering of log-probs [vocab]: dropped tokens get -inf (not renormalised;
    multinomial normalises). The one-row reference of `truncate_rows`."""
    if top_k > 0 and top_k < logp.numel():
        kth = logp.topk(top_k).values[-1]
        logp = logp.masked_fill(logp < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logp, order = logp.sort(descending=True)
        probs = torch.softmax(sorted_logp, dim=0)  # renormalised over what top-k kept
        drop = (probs.cumsum(0) - probs) >= top_p  # keep the smallest prefix reaching top_p
        logp = logp.scatter(0, order, sorted_logp.masked_fill(drop, float("-inf")))
    return logp
