"""`PrefixStore`: the prefix cache's entries — its index, the locations it reads, moving them.

The index (rollout/kv/prefix_index.py) maps chained hashes to `Loc`s (tier + page). The store holds
one pool reference on each device page the index reads (`lru`, least recently used first); the
index's host pages are the host tier's entries (`HostTier.lru`, rollout/kv/host_tier.py). Entries go
for good with `drop` (a checkpoint with its siblings: rule 3) or move a whole bundle
(`PrefixIndex.bundle`) between tiers: `write_back` (device -> host, when the cache evicts) and
`prefetch` (host -> device, before a hit). Which entries go, and when, is the prefix cache's call.
Invariant (`check_integrity`): the index reads exactly the locations held, each device one
allocated; a KDA checkpoint sits on the tier of its last MLA block.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from memory.page_pool import PagePool
from rollout.kv.host_tier import HostTier
from rollout.kv.page_loc import Loc
from rollout.kv.prefix_config import PrefixCacheConfig
from rollout.kv.prefix_index import PrefixIndex


class PrefixStore:
    def __init__(self, pool: PagePool, config: PrefixCacheConfig, host_tier: HostTier | None) -> None:
        self.pool, self.config, self.host_tier = pool, config, host_tier
        layout = pool.layout
        self.num_kda, self.num_mla = len(layout.kda_groups), len(layout.mla_groups)
        self.index = PrefixIndex(config.hash_block, layout.block_tokens, self.num_kda)
        self.lru: OrderedDict[int, None] = OrderedDict()
        """Device pages the index reads (it holds a pool reference on each), least recently used first."""
        self.from_host: set[int] = set()
        """Device pages a prefetch brought back, until a hit reads them or they leave (host-tier hits)."""
        if host_tier is not None:
            host_tier.evict_entry = self._drop_host_entry

    def hold(self, pages: list[int]) -> None:
        """Take the index's reference on device pages it just started to read."""
        self.pool.incref(pages)
        self.lru.update((p, None) for p in pages)

    def touch(self, pages: list[int]) -> None:
        """The pages served a hit: most recently used now."""
        for page in pages:
            if page in self.lru:
                self.lru.move_to_end(page)

    def indexed(self, loc: Loc) -> bool:
        return loc.page in self.lru if loc.on_device else self.host_tier is not None and loc.page in self.host_tier.lru

    def drop(self, locations: list[Loc]) -> int:
        """Forget locations (either tier) for good; returns the device pages freed. With rule 3 a
        checkpoint's siblings go too."""
        gone: list[Loc] = []
        for loc in locations:
            if loc in gone or not self.indexed(loc):
                continue
            if self.config.atomic_checkpoints:
                siblings = self.index.forget_page(loc)  # rule 3: a checkpoint's siblings go with it
            else:
                siblings = []
                self.index.forget_page_alone(loc)
            gone += [loc] + [p for p in siblings if p not in gone]
        device = [loc.page for loc in gone if loc.on_device and self.lru.pop(loc.page, 0) is None]
        self.from_host.difference_update(device)
        if self.host_tier is not None:
            self.host_tier.drop([loc.page for loc in gone if not loc.on_device], device)
        return len(self.pool.decref(device))

    def write_back(self, group: list[Loc]) -> int:
        """Move a device bundle to the host tier; returns the device pages freed, 0 if it cannot."""
        pages = [loc.page for loc in group]
        slots = self.host_tier.write_back(pages)
        if slots is None:
            return 0
        for page, slot in zip(pages, slots):
            self.index.relocate(Loc.device(page), Loc.host(slot))
            self.lru.pop(page)
            self.from_host.discard(page)
        return len(self.pool.decref(pages))

    def prefetch(self, locations: list[Loc], evict: Callable[[int], int], reserve: int = 0) -> bool:
        """Queue host -> device copies of the bundles holding host `locations` (`evict(n)` makes
        device room first, leaving `reserve` pages free after them); the index reads the new device
        pages at once, which rule 2 keeps unmatched until the copies ran. False (nothing changed) if
        the device pool has no room."""
        group: list[Loc] = []
        for loc in locations:
            group += [p for p in self.index.bundle(loc) if p not in group]
        slots = [loc.page for loc in group]
        self.host_tier.pinned.update(slots)
        try:
            need = len(group) + reserve
            if need > self.pool.num_free:
                evict(need - self.pool.num_free)
            if need > self.pool.num_free:
                return False
        finally:
            self.host_tier.pinned.difference_update(slots)
        for loc, page in zip(group, self.host_tier.prefetch(slots)):
            self.index.relocate(loc, Loc.device(page))
            self.lru[page] = None
            self.from_host.add(page)
        return True

    def _drop_host_entry(self, slot: int) -> None:
        """Room on the host: drop the bundle reading `slot`, unless it is being prefetched."""
        group = self.index.bundle(Loc.host(slot))
        if not any(loc.page in self.host_tier.pinned for loc in group if not loc.on_device):
            self.drop(group)

    def clear(self) -> None:
        """Forget every entry on both tiers (the index's references go; pages sequences hold stay)."""
        pages = list(self.lru)
        if self.host_tier is not None:
            self.host_tier.clear()
        self.lru.clear()
        self.from_host.clear()
        self.index = PrefixIndex(self.config.hash_block, self.pool.layout.block_tokens, self.num_kda)
        if pages:
            self.pool.decref(pages)

    def check_integrity(self) -> None:
        self.index.check_integrity()
        incomplete = {h.hex()[:8]: sorted(slot) for h, slot in self.index.kda.items() if len(slot) != self.num_kda}
        if incomplete:
            raise AssertionError(f"KDA checkpoints reachable in some groups only (boundary: groups): {incomplete}")
        held = {Loc.device(p) for p in self.lru}
        if self.host_tier is not None:
            self.host_tier.check_integrity()
            held |= {Loc.host(s) for s in self.host_tier.lru}
            if not set(self.host_tier.mirrors) <= set(self.lru):
                raise AssertionError("a mirror belongs to a device page the index does not hold")
        if self.index.pages() != held:
            raise AssertionError(f"index pages {sorted(self.index.pages())} != held pages {sorted(held)}")
        for page in self.lru:
            if self.pool.refcount(page) < 1:
                raise AssertionError(f"index page {page} is free in the pool")
        for h, slot in self.index.kda.items():  # a checkpoint sits on the tier of its last MLA block
            tiers = {loc.tier for loc in slot.values()}
            if self.num_mla and h in self.index.mla:
                tiers.add(self.index.mla[h][0].tier)
            if len(tiers) > 1:
                raise AssertionError(f"KDA checkpoint {h.hex()[:8]} and its MLA pages are on different tiers")
