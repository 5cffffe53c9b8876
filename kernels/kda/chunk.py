"""Chunked KDA prefill that also emits the states at requested token positions.

Same contract as `naive_chunk_kda` (kernels/kda/naive.py, which derives the WY/UT form used
here). `impl="naive"` calls it; `impl="triton"` runs one Triton program per (sequence, head,
block of value columns). Each value column of the state S [K, V] evolves independently, so
splitting V is exact; a program keeps its block S[:, v-block] in registers and walks the
sequence segment by segment. Segments are cut, as in the naive form, at multiples of the
chunk and at every requested position (so the state there is exact without padding); the
host computes the cuts and passes them as tensors.

Within a segment of L <= BT tokens starting from state S, with G = cumsum(g) ([L, K]) and
every decay taken as a difference exp(G_i - G_j), j <= i (never exp(G_i) * exp(-G_j), which
overflows under strong decay):

    A[i, j]  = beta_i <k_i, k_j * exp(G_i - G_j)>   for j < i       (strictly lower)
    T_inv    = (I + A)^{-1}                          by forward substitution
    u, w     = T_inv (beta v), T_inv (beta k exp(G))
    v_new    = u - w S                               (the delta actually written)
    o        = (scale q exp(G)) S + tril(scale q_i . (k_j exp(G_i - G_j))) v_new
    S       <- exp(G_L) S + (k exp(G_L - G))^T v_new

The Triton path uses its own chunk of BT = 16 tokens whatever chunk_len says (it only
validates it): the cut points differ from the naive path's, the results are the same math.
The pairwise decays form a [BT, BT, K] intermediate, which is why BT stays small.
"""

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.impl import check_impl, require_triton
from kernels.kda.naive import _check_inputs, _segment_ends, naive_chunk_kda

_BT = 16  # tokens per segment on the Triton path; tl.dot needs every dim >= 16


@triton.jit
def _chunk_kda_kernel(
    q_ptr,  # [B, T, H, K] contiguous
    k_ptr,  # [B, T, H, K] contiguous
    v_ptr,  # [B, T, H, V] contiguous
    g_ptr,  # [B, T, H, K] contiguous
    beta_ptr,  # [B, T, H] contiguous
    h0_ptr,  # [B, H, K, V] fp32 contiguous; read only if HAS_INITIAL
    seg_starts_ptr,  # [num_segments] int32 first token of each segment
    seg_ends_ptr,  # [num_segments] int32 one past its last token
    seg_slots_ptr,  # [num_segments] int32 index into position states, -1 if not requested
    o_ptr,  # [B, T, H, V] contiguous, q's dtype
    final_ptr,  # [B, H, K, V] fp32 contiguous
    pos_states_ptr,  # [B, P, H, K, V] fp32 contiguous
    scale,
    T,
    H,
    K,
    V,
    P,
    num_segments,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_INITIAL: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cols = tl.program_id(2) * BV + tl.arange(0, BV)  # [BV] value columns of this program
    col_mask = cols < V
    chans = tl.arange(0, BK)  # [BK] key channels
    chan_mask = chans < K
    ts = tl.arange(0, BT)  # [BT] token offsets within a segment
    causal = ts[:, None] >= ts[None, :]  # [BT, BT] j <= i
    strict = ts[:, None] > ts[None, :]  # [BT, BT] j < i
    eye = tl.where(ts[:, None] == ts[None, :], 1.0, 0.0)  # [BT, BT]

    state_offs = chans[:, None] * V + cols[None, :]  # [BK, BV] within one [K, V] state
    state_mask = chan_mask[:, None] & col_mask[None, :]
    head_state = (b * H + h) * K * V
    if HAS_INITIAL:
        S = tl.load(h0_ptr + head_state + state_offs, mask=state_mask, other=0.0)  # [BK, BV]
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)

    for s in range(num_segments):
        start = tl.load(seg_starts_ptr + s)
        seg_len = tl.load(seg_ends_ptr + s) - start
        tok_mask = ts < seg_len  # [BT]
        rows = (b * T + start + ts) * H + h  # [BT] row index into [B * T * H, *]
        qk_mask = tok_mask[:, None] & chan_mask[None, :]
        q = tl.load(q_ptr + rows[:, None] * K + chans[None, :], mask=qk_mask, other=0.0)
        k = tl.load(k_ptr + rows[:, None] * K + chans[None, :], mask=qk_mask, other=0.0)
        g = tl.load(g_ptr + rows[:, None] * K + chans[None, :], mask=qk_mask, other=0.0)
        v = tl.load(
            v_ptr + rows[:, None] * V + cols[None, :],
            mask=tok_mask[:, None] & col_mask[None, :],
            other=0.0,
        )  # [BT, BV]
        beta = tl.load(beta_ptr + rows, mask=tok_mask, other=0.0).to(tl.float32)  # [BT]
        q = q.to(tl.float32) * scale  # [BT, BK]; padded tokens and channels are 0
        k = k.to(tl.float32)  # [BT, BK]
        v = v.to(tl.float32)
        G = tl.cumsum(g.to(tl.float32), axis=0)  # [BT, BK]; padded g = 0 keeps G finite
        G_last = tl.sum(tl.where((ts == seg_len - 1)[:, None], G, 0.0), axis=0)  # [BK]

        # Pairwise decay exp(G_i - G_j), j <= i, as one difference; j > i gives exp(-inf) = 0.
        diff = G[:, None, :] - G[None, :, :]  # [BT(i), BT(j), BK]
        decay = tl.exp(tl.where(causal[:, :, None], diff, float("-inf")))
        kk = tl.sum(k[:, None, :] * k[None, :, :] * decay, axis=2)  # [BT, BT]
        qk = tl.sum(q[:, None, :] * k[None, :, :] * decay, axis=2)  # [BT, BT] incl. diagonal
        A = tl.where(strict, beta[:, None] * kk, 0.0)  # [BT, BT] strictly lower

        # (I + A) T_inv = I row by row: T_inv_i = e_i - sum_{j<i} A[i, j] T_inv_j. Row i of A
        # is zero at j >= i, so only rows already solved contribute.
        T_inv = eye  # [BT, BT]
        for i in tl.static_range(1, BT):
            a_i = tl.sum(tl.where(ts[:, None] == i, A, 0.0), axis=0)  # [BT] row i of A
            e_i = tl.where(ts == i, 1.0, 0.0)  # [BT]
            row_i = e_i - tl.sum(a_i[:, None] * T_inv, axis=0)  # [BT]
            T_inv = tl.where(ts[:, None] == i, row_i[None, :], T_inv)

        u = tl.dot(T_inv, beta[:, None] * v, input_precision="ieee")  # [BT, BV]
        w = tl.dot(T_inv, beta[:, None] * k * tl.exp(G), input_precision="ieee")  # [BT, BK]
        v_new = u - tl.dot(w, S, input_precision="ieee")  # [BT, BV]
        o = tl.dot(q * tl.exp(G), S, input_precision="ieee")  # [BT, BV] from the old state
        o += tl.dot(qk, v_new, input_precision="ieee")  # ... plus this segment's writes
        tl.store(
            o_ptr + rows[:, None] * V + cols[None, :],
            o.to(o_ptr.dtype.element_ty),
            mask=tok_mask[:, None] & col_mask[None, :],
        )

        # Padded tokens have k = 0 and v_new = 0, so they add nothing to the state.
        k_to_end = k * tl.exp(G_last[None, :] - G)  # [BT, BK]
        S = tl.exp(G_last)[:, None] * S + tl.dot(tl.trans(k_to_end), v_new, input_precision="ieee")

        slot = tl.load(seg_slots_ptr + s)
        if slot >= 0:
            slot_state = ((b * P + slot) * H + h) * K * V
            tl.store(pos_states_ptr + slot_state + state_offs, S, mask=state_mask)

    tl.store(final_ptr + head_state + state_offs, S, mask=state_mask)


def _segments(T: int, positions: tuple[int, ...], device) -> tuple[Tensor, Tensor, Tensor]:
    """Segment starts, ends and position-state slots ([num_segments] int32 each) for BT."""
    ends = _segment_ends(T, _BT, positions)
    starts = [0] + ends[:-1]
    slot_of = {p: i for i, p in enumerate(positions)}
    slots = [slot_of.get(end, -1) for end in ends]
    return tuple(torch.tensor(x, dtype=torch.int32, device=device) for x in (starts, ends, slots))


def _chunk_kda_triton(q, k, v, g, beta, scale, initial_state, positions):
    B, T, H, K = q.shape
    V = v.shape[3]
    device = q.device
    require_triton(_chunk_kda_kernel, device)
    P = len(positions)
    o = torch.empty(B, T, H, V, dtype=q.dtype, device=device)  # [B, T, H, V]
    final_state = torch.empty(B, H, K, V, dtype=torch.float32, device=device)  # [B, H, K, V]
    position_states = torch.zeros(B, P, H, K, V, dtype=torch.float32, device=device)
    has_initial = initial_state is not None
    if has_initial:
        initial_state = initial_state.to(torch.float32).contiguous()  # [B, H, K, V]
    if P and positions[0] == 0 and has_initial:
        position_states[:, 0] = initial_state  # position 0 is the state before any token
    if B == 0 or H == 0:
        return o, final_state, position_states
    starts, ends, slots = _segments(T, positions, device)
    block_v = min(32, max(16, triton.next_power_of_2(V)))
    grid = (B, H, triton.cdiv(V, block_v))
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    _chunk_kda_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        initial_state if has_initial else final_state,  # dummy pointer when not read
        starts,
        ends,
        slots,
        o,
        final_state,
        position_states,
        float(scale),
        T,
        H,
        K,
        V,
        P,
        len(ends),
        BT=_BT,
        BK=max(16, triton.next_power_of_2(K)),
        BV=block_v,
        HAS_INITIAL=has_initial,
    )
    return o, final_state, position_states


def chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    state_positions: Sequence[int] = (),
    chunk_len: int = 64,
    impl: str = "naive",
) -> tuple[Tensor, Tensor, Tensor]:
    """Chunked KDA over B sequences of T tokens; same contract as `naive_chunk_kda`.

    Args:
        q, k: [B, T, H, K], already L2-normalised over K.
        v: [B, T, H, V].
        g: [B, T, H, K] per-channel log-decay.
        beta: [B, T, H] delta-rule write strength.
        scale: query scale, default K ** -0.5.
        initial_state: [B, H, K, V] state before token 0, or None for zeros. Not mutated.
        state_positions: strictly increasing ints p in [0, T]; the state after the first p
            tokens is returned for each (p = 0 gives the initial state).
        chunk_len: segment length of the naive path; the Triton path validates it but uses
            its own 16-token chunk (same results up to fp32 rounding).
        impl: "naive" or "triton" (see module docstring).

    Returns (all new tensors):
        o: [B, T, H, V] in q's dtype (math in fp32).
        final_state: [B, H, K, V] fp32.
        position_states: [B, P, H, K, V] fp32, P = len(state_positions).

    Raises ValueError on bad shapes, positions, chunk_len or impl; RuntimeError if
    impl="triton" cannot run here.
    """
    check_impl(impl)
    if impl != "triton":  # "naive", or "cpu" (no fused CPU version of this one)
        return naive_chunk_kda(
            q,
            k,
            v,
            g,
            beta,
            scale=scale,
            initial_state=initial_state,
            state_positions=state_positions,
            chunk_len=chunk_len,
        )
    (B, T, H, K, V), positions = _check_inputs(q, k, v, g, beta, initial_state, state_positions)
    if isinstance(chunk_len, bool) or not isinstance(chunk_len, int) or chunk_len < 1:
        raise ValueError(f"chunk_len must be a positive int, got {chunk_len!r}")
    scale = K**-0.5 if scale is None else scale
    return _chunk_kda_triton(q, k, v, g, beta, scale, initial_state, positions)
