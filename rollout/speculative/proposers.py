"""Speculative proposers: what a sequence may say next, for the engine to verify in one forward.

A proposer implements `propose_batch(seqs, ks)`: per sequence up to k tokens, and the distribution each
was drawn from (a draft model's) or None (a deterministic guess: a point mass for the acceptance rule).
`NgramProposer` (prompt lookup, no model) lives here; `DraftProposer` (a small model of ours) in
rollout/speculative/draft.py. `settled(seq, proposed, kept)` tells a proposer how its last proposal fared (a draft
rolls its own state back to the kept tokens).
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from rollout.request import Sequence

@dataclass
class Proposal:
    """What a proposer suggests for one sequence."""

    tokens: list[int]
    """d_1 .. d_k (empty: nothing to propose)."""
    draft_probs: torch.Tensor | None = None
    """q [k, vocab], the distribution each d_i was drawn from (None: point masses)."""
    kind: str = ""
    """What produced it ("shared:<n>", "own:<n>" for n-gram matches of length n, "draft"): the engine
    tracks how often each kind is kept (rollout/speculative/speculation.py)."""


class Proposer:
    """The interface (module docstring). A subclass implements `propose` (one sequence, point masses) or
    `propose_batch`."""

    def propose(self, seq: Sequence, k: int) -> list[int]:
        raise NotImplementedError

    def propose_batch(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        """Up to ks[i] tokens for seqs[i] (none when ks[i] is 0)."""
        return [Proposal(self.propose(seq, k) if k else []) for seq, k in zip(seqs, ks)]

    def kind_of(self, seq: Sequence) -> str | None:
        """The kind of `seq`'s next proposal when known before proposing (None: only the proposal says);
        the engine then limits k before paying for a proposal (a draft model's forward passes)."""
        return None

    def observe(self, seqs: list[Sequence]) -> None:
        """A step's sequences, before any is asked for proposals (many are not: their proposals do not
        pay, or the batch is past the break-even): what the proposer learns from their tokens, it takes
        now (a suffix tree's texts)."""

    def settled(self, seq: Sequence, proposed: int, kept: int) -> None:
        """`seq` kept `kept` of its `proposed` tokens (its tokens are not appended yet)."""

    def clear(self) -> None:
        """Drop whatever the proposer holds per sequence (the engine sleeps)."""


class NgramProposer(Proposer):
    """Prompt lookup: the continuation of the most recent earlier occurrence of the sequence's last n
    tokens (the longest n in [ngram_min, ngram_max] that occurs), in what any sequence of the engine
    generated lately (a shared table of the last `shared_entries` n-grams of generated text, other
    sequences' only: agentic answers repeat their format across trajectories, and the model's own
    outputs predict it better than its prompt does, as suffix decoding exploits, Oliaro et al. 2024) or
    in the sequence itself; at equal n the generated text wins. Each sequence's n-grams are indexed
    incrementally (the latest end position of each), so a proposal costs O(ngram_max) lookups."""

    def __init__(self, ngram_min: int, ngram_max: int, shared_entries: int = 1 << 16) -> None:
        self.ngram_min, self.ngram_max, self.shared_entries = ngram_min, ngram_max, shared_entries
        self._index: weakref.WeakKeyDictionary[Sequence, tuple[int, dict[tuple[int, ...], int]]] = \
            weakref.WeakKeyDictionary()
        self._shared: OrderedDict[tuple[int, ...], tuple[list[int], int]] = OrderedDict()

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to k tokens to follow seq.tokens (fewer at the end of what was copied; [] when no n-gram
        of the suffix occurred before, here or in the shared table)."""
        return self._lookup(seq, k).tokens

    def propose_batch(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        return [self._lookup(seq, k) if k else Proposal([]) for seq, k in zip(seqs, ks)]

    def _lookup(self, seq: Sequence, k: int) -> Proposal:
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
            shared = self._shared.get(key)
            if shared is not None and shared[0] is not tokens:  # what a sequence generated after it
                source, end = shared
                return Proposal(list(source[end:end + k]), kind=f"shared:{n}")
            end = index.get(key)
            if end is not None:
                return Proposal(list(tokens[end:end + k]), kind=f"own:{n}")
        return Proposal([])
