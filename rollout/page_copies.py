"""`PageCopies`: the step's page copies, deferred to one batch right before the forward pass.

Three kinds, run in this order by `flush()`: device -> device (the prefix cache's private copies
at admission and its KDA checkpoints; one gather, then one scatter: every source is read before
any destination is written), host -> device (prefetches), device -> host (write-through).
Until `flush()` a destination holds its previous owner's bytes, so the prefix cache never matches
it (rule 2), and every pending copy holds one pool reference on each of its device ends.
"""
from __future__ import annotations

from memory.host_pool import HostPagePool
from memory.page_pool import PagePool


class PageCopies:
    def __init__(self, pool: PagePool, host: HostPagePool | None = None) -> None:
        self.pool, self.host = pool, host
        self.device: list[tuple[int, int]] = []
        """(source, destination) device pages."""
        self.loads: list[tuple[int, int]] = []
        """(host page, device page)."""
        self.stores: list[tuple[int, int]] = []
        """(device page, host page)."""

    def copy(self, src: list[int], dst: list[int]) -> None:
        self.pool.incref(src + dst)  # both ends stay allocated (and their bytes put) until the copy ran
        self.device += zip(src, dst)

    def load(self, host_pages: list[int], dst: list[int]) -> None:
        self.pool.incref(dst)
        self.loads += zip(host_pages, dst)

    def store(self, page: int, host_page: int) -> None:
        self.pool.incref([page])
        self.stores.append((page, host_page))

    def destinations(self) -> set[int]:
        """Device pages a pending copy will overwrite."""
        return {d for _, d in self.device} | {d for _, d in self.loads}

    def references(self) -> list[int]:
        """The device pool references pending copies hold (one per device end per copy)."""
        return [p for pair in self.device for p in pair] + [d for _, d in self.loads] + [d for d, _ in self.stores]

    def host_bound(self) -> set[int]:
        """Device pages with a host copy in flight (either way): their host pages must stay."""
        return {d for _, d in self.loads} | {d for d, _ in self.stores}

    def flush(self) -> None:
        """Run every pending copy and release the references they held."""
        if self.device:
            src, dst = [s for s, _ in self.device], [d for _, d in self.device]
            self.pool.copy_pages(src, dst)
            self.device = []
            self.pool.decref(src + dst)
        if self.loads:
            slots, dst = [h for h, _ in self.loads], [d for _, d in self.loads]
            self.host.load(slots, self.pool, dst)
            self.loads = []
            self.pool.decref(dst)
        if self.stores:
            src, slots = [d for d, _ in self.stores], [h for _, h in self.stores]
            self.host.store(slots, self.pool, src)
            self.stores = []
            self.pool.decref(src)
