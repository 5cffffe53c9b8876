"""Page transfer between tensor-parallel layouts: KDA state pages re-sliced, MLA pages replicated.

A rank r of TP degree t holds KDA heads [r*H/t, (r+1)*H/t) of every KDA page, head-major from byte 0
(`CacheLayout.shard`). A head's bytes (S and conv tails of every layer of the group) are one contiguous
range (head-major pages), so a rank's KDA page is a byte range of the TP-1 page, and moving pages from degree a
to degree b is one byte-range copy per (source rank, destination rank) pair whose heads overlap: the copy
itself re-slices, nothing is gathered whole and reshuffled afterwards.

MLA pages hold the latent [c_kv, k_rope] that every query head reads (weight absorption, DeepSeek-V2
Sec. 2.1.2): splitting query heads over ranks cannot split the cache, so it is **replicated** on every
rank, as vLLM and SGLang do for MLA under TP. Each destination rank receives a page's used bytes
(`mla_block_bytes`) from exactly one source rank (destination d from source d % a, spreading the sends).

Words: *plan* — the `ByteCopy`s that move one page of a kind from layout a to layout b; the same for
every page of that kind, so a transfer applies each copy to all its pages at once (one strided copy, or
one message per copy carrying that range of every page). Padding bytes are never copied.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from memory.layout import CacheLayout
from memory.page_pool import PagePool

KINDS = ("kda", "mla")


@dataclass(frozen=True)
class ByteCopy:
    """Bytes [src_start, src_start + num_bytes) of a page on source TP rank `src_rank` go to bytes
    [dst_start, dst_start + num_bytes) of the same logical page on destination TP rank `dst_rank`."""

    src_rank: int
    src_start: int
    dst_rank: int
    dst_start: int
    num_bytes: int

    @property
    def src_end(self) -> int:
        return self.src_start + self.num_bytes

    @property
    def dst_end(self) -> int:
        return self.dst_start + self.num_bytes


@dataclass
class TransferStats:
    """What one process moved in `transfer_pages` (page bytes only)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_copied: int = 0
    """Moved within the process (source and destination rank on the same process)."""


def check_compatible(kind: str, src: CacheLayout, dst: CacheLayout) -> None:
    """Raise ValueError unless pages of `kind` can move from layout `src` to layout `dst`: both are
    TP shards of one model's layout (same groups, dims, block_tokens, page_bytes and dtypes)."""
    if kind not in KINDS:
        raise ValueError(f"tp reshard: kind={kind!r}, expected one of {KINDS}")
    for name, layout in (("src", src), ("dst", dst)):
        if not isinstance(layout, CacheLayout):
            raise ValueError(f"tp reshard: {name} layout is a {type(layout).__name__}, expected a CacheLayout")
    whole_src, whole_dst = src.shard(1), dst.shard(1)
    for field in dataclasses.fields(CacheLayout):
        a, b = getattr(whole_src, field.name), getattr(whole_dst, field.name)
        if a != b:
            why = " (a transfer moves bytes, it does not convert)" if field.name.endswith("dtype") else ""
            raise ValueError(f"tp reshard: src layout has {field.name}={a}, dst layout {field.name}={b}; expected "
                             f"layouts of one model at two TP degrees{why}")
    if not (src.kda_groups if kind == "kda" else src.mla_groups):
        raise ValueError(f"tp reshard: kind={kind!r} but the layout has no {kind.upper()} cache group")


def plan(kind: str, src: CacheLayout, dst: CacheLayout) -> list[ByteCopy]:
    """The byte-range copies that move one page of `kind` from TP degree src.tp_size to dst.tp_size.

    KDA: for each destination rank, the source ranks holding its heads, one copy per overlap (heads
    are contiguous ranges, so an overlap is one range); every destination byte of the state is
    written exactly once. MLA: one copy of the used bytes per destination rank, from source rank
    d % src.tp_size. Ordered by destination rank, then source rank.
    """
    check_compatible(kind, src, dst)
    if kind == "mla":
        return [ByteCopy(d % src.tp_size, 0, d, 0, src.mla_block_bytes) for d in range(dst.tp_size)]
    head_bytes = src.kda_head_bytes
    copies = []
    for d in range(dst.tp_size):
        wanted = dst.rank_heads(d)
        for s in range(src.tp_size):
            held = src.rank_heads(s)
            lo, hi = max(wanted.start, held.start), min(wanted.stop, held.stop)
            if lo < hi:
                copies.append(ByteCopy(s, (lo - held.start) * head_bytes, d, (lo - wanted.start) * head_bytes,
                                       (hi - lo) * head_bytes))
    return copies


def reshard_pages(kind: str, pages_by_rank: Sequence[torch.Tensor], src: CacheLayout, dst: CacheLayout,
                  out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """In-process re-slice of page bytes held as tensors (e.g. `PagePool.read_pages`, a host tier).

    pages_by_rank[r]: uint8 [num_pages, page_bytes] of source TP rank r, the same logical pages in the
    same order on every rank. Returns one uint8 [num_pages, page_bytes] per destination rank: `out`
    (mutated: only the planned bytes are written) or new zero-filled tensors on the sources' device.
    """
    copies = plan(kind, src, dst)
    if len(pages_by_rank) != src.tp_size:
        raise ValueError(f"tp reshard: got pages of {len(pages_by_rank)} source ranks, expected src tp_size="
                         f"{src.tp_size}")
    shape = tuple(pages_by_rank[0].shape)
    for r, pages in enumerate(pages_by_rank):
        if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.shape[1] != src.page_bytes \
                or tuple(pages.shape) != shape:
            raise ValueError(f"tp reshard: source rank {r} pages are {pages.dtype} {tuple(pages.shape)}, expected "
                             f"uint8 [num_pages, page_bytes={src.page_bytes}] with rank 0's shape {shape}")
    if out is None:
        out = [torch.zeros(shape, dtype=torch.uint8, device=pages_by_rank[0].device) for _ in range(dst.tp_size)]
    if len(out) != dst.tp_size or any(tuple(o.shape) != shape or o.dtype != torch.uint8 for o in out):
        raise ValueError(f"tp reshard: out holds {[(o.dtype, tuple(o.shape)) for o in out]}, expected dst "
                         f"tp_size={dst.tp_size} uint8 tensors of shape {shape}")
    for c in copies:
        out[c.dst_rank][:, c.dst_start:c.dst_end].copy_(pages_by_rank[c.src_rank][:, c.src_start:c.src_end])
    return list(out)


def _check_tags(kind: str, pool: PagePool, pages: Sequence[int], role: str) -> list[tuple[str, int]]:
    tags = [pool.group_of_page(p) for p in pages]
    for page, tag in zip(pages, tags):
        if tag is None or tag[0] != kind:
            raise ValueError(f"tp reshard: {role} page {page} is tagged {tag}, expected a page in use of kind "
                             f"{kind!r}")
    return tags


def reshard_pool_pages(kind: str, src_pools: Sequence[PagePool], src_pages: Sequence[Sequence[int]],
                       dst_pools: Sequence[PagePool], dst_pages: Sequence[Sequence[int]]) -> None:
    """In-process page transfer between the pools of two TP degrees (one pool per rank).

    src_pages[r] / dst_pages[r]: page ids on rank r's pool, the i-th entry of every list being the
    same logical page (ids may differ per rank; dst pages allocated by the caller with the source's
    group tag). Mutates only the planned byte ranges of the dst pages; reads only the planned ranges.
    """
    for role, pools, pages in (("src", src_pools, src_pages), ("dst", dst_pools, dst_pages)):
        if not pools or len(pools) != len(pages) or len(pools) != pools[0].layout.tp_size:
            raise ValueError(f"tp reshard: {len(pools)} {role} pools and {len(pages)} page lists, expected one "
                             f"of each per rank ({role} tp_size={pools[0].layout.tp_size if pools else '?'})")
        for r, pool in enumerate(pools):
            if pool.layout != pools[0].layout:
                raise ValueError(f"tp reshard: {role} pool of rank {r} has layout {pool.layout.describe()}, "
                                 f"expected rank 0's {pools[0].layout.describe()}")
    copies = plan(kind, src_pools[0].layout, dst_pools[0].layout)
    num = len(src_pages[0])
    tags = None
    for role, pools, pages in (("src", src_pools, src_pages), ("dst", dst_pools, dst_pages)):
        for r, (pool, ids) in enumerate(zip(pools, pages)):
            if len(ids) != num:
                raise ValueError(f"tp reshard: {role} rank {r} lists {len(ids)} pages, expected {num} (src rank 0's)")
            rank_tags = _check_tags(kind, pool, ids, f"{role} rank {r}")
            tags = tags or rank_tags
            if rank_tags != tags:
                i = next(i for i, (a, b) in enumerate(zip(rank_tags, tags)) if a != b)
                raise ValueError(f"tp reshard: logical page {i} is in group {rank_tags[i]} on {role} rank {r}, "
                                 f"expected {tags[i]} (its group on src rank 0)")
    for c in copies:
        data = src_pools[c.src_rank].read_byte_range(list(src_pages[c.src_rank]), c.src_start, c.src_end)
        dst_pools[c.dst_rank].write_byte_range(list(dst_pages[c.dst_rank]), c.dst_start, data)


def _ranks(ranks: Sequence[int], layout: CacheLayout, role: str) -> list[int]:
    ranks = [int(r) for r in ranks]
    if len(ranks) != layout.tp_size or len(set(ranks)) != len(ranks):
        raise ValueError(f"tp reshard: {role}_ranks={ranks}, expected {layout.tp_size} distinct process ranks "
                         f"({role} tp_size={layout.tp_size})")
    return ranks


def transfer_pages(kind: str, src_layout: CacheLayout, dst_layout: CacheLayout, *, src_ranks: Sequence[int],
                   dst_ranks: Sequence[int], src_pool: PagePool | None = None, src_pages: Sequence[int] = (),
                   dst_pool: PagePool | None = None, dst_pages: Sequence[int] = (),
                   group: dist.ProcessGroup | None = None) -> TransferStats:
    """Move pages of `kind` from TP degree a to degree b over torch.distributed point-to-point.

    src_ranks[r] / dst_ranks[r]: the process (global rank) holding source / destination TP rank r; a
    process may hold one of each. Every process in src_ranks or dst_ranks calls this with the same
    layouts and ranks (others need not call it); a source passes `src_pool` and `src_pages`, a
    destination `dst_pool` and `dst_pages` (dst pages allocated with the source's group tag), every
    list naming the same logical pages in the same order (counts that differ fail in the backend).
    Each copy of the plan is one message carrying that byte range of every page, read straight from
    the pool (`read_byte_range`) and written straight into it: only the bytes a destination needs
    travel. Same-process copies stay local. gloo messages go through host memory.
    Returns what this process sent, received and copied locally (mutates only dst pages' planned bytes).
    """
    copies = plan(kind, src_layout, dst_layout)
    src_ranks, dst_ranks = _ranks(src_ranks, src_layout, "src"), _ranks(dst_ranks, dst_layout, "dst")
    me = dist.get_rank()
    src_pages, dst_pages = list(src_pages), list(dst_pages)
    for role, ranks, pool, pages, layout in (("src", src_ranks, src_pool, src_pages, src_layout),
                                             ("dst", dst_ranks, dst_pool, dst_pages, dst_layout)):
        if me not in ranks:
            continue
        if pool is None or pool.layout != layout:
            raise ValueError(f"tp reshard: process {me} is {role} TP rank {ranks.index(me)} but its {role}_pool "
                             f"{'is None' if pool is None else 'has layout ' + pool.layout.describe()}, expected a "
                             f"pool of layout {layout.describe()}")
        _check_tags(kind, pool, pages, f"{role} rank {ranks.index(me)}")
    if me in src_ranks and me in dst_ranks and len(src_pages) != len(dst_pages):
        raise ValueError(f"tp reshard: {len(src_pages)} src pages and {len(dst_pages)} dst pages, expected equal "
                         f"counts")
    stats = TransferStats()
    wire = torch.device("cpu") if dist.get_backend(group) == "gloo" else None
    pending, received = [], []
    for tag, c in enumerate(copies):
        sender, receiver = src_ranks[c.src_rank], dst_ranks[c.dst_rank]
        if sender == me and receiver == me:
            data = src_pool.read_byte_range(src_pages, c.src_start, c.src_end)
            dst_pool.write_byte_range(dst_pages, c.dst_start, data)
            stats.bytes_copied += len(dst_pages) * c.num_bytes
        elif sender == me:
            data = src_pool.read_byte_range(src_pages, c.src_start, c.src_end).to(wire or src_pool.device)
            pending.append((dist.isend(data, receiver, group=group, tag=tag), data))  # keep data alive until sent
            stats.bytes_sent += data.numel()
        elif receiver == me:
            data = torch.empty(len(dst_pages), c.num_bytes, dtype=torch.uint8, device=wire or dst_pool.device)
            pending.append((dist.irecv(data, sender, group=group, tag=tag), data))
            received.append((c, data))
            stats.bytes_received += data.numel()
    for request, _ in pending:
        request.wait()
    for c, data in received:
        dst_pool.write_byte_range(dst_pages, c.dst_start, data)
    return stats
