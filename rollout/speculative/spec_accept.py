"""Speculative verification's acceptance rule: which proposed tokens a sequence keeps, and the one token it
samples after them, so that what it emits follows the target policy's distribution exactly.

One verification pass gives the target's logits at the k + 1 positions [last token, d_1 .. d_k]: row i
is the distribution of the token after d_i (row 0: after the last token). The standard rule (Leviathan et
al. 2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et al. 2023): proposal d_i
(drawn from q_i) is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the
sequence samples from the residual max(0, p_i - q_i), normalised, and stops; when all k are accepted it
samples one more token from p_k (the bonus). Every emitted token is then distributed as p. An n-gram
proposal is a point mass (q_i(d_i) = 1): accepted with probability p_i(d_i), residual p_i with d_i
removed.

p is the sampler's distribution (rollout/sampling.py): softmax(logits / temperature) truncated by top-k
and top-p and renormalised; greedy (temperature 0) accepts d_i exactly when it is the argmax, so greedy
speculation emits greedy decoding's tokens. The logprob reported with each emitted token is the
sampler's convention (log softmax(logits / temperature) before truncation): the behaviour policy's.

Randomness: the sequence's own generator, k + 1 uniforms per verification drawn at once (u_i decides
proposal i, u_{k+1} draws the token after the kept ones), so a seeded request speculates reproducibly.

`accept` is one sequence's rule written plainly (the reference); `accept_many` runs a step's verifications
at once (one softmax, truncation and draw for all rows; the per-sequence part is a loop over k host
floats) and returns the same verdicts from the same generators (tested).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from rollout.sampling import SamplingParams, truncate_rows


@dataclass(frozen=True)
class Verdict:
    """What one sequence keeps from a verification pass."""

    tokens: list[int]
    """The accepted proposals, then the token sampled after them (correction or bonus): 1 to k + 1 tokens."""
    logprobs: list[float]
    """Per token, the behaviour logprob (log softmax(logits / temperature), before truncation)."""
    entropies: list[float]
    """Per token, the entropy (nats) of the distribution it was drawn at, as the sampler reports it."""

    @property
    def num_accepted(self) -> int:
        """Proposals kept (the last token is the target's own sample)."""
        return len(self.tokens) - 1


def target_probs(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, vocab] -> (the sampler's distribution p [R, vocab] float32, truncated and renormalised;
    the reported log-probs [R, vocab]: log softmax(logits / temperature), plain log softmax when greedy)."""
    logits = logits.float()
    if params.temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        return logp.exp(), logp
    logp = torch.log_softmax(logits / params.temperature, dim=-1)  # [R, vocab]
    rows = logp.shape[0]
    kept = truncate_rows(logp, [params.top_k] * rows, [params.top_p] * rows)
    return torch.softmax(kept, dim=-1), logp


def sampler_probs_rows(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """`target_probs` with settings per row: logits [R, vocab], params[r] row r's -> (p [R, vocab], logp
    [R, vocab]). A greedy row's logp is the plain log softmax; its p is not the sampler's (greedy takes
    the argmax): callers look at greedy rows' logits only."""
    temps = torch.tensor([sp.temperature if sp.temperature > 0 else 1.0 for sp in params])[:, None]
    logp = torch.log_softmax(logits.float() / temps, dim=-1)  # [R, vocab]
    kept = truncate_rows(logp, [sp.top_k for sp in params], [sp.top_p for sp in params])
    return torch.softmax(kept, dim=-1), logp


def _draw(probs: torch.Tensor, u: float) -> int:
    """One token from `probs` [vocab] (need not sum to 1) by inverting its CDF at the uniform u; never a
    zero-probability token."""
    return draw_rows(probs[None], [u])[0]


def draw_rows(probs: torch.Tensor, uniforms: list[float]) -> list[int]:
    """`_draw` of each row of probs [R, vocab] at its uniform."""
    cdf = probs.double().cumsum(dim=-1)  # [R, vocab]
    target = torch.tensor(uniforms, dtype=torch.float64) * cdf[:, -1]  # [R]
    index = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
    return index.clamp_(max=probs.shape[-1] - 1).tolist()


def accept(logits: torch.Tensor, proposal: list[int], params: SamplingParams, generator: torch.Generator | None,
           draft_probs: torch.Tensor | None = None) -> Verdict:
    """One sequence's verdict. logits: [k + 1, vocab], row i the target's logits after the last token and
    d_1 .. d_i; proposal: d_1 .. d_k (k >= 0); draft_probs: [k, vocab], the distribution each d_i was
    drawn from (a draft model's), or None for point masses (n-gram). `generator`: the sequence's (drawn
    from when temperature > 0; None only when greedy). Pure: reads the generator's stream only."""
    k = len(proposal)
    if logits.shape[0] != k + 1:
        raise ValueError(f"logits of {logits.shape[0]} rows for {k} proposals: expected {k + 1}")
    if draft_probs is not None and draft_probs.shape != (k, logits.shape[1]):
        raise ValueError(f"draft_probs of shape {tuple(draft_probs.shape)}, expected {(k, logits.shape[1])}")
    probs, logp = target_probs(logits, params)
    if params.temperature == 0:
        best = logits.argmax(dim=-1).tolist()  # as the sampler's greedy rows
        kept = next((i for i, d in enumerate(proposal) if best[i] != d), k)
        tokens = list(proposal[:kept]) + [best[kept]]
    else:
        if generator is None:
            raise ValueError(f"temperature={params.temperature} needs the sequence's generator")
        tokens = _stochastic(probs, proposal, generator, draft_probs)
    rows = torch.arange(len(tokens))
    used = logp[: len(tokens)]  # [emitted, vocab]
    entropies = -torch.where(used > float("-inf"), used.exp() * used, 0.0).sum(dim=-1)
    return Verdict(tokens, logp[rows, torch.tensor(tokens)].tolist(), entropies.tolist())


def _stochastic(probs: torch.Tensor, proposal: list[int], generator: torch.Generator,
                draft_probs: torch.Tensor | None) -> list[int]:
    """The rejection rule over p = probs [k + 1, vocab] (module docstring); returns the emitted tokens."""
    u = torch.rand(len(proposal) + 1, generator=generator, dtype=torch.float64).tolist()
    tokens: list[int] = []
    for i, d in enumerate(proposal):
        p_d = float(probs[i, d])
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        if q_d > 0 and u[i] * q_d < p_d:  # accepted with probability min(1, p / q)
            tokens.append(d)
            continue
        tokens.append(_draw(residual(probs[i], d, None if draft_probs is None else draft_probs[i]), u[-1]))
        return tokens
    tokens.append(_draw(probs[len(proposal)], u[-1]))
    return tokens


def residual(p: torch.Tensor, d: int, q: torch.Tensor | None) -> torch.Tensor:
    """Where to sample after rejecting proposal d: max(0, p - q) [vocab] (unnormalised); for a point mass
    q at d, p with d removed. When p <= q everywhere up to rounding, p itself (the residual's limit)."""
    if q is None:
        out = p.clone()
        out[d] = 0.0
    else:
        out = (p - q.float()).clamp_(min=0.0)
    return out if float(out.sum()) > 0.0 else p


def accept_many(logits: torch.Tensor, proposals: list[list[int]], params: list[SamplingParams],
                generators: list[torch.Generator | None], draft_probs: list[torch.Tensor | None] | None = None
                ) -> list[Verdict]:
    """`accept` for several sequences at once. logits: [sum of k_i + 1, vocab], sequence i's k_i + 1 rows
    in order; proposals, params, generators (None only when greedy), draft_probs ([k_i, vocab] or None
    each; None = all n-gram): per sequence. Returns each sequence's verdict, equal to `accept`'s from the
    same generator state."""
    counts = [len(p) + 1 for p in proposals]
    if logits.shape[0] != sum(counts):
        raise ValueError(f"logits of {logits.shape[0]} rows for proposals needing {sum(counts)}")
    logits = logits.float()
    starts = [0, *itertools.accumulate(counts)][:-1]
    probs, logp = sampler_probs_rows(logits, [sp for sp, n in zip(params, counts) for _ in range(n)])
    best = logits.argmax(dim=-1).tolist()
    proposal_rows = [s + j for s, prop in zip(starts, proposals) for j in range(len(prop))]
    proposed = [d for prop in proposals for d in prop]
    p_at = probs[proposal_rows, proposed].tolist() if proposed else []  # p_i(d_i), every proposal
    tokens: list[list[int]] = []
    finals: list[tuple[int, int, torch.Tensor]] = []  # (sequence, kept, the distribution to draw from)
    uniforms: list[float] = []
    at = 0
    for i, (prop, sp, gen, start) in enumerate(zip(proposals, params, generators, starts)):
        k = len(prop)
        if sp.temperature == 0:
            kept = next((j for j, d in enumerate(prop) if best[start + j] != d), k)
            tokens.append(list(prop[:kept]) + [best[start + kept]])
            at += k
            continue
        if gen is None:
            raise ValueError(f"temperature={sp.temperature} needs the sequence's generator")
        q = draft_probs[i] if draft_probs is not None else None
        u = torch.rand(k + 1, generator=gen, dtype=torch.float64).tolist()
        kept = k
        for j, d in enumerate(prop):
            q_d = 1.0 if q is None else float(q[j, d])
            if not (q_d > 0 and u[j] * q_d < p_at[at + j]):
                kept = j
                break
        at += k
        tokens.append(list(prop[:kept]))
        row = probs[start + kept]
        finals.append((i, kept, row if kept == k else residual(row, prop[kept], None if q is None else q[kept])))
        uniforms.append(u[-1])
    if finals:
        drawn = draw_rows(torch.stack([dist for _, _, dist in finals]), uniforms)
        for (i, _, _), token in zip(finals, drawn):
            tokens[i].append(token)
    rows = [s + j for s, toks in zip(starts, tokens) for j in range(len(toks))]
    emitted = [t for toks in tokens for t in toks]
    used = logp[rows]  # [emitted, vocab]
    entropies = (-torch.where(used > float("-inf"), used.exp() * used, 0.0).sum(dim=-1)).tolist()
    chosen = used[torch.arange(len(rows)), emitted].tolist()
    out, at = [], 0
    for toks in tokens:
        out.append(Verdict(toks, chosen[at:at + len(toks)], entropies[at:at + len(toks)]))
        at += len(toks)
    return out
