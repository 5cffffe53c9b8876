"""Environment calls off the engine's thread: the `env` config group and `EnvRunner`.

With `env.workers > 0` the rollout driver hands every environment call of a turn (`step`, and the
replay that rebuilds an environment) to a pool of worker threads and keeps stepping the engine for
the other requests; a finished call comes back through `collect()` on the driver's thread, which
alone touches trajectories, the tokenizer and the dispatcher. An `async def` method is awaited on an
event loop of its call's own (`resolve`), on the worker.

Timeouts: a call's clock starts when a worker picks it up. Past `timeout_s` the caller gets
`EnvTimeout` at once; the worker thread cannot be stopped (Python has no thread kill), so the runner
starts a replacement and the stuck thread retires when its call returns. Retries (`max_retries`,
after `backoff_s` x 2^k seconds) are the caller's: it resubmits on a fresh environment (a failed or
hung one is never reused, its state unknown). With `env.workers = 0` calls run inline, one at a
time, in a deterministic order (the default: runs reproduce bit for bit).
"""
from __future__ import annotations

import asyncio
import heapq
import inspect
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


class EnvTimeout(TimeoutError):
    """An environment call did not return within `env.timeout_s`."""


DROP_REASONS = ("too_long", "env_error", "timeout", "tokenizer", "bad_reward")
"""Why a trajectory was dropped; each is the iteration metric `dropped/<reason>`."""


class Dropped(Exception):
    """A fault that drops the trajectories it hit: `reason` (one of DROP_REASONS) and the error."""

    def __init__(self, reason: str, error: BaseException) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.reason, self.error = reason, error


def call_with_timeout(fn: Callable[[], object], timeout_s: float | None, what: str) -> object:
    """`fn()`, or EnvTimeout when it has not returned after `timeout_s` seconds (None: a plain call).
    The call runs on a daemon thread that is abandoned on timeout (Python cannot stop it; a daemon
    thread does not keep the process alive); whatever it raises is re-raised here."""
    if timeout_s is None:
        return resolve(fn())
    out: dict[str, object] = {}

    def target() -> None:
        try:
            out["value"] = resolve(fn())
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            out["error"] = err

    thread = threading.Thread(target=target, name=f"env-call {what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise EnvTimeout(f"{what} did not return within env.timeout_s={timeout_s:g}")
    if "error" in out:
        raise out["error"]
    return out["value"]


def resolve(value: object) -> object:
    """`value`, or what it resolves to when it is awaitable (an `async def` environment method),
    awaited on an event loop of this call's own (called on a thread without a running loop)."""
    if not inspect.isawaitable(value):
        return value

    async def wait() -> object:
        return await value

    return asyncio.run(wait())


FAILURE_POLICIES = ("drop", "score")


@dataclass(frozen=True, kw_only=True)
class EnvConfig:
    """How the rollout calls environments: the RL run's `env` group."""
    workers: int = 0
    """Threads running environment calls while the engine steps other requests; 0 = inline, one call at
    a time (deterministic: the default)."""
    timeout_s: float | None = 60.0
    """Seconds one call (reset, step, a replay) may take; past it the call fails as "timeout"; null = no limit."""
    max_retries: int = 0
    """A failed or timed-out call is retried this many times on a fresh environment (replayed to the turn)."""
    backoff_s: float = 0.5
    """Delay before the first retry; each further retry doubles it."""
    on_failure: str = "drop"
    """After the last retry: "drop" the trajectory (counted as dropped/<reason>) or "score" it: the episode
    ends with `failure_reward` and trains. A task's own `on_failure` / `failure_reward` attributes win."""
    failure_reward: float = 0.0
    """The reward of a trajectory ended by a failed call under on_failure=score."""

    def __post_init__(self) -> None:
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 0:
            raise ValueError(f"workers={self.workers!r}, expected an integer >= 0 (0 = inline calls)")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s!r}, expected a number > 0 or null")
        if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"max_retries={self.max_retries!r}, expected an integer >= 0")
        if not self.backoff_s >= 0:
            raise ValueError(f"backoff_s={self.backoff_s!r}, expected a number >= 0")
        if self.on_failure not in FAILURE_POLICIES:
            raise ValueError(f"on_failure={self.on_failure!r}, expected one of {', '.join(FAILURE_POLICIES)}")

    def retry_delay(self, attempt: int) -> float:
        """Seconds before attempt `attempt` (>= 1)."""
        return self.backoff_s * 2 ** (attempt - 1)


@dataclass(eq=False)  # identity: a call is tracked in sets
class _Call:
    key: object
    fn: Callable[[], object]
    not_before: float = 0.0
    started: float | None = None
    finished: bool = False


class EnvRunner:
    """A pool of `workers` daemon threads running submitted calls (see the module docstring).
    `submit(key, fn, delay_s)`; `collect()` -> [(key, value or the exception)] of the calls that
    ended (timed-out ones included, as EnvTimeout); `wait(timeout_s)` blocks until one may have;
    `pending` counts calls submitted and not yet collected. One thread submits and collects."""

    def __init__(self, workers: int, timeout_s: float | None) -> None:
        if workers < 1:
            raise ValueError(f"workers={workers}, expected >= 1")
        self.workers, self.timeout_s = workers, timeout_s
        self._cv = threading.Condition()
        self._queue: deque[_Call] = deque()
        self._delayed: list[tuple[float, int, _Call]] = []  # (not_before, order, call): retries waiting
        self._order = itertools.count()
        self._running: set[_Call] = set()
        self._ended: list[tuple[object, object]] = []
        self._threads = 0  # live worker threads (stuck ones included until they retire)
        self._stuck = 0  # threads whose call timed out and is still running
        self.pending = 0
        self.num_calls = self.num_timeouts = 0
        self.busy_seconds = 0.0
        """Summed wall time of the calls that ended (the work the engine did not wait for)."""
        self._closed = False

    # ---- the caller's side ---------------------------------------------------------------------------
    def submit(self, key: object, fn: Callable[[], object], delay_s: float = 0.0) -> None:
        call = _Call(key, fn, time.monotonic() + delay_s)
        self.pending += 1
        self.num_calls += 1
        with self._cv:
            if delay_s > 0:
                heapq.heappush(self._delayed, (call.not_before, next(self._order), call))
            else:
                self._queue.append(call)
            self._grow()
            self._cv.notify_all()

    def collect(self) -> list[tuple[object, object]]:
        """The calls that ended since the last collect, in the order they ended; a call past its
        timeout ends here as EnvTimeout (its thread is replaced)."""
        now = time.monotonic()
        with self._cv:
            self._release_delayed(now)
            if self.timeout_s is not None:
                for call in [c for c in self._running if not c.finished and now - c.started > self.timeout_s]:
                    self._running.discard(call)
                    call.finished = True
                    self._stuck += 1
                    self.num_timeouts += 1
                    self._ended.append((call.key, EnvTimeout(
                        f"the call did not return within env.timeout_s={self.timeout_s:g} s")))
                self._grow()
            ended, self._ended = self._ended, []
        self.pending -= len(ended)
        return ended

    def wait(self, timeout_s: float) -> None:
        """Block until a call ends, a timeout or a delayed retry falls due, or `timeout_s` passes."""
        with self._cv:
            if self._ended:
                return
            now = time.monotonic()
            due = [now + timeout_s]
            if self._delayed:
                due.append(self._delayed[0][0])
            if self.timeout_s is not None:
                due += [c.started + self.timeout_s for c in self._running if c.started is not None]
            self._cv.wait(max(0.0, min(due) - now) + 1e-3)

    def close(self) -> None:
        """Stop the workers (running calls are abandoned: daemon threads)."""
        with self._cv:
            self._closed = True
            self._queue.clear()
            self._delayed.clear()
            self._cv.notify_all()

    # ---- the workers ---------------------------------------------------------------------------------
    def _release_delayed(self, now: float) -> None:
        while self._delayed and self._delayed[0][0] <= now:
            self._queue.append(heapq.heappop(self._delayed)[2])
            self._cv.notify_all()

    def _grow(self) -> None:
        """Enough threads for `workers` calls at once besides the stuck ones (under the lock)."""
        while self._threads - self._stuck < self.workers and not self._closed:
            self._threads += 1
            threading.Thread(target=self._work, name=f"env-worker-{self._threads}", daemon=True).start()

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._release_delayed(time.monotonic())
                    if self._queue:
                        break
                    self._cv.wait(self._delayed[0][0] - time.monotonic() if self._delayed else None)
                if self._closed:
                    self._threads -= 1
                    return
                call = self._queue.popleft()
                call.started = time.monotonic()
                self._running.add(call)
                self._cv.notify_all()  # the caller's wait now has a deadline to watch
            try:
                value = call.fn()
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                value = err
            with self._cv:
                self.busy_seconds += time.monotonic() - call.started
                if not call.finished:  # else it timed out: its result is dropped
                    call.finished = True
                    self._running.discard(call)
                    self._ended.append((call.key, value))
                    self._cv.notify_all()
                else:
                    self._stuck -= 1
                    if self._threads - self._stuck > self.workers:  # a replacement took this one's place
                        self._threads -= 1
                        return
