"""The host tier of the KV cache (SPEC §6, issue 7): host-DRAM pages the size of the device pool's.

`HostPagePool` is a byte store: one uint8 buffer [num_pages, page_bytes] in host memory (pinned
when the device pool is on a GPU, so copies can run asynchronously), a free list, and a group tag
per used page so a page only ever goes back to a device page of its own cache group. It knows
nothing of prefixes: the prefix cache (rollout/prefix_cache.py) decides what to write back, what to
prefetch and what to drop, and calls `store` (device -> host) and `load` (host -> device).
Its bytes are leased from the host-DRAM ledger (`memory/host_ledger.py`) before the buffer is
allocated and returned by `close()`, so an oversized pool is a clear error, not an OOM kill.

Counters: `bytes_stored` (device -> host) and `bytes_loaded` (host -> device), for the write-back vs
write-through comparison. Invariant (`check_integrity`): free + used == num_pages; free <=> no tag;
no duplicate in the free list.
"""
from __future__ import annotations

import heapq

import torch

from memory.host_ledger import HostLedger
from memory.page_pool import OutOfPages, PagePool
from memory.pool_figures import PoolFigures


class HostPagePool(PoolFigures):
    def __init__(self, page_bytes: int, num_pages: int, ledger: HostLedger | None = None,
                 consumer: str = "kv_pool", pin_memory: bool = False) -> None:
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"host KV pool: num_pages={num_pages!r}, expected a positive integer")
        if page_bytes < 1:
            raise ValueError(f"host KV pool: page_bytes={page_bytes}, expected >= 1")
        self.page_bytes, self.ledger, self.consumer = page_bytes, ledger, consumer
        if ledger is not None:
            ledger.lease(consumer, num_pages * page_bytes)  # raises before anything is allocated
        self._buffer = torch.empty(num_pages, page_bytes, dtype=torch.uint8, pin_memory=pin_memory)
        self._tags: list[tuple[str, int] | None] = [None] * num_pages
        self._free = list(range(num_pages))
        self._closed = False
        self.bytes_stored = 0
        self.bytes_loaded = 0

    @classmethod
    def from_bytes(cls, page_bytes: int, pool_bytes: int, **kw) -> "HostPagePool":
        if pool_bytes // page_bytes < 1:
            raise ValueError(f"host KV pool: {pool_bytes:,} bytes hold no page of {page_bytes:,} bytes")
        return cls(page_bytes, pool_bytes // page_bytes, **kw)

    def allocate(self, num: int, group: tuple[str, int]) -> list[int]:
        """`num` free host pages tagged `group`; all or nothing (OutOfPages, nothing changed)."""
        self._check_open()
        if num > len(self._free):
            raise OutOfPages(num, len(self._free))
        pages = [heapq.heappop(self._free) for _ in range(num)]
        for page in pages:
            self._tags[page] = group
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if self._tags[page] is None:
                raise ValueError(f"host KV pool: page {page} freed twice (it is not in use)")
        for page in pages:
            self._tags[page] = None
            heapq.heappush(self._free, page)

    def tag(self, page: int) -> tuple[str, int] | None:
        return self._tags[page]

    def store(self, host_pages: list[int], pool: PagePool, device_pages: list[int]) -> None:
        """Copy device pages -> host pages (one gather on the device, one copy across)."""
        self._check_pairs(host_pages, pool, device_pages)
        if host_pages:
            data = pool.read_pages(device_pages)
            self._buffer.index_copy_(0, torch.tensor(host_pages, dtype=torch.long), data.to("cpu"))
            self.bytes_stored += len(host_pages) * self.page_bytes

    def load(self, host_pages: list[int], pool: PagePool, device_pages: list[int]) -> None:
        """Copy host pages -> device pages (one gather on the host, one scatter on the device)."""
        self._check_pairs(host_pages, pool, device_pages)
        if host_pages:
            pool.write_pages(device_pages, self._buffer.index_select(0, torch.tensor(host_pages, dtype=torch.long)))
            self.bytes_loaded += len(host_pages) * self.page_bytes

    def page_bytes_view(self, page: int) -> torch.Tensor:
        """uint8 [page_bytes] view of one host page (tests read entries through it)."""
        self._check_open()
        return self._buffer[page]

    def close(self) -> None:
        """Free the buffer and return its bytes to the ledger."""
        if self._closed:
            return
        self._buffer = torch.empty(0, self.page_bytes, dtype=torch.uint8)
        self._closed = True
        if self.ledger is not None:
            self.ledger.release(self.consumer, self.pool_bytes)

    def check_integrity(self) -> None:
        if len(set(self._free)) != len(self._free):
            raise AssertionError("host KV pool: duplicate pages in the free list")
        free = set(self._free)
        for page, tag in enumerate(self._tags):
            if (tag is None) != (page in free):
                raise AssertionError(f"host KV pool: page {page} tag {tag} disagrees with the free list")

    def _check_pairs(self, host_pages: list[int], pool: PagePool, device_pages: list[int]) -> None:
        self._check_open()
        if len(host_pages) != len(device_pages):
            raise ValueError(f"host KV pool: {len(host_pages)} host pages vs {len(device_pages)} device pages")
        if pool.layout.page_bytes != self.page_bytes:
            raise ValueError(f"host KV pool: page_bytes {self.page_bytes} != device pool's {pool.layout.page_bytes}")
        for h, d in zip(host_pages, device_pages):
            if self._tags[h] is None or self._tags[h] != pool.group_of_page(d):
                raise ValueError(f"host KV pool: host page {h} ({self._tags[h]}) and device page {d} "
                                 f"({pool.group_of_page(d)}) are not both in use in the same group")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("host KV pool: used after close()")
