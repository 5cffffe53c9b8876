"""One KDA decode step for B sequences whose recurrent states live in page-pool pages.

The KDA states of one layer are a typed strided view into the pool,
`state[page, h] = S` ([K, V] fp32), and `state_pages[b]` names the page holding sequence
b's state. One step of the gated delta rule (Kimi Linear, arXiv:2510.26692, Sec. 3; the
same math as `naive_recurrent_kda` with T = 1):

    S <- Diag(exp(g)) S                        # per-key-channel decay
    S <- S + beta k (v - S^T k)^T               # delta-rule write
    o  = S^T (scale q)

and S is written back to its page in place.

`impl="naive"` gathers the states, applies the step with batched matmuls (the math of
`naive_recurrent_kda` at T = 1; tested against it) and index_copy_s them back. `impl="triton"` runs one program per (sequence, head, block of value columns): each
value column of S evolves independently (the decay and k^T S act per column), so splitting V
is exact; a program loads S[:, v-block] into registers, updates it and stores it in place.
`impl="cpu"` runs the fused C++ op of kernels/cpu/ (fp32): one pass per (sequence, head) over S
in its page, no gather or scatter.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.impl import check_impl, require_cpu_ops, require_triton


def _check_inputs(q, k, v, g, beta, state, state_pages) -> tuple[int, ...]:
    """Validates shapes, dtypes and page ids (one host sync); returns (B, H, K, V)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H, K], got shape {tuple(q.shape)}")
    B, H, K = q.shape
    for name, x in (("k", k), ("g", g)):
        if tuple(x.shape) != (B, H, K):
            raise ValueError(f"{name} shape {tuple(x.shape)} must equal q shape {(B, H, K)}")
    if v.dim() != 3 or tuple(v.shape[:2]) != (B, H):
        raise ValueError(f"v shape {tuple(v.shape)} must be [B, H, V] = [{B}, {H}, V]")
    V = v.shape[2]
    if tuple(beta.shape) != (B, H):
        raise ValueError(f"beta shape {tuple(beta.shape)} must be [B, H] = {(B, H)}")
    if state.dim() != 4 or tuple(state.shape[1:]) != (H, K, V):
        raise ValueError(
            f"state shape {tuple(state.shape)} must be [num_pages, H, K, V] = "
            f"[num_pages, {H}, {K}, {V}]"
        )
    if state.dtype != torch.float32:
        raise ValueError(f"state dtype must be torch.float32, got {state.dtype}")
    if tuple(state_pages.shape) != (B,):
        raise ValueError(f"state_pages shape {tuple(state_pages.shape)} must be [B] = [{B}]")
    if state_pages.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"state_pages dtype must be int32 or int64, got {state_pages.dtype}")
    if B == 0:
        return B, H, K, V
    num_pages = state.shape[0]
    pages = state_pages.long().sort().values  # [B]
    num_dups = (pages[1:] == pages[:-1]).sum()
    lowest, highest, num_dups = torch.stack([pages[0], pages[-1], num_dups]).tolist()
    if lowest < 0 or highest >= num_pages:
        bad = lowest if lowest < 0 else highest
        raise ValueError(f"state page id {bad} is not in [0, num_pages={num_pages})")
    if num_dups:
        dup = int(pages[1:][pages[1:] == pages[:-1]][0])
        raise ValueError(
            f"state_pages must be distinct (two sequences cannot update one state), "
            f"page {dup} appears more than once"
        )
    return B, H, K, V


def _kda_decode_naive(q, k, v, g, beta, state, state_pages, scale) -> Tensor:
    """Gather the states, apply one step of the recurrence (as naive_recurrent_kda), scatter back."""
    pages = state_pages.long()  # [B]
    B, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    # index_select, not state[pages]: the same gather, several times faster on CPU.
    S = state.index_select(0, pages).float().mul_(g.exp().unsqueeze(-1)).view(B * H, K, V)  # decayed copy
    k_rows = k.reshape(B * H, 1, K)
    predicted = torch.bmm(k_rows, S)  # [B*H, 1, V] S'^T k: what the state recalls
    delta = (beta.reshape(B * H, 1, 1) * (v.reshape(B * H, 1, V) - predicted))  # [B*H, 1, V]
    S.baddbmm_(k_rows.transpose(1, 2), delta)  # S += k delta^T
    o = torch.bmm(scale * q.reshape(B * H, 1, K), S).view(B, H, V)
    state.index_copy_(0, pages, S.view(B, H, K, V).to(state.dtype))
    return o


@triton.jit
def _kda_decode_kernel(
    q_ptr,  # [B, H, K] contiguous
    k_ptr,  # [B, H, K] contiguous
    v_ptr,  # [B, H, V] contiguous
    g_ptr,  # [B, H, K] contiguous
    beta_ptr,  # [B, H] contiguous
    state_ptr,  # [num_pages, H, K, V] fp32 strided, updated in place
    pages_ptr,  # [B]
    o_ptr,  # [B, H, V] contiguous, q's dtype
    scale,
    H,
    K,
    V,
    stride_state_page,
    stride_state_head,
    stride_state_k,
    stride_state_v,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V] value columns
    col_mask = cols < V
    rows = tl.arange(0, BLOCK_K)  # [BLOCK_K] key channels
    row_mask = rows < K
    head = b * H + h
    q = tl.load(q_ptr + head * K + rows, mask=row_mask, other=0.0).to(tl.float32)  # [BLOCK_K]
    k = tl.load(k_ptr + head * K + rows, mask=row_mask, other=0.0).to(tl.float32)  # [BLOCK_K]
    g = tl.load(g_ptr + head * K + rows, mask=row_mask, other=0.0).to(tl.float32)  # [BLOCK_K]
    v = tl.load(v_ptr + head * V + cols, mask=col_mask, other=0.0).to(tl.float32)  # [BLOCK_V]
    beta = tl.load(beta_ptr + head).to(tl.float32)

    page = tl.load(pages_ptr + b).to(tl.int64)
    s_ptrs = (
        state_ptr
        + page * stride_state_page
        + h * stride_state_head
        + rows[:, None] * stride_state_k
        + cols[None, :] * stride_state_v
    )  # [BLOCK_K, BLOCK_V]
    s_mask = row_mask[:, None] & col_mask[None, :]
    S = tl.load(s_ptrs, mask=s_mask, other=0.0)  # [BLOCK_K, BLOCK_V]
    S = S * tl.exp(g)[:, None]
    predicted = tl.sum(k[:, None] * S, axis=0)  # [BLOCK_V] S'^T k: what the state recalls
    delta = beta * (v - predicted)  # [BLOCK_V]
    S = S + k[:, None] * delta[None, :]
    o = tl.sum((scale * q)[:, None] * S, axis=0)  # [BLOCK_V]
    tl.store(s_ptrs, S, mask=s_mask)
    tl.store(o_ptr + head * V + cols, o.to(o_ptr.dtype.element_ty), mask=col_mask)


def _kda_decode_triton(q, k, v, g, beta, state, state_pages, scale) -> Tensor:
    B, H, K = q.shape
    V = v.shape[2]
    require_triton(_kda_decode_kernel, q.device)
    o = torch.empty(B, H, V, dtype=q.dtype, device=q.device)  # [B, H, V]
    if B == 0:
        return o
    block_v = min(32, triton.next_power_of_2(V))
    grid = (B, H, triton.cdiv(V, block_v))
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    _kda_decode_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        state,
        state_pages,
        o,
        float(scale),
        H,
        K,
        V,
        *state.stride(),
        BLOCK_K=triton.next_power_of_2(K),
        BLOCK_V=block_v,
    )
    return o


def kda_decode_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    state_pages: Tensor,
    *,
    scale: float | None = None,
    impl: str = "naive",
    check: bool = True,
) -> Tensor:
    """One KDA recurrent step per sequence, updating the states in their pages in place.

    Args:
        q, k: [B, H, K], already L2-normalised over K.
        v: [B, H, V].
        g: [B, H, K] per-channel log-decay.
        beta: [B, H] delta-rule write strength.
        state: [num_pages, H, K, V] fp32, one layer's states, any strides (a view into the
            page pool). MUTATED: state[state_pages[b]] is replaced by sequence b's new state;
            nothing else in the underlying storage is written.
        state_pages: [B] int32/int64 distinct page ids in [0, num_pages).
        scale: query scale, default K ** -0.5.
        impl: "naive", "triton" or "cpu" (see module docstring).
        check: validate shapes and pages (one host sync). The engine's hot path passes False:
            its page bookkeeping is verified by CacheManager.check_integrity instead.

    Returns:
        o: [B, H, V] in q's dtype (math in fp32), a new tensor.

    Raises ValueError on bad shapes/dtypes, out-of-range or duplicate pages (checked with
    one host sync); RuntimeError if impl="triton" cannot run here.
    """
    check_impl(impl)
    K = _check_inputs(q, k, v, g, beta, state, state_pages)[2] if check else q.shape[-1]
    scale = K**-0.5 if scale is None else scale
    if impl == "naive":
        return _kda_decode_naive(q, k, v, g, beta, state, state_pages, scale)
    if impl == "cpu":
        if q.dtype != torch.float32 or state.dtype != torch.float32:
            return _kda_decode_naive(q, k, v, g, beta, state, state_pages, scale)  # the fused op is fp32-only
        return require_cpu_ops(q.device).kda_decode_step(q, k, v, g.float(), beta.float(), state,
                                                         state_pages.long(), float(scale))
    return _kda_decode_triton(q, k, v, g, beta, state, state_pages, scale)
