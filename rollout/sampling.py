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
    stop_strings: tuple[str, ...] = field(default_factory=tuple)
    """Texts that end generation (finish reason "stop") once the decoded new tokens contain one; the
    token completing it is kept (token-in/token-out: what was sampled is what the trainer scores).
    Needs the engine's `detokenize`."""

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
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        if not all(isinstance(s, str) and s for s in self.stop_strings):
            raise ValueError(f"stop_strings={self.stop_strings!r}, expected non-empty strings")

    @property
    def stop_window(self) -> int:
        """Tokens decoded to look for a stop string after each new token: one per UTF-8 byte of the
        longest (a token holds at least one byte) plus a few for tokens that decode to nothing."""
        return max((len(s.encode()) for s in self.stop_strings), default=0) + 4


@dataclass
class SamplingRows:
    """The sampling settings of one step's rows, built on the host before the forward pass.

    `values` per row: [temperature (0 = greedy), top_k (0 = keep all), top_p, uniform draw in
    [0, 1)] (float64 holds each exactly as the float32 / int64 it becomes on the device). The draws
    are left at 0.0 here and written by `fill_draws` into the host tensor that carries the values
    to the device, from each row's own CPU generator (a seed's numbers do not depend on the device,
    and no value is ever read back). The engine ships the rows in its step's one metadata copy
    (models/paged.py `StepMetadata.add_floats`); `sample` alone copies them itself."""

    values: list[list[float]]
    """[rows][4] as above, draws still 0.0."""
    generators: list[torch.Generator | None]
    """Per row, the generator its draw comes from (None for greedy rows)."""
    max_top_k: int
    """Largest top_k over the rows (0: no row truncates by rank); a bound after `select`."""
    any_top_p: bool
    """Whether some row has top_p < 1; a bound after `select`."""

    @classmethod
    def plan(cls, params: list[SamplingParams], generators: list[torch.Generator], vocab: int) -> "SamplingRows":
        top_k = [p.top_k if 0 < p.top_k < vocab and p.temperature > 0 else 0 for p in params]
        top_p = [p.top_p if p.temperature > 0 else 1.0 for p in params]
        return cls([[float(p.temperature), float(k), float(q), 0.0] for p, k, q in zip(params, top_k, top_p)],
                   [g if p.temperature > 0 else None for p, g in zip(params, generators)],
                   max(top_k, default=0), min(top_p, default=1.0) < 1.0)

    @property
    def num_stochastic(self) -> int:
        """Rows with temperature > 0 (0: every row is greedy and nothing needs to reach the device)."""
        return sum(g is not None for g in self.generators)

    def fill_draws(self, host: torch.Tensor) -> None:
        """Write each stochastic row's uniform draw into column 3 of `host` ([rows, 4] float64 on the
        host: the tensor about to carry `values` to the device). Draws once per row and call."""
        for b, gen in enumerate(self.generators):
            if gen is not None:
                host[b, 3] = torch.rand(1, generator=gen, device="cpu")

    def select(self, rows: list[int]) -> "SamplingRows":
        """The settings of `rows` only (host lists; draws already written stay written). max_top_k
        and any_top_p stay those of all rows: bounds, which truncate nothing more (each row's own k
        and p decide)."""
        return SamplingRows([self.values[r] for r in rows], [self.generators[r] for r in rows], self.max_top_k,
                            self.any_top_p)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
           ) -> tuple[list[int], list[float]]:
    """Draw one token per row. logits: [B, vocab] -> (token ids, their logprobs as documented above).

    The rows' settings and draws are built on the host (`SamplingRows`) and copied to the device in
    one non-blocking copy from pinned memory on a GPU (none when every row is greedy); tokens and
    logprobs come back in one copy. The engine instead ships the settings in its step's metadata
    buffer and calls `sample_rows`.
    """
    rows = SamplingRows.plan(params, generators, logits.shape[-1])
    settings = None
    if rows.num_stochastic:
        pinned = logits.device.type == "cuda"  # a staging buffer for one non-blocking copy
        host = torch.tensor(rows.values, dtype=torch.float64, device="cpu", pin_memory=pinned)  # [B, 4]
        rows.fill_draws(host)
        settings = host.to(logits.device, non_blocking=True) if pinned else host
    return sample_rows(logits, rows, settings)


def sample_rows(logits: torch.Tensor, rows: SamplingRows, settings: torch.Tensor | None, *,
                with_entropy: bool = False) -> tuple[list[int], list[float]] | tuple[list[int], list[float], list[float]]:
    """`sample` given the rows' settings already on the device: settings [B, 4] float64 (the values
    of `rows`), None when every row is greedy. One device-to-host copy (tokens and logprobs, and with
    `with_entropy` each row's entropy in nats of the tempered distribution before truncation: what the
    policy at that temperature is, -sum p log p; a greedy row's at temperature 1).

    Stochastic rows invert their CDF at their draw in one batched search (the same draw whatever
    else is in the batch); truncation (top-k / top-p) runs on the whole block at once
    (`truncate_rows`). In a batch mixing greedy and stochastic rows, the greedy rows also run the
    (row-independent) sampling ops, their draws discarded: cheaper than gathering the stochastic
    rows by an index."""
    logits = logits.float()
    vocab = logits.shape[-1]
    tokens = logits.argmax(dim=-1)  # greedy rows keep these
    if not rows.num_stochastic:  # all greedy: nothing was copied over (logits / 1.0 would be logits, bit for bit)
        logp = torch.log_softmax(logits, dim=-1)  # [B, vocab]
    else:
        raw_temperature = settings[:, :1].float()  # [B, 1]
        logp = torch.log_softmax(logits / torch.where(raw_temperature > 0, raw_temperature, 1.0), dim=-1)
        kept = _truncate(logp, settings[:, 1:2].long(), settings[:, 2:3].float(), rows.max_top_k, rows.any_top_p)
        cdf = kept.exp().cumsum(dim=-1)  # [B, vocab]; dropped tokens add nothing
        u = settings[:, 3].float()  # [B]
        # side="right": the first token whose CDF exceeds u * total, never a zero-probability one.
        drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], side="right")[:, 0].clamp_(max=vocab - 1)
        tokens = drawn if rows.num_stochastic == len(rows.values) else torch.where(raw_temperature[:, 0] > 0,
                                                                                    drawn, tokens)
    chosen = logp.gather(1, tokens[:, None])[:, 0]  # [B]
    # One device-to-host copy for all: float64 holds every token id and every float32 logprob exactly.
    columns = [tokens.to(torch.float64), chosen.to(torch.float64)]
    if with_entropy:  # 0 * log 0 = 0: a token of probability 0 adds nothing
        columns.append(-torch.where(logp > float("-inf"), logp.exp() * logp, 0.0).sum(dim=-1).to(torch.float64))
    host = torch.stack(columns).tolist()
    return ([int(t) for t in host[0]], *host[1:])


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
