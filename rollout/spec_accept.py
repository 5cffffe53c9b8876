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

Randomness: the sequence's own generator, in a fixed order (one uniform per proposal looked at, one for
the token sampled after), so a seeded request speculates reproducibly.
"""
from __future__ import annotations

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


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from `probs` [vocab] (need not sum to 1) by inverting its CDF at a uniform draw; never a
    zero-probability token."""
    cdf = probs.double().cumsum(0)
    u = torch.rand(1, generator=generator, dtype=torch.float64).item()
    index = int(torch.searchsorted(cdf, torch.tensor([u * cdf[-1].item()], dtype=torch.float64), right=True))
    return min(index, probs.numel() - 1)


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
        best = probs.argmax(dim=-1).tolist()
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
    tokens: list[int] = []
    for i, d in enumerate(proposal):
        p_d = float(probs[i, d])
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        u = torch.rand(1, generator=generator, dtype=torch.float64).item()
        if q_d > 0 and u * q_d < p_d:  # accepted with probability min(1, p / q)
            tokens.append(d)
            continue
        if draft_probs is None:
            residual = probs[i].clone()
            residual[d] = 0.0
        else:
            residual = (probs[i] - draft_probs[i].float()).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p <= q everywhere up to rounding: p itself is the residual's limit
            residual = probs[i]
        tokens.append(_draw(residual, generator))
        return tokens
    tokens.append(_draw(probs[len(proposal)], generator))
    return tokens
