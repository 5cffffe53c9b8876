"""The prefix cache's policy over the page pool; the cache manager calls it at each phase.

- `attach(seq)` at admission: look the sequence's chained hashes up (rollout/kv/prefix_index.py), pin
  every hit page (rule 1) before allocating anything, share the fully covered MLA pages, copy the
  partially covered last MLA page and the KDA checkpoints into private pages, and start the
  prefill at the hit (always leaving one token to compute); a hit on the host tier is prefetched.
- `register(seq)` after each forward pass: index the sequence's complete hash blocks; when the pass
  ended on a hash-block boundary (the scheduler cuts prefill chunks there), copy its KDA states
  into fresh pages as a read-only checkpoint, recycling its previous one unless at a turn boundary.
- `evict(n)` when the pool runs short: bundles only the index holds, least recently used first
  (`eviction="turn_aware"`: turn-boundary checkpoints and the MLA pages under them last), written
  back to the host tier when there is one. Entries and their tiers: rollout/kv/prefix_store.py.
- `flush()` right before the forward pass runs the step's page copies (rollout/kv/page_copies.py);
  until then a destination never matches (rule 2), and a sequence whose best hit waits on one is
  admitted a step later (`attach` returns None). Debug flags switch each rule off, for the tests.
"""
from __future__ import annotations

from collections import OrderedDict

from memory.page_pool import PagePool
from rollout.kv.host_tier import HostTier
from rollout.kv.page_copies import PageCopies
from rollout.kv.page_loc import Loc
from rollout.kv.prefix_config import PrefixCacheConfig
from rollout.kv.prefix_index import Match, PrefixIndex, cache_salt, chain_hashes
from rollout.kv.prefix_store import PrefixStore
from rollout.kv.resume_order import ResumeOrder
from rollout.request import Sequence

__all__ = ["PrefixCache", "PrefixCacheConfig"]


class PrefixCache:
    def __init__(self, pool: PagePool, config: PrefixCacheConfig, copies: PageCopies,
                 host_tier: HostTier | None = None) -> None:
        layout = pool.layout
        if layout.block_tokens % config.hash_block:
            raise ValueError(f"the pool's block_tokens={layout.block_tokens} is not a multiple of "
                             f"hash_block={config.hash_block}")
        self.pool, self.config, self.copies, self.host_tier = pool, config, copies, host_tier
        self.num_kda, self.num_mla = len(layout.kda_groups), len(layout.mla_groups)
        self.store = PrefixStore(pool, config, host_tier)
        self.version = 0
        self._hashes: dict[int, list[bytes]] = {}  # seq_id -> chain over its computed tokens
        self._registered: dict[int, int] = {}  # seq_id -> tokens registered so far (write-through)
        self._last_ckpt: dict[int, tuple[bytes, int]] = {}  # seq_id -> (hash, position) of its newest checkpoint
        self._turns: dict[bytes, list[bytes]] = {}  # turn-boundary checkpoint -> the hash chain up to it
        self._ends: dict[bytes, list[bytes]] = {}  # finished sequences' newest checkpoints (kept over a sleep)
        self._recycle: list[bytes] = []  # checkpoints superseded by a pending one: dropped after flush()
        self._key_version: dict[bytes, int] = {}  # hash -> the policy version that computed it (first registered)
        self.hit_tokens = 0
        self.stale_hit_tokens = 0
        """Hit tokens computed by an older policy version (`reuse_stale`): their KV is stale."""
        self.lookups = 0
        self.deferred_admissions = 0
        """Times a sequence waited a step for a pending copy instead of taking a shorter hit."""
        self.resume = ResumeOrder()
        """When each waiting conversation is expected to resume: eviction's order (rollout/kv/resume_order.py)."""
        self.host_hit_tokens = 0
        """Hit tokens whose pages came back from the host tier (a prefetch)."""
        self.reprefilled_tokens = 0
        """Prompt tokens computed again although the index held them earlier in this version (evicted, dropped)."""
        self.prefetched_ahead = 0
        """Pages prefetched before their sequence was admitted (`prefetch_ahead`): no admission waits on them."""
        self._seen: set[bytes] = set()  # every hash registered under the current salt

    @property
    def index(self) -> PrefixIndex:
        return self.store.index

    @property
    def lru(self) -> OrderedDict[int, None]:
        return self.store.lru

    @property
    def num_evictable(self) -> int:
        """Device pages only the index holds (refcount 1): free for a sequence that needs them, as
        far as the pool's pressure goes (an upper bound: a bundle goes only whole)."""
        return sum(self.pool.refcount(p) == 1 for p in self.lru)

    @property
    def salt(self) -> bytes:
        return cache_salt(self.config.model_id, 0 if self.config.reuse_stale else self.version)

    @property
    def pages_written_back(self) -> int:
        return self.host_tier.pages_written_back if self.host_tier is not None else 0

    @property
    def pages_prefetched(self) -> int:
        return self.host_tier.pages_prefetched if self.host_tier is not None else 0

    def set_version(self, version: int) -> None:
        """New weights: nothing computed by the old ones may hit again; the index is emptied
        (unless `reuse_stale` explicitly allows stale prefixes)."""
        if version != self.version:
            if not self.config.reuse_stale:
                self.clear()
            self.version = version

    @property
    def is_empty(self) -> bool:
        """No entry on either tier."""
        return not self.index.mla and not self.index.kda

    def clear(self) -> None:
        """Drop the whole index on both tiers (its references go; pages sequences still hold stay)."""
        self.flush()
        self.store.clear()
        self._key_version.clear()
        self._forget_sequences()
        self._turns.clear()
        self._ends.clear()
        self.resume.clear()
        self._seen.clear()

    def key_version(self, h: bytes) -> int:
        """The policy version that computed the prefix ending at hash `h` (the current one if unknown)."""
        return self._key_version.get(h, self.version)

    def slot_version(self, slot: int) -> int:
        """The oldest policy version among the entries reading host `slot`."""
        return min((self.key_version(h) for h in self.index.keys_of(Loc.host(slot))), default=self.version)

    def _note_versions(self, hashes: list[bytes], first: int, version: int) -> None:
        """Tag hashes[first:] that the index does not hold yet with `version` (the oldest version whose
        KV the registering sequence holds: a block computed on stale KV is stale too); forget the
        versions of keys the index dropped once they outnumber its keys (amortised)."""
        index = self.index
        for h in hashes[first:]:
            if h not in index.mla and h not in index.kda:
                self._key_version[h] = version
        if len(self._key_version) > 2 * (len(self.index.mla) + len(self.index.kda)) + 1024:
            live = self.index.mla.keys() | self.index.kda.keys()
            self._key_version = {h: v for h, v in self._key_version.items() if h in live}

    def hashes(self, seq: Sequence, upto: int, pending: list[int] | tuple[int, ...] = ()) -> list[bytes]:
        """Chained hashes of (seq.tokens + pending)[:upto] (complete hash blocks), extended incrementally.
        `pending`: tokens computed and verified but not appended yet (a speculative verification's)."""
        hb = self.config.hash_block
        chain = self._hashes.setdefault(seq.seq_id, [])
        want = upto // hb
        if len(chain) < want:
            start = len(chain) * hb
            tokens = seq.tokens[start:want * hb]
            if len(tokens) < want * hb - start:
                tokens = tokens + list(pending)[:want * hb - start - len(tokens)]
            chain += chain_hashes(tokens, hb, self.salt, start=chain[-1] if chain else b"", first_block=len(chain))
        if len(chain) < want:
            raise AssertionError(f"sequence {seq.seq_id}: {upto} tokens computed but only "
                                 f"{len(seq.tokens) + len(pending)} known to hash")
        return chain[:want]

    def forget(self, seq: Sequence) -> None:
        """The sequence is gone (finished, aborted): drop its per-sequence state. Its newest checkpoint
        is remembered as a conversation's end (where its next turn resumes, maybe in the next
        iteration): `sleep` writes it back with the turn boundaries (eviction order is unchanged)."""
        last = self._last_ckpt.get(seq.seq_id)
        chain = self._hashes.get(seq.seq_id, [])
        if last is not None and last[0] in self.index.kda and last[1] // self.config.hash_block <= len(chain):
            self._ends[last[0]] = chain[:last[1] // self.config.hash_block]
        self._hashes.pop(seq.seq_id, None)
        self._last_ckpt.pop(seq.seq_id, None)
        self._registered.pop(seq.seq_id, None)

    def _forget_sequences(self) -> None:
        self._hashes.clear()
        self._last_ckpt.clear()
        self._registered.clear()

    # ---- admission -----------------------------------------------------------------------------------
    def attach(self, seq: Sequence) -> int | None:
        """Give a page-less sequence the longest cached prefix of its tokens; returns the hit length,
        or None when that hit waits on a pending copy or a prefetch (admit the sequence next step)."""
        if seq.holds_pages or seq.num_computed:
            return 0
        match = self._lookup(seq)
        if match is None:
            self.deferred_admissions += 1
            return None
        self.lookups += 1
        hit = self._take(seq, match) if match.tokens else 0
        hb = self.config.hash_block
        self.reprefilled_tokens += hb * sum(h in self._seen for h in self._hashes[seq.seq_id][hit // hb:])
        return hit

    def _lookup(self, seq: Sequence) -> Match | None:
        """The longest device-tier hit; None when a longer one waits on a pending copy, or sits on
        the host and is being prefetched (the sequence waits a step, others go on)."""
        hashes = self.hashes(seq, seq.num_tokens - 1)
        has_mla = self.num_mla > 0
        excluded = self.pending_destinations() if self.config.exclude_pending else set()
        match = self.index.match(hashes, seq.num_tokens, has_mla=has_mla, excluded=excluded)
        if excluded and self.index.match(hashes, seq.num_tokens, has_mla=has_mla).tokens > match.tokens:
            return None
        locations = [p for pages in match.mla_pages for p in pages] + list(match.kda_pages)
        on_host = [loc for loc in locations if not loc.on_device]
        if on_host:
            if self.store.prefetch(on_host, self.evict):
                return None
            excluded |= {Loc.host(s) for s in self.host_tier.lru}  # device tier only
            match = self.index.match(hashes, seq.num_tokens, has_mla=has_mla, excluded=excluded)
        return match

    def _take(self, seq: Sequence, match: Match) -> int:
        """Give `seq` the hit's pages (shared) and private copies of the partial page and the
        checkpoint; returns the hit length, 0 when the pool has no room for the copies."""
        bt = self.pool.layout.block_tokens
        full = match.tokens // bt  # blocks entirely inside the hit: shared by reference
        partial = match.tokens % bt != 0
        blocks = [[loc.page for loc in pages] for pages in match.mla_pages]
        checkpoint = [loc.page for loc in match.kda_pages]
        hit_pages = [p for pages in blocks for p in pages] + checkpoint
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
        copies_src, copies_dst = list(checkpoint), list(kda)
        mla = []
        for g in range(self.num_mla):
            own = self.pool.allocate(1, ("mla", g)) if partial else []
            if partial:
                copies_src.append(blocks[full][g])
                copies_dst += own
            mla.append([pages[g] for pages in blocks[:full]] + own)
        self._copy(copies_src, copies_dst)
        self.pool.incref([p for group in mla for p in group[:full]])  # the sequence's own references
        if self.config.pin_hits:
            self.pool.decref(hit_pages)
        self.store.touch(hit_pages)
        if self.store.from_host.intersection(hit_pages):
            self.host_hit_tokens += match.tokens
            self.store.from_host.difference_update(hit_pages)
        seq.kda_pages, seq.mla_pages, seq.num_computed = kda, mla, match.tokens
        chain = self._hashes[seq.seq_id][:match.tokens // self.config.hash_block]
        self.resume.consumed(chain)
        versions = [self.key_version(h) for h in chain]
        seq.kv_version = min(versions, default=self.version)
        self.hit_tokens += match.tokens
        self.stale_hit_tokens += sum(v < self.version for v in versions) * self.config.hash_block
        return match.tokens

    # ---- after a forward pass ---------------------------------------------------------------------------
    def register(self, seq: Sequence, pending: list[int] | tuple[int, ...] = (),
                 inner: tuple[int, list[int]] | None = None) -> None:
        """Index what the sequence has computed; checkpoint its KDA states at a hash-block boundary.
        A sequence whose KV token eviction pruned registers nothing: its pages are not the prefix.
        `pending`: computed tokens not appended yet (a speculative verification's accepted proposals);
        `inner`: (a boundary the step crossed before its end, pages holding the KDA states there, one
        per cache group), checkpointed from those pages."""
        if seq.kv_pruned:
            return
        hb, done = self.config.hash_block, seq.num_computed
        hashes = self.hashes(seq, done, pending)
        if self.config.reuse_stale:
            self._note_versions(hashes, self._registered.get(seq.seq_id, 0) // hb,
                                self.version if seq.kv_version is None else min(self.version, seq.kv_version))
        if self.num_mla and hashes:
            block_pages = [tuple(seq.mla_pages[g][j] for g in range(self.num_mla))
                           for j in range(len(seq.mla_pages[0]))]
            new = self.index.register_mla(hashes, 0, [tuple(map(Loc.device, pages)) for pages in block_pages])
            self.store.hold(sorted(loc.page for loc in new))
            if self._write_through:  # the pages whose registered end advanced, again
                bt, first = self.pool.layout.block_tokens, self._registered.get(seq.seq_id, 0)
                touched = [p for pages in block_pages[first // bt:(done + bt - 1) // bt] for p in pages]
                self.host_tier.mirror([p for p in touched if p in self.lru])
        self._seen.update(hashes[self._registered.get(seq.seq_id, 0) // hb:])
        self._registered[seq.seq_id] = done
        if inner is not None and self.num_kda:
            boundary, pages = inner
            if boundary % hb or not 0 < boundary < done or len(pages) != self.num_kda:
                raise ValueError(f"inner checkpoint at {boundary} with {len(pages)} pages: expected a multiple of "
                                 f"{hb} in (0, {done}) and {self.num_kda} pages")
            self._checkpoint(seq, hashes[:boundary // hb], boundary, pages)
        if done and not done % hb and self.num_kda:
            self._checkpoint(seq, hashes, done, list(seq.kda_pages))

    def _checkpoint(self, seq: Sequence, hashes: list[bytes], done: int, states: list[int]) -> None:
        """Copy the KDA states after `done` tokens (hashes[-1]'s block end), in pages `states` (one per
        cache group), into fresh checkpoint pages."""
        hb, h = self.config.hash_block, hashes[-1]
        is_turn = any(done == p // hb * hb for p in seq.turn_boundaries)
        if len(self.index.kda.get(h, {})) == self.num_kda:
            if is_turn:  # someone already checkpointed this exact prefix; it is a turn for this one
                self._turns[h] = list(hashes)
            return
        companion = list(self.index.mla.get(h, ())) if self.num_mla else []
        if any(not loc.on_device for loc in companion):
            return  # its MLA pages live on the host tier: a checkpoint never sits on another tier
        companion = [loc.page for loc in companion]
        if self.num_kda > self.pool.num_free:
            self.pool.incref(companion)  # the checkpoint's MLA pages stay on this tier meanwhile
            self.evict(self.num_kda - self.pool.num_free)
            self.pool.decref(companion)
        if self.num_kda > self.pool.num_free:
            return  # no room for a checkpoint now; the prefix stays reachable up to its MLA pages
        pages = [self.pool.allocate(1, ("kda", g))[0] for g in range(self.num_kda)]
        self._copy(list(states), pages)
        for g, page in enumerate(pages):
            self.index.register_kda(h, g, Loc.device(page))
        self.lru.update((p, None) for p in pages)  # the allocation's reference is the index's
        if self._write_through:
            self.host_tier.mirror(pages)
        if is_turn:
            self._turns[h] = list(hashes)
        previous = self._last_ckpt.get(seq.seq_id)
        self._last_ckpt[seq.seq_id] = (h, done)
        if previous is not None and previous[0] not in self._turns:
            # Superseded; while the new checkpoint's copy is pending the old one stays reachable.
            if self.copies.device:
                self._recycle.append(previous[0])
            else:
                self._drop_checkpoint(previous[0])

    # ---- page copies -----------------------------------------------------------------------------------
    def _copy(self, src: list[int], dst: list[int]) -> None:
        if self.config.defer_copies:
            self.copies.copy(src, dst)
        else:
            self.pool.copy_pages(src, dst)

    def pending_destinations(self) -> set[Loc]:
        """Locations a pending copy will overwrite: they still hold their previous owner's bytes."""
        return {Loc.device(p) for p in self.copies.destinations()}

    def pending_references(self) -> list[int]:
        """The device pool references pending copies hold (one per device end per copy)."""
        return self.copies.references()

    def flush(self) -> None:
        """Run the step's pending copies (`PageCopies.flush`), then recycle what they superseded."""
        self.copies.flush()
        self.resume.invalidate()
        recycle, self._recycle = self._recycle, []
        for h in recycle:
            self._drop_checkpoint(h)

    # ---- the host tier -------------------------------------------------------------------------------
    @property
    def _write_through(self) -> bool:
        return self.host_tier is not None and self.config.host_mode == "write_through"

    def sleep(self) -> None:
        """The device pool is about to be released: with a host tier and `reuse_stale`, write the
        turn-boundary entries back (what later turns will need under the next weights); drop every
        other device entry. Without `reuse_stale` the next weights empty the cache: nothing is copied
        for it. Host entries stay."""
        self.flush()
        if self.host_tier is not None and self.config.reuse_stale:
            protected = self.protected_pages() | self._pages_under(self._ends)
            for page in [p for p in self.lru if p in protected]:
                if page in self.lru and self.pool.refcount(page) == 1:
                    group = self.index.bundle(Loc.device(page))
                    if all(self.pool.refcount(loc.page) == 1 for loc in group):
                        self.store.write_back(group)
        self.store.drop([Loc.device(p) for p in self.lru])
        self._forget_sequences()
        self._ends.clear()

    # ---- eviction ------------------------------------------------------------------------------------------
    def _drop_checkpoint(self, h: bytes) -> None:
        slot = self.index.kda.get(h)
        if slot and h not in self._turns and all(not loc.on_device or self.pool.refcount(loc.page) == 1
                                                 for loc in slot.values()):
            self.store.drop([next(iter(slot.values()))])

    def protected_pages(self) -> set[int]:
        """Device pages the turn-aware policy evicts last: each complete turn-boundary checkpoint's
        pages and the MLA pages its prefix is read from."""
        return self._pages_under(self._turns)

    def _pages_under(self, checkpoints: dict[bytes, list[bytes]]) -> set[int]:
        """Device pages of each complete checkpoint of `checkpoints` (hash -> chain up to it) and of the
        MLA pages its prefix is read from; entries evicted meanwhile are removed from the dict."""
        protected: set[Loc] = set()
        for h, chain in list(checkpoints.items()):
            slot = self.index.kda.get(h)
            if slot is None or len(slot) < self.num_kda:
                del checkpoints[h]  # evicted meanwhile
                continue
            match = self.index.match(chain, len(chain) * self.config.hash_block + 1, has_mla=self.num_mla > 0)
            protected.update(slot.values())
            if match.tokens == len(chain) * self.config.hash_block:
                protected.update(p for pages in match.mla_pages for p in pages)
        return {loc.page for loc in protected if loc.on_device}

    def evict(self, num: int, sooner_than: float | None = None) -> int:
        """Free at least `num` device pages if possible; returns pages freed. Only pages nobody but
        the index holds go, a bundle at a time: least recently used first; turn_aware: turn-boundary
        prefixes after the others, waiting conversations' last, the one expected to resume last first
        (rollout/kv/resume_order.py); to the host tier when there is one, else dropped. `sooner_than`:
        for a conversation resuming then, only what it may take (nobody expected sooner loses a page)."""
        order = list(self.lru)
        if self.config.eviction == "turn_aware" and (self._turns or self.resume.expected):
            protected = self.protected_pages() if self._turns else set()
            order = self.resume.eviction_order(order, protected, self.resume.resume_of(self._pages_of), sooner_than)
        freed = 0
        for page in order:
            if freed >= num:
                break
            if page not in self.lru or self.pool.refcount(page) != 1:
                continue
            loc = Loc.device(page)
            group = self.index.bundle(loc) if self.config.atomic_checkpoints else [loc]
            if any(self.pool.refcount(p.page) != 1 for p in group):
                if self.index.checkpoint_of(loc) is not None:  # its MLA pages are in use: it goes alone
                    freed += self.store.drop([loc])
                continue
            moved = self.store.write_back(group) if self.host_tier is not None else 0
            freed += moved or self.store.drop(group)
        if freed:
            self.resume.invalidate()
        return freed

    # ---- waiting conversations -------------------------------------------------------------------------
    def _pages_of(self, h: bytes, chain: list[bytes]) -> set[int] | None:
        """The device pages a hit up to checkpoint `h` (chain `chain`) reads; None once h left the index."""
        slot = self.index.kda.get(h)
        if self.num_kda and (slot is None or len(slot) < self.num_kda):
            return None
        if not self.num_kda and h not in self.index.mla:
            return None
        pages = {loc.page for loc in slot.values() if loc.on_device} if slot else set()
        match = self.index.match(chain, len(chain) * self.config.hash_block + 1, has_mla=self.num_mla > 0)
        pages.update(loc.page for group in match.mla_pages for loc in group if loc.on_device)
        return pages

    def _checkpointed(self, chain: list[bytes]) -> int:
        """Blocks of `chain` up to its longest complete checkpoint (MLA entry without KDA groups); 0: none."""
        for i in range(len(chain), 0, -1):
            h = chain[i - 1]
            if (len(self.index.kda.get(h, {})) == self.num_kda) if self.num_kda else h in self.index.mla:
                return i
        return 0

    def hashes_of(self, tokens: list[int]) -> list[bytes]:
        """The chained hashes a request of prompt `tokens` looks up (its complete blocks but the last token)."""
        hb = self.config.hash_block
        return chain_hashes(tokens[:(len(tokens) - 1) // hb * hb], hb, self.salt)

    def expect(self, tokens: list[int], at: float) -> None:
        """The conversation `tokens` continues resumes at about `at` (monotonic seconds: its tool's
        expected end): its entries are evicted after those of conversations resuming later."""
        chain = self.hashes_of(tokens)
        n = self._checkpointed(chain)
        if n:
            self.resume.expect(chain[n - 1], chain[:n], at)

    def prefetch_ahead(self, chain: list[bytes], at: float, reserve: int) -> int:
        """A queued request's cached prefix (`chain`: the hashes it will look up), if on the host tier,
        starts its way back now (before the request is admitted, so no admission waits on it), evicting
        only entries of conversations expected after `at` and keeping `reserve` pages free; it is
        expected at `at` meanwhile (unless expected sooner already). Returns the pages queued."""
        n = self._checkpointed(chain)
        if not n:
            return 0
        h = chain[n - 1]
        at = min(at, self.resume.expected.get(h, (at,))[0])
        self.resume.expect(h, chain[:n], at)
        if self.host_tier is None:
            return 0
        match = self.index.match(chain[:n], n * self.config.hash_block + 1, has_mla=self.num_mla > 0)
        locations = [p for pages in match.mla_pages for p in pages] + list(match.kda_pages)
        on_host = [loc for loc in locations if not loc.on_device]
        if not on_host:
            return 0
        before = self.host_tier.pages_prefetched
        self.store.prefetch(on_host, lambda num: self.evict(num, sooner_than=at), reserve=reserve)
        self.prefetched_ahead += self.host_tier.pages_prefetched - before
        return self.host_tier.pages_prefetched - before

    def check_integrity(self) -> None:
        """The index agrees with itself and holds exactly one reference on each device page it knows."""
        self.store.check_integrity()
