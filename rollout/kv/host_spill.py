"""The host KV pool's NVMe round trip between rollouts, so host DRAM is time-multiplexed.

Between two rollouts the host DRAM belongs to the training states (restored from NVMe for the
update); during a rollout it belongs to the host KV pool. So, with the engine asleep after a rollout
(paused sequences parked in host slots, the prefix cache's turn-boundary entries written back):

`spill_host` (before the training states come back):
  1. drops what the next rollout must not use: every prefix entry when stale prefixes are not
     reused (the next weights empty the cache anyway), and entries or parked sequences whose KV
     would be older than `max_staleness` versions at the next rollout (a dropped parked sequence is
     reset: recomputed under the new weights when it resumes);
  2. writes the kept slots to the NVMe store as one group, one tensor per run of consecutive slots
     (views of the pool's buffer: no host copy), checksummed and atomic (memory/nvme_store.py);
  3. suspends the pool: its buffer is freed and its lease returned to the ledger.
`restore_host` (at the next rollout, before the device pool and the parked sequences come back)
leases the pool again, `num_pages` pages (any size that holds the kept slots; a smaller lease drops
the slots above it, same as above), and reads the group back into the same slots, bit for bit.

Nothing here chooses sizes: the phase orchestrator (rl/run/loop.py) passes what the ledger has
free (`engine.host_pool_mb=auto`) or the configured size.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from memory.host_pool import HostPagePool
from memory.nvme_store import NvmeStore
from rollout.kv.host_tier import HostTier
from rollout.request import Sequence

GROUP = "kv_host_pool"
"""The NVMe store group holding the kept slots (one per store; each rank has its own store)."""


@dataclass
class SpilledSlots:
    """What `spill_host` wrote: the runs of consecutive slots [first, end), in the group's order."""

    runs: list[tuple[int, int]] = field(default_factory=list)
    bytes: int = 0


def slot_runs(slots: list[int]) -> list[tuple[int, int]]:
    """Ascending `slots` as maximal runs [first, end) of consecutive ids."""
    runs: list[tuple[int, int]] = []
    for s in slots:
        if runs and runs[-1][1] == s:
            runs[-1] = (runs[-1][0], s + 1)
        else:
            runs.append((s, s + 1))
    return runs


def drop_parked(tier: HostTier, seqs: list[Sequence], reset: Callable[[Sequence], None]) -> int:
    """Forget the parked pages of `seqs` (slots shared with a fork that stays parked stay) and reset
    each: it will be recomputed when it resumes. Returns the sequences dropped."""
    gone = {s.seq_id for s in seqs if s.seq_id in tier.parked}
    if not gone:
        return 0

    def slots_of(seq_ids) -> set[int]:
        return {x for i in seq_ids for kda, mla in [tier.parked[i]] for x in kda + [y for g in mla for y in g]}

    kept = slots_of(i for i in tier.parked if i not in gone)
    freed = sorted(slots_of(gone) - kept)
    for seq_id in gone:
        del tier.parked[seq_id]
    if freed:
        tier.host.free(freed)
    for seq in seqs:
        if seq.seq_id in gone:
            reset(seq)
    return len(gone)


def write_slots(host: HostPagePool, store: NvmeStore) -> SpilledSlots:
    """Write every used slot to `store` (group GROUP), one tensor per run of consecutive slots."""
    runs = slot_runs(host.used_slots())
    if not runs:
        discard(store)
        return SpilledSlots()
    store.spill(GROUP, {f"slots_{a}_{b}": host.buffer_rows(a, b) for a, b in runs})
    return SpilledSlots(runs, sum(b - a for a, b in runs) * host.page_bytes)


def discard(store: NvmeStore | None) -> None:
    """Delete what `write_slots` wrote (its contents were dropped)."""
    if store is not None and GROUP in store.names():
        store.drop(GROUP)


def read_slots(host: HostPagePool, store: NvmeStore, spilled: SpilledSlots) -> int:
    """Read what `write_slots` wrote back into the same slots (checksums verified); returns bytes read.
    Every run must lie inside the resumed pool."""
    if not spilled.runs:
        return 0
    store.restore(GROUP, out={f"slots_{a}_{b}": host.buffer_rows(a, b) for a, b in spilled.runs})
    store.drop(GROUP)
    return spilled.bytes
