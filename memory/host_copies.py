"""Host <-> device page copies for the host KV pool (memory/host_pool.py): overlapped on a GPU,
plain and synchronous as the reference.

`CopyTicket` is one issued copy. On CUDA it holds an event recorded on the copy stream right after
the copy; a reader waits on it before touching the destination: `wait()` blocks the host (a
host-side reader of host bytes: a view, the NVMe spill, freeing the buffer), `wait_device()` makes
the current stream wait without blocking the host (a device-side reader: the step's forward, a
device-to-device copy). On CPU the copy has run when the ticket is returned; the ticket still
records whether someone waited on it, so the ordering rule is tested without a GPU
(tests/memory/test_host_copies.py).

`HostCopier` runs the copies. Both directions go on one side stream (per device), so copies touching
the same host slot or device page run in the order they were issued: a store after a load from a
slot never overwrites it early. Before a copy it waits (on the GPU) for the work already queued on
the issuing stream: a store reads what the forward wrote, a load overwrites pages whose previous
readers were queued there. The host buffer is pinned when the device pool is on CUDA, so each
run of consecutive slots is copied straight into (or out of) the buffer with `non_blocking=True`,
no pageable temporary. `store_sync` / `load_sync` are the plain reference twins (the code the
host pool used before: one gather, one `.to()`), kept for tests and debugging.

The CUDA branch has NOT been run on a GPU yet (written and tested on a CPU-only machine): the
CPU branch runs the same gather/scatter code synchronously; the CUDA tests skip without a GPU.
"""
from __future__ import annotations

import torch

from memory.page_pool import PagePool


class UnwaitedCopy(RuntimeError):
    """A reader touched bytes whose copy was issued but never waited on."""


class CopyTicket:
    """One issued copy; `event` is None when it ran synchronously (CPU)."""

    __slots__ = ("event", "device", "kind", "device_pages", "waited", "device_waited")

    def __init__(self, event: "torch.cuda.Event | None" = None, device: torch.device | None = None,
                 kind: str = "none", device_pages: tuple[int, ...] = ()) -> None:
        self.event, self.device = event, device
        self.kind, self.device_pages = kind, device_pages
        """"store" (it reads `device_pages`) or "load" (it writes them); "none": an empty copy."""
        self.device_waited = False
        """The device stream has waited on it (`wait_device`): device reads of its pages are safe."""
        self.waited = False
        """A host-side reader waited on it (`wait`): `HostCopier.check_waited` checks this."""

    @property
    def done(self) -> bool:
        """The copy has finished (never blocks)."""
        return self.event is None or self.event.query()

    def wait(self) -> None:
        """Host-side reader: block until the copy has finished."""
        if self.event is not None:
            self.event.synchronize()
        self.waited = self.device_waited = True

    def wait_device(self) -> None:
        """Device-side reader: work queued on the current stream from now on runs after the copy
        (the host does not block)."""
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)
        self.device_waited = True


def slot_runs(host_pages: list[int]) -> list[tuple[int, int, int]]:
    """(row, first slot, count) per run of consecutive slots in `host_pages` (row: index into it)."""
    runs: list[list[int]] = []
    for row, slot in enumerate(host_pages):
        if runs and slot == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([row, slot, 1])
    return [tuple(r) for r in runs]


class HostCopier:
    """Issues a host pool's copies and keeps, per host slot, the newest ticket that touched it."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self.pending: dict[int, CopyTicket] = {}
        """Host slot -> the newest copy into or out of it not yet waited on by the host."""
        self.unsettled: list[CopyTicket] = []
        """Copies the device stream has not waited on (`settle_device`): until it has, no kernel
        there may read a loaded page, nor write a page a store is still reading (a freed page is
        reallocated at once)."""

    def _stream(self, device: torch.device) -> "torch.cuda.Stream":
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def store(self, buffer: torch.Tensor, host_pages: list[int], pool: PagePool,
              device_pages: list[int]) -> CopyTicket:
        """Device pages -> host slots: one gather on the device, one non-blocking copy per run of
        consecutive slots into the (pinned) buffer. A host-side reader of the slots waits first."""
        if pool.device.type != "cuda":
            data = pool.read_pages(device_pages)  # [n, page_bytes] uint8
            for row, slot, num in slot_runs(host_pages):
                buffer[slot:slot + num].copy_(data[row:row + num])
            return self._issued(host_pages, CopyTicket(kind="store", device_pages=tuple(device_pages)))
        stream = self._stream(pool.device)
        stream.wait_stream(torch.cuda.current_stream(pool.device))  # the pages' writers (the forward) first
        with torch.cuda.stream(stream):
            data = pool.read_pages(device_pages)  # allocated on the copy stream: freed after it
            for row, slot, num in slot_runs(host_pages):
                buffer[slot:slot + num].copy_(data[row:row + num], non_blocking=True)
            event = stream.record_event()
        return self._issued(host_pages, CopyTicket(event, pool.device, "store", tuple(device_pages)))

    def load(self, buffer: torch.Tensor, host_pages: list[int], pool: PagePool,
             device_pages: list[int]) -> CopyTicket:
        """Host slots -> device pages: one non-blocking copy per run into a device staging tensor,
        one scatter. A device-side reader of the pages waits on the ticket (`wait_device`) first."""
        if pool.device.type != "cuda":
            rows = [buffer[slot:slot + num] for _, slot, num in slot_runs(host_pages)]
            pool.write_pages(device_pages, torch.cat(rows))
            return self._issued(host_pages, CopyTicket(kind="load", device_pages=tuple(device_pages)))
        stream = self._stream(pool.device)
        stream.wait_stream(torch.cuda.current_stream(pool.device))  # earlier readers of the pages first
        with torch.cuda.stream(stream):
            staging = torch.empty(len(host_pages), buffer.shape[1], dtype=torch.uint8, device=pool.device)
            for row, slot, num in slot_runs(host_pages):
                staging[row:row + num].copy_(buffer[slot:slot + num], non_blocking=True)
            pool.write_pages(device_pages, staging)
            event = stream.record_event()
        return self._issued(host_pages, CopyTicket(event, pool.device, "load", tuple(device_pages)))

    def _issued(self, host_pages: list[int], ticket: CopyTicket) -> CopyTicket:
        for slot in host_pages:
            self.pending[slot] = ticket
        # Waited on by the device already (swaps, evictions): dropped here, so the list stays short
        # in an engine whose flush never runs (no prefix cache).
        self.unsettled = [t for t in self.unsettled if not t.device_waited]
        self.unsettled.append(ticket)
        return ticket

    def settle_device(self) -> None:
        """The current device stream waits on every copy issued so far (the host does not block):
        call it before running work that may read loaded pages or reuse stored ones."""
        for ticket in self.unsettled:
            if not ticket.device_waited:
                ticket.wait_device()
        self.unsettled.clear()

    def unsettled_loads(self) -> set[int]:
        """Device pages a load writes that no device stream waited on yet: nothing may read them."""
        return {p for t in self.unsettled if t.kind == "load" and not t.device_waited for p in t.device_pages}

    def wait_slots(self, slots: range | list[int]) -> None:
        """Before the host reads or writes these slots' bytes: wait on their copies in flight."""
        for slot in slots:
            ticket = self.pending.pop(slot, None)
            if ticket is not None:
                ticket.wait()

    def sync(self) -> None:
        """Wait on every copy in flight (before the buffer is freed or read as a whole)."""
        for ticket in set(self.pending.values()) | set(self.unsettled):
            ticket.wait()
        self.pending.clear()

    def check_waited(self, slots: range | list[int]) -> None:
        """Strict mode: raise `UnwaitedCopy` if a copy touching `slots` was never waited on."""
        for slot in slots:
            ticket = self.pending.get(slot)
            if ticket is not None and not ticket.waited:
                raise UnwaitedCopy(f"host slot {slot} is read while its copy was never waited on")


def store_sync(buffer: torch.Tensor, host_pages: list[int], pool: PagePool, device_pages: list[int]) -> None:
    """Reference twin of `HostCopier.store`: one gather, one blocking copy to a host temporary, one
    scatter into the buffer."""
    data = pool.read_pages(device_pages)
    buffer.index_copy_(0, torch.tensor(host_pages, dtype=torch.long), data.to("cpu"))


def load_sync(buffer: torch.Tensor, host_pages: list[int], pool: PagePool, device_pages: list[int]) -> None:
    """Reference twin of `HostCopier.load`: one gather on the host, one blocking copy, one scatter."""
    pool.write_pages(device_pages, buffer.index_select(0, torch.tensor(host_pages, dtype=torch.long)))
