"""Host <-> device page copies for the host KV pool (memory/host_pool.py): overlapped on a GPU,
optionally on a worker thread on CPU, plain and synchronous as the reference.

`CopyTicket` is one issued copy. On CUDA it holds an event recorded on the copy stream right after
the copy; a reader waits on it before touching the destination: `wait()` blocks the host (a
host-side reader of host bytes: a view, the NVMe spill, freeing the buffer), `wait_device()` makes
the current stream wait without blocking the host (a device-side reader: the step's forward, a
device-to-device copy). On CPU a copy has run when its ticket is returned, unless it is an async
load (below); the ticket still records whether someone waited on it, so the ordering rule is tested
without a GPU (tests/memory/test_host_copies.py).

`HostCopier` runs the copies. Both directions go on one side stream (per device), so copies touching
the same host slot or device page run in the order they were issued: a store after a load from a
slot never overwrites it early. Before a copy it waits (on the GPU) for the work already queued on
the issuing stream: a store reads what the forward wrote, a load overwrites pages whose previous
readers were queued there. The host buffer is pinned when the device pool is on CUDA, so each
run of consecutive slots is copied straight into (or out of) the buffer with `non_blocking=True`,
no pageable temporary. `store_sync` / `load_sync` are the plain reference twins (the code the
host pool used before: one gather, one `.to()`), kept for tests and debugging.

CPU side stream (`cpu_async_loads=True`, a CPU device pool): each load (the gather from the host
buffer and the scatter of `pool.write_pages`, its checks done when it is issued: the books belong to
the issuing thread) is queued to one daemon worker thread, run in issue order, so a prefetch issued
right before a forward pass runs during it (torch copy ops release the GIL). The
calling thread is the CPU "device stream": `wait_device()` blocks it until the copy ran, and an
exception raised by the copy is raised there (and by every wait on that ticket); one nobody waited
on is raised by the next copier-wide wait (`drain`), so none is lost. Ordering: every other copy
operation (a store, a load while async is off, `store_reference` / `load_reference`),
`wait_slots`, `sync`, `settle_device` and `close` first drains the queue (waits on every async load
in flight), so copies touching the same slot or page still run in issue order and the host pool's
buffer readers, `suspend` and `close` never meet a load in flight. As on a CUDA copy stream, no
reader or writer of a device page whose load is unsettled (`unsettled_loads`: a test reading pages
between steps too), nor the device pool's `release`, may run before `settle_device`. Figures (`load_seconds`, `load_wait_seconds`,
`loads_async`, `hidden_fraction`) say how much of the loads' copy time callers waited on; a
synchronous CPU load counts as waited on in full. The worker starts on the first async load and
stops at `close()` (or when the copier is garbage-collected).

The CUDA branch has NOT been run on a GPU yet (written and tested on a CPU-only machine): the
CPU branch runs the same gather/scatter code synchronously; the CUDA tests skip without a GPU.
"""
from __future__ import annotations

import functools
import queue
import threading
import time
import weakref
from collections.abc import Callable

import torch

from memory.page_pool import PagePool


class UnwaitedCopy(RuntimeError):
    """A reader touched bytes whose copy was issued but never waited on."""


class _LoadBooks:
    """What a copier and its worker thread share (under `lock`): the load figures and the failed
    async loads whose error nobody has been told about yet."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.load_s = self.wait_s = 0.0
        self.num_async = 0
        self.failed: list[CopyTicket] = []

    def add(self, load_s: float = 0.0, wait_s: float = 0.0, num_async: int = 0) -> None:
        with self.lock:
            self.load_s += load_s
            self.wait_s += wait_s
            self.num_async += num_async

    def run(self, ticket: CopyTicket, copy: Callable[[], None], inference: bool) -> None:
        """On the worker: run one load, keep its error on the ticket, then mark it done (never raises)."""
        start = time.perf_counter()
        try:
            with torch.inference_mode(inference):  # the issuing thread's mode (it is thread-local)
                copy()
        except BaseException as error:  # re-raised by the thread that waits on the ticket
            ticket.error = error
            with self.lock:
                self.failed.append(ticket)
        finally:
            self.add(load_s=time.perf_counter() - start)
            ticket.cpu_done.set()

    def block(self, ticket: CopyTicket, report: bool = True) -> None:
        """Block until an async load ran (the time counts as waited on); `report`: raise its error."""
        if not ticket.cpu_done.is_set():
            start = time.perf_counter()
            ticket.cpu_done.wait()
            self.add(wait_s=time.perf_counter() - start)
        if report and ticket.error is not None:
            with self.lock:
                if ticket in self.failed:
                    self.failed.remove(ticket)
            raise ticket.error

    def raise_unreported(self) -> None:
        """Raise the error of the oldest failed async load nobody has been told about."""
        with self.lock:
            ticket = self.failed.pop(0) if self.failed else None
        if ticket is not None:
            raise ticket.error


class CopyTicket:
    """One issued copy; `event` is None when it ran synchronously (CPU); `cpu_done` is set for an
    async CPU load (set once the worker ran it)."""

    __slots__ = ("event", "device", "kind", "device_pages", "waited", "device_waited", "cpu_done", "error",
                 "books")

    def __init__(self, event: "torch.cuda.Event | None" = None, device: torch.device | None = None,
                 kind: str = "none", device_pages: tuple[int, ...] = ()) -> None:
        self.event, self.device = event, device
        self.kind, self.device_pages = kind, device_pages
        """"store" (it reads `device_pages`) or "load" (it writes them); "none": an empty copy."""
        self.device_waited = False
        """The device stream has waited on it (`wait_device`): device reads of its pages are safe."""
        self.waited = False
        """A host-side reader waited on it (`wait`): `HostCopier.check_waited` checks this."""
        self.cpu_done: threading.Event | None = None
        self.error: BaseException | None = None
        """What the async load raised on the worker (raised again by every wait on this ticket)."""
        self.books: _LoadBooks | None = None

    @property
    def done(self) -> bool:
        """The copy has finished (never blocks); a failed async load is done too (its wait raises)."""
        if self.cpu_done is not None:
            return self.cpu_done.is_set()
        return self.event is None or self.event.query()

    def wait(self) -> None:
        """Host-side reader: block until the copy has finished."""
        if self.cpu_done is not None:
            self.books.block(self)
        elif self.event is not None:
            self.event.synchronize()
        self.waited = self.device_waited = True

    def wait_device(self) -> None:
        """Device-side reader: work queued on the current stream from now on runs after the copy
        (the host does not block on CUDA; on CPU the calling thread is the stream: it blocks)."""
        if self.cpu_done is not None:
            self.books.block(self)
        elif self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)
        self.device_waited = True

    def _drained(self, host: bool) -> None:
        """Mark it waited after `HostCopier.drain` (which raised its error, if any, once)."""
        if self.cpu_done is None:
            self.wait() if host else self.wait_device()
        else:
            self.device_waited = True
            self.waited = self.waited or host


def slot_runs(host_pages: list[int]) -> list[tuple[int, int, int]]:
    """(row, first slot, count) per run of consecutive slots in `host_pages` (row: index into it)."""
    runs: list[list[int]] = []
    for row, slot in enumerate(host_pages):
        if runs and slot == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([row, slot, 1])
    return [tuple(r) for r in runs]


def _load_cpu(buffer: torch.Tensor, host_pages: list[int], pool: PagePool, device_pages: list[int],
              checked: bool = True) -> None:
    """Host slots -> device pages on CPU: one copy per run of consecutive slots (none for one run),
    one scatter. `checked=False` (the worker): the pages were checked when the load was issued; the
    books may free one meanwhile (as on a CUDA copy stream, its next writer runs after the settle)."""
    rows = [buffer[slot:slot + num] for _, slot, num in slot_runs(host_pages)]
    data = rows[0] if len(rows) == 1 else torch.cat(rows)  # [n, page_bytes] uint8
    if checked:
        pool.write_pages(device_pages, data)
    else:  # write_pages' scatter without its checks of the books, which the issuing thread owns
        pool._buffer.index_copy_(0, torch.tensor(device_pages, dtype=torch.long), data)


def _work(jobs: queue.SimpleQueue) -> None:
    """The CPU side stream: run the queued loads in order until the stop mark (None). It holds the
    queue only, not the copier, so a copier nobody closed is still collected (and stops it)."""
    while True:
        job = jobs.get()
        if job is None:
            return
        job()
        del job


class HostCopier:
    """Issues a host pool's copies and keeps, per host slot, the newest ticket that touched it."""

    def __init__(self, cpu_async_loads: bool = False) -> None:
        self.cpu_async_loads = cpu_async_loads
        """CPU device pools: run loads on the worker thread (the CPU side stream); may be set at any time."""
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self.pending: dict[int, CopyTicket] = {}
        """Host slot -> the newest copy into or out of it not yet waited on by the host."""
        self.unsettled: list[CopyTicket] = []
        """Copies the device stream has not waited on (`settle_device`): until it has, no kernel
        there may read a loaded page, nor write a page a store is still reading (a freed page is
        reallocated at once)."""
        self._books = _LoadBooks()
        self._jobs: queue.SimpleQueue | None = None
        self._worker: threading.Thread | None = None
        self._stop: weakref.finalize | None = None
        self._last: CopyTicket | None = None
        """The newest async load not drained yet: the worker runs them in order, so once it ran all did."""

    # ---- figures (CPU loads; a CUDA copy's time is on its stream) -------------------------------------
    @property
    def load_seconds(self) -> float:
        """Wall time spent copying loads (on the worker for async ones)."""
        return self._books.load_s

    @property
    def load_wait_seconds(self) -> float:
        """Time callers were blocked on unfinished loads (a synchronous load: all of its time)."""
        return self._books.wait_s

    @property
    def loads_async(self) -> int:
        """Loads run on the worker thread."""
        return self._books.num_async

    @property
    def hidden_fraction(self) -> float:
        """Share of the loads' copy time no caller waited on, in [0, 1] (1.0 when nothing was loaded)."""
        load_s, wait_s = self._books.load_s, self._books.wait_s
        return 1.0 if load_s <= 0 else min(1.0, max(0.0, 1.0 - wait_s / load_s))

    def reset_figures(self) -> None:
        """Zero the figures (a load in flight counts in the new ones)."""
        with self._books.lock:
            self._books.load_s = self._books.wait_s = 0.0
            self._books.num_async = 0

    # ---- copies --------------------------------------------------------------------------------------
    def _stream(self, device: torch.device) -> "torch.cuda.Stream":
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def store(self, buffer: torch.Tensor, host_pages: list[int], pool: PagePool,
              device_pages: list[int]) -> CopyTicket:
        """Device pages -> host slots: one gather on the device, one non-blocking copy per run of
        consecutive slots into the (pinned) buffer. A host-side reader of the slots waits first.
        Async loads in flight are drained first (one of them may read these slots)."""
        self.drain()
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
        one scatter. A device-side reader of the pages waits on the ticket (`wait_device`) first.
        On CPU with `cpu_async_loads` the copy is queued to the worker thread and runs in issue order."""
        if pool.device.type != "cuda":
            if self.cpu_async_loads:
                return self._load_async(buffer, host_pages, pool, device_pages)
            self.drain()
            start = time.perf_counter()
            _load_cpu(buffer, host_pages, pool, device_pages)
            elapsed = time.perf_counter() - start
            self._books.add(load_s=elapsed, wait_s=elapsed)  # a synchronous copy is fully exposed
            return self._issued(host_pages, CopyTicket(kind="load", device_pages=tuple(device_pages)))
        self.drain()
        stream = self._stream(pool.device)
        stream.wait_stream(torch.cuda.current_stream(pool.device))  # earlier readers of the pages first
        with torch.cuda.stream(stream):
            staging = torch.empty(len(host_pages), buffer.shape[1], dtype=torch.uint8, device=pool.device)
            for row, slot, num in slot_runs(host_pages):
                staging[row:row + num].copy_(buffer[slot:slot + num], non_blocking=True)
            pool.write_pages(device_pages, staging)
            event = stream.record_event()
        return self._issued(host_pages, CopyTicket(event, pool.device, "load", tuple(device_pages)))

    def _load_async(self, buffer: torch.Tensor, host_pages: list[int], pool: PagePool,
                    device_pages: list[int]) -> CopyTicket:
        if pool.is_released:
            raise RuntimeError("host copier: load into a released device pool; reacquire() first")
        if len(set(device_pages)) != len(device_pages) or any(pool.refcount(p) == 0 for p in device_pages):
            raise ValueError(f"host copier: load into device pages {device_pages}, expected distinct pages in use")
        if len(host_pages) != len(device_pages):
            raise ValueError(f"host copier: {len(host_pages)} host pages vs {len(device_pages)} device pages")
        ticket = CopyTicket(kind="load", device_pages=tuple(device_pages))
        ticket.cpu_done, ticket.books = threading.Event(), self._books
        copy = functools.partial(_load_cpu, buffer, list(host_pages), pool, list(device_pages), checked=False)
        if self._worker is None:  # started lazily, one per copier
            self._jobs = queue.SimpleQueue()
            self._worker = threading.Thread(target=_work, args=(self._jobs,), name="host-copier-loads", daemon=True)
            self._worker.start()
            self._stop = weakref.finalize(self, self._jobs.put, None)
        self._jobs.put(functools.partial(self._books.run, ticket, copy, torch.is_inference_mode_enabled()))
        self._books.add(num_async=1)
        self._last = ticket
        return self._issued(host_pages, ticket)

    def store_reference(self, buffer: torch.Tensor, host_pages: list[int], pool: PagePool,
                        device_pages: list[int]) -> CopyTicket:
        """`store_sync` (the host pool's `sync_copies` path), after draining the async loads."""
        self.drain()
        store_sync(buffer, host_pages, pool, device_pages)
        return CopyTicket()

    def load_reference(self, buffer: torch.Tensor, host_pages: list[int], pool: PagePool,
                       device_pages: list[int]) -> CopyTicket:
        """`load_sync` (the host pool's `sync_copies` path), after draining the async loads; timed as
        fully exposed."""
        self.drain()
        start = time.perf_counter()
        load_sync(buffer, host_pages, pool, device_pages)
        elapsed = time.perf_counter() - start
        self._books.add(load_s=elapsed, wait_s=elapsed)
        return CopyTicket()

    def _issued(self, host_pages: list[int], ticket: CopyTicket) -> CopyTicket:
        for slot in host_pages:
            self.pending[slot] = ticket
        # Waited on by the device already (swaps, evictions): dropped here, so the list stays short
        # in an engine whose flush never runs (no prefix cache).
        self.unsettled = [t for t in self.unsettled if not t.device_waited]
        self.unsettled.append(ticket)
        return ticket

    # ---- waits ---------------------------------------------------------------------------------------
    def drain(self) -> None:
        """Block until every async load issued so far ran, then raise the error of the oldest failed
        one nobody was told about yet (each such error is raised once here)."""
        if self._last is not None:
            self._books.block(self._last, report=False)
            self._last = None
        self._books.raise_unreported()

    def settle_device(self) -> None:
        """The current device stream waits on every copy issued so far (the host does not block on
        CUDA; on CPU it drains the async loads): call it before running work that may read loaded
        pages or reuse stored ones."""
        self.drain()
        for ticket in self.unsettled:
            if not ticket.device_waited:
                ticket._drained(host=False)
        self.unsettled.clear()

    def unsettled_loads(self) -> set[int]:
        """Device pages a load writes that no device stream waited on yet: nothing may read them."""
        return {p for t in self.unsettled if t.kind == "load" and not t.device_waited for p in t.device_pages}

    def wait_slots(self, slots: range | list[int]) -> None:
        """Before the host reads or writes these slots' bytes: wait on their copies in flight."""
        self.drain()
        for slot in slots:
            ticket = self.pending.pop(slot, None)
            if ticket is not None:
                ticket._drained(host=True)

    def sync(self) -> None:
        """Wait on every copy in flight (before the buffer is freed or read as a whole)."""
        self.drain()
        for ticket in set(self.pending.values()) | set(self.unsettled):
            ticket._drained(host=True)
        self.pending.clear()

    def close(self) -> None:
        """`sync`, then stop the worker thread (joined); a later async load starts a new one."""
        try:
            self.sync()
        finally:
            if self._worker is not None:
                self._stop()  # the stop mark, queued behind every load (all ran: sync drained them)
                self._worker.join()
                self._worker = self._jobs = self._stop = None

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
