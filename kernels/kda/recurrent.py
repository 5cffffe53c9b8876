"""Token-by-token KDA in as few torch ops per token as possible: the CPU engine's prefill form
for wide batches of short prompts (see models/paged.py `torch_prefill_form`).

Same recurrence as `naive_recurrent_kda` (its reference twin, tests/kernels/test_kda_recurrent.py):
everything that does not depend on the state (decays, scaled queries, beta) is computed for all
tokens up front, and the loop body is five batched matmul-class ops on a [B*H, K, V] state
updated in place — versus ~20 small ops per token in the reference.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kernels.kda.naive import check_inputs


def recurrent_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float | None = None,
                  initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """q, k: [B, T, H, K] (L2-normalised); v: [B, T, H, V]; g: [B, T, H, K]; beta: [B, T, H];
    initial_state: [B, H, K, V] or None (zeros), not mutated.
    Returns (o [B, T, H, V] in q's dtype, final state [B, H, K, V] fp32)."""
    o, final, _ = recurrent_kda_states(q, k, v, g, beta, scale=scale, initial_state=initial_state)
    return o, final


def recurrent_kda_states(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float | None = None,
                         initial_state: Tensor | None = None, state_positions: Sequence[int] = ()
                         ) -> tuple[Tensor, Tensor, Tensor]:
    """`recurrent_kda`, plus the state after the first p tokens for each p of `state_positions` (strictly
    increasing, in [0, T]; p = 0 is the initial state), as `chunk_kda` returns them: position_states
    [B, P, H, K, V] fp32 (speculative verification keeps one per verified position, to roll back to)."""
    (B, T, H, K, V), positions = check_inputs(q, k, v, g, beta, initial_state, state_positions)
    scale = K**-0.5 if scale is None else scale
    f32 = torch.float32
    # Token-major, (batch, head)-flattened layouts so each step reads contiguous slices.
    decay = g.to(f32).exp().permute(1, 0, 2, 3).reshape(T, B * H, K, 1)  # [T, BH, K, 1]
    k_cols = k.to(f32).permute(1, 0, 2, 3).reshape(T, B * H, K, 1)  # [T, BH, K, 1]
    q_rows = (q.to(f32) * scale).permute(1, 0, 2, 3).reshape(T, B * H, 1, K)  # [T, BH, 1, K]
    v_rows = v.to(f32).permute(1, 0, 2, 3).reshape(T, B * H, 1, V)  # [T, BH, 1, V]
    beta_t = beta.to(f32).permute(1, 0, 2).reshape(T, B * H, 1, 1)  # [T, BH, 1, 1]
    if initial_state is None:
        S = torch.zeros(B * H, K, V, dtype=f32, device=q.device)
    else:
        S = initial_state.to(f32).reshape(B * H, K, V).clone()  # [BH, K, V], never the caller's
    kept = torch.empty(len(positions), B * H, K, V, dtype=f32, device=q.device)  # [P, BH, K, V]
    slot = {p: i for i, p in enumerate(positions)}
    if 0 in slot:
        kept[slot[0]] = S
    o = torch.empty(T, B * H, 1, V, dtype=f32, device=q.device)
    for t in range(T):
        S.mul_(decay[t])  # decay each key channel (row of S)
        delta = (v_rows[t] - torch.bmm(k_cols[t].transpose(1, 2), S)).mul_(beta_t[t])  # [BH, 1, V]
        S.baddbmm_(k_cols[t], delta)  # rank-1 write k delta^T
        torch.bmm(q_rows[t], S, out=o[t])
        if t + 1 in slot:
            kept[slot[t + 1]] = S
    position_states = kept.view(len(positions), B, H, K, V).transpose(0, 1)  # [B, P, H, K, V]
    return o.view(T, B, H, V).transpose(0, 1).to(q.dtype), S.view(B, H, K, V), position_states
