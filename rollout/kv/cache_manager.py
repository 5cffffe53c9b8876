"""The single façade over every KV tier: which pool pages each sequence owns, and the phases.

Every sequence holds, per MLA cache group, `ceil(tokens / block_tokens)` pages in logical order
(its block table) and, per KDA cache group, one private page with its recurrent state. Pages are
ref-counted by the pool; a page shared by forks is referenced once per sequence holding it.
The scheduler and the engine call phase methods only — `chunk`, `admit`, `grow`, `preempt`,
`swap_in`, `reset`, `finish`, `expect_resume`, `prefetch_waiting`, `before_forward`, `after_forward`, `idle`, `park`/`sleep`/`wake`, `set_version`,
`stats` — never the parts behind them: the prefix cache (rollout/kv/prefix_cache.py), the host tier
(rollout/kv/host_tier.py), the token evictor (rollout/kv/kv_eviction.py), the step's page copies.
Invariant (`check_integrity`): each page's pool refcount == the number of sequence slots, index
entries and pending copies that list it, and the pool's own free/used accounting holds.
"""
from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Iterable

from memory.host_ledger import HostLedger
from memory.host_pool import HostPagePool
from memory.page_pool import OutOfPages, PagePool
from memory.nvme_store import NvmeStore
from models.model import HybridLM
from rollout.kv.host_spill import SpilledSlots, discard, drop_parked, read_slots, write_slots
from rollout.kv.host_tier import HostTier
from rollout.kv.kv_eviction import KVBudgetConfig, KVEvictor, StepObserver
from rollout.kv.page_copies import PageCopies
from rollout.kv.prefix_cache import PrefixCache
from rollout.kv.prefix_config import PrefixCacheConfig
from rollout.request import Sequence

PREFETCH_LOOKAHEAD = 8
"""Queued sequences whose host-tier prefix is prefetched ahead of their admission, per step."""


class CacheManager:
    @classmethod
    def build(cls, pool: PagePool, host: HostPagePool | None, prefix_cache: PrefixCacheConfig | None,
              kv_budget: KVBudgetConfig | None, model: HybridLM, ledger: HostLedger | None = None) -> "CacheManager":
        """The tiers an engine's config asks for, behind one façade: the step's page copies, the host tier
        when there is a host pool, the prefix cache and the token evictor when configured."""
        copies = PageCopies(pool, host)
        host_tier = HostTier(pool, host, copies) if host is not None else None
        prefix = PrefixCache(pool, prefix_cache, copies, host_tier) if prefix_cache is not None else None
        evictor = KVEvictor(kv_budget, pool, model, ledger=ledger) if kv_budget is not None else None
        return cls(pool, prefix, evictor, host_tier)

    def __init__(self, pool: PagePool, prefix: PrefixCache | None = None, evictor: KVEvictor | None = None,
                 host_tier: HostTier | None = None) -> None:
        self.pool, self.prefix, self.evictor, self.host_tier = pool, prefix, evictor, host_tier
        self.layout = pool.layout
        self.num_kda_groups = len(self.layout.kda_groups)
        self.num_mla_groups = len(self.layout.mla_groups)
        self.version = 0
        """The policy version the engine computes with (`set_version`): a sequence's KV is tagged with it."""
        self._spilled = SpilledSlots()
        """What `spill_host` wrote to NVMe, read back by `restore_host`."""

    # ---- what the scheduler asks -----------------------------------------------------------------------
    def chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens `seq` may compute this step out of `budget`: at most a KV budget's `max_chunk`; with
        a prefix cache, a prefill chunk that crosses a hash-block boundary ends on the last one it
        crosses (or earlier, on the one under a turn boundary), so the KDA state after the chunk is
        a checkpoint the cache can keep."""
        want = min(seq.num_uncomputed, budget, self.max_chunk or budget)
        if self.prefix is not None and want > 1:
            hb, start = self.prefix.config.hash_block, seq.num_computed
            # Also stop at the hash boundary under a conversation-turn boundary: that checkpoint is
            # the one later turns (and other sessions sharing the prompt) will hit.
            stops = [p // hb * hb for p in seq.turn_boundaries] + [(start + want) // hb * hb]
            inside = [b for b in stops if start < b < start + want]
            if inside:
                want = min(inside) - start
        return want

    def admit(self, seq: Sequence) -> bool:
        """Start a waiting sequence at its longest cached prefix (if any). False: that prefix waits
        on a pending copy or a prefetch; admit the sequence next step (nothing changed)."""
        return self.prefix is None or self.prefix.attach(seq) is not None

    def expect_resume(self, tokens: list[int], at: float) -> None:
        """A conversation waiting on its tool continues `tokens` at about `at` (monotonic seconds): when
        the pool is short, its prefix entries go to the host tier after those of conversations resuming
        later (rollout/kv/resume_order.py). Nothing without a prefix cache."""
        if self.prefix is not None:
            self.prefix.expect(tokens, at)

    def prefetch_waiting(self, waiting: Iterable[Sequence], reserve: int) -> None:
        """Before the step's copies run: the first PREFETCH_LOOKAHEAD queued sequences (not yet admitted,
        in queue order) whose cached prefix sits on the host tier get it prefetched now, while `reserve`
        device pages stay free, so that their admission finds it on the device (the copy overlaps this
        step's forward) instead of waiting a step for it."""
        if self.prefix is None:
            return
        now = time.monotonic()
        for i, seq in enumerate(itertools.islice(waiting, PREFETCH_LOOKAHEAD)):
            if not seq.holds_pages and not seq.num_computed and not self.is_swapped(seq):
                chain = self.prefix.hashes(seq, seq.num_tokens - 1)
                self.prefix.prefetch_ahead(chain, now + i * 1e-6, reserve)  # the queue's order: sooner first

    def prefetch_tokens(self, tokens: list[int], at: float, reserve: int) -> int:
        """`prefetch_waiting` for a request not sent to the engine yet (a dispatcher's queued follow-up
        continuing `tokens`, resuming at about `at`); returns the pages queued."""
        if self.prefix is None:
            return 0
        return self.prefix.prefetch_ahead(self.prefix.hashes_of(tokens), at, reserve)

    def grow(self, seq: Sequence, num_new: int) -> bool:
        """Make `seq` ready to compute `num_new` more tokens: evict tokens under a KV budget, then
        allocate the pages it lacks. False when the pool cannot (nothing allocated)."""
        return self.make_room(seq, num_new) and self.ensure_capacity(seq, seq.kv_len + num_new)

    def make_room(self, seq: Sequence, num_new: int) -> bool:
        """With a KV budget, evict so `seq` can take `num_new` tokens within it (see
        rollout/kv/kv_eviction.py); False (nothing changed) if copy-on-write lacks free pages."""
        if self.evictor is None:
            return True
        if self.prefix is not None and seq.kv_len + num_new > self.evictor.config.budget_tokens:
            self.prefix.flush()  # compaction reads the sequence's pages: their pending copies land first
        return self.evictor.make_room(seq, num_new)

    def preempt(self, seq: Sequence) -> str:
        """Take `seq`'s device pages back for others. With a host tier that can make room for them
        (mirrors and cached entries may go, parked and swapped sequences never) they are swapped out:
        copied to host slots, then dropped; `num_computed`, the prefix cache's hashes of the sequence
        and its token evictor state (`seq.kv`, whose pages are stored as they are) are kept, and
        `swap_in` restores them bit for bit. Otherwise (no host tier, too little host room, nothing
        computed yet) it is `reset`: recomputed from token 0. Returns "swap" or "recompute"."""
        if self.host_tier is not None and seq.num_computed and seq.holds_pages:
            self.before_forward()  # pending copies into its pages land before its bytes are read
            if self.host_tier.swap_out(seq, self.layout.mla_pages_for(seq.kv_len) if self.num_mla_groups else 0):
                self.free(seq)  # pages grown for this step's tokens hold nothing yet: not stored
                return "swap"
        self.reset(seq)
        return "recompute"

    def is_swapped(self, seq: Sequence) -> bool:
        """`seq` waits on the host tier (preempted by `preempt`, not yet back)."""
        return self.host_tier is not None and seq.seq_id in self.host_tier.swapped

    def swap_in(self, seq: Sequence, num_new: int = 0) -> bool:
        """Bring a swapped-out `seq` back into fresh device pages (its bytes bit for bit, pages it
        shared before now private) if the pool has room for them and for `num_new` more tokens
        (cached pages nobody uses are evicted for it). False: no room now, nothing changed."""
        have = len(self.host_tier.swapped[seq.seq_id][1][0]) if self.num_mla_groups else 0
        tokens = seq.kv_len + num_new
        if self.evictor is not None:  # make_room compacts to the budget before growing
            tokens = min(tokens, self.evictor.config.budget_tokens)
        need = (self.host_tier.num_swapped_pages(seq)
                + self.num_mla_groups * max(0, self.layout.mla_pages_for(tokens) - have))
        if need > self.pool.num_free and self.prefix is not None:
            self.prefix.evict(need - self.pool.num_free)
        if need > self.pool.num_free:
            return False
        self.host_tier.swap_in(seq)
        return True

    def reset(self, seq: Sequence) -> None:
        """Drop everything the sequence has cached (swapped slots too): it will be recomputed from token 0."""
        self.free(seq)
        if self.host_tier is not None:
            self.host_tier.discard(seq)
        seq.num_computed = 0
        seq.kv_version = None
        if self.evictor is not None:
            self.evictor.reset(seq)

    def finish(self, seq: Sequence) -> None:
        """The sequence is done (or aborted): its pages and per-sequence state go."""
        self.reset(seq)
        if self.prefix is not None:
            self.prefix.forget(seq)

    # ---- around the forward pass -----------------------------------------------------------------------
    def before_forward(self) -> None:
        """Run the step's pending page copies (one batch), right before the forward pass."""
        if self.prefix is not None:
            self.prefix.flush()

    def observer(self, seqs: list[Sequence], num_new: list[int]) -> StepObserver | None:
        """With a KV budget, the step's attention observer (`models.paged.KVObserver`); else None."""
        return self.evictor.begin_step(seqs, num_new) if self.evictor is not None else None

    def observed(self, observer: StepObserver | None) -> None:
        """After the forward (`num_computed` advanced): the observer's scores join the budget's books."""
        if observer is not None:
            self.evictor.end_step(observer)

    def after_forward(self, seqs: list[Sequence], pending: dict[int, list[int]] | None = None,
                      inner: dict[int, tuple[int, list[int]]] | None = None) -> None:
        """Tag each sequence's KV with the version computing it (`Sequence.kv_version` keeps the oldest),
        then index what the pass computed (prefix cache), before anything finishes. A speculative
        verification's, by seq_id: `pending`, the accepted proposals (computed, not appended yet);
        `inner`, the last hash-block boundary it crossed and the pages of its KDA states there."""
        for seq in seqs:
            if seq.kv_version is None:
                seq.kv_version = self.version
        if self.prefix is not None:
            pending, inner = pending or {}, inner or {}
            for seq in seqs:
                self.prefix.register(seq, pending.get(seq.seq_id, ()), inner.get(seq.seq_id))

    def idle(self) -> None:
        """No work left: nothing may stay half-copied."""
        if self.prefix is not None:
            self.prefix.flush()

    # ---- memory and weights --------------------------------------------------------------------------
    def park(self, paused: list[Sequence]) -> None:
        """Before a sleep: run pending copies; with a host tier, park the paused sequences' pages there
        (a sequence it cannot take keeps its pages: the scheduler's preemption frees them)."""
        self.before_forward()
        if self.host_tier is not None:
            for seq in self.host_tier.park(paused):
                self.free(seq)

    def sleep(self) -> None:
        """Release the device pool (every sequence's pages already freed or parked); the prefix cache
        writes its turn-boundary entries back to the host tier and drops the rest of the device tier."""
        if self.prefix is not None:
            self.prefix.sleep()
        self.pool.release()

    def wake(self, paused: list[Sequence]) -> None:
        """Take the device pool back and restore the parked sequences among `paused` (bit for bit);
        one the pool cannot take is reset (recomputed after it resumes)."""
        self.pool.reacquire()
        if self.host_tier is not None:
            for seq in self.host_tier.unpark(paused):
                self.reset(seq)

    def spill_host(self, store: NvmeStore, seqs: list[Sequence], next_version: int,
                   max_staleness: int | None = None) -> int:
        """After `sleep`, before the training states come back: keep what the next rollout (policy
        `next_version`) may use, write it to `store` and give the host pool's DRAM back to the ledger
        (rollout/kv/host_spill.py). Prefix entries go unless stale prefixes are reused; entries and the
        sequences among `seqs` parked or swapped out whose KV is older than `next_version -
        max_staleness` go (those sequences are reset: recomputed). Returns the bytes written."""
        tier = self.host_tier
        if tier is None or tier.host.is_suspended:
            return 0
        self.idle()
        if tier.mirrors:  # clean copies of device pages, which are gone with the pool
            tier.host.free(list(tier.mirrors.values()))
            tier.mirrors.clear()
        oldest = None if max_staleness is None else next_version - max_staleness
        if self.prefix is not None:
            if not self.prefix.config.reuse_stale:
                self.prefix.clear()
            elif oldest is not None:
                for slot in [s for s in tier.lru if self.prefix.slot_version(s) < oldest]:
                    if slot in tier.lru:
                        tier.evict_entry(slot)
        if oldest is not None:
            stale = [s for s in seqs if s.kv_version is not None and s.kv_version < oldest]
            drop_parked(tier, stale, self.reset)
            for seq in stale:  # swapped out by a preemption: recomputed too
                if seq.seq_id in tier.swapped:
                    self.reset(seq)
        self._spilled = write_slots(tier.host, store)
        tier.host.suspend()
        return self._spilled.bytes

    def restore_host(self, store: NvmeStore | None, seqs: list[Sequence], num_pages: int) -> int:
        """Before `wake`: lease the host pool again (`num_pages`, HostBudgetExceeded if the ledger
        cannot) and read back what `spill_host` kept, into the same slots. A lease too small for the
        kept slots drops them all (entries forgotten, the parked or swapped sequences among `seqs`
        reset). Returns bytes read."""
        tier = self.host_tier
        if tier is None or not tier.host.is_suspended:
            return 0
        used = tier.host.used_slots()
        if used and used[-1] >= num_pages or num_pages < 1:
            if self.prefix is not None:
                self.prefix.store.clear()
            drop_parked(tier, seqs, self.reset)
            for seq in seqs:
                if seq.seq_id in tier.swapped:
                    self.reset(seq)
            self._spilled = SpilledSlots()
            discard(store)
        if num_pages < 1:  # no DRAM to lend this rollout: no host tier until the next one
            return 0
        tier.host.resume(num_pages)
        spilled, self._spilled = self._spilled, SpilledSlots()
        return read_slots(tier.host, store, spilled) if store is not None else 0

    @property
    def spilled_host_bytes(self) -> int:
        """Bytes of host pages `spill_host` kept on NVMe until `restore_host` (payload)."""
        return self._spilled.bytes

    @property
    def pages_written_back(self) -> int:
        """Host pages the host tier has written back from the device since it was built (0 without)."""
        return self.host_tier.pages_written_back if self.host_tier is not None else 0

    @property
    def prefix_cache_is_empty(self) -> bool:
        """No prefix-cache entry on either tier (True without a prefix cache)."""
        return self.prefix is None or self.prefix.is_empty

    @property
    def resume_point_pages(self) -> int:
        """With the prefix cache on, the pages of one sequence's resume point that only the cache holds: a
        KDA checkpoint (one page per KDA group) and the MLA page it ends in (one per MLA group), which a
        continuation copies rather than shares. 0 without the cache."""
        return self.num_kda_groups + self.num_mla_groups if self.prefix is not None else 0

    def clear_prefix_cache(self) -> None:
        if self.prefix is not None:
            self.prefix.clear()

    @property
    def num_parked_pages(self) -> int:
        """Host pages holding paused sequences' pages over a sleep."""
        return self.host_tier.num_parked_pages if self.host_tier is not None else 0

    def set_version(self, version: int) -> None:
        """New weights: InfiniGen's partial keys follow them; prefixes computed by older ones stop
        matching (rollout/kv/prefix_cache.py `set_version`)."""
        self.version = version
        if self.evictor is not None:
            self.evictor.weights_updated()
        if self.prefix is not None:
            self.prefix.set_version(version)

    @property
    def num_evictable_pages(self) -> int:
        """Used pool pages that only the prefix cache holds: eviction frees them on demand."""
        return self.prefix.num_evictable if self.prefix is not None else 0

    def stats(self) -> dict[str, float]:
        """The token evictor's counters, `kv_`-prefixed (none without a KV budget); with a host tier,
        the slots swapped-out sequences hold (`swapped_pages`)."""
        out = {f"kv_{k}": v for k, v in self.evictor.stats.items()} if self.evictor is not None else {}
        if self.host_tier is not None:
            out["swapped_pages"] = self.host_tier.num_swapped_slots
        if self.prefix is not None:  # prefix cache and host tier counters since the engine was built
            out.update(prefix_hit_tokens=self.prefix.hit_tokens, prefix_stale_hit_tokens=self.prefix.stale_hit_tokens,
                       prefix_lookups=self.prefix.lookups, reprefilled_tokens=self.prefix.reprefilled_tokens,
                       admissions_deferred=self.prefix.deferred_admissions)
        if self.host_tier is not None:
            host = self.host_tier.host
            out.update(host_pool_bytes=host.pool_bytes, host_pages_used=host.num_used,
                       host_pages_written_back=self.host_tier.pages_written_back,
                       host_pages_prefetched=self.host_tier.pages_prefetched)
            if hasattr(host.copier, "load_seconds"):  # a copier that times its loads (what the forward waited on)
                out.update(host_copy_load_s=host.copier.load_seconds, host_copy_wait_s=host.copier.load_wait_seconds)
            if self.prefix is not None:
                out.update(host_hit_tokens=self.prefix.host_hit_tokens,
                           host_pages_prefetched_ahead=self.prefix.prefetched_ahead)
        return out

    # ---- pages ---------------------------------------------------------------------------------------
    @property
    def max_chunk(self) -> int | None:
        """Most new tokens one step may give a sequence (a KV budget's limit), None = any."""
        return self.evictor.config.max_chunk if self.evictor is not None else None

    def pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New pages `seq` needs to hold `num_tokens` MLA slots."""
        kda = 0 if seq.kda_pages else self.num_kda_groups
        have = len(seq.mla_pages[0]) if seq.mla_pages else 0
        return kda + self.num_mla_groups * max(0, self.layout.mla_pages_for(num_tokens) - have)

    def pages_for_tokens(self, num_tokens: int) -> int:
        """Pages one private sequence of `num_tokens` tokens holds (at most its KV budget's worth)."""
        if self.evictor is not None:
            num_tokens = min(num_tokens, self.evictor.config.budget_tokens)
        return self.layout.sequence_pages(num_tokens)

    def ensure_capacity(self, seq: Sequence, num_tokens: int) -> bool:
        """Allocate what `seq` lacks to hold `num_tokens` tokens. All-or-nothing: False (and
        nothing allocated) when the pool has too few free pages."""
        needed = self.pages_needed(seq, num_tokens)
        if needed > self.pool.num_free and self.prefix is not None:
            self.prefix.evict(needed - self.pool.num_free)  # cached pages nobody uses go first
        if needed > self.pool.num_free:
            return False
        try:
            if not seq.kda_pages:
                seq.kda_pages = [self.pool.allocate(1, ("kda", g))[0] for g in range(self.num_kda_groups)]
            if not seq.mla_pages:
                seq.mla_pages = [[] for _ in range(self.num_mla_groups)]
            missing = self.layout.mla_pages_for(num_tokens) - len(seq.mla_pages[0]) if self.num_mla_groups else 0
            if missing > 0:
                for g in range(self.num_mla_groups):
                    seq.mla_pages[g].extend(self.pool.allocate(missing, ("mla", g)))
        except OutOfPages as err:  # cannot happen after the check above; keep the accounting exact anyway
            raise RuntimeError(f"page accounting error while growing sequence {seq.seq_id}") from err
        return True

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; pages still shared with forks stay allocated."""
        self.pool.decref(seq.kda_pages + [p for group in seq.mla_pages for p in group])
        seq.kda_pages, seq.mla_pages = [], []

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """Give each child the parent's cache at `parent.num_computed` tokens.

        Full MLA pages are shared by reference count; the partially filled last page and the KDA
        state pages are copied (copy-on-write done eagerly: the child will write into them). The
        first child takes over the parent's own references; the parent ends holding nothing.
        Raises OutOfPages (allocating nothing) if the copies do not fit.
        """
        full = parent.kv_len // self.layout.block_tokens
        partial = len(parent.mla_pages[0]) > full if parent.mla_pages else False
        copies_per_child = self.num_kda_groups + (self.num_mla_groups if partial else 0)
        if copies_per_child * (len(children) - 1) > self.pool.num_free:
            raise OutOfPages(copies_per_child * (len(children) - 1), self.pool.num_free)
        first, rest = children[0], children[1:]
        first.kda_pages, first.mla_pages = parent.kda_pages, parent.mla_pages
        parent.kda_pages, parent.mla_pages = [], []
        src: list[int] = []  # every child's copies in one copy_pages: one gather, one scatter
        dst: list[int] = []
        for child in rest:
            child.kda_pages = [self.pool.allocate(1, ("kda", g))[0] for g in range(self.num_kda_groups)]
            src += first.kda_pages
            dst += child.kda_pages
            child.mla_pages = []
            for g, pages in enumerate(first.mla_pages):
                shared = pages[:full]
                self.pool.incref(shared)
                own = self.pool.allocate(1, ("mla", g)) if partial else []
                src += pages[full:full + 1] if partial else []
                dst += own
                child.mla_pages.append(shared + own)
        self.pool.copy_pages(src, dst)
        for child in children:
            child.num_computed, child.kv_version = parent.num_computed, parent.kv_version
        if self.evictor is not None:
            self.evictor.fork(parent, children)

    def block_tables(self, seqs: list[Sequence]) -> list[list[list[int]]]:
        """Per MLA group, each sequence's pages in logical order (host ints; copies: the step's view
        even if eviction rewrites the sequences' lists later)."""
        return [[list(s.mla_pages[g]) for s in seqs] for g in range(self.num_mla_groups)]

    def state_pages(self, seqs: list[Sequence]) -> list[list[int]]:
        """Per KDA group, the state page of each sequence (host ints)."""
        return [[s.kda_pages[g] for s in seqs] for g in range(self.num_kda_groups)]

    def check_integrity(self, seqs: Iterable[Sequence]) -> None:
        """Pool accounting holds and every refcount equals the references sequences, the prefix
        index and pending copies hold; the prefix index and host tier agree with themselves."""
        self.pool.check_integrity()
        held = Counter()
        if self.prefix is not None:  # the prefix index holds one reference per page it knows
            self.prefix.check_integrity()
            held.update(list(self.prefix.lru))
            held.update(self.prefix.pending_references())
        elif self.host_tier is not None:  # parked sequences only
            self.host_tier.check_integrity()
        for s in seqs:
            held.update(s.kda_pages)
            for group in s.mla_pages:
                held.update(group)
            if s.holds_pages:
                need = self.layout.mla_pages_for(s.kv_len)
                if s.mla_pages and len(s.mla_pages[0]) < need:
                    raise AssertionError(f"sequence {s.seq_id} holds {s.kv_len} MLA slots but "
                                         f"{len(s.mla_pages[0])} MLA pages per group (< {need})")
                if self.evictor is not None:
                    self.evictor.check(s)
                    if s.mla_pages and len(s.mla_pages[0]) > self.layout.mla_pages_for(
                            self.evictor.config.budget_tokens):
                        raise AssertionError(f"sequence {s.seq_id} holds {len(s.mla_pages[0])} MLA pages per group, "
                                             f"more than its budget of {self.evictor.config.budget_tokens} tokens needs")
        for page, count in held.items():
            if self.pool.refcount(page) != count:
                raise AssertionError(f"page {page}: pool refcount {self.pool.refcount(page)} but {count} "
                                     f"sequence references")
        if sum(held.values()) and self.pool.num_used != len(held):
            raise AssertionError(f"pool has {self.pool.num_used} used pages, sequences reference {len(held)}")
        if not held and self.pool.num_used:
            raise AssertionError(f"{self.pool.num_used} pages used but no sequence holds any (leak)")
