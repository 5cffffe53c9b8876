"""Absorbed MLA decode over a paged latent cache: one query token per sequence.

The latent cache of one layer is a typed strided view into the page pool,
`cache[page, slot] = [c_kv (Dc), k_rope (Dr)]`; a sequence's pages are listed, in token
order, in its row of `block_tables`, so token t lives at page `block_tables[b, t // block_tokens]`,
slot `t % block_tokens`. With W_uk already folded into the query (q_lat = W_uk^T q_nope,
DeepSeek-V2 Sec. 2.1.2, as in `naive_mla_attention_absorbed`), per head:

    scores[t] = (q_lat . c_kv[t] + q_rope . k_rope[t]) * scale      for t < seq_len
    o_lat     = sum_t softmax(scores)[t] c_kv[t]                      # [Dc]; W_uv applied later

`impl="naive"` gathers each sequence's pages and runs plain torch: the reference.

`impl="triton"` follows FlashMLA's design (DeepSeek, 2025), in Triton:
- one program covers a tile of up to 64 heads of one sequence (padded and masked; 16 or 32 for
  fewer heads, several tiles past 64), so a sequence's latent rows are read once for all its
  heads: MLA's point at decode, where every head attends to the same rows;
- it walks its tokens in tiles of 64 (one page when block_tokens is 64, so one table lookup per
  tile; other page sizes look each token's page up) with an online softmax in base 2 (Milakov &
  Gimelshein 2018; FlashAttention), reading only slots below seq_len, never gathering pages;
- the cache is read in its own dtype: a bf16 cache gives bf16 x bf16 `tl.dot`s (the query cast
  to bf16) with fp32 accumulation, the softmax and the accumulator in fp32; an fp32 cache runs
  its dots in "ieee" fp32 (what the interpreter tests check against the naive path);
- split-KV (flash-decoding): each sequence's tokens are cut into `num_splits` page-aligned
  ranges, one program per (sequence, split, head tile) on grid axis x, each writing a partial
  (o, lse); a combine kernel merges them with `merge_attention`'s formula
  (kernels/mla/split_kv.py, which also plans the splits from host integers: no device sync).

On a GPU the launch is autotuned over num_warps x num_stages once per shape (the tuning's first
call syncs; later calls do not). The Triton path has run only under TRITON_INTERPRET=1 (fp32,
small shapes); no GPU has run it, so its speed (the design aims at FlashMLA's HBM-bound decode)
and its register and shared-memory fit at 64 heads x 576-wide bf16 latents are unmeasured.
"""
import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.impl import check_impl, gpu_autotune, require_triton
from kernels.mla.split_kv import (BLOCK_N, SplitPlan, combine_kernel, combine_splits_triton, decode_grid, device_sms,
                                   plan_splits)


def _check_inputs(q_lat, q_rope, cache, block_tables, seq_lens, max_seq_len=None) -> tuple[int, ...]:
    """Validates shapes, dtypes, seq_lens (<= max_seq_len when given) and the page ids they need;
    returns (B, H, Dc, Dr).

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
    if max_seq_len is not None and longest > max_seq_len:
        raise ValueError(f"seq_len {longest} exceeds the max_seq_len={max_seq_len} given")
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
def _tile_rows(cache_ptr, table_row, tile, tok, tok_mask, stride_cache_page, stride_cache_slot, stride_table_col,
               BLOCK_TOKENS: tl.constexpr, PAGE_TILES: tl.constexpr):
    """Pointers to the cache rows of tokens tok = tile + [0, BLOCK_N) [BLOCK_N]; table entries
    are read for the tokens in tok_mask only."""
    if PAGE_TILES:  # one table entry per tile: a tile starts on a page boundary + k * BLOCK_N
        page = tl.load(table_row + (tile // BLOCK_TOKENS) * stride_table_col).to(tl.int64)
        rows = cache_ptr + page * stride_cache_page + (tok - tile + tile % BLOCK_TOKENS) * stride_cache_slot
    else:  # pages shorter than a tile (or not dividing it): one table entry per token
        page = tl.load(table_row + (tok // BLOCK_TOKENS) * stride_table_col, mask=tok_mask, other=0).to(tl.int64)
        rows = cache_ptr + page * stride_cache_page + (tok % BLOCK_TOKENS) * stride_cache_slot
    return rows


# Autotuned on a GPU (the interpreter runs the plain kernel) over num_warps 4/8 x num_stages 1/2,
# once per shape: configs that do not fit (registers, shared memory) are skipped by the tuner.
# At DeepSeek/Kimi shapes (64 heads, Dc = 512, Dr = 64, bf16) the fp32 accumulator is 64 x 512
# (128 registers a thread over 8 warps) and two stages hold two 64-token tiles (2 x 72 KiB)
# beside the 72 KiB query, FlashMLA's budget of the 227 KiB an SM offers. Never measured.
@gpu_autotune(key=["DC", "DR", "BLOCK_H", "BLOCK_TOKENS"], warps=(4, 8), stages=(1, 2))
@triton.jit
def _paged_mla_decode_kernel(
    q_lat_ptr,  # [B, H, DC] contiguous
    q_rope_ptr,  # [B, H, DR] contiguous
    cache_ptr,  # [num_pages, BLOCK_TOKENS, DC + DR] strided, bf16 or fp32
    block_tables_ptr,  # [B, max_blocks] strided
    seq_lens_ptr,  # [B]
    o_ptr,  # [B, num_splits, H, DC] contiguous: fp32 partials, or the output itself when num_splits == 1
    lse_ptr,  # [B, num_splits, H] fp32 natural-log log-sum-exp of the scaled scores; -inf: no token
    scale_log2,  # softmax scale * log2(e): the online softmax runs in base 2
    H, num_head_tiles, num_splits,
    split_len,  # tokens per split, a multiple of lcm(BLOCK_N, BLOCK_TOKENS); the last runs to seq_len
    stride_cache_page, stride_cache_slot, stride_cache_dim, stride_table_row, stride_table_col,
    DC: tl.constexpr, DR: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_DR: tl.constexpr,
    PAGE_TILES: tl.constexpr,  # BLOCK_TOKENS % BLOCK_N == 0: a tile lies in one page
    DOT_PRECISION: tl.constexpr,  # "ieee" for an fp32 cache; ignored for bf16 operands
):
    pid = tl.program_id(0)  # (sequence, split, head tile), head tile fastest: see decode_grid
    head_tile = pid % num_head_tiles
    b = (pid // num_head_tiles // num_splits).to(tl.int64)
    s = (pid // num_head_tiles % num_splits).to(tl.int64)
    heads = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    head_mask = heads < H
    dc = tl.arange(0, BLOCK_DC)  # [BLOCK_DC]
    dc_mask = dc < DC
    dr = tl.arange(0, BLOCK_DR)  # [BLOCK_DR]
    dr_mask = dr < DR
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    kv_ty = cache_ptr.dtype.element_ty
    q_rows = b * H + heads  # [BLOCK_H] rows of [B * H, *]
    # The query in the cache's dtype: bf16 x bf16 products with fp32 accumulation (tensor cores).
    q_lat = tl.load(q_lat_ptr + q_rows[:, None] * DC + dc[None, :], mask=head_mask[:, None] & dc_mask[None, :],
                    other=0.0).to(kv_ty)  # [BLOCK_H, BLOCK_DC]; padded heads are 0 and never stored
    if DR > 0:
        q_rope = tl.load(q_rope_ptr + q_rows[:, None] * DR + dr[None, :], mask=head_mask[:, None] & dr_mask[None, :],
                         other=0.0).to(kv_ty)  # [BLOCK_H, BLOCK_DR]
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
    start = s * split_len
    end = tl.minimum(start + split_len, seq_len)
    end = tl.where(s == num_splits - 1, seq_len, end)  # the last split runs to the end
    table_row = block_tables_ptr + b * stride_table_row
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)  # running max of base-2 scores
    l = tl.zeros([BLOCK_H], dtype=tl.float32)  # running sum of 2^(score - m)
    acc = tl.zeros([BLOCK_H, BLOCK_DC], dtype=tl.float32)  # running sum of p c_kv
    for tile in range(start, end, BLOCK_N):  # no iteration for a split past the end
        tok = tile + offs_n  # [BLOCK_N]
        tok_mask = tok < end  # slots past the end (and their table entries) are never read
        rows = _tile_rows(cache_ptr, table_row, tile, tok, tok_mask, stride_cache_page, stride_cache_slot,
                          stride_table_col, BLOCK_TOKENS, PAGE_TILES)  # [BLOCK_N] row pointers
        c_kv = tl.load(rows[:, None] + dc[None, :] * stride_cache_dim, mask=tok_mask[:, None] & dc_mask[None, :],
                       other=0.0)  # [BLOCK_N, BLOCK_DC], the cache's dtype
        scores = tl.dot(q_lat, tl.trans(c_kv), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N] fp32
        if DR > 0:
            k_rope = tl.load(rows[:, None] + (DC + dr[None, :]) * stride_cache_dim,
                             mask=tok_mask[:, None] & dr_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_DR]
            scores = tl.dot(q_rope, tl.trans(k_rope), acc=scores, input_precision=DOT_PRECISION)
        scores = tl.where(tok_mask[None, :], scores * scale_log2, float("-inf"))
        # Online softmax (Milakov & Gimelshein 2018; FlashAttention): the first tile of a split
        # holds its first token, so m_new is finite there and alpha = 2^-inf = 0.
        m_new = tl.maximum(m, tl.max(scores, axis=1))  # [BLOCK_H]
        alpha = tl.exp2(m - m_new)  # [BLOCK_H]
        p = tl.exp2(scores - m_new[:, None])  # [BLOCK_H, BLOCK_N]; masked tokens give 0
        l = l * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(kv_ty), c_kv, acc=acc * alpha[:, None], input_precision=DOT_PRECISION)
        m = m_new
    # A split with no token: l = 0, acc = 0 -> o = 0 and lse = -inf (weight 0 in the combine).
    has_tokens = l > 0
    l = tl.where(has_tokens, l, 1.0)
    o = acc / l[:, None]  # [BLOCK_H, BLOCK_DC]
    lse = tl.where(has_tokens, (m + tl.log2(l)) * 0.6931471805599453, float("-inf"))  # ln 2 * log2 sum
    out_rows = (b * num_splits + s) * H + heads  # [BLOCK_H] rows of [B * num_splits * H, *]
    tl.store(o_ptr + out_rows[:, None] * DC + dc[None, :], o.to(o_ptr.dtype.element_ty),
             mask=head_mask[:, None] & dc_mask[None, :])
    tl.store(lse_ptr + out_rows, lse, mask=head_mask)


_LOG2E = 1.4426950408889634


def _decode_partials(q_lat, q_rope, cache, block_tables, seq_lens, scale, plan: SplitPlan, o, lse):
    """Runs the split kernel: writes o [B, S, H, Dc] (fp32 partials; the output when S == 1) and
    lse [B, S, H] fp32, given the plan. Returns nothing; o and lse are written in place."""
    B, H, Dc = q_lat.shape
    Dr = q_rope.shape[2]
    block_tokens = cache.shape[1]
    block_dc = max(16, triton.next_power_of_2(Dc))
    _paged_mla_decode_kernel[decode_grid(plan)](
        q_lat.contiguous(), q_rope.contiguous(), cache, block_tables, seq_lens, o, lse,
        float(scale) * _LOG2E, H, plan.num_head_tiles, plan.num_splits, plan.split_len,
        cache.stride(0), cache.stride(1), cache.stride(2), block_tables.stride(0), block_tables.stride(1),
        DC=Dc, DR=Dr, BLOCK_TOKENS=block_tokens, BLOCK_H=plan.block_h, BLOCK_N=BLOCK_N, BLOCK_DC=block_dc,
        BLOCK_DR=max(16, triton.next_power_of_2(Dr)), PAGE_TILES=block_tokens % BLOCK_N == 0,
        DOT_PRECISION="ieee" if cache.dtype == torch.float32 else "tf32",
    )


def _paged_mla_decode_triton(q_lat, q_rope, cache, block_tables, seq_lens, scale, return_lse, max_seq_len,
                             num_splits):
    B, H, Dc = q_lat.shape
    require_triton(_paged_mla_decode_kernel, q_lat.device)
    o_lat = torch.empty(B, H, Dc, dtype=q_lat.dtype, device=q_lat.device)  # [B, H, Dc]
    lse = torch.empty(B, H, dtype=torch.float32, device=q_lat.device)  # [B, H]
    if B == 0:
        return (o_lat, lse) if return_lse else o_lat
    block_tokens = cache.shape[1]
    # No device read: the longest sequence is the caller's max_seq_len or the table's capacity.
    longest = max_seq_len if max_seq_len is not None else block_tables.shape[1] * block_tokens
    plan = plan_splits(B, H, max(1, longest), block_tokens, num_sms=device_sms(q_lat.device), num_splits=num_splits)
    if plan.num_splits == 1:  # the partial is the result: no combine pass
        _decode_partials(q_lat, q_rope, cache, block_tables, seq_lens, scale, plan, o_lat, lse)
    else:
        part_o = torch.empty(B, plan.num_splits, H, Dc, dtype=torch.float32, device=q_lat.device)  # [B, S, H, Dc]
        part_lse = torch.empty(B, plan.num_splits, H, dtype=torch.float32, device=q_lat.device)  # [B, S, H]
        _decode_partials(q_lat, q_rope, cache, block_tables, seq_lens, scale, plan, part_o, part_lse)
        combine_splits_triton(part_o, part_lse, seq_lens, plan.split_len, o_lat, lse)
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
    num_splits: int | None = None,
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
            reads nothing back from the device: no host sync); None = read it from seq_lens
            (naive) or take the block table's capacity (triton, which never syncs). Triton
            sizes its splits from it: a value below max(seq_lens) still gives the right result
            (the last split runs to each sequence's end), only slower; check=True rejects it.
        num_splits: triton only: force the number of KV splits (tests); None = `plan_splits`.

    Returns:
        o_lat: [B, H, Dc] in q_lat's dtype (math in fp32), the attention-weighted latent;
        the caller applies W_uv. A new tensor. (o_lat, lse) with return_lse.

    Raises ValueError on bad shapes/dtypes, seq_lens out of range or a needed page id
    outside [0, num_pages) (checked with one host sync); RuntimeError if impl="triton" cannot
    run here.
    """
    check_impl(impl)
    if check:
        _check_inputs(q_lat, q_rope, cache, block_tables, seq_lens, max_seq_len)
    if impl != "triton":  # "naive", or "cpu" (no fused CPU version of this one)
        return _paged_mla_decode_naive(q_lat, q_rope, cache, block_tables, seq_lens, scale, return_lse, max_seq_len)
    return _paged_mla_decode_triton(q_lat, q_rope, cache, block_tables, seq_lens, scale, return_lse, max_seq_len,
                                    num_splits)


# name -> Triton kernel (tools/gpu_check.py's compile counts and register figures)
TRITON_KERNELS = {"mla_decode": _paged_mla_decode_kernel, "mla_decode_combine": combine_kernel}
