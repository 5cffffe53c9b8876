"""`PageCopies`: the step's page copies, deferred to one batch right before the forward pass.

Three kinds, run in this order by `flush()`: device -> device (the prefix cache's private copies
at admission and its KDA checkpoints; one gather, then one scatter: every source is read before
any destination is written), host -> device (prefetches), device -> host (write-through).
Until `flush()` a destination holds its previous owner's bytes, so the prefix cache never matches
it (rule 2), and every pending copy holds one pool reference on each of its device ends.

Host copies overlap the forward pass (memory/host_copies.py): on a GPU they run on a side stream
and `flush()` does not wait for them. It starts by making the compute stream wait on every host
copy issued before it (`settle`: the prefetches of the previous flush, this step's swap-ins and
write-backs), so the forward, and every device copy queued behind it, reads a loaded page only
after its copy and reuses a stored page only after it was read. A prefetch issued here is read by
no one in this step (its sequence is admitted a step later, rule 2): it runs while this step's
forward does. On CPU every copy has run when it returns; the order of waits is the same.
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

    def settle(self) -> None:
        """The compute stream waits on the host copies issued so far (the host does not block)."""
        if self.host is not None:
            self.host.copier.settle_device()

    def unsettled_loads(self) -> set[int]:
        """Device pages a host copy is writing that no device stream has waited on: none of them
        may be read (a sequence holding one is a bug; tests check it after every step)."""
        return self.host.copier.unsettled_loads() if self.host is not None else set()

    def flush(self) -> None:
        """Settle the host copies in flight, run the pending device copies, issue the host ones, and
        release the references they held (a page's bytes are in place for the device stream)."""
        self.settle()
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
