"""Token eviction inside long sequences, for the MLA layers: H2O and InfiniGen.

A per-sequence budget caps the MLA cache entries (slots) a sequence holds on the device. KDA
layers are untouched: their state is one page whatever the length. When a step would take a
sequence over its budget, `KVEvictor.make_room` picks which slots stay (sinks, a recent window,
then the heaviest hitters: the tokens with the most accumulated attention) and what happens to the
others — the policy's choice:

- `h2o` (Zhang et al. 2023): dropped for good.
- `infinigen` (Lee et al. 2024): copied to a host token store (memory/token_store.py) with a
  partial key (a few channels of the rotated latent) kept on the device. At each decode step and
  MLA layer, the partial query x partial keys speculates which offloaded tokens the attention
  will want (InfiniGen's rule: partial score > max - alpha, at most `max_fetch` per head); those
  rows are fetched before the attention runs and attended with the pages (an exact split softmax,
  kernels/mla/weights.py). Offloaded tokens whose accumulated attention overtakes a resident one
  are paged back in at the next eviction. Prefill chunks attend over every offloaded row.

Granularity (documented choice): one decision per sequence for every MLA layer and head. MLA's
latent row is shared by all heads, so a token cannot be evicted for one head only; and the pages
of a cache group hold every layer of the group, with all groups' block tables indexed by the same
slot, so per-layer decisions would need per-layer page sets. Scores are therefore summed over
heads and MLA layers.

Slots vs positions: after eviction a sequence's slots are compacted (survivors move down, pages
past the end are freed), so slot != token position. RoPE is applied at write time with the
token's position, so a moved entry stays valid; `PagedStep.kv_starts` tells the paged forward
where the new tokens' slots begin. Shared pages (forks, the prefix cache) are never written:
compaction copies a shared page first (copy on write). A sequence that evicted anything registers
nothing in the prefix cache (its pages are no longer the full prefix).

Policies are registered functions with one interface (rollout/kv/kv_policy.py); InfiniGen's partial-key
predictor is rollout/kv/kv_predictor.py.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from memory.host_ledger import HostLedger
from memory.page_pool import PagePool
from memory.token_store import HostStoreFull, HostTokenStore
from models.model import HybridLM
from rollout.kv.kv_policy import EvictionPolicy, heavy_hitters, lookup_policy, register_policy
from rollout.kv.kv_predictor import PartialKeyPredictor
from rollout.request import Sequence
from rollout.seq_kv import SeqKV, long_tensor

__all__ = ["EvictionPolicy", "KVBudgetConfig", "KVEvictor", "PartialKeyPredictor", "SeqKV", "StepObserver",
           "heavy_hitters", "lookup_policy", "register_policy"]


# ---- configuration --------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class KVBudgetConfig:
    budget_tokens: int
    """MLA slots a sequence may hold on the device, at any time (the step's new tokens included)."""
    policy: str = "h2o"
    """A registered policy: "h2o" (drop) or "infinigen" (offload to host, fetch back)."""
    sink_tokens: int = 4
    """The first tokens of a sequence are never evicted (attention sinks)."""
    recent_tokens: int = 32
    """Neither are the most recent ones."""
    partial_channels: int | None = None
    """InfiniGen: latent channels of the partial keys (None = a quarter of the latent, >= 1; the
    whole latent = an exact predictor, no rotation)."""
    alpha: float = 4.0
    """InfiniGen: fetch tokens whose partial score is within alpha of the best (math.inf = all)."""
    max_fetch: int | None = 64
    """InfiniGen: at most this many tokens fetched per head, layer and step (None = no cap)."""
    host_tokens: int = 1 << 16
    """InfiniGen: rows of the host token store (one row = one token, every MLA layer)."""
    calibration_tokens: int = 256
    """InfiniGen: tokens of the random calibration text the partial-key rotation is fitted on."""
    seed: int = 0

    def __post_init__(self) -> None:
        lookup_policy(self.policy)
        for name in ("budget_tokens", "host_tokens", "calibration_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"kv_budget.{name}={value!r}, expected a positive integer")
        for name in ("sink_tokens", "recent_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"kv_budget.{name}={value!r}, expected an integer >= 0")
        if self.budget_tokens <= self.sink_tokens + self.recent_tokens:
            raise ValueError(f"kv_budget.budget_tokens={self.budget_tokens} must exceed sink_tokens + recent_tokens = "
                             f"{self.sink_tokens} + {self.recent_tokens} (room for new tokens)")
        if self.partial_channels is not None and (not isinstance(self.partial_channels, int)
                                                  or self.partial_channels < 1):
            raise ValueError(f"kv_budget.partial_channels={self.partial_channels!r}, expected None or >= 1")
        if not self.alpha > 0:
            raise ValueError(f"kv_budget.alpha={self.alpha!r}, expected > 0 (math.inf allowed)")
        if self.max_fetch is not None and (not isinstance(self.max_fetch, int) or self.max_fetch < 1):
            raise ValueError(f"kv_budget.max_fetch={self.max_fetch!r}, expected None or >= 1")

    @property
    def max_chunk(self) -> int:
        """Most new tokens one step may give a sequence: what is left beside sinks and recent window."""
        return self.budget_tokens - self.sink_tokens - self.recent_tokens


# ---- the evictor ----------------------------------------------------------------------------------
class KVEvictor:
    """Keeps every sequence within its MLA budget; the engine's cache manager calls it."""

    def __init__(self, config: KVBudgetConfig, pool: PagePool, model: HybridLM,
                 ledger: HostLedger | None = None) -> None:
        self.config, self.pool, self.layout, self.model = config, pool, pool.layout, model
        self.policy = lookup_policy(config.policy)
        self.mla_layers = list(model.config.mla_layers)
        self.latent_dim = model.config.mla_latent_dim
        self.store: HostTokenStore | None = None
        self.predictor: PartialKeyPredictor | None = None
        if self.policy.offload:
            self.store = HostTokenStore((len(self.mla_layers), self.latent_dim), config.host_tokens,
                                        dtype=self.layout.cache_dtype, ledger=ledger,
                                        pin_memory=pool.device.type == "cuda")
            self.predictor = PartialKeyPredictor(model, config.partial_channels, config.calibration_tokens,
                                                 config.seed)
        self.stats = {"evicted": 0, "dropped": 0, "offloaded": 0, "readmitted": 0, "fetched": 0,
                      "cow_pages": 0, "compactions": 0}
        self.peak_extra_bytes = 0
        """Largest device bytes beyond the pool at once: partial keys + rows fetched for a step."""
        self._partial_bytes = 0
        self._warned_full = False

    def weights_updated(self) -> None:
        """The model's weights changed in place: InfiniGen's partial keys are refitted to them."""
        if self.predictor is not None:
            self.predictor.calibrate(self.model)

    # ---- bookkeeping ----
    def state(self, seq: Sequence) -> SeqKV:
        if seq.kv is None:
            seq.kv = SeqKV.fresh(seq.num_computed)
        return seq.kv

    def reset(self, seq: Sequence) -> None:
        """The sequence restarts from nothing (preempted, finished): host rows freed."""
        kv = seq.kv
        if kv is not None and kv.num_offloaded:
            self.store.free(kv.off_rows)
            self._partial_bytes -= sum(p.numel() * p.element_size() for p in kv.off_partial)
        seq.kv = None

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """Children continue from the parent's KV: the first takes its state, the others copies
        (offloaded rows are copied in the host store)."""
        kv = parent.kv
        parent.kv = None
        if kv is None:
            return
        children[0].kv = kv
        for child in children[1:]:
            rows = self.store.store(self.store.load(kv.off_rows)) if kv.num_offloaded else long_tensor()
            partial = [p.clone() for p in kv.off_partial]
            self._partial_bytes += sum(p.numel() * p.element_size() for p in partial)
            child.kv = SeqKV(kv.positions.clone(), kv.scores.clone(), kv.off_positions.clone(), kv.off_scores.clone(),
                             rows, partial, kv.num_dropped, kv.pruned)
        self._note_extra(0)

    def _note_extra(self, transient: int) -> None:
        self.peak_extra_bytes = max(self.peak_extra_bytes, self._partial_bytes + transient)

    def check(self, seq: Sequence) -> None:
        """Invariants of one sequence (engine.check_integrity)."""
        kv = seq.kv
        if kv is None:
            return
        budget = self.config.budget_tokens
        if kv.length > budget:
            raise AssertionError(f"sequence {seq.seq_id} holds {kv.length} MLA slots > budget {budget}")
        every = torch.cat([kv.positions, kv.off_positions])
        if every.unique().numel() != every.numel():
            raise AssertionError(f"sequence {seq.seq_id}: a token is both resident and offloaded, or twice")
        if every.numel() and (int(every.min()) < 0 or int(every.max()) >= seq.num_computed):
            raise AssertionError(f"sequence {seq.seq_id}: a kept token lies outside [0, {seq.num_computed})")
        if every.numel() + kv.num_dropped != seq.num_computed:
            raise AssertionError(f"sequence {seq.seq_id}: {kv.length} resident + {kv.num_offloaded} offloaded + "
                                 f"{kv.num_dropped} dropped != {seq.num_computed} computed tokens")
        sinks = min(self.config.sink_tokens, seq.num_computed)
        recent = range(max(0, seq.num_computed - self.config.recent_tokens), seq.num_computed)
        kept = set(kv.positions.tolist())
        missing = [p for p in list(range(sinks)) + list(recent) if p not in kept]
        if missing:
            raise AssertionError(f"sequence {seq.seq_id}: sink/recent tokens {missing[:8]} are not resident")

    # ---- making room ----
    def _protected(self, positions: torch.Tensor, num_computed: int) -> torch.Tensor:
        return (positions < self.config.sink_tokens) | (positions >= num_computed - self.config.recent_tokens)

    def make_room(self, seq: Sequence, num_new: int) -> bool:
        """Evict so that `seq` holds at most budget - num_new slots before computing `num_new`
        tokens. False (nothing changed) when copy-on-write of shared pages needs free pages the
        pool lacks."""
        kv = self.state(seq)
        keep = self.config.budget_tokens - num_new
        if kv.length <= keep:
            return True
        if num_new > self.config.max_chunk:
            raise ValueError(f"eviction: {num_new} new tokens > max_chunk {self.config.max_chunk}")
        resident_protected = self._protected(kv.positions, seq.num_computed)
        scores = torch.cat([kv.scores, kv.off_scores])
        positions = torch.cat([kv.positions, kv.off_positions])
        protected = torch.cat([resident_protected, torch.zeros(kv.num_offloaded, dtype=torch.bool)])
        stay = self.policy.select(scores, positions, protected, keep)
        keep_slots = stay[:kv.length].nonzero().flatten()  # resident slots that stay, in slot order
        readmit = stay[kv.length:].nonzero().flatten()  # offloaded entries coming back
        gone = (~stay[:kv.length]).nonzero().flatten()
        return self._rewrite(seq, keep_slots, readmit, gone)

    def _gather(self, seq: Sequence, slots: torch.Tensor) -> torch.Tensor:
        """Rows [n, num_mla_layers, W] of the sequence's slots."""
        bt = self.layout.block_tokens
        rows = []
        for layer in self.mla_layers:
            _, g, _ = self.layout.group_of(layer)
            pages = torch.tensor(seq.mla_pages[g], dtype=torch.long)
            rows.append(self.pool.mla_view(layer)[pages[slots // bt], slots % bt])
        return torch.stack(rows, dim=1)

    def _rewrite(self, seq: Sequence, keep_slots: torch.Tensor, readmit: torch.Tensor, gone: torch.Tensor) -> bool:
        kv, bt = seq.kv, self.layout.block_tokens
        new_len = keep_slots.numel() + readmit.numel()
        first = int((keep_slots != torch.arange(keep_slots.numel())).nonzero().flatten()[0]) \
            if bool((keep_slots != torch.arange(keep_slots.numel())).any()) else keep_slots.numel()
        first_page, num_pages = first // bt, -(-new_len // bt)
        shared = [j for g in range(len(seq.mla_pages)) for j in range(first_page, num_pages)
                  if self.pool.refcount(seq.mla_pages[g][j]) > 1]
        if len(shared) > self.pool.num_free:
            return False
        # 1. What leaves: to the host (offload) or nowhere.
        if gone.numel():
            self._evict(seq, gone)
        # 2. What comes back from the host.
        back = None
        if readmit.numel():
            back = self.store.load(kv.off_rows[readmit], self.pool.device).to(self.layout.cache_dtype)  # [k, L, W]
        # 3. Survivors after `first` move down; readmitted rows follow them.
        moving = self._gather(seq, keep_slots[first:])  # [n - first, L, W]
        data = moving if back is None else torch.cat([moving, back])
        for g, pages in enumerate(seq.mla_pages):
            for j in range(first_page, num_pages):
                if self.pool.refcount(pages[j]) > 1:  # copy on write: forks / the prefix cache still read it
                    fresh = self.pool.allocate(1, ("mla", g))
                    if j == first_page and first % bt:
                        self.pool.copy_pages([pages[j]], fresh)
                    self.pool.decref([pages[j]])
                    pages[j] = fresh[0]
                    self.stats["cow_pages"] += 1
            self.pool.decref(pages[num_pages:])
            del pages[num_pages:]
        dst = torch.arange(first, new_len)
        for i, layer in enumerate(self.mla_layers):
            _, g, _ = self.layout.group_of(layer)
            pages = torch.tensor(seq.mla_pages[g], dtype=torch.long)
            self.pool.mla_view(layer)[pages[dst // bt], dst % bt] = data[:, i]
        # 4. The bookkeeping follows the data.
        positions = [kv.positions[keep_slots]]
        scores = [kv.scores[keep_slots]]
        if readmit.numel():
            positions.append(kv.off_positions[readmit])
            scores.append(kv.off_scores[readmit])
            self._drop_offloaded(kv, readmit, free_rows=True)
            self.stats["readmitted"] += readmit.numel()
        kv.positions, kv.scores = torch.cat(positions), torch.cat(scores)
        kv.pruned = True
        self.stats["compactions"] += 1
        return True

    def _evict(self, seq: Sequence, gone: torch.Tensor) -> None:
        kv = seq.kv
        self.stats["evicted"] += gone.numel()
        if self.policy.offload:
            rows = self._gather(seq, gone)  # [k, L, W]
            try:
                ids = self.store.store(rows)
            except HostStoreFull as err:
                if not self._warned_full:
                    warnings.warn(f"InfiniGen: {err}; evicted tokens are dropped instead (H2O) from now on "
                                  f"while the store is full", RuntimeWarning, stacklevel=3)
                    self._warned_full = True
            else:
                partial = [self.predictor.keys(layer, rows[:, i]) for i, layer in enumerate(self.mla_layers)]
                kv.off_positions = torch.cat([kv.off_positions, kv.positions[gone]])
                kv.off_scores = torch.cat([kv.off_scores, kv.scores[gone]])
                kv.off_rows = torch.cat([kv.off_rows, ids])
                kv.off_partial = partial if not kv.off_partial else [torch.cat([a, b]) for a, b in
                                                                      zip(kv.off_partial, partial)]
                self._partial_bytes += sum(p.numel() * p.element_size() for p in partial)
                self._note_extra(0)
                self.stats["offloaded"] += gone.numel()
                return
        kv.num_dropped += gone.numel()
        self.stats["dropped"] += gone.numel()

    def _drop_offloaded(self, kv: SeqKV, index: torch.Tensor, free_rows: bool) -> None:
        keep = torch.ones(kv.num_offloaded, dtype=torch.bool)
        keep[index] = False
        if free_rows:
            self.store.free(kv.off_rows[index])
        self._partial_bytes -= sum(p[index].numel() * p.element_size() for p in kv.off_partial)
        kv.off_positions, kv.off_scores, kv.off_rows = kv.off_positions[keep], kv.off_scores[keep], kv.off_rows[keep]
        kv.off_partial = [p[keep] for p in kv.off_partial]

    # ---- one step ----
    def begin_step(self, seqs: list[Sequence], num_new: list[int]) -> "StepObserver":
        for seq in seqs:
            self.state(seq)
        return StepObserver(self, seqs, num_new)

    def end_step(self, observer: "StepObserver") -> None:
        """After the forward: the new tokens join the resident slots with what they received."""
        for i, (seq, n) in enumerate(zip(observer.seqs, observer.num_new)):
            kv = seq.kv
            start = seq.num_computed - n  # the runner has advanced num_computed
            kv.positions = torch.cat([kv.positions, torch.arange(start, start + n)])
            kv.scores = torch.cat([kv.scores, torch.zeros(n, dtype=torch.float64)]) + observer.resident[i]
            if kv.num_offloaded:
                kv.off_scores = kv.off_scores + observer.extra[i]


class StepObserver:
    """`models.paged.KVObserver` for one step: collects attention weights, serves fetched rows."""

    def __init__(self, evictor: KVEvictor, seqs: list[Sequence], num_new: list[int]) -> None:
        self.evictor, self.seqs, self.num_new = evictor, seqs, num_new
        self.resident = [torch.zeros(s.kv.length + n, dtype=torch.float64) for s, n in zip(seqs, num_new)]
        self.extra = [torch.zeros(s.kv.num_offloaded, dtype=torch.float64) for s in seqs]
        self._columns: dict[tuple[int, tuple[int, ...]], list[torch.Tensor]] = {}

    def extra_kv(self, layer: int, seqs: list[int], q: torch.Tensor | None):
        ev = self.evictor
        if ev.store is None or not any(self.seqs[i].kv.num_offloaded for i in seqs):
            return None
        slot = ev.mla_layers.index(layer)
        chosen: list[torch.Tensor] = []
        for r, i in enumerate(seqs):
            kv = self.seqs[i].kv
            if not kv.num_offloaded:
                chosen.append(long_tensor())
            elif q is None:
                chosen.append(torch.arange(kv.num_offloaded))
            else:
                chosen.append(self._speculate(layer, q[r], kv.off_partial[slot]))
        width = max(c.numel() for c in chosen)
        if width == 0:
            return None
        kv_rows = torch.zeros(len(seqs), width, ev.latent_dim, dtype=ev.layout.cache_dtype, device=ev.pool.device)
        valid = torch.zeros(len(seqs), width, dtype=torch.bool, device=ev.pool.device)
        for r, (i, cols) in enumerate(zip(seqs, chosen)):
            if cols.numel():
                rows = ev.store.load(self.seqs[i].kv.off_rows[cols], ev.pool.device)[:, slot]
                kv_rows[r, :cols.numel()] = rows
                valid[r, :cols.numel()] = True
                ev.stats["fetched"] += cols.numel()
        ev._note_extra(kv_rows.numel() * kv_rows.element_size())
        self._columns[(layer, tuple(seqs))] = chosen
        return kv_rows, valid

    def _speculate(self, layer: int, q: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
        """InfiniGen's selection for one sequence: q [H, W], partial keys [m, r] -> offloaded indices."""
        cfg, pred = self.evictor.config, self.evictor.predictor
        scores = pred.queries(layer, q) @ partial.T  # [H, m]
        if math.isinf(cfg.alpha):
            count = scores.shape[1]
        else:
            near = scores > scores.max(dim=1, keepdim=True).values - cfg.alpha
            count = math.ceil(near.sum(dim=1).float().mean().item())
        count = min(count, scores.shape[1], cfg.max_fetch or scores.shape[1])
        if count == scores.shape[1]:
            return torch.arange(count)
        return scores.topk(count, dim=1).indices.flatten().unique().cpu()  # indexes host bookkeeping

    def observe(self, layer: int, seqs: list[int], resident: torch.Tensor, extra: torch.Tensor | None) -> None:
        columns = self._columns.pop((layer, tuple(seqs)), None)
        for r, i in enumerate(seqs):
            acc = self.resident[i]
            acc += resident[r, :acc.numel()].double().cpu()  # scores are host bookkeeping
            if extra is not None and columns is not None and columns[r].numel():
                self.extra[i][columns[r]] += extra[r, :columns[r].numel()].double().cpu()
