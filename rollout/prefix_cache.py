"""The prefix cache over the page pool (SPEC §5.2; issue 6, part 2): what the engine calls.

- `attach(seq)` at admission: look the sequence's chained hashes up (rollout/prefix_index.py), pin
  every hit page (rule 1) before allocating anything, share the fully covered MLA pages by
  reference, copy the partially covered last MLA page and the KDA checkpoints into the sequence's
  private pages, and start its prefill at the hit (always leaving one token to compute).
- `register(seq)` after each forward pass: index the sequence's complete hash blocks in its MLA
  pages; when the pass ended on a hash-block boundary (the scheduler cuts prefill chunks there),
  copy its KDA states into fresh pages as a read-only checkpoint. The sequence's previous
  checkpoint is recycled unless it sits at a conversation-turn boundary.
- `evict(n)` when the pool runs short: pages that only the index holds, least recently used first;
  with `eviction="turn_aware"` (default) the checkpoints at conversation-turn boundaries, and the
  MLA pages under them, go only after every other cached page. A KDA checkpoint goes with its
  siblings in the other groups (rule 3).
- `flush()` right before the forward pass: the step's page copies (into private pages at
  admission, out to checkpoints after the previous pass) run as one batched gather + scatter.
  Until then a checkpoint page holds its previous owner's bytes, so it is excluded from matching
  (rule 2); a sequence whose best hit waits on such a copy is admitted a step later instead of
  recomputing (`attach` returns None). A pending copy holds a pool reference on both its pages.
The index holds one pool reference per page it knows; a page is evictable when that is its only one.
Debug flags switch each concurrency rule off, for the tests that show why it exists.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from memory.host_pool import HostPagePool
from memory.page_pool import PagePool
from rollout.prefix_config import PrefixCacheConfig
from rollout.prefix_index import PrefixIndex, cache_salt, chain_hashes
from rollout.request import Sequence

__all__ = ["PrefixCache", "PrefixCacheConfig"]


class PrefixCache:
    def __init__(self, pool: PagePool, config: PrefixCacheConfig, host: HostPagePool | None = None) -> None:
        layout = pool.layout
        if layout.block_tokens % config.hash_block:
            raise ValueError(f"the pool's block_tokens={layout.block_tokens} is not a multiple of "
                             f"hash_block={config.hash_block}")
        self.pool, self.config = pool, config
        self.num_kda, self.num_mla = len(layout.kda_groups), len(layout.mla_groups)
        self.index = PrefixIndex(config.hash_block, layout.block_tokens, self.num_kda)
        self.version = 0
        self.lru: OrderedDict[int, None] = OrderedDict()  # device pages the index holds a reference to
        self.host = host
        self.num_device = pool.num_pages  # index locations >= this are host pages (location - num_device)
        self.host_lru: OrderedDict[int, None] = OrderedDict()  # host locations the index reads
        self._mirror: dict[int, int] = {}  # device page -> host page holding the same (registered) bytes
        self._pending_in: list[tuple[int, int]] = []  # (host page, device page) prefetch copies
        self._pending_out: list[tuple[int, int]] = []  # (device page, host page) write-through copies
        self._host_pinned: set[int] = set()  # host locations being prefetched: never dropped meanwhile
        self._registered: dict[int, int] = {}  # seq_id -> tokens registered so far (write-through)
        self.pages_written_back = 0
        self.pages_prefetched = 0
        self._hashes: dict[int, list[bytes]] = {}  # seq_id -> chain over its computed tokens
        self._last_ckpt: dict[int, tuple[bytes, int]] = {}  # seq_id -> (hash, position) of its newest checkpoint
        self._turns: dict[bytes, list[bytes]] = {}  # turn-boundary checkpoint -> the hash chain up to it
        self._pending: list[tuple[int, int]] = []  # (src, dst) page copies waiting for flush()
        self._recycle: list[bytes] = []  # checkpoints superseded by a pending one: dropped after flush()
        self.hit_tokens = 0
        self.lookups = 0
        self.deferred_admissions = 0
        """Times a sequence waited a step for a pending copy instead of taking a shorter hit."""

    @property
    def salt(self) -> bytes:
        return cache_salt(self.config.model_id, 0 if self.config.reuse_stale else self.version)

    def set_version(self, version: int) -> None:
        """New weights: nothing computed by the old ones may hit again; the index is emptied
        (unless `reuse_stale` explicitly allows stale prefixes)."""
        if version != self.version:
            if not self.config.reuse_stale:
                self.clear()
            self.version = version

    def clear(self) -> None:
        """Drop the whole index on both tiers (its references go; pages sequences still hold stay)."""
        self.flush()
        pages = list(self.lru)
        if self.host is not None:
            self.host.free([loc - self.num_device for loc in self.host_lru] + list(self._mirror.values()))
        self.lru.clear()
        self.host_lru.clear()
        self._mirror.clear()
        self.index = PrefixIndex(self.config.hash_block, self.pool.layout.block_tokens, self.num_kda)
        self._hashes.clear()
        self._last_ckpt.clear()
        self._turns.clear()
        self._registered.clear()
        if pages:
            self.pool.decref(pages)

    def hashes(self, seq: Sequence, upto: int) -> list[bytes]:
        """Chained hashes of seq.tokens[:upto] (complete hash blocks), extended incrementally."""
        hb = self.config.hash_block
        chain = self._hashes.setdefault(seq.seq_id, [])
        want = upto // hb
        if len(chain) < want:
            start = len(chain) * hb
            chain += chain_hashes(seq.tokens[start:want * hb], hb, self.salt,
                                  start=chain[-1] if chain else b"", first_block=len(chain))
        return chain[:want]

    def forget(self, seq: Sequence) -> None:
        """The sequence is gone (finished, aborted) or restarts: drop its per-sequence state."""
        self._hashes.pop(seq.seq_id, None)
        self._last_ckpt.pop(seq.seq_id, None)
        self._registered.pop(seq.seq_id, None)

    # ---- admission -----------------------------------------------------------------------------------
    def attach(self, seq: Sequence) -> int | None:
        """Give a page-less sequence the longest cached prefix of its tokens; returns the hit length,
        or None when that hit waits on a pending copy (admit the sequence next step)."""
        if seq.holds_pages or seq.num_computed:
            return 0
        hashes = self.hashes(seq, seq.num_tokens - 1)
        has_mla = self.num_mla > 0
        excluded = self.pending_destinations() if self.config.exclude_pending else ()
        match = self.index.match(hashes, seq.num_tokens, has_mla=has_mla, excluded=excluded)
        if excluded and self.index.match(hashes, seq.num_tokens, has_mla=has_mla).tokens > match.tokens:
            self.deferred_admissions += 1
            return None
        on_host = [p for p in self._match_locations(match) if p >= self.num_device]
        if on_host:  # bring them back before the forward pass; the sequence waits a step, others go on
            if self._prefetch(on_host):
                self.deferred_admissions += 1
                return None
            match = self.index.match(hashes, seq.num_tokens, has_mla=has_mla,
                                     excluded=set(excluded) | set(self.host_lru))  # device tier only
        self.lookups += 1
        if not match.tokens:
            return 0
        bt = self.pool.layout.block_tokens
        full = match.tokens // bt  # blocks entirely inside the hit: shared by reference
        partial = match.tokens % bt != 0
        hit_pages = [p for pages in match.mla_pages for p in pages] + list(match.kda_pages)
        if self.config.pin_hits:
            self.pool.incref(hit_pages)  # rule 1: nothing below may evict what we are about to use
        need = self.num_kda + (self.num_mla if partial else 0)
        if need > self.pool.num_free:
            self.evict(need - self.pool.num_free)
        if need > self.pool.num_free:  # no room for the private copies: no hit this time
            if self.config.pin_hits:
                self.pool.decref(hit_pages)
            return 0
        kda = [self.pool.allocate(1, ("kda", g))[0] for g in range(self.num_kda)]
        copies_src, copies_dst = list(match.kda_pages), list(kda)
        mla = []
        for g in range(self.num_mla):
            own = self.pool.allocate(1, ("mla", g)) if partial else []
            if partial:
                copies_src.append(match.mla_pages[full][g])
                copies_dst += own
            mla.append([pages[g] for pages in match.mla_pages[:full]] + own)
        self._copy(copies_src, copies_dst)
        self.pool.incref([p for group in mla for p in group[:full]])  # the sequence's own references
        if self.config.pin_hits:
            self.pool.decref(hit_pages)
        for page in hit_pages:
            if page in self.lru:
                self.lru.move_to_end(page)
        seq.kda_pages, seq.mla_pages, seq.num_computed = kda, mla, match.tokens
        self.hit_tokens += match.tokens
        return match.tokens

    # ---- after a forward pass ---------------------------------------------------------------------------
    def register(self, seq: Sequence) -> None:
        """Index what the sequence has computed; checkpoint its KDA states at a hash-block boundary.
        A sequence whose KV token eviction pruned registers nothing: its pages are not the prefix."""
        if seq.kv_pruned:
            return
        hb, done = self.config.hash_block, seq.num_computed
        hashes = self.hashes(seq, done)
        if self.num_mla and hashes:
            block_pages = [tuple(seq.mla_pages[g][j] for g in range(self.num_mla))
                           for j in range(len(seq.mla_pages[0]))]
            self._hold(self.index.register_mla(hashes, 0, block_pages))
            if self._write_through:  # the pages whose registered end advanced, again
                bt, first = self.pool.layout.block_tokens, self._registered.get(seq.seq_id, 0)
                touched = [p for pages in block_pages[first // bt:(done + bt - 1) // bt] for p in pages]
                self._mirror_now([p for p in touched if p in self.lru])
        self._registered[seq.seq_id] = done
        if done == 0 or done % hb or not self.num_kda:
            return
        h = hashes[-1]
        is_turn = any(done == p // hb * hb for p in seq.turn_boundaries)
        if len(self.index.kda.get(h, {})) == self.num_kda:
            if is_turn:  # someone already checkpointed this exact prefix; it is a turn for this one
                self._turns[h] = list(hashes)
            return
        companion = list(self.index.mla.get(h, ())) if self.num_mla else []
        if any(p >= self.num_device for p in companion):
            return  # its MLA pages live on the host tier: a checkpoint never sits on another tier
        if self.num_kda > self.pool.num_free:
            self.pool.incref(companion)  # the checkpoint's MLA pages stay on this tier meanwhile
            self.evict(self.num_kda - self.pool.num_free)
            self.pool.decref(companion)
        if self.num_kda > self.pool.num_free:
            return  # no room for a checkpoint now; the prefix stays reachable up to its MLA pages
        pages = [self.pool.allocate(1, ("kda", g))[0] for g in range(self.num_kda)]
        self._copy(list(seq.kda_pages), pages)
        for g, page in enumerate(pages):
            self.index.register_kda(h, g, page)
        self.lru.update((p, None) for p in pages)  # the allocation's reference is the index's
        if self._write_through:
            self._mirror_now(pages)
        if is_turn:
            self._turns[h] = list(hashes)
        previous = self._last_ckpt.get(seq.seq_id)
        self._last_ckpt[seq.seq_id] = (h, done)
        if previous is not None and previous[0] not in self._turns:
            # Superseded; while the new checkpoint's copy is pending the old one stays reachable.
            if self._pending:
                self._recycle.append(previous[0])
            else:
                self._drop_checkpoint(previous[0])

    # ---- page copies -----------------------------------------------------------------------------------
    def _copy(self, src: list[int], dst: list[int]) -> None:
        if not self.config.defer_copies:
            self.pool.copy_pages(src, dst)
            return
        self.pool.incref(src + dst)  # both ends stay allocated (and their bytes put) until the copy ran
        self._pending += zip(src, dst)

    def pending_destinations(self) -> set[int]:
        """Pages a pending copy will overwrite: they still hold their previous owner's bytes."""
        return {dst for _, dst in self._pending} | {dst for _, dst in self._pending_in}

    def pending_references(self) -> list[int]:
        """The device pool references pending copies hold (one per device end per copy)."""
        return ([p for pair in self._pending for p in pair] + [d for _, d in self._pending_in]
                + [d for d, _ in self._pending_out])

    def flush(self) -> None:
        """Run the pending copies: device pages (one gather, then one scatter: every source is read
        before any destination is written), then prefetches from the host, then write-through copies
        to the host; release their references, then recycle what they superseded."""
        if self._pending:
            src, dst = [s for s, _ in self._pending], [d for _, d in self._pending]
            self.pool.copy_pages(src, dst)
            self._pending = []
            self.pool.decref(src + dst)
        if self._pending_in:
            slots, dst = [h for h, _ in self._pending_in], [d for _, d in self._pending_in]
            self.host.load(slots, self.pool, dst)
            self._pending_in = []
            self.pool.decref(dst)
        if self._pending_out:
            src, slots = [d for d, _ in self._pending_out], [h for _, h in self._pending_out]
            self.host.store(slots, self.pool, src)
            self._pending_out = []
            self.pool.decref(src)
        recycle, self._recycle = self._recycle, []
        for h in recycle:
            self._drop_checkpoint(h)

    # ---- the host tier -------------------------------------------------------------------------------
    @property
    def _write_through(self) -> bool:
        return self.host is not None and self.config.host_mode == "write_through"

    def _match_locations(self, match) -> list[int]:
        return [p for pages in match.mla_pages for p in pages] + list(match.kda_pages)

    def bundle(self, location: int) -> list[int]:
        """The locations that move between tiers (or go) together with `location`: an MLA page
        tuple (one page per MLA group, one physical block) and every KDA checkpoint (all groups)
        at a boundary inside it. A checkpoint thus always sits on the tier of the MLA pages of its
        last block, and a checkpoint without MLA keys is unreachable (it goes alone, with siblings)."""
        idx = self.index
        h = idx._kda_key_of_page.get(location)
        if h is not None:
            pages = idx.mla.get(h) if self.num_mla else None
            if pages is None:
                return list(idx.kda[h].values())
        else:
            pages = idx.mla[next(iter(idx._keys_of_page[location]))]
        out = list(pages)
        for key in idx._keys_of_page.get(pages[0], ()):
            out += [p for p in idx.kda.get(key, {}).values() if p not in out]
        return out

    def _host_room(self, num: int, keep: Iterable[int] = ()) -> bool:
        """Make `num` host pages free: clean copies of device pages (but those of `keep`) first,
        then the least recently used host bundles (never one being prefetched). False if impossible."""
        host = self.host
        keep = set(keep) | {d for _, d in self._pending_in} | {d for d, _ in self._pending_out}  # copies in flight
        for page in [p for p in self._mirror if p not in keep]:
            if host.num_free >= num:
                break
            host.free([self._mirror.pop(page)])
        for loc in list(self.host_lru):
            if host.num_free >= num:
                break
            if loc in self.host_lru:
                group = self.bundle(loc)
                if not self._host_pinned.intersection(group):
                    self._drop(group)
        return host.num_free >= num

    def make_host_room(self, num: int) -> bool:
        """Free `num` host pages for someone else (the engine parking paused sequences)."""
        return self._host_room(num)

    def sleep(self) -> None:
        """The device pool is about to be released: with a host tier, write the turn-boundary
        entries back (what later turns will need); drop every other device entry. Host entries stay."""
        self.flush()
        if self.host is not None:
            protected = self.protected_pages()
            for page in [p for p in self.lru if p in protected]:
                if page in self.lru and self.pool.refcount(page) == 1:
                    group = self.bundle(page)
                    if all(self.pool.refcount(p) == 1 for p in group):
                        self._write_back(group)
        self._drop(list(self.lru))
        self._hashes.clear()
        self._last_ckpt.clear()
        self._registered.clear()

    def _write_back(self, device_pages: list[int]) -> int:
        """Move a device bundle to the host tier (copying only pages without a clean host copy);
        returns the device pages freed, 0 if the host tier cannot take it."""
        copy = [p for p in device_pages if p not in self._mirror]
        if not self._host_room(len(copy), keep=device_pages):
            return 0
        slots = [self.host.allocate(1, self.pool.group_of_page(p))[0] for p in copy]
        self.host.store(slots, self.pool, copy)
        self._mirror.update(zip(copy, slots))
        for p in device_pages:
            loc = self.num_device + self._mirror.pop(p)
            self.index.relocate(p, loc)
            self.lru.pop(p)
            self.host_lru[loc] = None
        self.pages_written_back += len(copy)
        return len(self.pool.decref(device_pages))

    def _prefetch(self, locations: list[int]) -> bool:
        """Queue host -> device copies of the bundles holding `locations` (run by the next flush());
        the index reads the new device pages at once, which rule 2 keeps unmatched until then."""
        group = []
        for loc in locations:
            group += [p for p in self.bundle(loc) if p not in group]
        self._host_pinned.update(group)
        try:
            if len(group) > self.pool.num_free:
                self.evict(len(group) - self.pool.num_free)
            if len(group) > self.pool.num_free:
                return False
        finally:
            self._host_pinned.difference_update(group)
        slots = [loc - self.num_device for loc in group]
        dev = [self.pool.allocate(1, self.host.tag(slot))[0] for slot in slots]
        for loc, slot, page in zip(group, slots, dev):
            self.index.relocate(loc, page)
            self.host_lru.pop(loc)
            self.lru[page] = None
            self._mirror[page] = slot  # the host copy stays, clean: evicting it again costs no copy
        self.pool.incref(dev)  # the pending copies' references
        self._pending_in += zip(slots, dev)
        self.pages_prefetched += len(dev)
        return True

    def _mirror_now(self, device_pages: list[int]) -> None:
        """Write-through: queue a copy of each page to its host mirror (allocated on first use)."""
        for p in device_pages:
            if p not in self._mirror:
                if not self._host_room(1):
                    continue
                self._mirror[p] = self.host.allocate(1, self.pool.group_of_page(p))[0]
            self.pool.incref([p])
            self._pending_out.append((p, self._mirror[p]))

    def _hold(self, pages: set[int]) -> None:
        """Take the index's reference on pages it just started to know."""
        self.pool.incref(sorted(pages))
        self.lru.update((p, None) for p in sorted(pages))

    def _drop_checkpoint(self, h: bytes) -> None:
        slot = self.index.kda.get(h)
        if slot and h not in self._turns and all(p >= self.num_device or self.pool.refcount(p) == 1
                                                 for p in slot.values()):
            self._drop([next(iter(slot.values()))])

    # ---- eviction ------------------------------------------------------------------------------------------
    def protected_pages(self) -> set[int]:
        """Pages the turn-aware policy evicts last: each complete turn-boundary checkpoint's pages and
        the MLA pages its prefix is read from."""
        protected: set[int] = set()
        for h, chain in list(self._turns.items()):
            slot = self.index.kda.get(h)
            if slot is None or len(slot) < self.num_kda:
                del self._turns[h]  # evicted meanwhile
                continue
            match = self.index.match(chain, len(chain) * self.config.hash_block + 1, has_mla=self.num_mla > 0)
            protected.update(slot.values())
            if match.tokens == len(chain) * self.config.hash_block:
                protected.update(p for pages in match.mla_pages for p in pages)
        return protected

    def evict(self, num: int) -> int:
        """Free at least `num` device pages if possible; returns pages freed. Only pages nobody but
        the index holds go, a bundle at a time (see `bundle`): least recently used first, turn-boundary
        prefixes last (turn_aware); to the host tier when there is one, else dropped."""
        order = list(self.lru)
        if self.config.eviction == "turn_aware" and self._turns:
            protected = self.protected_pages()
            order = [p for p in order if p not in protected] + [p for p in order if p in protected]
        freed = 0
        for page in order:
            if freed >= num:
                break
            if page not in self.lru or self.pool.refcount(page) != 1:
                continue
            group = self.bundle(page) if self.config.atomic_checkpoints else [page]
            if any(self.pool.refcount(p) != 1 for p in group):
                if page in self.index._kda_key_of_page:  # its MLA pages are in use: the checkpoint goes alone
                    freed += self._drop([page])
                continue
            moved = self._write_back(group) if self.host is not None else 0
            freed += moved or self._drop(group)
        return freed

    def _drop(self, locations: list[int]) -> int:
        """Forget locations (either tier) for good; returns the device pages freed. With rule 3 a
        checkpoint's siblings go too."""
        gone: list[int] = []
        for loc in locations:
            if loc in gone or (loc not in self.lru and loc not in self.host_lru):
                continue
            if self.config.atomic_checkpoints:
                siblings = self.index.forget_page(loc)  # rule 3: a checkpoint's siblings go with it
            else:
                siblings = []
                self.index.forget_page_alone(loc)
            gone += [loc] + [p for p in siblings if p not in gone]
        device = [p for p in gone if p < self.num_device and self.lru.pop(p, 0) is None]
        host = [p - self.num_device for p in gone if p >= self.num_device and self.host_lru.pop(p, 0) is None]
        host += [self._mirror.pop(p) for p in device if p in self._mirror]
        if host:
            self.host.free(host)
        return len(self.pool.decref(device))

    def check_integrity(self) -> None:
        """The index agrees with itself and holds exactly one reference on each page it knows."""
        self.index.check_integrity()
        incomplete = {h.hex()[:8]: sorted(slot) for h, slot in self.index.kda.items() if len(slot) != self.num_kda}
        if incomplete:
            raise AssertionError(f"KDA checkpoints reachable in some groups only (boundary: groups): {incomplete}")
        if self.index.pages() != set(self.lru) | set(self.host_lru):
            raise AssertionError(f"index pages {sorted(self.index.pages())} != held pages "
                                 f"{sorted(self.lru)} + host {sorted(self.host_lru)}")
        for page in self.lru:
            if self.pool.refcount(page) < 1:
                raise AssertionError(f"index page {page} is free in the pool")
        if any(p >= self.num_device for p in self.lru) or any(p < self.num_device for p in self.host_lru):
            raise AssertionError("a device location is listed as a host one or the reverse")
        if self.host is not None:
            slots = [p - self.num_device for p in self.host_lru] + list(self._mirror.values())
            if len(set(slots)) != len(slots) or any(self.host.tag(s) is None for s in slots):
                raise AssertionError("host pages of the index and mirrors overlap or are free")
            if not set(self._mirror) <= set(self.lru):
                raise AssertionError("a mirror belongs to a device page the index does not hold")
        for h, slot in self.index.kda.items():  # a checkpoint sits on the tier of its last MLA block
            tiers = {p >= self.num_device for p in slot.values()}
            if self.num_mla and h in self.index.mla:
                tiers.add(self.index.mla[h][0] >= self.num_device)
            if len(tiers) > 1:
                raise AssertionError(f"KDA checkpoint {h.hex()[:8]} and its MLA pages are on different tiers")
