"""`ResumeOrder`: when each waiting conversation is expected to resume, for the prefix cache's eviction.

A multi-turn trajectory between two turns is *inactive*: its KV (the prefix cache's entries up to its
last checkpoint) is reusable but idle while its tool runs, or while its next request waits in the
engine's queue. The rollout says when it expects each to resume (`expect`: the tool's expected end, or
the time a request was queued); the prefix cache then evicts, when the device pool is short:
1. entries no waiting conversation reads (least recently used first),
2. then turn-boundary entries no one is expected to resume from (a finished episode's),
3. then waiting conversations' entries, the one expected to resume last first
so the one soonest to resume goes last; a page several conversations read (a group's shared prompt)
counts at the soonest of them. An expectation ends when its conversation's next request takes the hit
(`consumed`) or its checkpoint leaves the index. Pure bookkeeping: pages come from the prefix cache's
`pages_of` (hash -> the device pages a hit up to it reads).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable


class ResumeOrder:
    def __init__(self) -> None:
        self.expected: dict[bytes, tuple[float, list[bytes]]] = {}
        """Checkpoint hash -> (expected resume time, the hash chain up to it)."""
        self._order: dict[int, float] | None = None  # device page -> soonest resume among its readers

    def expect(self, h: bytes, chain: list[bytes], at: float) -> None:
        """The conversation whose prefix ends at checkpoint `h` resumes at about `at` (monotonic seconds)."""
        self.expected[h] = (at, chain)
        self._order = None

    def consumed(self, hashes: Iterable[bytes]) -> None:
        """A request took a hit through these hashes: their conversations are running again."""
        for h in hashes:
            if self.expected.pop(h, None) is not None:
                self._order = None

    def invalidate(self) -> None:
        """Pages moved (a step's copies ran, entries left): recompute the order when next asked."""
        self._order = None

    def clear(self) -> None:
        self.expected.clear()
        self._order = None

    def resume_of(self, pages_of: Callable[[bytes, list[bytes]], set[int] | None]) -> dict[int, float]:
        """Device page -> the soonest expected resume among the waiting conversations reading it.
        `pages_of(h, chain)`: the pages a hit up to checkpoint h reads, None once h left the index (its
        expectation is then dropped). Cached until the next `expect` / `consumed` / `invalidate`."""
        if self._order is None:
            order: dict[int, float] = {}
            for h, (at, chain) in list(self.expected.items()):
                pages = pages_of(h, chain)
                if pages is None:
                    del self.expected[h]
                    continue
                for page in pages:
                    if at < order.get(page, float("inf")):
                        order[page] = at
            self._order = order
        return self._order

    def eviction_order(self, lru: Iterable[int], protected: set[int], resume: dict[int, float],
                       sooner_than: float | None = None) -> list[int]:
        """`lru` (least recently used first) in eviction order (module docstring). With `sooner_than`,
        only what is safe to give up for a conversation resuming then: pages of classes 1 and 2 and
        those of conversations expected strictly later."""
        free, turns, waiting = [], [], []
        for page in lru:
            at = resume.get(page)
            if at is not None:
                if sooner_than is None or at > sooner_than:
                    waiting.append((at, page))
            elif page in protected:
                turns.append(page)
            else:
                free.append(page)
        waiting.sort(key=lambda item: -item[0])  # stable: among equal times, least recently used first
        return free + turns + [page for _, page in waiting]
