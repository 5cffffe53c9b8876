"""Host-DRAM ledger: one budget of host bytes, leased and returned by consumers.

Host DRAM is time-multiplexed: after a training iteration the training states (weights, optimizer
moments) leave for NVMe and the freed bytes are lent to the host KV pool; before the next update
the pool gives them back. Every consumer (`"train_states"`, `"kv_pool"`, `"reference"`, ...) leases
bytes from this ledger *before* it allocates them and releases them *after* it frees them, so an
over-commitment is a `HostBudgetExceeded` naming who holds what, raised before anything is
allocated, instead of the kernel's OOM killer ending the run.

    ledger = HostLedger()                      # budget: MemAvailable * (1 - reserve_fraction)
    ledger.lease("kv_pool", pool_bytes)        # raises HostBudgetExceeded, nothing changed
    ...
    ledger.release("kv_pool", pool_bytes)

The ledger counts bytes; it allocates nothing and cannot see memory nobody declared (Python
objects, the allocator's slack): `reserve_fraction` of MemAvailable is left out of the default
budget for those. Every change is appended to `events` (time since the ledger was made, consumer,
signed delta, the consumer's holding and the total after it) for the memory timeline plot.
All methods take one lock, so consumers on other threads (a prefetcher, a background writer) may
lease and release concurrently.

Invariant (`check_integrity`): each holding is > 0 and the holdings sum to the total held, which is
<= budget_bytes; replaying `events` from zero reproduces every recorded running figure and ends at
the current holdings.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path


class HostBudgetExceeded(RuntimeError):
    """A lease larger than the free host bytes. Carries the figures its message names."""

    def __init__(self, consumer: str, asked: int, free: int, budget_bytes: int, holdings: dict[str, int]) -> None:
        self.consumer, self.asked, self.free, self.budget_bytes = consumer, asked, free, budget_bytes
        self.holdings = dict(holdings)
        held = ", ".join(f"{name}={n} B" for name, n in sorted(holdings.items())) or "nobody"
        super().__init__(f"host ledger: {consumer!r} asked {asked} B but only {free} B of the {budget_bytes} B "
                         f"budget are free; holding: {held}")


@dataclass(frozen=True)
class LedgerEvent:
    time_s: float
    """Seconds since the ledger was created (monotonic clock)."""
    consumer: str
    delta: int
    """Bytes leased (> 0) or released (< 0)."""
    held_after: int
    """The consumer's holding after this change."""
    total_after: int
    """Bytes held by all consumers after this change."""


def mem_available_bytes(meminfo: str | Path = "/proc/meminfo") -> int:
    """MemAvailable of /proc/meminfo in bytes (the kernel's estimate of memory that can be allocated
    without swapping)."""
    try:
        text = Path(meminfo).read_text()
    except OSError as err:
        raise RuntimeError(f"host ledger: cannot read {meminfo} ({err}); pass budget_bytes explicitly") from None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            value, unit = line.split()[1:3]
            if unit != "kB":
                raise RuntimeError(f"host ledger: unexpected unit {unit!r} in {meminfo}: {line!r}")
            return int(value) * 1024
    raise RuntimeError(f"host ledger: no MemAvailable line in {meminfo}; pass budget_bytes explicitly")


def _check_consumer(consumer: object) -> None:
    if not isinstance(consumer, str) or not consumer:
        raise ValueError(f"host ledger: consumer must be a non-empty string, got {consumer!r}")


def _check_bytes(what: str, nbytes: object) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"host ledger: {what}={nbytes!r}, expected an integer >= 0")


class HostLedger:
    def __init__(self, budget_bytes: int | None = None, reserve_fraction: float = 0.1) -> None:
        """budget_bytes: the host bytes consumers may hold together; None = MemAvailable now times
        (1 - reserve_fraction) (the reserve is for memory nobody leases)."""
        if not 0.0 <= reserve_fraction < 1.0:
            raise ValueError(f"host ledger: reserve_fraction={reserve_fraction}, expected in [0, 1)")
        if budget_bytes is None:
            budget_bytes = int(mem_available_bytes() * (1.0 - reserve_fraction))
        _check_bytes("budget_bytes", budget_bytes)
        self.budget_bytes: int = budget_bytes
        self.events: list[LedgerEvent] = []
        self._holdings: dict[str, int] = {}
        self._total = 0
        self._lock = threading.Lock()
        self._start_s = time.monotonic()

    # ---- changes (under the lock) -----------------------------------------------------------------
    def _record(self, consumer: str, delta: int) -> None:
        held = self._holdings.get(consumer, 0) + delta
        if held:
            self._holdings[consumer] = held
        else:
            self._holdings.pop(consumer, None)
        self._total += delta
        self.events.append(LedgerEvent(time.monotonic() - self._start_s, consumer, delta, held, self._total))

    def lease(self, consumer: str, nbytes: int) -> None:
        """Add `nbytes` to `consumer`'s holding; HostBudgetExceeded (nothing changed) if fewer are free.
        Lease before allocating, so a refusal leaves nothing half-built. 0 bytes is a no-op."""
        _check_consumer(consumer)
        _check_bytes("nbytes", nbytes)
        with self._lock:
            free = self.budget_bytes - self._total
            if nbytes > free:
                raise HostBudgetExceeded(consumer, nbytes, free, self.budget_bytes, self._holdings)
            if nbytes:
                self._record(consumer, nbytes)

    def try_lease(self, consumer: str, nbytes: int) -> bool:
        """lease() that returns False (nothing changed) instead of raising when the bytes are not free.
        Bad arguments still raise."""
        try:
            self.lease(consumer, nbytes)
        except HostBudgetExceeded:
            return False
        return True

    def release(self, consumer: str, nbytes: int) -> None:
        """Return `nbytes` of `consumer`'s holding (after freeing them). More than it holds is a
        ValueError, nothing changed."""
        _check_consumer(consumer)
        _check_bytes("nbytes", nbytes)
        with self._lock:
            held = self._holdings.get(consumer, 0)
            if nbytes > held:
                raise ValueError(f"host ledger: {consumer!r} releases {nbytes} B but holds only {held} B")
            if nbytes:
                self._record(consumer, -nbytes)

    # ---- queries -----------------------------------------------------------------------------------
    def held(self, consumer: str | None = None) -> int:
        """Bytes held by `consumer` (0 if none), or by everyone when None."""
        with self._lock:
            return self._total if consumer is None else self._holdings.get(consumer, 0)

    @property
    def free(self) -> int:
        with self._lock:
            return self.budget_bytes - self._total

    def holdings(self) -> dict[str, int]:
        """A copy: consumer -> bytes held, for every consumer holding more than 0."""
        with self._lock:
            return dict(self._holdings)

    def check_integrity(self) -> None:
        with self._lock:
            if any(n <= 0 for n in self._holdings.values()):
                raise RuntimeError(f"host ledger integrity: a non-positive holding: {self._holdings}")
            if sum(self._holdings.values()) != self._total:
                raise RuntimeError(f"host ledger integrity: holdings {self._holdings} do not sum to {self._total}")
            if not 0 <= self._total <= self.budget_bytes:
                raise RuntimeError(f"host ledger integrity: {self._total} B held, budget {self.budget_bytes} B")
            replay: dict[str, int] = {}
            total, last_s = 0, 0.0
            for i, e in enumerate(self.events):
                replay[e.consumer] = replay.get(e.consumer, 0) + e.delta
                total += e.delta
                if e.delta == 0 or replay[e.consumer] != e.held_after or total != e.total_after or e.time_s < last_s:
                    raise RuntimeError(f"host ledger integrity: event {i} {e} disagrees with the replay "
                                       f"(held {replay[e.consumer]}, total {total})")
                last_s = e.time_s
            if {c: n for c, n in replay.items() if n} != self._holdings:
                raise RuntimeError(f"host ledger integrity: replayed events give {replay}, "
                                   f"holdings are {self._holdings}")
