"""Speculative decoding in the engine's step: proposals verified in one forward, the hybrid's state rolled
back by choosing a page.

Per step, after the scheduler: each decoding sequence (its one uncomputed token is the last it sampled)
may get up to `num_speculative_tokens` proposals d_1 .. d_k from a proposer (rollout/speculative/proposers.py
`NgramProposer`: prompt lookup over what the engine's sequences generated lately and the sequence's own
tokens; rollout/speculative/draft.py `DraftProposer`: a small model's samples, whose distribution is the acceptance
rule's q). It then computes k + 1 tokens in the step: [last, d_1 .. d_k] as one chunk.
MLA writes k + 1 slots; each KDA layer also writes its state and conv tails after each of the first k of
them into k pages of their own per cache group (models/paged_positions.py). The target's logits at the
k + 1 positions decide (rollout/speculative/spec_accept.py) how many proposals stay (a) and the token after them; then:
- num_computed = start + 1 + a: MLA slots past it are garbage nobody reads, overwritten by the next steps
  (their pages stay with the sequence, which is growing into them);
- the KDA state after start + 1 + a tokens is in the position page a (or, when a = k, in the sequence's own
  page): that page becomes the sequence's state page for the group and the others are freed;
- the prefix cache indexes the sequence after this, with the accepted proposals as its next tokens (they
  are appended after the indexing), so it never sees an unverified token; when the accepted tokens cross
  a hash-block boundary before their end, the KDA state there is in a position page, and the cache
  checkpoints it from that page as it does from a sequence's own (`Settlement`);
- where possible the k + 1 tokens run decode-shaped (models/paged.py `PagedStep.chained_seqs`): MLA rows
  as decode queries, KDA chained token by token through the position pages, all in the decode batch.
Proposals stop short of max_new_tokens and max_model_len, and of the step's token budget; a sequence
whose growth or position pages do not fit the pool this step decodes plainly. Tokens carry the policy
version and the target's logprobs as plain decoding's do.

Adaptive per sequence, from counts only (so a seeded run speculates the same way each time): the chance
that a proposal is kept is estimated per sequence and per kind of proposal (an n-gram match of n tokens
from generated text or from the sequence's own, a draft's: `acceptance_estimate`), and a sequence verifies
only the proposals that pay for their token row (`worth`: on CPU a row costs about 1/64 of a decode step's
fixed part, `EngineConfig.speculative_row_cost`; with "fitted", rollout/speculative/cost_model.py fits
the fixed part, a decode row and a verification row to this engine's measured decode steps, so a batch
above the break-even decodes plainly); where none pays it still verifies one proposal after 4, then 8,
16 ... (at most 64) of its tokens, to notice a change. A step whose batch is past the break-even of
proposals kept at GATE_RATE (or the best kind's rate, if higher) asks nobody, probes nothing and feeds
no tree: it is plain decoding's step, counted as a gated step (a tree catches a sequence up when it is
next asked). Other steps first hand the proposer their sequences (`Proposer.observe`: a suffix tree
takes their new tokens whether or not they are asked). A fitted model makes the choice depend on
timing: the output stays exact, but sampled runs are then not reproducible bit for bit.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from memory.page_pool import OutOfPages
from models.model import HybridLM
from rollout.kv import CacheManager
from rollout.speculative.draft import draft_proposer
from rollout.engine_config import EngineConfig
from rollout.speculative.proposers import NgramProposer, Proposer
from rollout.request import Sequence
from rollout.scheduler import ScheduledStep
from rollout.speculative.cost_model import StepCostModel
from rollout.speculative.spec_accept import accept_many
from rollout.speculative.suffix_tree import SuffixProposer

Sample = tuple[Sequence, int, float, float]
"""A token a step emits: (sequence, token, behaviour logprob, entropy of its sampling distribution)."""
MAX_BACKOFF = 64
GATE_RATE = 0.95
"""A step gates (asks nobody, probes nothing) where proposals kept at this rate, or the best kind's rate
if higher, would not pay."""
"""Most tokens a sequence for which speculation does not pay decodes between two probes."""
PROBE_AFTER = 4
"""Tokens before the first probe of such a sequence (then 8, 16 ... MAX_BACKOFF between probes)."""
PRIOR_WEIGHT = 4.0
"""Pseudo-observations of the engine-wide acceptance in each sequence's estimate."""
PROBES_PER_STEP = 2
"""Most probes in one step (sequences in lockstep would otherwise all probe at once)."""
KNOWN_KIND = 8
"""Observations (kept + rejected, decayed) after which a kind's engine-wide rate is trusted: a kind known
not to pay is then probed once in KNOWN_KIND_PROBE_EVERY of the probes that come due."""
KNOWN_KIND_PROBE_EVERY = 16
GLOBAL_DECAY = 0.99
"""Per verification of a kind, the weight its engine-wide counts keep (about its last 100 verifications count)."""


@dataclass
class Verification:
    """One step's verifying sequences."""

    index: list[int]
    """Indices into the step's sequences."""
    proposals: list[list[int]]
    """Per verifying sequence, its proposals (k >= 1 tokens)."""
    draft_probs: list[torch.Tensor | None]
    """Per verifying sequence, the distribution [k, vocab] each proposal was drawn from (None: point masses)."""
    kinds: list[str]
    """Per verifying sequence, what produced its proposals (`Proposal.kind`)."""
    position_pages: list[list[list[int]]]
    """Per verifying sequence, per KDA cache group, the k pages of its states after 1..k new tokens."""
    starts: list[int]
    """Per verifying sequence, num_computed before the step."""


@dataclass
class Settlement:
    """What a step's verifications leave for the cache's indexing (`CacheManager.after_forward`), which
    runs before anything finishes."""

    accepted: dict[int, list[int]]
    """seq_id -> the proposals it kept: computed, verified, and appended to its tokens only after the cache
    indexed them (the prefix cache hashes them as the tokens they will be)."""
    checkpoints: dict[int, tuple[int, list[int]]]
    """seq_id -> (the last hash-block boundary the verification crossed strictly inside its accepted
    tokens, the position pages holding the KDA states there, one per cache group): the prefix cache's
    checkpoint at that boundary, taken from them as from a sequence's own state pages."""
    release: list[int]
    """Position pages and replaced state pages to free once the cache has indexed the step (a deferred
    checkpoint copy holds its own reference on its source)."""


@dataclass
class _Pace:
    """A sequence's acceptance record, for its adaptive speculation length."""

    accepted: int = 0
    """Proposals it kept."""
    rejected: int = 0
    """Verifications that stopped at a rejected proposal."""
    misses: int = 0
    """Probes in a row while speculation did not pay."""
    probe_at: int = PROBE_AFTER
    """Generated-token count at which a sequence for which speculation does not pay verifies one proposal."""


class Speculator:
    """Plans a step's verifications and settles them (module docstring)."""

    def __init__(self, cache: CacheManager, num_speculative_tokens: int, ngram_min: int, ngram_max: int,
                 max_num_batched_tokens: int, max_model_len: int, row_cost: float | str = 0.016,
                 proposer: Proposer | None = None) -> None:
        self.cache, self.pool = cache, cache.pool
        self.max_k, self.max_batched, self.max_model_len = num_speculative_tokens, max_num_batched_tokens, max_model_len
        self.fitted = row_cost == "fitted"
        """Whether the step cost is fitted to this engine's measured steps (`observe_step`)."""
        self.row_cost = 0.016 if self.fitted else float(row_cost)
        """A token row's cost as a share of a step's fixed part (EngineConfig.speculative_row_cost), the prior
        of the fitted model."""
        self.cost = StepCostModel(self.row_cost)
        self.proposer: Proposer = proposer if proposer is not None else NgramProposer(ngram_min, ngram_max)
        self._pace: weakref.WeakKeyDictionary[Sequence, _Pace] = weakref.WeakKeyDictionary()
        self._kinds: dict[str, tuple[float, float]] = {}  # kind -> engine-wide (kept, rejected), decayed
        self._declined: dict[str, int] = {}  # kind -> times a sequence's probe of it came due
        self._step_probes = 0  # probes planned in the current step
        self.num_proposed = 0
        self.num_accepted = 0
        self.num_verifications = 0
        self.num_gated_steps = 0
        """Steps past the break-even (`plan`): no proposal asked for, no probe."""

    @classmethod
    def build(cls, cache: CacheManager, config: EngineConfig, target: HybridLM, draft: HybridLM | None,
              seed: int) -> Speculator | None:
        """The engine's speculator for `config` (None with speculative=off); `draft` as `draft_proposer`."""
        if config.speculative == "off":
            return None
        proposer = (SuffixProposer(config.suffix_max_depth, config.suffix_max_tokens, config.suffix_min_share)
                    if config.speculative == "suffix" else draft_proposer(config, target, draft, seed))
        return cls(cache, config.num_speculative_tokens, config.ngram_min, config.ngram_max,
                   config.max_num_batched_tokens, config.max_model_len, config.speculative_row_cost,
                   proposer=proposer)

    def acceptance_estimate(self, seq: Sequence, kind: str) -> float:
        """The chance that `seq`'s next proposal of `kind` is kept: its own kept / (kept + rejections),
        with PRIOR_WEIGHT pseudo-observations at the engine-wide rate of that kind (`kind_rate`): an
        n-gram match of 4 tokens is kept far more often than one of 1."""
        return self._blend(seq, self.kind_rate(kind))

    def kind_rate(self, kind: str) -> float:
        """The engine-wide rate at which proposals of `kind` are kept (from one kept and one rejected)."""
        accepted, rejected = self._kinds.get(kind, (0.0, 0.0))
        return (accepted + 1.0) / (accepted + rejected + 2.0)

    def _blend(self, seq: Sequence, overall: float) -> float:
        pace = self._pace.get(seq)
        if pace is None:
            return overall
        return (pace.accepted + PRIOR_WEIGHT * overall) / (pace.accepted + pace.rejected + PRIOR_WEIGHT)

    def worth(self, acceptance: float, num_seqs: int) -> int:
        """How many proposals pay in a step of `num_seqs` sequences (0: none). In token rows: proposal j, kept
        with chance a^j, costs one row; kept, it saves a later row and its share of a step's fixed part,
        1 + 1 / (r num_seqs) rows, r = `row_cost` (a row's cost as a share of the fixed part); a
        verification also costs its own bookkeeping (`StepCostModel.overhead_rows`: two rows, or fitted).
        The k with the largest expected saving sum_j a^j (1 + 1 / (r n)) - k - that, if positive."""
        if self.row_cost == 0 and not self.fitted:
            return self.max_k
        return self.cost.worth(acceptance, num_seqs, self.max_k)

    def observe_step(self, num_decoding: int, plan: Verification | None, seconds: float) -> None:
        """A decode step's measured seconds (`num_decoding` sequences, each one row, plus the plan's
        verification rows) for the fitted cost model; nothing unless speculative_row_cost=fitted."""
        if self.fitted:
            self.cost.observe(num_decoding, sum(len(p) for p in plan.proposals) if plan is not None else 0, seconds,
                              len(plan.index) if plan is not None else 0)

    def stats(self) -> dict[str, float]:
        """Tokens proposed and kept, and verifications, since the engine was built (`Engine.stats`)."""
        return {"spec_proposed": self.num_proposed, "spec_accepted": self.num_accepted,
                "spec_verifications": self.num_verifications, "spec_gated_steps": self.num_gated_steps}

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed tokens since the engine was built (0 before any proposal)."""
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    def plan(self, step: ScheduledStep) -> Verification | None:
        """Extend the step's decoding sequences by their proposals (their `num_new_tokens` grow to k + 1;
        their pages and position pages allocated); None when nobody speculates."""
        budget = self.max_batched - step.num_tokens
        num_seqs = len(step.seqs)
        self._step_probes = 0
        best_rate = max((self.kind_rate(kind) for kind in self._kinds), default=self.kind_rate(""))
        if self.worth(max(best_rate, GATE_RATE), num_seqs) == 0:  # past the break-even of the best kind
            self.num_gated_steps += 1
            return None
        self.proposer.observe(step.seqs)  # a suffix tree takes every sequence's new tokens, asked or not
        wanted: list[tuple[int, int, str | None]] = []  # (index into the step, proposals it may verify, kind if known)
        for i, (seq, n) in enumerate(zip(step.seqs, step.num_new_tokens)):
            if budget <= 0:
                break
            room = self._room(seq, n, budget)
            kind = self.proposer.kind_of(seq) if room else None
            if kind is not None:  # known before proposing: ask only for what pays (a draft's passes cost)
                room = self._paying(seq, kind, room, num_seqs)
            elif room and not self._may_pay(seq, num_seqs, best_rate):
                room = 0  # no kind pays here and no probe is due: not even a lookup
            if room > 0:
                wanted.append((i, room, kind))
                budget -= room
        if not wanted:
            return None
        proposals = self.proposer.propose_batch([step.seqs[i] for i, _, _ in wanted], [k for _, k, _ in wanted])
        plan = Verification([], [], [], [], [], [])
        for (i, room, known), proposal in zip(wanted, proposals):
            seq = step.seqs[i]
            tokens = proposal.tokens[:room]
            if tokens and known is None:  # its kind is known only now: keep what pays
                tokens = tokens[:self._paying(seq, proposal.kind, len(tokens), num_seqs)]
            if not tokens or not self.cache.grow(seq, 1 + len(tokens)):
                continue
            pages = self._position_pages(len(tokens))
            if pages is None:
                continue
            step.num_new_tokens[i] = 1 + len(tokens)
            plan.index.append(i)
            plan.proposals.append(tokens)
            plan.draft_probs.append(None if proposal.draft_probs is None else proposal.draft_probs[:len(tokens)])
            plan.kinds.append(proposal.kind)
            plan.position_pages.append(pages)
            plan.starts.append(seq.num_computed)
        return plan if plan.index else None

    def _room(self, seq: Sequence, n: int, budget: int) -> int:
        """Proposals `seq` may verify this step at most: 0 unless it decodes; within num_speculative_tokens,
        the budget, its max_new_tokens and max_model_len."""
        if n != 1 or seq.num_computed != seq.num_tokens - 1 or seq.num_computed == 0 or seq.num_forks:
            return 0
        return max(0, min(self.max_k, budget, seq.params.max_new_tokens - seq.num_generated - 1,
                          self.max_model_len - seq.num_tokens - 1))

    def _may_pay(self, seq: Sequence, num_seqs: int, best_rate: float) -> bool:
        """Whether a proposal of the best kind (engine-wide rate `best_rate`) could pay for `seq` in this
        step, or its probe is due."""
        pace = self._pace.get(seq)
        if seq.num_generated >= (PROBE_AFTER if pace is None else pace.probe_at):
            return True
        return self.worth(self._blend(seq, best_rate), num_seqs) > 0

    def _paying(self, seq: Sequence, kind: str, room: int, num_seqs: int) -> int:
        """Of `room` proposals of `kind`, those that pay (`worth`); when none does, one probe after
        PROBE_AFTER, then 2 x, 4 x ... (at most MAX_BACKOFF) of the sequence's tokens (only one in
        KNOWN_KIND_PROBE_EVERY of them once the kind's rate is known), else 0."""
        pace = self._pace.setdefault(seq, _Pace())
        k = self.worth(self.acceptance_estimate(seq, kind), num_seqs)
        if k:
            pace.misses = 0
            return min(k, room)
        if seq.num_generated < pace.probe_at:
            return 0
        if self._step_probes >= PROBES_PER_STEP:
            return 0  # exploration costs at most PROBES_PER_STEP rows a step
        accepted, rejected = self._kinds.get(kind, (0.0, 0.0))
        self._declined[kind] = self._declined.get(kind, 0) + 1
        if accepted + rejected >= KNOWN_KIND and self._declined[kind] % KNOWN_KIND_PROBE_EVERY:
            return 0  # a kind known not to pay: probed rarely
        self._step_probes += 1
        pace.misses += 1
        pace.probe_at = seq.num_generated + min(PROBE_AFTER * 2 ** pace.misses, MAX_BACKOFF)
        return 1

    def _position_pages(self, k: int) -> list[list[int]] | None:
        """k fresh state pages per KDA cache group, or None (nothing allocated) when the pool lacks them."""
        pages: list[list[int]] = []
        try:
            for g in range(self.cache.num_kda_groups):
                pages.append(self.pool.allocate(k, ("kda", g)))
        except OutOfPages:
            self.pool.decref([p for group in pages for p in group])
            return None
        return pages

    def settle(self, step: ScheduledStep, plan: Verification, logits: torch.Tensor
               ) -> tuple[list[Sample], Settlement]:
        """Accept and roll back each verifying sequence (module docstring), before the cache indexes the
        step. logits: [sum of k + 1, vocab], each sequence's rows in plan order. Returns their samples
        (sequence, token, logprob, sampling entropy), in order, and what the cache's indexing needs
        (its pages to free after it)."""
        samples: list[Sample] = []
        settled = Settlement({}, {}, [])
        hash_block = self.cache.prefix.config.hash_block if self.cache.prefix is not None else 0
        seqs = [step.seqs[i] for i in plan.index]
        drafts = plan.draft_probs if any(q is not None for q in plan.draft_probs) else None
        verdicts = accept_many(logits, plan.proposals, [seq.params for seq in seqs],
                               [seq.generator if seq.params.temperature > 0 else None for seq in seqs], drafts)
        for seq, verdict, proposal, kind, pages, start in zip(seqs, verdicts, plan.proposals, plan.kinds,
                                                              plan.position_pages, plan.starts):
            k, kept = len(proposal), verdict.num_accepted
            done = seq.num_computed = start + 1 + kept
            if kept:
                settled.accepted[seq.seq_id] = proposal[:kept]
            boundary = (done - 1) // hash_block * hash_block if hash_block else 0  # the last one before done
            if boundary > start:  # the state after it is in position page boundary - start - 1 (< kept)
                settled.checkpoints[seq.seq_id] = (boundary, [group[boundary - start - 1] for group in pages])
            for g, group in enumerate(pages):
                if kept < k:  # the state after start + 1 + kept tokens is in position page `kept`
                    settled.release.append(seq.kda_pages[g])
                    seq.kda_pages[g] = group[kept]
                settled.release += [p for j, p in enumerate(group) if j != kept]  # all of them when kept == k
            self._update_pace(seq, kind, k, kept)
            self.proposer.settled(seq, k, kept)
            samples += zip([seq] * len(verdict.tokens), verdict.tokens, verdict.logprobs, verdict.entropies)
        return samples, settled

    def _update_pace(self, seq: Sequence, kind: str, k: int, kept: int) -> None:
        self.num_proposed += k
        self.num_accepted += kept
        self.num_verifications += 1
        pace = self._pace.setdefault(seq, _Pace())
        rejected = int(kept < k)
        pace.accepted += kept
        pace.rejected += rejected
        accepted_all, rejected_all = self._kinds.get(kind, (0.0, 0.0))
        self._kinds[kind] = (accepted_all * GLOBAL_DECAY + kept, rejected_all * GLOBAL_DECAY + rejected)
