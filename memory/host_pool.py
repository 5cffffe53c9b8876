"""The host tier of the KV cache: host-DRAM pages the size of the device pool's.

`HostPagePool` is a byte store: one uint8 buffer [num_pages, page_bytes] in host memory (pinned
when the device pool is on a GPU, so copies can run asynchronously), a free list, and a group tag
per used page so a page only ever goes back to a device page of its own cache group. It knows
nothing of prefixes: the prefix cache (rollout/kv/prefix_cache.py) decides what to write back, what to
prefetch and what to drop, and calls `store` (device -> host) and `load` (host -> device).
Its bytes are leased from the host-DRAM ledger (`memory/host_ledger.py`) before the buffer is
allocated and returned by `close()`, so an oversized pool is a clear error, not an OOM kill.

Lifecycle (host DRAM is time-multiplexed): a pool may give its buffer and lease back between rollouts
(`suspend`) and take a new lease, of any size holding its used slots, at the next one (`resume`);
the books (tags, free list) stay, the bytes do not: rollout/kv/host_spill.py writes the live slots to
NVMe first and reads them back after. `unleased` builds a pool that starts suspended with no page
(`engine.host_pool_mb=auto`: sized at each rollout from what the ledger has free).

Copies (memory/host_copies.py): `store` and `load` return a `CopyTicket`; on a CUDA pool they run
on a side stream, non-blocking, straight between the pinned buffer and the device. The device-side
reader of loaded pages waits on the ticket (`wait_device`, rollout/kv/page_copies.py does); host-side
readers of the buffer (`page_bytes_view`, `buffer_rows`) and `suspend`/`close` wait here.
`sync_copies=True` switches to the plain synchronous reference path. On a CPU device pool,
`cpu_async_loads=True` (or setting `copier.cpu_async_loads` later) runs loads on the copier's worker
thread, the CPU side stream, so a prefetch overlaps the forward pass; `close()` stops that thread.

Counters: `bytes_stored` (device -> host) and `bytes_loaded` (host -> device), for the write-back vs
write-through comparison. Invariant (`check_integrity`): free + used == num_pages; free <=> no tag;
no duplicate in the free list.
"""
from __future__ import annotations

import heapq

import torch

from memory.host_copies import CopyTicket, HostCopier
from memory.host_ledger import HostLedger
from memory.page_pool import OutOfPages, PagePool
from memory.pool_figures import PoolFigures


class HostPagePool(PoolFigures):
    def __init__(self, page_bytes: int, num_pages: int, ledger: HostLedger | None = None,
                 consumer: str = "kv_pool", pin_memory: bool = False, cpu_async_loads: bool = False) -> None:
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
        self._suspended = False
        self._pin = pin_memory
        self.bytes_stored = 0
        self.bytes_loaded = 0
        self.copier = HostCopier(cpu_async_loads=cpu_async_loads)
        self.sync_copies = False
        """Copy with the plain synchronous reference (`host_copies.store_sync`/`load_sync`)."""

    @classmethod
    def from_bytes(cls, page_bytes: int, pool_bytes: int, **kw) -> "HostPagePool":
        if pool_bytes // page_bytes < 1:
            raise ValueError(f"host KV pool: {pool_bytes:,} bytes hold no page of {page_bytes:,} bytes")
        return cls(page_bytes, pool_bytes // page_bytes, **kw)

    # ---- lifecycle: leased per rollout, time-multiplexed with the training states -------------------
    @classmethod
    def unleased(cls, page_bytes: int, ledger: HostLedger | None = None, consumer: str = "kv_pool",
                 pin_memory: bool = False, cpu_async_loads: bool = False) -> "HostPagePool":
        """A pool of no page, no buffer and no lease yet (`engine.host_pool_mb=auto`): `resume(n)`
        leases and allocates it when the DRAM is free (the phase orchestrator, at each rollout)."""
        pool = cls(page_bytes, 1, ledger=None, consumer=consumer, pin_memory=pin_memory,
                   cpu_async_loads=cpu_async_loads)
        pool.ledger, pool._tags, pool._free = ledger, [], []
        pool.suspend()
        return pool

    @property
    def is_suspended(self) -> bool:
        """No buffer and no lease (`suspend`): the books stay, the bytes are gone until `resume`."""
        return self._suspended

    @property
    def num_free(self) -> int:
        return 0 if self._suspended else len(self._free)

    @property
    def pool_bytes(self) -> int:
        """Bytes held (and leased): 0 while suspended."""
        return 0 if self._suspended else self.num_pages * self.page_bytes

    def suspend(self) -> None:
        """Free the buffer and return its bytes to the ledger, keeping the books: used slots keep their
        ids and group tags, their bytes are gone (the caller saved what it keeps, e.g. to NVMe through
        rollout/kv/host_spill.py). Nothing may be allocated, stored or loaded until `resume`."""
        self._check_open()
        if self._suspended:
            return
        leased = self.pool_bytes
        self.copier.sync()  # no copy may still read or write the buffer being freed
        self._buffer = torch.empty(0, self.page_bytes, dtype=torch.uint8)
        self._suspended = True
        if self.ledger is not None and leased:
            self.ledger.release(self.consumer, leased)

    def resume(self, num_pages: int) -> None:
        """Lease `num_pages` pages from the ledger (HostBudgetExceeded: nothing changed) and allocate a
        fresh, uninitialised buffer. Every used slot must lie below `num_pages` (the caller dropped the
        others); the free list becomes the other slots."""
        self._check_open()
        if not self._suspended:
            raise RuntimeError("host KV pool: resume() of a pool that is not suspended")
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"host KV pool: resume(num_pages={num_pages!r}), expected a positive integer")
        used = [page for page, tag in enumerate(self._tags) if tag is not None]
        if used and used[-1] >= num_pages:
            raise ValueError(f"host KV pool: resume(num_pages={num_pages}) but slot {used[-1]} is in use; "
                             f"drop the slots >= {num_pages} first")
        if self.ledger is not None:
            self.ledger.lease(self.consumer, num_pages * self.page_bytes)  # raises before anything changes
        try:
            self._buffer = torch.empty(num_pages, self.page_bytes, dtype=torch.uint8, pin_memory=self._pin)
        except BaseException:
            if self.ledger is not None:
                self.ledger.release(self.consumer, num_pages * self.page_bytes)
            raise
        self._tags = (self._tags + [None] * num_pages)[:num_pages]
        self._free = [page for page, tag in enumerate(self._tags) if tag is None]  # sorted: a valid heap
        self._suspended = False

    def used_slots(self) -> list[int]:
        """Slots in use, ascending."""
        return [page for page, tag in enumerate(self._tags) if tag is not None]

    def buffer_rows(self, first: int, end: int) -> torch.Tensor:
        """uint8 [end - first, page_bytes] view of consecutive slots (the NVMe round trip reads and
        writes the buffer through these, no copy)."""
        self._check_open()
        if self._suspended:
            raise RuntimeError("host KV pool: its buffer is released (suspended)")
        self.copier.wait_slots(range(first, end))
        return self._buffer[first:end]

    def allocate(self, num: int, group: tuple[str, int]) -> list[int]:
        """`num` free host pages tagged `group`; all or nothing (OutOfPages, nothing changed)."""
        self._check_leased()
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

    def store(self, host_pages: list[int], pool: PagePool, device_pages: list[int]) -> CopyTicket:
        """Copy device pages -> host pages (one gather on the device, one copy across per run of
        consecutive slots). The copy may still run when this returns (CUDA): the host bytes are
        safe to read once the ticket is waited on (this pool's own readers wait by themselves)."""
        self._check_pairs(host_pages, pool, device_pages)
        if not host_pages:
            return CopyTicket()
        self.bytes_stored += len(host_pages) * self.page_bytes
        if self.sync_copies:
            return self.copier.store_reference(self._buffer, host_pages, pool, device_pages)
        return self.copier.store(self._buffer, host_pages, pool, device_pages)

    def load(self, host_pages: list[int], pool: PagePool, device_pages: list[int]) -> CopyTicket:
        """Copy host pages -> device pages (one copy across per run of consecutive slots, one scatter
        on the device). The device pages are safe to read on a stream once it waited on the
        ticket (`wait_device`); the slots may be freed at once (later copies queue behind this one)."""
        self._check_pairs(host_pages, pool, device_pages)
        if not host_pages:
            return CopyTicket()
        self.bytes_loaded += len(host_pages) * self.page_bytes
        if self.sync_copies:
            return self.copier.load_reference(self._buffer, host_pages, pool, device_pages)
        return self.copier.load(self._buffer, host_pages, pool, device_pages)

    def page_bytes_view(self, page: int) -> torch.Tensor:
        """uint8 [page_bytes] view of one host page (tests read entries through it), its copies waited on."""
        self._check_leased()
        self.copier.wait_slots([page])
        return self._buffer[page]

    def close(self) -> None:
        """Wait on the copies in flight, stop the copier's worker thread, free the buffer and return
        its bytes to the ledger. A load's error raised here leaves the pool open (close again)."""
        if self._closed:
            return
        leased = self.pool_bytes
        self.copier.close()
        self._buffer = torch.empty(0, self.page_bytes, dtype=torch.uint8)
        self._closed = True
        if self.ledger is not None and leased:
            self.ledger.release(self.consumer, leased)

    def check_integrity(self) -> None:
        if len(set(self._free)) != len(self._free):
            raise AssertionError("host KV pool: duplicate pages in the free list")
        free = set(self._free)
        for page, tag in enumerate(self._tags):
            if (tag is None) != (page in free):
                raise AssertionError(f"host KV pool: page {page} tag {tag} disagrees with the free list")

    def _check_pairs(self, host_pages: list[int], pool: PagePool, device_pages: list[int]) -> None:
        self._check_leased()
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

    def _check_leased(self) -> None:
        self._check_open()
        if self._suspended:
            raise RuntimeError("host KV pool: used while suspended (its buffer and lease are returned; resume() first)")
