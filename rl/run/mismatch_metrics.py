"""Every iteration's rollout-vs-trainer mismatch: how far the engine's behaviour logprobs (sampled by
recurrence and decode kernels, paged attention) are from the trainer's recomputation of the same
tokens at the update's start (the chunk kernel, dense attention), on the policy tokens.

k3 = expm1(d) - d with d = trainer - engine logprob: an estimate of KL(engine || trainer) on tokens the
engine sampled, >= 0 (0 when they agree). `k3_fresh` is over the tokens the newest policy version
sampled (numerics only: stale partial rollouts excluded); the ratio exp(d)'s quantiles; the fraction
of tokens outside the rollout correction's bounds; k3 by turn (1, 2, 3, 4+) and by position in the
sequence (buckets by powers of 4 from 16 tokens). Under context parallelism each rank reports its share
(positions are then local)."""
from __future__ import annotations

import torch

from trainer.losses import LossConfig

POSITION_EDGES = (16, 64, 256, 1024, 4096, 16384, 65536, 262144)
MAX_TURN = 4


def mismatch_metrics(batch, trainer_logp: torch.Tensor, loss: LossConfig) -> dict[str, float]:
    """`batch` a PackedBatch, `trainer_logp` [N] the trainer's old logprobs of its rows. Computed on the
    device without a data-dependent shape; one host transfer at the end (the train step's sync budget)."""
    mask = batch.mask
    if not len(mask):
        return {}
    d = torch.where(mask, trainer_logp.float() - batch.behaviour.float(), 0.0)
    k3 = torch.expm1(d) - d
    newest = torch.where(mask, batch.versions, -1).max()
    ratio = torch.exp(d)
    names, sums, counts = [], [], []

    def mean_over(name: str, where: torch.Tensor) -> None:
        names.append(name)
        sums.append(torch.where(where, k3, 0.0).sum())
        counts.append(where.sum().float())

    mean_over("mismatch/k3", mask)
    mean_over("mismatch/k3_fresh", mask & (batch.versions == newest))
    turn, position = _turns_and_positions(batch)
    for k in range(1, MAX_TURN + 1):
        mean_over(f"mismatch/k3_turn{k}{'+' if k == MAX_TURN else ''}",
                  mask & ((turn == k) if k < MAX_TURN else (turn >= k)))
    lows = (0, *POSITION_EDGES)
    for lo, hi in zip(lows, (*POSITION_EDGES, None)):
        where = mask & (position >= lo)
        mean_over(f"mismatch/k3_pos{lo}-{hi if hi is not None else 'inf'}", where if hi is None else where & (position < hi))
    n = mask.sum()
    ordered = torch.sort(torch.where(mask, ratio, float("inf"))).values  # valid ratios first, in order
    extra = [d.abs().max()]
    extra += [ordered[((n - 1).clamp_min(0).float() * q).round().long()] for q in (0.01, 0.5, 0.99)]
    if loss.tis_cap is not None:
        lower, upper = loss.rollout_is_bounds if loss.rollout_is_mode == "mask" else (0.0, loss.tis_cap)
        extra.append((((ratio < lower) | (ratio > upper)) & mask).sum() / n.clamp_min(1))
    values = torch.stack([*sums, *counts, *[x.float() for x in extra], n.float()]).tolist()  # the one transfer
    if not values[-1]:
        return {}
    k = len(names)
    out = {name: s / c for name, s, c in zip(names, values[:k], values[k:2 * k]) if c}
    tail = values[2 * k:-1]
    out["mismatch/max_abs_logp_diff"] = tail[0]
    out.update({"mismatch/ratio_p01": tail[1], "mismatch/ratio_p50": tail[2], "mismatch/ratio_p99": tail[3]})
    if loss.tis_cap is not None:
        out["mismatch/outside_bounds_frac"] = tail[4]
    return out


def _turns_and_positions(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """[N] each row's turn (1 + the policy runs before it in its sequence; 0 before the first) and its
    position in its sequence (rows from the sequence's start)."""
    mask, seq = batch.mask, batch.seq_of_row
    n = len(mask)
    index = torch.arange(n, device=mask.device)
    lens = torch.tensor(batch.seq_lens, dtype=torch.long, device=mask.device)
    starts = torch.cumsum(lens, 0) - lens  # [S]
    position = index - starts[seq]
    prev = torch.cat([torch.zeros(1, dtype=torch.bool, device=mask.device), mask[:-1]])
    begins = mask & (~prev | (position == 0))  # a run starts (a new sequence resets it)
    runs = torch.cumsum(begins.long(), 0)
    before = torch.where(starts > 0, runs[(starts - 1).clamp_min(0)], 0)  # runs of earlier sequences
    return runs - before[seq], position
