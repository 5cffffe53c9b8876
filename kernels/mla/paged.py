"""Absorbed MLA decode over a paged latent cache: one query token per sequence.

The latent cache of one layer is a typed strided view into the page pool,
`cache[page, slot] = [c_kv (Dc), k_rope (Dr)]`; a sequence's pages are listed, in token
order, in its row of `block_tables`, so token t lives at page `block_tables[b, t // block_tokens]`,
slot `t % block_tokens`. With W_uk already folded into the query (q_lat = W_uk^T q_nope,
DeepSeek-V2 Sec. 2.1.2, as in `naive_mla_attention_absorbed`), per head:

    scores[t] = (q_lat . c_kv[t] + q_rope . k_rope[t]) * scale      for t < seq_len
    o_lat     = sum_t softmax(scores)[t] c_kv[t]                      # [Dc]; W_uv applied later

`impl="naive"` gathers each sequence's pages and runs plain torch; `impl="triton"` runs one
program per (sequence, block of 16 heads): all heads of a block share every latent row it
loads (the point of MLA at decode), and it walks the sequence in blocks of tokens with an
online softmax (Milakov & Gimelshein 2018; FlashAttention), looking each token's page up in
block_tables, so the pages are never gathered into a contiguous copy.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.impl import check_impl, require_triton


def _check_inputs(q_lat, q_rope, cache, block_tables, seq_lens) -> tuple[int, ...]:
    """Validates shapes, dtypes, seq_lens and the page ids they need; returns (B, H, Dc, Dr).

    Reading seq_lens and the needed block-table entries costs one host sync.
    """
    if q_lat.dim() != 3:
        raise ValueError(f"q_lat must be [B, H, Dc], got shape {tuple(q_lat.shape)}")
    B, H, Dc = q_lat.shape
    if q_rope.dim() != 3 or tuple(q_rope.shape[:2]) != (B, H):
        raise ValueError(f"q_rope shape {tuple(q_rope.shape)} must be [B, H, Dr] = [{B}, {H}, Dr]")
    Dr = q_rope.shape[2]
    if cache.dim() != 3 or cache.shape[2] != Dc + Dr:
        raise ValueError(
            f"cache shape {tuple(cache.shape)} must be [num_pages, block_tokens, Dc + Dr] = "
            f"[num_pages, block_tokens, {Dc + Dr}]"
        )
    num_pages, block_tokens = cache.shape[:2]
    if block_tables.dim() != 2 or block_tables.shape[0] != B:
        raise ValueError(
            f"block_tables shape {tuple(block_tables.shape)} must be [B, max_blocks] = "
            f"[{B}, max_blocks]"
        )
    if block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_tables dtype must be int32 or int64, got {block_tables.dtype}")
    if tuple(seq_lens.shape) != (B,):
        raise ValueError(f"seq_lens shape {tuple(seq_lens.shape)} must be [B] = [{B}]")
    if seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens dtype must be int32 or int64, got {seq_lens.dtype}")
    if B == 0:
        return B, H, Dc, Dr
    max_blocks = block_tables.shape[1]
    capacity = max_blocks * block_tokens
    num_blocks = (seq_lens.long() + block_tokens - 1) // block_tokens  # [B] pages each needs
    needed = torch.arange(max_blocks, device=seq_lens.device) < num_blocks.unsqueeze(1)
    bad_ids = needed & ((block_tables < 0) | (block_tables >= num_pages))  # [B, max_blocks]
    shortest, longest, num_bad = torch.stack(
        [seq_lens.min().long(), seq_lens.max().long(), bad_ids.sum()]
    ).tolist()
    if shortest < 1:
        raise ValueError(f"seq_lens must be >= 1 (the current token is cached), got {shortest}")
    if longest > capacity:
        raise ValueError(
            f"seq_len {longest} exceeds the block table's capacity max_blocks * block_tokens = "
            f"{max_blocks} * {block_tokens} = {capacity}"
        )
    if num_bad:
        b, i = bad_ids.nonzero()[0].tolist()
        raise ValueError(
            f"block_tables[{b}, {i}] = {int(block_tables[b, i])} is not a page id in "
            f"[0, num_pages={num_pages})"
        )
    return B, H, Dc, Dr


def _paged_mla_decode_naive(q_lat, q_rope, cache, block_tables, seq_lens, scale, return_lse=False, max_seq_len=None):
    """Gathers every sequence's pages (whole blocks, in table order) into one padded
    [B, max_blocks * block_tokens, Dc + Dr] batch, then plain softmax attention. Slots past a
    sequence's seq_len may hold anything (stale or never-written pages, even NaN bit patterns):
    they are masked out of the softmax, and zeroed when the gather holds any non-finite value.
    Table entries past the last needed block are never dereferenced (page 0 is read instead)."""
    B, H, Dc = q_lat.shape
    block_tokens, width = cache.shape[1], cache.shape[2]
    f32 = torch.float32
    lens = seq_lens.to(device=q_lat.device, dtype=torch.long)  # [B]
    num_blocks = -(-(int(lens.max()) if max_seq_len is None else max_seq_len) // block_tokens)
    blocks = torch.arange(num_blocks, device=q_lat.device)  # [nb]
    needed = blocks * block_tokens < lens[:, None]  # [B, nb]
    pages = block_tables[:, :num_blocks].long().masked_fill(~needed, 0)  # [B, nb]
    # A block gather (index_select of whole pages) is several times cheaper than a per-token one.
    kv = cache.index_select(0, pages.reshape(-1)).view(B, num_blocks * block_tokens, width).to(f32)
    valid = torch.arange(num_blocks * block_tokens, device=q_lat.device) < lens[:, None]  # [B, S]
    # Probabilities past seq_len are exactly 0 below, and 0 * finite = 0, so those slots only need
    # clearing when something in the gather is not finite (one cheap sum decides; NaN/inf in a real
    # slot still reaches the output, as in the reference). Given max_seq_len, the caller wants no
    # host sync: clear them unconditionally (the same sums: 0 * 0 and 0 * finite are both zeros).
    if max_seq_len is not None or not bool(kv.sum().isfinite()):
        kv = kv.masked_fill(~valid[..., None], 0.0)  # [B, S, Dc + Dr]
    q = torch.cat([q_lat, q_rope], dim=-1).to(f32)  # [B, H, Dc + Dr]: one product scores both parts
    scores = (q @ kv.transpose(1, 2)) * scale  # [B, H, S]
    scores.masked_fill_(~valid[:, None, :], float("-inf"))
    o_lat = (scores.softmax(dim=-1) @ kv)[..., :Dc].to(q_lat.dtype)  # [B, H, Dc]
    return (o_lat, scores.logsumexp(dim=-1)) if return_lse else o_lat


@triton.jit
def _paged_mla_decode_kernel(
    q_lat_ptr,  # [B, H, DC] contiguous
    q_rope_ptr,  # [B, H, DR] contiguous
    cache_ptr,  # [num_pages, block_tokens, DC + DR] strided
    block_tables_ptr,  # [B, max_blocks] strided
    seq_lens_ptr,  # [B]
    o_ptr,  # [B, H, DC] contiguous, q_lat's dtype
    lse_ptr,  # [B, H] fp32 log-sum-exp of the scaled scores (written when STORE_LSE)
    scale,
    H,
    DC,
    DR,
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
    STORE_LSE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    head_mask = heads < H
    dc = tl.arange(0, BLOCK_DC)  # [BLOCK_DC]
    dc_mask = dc < DC
    q_rows = b * H + heads  # [BLOCK_H] row index into [B * H, *]
    q_lat = tl.load(
        q_lat_ptr + q_rows[:, None] * DC + dc[None, :],
        mask=head_mask[:, None] & dc_mask[None, :],
        other=0.0,
    ).to(tl.float32)  # [BLOCK_H, BLOCK_DC]; padded heads are 0 and never stored
    if HAS_ROPE:
        dr = tl.arange(0, BLOCK_DR)  # [BLOCK_DR]
        dr_mask = dr < DR
        q_rope = tl.load(
            q_rope_ptr + q_rows[:, None] * DR + dr[None, :],
            mask=head_mask[:, None] & dr_mask[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_H, BLOCK_DR]

    seq_len = tl.load(seq_lens_ptr + b)
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)  # running max of scores
    l = tl.zeros([BLOCK_H], dtype=tl.float32)  # running sum of exp(scores - m)
    acc = tl.zeros([BLOCK_H, BLOCK_DC], dtype=tl.float32)  # running sum of p c_kv
    for start in range(0, seq_len, BLOCK_N):
        tok = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        tok_mask = tok < seq_len  # block-table entries past the sequence are never loaded
        page = tl.load(
            block_tables_ptr + b * stride_table_row + (tok // block_tokens) * stride_table_col,
            mask=tok_mask,
            other=0,
        ).to(tl.int64)  # [BLOCK_N]
        rows = cache_ptr + page * stride_cache_page + (tok % block_tokens) * stride_cache_slot
        c_kv = tl.load(
            rows[:, None] + dc[None, :] * stride_cache_dim,
            mask=tok_mask[:, None] & dc_mask[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_N, BLOCK_DC]
        scores = tl.dot(q_lat, tl.trans(c_kv), input_precision="ieee")  # [BLOCK_H, BLOCK_N]
        if HAS_ROPE:
            k_rope = tl.load(
                rows[:, None] + (DC + dr[None, :]) * stride_cache_dim,
                mask=tok_mask[:, None] & dr_mask[None, :],
                other=0.0,
            ).to(tl.float32)  # [BLOCK_N, BLOCK_DR]
            scores += tl.dot(q_rope, tl.trans(k_rope), input_precision="ieee")
        scores = tl.where(tok_mask[None, :], scores * scale, float("-inf"))
        # Online softmax: rescale what was accumulated under the old max. The first block
        # holds token 0 (seq_len >= 1), so m_new is finite and alpha = exp(-inf) = 0 there.
        m_new = tl.maximum(m, tl.max(scores, axis=1))  # [BLOCK_H]
        alpha = tl.exp(m - m_new)  # [BLOCK_H]
        p = tl.exp(scores - m_new[:, None])  # [BLOCK_H, BLOCK_N]; masked tokens give 0
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, c_kv, input_precision="ieee")
        m = m_new
    o = acc / l[:, None]  # [BLOCK_H, BLOCK_DC]
    tl.store(
        o_ptr + q_rows[:, None] * DC + dc[None, :],
        o.to(o_ptr.dtype.element_ty),
        mask=head_mask[:, None] & dc_mask[None, :],
    )
    if STORE_LSE:
        tl.store(lse_ptr + q_rows, m + tl.log(l), mask=head_mask)


# Heads per program and tokens per loop step. tl.dot needs every dim >= 16; 16 heads share
# each latent row loaded. Not tuned (no autotune: it fails under the interpreter).
_BLOCK_H = 16
_BLOCK_N = 16


def _paged_mla_decode_triton(q_lat, q_rope, cache, block_tables, seq_lens, scale, return_lse=False):
    B, H, Dc = q_lat.shape
    Dr = q_rope.shape[2]
    require_triton(_paged_mla_decode_kernel, q_lat.device)
    q_lat_c = q_lat.contiguous()  # [B, H, Dc]
    q_rope_c = q_rope.contiguous()  # [B, H, Dr]
    o_lat = torch.empty(B, H, Dc, dtype=q_lat.dtype, device=q_lat.device)  # [B, H, Dc]
    lse = torch.empty(B, H, dtype=torch.float32, device=q_lat.device) if return_lse else o_lat  # [B, H]
    if B == 0:
        return (o_lat, lse) if return_lse else o_lat
    block_dc = max(16, triton.next_power_of_2(Dc))
    grid = (B, triton.cdiv(H, _BLOCK_H))
    _paged_mla_decode_kernel[grid](
        q_lat_c,
        q_rope_c,
        cache,
        block_tables,
        seq_lens,
        o_lat,
        lse,
        float(scale),
        H,
        Dc,
        Dr,
        cache.shape[1],
        cache.stride(0),
        cache.stride(1),
        cache.stride(2),
        block_tables.stride(0),
        block_tables.stride(1),
        BLOCK_H=_BLOCK_H,
        BLOCK_N=_BLOCK_N,
        BLOCK_DC=block_dc,
        BLOCK_DR=max(16, triton.next_power_of_2(Dr)),
        HAS_ROPE=Dr > 0,
        STORE_LSE=return_lse,
        num_warps=8 if block_dc >= 256 else 4,
    )
    return (o_lat, lse) if return_lse else o_lat


def paged_mla_decode(
    q_lat: Tensor,
    q_rope: Tensor,
    cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    *,
    scale: float,
    impl: str = "naive",
    check: bool = True,
    return_lse: bool = False,
    max_seq_len: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Absorbed MLA attention of one new token per sequence over its paged latent cache.

    Args:
        q_lat: [B, H, Dc] q_nope already multiplied by W_uk (the absorbed query).
        q_rope: [B, H, Dr] RoPE part of the query; Dr may be 0 (NoPE).
        cache: [num_pages, block_tokens, Dc + Dr] one layer's latent cache, any strides (a
            view into the page pool); token rows are [c_kv, k_rope]. Not mutated.
        block_tables: [B, max_blocks] int32/int64 page ids in token order. Only the first
            ceil(seq_len / block_tokens) entries of a row are read; the rest may hold
            anything, -1 included.
        seq_lens: [B] int, tokens to attend, 1 <= seq_len <= max_blocks * block_tokens; the
            current token is already written to the cache.
        scale: softmax scale applied to the scores.
        impl: "naive" or "triton" (see module docstring).
        check: validate shapes, lengths and page ids (one host sync). The engine's hot path
            passes False: its block tables are verified by CacheManager.check_integrity instead.

        return_lse: also return lse [B, H] fp32, the log-sum-exp of the scaled scores: what
            merging with attention over other rows needs (`merge_attention`), and what
            `paged_mla_weights` turns scores into probabilities with.
        max_seq_len: max(seq_lens) when the caller knows it on the host (the naive path then
            reads nothing back from the device: no host sync); None = read it from seq_lens.

    Returns:
        o_lat: [B, H, Dc] in q_lat's dtype (math in fp32), the attention-weighted latent;
        the caller applies W_uv. A new tensor. (o_lat, lse) with return_lse.

    Raises ValueError on bad shapes/dtypes, seq_lens out of range or a needed page id
    outside [0, num_pages) (checked with one host sync); RuntimeError if impl="triton" cannot
    run here.
    """
    check_impl(impl)
    if check:
        _check_inputs(q_lat, q_rope, cache, block_tables, seq_lens)
    if impl != "triton":  # "naive", or "cpu" (no fused CPU version of this one)
        return _paged_mla_decode_naive(q_lat, q_rope, cache, block_tables, seq_lens, scale, return_lse, max_seq_len)
    return _paged_mla_decode_triton(q_lat, q_rope, cache, block_tables, seq_lens, scale, return_lse)
