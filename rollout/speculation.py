"""Speculative decoding in the engine's step: proposals verified in one forward, the hybrid's state rolled
back by choosing a page.

Per step, after the scheduler: each decoding sequence (its one uncomputed token is the last it sampled)
may get up to `num_speculative_tokens` proposals d_1 .. d_k from a proposer (`NgramProposer`: prompt lookup
over the sequence's own tokens, then over what the engine's sequences generated lately). It then computes
k + 1 tokens in the step: [last, d_1 .. d_k] as one chunk.
MLA writes k + 1 slots; each KDA layer also writes its state and conv tails after each of the first k of
them into k pages of their own per cache group (models/paged_positions.py). The target's logits at the
k + 1 positions decide (rollout/spec_accept.py) how many proposals stay (a) and the token after them; then:
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

Adaptive per sequence: k follows the last acceptance (a + 1, at most the knob); a sequence whose
proposals were all rejected stops speculating for 2, 4, 8 ... (at most 64) of its tokens.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from memory.page_pool import OutOfPages
from rollout.cache_manager import CacheManager
from rollout.request import Sequence
from rollout.scheduler import ScheduledStep
from rollout.spec_accept import accept_many

Sample = tuple[Sequence, int, float, float]
"""A token a step emits: (sequence, token, behaviour logprob, entropy of its sampling distribution)."""
MAX_BACKOFF = 64
"""Most tokens a sequence decodes plainly after a verification that kept nothing."""


class NgramProposer:
    """Prompt lookup: the continuation of the most recent earlier occurrence of the sequence's last n
    tokens (the longest n in [ngram_min, ngram_max] that occurs), in the sequence itself or, failing a
    longer match there, in what any sequence of the engine generated lately (a shared table of the last
    `shared_entries` n-grams of generated text: agentic answers repeat their format across trajectories,
    as suffix decoding exploits, Oliaro et al. 2024). Each sequence's n-grams are indexed incrementally
    (the latest end position of each), so a proposal costs O(ngram_max) lookups, not a scan."""

    def __init__(self, ngram_min: int, ngram_max: int, shared_entries: int = 1 << 16) -> None:
        self.ngram_min, self.ngram_max, self.shared_entries = ngram_min, ngram_max, shared_entries
        self._index: weakref.WeakKeyDictionary[Sequence, tuple[int, dict[tuple[int, ...], int]]] = \
            weakref.WeakKeyDictionary()
        self._shared: OrderedDict[tuple[int, ...], tuple[list[int], int]] = OrderedDict()

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to k tokens to follow seq.tokens (fewer at the end of what was copied; [] when no n-gram
        of the suffix occurred before, here or in the shared table)."""
        tokens = seq.tokens
        upto, index = self._index.get(seq, (0, {}))
        for end in range(max(upto, 1), len(tokens)):  # n-grams ending at `end` (exclusive), followed by a token
            for n in range(self.ngram_min, min(self.ngram_max, end) + 1):
                key = tuple(tokens[end - n:end])
                index[key] = end
                if end > seq.prompt_len:  # generated text: shared
                    self._shared[key] = (tokens, end)
                    self._shared.move_to_end(key)
        while len(self._shared) > self.shared_entries:
            self._shared.popitem(last=False)
        self._index[seq] = (len(tokens), index)
        for n in range(min(self.ngram_max, len(tokens) - 1), self.ngram_min - 1, -1):
            key = tuple(tokens[len(tokens) - n:])
            end = index.get(key)
            if end is not None:
                return list(tokens[end:end + k])
            shared = self._shared.get(key)
            if shared is not None and shared[0] is not tokens:
                source, end = shared
                return list(source[end:end + k])
        return []


@dataclass
class Verification:
    """One step's verifying sequences."""

    index: list[int]
    """Indices into the step's sequences."""
    proposals: list[list[int]]
    """Per verifying sequence, its proposals (k >= 1 tokens)."""
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
    """A sequence's adaptive speculation length."""

    k: int
    misses: int = 0
    resume_at: int = 0
    """Generated-token count from which it speculates again."""


class Speculator:
    """Plans a step's verifications and settles them (module docstring)."""

    def __init__(self, cache: CacheManager, num_speculative_tokens: int, ngram_min: int, ngram_max: int,
                 max_num_batched_tokens: int, max_model_len: int) -> None:
        self.cache, self.pool = cache, cache.pool
        self.max_k, self.max_batched, self.max_model_len = num_speculative_tokens, max_num_batched_tokens, max_model_len
        self.proposer = NgramProposer(ngram_min, ngram_max)
        self._pace: weakref.WeakKeyDictionary[Sequence, _Pace] = weakref.WeakKeyDictionary()
        self.num_proposed = 0
        self.num_accepted = 0
        self.num_verifications = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed tokens since the engine was built (0 before any proposal)."""
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    def plan(self, step: ScheduledStep) -> Verification | None:
        """Extend the step's decoding sequences by their proposals (their `num_new_tokens` grow to k + 1;
        their pages and position pages allocated); None when nobody speculates."""
        budget = self.max_batched - step.num_tokens
        plan = Verification([], [], [], [])
        for i, (seq, n) in enumerate(zip(step.seqs, step.num_new_tokens)):
            if budget <= 0:
                break
            k = self._room(seq, n, budget)
            proposal = self.proposer.propose(seq, k) if k > 0 else []
            if not proposal or not self.cache.grow(seq, 1 + len(proposal)):
                continue
            pages = self._position_pages(len(proposal))
            if pages is None:
                continue
            step.num_new_tokens[i] = 1 + len(proposal)
            budget -= len(proposal)
            plan.index.append(i)
            plan.proposals.append(proposal)
            plan.position_pages.append(pages)
            plan.starts.append(seq.num_computed)
        return plan if plan.index else None

    def _room(self, seq: Sequence, n: int, budget: int) -> int:
        """Proposals `seq` may verify this step: 0 unless it decodes; within its pace, the budget, its
        max_new_tokens and max_model_len, and the next hash-block boundary (a chunk ends there)."""
        if n != 1 or seq.num_computed != seq.num_tokens - 1 or seq.num_computed == 0 or seq.num_forks:
            return 0
        pace = self._pace.setdefault(seq, _Pace(self.max_k))
        if seq.num_generated < pace.resume_at:
            return 0
        k = min(pace.k, budget, seq.params.max_new_tokens - seq.num_generated - 1,
                self.max_model_len - seq.num_tokens - 1)
        return max(k, 0)

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
        verdicts = accept_many(logits, plan.proposals, [seq.params for seq in seqs],
                               [seq.generator if seq.params.temperature > 0 else None for seq in seqs])
        for seq, verdict, proposal, pages, start in zip(seqs, verdicts, plan.proposals, plan.position_pages,
                                                        plan.starts):
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
            self._update_pace(seq, k, kept)
            samples += zip([seq] * len(verdict.tokens), verdict.tokens, verdict.logprobs, verdict.entropies)
        return samples, settled

    def _update_pace(self, seq: Sequence, k: int, kept: int) -> None:
        self.num_proposed += k
        self.num_accepted += kept
        self.num_verifications += 1
        pace = self._pace.setdefault(seq, _Pace(self.max_k))
        pace.k = min(self.max_k, kept + 1)
        if kept == 0:
            pace.misses += 1
            pace.resume_at = seq.num_generated + 1 + min(2 ** pace.misses, MAX_BACKOFF)
        else:
            pace.misses = 0
