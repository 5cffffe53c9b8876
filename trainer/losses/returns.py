"""Token-level advantages (registry kind "advantage", `level` "token"): rewards per token, discounted
returns, GAE, and whitening over the batch, all on the packed layout of whole sequences.

A sequence's *steps* are its valid (policy) rows in order; rows between them (prompt, tool observations)
are not steps: discounting and bootstrapping skip them, so a multi-turn trajectory is one chain of its
own tokens (verl's multi-turn GAE). The outcome reward sits on each sequence's last step; with KL in
the reward every step also carries -coef * kl_t (Ouyang et al. 2022, arXiv:2203.02155 eq. 2).

Batch statistics (whitening, `scale_rewards=batch`) are over the whole step's batch: `moments` sums a
small float64 tensor over the data-parallel ranks (the identity on one rank), so N ranks whiten as
one rank with all the sequences does.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from trainer.losses.aggregation import Segments, per_sequence
from trainer.losses.registry import register

WHITEN_EPS = 1e-8
"""Added to the variance before its inverse square root (verl's masked_whiten)."""


class TokenRewards(NamedTuple):
    """What a token-level estimator reads, for `count` whole sequences packed into [N] rows."""

    rewards: Tensor
    """[S] float32: each sequence's outcome reward (the environment's, shaped)."""
    mask: Tensor
    """[N] bool: the steps (policy tokens)."""
    segments: Segments
    """Each row's sequence (whole sequences: no context-parallel share)."""
    groups: Tensor
    """[S] int64: each sequence's prompt group (for group baselines)."""
    kl_penalty: Tensor | None = None
    """[N] float32: coef * kl_t per row, subtracted from the step's reward; None = no KL in the reward."""
    values: Tensor | None = None
    """[N] float32: the critic's V(s_t) per row (GAE); None without a critic."""
    moments: Callable[[Tensor], Tensor] = lambda x: x
    """Sums a [k] float64 tensor over the data-parallel ranks (identity on one)."""


def token_level_rewards(tr: TokenRewards) -> Tensor:
    """[N]: the outcome reward on each sequence's last step, minus the KL penalty on every step; 0 off steps."""
    rows, seq, pos, counts = _steps(tr.mask, tr.segments)
    out = torch.zeros(tr.mask.shape, dtype=torch.float32, device=tr.mask.device)
    last = pos == counts[seq] - 1  # [M] each sequence's last step
    out[rows[last]] = tr.rewards.to(torch.float32)[seq[last]]
    if tr.kl_penalty is not None:
        out = out - torch.where(tr.mask, tr.kl_penalty.to(torch.float32), 0.0)
    return out


def sequence_returns(tr: TokenRewards) -> Tensor:
    """[S]: each sequence's undiscounted return (outcome reward minus its summed KL penalty)."""
    return per_sequence(token_level_rewards(tr), tr.segments)


def discounted_returns(rewards: Tensor, mask: Tensor, segments: Segments, gamma: float) -> Tensor:
    """[N]: G_t = sum_{k >= t} gamma^(k - t) r_k over each sequence's steps (0 off steps)."""
    padded, index = _padded(rewards, mask, segments)  # [S, L]
    out = torch.zeros_like(padded)
    running = torch.zeros(padded.shape[0], dtype=padded.dtype, device=padded.device)
    for t in range(padded.shape[1] - 1, -1, -1):  # padding after a sequence's steps is 0: it adds nothing
        running = padded[:, t] + gamma * running
        out[:, t] = running
    return _scatter(out, index, rewards)


def gae(rewards: Tensor, values: Tensor, mask: Tensor, segments: Segments, gamma: float,
        lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, arXiv:1506.02438 eq. 16) over each
    sequence's steps: delta_t = r_t + gamma V_{t+1} - V_t (V after the last step is 0: the episode ends),
    A_t = delta_t + gamma lam A_{t+1}. Returns (advantages [N], returns A + V [N]), 0 off steps.
    lam = 0 gives the TD error, lam = 1 the Monte-Carlo return minus V."""
    r, index = _padded(rewards, mask, segments)  # [S, L]
    v, _ = _padded(values, mask, segments)
    steps = index[3]
    length = r.shape[1]
    live = torch.arange(length, device=r.device)[None, :] < steps[:, None]  # [S, L]
    v = torch.where(live, v, 0.0)
    adv = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    for t in range(length - 1, -1, -1):
        next_v = v[:, t + 1] if t + 1 < length else torch.zeros_like(running)
        delta = r[:, t] + gamma * next_v - v[:, t]
        running = torch.where(live[:, t], delta + gamma * lam * running, 0.0)
        adv[:, t] = running
    advantages = _scatter(adv, index, rewards)
    return advantages, torch.where(mask, advantages + values.to(advantages.dtype), 0.0)


def whiten(x: Tensor, mask: Tensor, moments: Callable[[Tensor], Tensor] = lambda s: s) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the valid rows of every rank's batch (`moments` sums over
    ranks), var with Bessel's correction as verl's masked_whiten; 0 off the valid rows. One valid
    token in all: its value minus the mean, 0."""
    xs = torch.where(mask, x.to(torch.float64), 0.0)
    n, s1 = moments(torch.stack([mask.sum().to(torch.float64), xs.sum()])).unbind()
    mean = s1 / n.clamp_min(1)
    centred = torch.where(mask, xs - mean, 0.0)
    s2 = moments(centred.square().sum()[None])[0]
    var = s2 / (n - 1).clamp_min(1)
    return torch.where(mask, centred * torch.rsqrt(var + WHITEN_EPS), 0.0).to(torch.float32)


def _mark_token_level(fn: Callable) -> Callable:
    fn.level = "token"
    return fn


@register("advantage", "reinforce_plus_plus")
@_mark_token_level
def reinforce_plus_plus(tr: TokenRewards, *, gamma: float = 1.0, **_: object) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262; verl's reinforce_plus_plus): the discounted return of
    the token rewards (KL in the reward), whitened over the batch: no critic, no group baseline.
    Returns (advantages [N], returns [N])."""
    returns = discounted_returns(token_level_rewards(tr), tr.mask, tr.segments, gamma)
    return whiten(returns, tr.mask, tr.moments), returns


@register("advantage", "reinforce_plus_plus_baseline")
@_mark_token_level
def reinforce_plus_plus_baseline(tr: TokenRewards, **_: object) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with a group baseline (verl's reinforce_plus_plus_baseline): each sequence's return
    minus its group's mean return, on every step, then whitened over the batch. A singleton group or
    one of equal returns contributes 0 before whitening. Returns (advantages [N], returns [N])."""
    returns = sequence_returns(tr).double()  # [S]
    groups, inverse = torch.unique(tr.groups, return_inverse=True)

    def per_group(how: str) -> Tensor:  # [G]
        return torch.zeros(len(groups), dtype=returns.dtype, device=returns.device).scatter_reduce(
            0, inverse, returns if how != "count" else torch.ones_like(returns), "sum" if how == "count" else how,
            include_self=False)

    mean = per_group("mean")
    same = per_group("amax") == per_group("amin")  # every member equal, or a singleton
    centred = torch.where(same[inverse], 0.0, returns - mean[inverse])  # [S]
    per_row = torch.where(tr.mask, centred.to(torch.float32)[tr.segments.ids], 0.0)
    return whiten(per_row, tr.mask, tr.moments), per_row


@register("advantage", "gae")
@_mark_token_level
def gae_advantages(tr: TokenRewards, *, gamma: float = 1.0, lam: float = 1.0, **_: object) -> tuple[Tensor, Tensor]:
    """PPO's advantages from a critic (`tr.values`): GAE over the token rewards, whitened over the batch
    (as verl's gae estimator); the returns (A + V, unwhitened) are the critic's targets."""
    if tr.values is None:
        raise ValueError("advantage 'gae' needs the critic's values, got None (algo.critic is built with advantage=gae)")
    advantages, returns = gae(token_level_rewards(tr), tr.values, tr.mask, tr.segments, gamma, lam)
    return whiten(advantages, tr.mask, tr.moments), returns


def _steps(mask: Tensor, segments: Segments) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(rows [M] of the steps in order, their sequence [M], their index among the sequence's steps [M],
    steps per sequence [S])."""
    rows = mask.nonzero().squeeze(1)
    seq = segments.ids[rows]
    counts = torch.bincount(seq, minlength=segments.count)
    first = torch.cumsum(counts, 0) - counts
    pos = torch.arange(len(rows), device=mask.device) - first[seq]
    return rows, seq, pos, counts


def _padded(x: Tensor, mask: Tensor, segments: Segments) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor, Tensor]]:
    """x's steps as [S, L] (L the longest sequence's steps; zeros after each one's), and the index to
    scatter back."""
    index = _steps(mask, segments)
    rows, seq, pos, counts = index
    length = int(counts.max()) if len(counts) else 0
    padded = torch.zeros(segments.count, length, dtype=torch.float64, device=x.device)
    padded[seq, pos] = x[rows].to(torch.float64)
    return padded, index


def _scatter(padded: Tensor, index: tuple[Tensor, Tensor, Tensor, Tensor], like: Tensor) -> Tensor:
    rows, seq, pos, _ = index
    out = torch.zeros(like.shape, dtype=torch.float32, device=like.device)
    out[rows] = padded[seq, pos].to(torch.float32)
    return out
