"""KDA over a few new tokens per sequence, decode-shaped: short conv and one recurrent step per token,
each token's state and conv tails written to a page of its own.

Speculative verification runs a sequence's last token and its k proposals through the model at once,
then keeps the state after the last accepted one. The chunked prefill path can emit the states at each
position, but it pads, gathers and scatters; for k + 1 <= ~8 tokens the recurrence itself is cheap. So
here sequence b's rows r = cu_rows[b] .. cu_rows[b+1]-1 run in order, row r reading the state (S of
every head and the conv tails) the previous row left, in page `src_pages[b]` for the first row and in
`dst_pages[r - 1]` after, and writing its own to `dst_pages[r]`. A verification names its k position
pages then its own page as destinations: every intermediate state lands where rollback picks it up
(choosing a page), and nothing is copied. A plain decode step is the case of one row whose destination
is its source (in place).

Per row, the math of `KDALayer.decode_conv` followed by `kda_decode_step`:
    x_w  = SiLU(sum_{j<K-1} tail_w[j] * taps_w[j] + mixed_w * taps_w[K-1])   for w in q, k, v
    q, k = x_q / ||x_q||, x_k / ||x_k|| (eps 1e-6 inside the sqrt); v = x_v; tails shift by one token
    S    = Diag(exp(g)) S;  S = S + beta k (v - S^T k)^T;  o = S^T (scale q)

`impl="naive"`: plain torch, one batched step per token position (the reference); `impl="cpu"`: the
fused C++ op of kernels/cpu/ (one pass per (sequence, head) over all its rows). No Triton version: on a
GPU verification runs the chunked prefill path, which writes the same per-position states.
"""
from __future__ import annotations

import torch
from torch import Tensor

from kernels.impl import check_impl, require_cpu_ops


def _check_inputs(mixed, g, beta, state, tails, taps, src_pages, dst_pages, cu_rows: Tensor) -> None:
    """Shapes, and the pages each sequence writes: in range and written by no other sequence (reads the
    page tensors on the host)."""
    if taps.dim() != 4 or taps.shape[1] != 3:
        raise ValueError(f"taps must be [H, 3, kernel, D], got shape {tuple(taps.shape)}")
    H, _, KK, D = taps.shape
    N = mixed.shape[0]
    if tuple(mixed.shape) != (N, 3 * H * D):
        raise ValueError(f"mixed shape {tuple(mixed.shape)} must be [N, 3*H*D] = [{N}, {3 * H * D}]")
    if tuple(g.shape) != (N, H, D) or tuple(beta.shape) != (N, H):
        raise ValueError(f"g {tuple(g.shape)} and beta {tuple(beta.shape)} must be [{N}, {H}, {D}] and [{N}, {H}]")
    if state.dim() != 4 or tuple(state.shape[1:]) != (H, D, D):
        raise ValueError(f"state shape {tuple(state.shape)} must be [num_pages, {H}, {D}, {D}]")
    if tails.dim() != 5 or tuple(tails.shape[1:]) != (H, 3, KK - 1, D) or tails.shape[0] != state.shape[0]:
        raise ValueError(f"tails shape {tuple(tails.shape)} must be [{state.shape[0]}, {H}, 3, {KK - 1}, {D}]")
    B, cu_rows = src_pages.shape[0], cu_rows.tolist()
    if len(cu_rows) != B + 1 or cu_rows[0] != 0 or cu_rows[-1] != N or any(
            b <= a for a, b in zip(cu_rows, cu_rows[1:])):
        raise ValueError(f"cu_rows {cu_rows} must rise strictly from 0 to N={N} in {B + 1} entries (one or more "
                         f"rows per sequence)")
    if tuple(dst_pages.shape) != (N,):
        raise ValueError(f"dst_pages shape {tuple(dst_pages.shape)} must be [N] = [{N}]")
    num_pages = state.shape[0]
    src, dst = src_pages.tolist(), dst_pages.tolist()
    owner: dict[int, int] = {}
    for b in range(B):
        for page in {src[b], *dst[cu_rows[b]:cu_rows[b + 1]]}:
            if not 0 <= page < num_pages:
                raise ValueError(f"page {page} of sequence {b} is not in [0, num_pages={num_pages})")
            if owner.setdefault(page, b) != b:
                raise ValueError(f"page {page} is used by sequences {owner[page]} and {b}: each page belongs to one")


def _naive(mixed, g, beta, state, tails, taps, src_pages, dst_pages, cu_rows: Tensor, scale: float) -> Tensor:
    """One batched step per token position j over the sequences with a row j."""
    H, _, KK, D = taps.shape
    cu_rows = cu_rows.tolist()
    N, B = mixed.shape[0], len(cu_rows) - 1
    o = torch.empty(N, H, D, dtype=torch.float32, device=mixed.device)  # [N, H, V]
    src, dst = src_pages.tolist(), dst_pages.tolist()
    longest = max(b - a for a, b in zip(cu_rows, cu_rows[1:]))
    for j in range(longest):
        seqs = [b for b in range(B) if cu_rows[b] + j < cu_rows[b + 1]]
        rows = torch.tensor([cu_rows[b] + j for b in seqs], device=mixed.device)  # [R]
        read = torch.tensor([src[b] if j == 0 else dst[cu_rows[b] + j - 1] for b in seqs], device=mixed.device)
        write = dst_pages.to(mixed.device)[rows]  # [R]
        R = len(seqs)
        new = mixed[rows].float().view(R, 3, H, 1, D).transpose(1, 2)  # [R, H, 3, 1, D]
        ext = torch.cat([tails[read].float(), new], dim=3)  # [R, H, 3, K, D]
        qkv = torch.nn.functional.silu((ext * taps.float()).sum(dim=3))  # [R, H, 3, D]
        q, k = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in qkv[:, :, :2].unbind(2))
        v = qkv[:, :, 2]  # [R, H, D]
        S = state[read].float() * g[rows].float().exp().unsqueeze(-1)  # [R, H, K, V] decayed
        predicted = torch.einsum("rhk,rhkv->rhv", k, S)
        delta = beta[rows].float().unsqueeze(-1) * (v - predicted)  # [R, H, V]
        S = S + k.unsqueeze(-1) * delta.unsqueeze(-2)
        o[rows] = torch.einsum("rhk,rhkv->rhv", scale * q, S)
        state[write] = S.to(state.dtype)
        tails[write] = ext[:, :, :, 1:].to(tails.dtype)
    return o


def kda_decode_tokens(mixed: Tensor, g: Tensor, beta: Tensor, state: Tensor, tails: Tensor, taps: Tensor,
                      src_pages: Tensor, dst_pages: Tensor, cu_rows: Tensor, *, scale: float | None = None,
                      impl: str = "naive", check: bool = True) -> Tensor:
    """Run each sequence's new tokens through KDA's conv and recurrence, chained through pages.

    Args:
        mixed: [N, 3*H*D] pre-conv q|k|v inputs of every row (channel = which*H*D + h*D + d).
        g: [N, H, D] per-channel log-decay; beta: [N, H].
        state: [num_pages, H, D, D] fp32 states, any strides (a pool view). MUTATED at dst_pages only.
        tails: [num_pages, H, 3, K-1, D] conv tails, any strides (a pool view). MUTATED at dst_pages only.
        taps: [H, 3, K, D] the conv's taps (`KDALayer.head_major_taps`).
        src_pages: [B] the page each sequence's first row reads.
        dst_pages: [N] the page each row writes (the next row of its sequence reads it).
        cu_rows: [B + 1] int64: sequence b owns rows cu_rows[b] .. cu_rows[b+1]-1.
        scale: query scale, default D ** -0.5.
        impl: "naive" or "cpu" (module docstring).
        check: validate shapes and pages (reads the page and row tensors on the host).

    Returns o: [N, H, D] float32. Raises ValueError on bad shapes, a page out of range or a page two
    sequences touch.
    """
    check_impl(impl)
    if impl == "triton":
        raise ValueError("kda_decode_tokens has no Triton version: run verification through the chunked prefill "
                         "path (chunk_kda with state_positions) on a GPU")
    if check:
        _check_inputs(mixed, g, beta, state, tails, taps, src_pages, dst_pages, cu_rows)
    scale = taps.shape[-1] ** -0.5 if scale is None else scale
    fp32 = mixed.dtype == state.dtype == tails.dtype == torch.float32
    if impl == "cpu" and fp32:
        return require_cpu_ops(mixed.device).kda_decode_tokens(mixed, g.float(), beta.float(), state, tails, taps.float(),
                                                               src_pages.long(), dst_pages.long(), cu_rows.long(),
                                                               float(scale))
    return _naive(mixed, g, beta, state, tails, taps, src_pages, dst_pages, cu_rows, scale)
