"""Attention weights per cached token, and attention split over two sets of rows.

Token-eviction policies (rollout/kv/kv_eviction.py) need what paged decode never materialises: how
much attention each cached token received. Given the log-sum-exp `lse` that
`paged_mla_decode(return_lse=True)` returns, a second pass recomputes each token's score and sums
its probability over heads (MLA's latent row is shared by every head, so a token can only be kept
or evicted for all heads at once):

    weights[b, t] = sum_h exp(scores[b, h, t] - lse[b, h])          for t < seq_len, else 0

`impl="naive"` gathers whole pages (as the naive decode); `impl="triton"` runs one program per
(sequence, block of 16 tokens), looping over heads, reading rows through the block table; the
programs lie on one grid axis (`weights_grid`), so no grid dimension nears CUDA's 65,535 limit on
y/z at long contexts (4M tokens x 64 sequences is 16.8M programs on x, limit 2^31 - 1).

InfiniGen-style attention runs over the resident pages *and* rows fetched back from the host for
one step. `dense_attention` gives (o, lse) over such rows, and `merge_attention` combines two
partial results exactly as one softmax over the union would (the split softmax of
FlashAttention / flash-decoding).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.impl import check_impl, require_triton


def _paged_mla_weights_naive(q_lat, q_rope, cache, block_tables, seq_lens, lse, scale, width) -> Tensor:
    B = q_lat.shape[0]
    block_tokens = cache.shape[1]
    lens = seq_lens.to(device=q_lat.device, dtype=torch.long)  # [B]
    num_blocks = -(-width // block_tokens)
    needed = torch.arange(num_blocks, device=q_lat.device) * block_tokens < lens[:, None]  # [B, nb]
    pages = block_tables[:, :num_blocks].long().masked_fill(~needed, 0)  # [B, nb]
    kv = cache.index_select(0, pages.reshape(-1)).view(B, num_blocks * block_tokens, -1)[:, :width].float()
    valid = torch.arange(width, device=q_lat.device) < lens[:, None]  # [B, S]
    kv = kv.masked_fill(~valid[..., None], 0.0)  # unread slots may hold anything
    q = torch.cat([q_lat, q_rope], dim=-1).float()  # [B, H, Dc + Dr]
    probs = ((q @ kv.transpose(1, 2)) * scale - lse.float()[..., None]).exp()  # [B, H, S]
    return probs.sum(dim=1).masked_fill(~valid, 0.0)  # [B, S]


@triton.jit
def _paged_mla_weights_kernel(
    q_lat_ptr,  # [B, H, DC] contiguous
    q_rope_ptr,  # [B, H, DR] contiguous
    cache_ptr,  # [num_pages, block_tokens, DC + DR] strided
    block_tables_ptr,  # [B, max_blocks] strided
    seq_lens_ptr,  # [B]
    lse_ptr,  # [B, H] fp32 contiguous
    w_ptr,  # [B, W] fp32 contiguous, output
    scale,
    H,
    DC,
    DR,
    W,
    block_tokens,
    stride_cache_page,
    stride_cache_slot,
    stride_cache_dim,
    stride_table_row,
    stride_table_col,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DC: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    HAS_ROPE: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # (sequence, token block), token block fastest: see weights_grid
    num_tok_blocks = tl.cdiv(W, BLOCK_N)
    b = pid // num_tok_blocks
    tok = (pid % num_tok_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] int64
    seq_len = tl.load(seq_lens_ptr + b)
    tok_mask = tok < seq_len
    dc = tl.arange(0, BLOCK_DC)
    dc_mask = dc < DC
    page = tl.load(
        block_tables_ptr + b * stride_table_row + (tok // block_tokens) * stride_table_col, mask=tok_mask, other=0
    ).to(tl.int64)
    rows = cache_ptr + page * stride_cache_page + (tok % block_tokens) * stride_cache_slot  # [BLOCK_N]
    c_kv = tl.load(rows[:, None] + dc[None, :] * stride_cache_dim, mask=tok_mask[:, None] & dc_mask[None, :],
                   other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_DC]
    if HAS_ROPE:
        dr = tl.arange(0, BLOCK_DR)
        dr_mask = dr < DR
        k_rope = tl.load(rows[:, None] + (DC + dr[None, :]) * stride_cache_dim,
                         mask=tok_mask[:, None] & dr_mask[None, :], other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_DR]
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        head_mask = heads < H
        q_rows = b * H + heads
        q_lat = tl.load(q_lat_ptr + q_rows[:, None] * DC + dc[None, :], mask=head_mask[:, None] & dc_mask[None, :],
                        other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_DC]
        scores = tl.dot(q_lat, tl.trans(c_kv), input_precision="ieee")  # [BLOCK_H, BLOCK_N]
        if HAS_ROPE:
            q_rope = tl.load(q_rope_ptr + q_rows[:, None] * DR + dr[None, :],
                             mask=head_mask[:, None] & dr_mask[None, :], other=0.0).to(tl.float32)
            scores += tl.dot(q_rope, tl.trans(k_rope), input_precision="ieee")
        lse = tl.load(lse_ptr + q_rows, mask=head_mask, other=0.0)  # [BLOCK_H]
        p = tl.exp(scores * scale - lse[:, None])
        p = tl.where(head_mask[:, None] & tok_mask[None, :], p, 0.0)
        total += tl.sum(p, axis=0)
    tl.store(w_ptr + b * W + tok, total, mask=tok < W)


# CUDA grid limits: x < 2^31, y and z <= 65535 (a token-block axis on y overflowed past ~1M tokens).
_MAX_GRID_X = 2**31 - 1
_WEIGHTS_BLOCK_N = 16


def weights_grid(batch: int, width: int, block_n: int = _WEIGHTS_BLOCK_N) -> tuple[int]:
    """One axis over (sequence, token block): batch * ceil(width / block_n) programs on grid x."""
    programs = batch * -(-width // block_n)
    if programs > _MAX_GRID_X:
        raise ValueError(f"weights grid of {batch} x ceil({width} / {block_n}) = {programs} programs exceeds CUDA's "
                         f"grid x limit {_MAX_GRID_X}")
    return (programs,)


def _paged_mla_weights_triton(q_lat, q_rope, cache, block_tables, seq_lens, lse, scale, width) -> Tensor:
    B, H, Dc = q_lat.shape
    Dr = q_rope.shape[2]
    require_triton(_paged_mla_weights_kernel, q_lat.device)
    out = torch.empty(B, width, dtype=torch.float32, device=q_lat.device)
    if B == 0 or width == 0:
        return out
    block_n = _WEIGHTS_BLOCK_N
    _paged_mla_weights_kernel[weights_grid(B, width, block_n)](
        q_lat.contiguous(), q_rope.contiguous(), cache, block_tables, seq_lens, lse.float().contiguous(), out,
        float(scale), H, Dc, Dr, width, cache.shape[1], cache.stride(0), cache.stride(1), cache.stride(2),
        block_tables.stride(0), block_tables.stride(1),
        BLOCK_H=16, BLOCK_N=block_n, BLOCK_DC=max(16, triton.next_power_of_2(Dc)),
        BLOCK_DR=max(16, triton.next_power_of_2(Dr)), HAS_ROPE=Dr > 0, num_warps=4,
    )
    return out


def paged_mla_weights(q_lat: Tensor, q_rope: Tensor, cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                      lse: Tensor, *, scale: float, width: int | None = None, impl: str = "naive") -> Tensor:
    """Attention probability each cached token received, summed over heads.

    Same inputs as `paged_mla_decode` plus lse [B, H] (its `return_lse` output, or the lse of a
    softmax over more rows than the pages: probabilities are then relative to that union).
    width: columns of the result (default max(seq_lens), one host sync).
    Returns [B, width] float32; column t >= seq_lens[b] is 0.
    """
    check_impl(impl)
    if lse.shape != q_lat.shape[:2]:
        raise ValueError(f"lse shape {tuple(lse.shape)} must be [B, H] = {list(q_lat.shape[:2])}")
    if width is None:
        width = int(seq_lens.max()) if seq_lens.numel() else 0
    if impl != "triton":  # "naive", or "cpu" (no fused CPU version of this one)
        return _paged_mla_weights_naive(q_lat, q_rope, cache, block_tables, seq_lens, lse, scale, width)
    return _paged_mla_weights_triton(q_lat, q_rope, cache, block_tables, seq_lens, lse, scale, width)


def dense_attention(q: Tensor, kv: Tensor, valid: Tensor, *, scale: float, value_dim: int
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """Absorbed attention of q [B, H, W] over rows kv [B, M, W] where valid [B, M] (bool).

    Returns (o [B, H, value_dim] fp32 = softmax-weighted kv[..., :value_dim], lse [B, H]
    (-inf where a sequence has no valid row; its o is 0), scores [B, H, M] scaled, -inf where
    invalid)."""
    scores = (q.float() @ kv.float().transpose(1, 2)) * scale  # [B, H, M]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = scores.logsumexp(dim=-1)  # [B, H]
    probs = (scores - lse.masked_fill(lse.isinf(), 0.0)[..., None]).exp()  # rows with nothing valid: all 0
    o = probs @ kv.float()[..., :value_dim]
    return o, lse, scores


def merge_attention(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Combine attention over two disjoint row sets into attention over their union.

    o_*: [..., D] normalised outputs, lse_*: [...] log-sum-exp of each set's scores (-inf for an
    empty set). Returns (o, lse) of the union."""
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = (lse_a - lse).exp().nan_to_num(0.0)[..., None]
    w_b = (lse_b - lse).exp().nan_to_num(0.0)[..., None]
    return o_a.float() * w_a + o_b.float() * w_b, lse
