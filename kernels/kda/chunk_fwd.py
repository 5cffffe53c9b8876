"""KDA chunk forward in Triton: fla's four-stage design (cumsum -> intra-chunk with the UT/WY
transform -> the only serial loop, over chunks -> output), with states emitted at requested
positions. Math and notation: kernels/kda/naive.py (`naive_chunk_kda`); building blocks:
kernels/kda/chunk_intra.py.

A call is cut into segments of at most BT = 64 tokens: at multiples of 64 and at every requested
state position (the prefix cache's checkpoints), so the state at a position is exact without
padding. The host computes the cut (`segment_plan`) from Python ints: no device sync. Stages:

  1. `_cumsum_kernel`   (segment, b*h, K block): G = in-segment cumsum(g), fp32.
  2. `intra_kernel`    (segment, b*h): A_kk = beta * gram(k, k) (strict), A_qk = scale * gram(q, k),
                        T = (I + A_kk)^{-1} (UT transform, by 16 x 16 blocks in place in `ai`),
                        w = T (beta k e^G), u = T (beta v), qg = scale q e^G, kg = k e^(G_last - G).
                        All segments in parallel.
  3. `_state_kernel`    (b*h, V block): the serial walk. v_new = u - w S; S <- e^G_last S + kg^T v_new;
                        S stored at every segment start (hs), at requested positions and at the end.
  4. `_output_kernel`   (segment, b*h, V block): o = qg S_start + A_qk v_new. All segments in parallel.

Everything is saved for the backward (chunk_bwd.py): memory linear in T. fp32 inputs keep fp32
workspaces and 'ieee' dots (the interpreter tests compare with the naive twin at 1e-5); bf16/fp16
inputs keep bf16 workspaces and bf16 tensor-core dots with fp32 accumulation, fp32 gates and states.
Lengths are never specialised on (`do_not_specialize`), so odd T does not compile new variants.
Never run on a GPU yet: tools/gpu_check.sh measures it against fla's chunk_kda.
"""

import functools

import torch
import triton
import triton.language as tl

from kernels.impl import gpu_autotune
from kernels.kda.chunk_intra import block_inverse, gram_tile, mm, row_tile, segment_program, state_program

BT = 64  # tokens per segment
BC = 16  # tokens per sub-chunk (tl.dot needs every dimension >= 16)


@triton.jit(do_not_specialize=["NS", "T"])
def _cumsum_kernel(g_ptr, G_ptr, seg_ptr, NS, T, H, K, BT: tl.constexpr, BK: tl.constexpr):
    s, bh, b, h, L, t, valid, row0, rows = segment_program(seg_ptr, NS, T, H, BT)
    c = tl.program_id(2) * BK + tl.arange(0, BK)
    cm = c < K
    G = tl.cumsum(row_tile(g_ptr, rows, valid, c, cm, K), axis=0)  # [BT, BK]
    tl.store(G_ptr + rows[:, None] * K + c[None, :], G, mask=valid[:, None] & cm[None, :])


@triton.jit(do_not_specialize=["NS", "T"])
def intra_kernel(q_ptr, k_ptr, v_ptr, beta_ptr, G_ptr, seg_ptr,
                  ai_ptr, aqk_ptr, w_ptr, u_ptr, qg_ptr, kg_ptr,
                  scale, NS, T, H, K, V,
                  BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT_BF16: tl.constexpr):
    s, bh, b, h, L, t, valid, row0, rows = segment_program(seg_ptr, NS, T, H, BT)
    beta = tl.load(beta_ptr + rows, mask=valid, other=0.0).to(tl.float32)  # [BT]
    A_kk = beta[:, None] * gram_tile(k_ptr, k_ptr, G_ptr, row0, H, t, valid, L, K, True, BT, BC, BK, DOT_BF16)
    A_qk = scale * gram_tile(q_ptr, k_ptr, G_ptr, row0, H, t, valid, L, K, False, BT, BC, BK, DOT_BF16)
    tile = rows[:, None] * BT + t[None, :]
    tl.store(aqk_ptr + tile, A_qk, mask=valid[:, None])
    tl.store(ai_ptr + tile, A_kk, mask=valid[:, None])
    tl.debug_barrier()  # A_kk visible to every thread of this program
    block_inverse(ai_ptr, row0, H, L, BT, BC)  # in place: (I + A_kk)^{-1}, the UT transform
    tl.debug_barrier()
    Ai = tl.load(ai_ptr + tile, mask=valid[:, None], other=0.0)  # [BT, BT]
    for c0 in range(0, K, BK):
        c = c0 + tl.arange(0, BK)
        cm = c < K
        m2 = valid[:, None] & cm[None, :]
        G = row_tile(G_ptr, rows, valid, c, cm, K)  # [BT, BK]
        G_last = tl.load(G_ptr + (row0 + (L - 1) * H) * K + c, mask=cm, other=0.0)  # [BK]
        k = row_tile(k_ptr, rows, valid, c, cm, K)
        w = mm(Ai, beta[:, None] * k * tl.exp(G), DOT_BF16)  # [BT, BK]
        tl.store(w_ptr + rows[:, None] * K + c[None, :], w.to(w_ptr.dtype.element_ty), mask=m2)
        qg = scale * row_tile(q_ptr, rows, valid, c, cm, K) * tl.exp(G)
        tl.store(qg_ptr + rows[:, None] * K + c[None, :], qg.to(qg_ptr.dtype.element_ty), mask=m2)
        kg = k * tl.exp(tl.where(m2, G_last[None, :] - G, 0.0))
        tl.store(kg_ptr + rows[:, None] * K + c[None, :], kg.to(kg_ptr.dtype.element_ty), mask=m2)
    for v0 in range(0, V, BV):
        cv = v0 + tl.arange(0, BV)
        vm = cv < V
        u = mm(Ai, beta[:, None] * row_tile(v_ptr, rows, valid, cv, vm, V), DOT_BF16)  # [BT, BV]
        tl.store(u_ptr + rows[:, None] * V + cv[None, :], u.to(u_ptr.dtype.element_ty), mask=valid[:, None] & vm[None, :])


@gpu_autotune(key=["K", "V"])
@triton.jit(do_not_specialize=["NS", "T", "P"])
def _state_kernel(w_ptr, u_ptr, kg_ptr, G_ptr, h0_ptr, seg_ptr,
                  hs_ptr, vnew_ptr, pos_ptr, final_ptr,
                  NS, T, H, K, V, P,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  HAS_INITIAL: tl.constexpr, DOT_BF16: tl.constexpr):
    bh, b, h, cv, vm, c, cm, t, s_offs, s_mask = state_program(H, K, V, BT, BK, BV)  # s_offs: [BK, BV]
    if HAS_INITIAL:
        S = tl.load(h0_ptr + bh * K * V + s_offs, mask=s_mask, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    for s in range(NS):
        start, L, slot = tl.load(seg_ptr + s), tl.load(seg_ptr + NS + s), tl.load(seg_ptr + 2 * NS + s)
        valid = t < L
        row0 = (b * T + start) * H + h
        rows = row0 + t * H
        tl.store(hs_ptr + ((b * NS + s) * H + h) * K * V + s_offs, S.to(hs_ptr.dtype.element_ty), mask=s_mask)
        w = row_tile(w_ptr, rows, valid, c, cm, K)  # [BT, BK]
        v_new = row_tile(u_ptr, rows, valid, cv, vm, V) - mm(w, S, DOT_BF16)  # [BT, BV]
        tl.store(vnew_ptr + rows[:, None] * V + cv[None, :], v_new.to(vnew_ptr.dtype.element_ty),
                 mask=valid[:, None] & vm[None, :])
        kg = row_tile(kg_ptr, rows, valid, c, cm, K)
        G_last = tl.load(G_ptr + (row0 + (L - 1) * H) * K + c, mask=cm, other=0.0)  # [BK]
        S = tl.exp(G_last)[:, None] * S + mm(tl.trans(kg), v_new, DOT_BF16)
        if slot >= 0:
            tl.store(pos_ptr + ((b * P + slot) * H + h) * K * V + s_offs, S, mask=s_mask)
    tl.store(final_ptr + bh * K * V + s_offs, S, mask=s_mask)


@gpu_autotune(key=["K", "V"])
@triton.jit(do_not_specialize=["NS", "T"])
def _output_kernel(qg_ptr, aqk_ptr, vnew_ptr, hs_ptr, seg_ptr, o_ptr, NS, T, H, K, V,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT_BF16: tl.constexpr):
    s, bh, b, h, L, t, valid, row0, rows = segment_program(seg_ptr, NS, T, H, BT)
    cv = tl.program_id(2) * BV + tl.arange(0, BV)
    vm = cv < V
    state = ((b * NS + s) * H + h) * K * V
    o = tl.zeros([BT, BV], dtype=tl.float32)
    for c0 in range(0, K, BK):
        c = c0 + tl.arange(0, BK)
        cm = c < K
        S = tl.load(hs_ptr + state + c[:, None] * V + cv[None, :], mask=cm[:, None] & vm[None, :], other=0.0)
        o += mm(row_tile(qg_ptr, rows, valid, c, cm, K), S, DOT_BF16)  # from the segment's start state
    A_qk = tl.load(aqk_ptr + rows[:, None] * BT + t[None, :], mask=valid[:, None], other=0.0)  # [BT, BT]
    o += mm(A_qk, row_tile(vnew_ptr, rows, valid, cv, vm, V), DOT_BF16)  # ... plus this segment's writes
    tl.store(o_ptr + rows[:, None] * V + cv[None, :], o.to(o_ptr.dtype.element_ty), mask=valid[:, None] & vm[None, :])


@functools.lru_cache(maxsize=512)
def segment_plan(T: int, positions: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """(starts, lengths, slots) of the segments: cut at multiples of BT, at each position p > 0
    and at T; slot = index in `positions` of the position a segment ends at, else -1."""
    ends = sorted(set(range(BT, T, BT)) | {p for p in positions if p > 0} | ({T} if T > 0 else set()))
    starts = [0, *ends[:-1]]
    slot_of = {p: i for i, p in enumerate(positions)}
    return tuple(starts), tuple(e - s for s, e in zip(starts, ends)), tuple(slot_of.get(e, -1) for e in ends)


def segment_tensor(T: int, positions: tuple[int, ...], device) -> tuple[torch.Tensor, int]:
    """The plan as one [3 * NS] int32 tensor (starts, lengths, slots) on `device`, and NS. On CUDA it
    goes through pinned memory with a non-blocking copy: a pageable copy would wait for the stream
    (a host sync in every prefill)."""
    starts, lengths, slots = segment_plan(T, positions)
    values = starts + lengths + slots
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=torch.int32, device=device), len(starts)
    host = torch.tensor(values, dtype=torch.int32, pin_memory=True)
    return host.to(device, non_blocking=True), len(starts)


def workspace_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype == torch.float32 else torch.bfloat16


def chunk_kda_fwd(q, k, v, g, beta, scale, initial_state, positions):
    """Runs the four stages on contiguous [B, T, H, *] inputs (T > 0, B * H > 0).

    Returns o [B, T, H, V] (q's dtype), final_state [B, H, K, V] fp32, position_states
    [B, P, H, K, V] fp32, and `saved`, the dict of workspaces the backward reads.
    """
    B, T, H, K = q.shape
    V, P, dev = v.shape[3], len(positions), q.device
    wdt = workspace_dtype(q.dtype)
    bf16 = wdt != torch.float32
    seg, NS = segment_tensor(T, positions, dev)
    BK, BV = max(16, triton.next_power_of_2(K)), max(16, min(64, triton.next_power_of_2(V)))
    BKb = min(BK, 64)  # K block of the parallel stages
    G = torch.empty(B, T, H, K, dtype=torch.float32, device=dev)
    _cumsum_kernel[(NS, B * H, triton.cdiv(K, BKb))](g, G, seg, NS, T, H, K, BT=BT, BK=BKb)
    ai = torch.empty(B, T, H, BT, dtype=torch.float32, device=dev)
    aqk = torch.empty_like(ai)
    w, qg, kg = (torch.empty(B, T, H, K, dtype=wdt, device=dev) for _ in range(3))
    u, v_new = (torch.empty(B, T, H, V, dtype=wdt, device=dev) for _ in range(2))
    intra_kernel[(NS, B * H)](q, k, v, beta, G, seg, ai, aqk, w, u, qg, kg, float(scale), NS, T, H, K, V,
                               BT=BT, BC=BC, BK=BKb, BV=BV, DOT_BF16=bf16)
    hs = torch.empty(B, NS, H, K, V, dtype=wdt, device=dev)
    pos = torch.zeros(B, P, H, K, V, dtype=torch.float32, device=dev)
    final = torch.empty(B, H, K, V, dtype=torch.float32, device=dev)
    has_initial = initial_state is not None
    h0 = initial_state.to(torch.float32).contiguous() if has_initial else final
    if P and positions[0] == 0 and has_initial:
        pos[:, 0] = h0  # position 0 is the state before any token
    _state_kernel[(B * H, triton.cdiv(V, BV))](w, u, kg, G, h0, seg, hs, v_new, pos, final, NS, T, H, K, V, P,
                                               BT=BT, BK=BK, BV=BV, HAS_INITIAL=has_initial, DOT_BF16=bf16)
    o = torch.empty(B, T, H, V, dtype=q.dtype, device=dev)
    _output_kernel[(NS, B * H, triton.cdiv(V, BV))](qg, aqk, v_new, hs, seg, o, NS, T, H, K, V,
                                                    BT=BT, BK=BKb, BV=BV, DOT_BF16=bf16)
    saved = dict(G=G, ai=ai, aqk=aqk, w=w, u=u, qg=qg, kg=kg, v_new=v_new, hs=hs, seg=seg, NS=NS)
    return o, final, pos, saved


TRITON_KERNELS = {"kda_chunk_cumsum": _cumsum_kernel, "kda_chunk_intra": intra_kernel,
                  "kda_chunk_state": _state_kernel, "kda_chunk_output": _output_kernel}
