"""Unified paged pool: MLA KV pages and KDA state pages of one size in one flat buffer.

Words:
- cache group: `group_layers` consecutive layers of one kind ("kda" or "mla"), taken in layer
  order. A page belongs to exactly one group; its tag is ("kda" | "mla", group index).
- slot: a layer's position inside its group; every page of the group reserves one slot per layer.
  The last group of a kind may have fewer layers; its pages keep full-size slots (the tail is unused).
- KDA page: one sequence's full recurrent state for every layer of its group, stored **head-major**
  `[num_heads][group_layers][unit]`, where a head's *unit* is S `[dk, dv]` then its conv tails
  `[3 (q, k, v), kernel-1, dk]`. One head's bytes across the whole group are thus one contiguous,
  self-contained range (`head_byte_range`): tensor-parallel re-slicing is a byte-range copy.
- MLA page: `block_tokens` tokens of [c_kv, k_rope] for every layer of its group,
  `[group_layers][block_tokens][latent_dim]`.
- block_tokens: chosen so an MLA block and a KDA state fill the same page_bytes:
  kda_state_bytes_per_group / mla_token_bytes_per_group, rounded down to a multiple of 16.

Bookkeeping (free list, refcounts, tags) is plain Python so it is testable on CPU; only the page
bytes live on the device. Like nano-vllm's BlockManager, sharing is by refcount: a fork increfs
the pages it shares and copies (`copy_pages`) the one it will write (copy-on-write).
"""
from __future__ import annotations

import heapq
import operator
from collections import Counter
from collections.abc import Iterable

import torch

from memory.layout import CacheLayout
from memory.pool_figures import PoolFigures
from models.state import KDALayerState


class OutOfPages(RuntimeError):
    """allocate() asked for more pages than are free; nothing was allocated."""

    def __init__(self, num_requested: int, num_free: int) -> None:
        super().__init__(f"page pool: requested {num_requested} pages, {num_free} free")
        self.num_requested, self.num_free = num_requested, num_free


class PagePool(PoolFigures):
    """One flat byte buffer [num_pages, page_bytes] (uint8) on one device; pages of all cache groups
    share one free list and one ref-count scheme.

    A page is free (refcount 0, no tag) or used (refcount >= 1, tagged with its cache group). The
    free list is a min-heap, so allocation hands out the lowest free ids first (deterministic).
    Page contents are undefined when allocated: zero KDA pages (`zero_pages`) before a new sequence.
    Views (`mla_view`, `kda_views`, `page_bytes_view`) alias the buffer; they cover every page, and
    the caller indexes them with page ids it holds a reference on.
    """

    def __init__(self, layout: CacheLayout, num_pages: int, device: str | torch.device = "cpu") -> None:
        if not isinstance(num_pages, int) or num_pages <= 0:
            raise ValueError(f"page pool: num_pages={num_pages!r}, expected a positive integer")
        self.layout = layout
        self.device = torch.device(device)
        self._buffer = torch.empty(num_pages, layout.page_bytes, dtype=torch.uint8,
                                   device=self.device)  # [num_pages, page_bytes]
        self._refcounts = [0] * num_pages
        self._tags: list[tuple[str, int] | None] = [None] * num_pages
        self._free = list(range(num_pages))  # min-heap (a sorted list is one)
        self._released = False

    @classmethod
    def from_bytes(cls, layout: CacheLayout, pool_bytes: int, device: str | torch.device = "cpu") -> "PagePool":
        """A pool of pool_bytes // page_bytes pages (the remainder is left unused)."""
        num_pages = pool_bytes // layout.page_bytes
        if num_pages <= 0:
            raise ValueError(f"page pool: pool_bytes={pool_bytes:,} holds no page of page_bytes={layout.page_bytes:,}; "
                             f"expected at least one page")
        return cls(layout, num_pages, device)

    # ---- figures (num_pages, num_free, num_used, pool_bytes: PoolFigures) -----------------------
    @property
    def page_bytes(self) -> int:
        return self.layout.page_bytes

    @property
    def utilization(self) -> float:
        """Fraction of pages in use."""
        return self.num_used / self.num_pages

    @property
    def is_released(self) -> bool:
        return self._released

    # ---- allocation and sharing -----------------------------------------------------------------
    def allocate(self, num: int, group: tuple[str, int]) -> list[int]:
        """Take `num` free pages (lowest ids first) for `group`; each gets refcount 1 and the group's tag.

        All or nothing: raises OutOfPages, changing nothing, if fewer than `num` are free.
        """
        self._check_awake("allocate")
        group = self._check_group(group)
        if not isinstance(num, int) or num < 0:
            raise ValueError(f"page pool: allocate num={num!r}, expected an integer >= 0")
        if num > len(self._free):
            raise OutOfPages(num, len(self._free))
        pages = [heapq.heappop(self._free) for _ in range(num)]
        for page in pages:
            self._refcounts[page] = 1
            self._tags[page] = group
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """Add one reference per occurrence in `pages` (all must be in use; checked before any change)."""
        pages = [self._check_used(page, "incref") for page in pages]
        for page in pages:
            self._refcounts[page] += 1

    def decref(self, pages: Iterable[int]) -> list[int]:
        """Drop one reference per occurrence in `pages`; returns (ascending) the pages that reached 0,
        which are back on the free list and untagged. Checked before any change: a page dropped more
        times than its refcount raises ValueError and nothing changes."""
        counts = Counter(self._check_used(page, "decref") for page in pages)
        for page, n in counts.items():
            if n > self._refcounts[page]:
                raise ValueError(f"page pool: decref page {page} {n} times, but its refcount is "
                                 f"{self._refcounts[page]}")
        freed = []
        for page, n in counts.items():
            self._refcounts[page] -= n
            if self._refcounts[page] == 0:
                self._tags[page] = None
                heapq.heappush(self._free, page)
                freed.append(page)
        return sorted(freed)

    def refcount(self, page: int) -> int:
        return self._refcounts[self._check_page(page)]

    def group_of_page(self, page: int) -> tuple[str, int] | None:
        """The cache group tag of a used page, None for a free one."""
        return self._tags[self._check_page(page)]

    # ---- typed views (alias the buffer) ---------------------------------------------------------
    def mla_view(self, layer: int) -> torch.Tensor:
        """[num_pages, block_tokens, latent_dim] cache_dtype view of MLA `layer`'s slot in every page.

        Writes go to the pool. Meaningful only at pages tagged with the layer's MLA group; valid
        until release() and again after reacquire().
        """
        self._check_awake("mla_view")
        kind, _, slot = self.layout.group_of(layer)
        if kind != "mla":
            raise ValueError(f"page pool: mla_view(layer={layer}) but layer {layer} is a {kind} layer")
        lay = self.layout
        n = lay.block_tokens * lay.latent_dim
        typed = self._buffer.view(lay.cache_dtype)  # [num_pages, page_bytes // itemsize]
        return typed[:, slot * n:(slot + 1) * n].unflatten(1, (lay.block_tokens, lay.latent_dim))

    def kda_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(state [num_pages, H, dk, dv], conv_tail [num_pages, H, 3 (q, k, v), kernel-1, dk]) state_dtype
        views of KDA `layer`'s slot in every page.

        Writes go to the pool. Meaningful only at pages tagged with the layer's KDA group; valid
        until release() and again after reacquire(). conv_tail[p, h, w, t, d] is channel
        w * H * dk + h * dk + d of KDALayerState.conv_tail[t] (see read/write_kda_state).
        """
        self._check_awake("kda_views")
        kind, _, slot = self.layout.group_of(layer)
        if kind != "kda":
            raise ValueError(f"page pool: kda_views(layer={layer}) but layer {layer} is a {kind} layer")
        lay = self.layout
        h, dk, unit = lay.num_heads, lay.head_dim, lay.kda_unit_elems
        typed = self._buffer.view(lay.state_dtype)  # [num_pages, page_bytes // itemsize]
        heads = typed[:, :h * lay.group_layers * unit].unflatten(1, (h, lay.group_layers, unit))[:, :, slot]
        state = heads[..., :dk * dk].unflatten(-1, (dk, dk))  # [num_pages, H, dk, dv]
        conv = heads[..., dk * dk:].unflatten(-1, (3, lay.conv_kernel - 1, dk))  # [num_pages, H, 3, K-1, dk]
        return state, conv

    def page_bytes_view(self, page: int) -> torch.Tensor:
        """uint8 [page_bytes] view of one page."""
        self._check_awake("page_bytes_view")
        return self._buffer[self._check_page(page)]

    def head_byte_range(self, head: int) -> tuple[int, int]:
        """[start, end) bytes of one KDA head's block inside a KDA page (see CacheLayout.head_byte_range)."""
        return self.layout.head_byte_range(head)

    # ---- whole-state helpers --------------------------------------------------------------------
    def write_kda_state(self, page: int, layer: int, state: KDALayerState) -> None:
        """Store one layer's KDALayerState (S [H, dk, dv], conv_tail [K-1, 3*H*dk]) in `page`'s slot."""
        page = self._check_used(page, "write_kda_state")
        s_view, conv_view = self.kda_views(layer)
        lay = self.layout
        s_view[page].copy_(state.recurrent)
        tail = state.conv_tail.view(lay.conv_kernel - 1, 3, lay.num_heads, lay.head_dim)  # [K-1, 3, H, dk]
        conv_view[page].copy_(tail.permute(2, 1, 0, 3))  # [H, 3, K-1, dk]

    def read_kda_state(self, page: int, layer: int, dtype: torch.dtype = torch.float32) -> KDALayerState:
        """A fresh KDALayerState (copies, `dtype`) of one layer's slot in `page`; safe to keep after decref."""
        page = self._check_used(page, "read_kda_state")
        s_view, conv_view = self.kda_views(layer)
        lay = self.layout
        tail = conv_view[page].permute(2, 1, 0, 3)  # [K-1, 3, H, dk]
        return KDALayerState(recurrent=s_view[page].to(dtype, copy=True),
                             conv_tail=tail.reshape(lay.conv_kernel - 1, -1).to(dtype, copy=True))

    def zero_pages(self, pages: Iterable[int]) -> None:
        """Zero every byte of `pages` (used ones): a new sequence's KDA state starts at S = 0, empty tails."""
        self._check_awake("zero_pages")
        pages = [self._check_used(page, "zero_pages") for page in pages]
        if pages:
            self._buffer[torch.tensor(pages, device=self.device)] = 0

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Byte-copy page src[i] -> dst[i] (copy-on-write, forking a KDA state); one gather then one scatter.

        All pages must be in use, dst distinct, and each dst tagged with its src's group. Bookkeeping
        (refcounts, tags) is unchanged.
        """
        self._check_awake("copy_pages")
        src = [self._check_used(page, "copy_pages src") for page in src]
        dst = [self._check_used(page, "copy_pages dst") for page in dst]
        if len(src) != len(dst):
            raise ValueError(f"page pool: copy_pages got {len(src)} src and {len(dst)} dst pages, "
                             f"expected equal counts")
        if len(set(dst)) != len(dst):
            raise ValueError(f"page pool: copy_pages dst {dst} has duplicates, expected distinct pages")
        for s, d in zip(src, dst):
            if self._tags[s] != self._tags[d]:
                raise ValueError(f"page pool: copy_pages {s} -> {d}: src group {self._tags[s]} != dst group "
                                 f"{self._tags[d]}, expected equal groups")
        if src:
            # both index lists in one staged, non-blocking copy (a pageable copy per list would
            # block the host twice on CUDA)
            host = torch.tensor([src, dst], dtype=torch.long, device="cpu", pin_memory=self.device.type == "cuda")
            src_t, dst_t = host.to(self.device, non_blocking=True)  # [n] each
            self._buffer.index_copy_(0, dst_t, self._buffer.index_select(0, src_t))

    def read_pages(self, pages: list[int]) -> torch.Tensor:
        """A copy of the pages' bytes, uint8 [len(pages), page_bytes] (one gather), for a host tier."""
        self._check_awake("read_pages")
        pages = [self._check_used(page, "read_pages") for page in pages]
        return self._buffer.index_select(0, torch.tensor(pages, dtype=torch.long, device=self.device))

    def write_pages(self, pages: list[int], data: torch.Tensor) -> None:
        """Overwrite the pages with `data` uint8 [len(pages), page_bytes] (one scatter; `data` may live
        on another device, e.g. host memory). Pages must be in use and distinct."""
        self._check_awake("write_pages")
        pages = [self._check_used(page, "write_pages") for page in pages]
        if tuple(data.shape) != (len(pages), self.layout.page_bytes) or data.dtype != torch.uint8:
            raise ValueError(f"page pool: write_pages got {data.dtype} {tuple(data.shape)}, expected uint8 "
                             f"{(len(pages), self.layout.page_bytes)}")
        if len(set(pages)) != len(pages):
            raise ValueError(f"page pool: write_pages pages {pages} have duplicates, expected distinct pages")
        if pages:
            index = torch.tensor(pages, dtype=torch.long, device=self.device)
            self._buffer.index_copy_(0, index, data.to(self.device, non_blocking=True))

    def read_byte_range(self, pages: list[int], start: int, end: int) -> torch.Tensor:
        """A copy of bytes [start, end) of each page, uint8 [len(pages), end - start] (one gather of
        only those bytes): the unit of a tensor-parallel re-slice (memory/tp_reshard.py)."""
        self._check_awake("read_byte_range")
        pages = [self._check_used(page, "read_byte_range") for page in pages]
        self._check_byte_range(start, end, "read_byte_range")
        index = torch.tensor(pages, dtype=torch.long, device=self.device)
        return self._buffer[:, start:end].index_select(0, index)

    def write_byte_range(self, pages: list[int], start: int, data: torch.Tensor) -> None:
        """Overwrite bytes [start, start + data.shape[1]) of each page with `data` uint8 [len(pages), n]
        (one scatter; `data` may live on another device). The pages' other bytes are untouched.
        Pages must be in use and distinct."""
        self._check_awake("write_byte_range")
        pages = [self._check_used(page, "write_byte_range") for page in pages]
        if data.dim() != 2 or data.shape[0] != len(pages) or data.dtype != torch.uint8:
            raise ValueError(f"page pool: write_byte_range got {data.dtype} {tuple(data.shape)}, expected uint8 "
                             f"[{len(pages)}, num_bytes]")
        if len(set(pages)) != len(pages):
            raise ValueError(f"page pool: write_byte_range pages {pages} have duplicates, expected distinct pages")
        end = start + data.shape[1]
        self._check_byte_range(start, end, "write_byte_range")
        if pages:
            index = torch.tensor(pages, dtype=torch.long, device=self.device)
            self._buffer[:, start:end].index_copy_(0, index, data.to(self.device, non_blocking=True))

    # ---- sleep / wake ---------------------------------------------------------------------------
    def release(self) -> None:
        """Sleep: free the buffer's memory (its storage is resized to 0 bytes, so memory is freed even
        while others hold views). Refuses while any page is in use. Until reacquire(), views must not
        be touched: reading a view of a released storage is undefined and can crash the process.
        On CUDA the freed blocks are also returned to the driver (torch.cuda.empty_cache)."""
        self._check_awake("release")
        if self.num_used:
            raise RuntimeError(f"page pool: cannot release, {self.num_used} pages are still in use "
                               f"(refcount >= 1); decref them first")
        self._buffer.untyped_storage().resize_(0)
        self._released = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def reacquire(self) -> None:
        """Wake: allocate the buffer again (same storage object, new memory; contents undefined, all
        pages free). Views taken before release() are valid again (at a new address: recapture CUDA graphs)."""
        if not self._released:
            raise RuntimeError("page pool: reacquire() on a pool that is not released")
        self._buffer.untyped_storage().resize_(self.num_pages * self.layout.page_bytes)
        self._released = False

    # ---- integrity ------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Recompute the bookkeeping invariants; raises RuntimeError naming the first broken one.

        free + used == num_pages; free pages have refcount 0 and no tag; used pages refcount >= 1 and
        a valid group tag; the free list has no duplicates and is a min-heap; a released pool has no
        used page and a 0-byte storage.
        """
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            dup = [p for p, n in Counter(self._free).items() if n > 1]
            raise RuntimeError(f"page pool integrity: free list has duplicates {dup}")
        bad = [p for p in free_set if not (isinstance(p, int) and 0 <= p < self.num_pages)]
        if bad:
            raise RuntimeError(f"page pool integrity: free list holds ids {bad} outside 0..{self.num_pages - 1}")
        for i in range(1, len(self._free)):
            if self._free[(i - 1) // 2] > self._free[i]:
                raise RuntimeError(f"page pool integrity: free list is not a min-heap at index {i}")
        valid_groups = set(self.layout.groups)
        num_used = 0
        for page, (count, tag) in enumerate(zip(self._refcounts, self._tags)):
            if page in free_set:
                if count != 0 or tag is not None:
                    raise RuntimeError(f"page pool integrity: free page {page} has refcount {count} and tag {tag}, "
                                       f"expected 0 and None")
            else:
                num_used += 1
                if count < 1 or tag not in valid_groups:
                    raise RuntimeError(f"page pool integrity: used page {page} has refcount {count} and tag {tag}, "
                                       f"expected >= 1 and one of {sorted(valid_groups)}")
        if len(self._free) + num_used != self.num_pages:
            raise RuntimeError(f"page pool integrity: {len(self._free)} free + {num_used} used != "
                               f"num_pages={self.num_pages}")
        nbytes = self._buffer.untyped_storage().nbytes()
        expected = 0 if self._released else self.num_pages * self.layout.page_bytes
        if nbytes != expected:
            raise RuntimeError(f"page pool integrity: buffer holds {nbytes} bytes, expected {expected} "
                               f"(released={self._released})")
        if self._released and num_used:
            raise RuntimeError(f"page pool integrity: released pool has {num_used} used pages")

    # ---- argument checks ------------------------------------------------------------------------
    def _check_page(self, page: int) -> int:
        try:
            index = operator.index(page)
        except TypeError:
            index = -1
        if isinstance(page, bool) or not 0 <= index < self.num_pages:
            raise ValueError(f"page pool: page {page!r} out of range, expected an int in 0..{self.num_pages - 1}")
        return index

    def _check_used(self, page: int, what: str) -> int:
        page = self._check_page(page)
        if self._refcounts[page] == 0:
            raise ValueError(f"page pool: {what} on free page {page}, expected a page in use (refcount >= 1)")
        return page

    def _check_byte_range(self, start: int, end: int, what: str) -> None:
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= self.layout.page_bytes):
            raise ValueError(f"page pool: {what} bytes [{start!r}, {end!r}), expected 0 <= start <= end <= "
                             f"page_bytes={self.layout.page_bytes}")

    def _check_group(self, group: tuple[str, int]) -> tuple[str, int]:
        group = tuple(group)
        if group not in set(self.layout.groups):
            raise ValueError(f"page pool: unknown cache group {group!r}, expected one of {self.layout.groups}")
        return group

    def _check_awake(self, what: str) -> None:
        if self._released:
            raise RuntimeError(f"page pool: {what} while released; call reacquire() first")
