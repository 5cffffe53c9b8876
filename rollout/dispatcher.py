"""Request dispatch with auto-throttling: how many requests to keep in the engine.

The RL driver hands the dispatcher a backlog of `Submission`s (each with, for multi-turn
trajectories, a `FollowUp` that turns a finished turn into the next turn's submissions). The dispatcher keeps at most
`limit` requests in flight. With `max_concurrency=None` (auto) the limit follows the engine's
runtime signals, AIMD-style:
- a preemption since the last step (the pool could not hold the running sequences' growth):
  multiply the limit by `backoff`;
- the engine is saturated (requests queued inside it, pool utilisation >= `high_watermark`, or
  requests held back for KV room, below): hold the limit;
- otherwise grow it by a quarter (at least one).
and, before any preemption happens, a request is only sent while the pages the in-flight requests
would hold at their full length (prompt + max_new_tokens) fit in `kv_overcommit` x the pool.
So concurrency is high while contexts are short and backs off as KV pressure grows, with no
per-workload tuning. An integer `max_concurrency` pins the limit (the baseline it is compared to).

With the prefix cache on, the pool fills with pages only the prefix index holds. The throttle's
utilisation counts them as free (`Dispatcher.signals`: eviction hands them out on demand), and the
admission check accounts for the cache's own pages instead: each sequence's full-length projection
includes its resume point, the pages a continuation (the next turn) copies out of the cache rather
than shares: a KDA checkpoint (one page per KDA group) and the MLA page the hit ends in (one per
MLA group). The full pages a hit shares are held by the sequence, so its projection has them
already. Without that headroom the running sequences' growth evicts the checkpoints the next turns
resume from (fewer hits, more prefill), or finds nothing evictable while the checkpoints cut at a
hash boundary wait on their page copy (pinned until the next forward pass; sequences admitted
together cross boundaries together) and preempts. A follow-up waiting in the backlog keeps its
finished turn's resume point reserved until it is sent, or the others' growth evicts it first.
Measured on `benchmarks.throttle`: docs/rollout.md.

Work in the background (`Background`: environment calls on worker threads, rl/episodes/env_runner.py): a
finished turn's follow-up may hand its conversation to the background and return nothing; the
dispatcher keeps stepping the engine for the other requests, collects what the background finished
after every step (its submissions go first, like any follow-up's), waits on it only when the engine
has nothing to run, and runs until it is empty too. A conversation waiting on its tool keeps its
resume point reserved in the admission check, as a queued follow-up does.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from rollout.engine import Engine
from rollout.request import RequestOutput
from rollout.sampling import SamplingParams

PREFETCH_BACKLOG = 4
"""Queued follow-ups whose host-tier prefixes are prefetched before they are sent, per step."""

@dataclass(frozen=True)
class Submission:
    """One request for the engine, as the backlog and the in-flight table hold it."""

    prompt: list[int]
    params: SamplingParams
    follow_up: "FollowUp | None" = None
    """Called with the request's output when it finishes (None: nothing follows)."""
    turn_boundaries: tuple[int, ...] = ()
    """Where the conversation's turns end in `prompt` (the prefix cache keeps its checkpoints there)."""


class Background(Protocol):
    """Work that ends outside the engine (environment calls on worker threads) and yields submissions."""

    @property
    def pending(self) -> int:
        """Items not yet collected (each a conversation whose next request is not known yet)."""

    def collect(self) -> list[Submission]:
        """The submissions of the items that ended since the last call (never blocks)."""

    def wait(self, timeout_s: float) -> None:
        """Block until an item may have ended, or `timeout_s` seconds."""


class FollowUp(Protocol):
    """What continues a request once it finishes: called with its output, returns the next requests
    of the same conversation(s), each a `Submission` naming its own follow-up ([] = they ended).
    They go to the front of the backlog, in order: their prefixes are hot in the cache. A caller
    that needs to know whom a request continues (an iteration stopped early) keeps that on its
    follow-up object, which `Dispatcher.clear` hands back with the submission."""

    def __call__(self, out: RequestOutput) -> list[Submission]: ...


@dataclass(frozen=True, kw_only=True)
class ThrottleConfig:
    max_concurrency: int | None = None
    """Requests in flight; None = automatic (the default)."""
    auto_start: int = 8
    """Automatic mode: the initial limit."""
    auto_max: int = 1024
    """Automatic mode: the largest limit."""
    high_watermark: float = 0.9
    """Automatic mode: pool utilisation at which the limit stops growing."""
    backoff: float = 0.5
    """Automatic mode: limit multiplier after a preemption."""
    kv_overcommit: float = 1.0
    """Automatic mode: in-flight requests' full-length pages may reach this multiple of the pool."""
    resume_headroom: bool = True
    """Automatic mode, prefix cache on: project each sequence's resume point (debug: False shows why)."""

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency={self.max_concurrency}, expected >= 1 or None (auto)")
        if not 1 <= self.auto_start <= self.auto_max:
            raise ValueError(f"auto_start={self.auto_start}, auto_max={self.auto_max}: expected 1 <= start <= max")
        if not 0 < self.high_watermark <= 1 or not 0 < self.backoff < 1:
            raise ValueError(f"high_watermark={self.high_watermark} (in (0, 1]), backoff={self.backoff} "
                             f"(in (0, 1)) out of range")


@dataclass
class AutoLimit:
    """The automatic controller: engine signals in, concurrency limit out (no engine access)."""

    config: ThrottleConfig
    limit: int = 0
    last_preemptions: int = 0
    history: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.limit = self.config.auto_start

    def update(self, stats: dict[str, float], hold: bool = False) -> int:
        """`hold`: no reason to grow this step (requests held back for KV room, or none waiting)."""
        cfg = self.config
        if stats["preemptions"] > self.last_preemptions:
            self.limit = max(1, int(self.limit * cfg.backoff))
        elif hold or stats["waiting"] > 0 or stats["pool_utilization"] >= cfg.high_watermark:
            pass
        else:
            self.limit = min(cfg.auto_max, self.limit + max(1, self.limit // 4))
        self.last_preemptions = int(stats["preemptions"])
        self.history.append(self.limit)
        return self.limit


class Dispatcher:
    def __init__(self, engine: Engine, config: ThrottleConfig | None = None) -> None:
        self.engine, self.config = engine, config or ThrottleConfig()
        self.auto = AutoLimit(self.config) if self.config.max_concurrency is None else None
        self.backlog: deque[Submission] = deque()
        self.in_flight: dict[str, Submission] = {}
        self._projected: dict[str, int] = {}  # request -> pages it holds at full length
        # The resume point of each follow-up queued at the front of the backlog (in order): its
        # conversation's prefix is cached, and the pages stay reserved until it is sent.
        self._queued_resume: deque[int] = deque()
        self._background: Background | None = None
        self.engine_seconds = 0.0
        """Seconds spent in `engine.step` (the engine's busy time) over every `run`."""
        self.wait_seconds = 0.0
        """Seconds spent waiting on the background with nothing for the engine to run."""

    def _full_length_pages(self, prompt: list[int], params: SamplingParams) -> int:
        """Pages the request's sequences hold at full length (prompt + max_new_tokens), plus, with the
        prefix cache on, each sequence's resume point in the cache (`_resume_pages`). Speculation adds
        nothing: a verification's k + 1 slots lie within the full length (proposals stop short of
        max_new_tokens), and its position pages are taken from free pages for one step only (a sequence
        that finds none decodes plainly), so they never preempt anyone."""
        cache = self.engine.cache
        tokens = min(len(prompt) + params.max_new_tokens, self.engine.config.max_model_len)
        return (cache.pages_for_tokens(tokens) + self._resume_pages) * params.n

    @property
    def _resume_pages(self) -> int:
        """The pages of one sequence's resume point only the prefix cache holds
        (`CacheManager.resume_point_pages`), when the headroom for them is kept."""
        return self.engine.cache.resume_point_pages if self.config.resume_headroom else 0

    def _room_for(self, prompt: list[int], params: SamplingParams) -> bool:
        """Whether the backlog's head fits: in-flight projections + the resume points the other
        queued follow-ups keep reserved + its own projection within `kv_overcommit` x the pool."""
        if self.auto is None or not self.in_flight:
            return True  # a fixed limit is the whole policy; one request always goes
        budget = self.config.kv_overcommit * self.engine.pool.num_pages
        reserved = sum(self._queued_resume) - (self._queued_resume[0] if self._queued_resume else 0)
        if self._background is not None:  # conversations waiting on their tools resume soon
            reserved += self._background.pending * self._resume_pages
        return sum(self._projected.values()) + reserved + self._full_length_pages(prompt, params) <= budget

    def signals(self) -> dict[str, float]:
        """`Engine.stats()` as the throttle reads it: `pool_utilization` leaves out the pages only the
        prefix index holds (free on demand). Counting them is a walk over the index, so it is done
        only when the raw utilisation reaches `high_watermark`, the only comparison it changes."""
        stats = self.engine.stats()
        if stats["pool_utilization"] >= self.config.high_watermark:
            held = stats["pool_pages_used"] - self.engine.cache.num_evictable_pages
            stats["pool_utilization"] = held / stats["pool_pages"]
        return stats

    @property
    def limit(self) -> int:
        return self.auto.limit if self.auto is not None else self.config.max_concurrency

    def add(self, submission: Submission) -> None:
        """Queue a request; its follow-up, if any, may return the next turn's submissions."""
        self.backlog.append(submission)

    def adopt(self, request_id: str, submission: Submission) -> None:
        """Count a request that is already in the engine (a resumed partial rollout) as in flight."""
        self.in_flight[request_id] = submission
        self._projected[request_id] = self._full_length_pages(submission.prompt, submission.params)

    def clear(self) -> tuple[list[tuple[str, Submission]], list[Submission]]:
        """Forget all work (a stopped iteration): returns ((request id, submission) in flight, unsent backlog)."""
        in_flight, backlog = list(self.in_flight.items()), list(self.backlog)
        self.in_flight.clear()
        self._projected.clear()
        self._queued_resume.clear()
        self.backlog.clear()
        return in_flight, backlog

    def run(self, on_output: Callable[[RequestOutput], None] | None = None,
            should_stop: Callable[[], bool] | None = None, background: Background | None = None,
            on_step: Callable[[], None] | None = None) -> list[RequestOutput]:
        """Dispatch until the backlog, the follow-ups, the engine and the `background` are all done,
        or until `should_stop()` (checked before every step, a pure decision) says so, leaving the
        rest in flight / queued / in the background; returns every finished request's output in
        completion order. `on_step()` (a progress display, say) is called after every engine step,
        its follow-ups queued, and once more when the run ends."""
        outputs = []
        if self.auto is not None:  # count preemptions from here on (the engine may be new or reused)
            self.auto.last_preemptions = int(self.engine.stats()["preemptions"])
        self._background = background
        try:
            while self.backlog or self.in_flight or (background is not None and background.pending):
                if should_stop is not None and should_stop():
                    break
                kv_bound = self._send()
                self._prefetch_backlog()
                if self.in_flight:
                    t0 = time.perf_counter()
                    finished = self.engine.step()
                    self.engine_seconds += time.perf_counter() - t0
                    for out in finished:
                        outputs.append(out)
                        if on_output is not None:
                            on_output(out)
                        self._queue_next(self._finish(out))
                    if on_step is not None:
                        on_step()
                elif background is not None:  # nothing to run: the engine waits on the tools
                    t0 = time.perf_counter()
                    # under expert parallelism the peers' steps need this rank's exchanges meanwhile
                    if not self.engine.idle_step(unfinished=True):
                        background.wait(0.5 if self.engine.expert_parallel is None else 0.01)
                    self.wait_seconds += time.perf_counter() - t0
                if background is not None:
                    self._queue_next(background.collect())
                if self.auto is not None:
                    self.auto.update(self.signals(), hold=kv_bound or not self.backlog)
        finally:
            self._background = None
        if on_step is not None:
            on_step()
        return outputs

    def _send(self) -> bool:
        """Send the backlog's head while the limit and the KV room allow; True when KV room held it back."""
        while self.backlog and len(self.in_flight) < self.limit:
            if not self._room_for(self.backlog[0].prompt, self.backlog[0].params):
                return True
            sub = self.backlog.popleft()
            if self._queued_resume:
                self._queued_resume.popleft()
            request_id = self.engine.add_request(sub.prompt, sub.params, turn_boundaries=sub.turn_boundaries)
            self.in_flight[request_id] = sub
            self._projected[request_id] = self._full_length_pages(sub.prompt, sub.params)
        return False

    def _prefetch_backlog(self) -> None:
        """The first PREFETCH_BACKLOG follow-ups still queued here (their conversations' next turns, in
        the order they will be sent) get their host-tier prefixes copied back now (`Engine.prefetch_prefix`),
        so that their admission finds them on the device."""
        if self.engine.cache.host_tier is None or not self._queued_resume:
            return
        now = time.monotonic()
        for i in range(min(PREFETCH_BACKLOG, len(self._queued_resume), len(self.backlog))):
            self.engine.prefetch_prefix(self.backlog[i].prompt, now + i * 1e-6)

    def _finish(self, out: RequestOutput) -> list[Submission]:
        """A finished request out of the books; its follow-up's submissions."""
        follow_up = self.in_flight.pop(out.request_id).follow_up
        self._projected.pop(out.request_id)
        return follow_up(out) if follow_up is not None else []

    def _queue_next(self, nxt: list[Submission]) -> None:
        """Follow-ups' submissions to the front of the backlog, in order: their prefixes are hot."""
        self.backlog.extendleft(reversed(nxt))
        self._queued_resume.extendleft(reversed([self._resume_pages * sub.params.n for sub in nxt]))
