"""The host tier: host memory (memory/host_pool.py) as the second home of KV pages.

One implementation of moving pages between the device pool and host pages (*slots*), for two users:
- the prefix cache (rollout/kv/prefix_cache.py): `write_back` of a bundle it evicts, `prefetch`
  before a hit on the host, `mirror` (write-through) copies; its host entries are `lru`;
- the engine's sleep/wake: `park` paused sequences' pages before the device pool goes, `unpark`
  them after it is back (bit for bit; a page shared by forks is stored once);
- preemption by swapping: `swap_out` a victim's pages to slots, `swap_in` them into fresh device
  pages when it is rescheduled (bit for bit; every page of the victim gets its own slot, a page it
  shared with a fork or the prefix cache included, and comes back private).
Room is made the same way for both (`room`): clean mirrors first, then the least recently used
cached entries (the prefix cache drops them through `evict_entry`), never one being prefetched.
A device page with a `mirrors` entry has a clean copy on the host: evicting it again costs no copy.
Prefetch and write-through copies join the step's `PageCopies` (run right before the forward
pass). Slots of cached entries, mirrors, parked and swapped sequences are distinct and allocated
(`check_integrity`); `room` only ever drops mirrors and cached entries.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from memory.host_pool import HostPagePool
from memory.page_pool import PagePool
from rollout.kv.page_copies import PageCopies
from rollout.request import Sequence


class HostTier:
    def __init__(self, pool: PagePool, host: HostPagePool, copies: PageCopies) -> None:
        self.pool, self.host, self.copies = pool, host, copies
        self.lru: OrderedDict[int, None] = OrderedDict()
        """Slots the prefix index reads (its host entries), least recently used first."""
        self.mirrors: dict[int, int] = {}
        """Device page (a prefix-cache entry) -> slot holding the same bytes."""
        self.pinned: set[int] = set()
        """Slots being prefetched: `room` never drops them meanwhile."""
        self.evict_entry: Callable[[int], None] | None = None
        """Drops the cached entry reading a slot (with its bundle); set by the prefix cache."""
        self.parked: dict[int, tuple[list[int], list[list[int]]]] = {}
        """Paused seq_id -> the slots of its (KDA pages, MLA pages per group), over a sleep."""
        self.swapped: dict[int, tuple[list[int], list[list[int]]]] = {}
        """Preempted seq_id -> the slots of its (KDA pages, MLA pages per group) until it is rescheduled."""
        self.pages_written_back = 0
        self.pages_prefetched = 0
        self.pages_swapped_out = 0
        self.pages_swapped_in = 0

    # ---- the one copy path -----------------------------------------------------------------------------
    def room(self, num: int, keep: Iterable[int] = ()) -> bool:
        """Make `num` slots free: mirrors first (but those of device pages in `keep` or with a copy
        in flight), then the least recently used cached entries. False if impossible."""
        host = self.host
        keep = set(keep) | self.copies.host_bound()
        for page in [p for p in self.mirrors if p not in keep]:
            if host.num_free >= num:
                break
            host.free([self.mirrors.pop(page)])
        for slot in list(self.lru):
            if host.num_free >= num:
                break
            if slot in self.lru:
                self.evict_entry(slot)
        return host.num_free >= num

    def _store(self, pages: list[int], keep: Iterable[int] = ()) -> list[int] | None:
        """Copy device `pages` into fresh slots now (one per page, tagged with its group); None
        (nothing changed) if the host cannot make room. The device stream waits on the copy before
        its next kernel: the caller may free the pages, and the next writer of a page reuses it."""
        if not self.room(len(pages), keep):
            return None
        slots = [self.host.allocate(1, self.pool.group_of_page(p))[0] for p in pages]
        self.host.store(slots, self.pool, pages).wait_device()
        return slots

    def _device_pages(self, slots: list[int]) -> list[int]:
        """Fresh device pages for `slots` (same groups); the caller checked the pool has room."""
        return [self.pool.allocate(1, self.host.tag(s))[0] for s in slots]

    # ---- the prefix cache's entries ------------------------------------------------------------------
    def write_back(self, pages: list[int]) -> list[int] | None:
        """Move device `pages` (one bundle) to slots, copying only those without a mirror; returns
        each page's slot, now a cached entry, or None (nothing changed) if the host cannot take
        them. The caller relocates its keys and drops its device references."""
        copy = [p for p in pages if p not in self.mirrors]
        slots = self._store(copy, keep=pages)
        if slots is None:
            return None
        self.mirrors.update(zip(copy, slots))
        out = [self.mirrors.pop(p) for p in pages]
        self.lru.update((s, None) for s in out)
        self.pages_written_back += len(copy)
        return out

    def prefetch(self, slots: list[int]) -> list[int]:
        """Queue copies of cached `slots` into fresh device pages (`PageCopies.load`); the slots stay
        as their mirrors. Returns the device pages; the caller made room for them and re-keys its
        entries."""
        dev = self._device_pages(slots)
        for slot, page in zip(slots, dev):
            self.lru.pop(slot)
            self.mirrors[page] = slot  # the host copy stays, clean: evicting it again costs no copy
        self.copies.load(slots, dev)
        self.pages_prefetched += len(dev)
        return dev

    def mirror(self, pages: list[int]) -> None:
        """Write-through: queue a copy of each device page to its mirror (allocated on first use)."""
        for p in pages:
            if p not in self.mirrors:
                if not self.room(1):
                    continue
                self.mirrors[p] = self.host.allocate(1, self.pool.group_of_page(p))[0]
            self.copies.store(p, self.mirrors[p])

    def drop(self, slots: list[int], device_pages: list[int]) -> None:
        """Forget cached `slots` and the mirrors of `device_pages` (entries going for good)."""
        freed = [s for s in slots if self.lru.pop(s, 0) is None]
        freed += [self.mirrors.pop(p) for p in device_pages if p in self.mirrors]
        if freed:
            self.host.free(freed)

    def clear(self) -> None:
        """Forget every cached entry and mirror (parked sequences stay)."""
        self.host.free(list(self.lru) + list(self.mirrors.values()))
        self.lru.clear()
        self.mirrors.clear()

    # ---- paused sequences over a sleep -----------------------------------------------------------------
    def park(self, seqs: list[Sequence]) -> list[Sequence]:
        """Copy the pages of every sequence in `seqs` that holds some to slots (a page shared by
        forks once), before cached entries. Returns the sequences parked, whose device references
        the caller drops; one the host cannot take is not parked. A swapped-out one among `seqs`
        is parked as it is (its slots change hands, no copy): over a sleep every paused sequence
        on the host is a parked one, restored by `unpark` (or dropped by the NVMe spill's policy)."""
        parked = [s for s in seqs if s.seq_id in self.swapped]
        for seq in parked:
            self.parked[seq.seq_id] = self.swapped.pop(seq.seq_id)
        slot_of: dict[int, int] = {}
        for seq in [s for s in seqs if s.holds_pages]:
            pages = seq.kda_pages + [p for group in seq.mla_pages for p in group]
            new = list(dict.fromkeys(p for p in pages if p not in slot_of))
            slots = self._store(new)
            if slots is None:
                continue
            slot_of.update(zip(new, slots))
            self.parked[seq.seq_id] = ([slot_of[p] for p in seq.kda_pages],
                                       [[slot_of[p] for p in group] for group in seq.mla_pages])
            parked.append(seq)
        return parked

    def unpark(self, seqs: list[Sequence]) -> list[Sequence]:
        """Give each parked sequence of `seqs` (page-less) fresh device pages holding its parked
        bytes, pages shared by forks shared again; free every parked slot. Returns the parked
        sequences the device pool had no room for (the caller resets them: recomputed)."""
        if not self.parked:
            return []
        by_id = {s.seq_id: s for s in seqs}
        page_of: dict[int, int] = {}  # slot -> its restored device page
        lost = []
        for seq_id, (kda, mla) in self.parked.items():
            seq = by_id.get(seq_id)
            if seq is None or seq.holds_pages:  # aborted meanwhile
                continue
            slots = list(dict.fromkeys(kda + [s for group in mla for s in group]))
            new = [s for s in slots if s not in page_of]
            if len(new) > self.pool.num_free:
                lost.append(seq)
                continue
            fresh = self._device_pages(new)
            self.host.load(new, self.pool, fresh).wait_device()  # the next forward reads them
            self.pool.incref([page_of[s] for s in slots if s not in new])  # shared with an earlier fork
            page_of.update(zip(new, fresh))
            seq.kda_pages = [page_of[s] for s in kda]
            seq.mla_pages = [[page_of[s] for s in group] for group in mla]
        self.host.free(sorted(self._parked_slots()))
        self.parked.clear()
        return lost

    # ---- preempted sequences (swap) ---------------------------------------------------------------------
    def swap_out(self, seq: Sequence, num_mla_pages: int) -> bool:
        """Copy `seq`'s KDA pages and its first `num_mla_pages` MLA pages per group (those holding its
        `kv_len` slots) to fresh slots, making room as `room` does. True: stored (the caller drops
        its device references); False: the host cannot take them, nothing changed."""
        if seq.seq_id in self.swapped:
            raise ValueError(f"sequence {seq.seq_id} is already swapped out")
        mla = [group[:num_mla_pages] for group in seq.mla_pages]
        slots = self._store(seq.kda_pages + [p for group in mla for p in group])
        if slots is None:
            return False
        rest = iter(slots)
        self.swapped[seq.seq_id] = ([next(rest) for _ in seq.kda_pages], [[next(rest) for _ in group] for group in mla])
        self.pages_swapped_out += len(slots)
        return True

    def num_swapped_pages(self, seq: Sequence) -> int:
        """Device pages `swap_in(seq)` takes (0 if `seq` is not swapped out)."""
        kda, mla = self.swapped.get(seq.seq_id, ([], []))
        return len(kda) + sum(map(len, mla))

    def swap_in(self, seq: Sequence) -> None:
        """Give the swapped-out, page-less `seq` fresh device pages holding its stored bytes and free
        its slots. The caller checked the pool has `num_swapped_pages(seq)` free pages."""
        kda, mla = self.swapped.pop(seq.seq_id)
        slots = kda + [s for group in mla for s in group]
        fresh = self._device_pages(slots)
        self.host.load(slots, self.pool, fresh).wait_device()  # this step's forward reads them
        self.host.free(slots)  # a later copy into these slots queues behind this one (one copy stream)
        page_of = dict(zip(slots, fresh))
        seq.kda_pages = [page_of[s] for s in kda]
        seq.mla_pages = [[page_of[s] for s in group] for group in mla]
        self.pages_swapped_in += len(slots)

    def discard(self, seq: Sequence) -> None:
        """Free `seq`'s swapped slots, if any (it finished, was aborted or restarts from token 0)."""
        kda, mla = self.swapped.pop(seq.seq_id, ([], []))
        slots = kda + [s for group in mla for s in group]
        if slots:
            self.host.free(slots)

    @property
    def num_swapped_slots(self) -> int:
        """Slots holding swapped-out sequences' pages."""
        return sum(len(kda) + sum(map(len, mla)) for kda, mla in self.swapped.values())

    def _parked_slots(self) -> set[int]:
        return {s for kda, mla in self.parked.values() for s in kda + [x for group in mla for x in group]}

    @property
    def num_parked_pages(self) -> int:
        """Slots holding parked sequences' pages."""
        return len(self._parked_slots())

    def check_integrity(self) -> None:
        """Cached entries, mirrors, parked and swapped pages hold distinct allocated slots."""
        swapped = [s for kda, mla in self.swapped.values() for s in kda + [x for group in mla for x in group]]
        slots = list(self.lru) + list(self.mirrors.values()) + sorted(self._parked_slots()) + swapped
        if len(set(slots)) != len(slots) or any(self.host.tag(s) is None for s in slots):
            raise AssertionError("host slots of cached entries, mirrors, parked and swapped sequences overlap "
                                 "or are free")
