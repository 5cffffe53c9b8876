"""Absorbed MLA prefill over a paged latent cache, in tiles of slots: memory linear in the context.

A prefill chunk of sequence b holds `lens[b]` new tokens at MLA slots `kv_starts[b] + t`; they are
already written to the cache (prefill attends to itself). Query row t (every head) attends slots
`0 .. kv_starts[b] + t` with the absorbed form of `paged_mla_decode` (W_uk folded into q_lat, W_uv
applied by the caller):

    scores[t, h, s] = (q_lat[t, h] . c_kv[s] + q_rope[t, h] . k_rope[s]) * scale
    o_lat[t, h]     = sum_s softmax_s(scores[t, h])[s] c_kv[s]

Queries come right-padded to the longest chunk, [B, Lq, H, *]. A padded row (t >= lens[b]) attends
every slot below the sequence's end, so it stays finite; its output is the caller's to drop.

Neither path materialises scores over the whole context. `impl="naive"` walks the slots in tiles
of `tile_slots` (whole pages, or an equal part of one page), gathering each tile's pages through the
block table, and keeps an online softmax (Milakov & Gimelshein 2018; FlashAttention): running max,
running sum and the running weighted sum of c_kv per query row, normalised at the end. Its peak is
one tile of scores, [B, Lq * H, tile_slots] fp32, plus one tile of gathered rows. `impl="triton"`
runs one program per (sequence, block of 16 query rows x heads, flattened) and loops over the
sequence's slots in blocks of 16, reading each slot's page from the block table: scores never
leave registers. The Triton kernel has never run on a GPU (tested under TRITON_INTERPRET=1 only).

Slots at or past a sequence's end (kv_starts + lens) are never used: the Triton kernel never loads
them, the torch path zeroes them in each gathered tile before its matmuls (pages not written yet
may hold anything, NaN included, and 0 * NaN would leak into the sum).

`paged_mla_prefill_weights` is the second pass token eviction needs: given the final lse, the
attention probability each slot received, summed over heads and over the chunk's real rows.
`attend_rows` / `attend_rows_weights` are the same two passes over rows outside the pages (token
eviction's offloaded rows), tiled twins of `kernels.mla.weights.dense_attention`; their (o, lse)
merges with the pages' through `merge_attention`. These three are torch only.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.impl import check_impl, require_triton

TILE_SLOTS = 1024
"""Default slots per tile of the torch path (rounded to whole pages, or to a divisor of a page)."""


def tile_slots_for(requested: int, block_tokens: int) -> int:
    """The tile the torch path uses for a requested size: the largest multiple of `block_tokens`
    not above it, or, when a page is larger, the largest divisor of `block_tokens` not above it
    (a tile never straddles a page boundary, so every tile is one strided gather)."""
    if requested < 1:
        raise ValueError(f"tile_slots must be >= 1, got {requested}")
    if requested >= block_tokens:
        return requested // block_tokens * block_tokens
    return max(d for d in range(1, requested + 1) if block_tokens % d == 0)


class _OnlineSoftmax:
    """Running softmax over tiles of columns for [B, R] query rows: max m, sum l of exp(s - m) and
    acc = sum exp(s - m) v. A row that has seen nothing yet has m = -inf, l = 0, acc = 0; its
    `result` is o = 0, lse = -inf (the convention of `merge_attention`)."""

    def __init__(self, num: int, rows: int, value_dim: int, device: torch.device) -> None:
        f32 = torch.float32
        self.m = torch.full((num, rows), float("-inf"), dtype=f32, device=device)  # [B, R]
        self.l = torch.zeros(num, rows, dtype=f32, device=device)  # [B, R]
        self.acc = torch.zeros(num, rows, value_dim, dtype=f32, device=device)  # [B, R, Dv]

    def add(self, scores: Tensor, values: Tensor) -> None:
        """scores [B, R, T] fp32, scaled, -inf where masked (overwritten: it becomes the tile's
        probabilities, so no second tile is allocated); values [B, T, Dv] fp32, finite."""
        m_new = torch.maximum(self.m, scores.amax(dim=-1))  # [B, R]
        shift = m_new.masked_fill(m_new == float("-inf"), 0.0)  # rows with nothing yet: exp(-inf - 0) = 0
        alpha = (self.m - shift).exp()  # [B, R] rescales what was accumulated under the old max
        probs = scores.sub_(shift[..., None]).exp_()  # [B, R, T]
        self.l = self.l * alpha + probs.sum(dim=-1)
        self.acc = torch.baddbmm(self.acc * alpha[..., None], probs, values)
        self.m = m_new

    def result(self) -> tuple[Tensor, Tensor]:
        """(o [B, R, Dv] = acc / l, lse [B, R] = m + log l)."""
        o = self.acc / self.l.masked_fill(self.l == 0, 1.0)[..., None]
        return o, self.m + self.l.log()


def _tiles(cache: Tensor, block_tables: Tensor, ends: Tensor, max_end: int, tile_slots: int):
    """Yields (first slot, kv [B, T, Dc + Dr] fp32, slots [T]) for tiles covering slots [0, max_end)
    (the last one ends at a page or tile boundary), each gathered through the block table with the
    slots at or past each sequence's end zeroed. Table entries past a sequence's last page are
    never dereferenced (page 0 is read instead, and zeroed)."""
    block_tokens = cache.shape[1]
    tile = tile_slots_for(tile_slots, block_tokens)
    num = block_tables.shape[0]
    num_blocks = -(-max_end // block_tokens)
    span = num_blocks * block_tokens
    for lo in range(0, max_end, tile):
        if tile >= block_tokens:  # whole pages: one block gather
            c0, c1 = lo // block_tokens, min(lo + tile, span) // block_tokens
            cols = torch.arange(c0, c1, device=ends.device)  # [nb_tile]
            pages = block_tables[:, c0:c1].long().masked_fill(cols * block_tokens >= ends[:, None], 0)
            kv = cache.index_select(0, pages.reshape(-1)).view(num, (c1 - c0) * block_tokens, -1)
        else:  # a part of one page: the slot range of every page, then the pages
            col, off = divmod(lo, block_tokens)
            pages = block_tables[:, col].long().masked_fill(col * block_tokens >= ends, 0)  # [B]
            kv = cache[:, off:off + tile].index_select(0, pages)  # [B, T, Dc + Dr]
        slots = lo + torch.arange(kv.shape[1], device=ends.device)  # [T]
        yield lo, kv.float().masked_fill_((slots >= ends[:, None])[..., None], 0.0), slots


def _queries(q_lat: Tensor, q_rope: Tensor) -> Tensor:
    """[B, Lq, H, Dc], [B, Lq, H, Dr] -> q [B, Lq * H, Dc + Dr] fp32: one product scores both parts."""
    num, width, heads = q_lat.shape[:3]
    return torch.cat([q_lat, q_rope], dim=-1).float().view(num, width * heads, -1)


def _tile_scores(q: Tensor, kv: Tensor, slots: Tensor, starts: Tensor, ends: Tensor, width: int,
                 scale: float) -> Tensor:
    """Scaled scores [B, Lq * H, T] of one tile, -inf where a row may not attend: slot past the
    row's own position, or at/past the sequence's end (padded rows see every slot below the end)."""
    num, rows = q.shape[:2]
    scores = torch.bmm(q, kv.transpose(1, 2)).mul_(scale)  # [B, Lq*H, T]
    q_pos = starts[:, None] + torch.arange(width, device=q.device)  # [B, Lq] slot of each query row
    allowed = (slots <= q_pos[..., None]) & (slots < ends[:, None, None])  # [B, Lq, T]
    scores.view(num, width, rows // width, -1).masked_fill_(~allowed[:, :, None, :], float("-inf"))
    return scores


def _paged_mla_prefill_naive(q_lat, q_rope, cache, block_tables, kv_starts, lens, scale, max_end, tile_slots):
    num, width, heads, dc = q_lat.shape
    starts = kv_starts.long()
    ends = starts + lens.long()  # [B]
    q = _queries(q_lat, q_rope)  # [B, Lq*H, Dc + Dr]
    state = _OnlineSoftmax(num, width * heads, dc, q.device)
    for _, kv, slots in _tiles(cache, block_tables, ends, max_end, tile_slots):
        state.add(_tile_scores(q, kv, slots, starts, ends, width, scale), kv[..., :dc])
    o, lse = state.result()
    return o.view(num, width, heads, dc).to(q_lat.dtype), lse.view(num, width, heads)


@triton.jit
def _paged_mla_prefill_kernel(
    q_lat_ptr,  # [B, Lq, H, DC] contiguous
    q_rope_ptr,  # [B, Lq, H, DR] contiguous
    cache_ptr,  # [num_pages, block_tokens, DC + DR] strided
    block_tables_ptr,  # [B, max_blocks] strided
    starts_ptr,  # [B] slot of each sequence's first query row
    lens_ptr,  # [B] real query rows
    o_ptr,  # [B, Lq, H, DC] contiguous, q_lat's dtype
    lse_ptr,  # [B, Lq, H] fp32 (written when STORE_LSE)
    scale,
    LQ,
    H,
    DC,
    DR,
    block_tokens,
    stride_cache_page,
    stride_cache_slot,
    stride_cache_dim,
    stride_table_row,
    stride_table_col,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DC: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    STORE_LSE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] row = t * H + h of this sequence
    row_mask = r < LQ * H
    start = tl.load(starts_ptr + b)
    end = start + tl.load(lens_ptr + b)
    # Row t sees slots < start + t + 1; padded rows (t >= len) and rows past LQ * H see every slot
    # below the end (>= 1 slot each: len >= 1), so m is finite after the first block.
    limit = tl.minimum(start + r // H + 1, end)  # [BLOCK_M]
    hi = tl.max(limit, axis=0)  # slots this program reads; never past the end
    dc = tl.arange(0, BLOCK_DC)
    dc_mask = dc < DC
    q_rows = b * LQ * H + r  # [BLOCK_M] row index into [B * Lq * H, *]
    q_lat = tl.load(q_lat_ptr + q_rows[:, None] * DC + dc[None, :], mask=row_mask[:, None] & dc_mask[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_DC]
    if HAS_ROPE:
        dr = tl.arange(0, BLOCK_DR)
        dr_mask = dr < DR
        q_rope = tl.load(q_rope_ptr + q_rows[:, None] * DR + dr[None, :], mask=row_mask[:, None] & dr_mask[None, :],
                         other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_DR]
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DC], dtype=tl.float32)
    for lo in range(0, hi, BLOCK_N):
        tok = lo + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        tok_mask = tok < hi  # slots at or past the end (and their table entries) are never loaded
        page = tl.load(block_tables_ptr + b * stride_table_row + (tok // block_tokens) * stride_table_col,
                       mask=tok_mask, other=0).to(tl.int64)  # [BLOCK_N]
        rows = cache_ptr + page * stride_cache_page + (tok % block_tokens) * stride_cache_slot
        c_kv = tl.load(rows[:, None] + dc[None, :] * stride_cache_dim, mask=tok_mask[:, None] & dc_mask[None, :],
                       other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_DC]
        scores = tl.dot(q_lat, tl.trans(c_kv), input_precision="ieee")  # [BLOCK_M, BLOCK_N]
        if HAS_ROPE:
            k_rope = tl.load(rows[:, None] + (DC + dr[None, :]) * stride_cache_dim,
                             mask=tok_mask[:, None] & dr_mask[None, :], other=0.0).to(tl.float32)
            scores += tl.dot(q_rope, tl.trans(k_rope), input_precision="ieee")
        scores = tl.where(tok[None, :] < limit[:, None], scores * scale, float("-inf"))
        # Every row sees slot 0, which is in the first block: m_new is finite from there on, and
        # alpha = exp(-inf) = 0 on the first block.
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])  # [BLOCK_M, BLOCK_N]; masked slots give 0
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, c_kv, input_precision="ieee")
        m = m_new
    o = acc / l[:, None]
    tl.store(o_ptr + q_rows[:, None] * DC + dc[None, :], o.to(o_ptr.dtype.element_ty),
             mask=row_mask[:, None] & dc_mask[None, :])
    if STORE_LSE:
        tl.store(lse_ptr + q_rows, m + tl.log(l), mask=row_mask)


# Query rows (positions x heads, flattened) per program and slots per loop step; tl.dot needs every
# dim >= 16. Not tuned (no autotune: it fails under the interpreter).
_BLOCK_M = 16
_BLOCK_N = 16


def _paged_mla_prefill_triton(q_lat, q_rope, cache, block_tables, kv_starts, lens, scale):
    num, width, heads, dc = q_lat.shape
    dr = q_rope.shape[3]
    require_triton(_paged_mla_prefill_kernel, q_lat.device)
    o_lat = torch.empty_like(q_lat, memory_format=torch.contiguous_format)  # [B, Lq, H, Dc]
    lse = torch.empty(num, width, heads, dtype=torch.float32, device=q_lat.device)  # [B, Lq, H]
    if num == 0 or width == 0:
        return o_lat, lse
    block_dc = max(16, triton.next_power_of_2(dc))
    grid = (num, triton.cdiv(width * heads, _BLOCK_M))
    _paged_mla_prefill_kernel[grid](
        q_lat.contiguous(), q_rope.contiguous(), cache, block_tables, kv_starts, lens, o_lat, lse,
        float(scale), width, heads, dc, dr, cache.shape[1], cache.stride(0), cache.stride(1), cache.stride(2),
        block_tables.stride(0), block_tables.stride(1),
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_DC=block_dc, BLOCK_DR=max(16, triton.next_power_of_2(dr)),
        HAS_ROPE=dr > 0, STORE_LSE=True, num_warps=8 if block_dc >= 256 else 4,
    )
    return o_lat, lse


def _check_inputs(q_lat, q_rope, cache, block_tables, kv_starts, lens) -> None:
    """Validates shapes, dtypes, lengths and the page ids they need (one host sync)."""
    if q_lat.dim() != 4:
        raise ValueError(f"q_lat must be [B, Lq, H, Dc], got shape {tuple(q_lat.shape)}")
    num, width, heads, dc = q_lat.shape
    if q_rope.dim() != 4 or tuple(q_rope.shape[:3]) != (num, width, heads):
        raise ValueError(f"q_rope shape {tuple(q_rope.shape)} must be [B, Lq, H, Dr] = [{num}, {width}, {heads}, Dr]")
    dr = q_rope.shape[3]
    if cache.dim() != 3 or cache.shape[2] != dc + dr:
        raise ValueError(f"cache shape {tuple(cache.shape)} must be [num_pages, block_tokens, Dc + Dr] = "
                         f"[num_pages, block_tokens, {dc + dr}]")
    if block_tables.dim() != 2 or block_tables.shape[0] != num:
        raise ValueError(f"block_tables shape {tuple(block_tables.shape)} must be [B, max_blocks] = "
                         f"[{num}, max_blocks]")
    for name, x in (("block_tables", block_tables), ("kv_starts", kv_starts), ("lens", lens)):
        if x.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} dtype must be int32 or int64, got {x.dtype}")
    for name, x in (("kv_starts", kv_starts), ("lens", lens)):
        if tuple(x.shape) != (num,):
            raise ValueError(f"{name} shape {tuple(x.shape)} must be [B] = [{num}]")
    if num == 0:
        return
    num_pages, block_tokens = cache.shape[:2]
    max_blocks = block_tables.shape[1]
    ends = kv_starts.long() + lens.long()  # [B]
    needed = torch.arange(max_blocks, device=ends.device) * block_tokens < ends[:, None]  # [B, max_blocks]
    bad_ids = needed & ((block_tables < 0) | (block_tables >= num_pages))
    first, shortest, most, longest, num_bad = torch.stack(
        [kv_starts.min().long(), lens.min().long(), lens.max().long(), ends.max(), bad_ids.sum()]).tolist()
    if first < 0:
        raise ValueError(f"kv_starts must be >= 0, got {first}")
    if shortest < 1:
        raise ValueError(f"lens must be >= 1 (every sequence in a prefill has a new token), got {shortest}")
    if most > width:
        raise ValueError(f"lens must be <= Lq = {width} (queries are right-padded to the longest), got {most}")
    if longest > max_blocks * block_tokens:
        raise ValueError(f"kv_starts + lens = {longest} exceeds the block table's capacity max_blocks * "
                         f"block_tokens = {max_blocks} * {block_tokens} = {max_blocks * block_tokens}")
    if num_bad:
        b, i = bad_ids.nonzero()[0].tolist()
        raise ValueError(f"block_tables[{b}, {i}] = {int(block_tables[b, i])} is not a page id in "
                         f"[0, num_pages={num_pages})")


def paged_mla_prefill(q_lat: Tensor, q_rope: Tensor, cache: Tensor, block_tables: Tensor, kv_starts: Tensor,
                      lens: Tensor, *, scale: float, impl: str = "naive", check: bool = True,
                      max_end: int | None = None, tile_slots: int = TILE_SLOTS) -> tuple[Tensor, Tensor]:
    """Causal absorbed MLA of several sequences' prefill chunks over their paged latent cache.

    Args:
        q_lat: [B, Lq, H, Dc] q_nope already multiplied by W_uk, right-padded to the longest chunk.
        q_rope: [B, Lq, H, Dr] RoPE part of the query; Dr may be 0 (NoPE).
        cache: [num_pages, block_tokens, Dc + Dr] one layer's latent cache, any strides; the chunk's
            own rows are already written. Not mutated.
        block_tables: [B, max_blocks] int32/int64 page ids in slot order. Only the first
            ceil((kv_starts + lens) / block_tokens) entries of a row are read; the rest may hold
            anything, -1 included.
        kv_starts: [B] int, slot of each chunk's first token (the slots before it are its context).
        lens: [B] int, real rows of each chunk, 1 <= lens <= Lq.
        scale: softmax scale applied to the scores.
        impl: "naive" (torch, tiled; also "cpu") or "triton" (see module docstring).
        check: validate shapes, lengths and page ids (one host sync).
        max_end: max(kv_starts + lens) when the caller knows it on the host (the torch path then
            reads nothing back from the device); None = read it (one host sync).
        tile_slots: slots per tile of the torch path (`tile_slots_for` rounds it to the page).

    Returns:
        (o_lat [B, Lq, H, Dc] in q_lat's dtype (math in fp32), lse [B, Lq, H] fp32 log-sum-exp of
        each row's scaled scores: what `merge_attention` and `paged_mla_prefill_weights` need).
        Rows t >= lens[b] hold attention over every slot below the sequence's end.

    Raises ValueError on bad shapes, dtypes, lengths or needed page ids (with `check`), and
    RuntimeError if impl="triton" cannot run here. The Triton kernel has only run under
    TRITON_INTERPRET=1 (fp32, tests/kernels/test_mla_prefill.py), never on a GPU.
    """
    check_impl(impl)
    if check:
        _check_inputs(q_lat, q_rope, cache, block_tables, kv_starts, lens)
    if impl == "triton":
        return _paged_mla_prefill_triton(q_lat, q_rope, cache, block_tables, kv_starts, lens, scale)
    if max_end is None:
        max_end = int((kv_starts.long() + lens.long()).max()) if lens.numel() else 0
    return _paged_mla_prefill_naive(q_lat, q_rope, cache, block_tables, kv_starts, lens, scale, max_end, tile_slots)


def paged_mla_prefill_weights(q_lat: Tensor, q_rope: Tensor, cache: Tensor, block_tables: Tensor,
                              kv_starts: Tensor, lens: Tensor, lse: Tensor, *, scale: float, max_end: int,
                              tile_slots: int = TILE_SLOTS) -> Tensor:
    """Attention probability each slot received from a prefill chunk, summed over heads and over
    the chunk's real rows (t < lens[b]); torch, tiled like the naive `paged_mla_prefill`.

    Same inputs as `paged_mla_prefill` plus lse [B, Lq, H] (its output, or the lse of a softmax over
    more rows than the pages: probabilities are then relative to that union) and max_end (host int).
    Returns [B, ceil(max_end / block_tokens) * block_tokens] fp32; slots at or past a sequence's end
    are 0. Peak: one tile of scores, as the attention pass.
    """
    num, width, heads = q_lat.shape[:3]
    if tuple(lse.shape) != (num, width, heads):
        raise ValueError(f"lse shape {tuple(lse.shape)} must be [B, Lq, H] = [{num}, {width}, {heads}]")
    block_tokens = cache.shape[1]
    starts = kv_starts.long()
    ends = starts + lens.long()  # [B]
    q = _queries(q_lat, q_rope)  # [B, Lq*H, Dc + Dr]
    real = (torch.arange(width, device=q.device) < lens[:, None]).float()  # [B, Lq] rows that are not padding
    real_rows = real.repeat_interleave(heads, dim=1)[:, None, :]  # [B, 1, Lq*H]
    lse_rows = lse.float().reshape(num, width * heads, 1)  # [B, Lq*H, 1]
    span = -(-max_end // block_tokens) * block_tokens
    out = torch.zeros(num, span, dtype=torch.float32, device=q.device)  # [B, span]
    for lo, kv, slots in _tiles(cache, block_tables, ends, max_end, tile_slots):
        probs = _tile_scores(q, kv, slots, starts, ends, width, scale).sub_(lse_rows).exp_()  # [B, Lq*H, T]
        out[:, lo:lo + kv.shape[1]] = torch.bmm(real_rows, probs)[:, 0]
    return out


def attend_rows(q: Tensor, kv: Tensor, valid: Tensor, *, scale: float, value_dim: int,
                tile_slots: int = TILE_SLOTS) -> tuple[Tensor, Tensor]:
    """`dense_attention` in tiles of rows: q [B, R, W] over kv [B, M, W] where valid [B, M] (bool).

    Returns (o [B, R, value_dim] fp32, lse [B, R]; -inf and o = 0 where a sequence has no valid
    row). Peak: one tile of scores [B, R, tile_slots]."""
    num, rows = q.shape[:2]
    q = q.float()
    state = _OnlineSoftmax(num, rows, value_dim, q.device)
    for lo in range(0, kv.shape[1], tile_slots):
        tile_valid = valid[:, lo:lo + tile_slots]  # [B, T]
        tile = kv[:, lo:lo + tile_slots].float().masked_fill(~tile_valid[..., None], 0.0)  # [B, T, W]: no NaN leaks
        scores = torch.bmm(q, tile.transpose(1, 2)).mul_(scale)  # [B, R, T]
        scores.masked_fill_(~tile_valid[:, None, :], float("-inf"))
        state.add(scores, tile[..., :value_dim])
    return state.result()


def attend_rows_weights(q: Tensor, kv: Tensor, valid: Tensor, lse: Tensor, row_weights: Tensor, *, scale: float,
                        tile_slots: int = TILE_SLOTS) -> Tensor:
    """Probability each of the rows kv [B, M, W] received from queries q [B, R, W] given their final
    lse [B, R], summed over queries weighted by row_weights [B, R] (1 for a real query, 0 for
    padding): [B, M] fp32, 0 where not valid. Tiled like `attend_rows`."""
    q = q.float()
    out = torch.zeros(kv.shape[:2], dtype=torch.float32, device=q.device)  # [B, M]
    lse_rows, weights = lse.float()[..., None], row_weights.float()[:, None, :]  # [B, R, 1], [B, 1, R]
    for lo in range(0, kv.shape[1], tile_slots):
        tile_valid = valid[:, lo:lo + tile_slots]  # [B, T]
        tile = kv[:, lo:lo + tile_slots].float().masked_fill(~tile_valid[..., None], 0.0)  # [B, T, W]: no NaN leaks
        scores = torch.bmm(q, tile.transpose(1, 2)).mul_(scale)  # [B, R, T]
        scores.masked_fill_(~tile_valid[:, None, :], float("-inf"))
        out[:, lo:lo + tile.shape[1]] = torch.bmm(weights, scores.sub_(lse_rows).exp_())[:, 0]
    return out
