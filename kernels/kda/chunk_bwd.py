"""KDA chunk backward in Triton: gradients of q, k, v, g, beta and the initial state from those of
o, the final state and the position states, reading the forward's workspaces (chunk_fwd.py).

Per segment (notation of kernels/kda/naive.py; S0/S1 the states before/after it, T = (I + A)^{-1},
X = beta k e^G, Y = beta v, w = T X, u = T Y, v_new = u - w S0, P = scale gram(q, k),
o = Qg S0 + P v_new, S1 = e^G_last S0 + Kg^T v_new), reverse-mode gives

    dv_new = P^T dO + Kg dS1                      dS0 = e^G_last dS1 + Qg^T dO - w^T dv_new
    dX = T^T (-dv_new S0^T)   dY = T^T dv_new     dA = -(dX w^T + dY u^T)   (strictly lower)
    dP = dO v_new^T (lower)   dQg = dO S0^T       dKg = v_new dS1^T

(dA uses dT = -T^T dT_out T^T, folded: dX w^T = T^T dw X^T T^T). The pairwise-decay products of dA
and dP with k and q (`decay_row` / `decay_col`, chunk_intra.py) give the row- and column-role
gradients; the gate gradient dG sums every term's d/dG, and dg is its reverse cumsum in the segment.

Three kernels: `_dstate_kernel` (b*h, V block) walks the segments backwards (the only serial loop)
storing dS1 per segment and dv_new; then for all segments in parallel `_grad_a_kernel` (segment,
b*h) forms dA, dP and dX (to scratch) and dv, and `_grad_k_kernel` (segment, b*h, K block) the
pairwise-decay products and dq, dk, dg, dbeta. Tiles stay within [64, 64] x blocks of K or V (at
most 64 wide). Never run on a GPU yet.
"""

import torch
import triton
import triton.language as tl

from kernels.impl import gpu_autotune
from kernels.kda.chunk_fwd import BC, BT
from kernels.kda.chunk_intra import decay_col, decay_row, mm, row_tile, segment_program, state_program


@gpu_autotune(key=["K", "V"])
@triton.jit(do_not_specialize=["NS", "T", "P"])
def _dstate_kernel(do_ptr, aqk_ptr, qg_ptr, kg_ptr, w_ptr, G_ptr, seg_ptr, dfinal_ptr, dpos_ptr,
                   ds1_ptr, dvnew_ptr, dh0_ptr, NS, T, H, K, V, P,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT_BF16: tl.constexpr):
    bh, b, h, cv, vm, c, cm, t, s_offs, s_mask = state_program(H, K, V, BT, BK, BV)  # s_offs: [BK, BV]
    dh = tl.load(dfinal_ptr + bh * K * V + s_offs, mask=s_mask, other=0.0)  # [BK, BV] d(state after the segment)
    for i in range(NS):
        s = NS - 1 - i
        start, L, slot = tl.load(seg_ptr + s), tl.load(seg_ptr + NS + s), tl.load(seg_ptr + 2 * NS + s)
        if slot >= 0:  # the state after this segment was also returned at a position
            dh += tl.load(dpos_ptr + ((b * P + slot) * H + h) * K * V + s_offs, mask=s_mask, other=0.0)
        tl.store(ds1_ptr + ((b * NS + s) * H + h) * K * V + s_offs, dh, mask=s_mask)
        valid = t < L
        row0 = (b * T + start) * H + h
        rows = row0 + t * H
        dO = row_tile(do_ptr, rows, valid, cv, vm, V)  # [BT, BV]
        A_qk = tl.load(aqk_ptr + rows[:, None] * BT + t[None, :], mask=valid[:, None], other=0.0)  # [BT, BT]
        kg = row_tile(kg_ptr, rows, valid, c, cm, K)  # [BT, BK]
        dv_new = mm(tl.trans(A_qk), dO, DOT_BF16) + mm(kg, dh, DOT_BF16)  # [BT, BV]
        tl.store(dvnew_ptr + rows[:, None] * V + cv[None, :], dv_new, mask=valid[:, None] & vm[None, :])
        G_last = tl.load(G_ptr + (row0 + (L - 1) * H) * K + c, mask=cm, other=0.0)  # [BK]
        qg = row_tile(qg_ptr, rows, valid, c, cm, K)
        w = row_tile(w_ptr, rows, valid, c, cm, K)
        dh = tl.exp(G_last)[:, None] * dh + mm(tl.trans(qg), dO, DOT_BF16) - mm(tl.trans(w), dv_new, DOT_BF16)
    tl.store(dh0_ptr + bh * K * V + s_offs, dh, mask=s_mask)


@triton.jit
def _state_tile(ptr, b, s, h, NS, H, K, V, c, cm, cv, vm):
    """[BK, BV] fp32 tile of a [B, NS, H, K, V] per-segment state tensor."""
    offs = ((b * NS + s) * H + h) * K * V + c[:, None] * V + cv[None, :]
    return tl.load(ptr + offs, mask=cm[:, None] & vm[None, :], other=0.0).to(tl.float32)


@triton.jit
def _store_rows(ptr, rows, valid, c, cm, width, x):
    tl.store(ptr + rows[:, None] * width + c[None, :], x.to(ptr.dtype.element_ty), mask=valid[:, None] & cm[None, :])


@triton.jit(do_not_specialize=["NS", "T"])
def _grad_a_kernel(v_ptr, beta_ptr, ai_ptr, w_ptr, u_ptr, vnew_ptr, hs_ptr, do_ptr, dvnew_ptr, seg_ptr,
                   dA_ptr, dP_ptr, dx_ptr, dv_ptr, dbeta_ptr, NS, T, H, K, V,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT_BF16: tl.constexpr):
    """Per (segment, head): dA, dP ([BT, BT], to scratch), dX (to scratch), dv and the dY part of
    dbeta, looping over K and V blocks so no tile is larger than [BT, max(BK, BV)]."""
    s, bh, b, h, L, t, valid, row0, rows = segment_program(seg_ptr, NS, T, H, BT)
    state = ((b * NS + s) * H + h) * K * V
    beta = tl.load(beta_ptr + rows, mask=valid, other=0.0).to(tl.float32)  # [BT]
    Ai_t = tl.trans(tl.load(ai_ptr + rows[:, None] * BT + t[None, :], mask=valid[:, None], other=0.0))  # T^T
    dA = tl.zeros([BT, BT], dtype=tl.float32)
    dP = tl.zeros([BT, BT], dtype=tl.float32)
    dbeta = tl.zeros([BT], dtype=tl.float32)
    for v0 in range(0, V, BV):
        cv = v0 + tl.arange(0, BV)
        vm = cv < V
        dv_new = row_tile(dvnew_ptr, rows, valid, cv, vm, V)  # [BT, BV]
        dP += mm(row_tile(do_ptr, rows, valid, cv, vm, V), tl.trans(row_tile(vnew_ptr, rows, valid, cv, vm, V)),
                  DOT_BF16)
        dY = mm(Ai_t, dv_new, DOT_BF16)  # [BT, BV]
        dA -= mm(dY, tl.trans(row_tile(u_ptr, rows, valid, cv, vm, V)), DOT_BF16)
        dbeta += tl.sum(dY * row_tile(v_ptr, rows, valid, cv, vm, V), axis=1)
        _store_rows(dv_ptr, rows, valid, cv, vm, V, beta[:, None] * dY)
    for c0 in range(0, K, BK):
        c = c0 + tl.arange(0, BK)
        cm = c < K
        dw = tl.zeros([BT, BK], dtype=tl.float32)  # -dv_new S0^T
        for v0 in range(0, V, BV):
            cv = v0 + tl.arange(0, BV)
            vm = cv < V
            S0 = tl.load(hs_ptr + state + c[:, None] * V + cv[None, :], mask=cm[:, None] & vm[None, :], other=0.0)
            dw -= mm(row_tile(dvnew_ptr, rows, valid, cv, vm, V), tl.trans(S0), DOT_BF16)
        dX = mm(Ai_t, dw, DOT_BF16)  # [BT, BK]
        dA -= mm(dX, tl.trans(row_tile(w_ptr, rows, valid, c, cm, K)), DOT_BF16)
        _store_rows(dx_ptr, rows, valid, c, cm, K, dX)
    pair = valid[:, None] & valid[None, :]
    tile = rows[:, None] * BT + t[None, :]
    tl.store(dA_ptr + tile, tl.where(pair & (t[None, :] < t[:, None]), dA, 0.0), mask=valid[:, None])
    tl.store(dP_ptr + tile, tl.where(pair & (t[None, :] <= t[:, None]), dP, 0.0), mask=valid[:, None])
    tl.store(dbeta_ptr + rows, dbeta, mask=valid)


@triton.jit(do_not_specialize=["NS", "T"])
def _grad_k_kernel(q_ptr, k_ptr, beta_ptr, G_ptr, vnew_ptr, hs_ptr, do_ptr, ds1_ptr, seg_ptr,
                   dA_ptr, dP_ptr, dx_ptr, dq_ptr, dk_ptr, dg_ptr, dbeta_ptr,
                   scale, NS, T, H, K, V,
                   BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT_BF16: tl.constexpr):
    """Per (segment, head, K block): dq, dk, dg and this block's part of dbeta (row k_block of the
    [NKB, B, T, H] dbeta partials), from dA, dP, dX of `_grad_a_kernel`."""
    s, bh, b, h, L, t, valid, row0, rows = segment_program(seg_ptr, NS, T, H, BT)
    kb = tl.program_id(2)
    state = ((b * NS + s) * H + h) * K * V
    c = kb * BK + tl.arange(0, BK)
    cm = c < K
    dQg = tl.zeros([BT, BK], dtype=tl.float32)  # dO S0^T
    dKg = tl.zeros([BT, BK], dtype=tl.float32)  # v_new dS1^T
    last = tl.zeros([BK], dtype=tl.float32)  # rowsum(dS1 * S0)
    for v0 in range(0, V, BV):
        cv = v0 + tl.arange(0, BV)
        vm = cv < V
        s_offs = state + c[:, None] * V + cv[None, :]
        s_mask = cm[:, None] & vm[None, :]
        S0 = tl.load(hs_ptr + s_offs, mask=s_mask, other=0.0).to(tl.float32)  # [BK, BV]
        dS1 = tl.load(ds1_ptr + s_offs, mask=s_mask, other=0.0)
        dQg += mm(row_tile(do_ptr, rows, valid, cv, vm, V), tl.trans(S0), DOT_BF16)
        dKg += mm(row_tile(vnew_ptr, rows, valid, cv, vm, V), tl.trans(dS1), DOT_BF16)
        last += tl.sum(dS1 * S0, axis=1)
    dA = tl.load(dA_ptr + rows[:, None] * BT + t[None, :], mask=valid[:, None], other=0.0)  # [BT, BT]
    dP = tl.load(dP_ptr + rows[:, None] * BT + t[None, :], mask=valid[:, None], other=0.0)
    dX = row_tile(dx_ptr, rows, valid, c, cm, K)  # [BT, BK]
    beta = tl.load(beta_ptr + rows, mask=valid, other=0.0).to(tl.float32)  # [BT]
    G = row_tile(G_ptr, rows, valid, c, cm, K)
    G_last = tl.load(G_ptr + (row0 + (L - 1) * H) * K + c, mask=cm, other=0.0)  # [BK]
    q = row_tile(q_ptr, rows, valid, c, cm, K)
    k = row_tile(k_ptr, rows, valid, c, cm, K)
    Rk = decay_row(dA, k_ptr, G_ptr, G, row0, H, t, valid, L, c, cm, K, BT, BC, DOT_BF16)
    Ck = decay_col(beta[:, None] * dA, k_ptr, G_ptr, G, row0, H, t, valid, L, c, cm, K, BT, BC, DOT_BF16)
    Rq = decay_row(dP, k_ptr, G_ptr, G, row0, H, t, valid, L, c, cm, K, BT, BC, DOT_BF16)
    Cq = decay_col(dP, q_ptr, G_ptr, G, row0, H, t, valid, L, c, cm, K, BT, BC, DOT_BF16)
    eG = tl.exp(G)  # padded rows have G = 0 and zero inputs
    to_end = tl.where(valid[:, None], tl.exp(G_last[None, :] - G), 0.0)  # [BT, BK]
    dq = scale * (Rq + dQg * eG)
    dk = beta[:, None] * (Rk + dX * eG) + Ck + scale * Cq + dKg * to_end
    kg_term = dKg * k * to_end  # d(Kg)/dG_i = -Kg_i, d(Kg)/dG_last = +sum_i Kg_i
    dG = beta[:, None] * k * (Rk + dX * eG) - k * Ck + scale * (q * Rq - k * Cq + dQg * q * eG) - kg_term
    last = tl.exp(G_last) * last + tl.sum(kg_term, axis=0)  # [BK] d/dG_last
    dG = tl.where(valid[:, None], dG, 0.0) + tl.where((t == L - 1)[:, None], last[None, :], 0.0)
    dg = tl.sum(dG, axis=0)[None, :] - tl.cumsum(dG, axis=0) + dG  # reverse cumsum: G = cumsum(g)
    _store_rows(dq_ptr, rows, valid, c, cm, K, dq)
    _store_rows(dk_ptr, rows, valid, c, cm, K, dk)
    _store_rows(dg_ptr, rows, valid, c, cm, K, dg)
    dbeta = tl.sum(k * (Rk + dX * eG), axis=1)  # [BT] this K block's part
    tl.store(dbeta_ptr + kb.to(tl.int64) * (tl.num_programs(1) * T).to(tl.int64) + rows, dbeta, mask=valid)


def chunk_kda_bwd(q, k, v, beta, scale, saved, positions, do, dfinal, dpos):
    """Gradients (dq, dk, dv, dg, dbeta, dh0) of one `chunk_kda_fwd` call, in the inputs' dtypes
    (dh0 fp32). q, k, v, beta, do contiguous [B, T, H, *]; dfinal [B, H, K, V]; dpos [B, P, H, K, V]."""
    B, T, H, K = q.shape
    V, P, dev = v.shape[3], len(positions), q.device
    bf16 = saved["w"].dtype != torch.float32
    seg, NS = saved["seg"], saved["NS"]
    BK, BVs = max(16, triton.next_power_of_2(K)), max(16, min(64, triton.next_power_of_2(V)))
    dfinal = dfinal.to(torch.float32).contiguous()
    dpos = dpos.to(torch.float32).contiguous()
    ds1 = torch.empty(B, NS, H, K, V, dtype=torch.float32, device=dev)
    dv_new = torch.empty(B, T, H, V, dtype=torch.float32, device=dev)
    dh0 = torch.empty(B, H, K, V, dtype=torch.float32, device=dev)
    _dstate_kernel[(B * H, triton.cdiv(V, BVs))](
        do, saved["aqk"], saved["qg"], saved["kg"], saved["w"], saved["G"], seg, dfinal, dpos,
        ds1, dv_new, dh0, NS, T, H, K, V, P, BT=BT, BK=BK, BV=BVs, DOT_BF16=bf16)
    if P and positions[0] == 0:
        dh0 += dpos[:, 0]  # position 0 returned the initial state itself
    BKb, nkb = min(BK, 64), triton.cdiv(K, min(BK, 64))
    dA, dP = (torch.empty(B, T, H, BT, dtype=torch.float32, device=dev) for _ in range(2))
    dx = torch.empty(B, T, H, K, dtype=torch.float32, device=dev)
    dbeta_parts = torch.empty(1 + nkb, B, T, H, dtype=torch.float32, device=dev)  # dY part, then per K block
    dv = torch.empty_like(v)
    _grad_a_kernel[(NS, B * H)](
        v, beta, saved["ai"], saved["w"], saved["u"], saved["v_new"], saved["hs"], do, dv_new, seg,
        dA, dP, dx, dv, dbeta_parts[0], NS, T, H, K, V, BT=BT, BK=BKb, BV=BVs, DOT_BF16=bf16)
    dq, dk, dg = torch.empty_like(q), torch.empty_like(k), torch.empty(B, T, H, K, dtype=q.dtype, device=dev)
    _grad_k_kernel[(NS, B * H, nkb)](
        q, k, beta, saved["G"], saved["v_new"], saved["hs"], do, ds1, seg, dA, dP, dx, dq, dk, dg, dbeta_parts[1:],
        float(scale), NS, T, H, K, V, BT=BT, BC=BC, BK=BKb, BV=BVs, DOT_BF16=bf16)
    return dq, dk, dv, dg, dbeta_parts.sum(0).to(beta.dtype), dh0


TRITON_KERNELS = {"kda_chunk_dstate": _dstate_kernel, "kda_chunk_grad_a": _grad_a_kernel,
                  "kda_chunk_grad_k": _grad_k_kernel}
