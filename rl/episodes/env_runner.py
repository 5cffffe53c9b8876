"""Environment calls off the engine's thread: the `env` config group and `EnvRunner`.

With `env.workers > 0` the rollout driver hands every environment call of a turn (`step`, and the
replay that rebuilds an environment) to a pool of worker threads and keeps stepping the engine for
the other requests; a finished call comes back through `collect()` on the driver's thread, which
alone touches trajectories, the tokenizer and the dispatcher. An `async def` method is awaited on an
event loop of its call's own (`resolve`), on the worker.

Timeouts: a call's clock starts when it starts running. Past `timeout_s` the caller gets `EnvTimeout` at
once, and the call is ENDED: `EnvCallAbandoned` (a BaseException, so `except Exception` in the call does
not keep it) is raised in its thread at its next Python instruction, again every 0.1 s until it returns,
so a reward stuck in `while True` stops burning a core. Code blocked inside one C call (a `time.sleep(3600)`,
a socket read without timeout) cannot be interrupted in-process: it is counted (`num_stuck`, the metric
`env_stuck_calls`) and bounded (at most `workers` of them; past that, new calls fail at once as
EnvTimeout naming why) and ends when its C call returns. Code that must be stopped without fail belongs
in the sandbox (rl/envs/tools/sandbox.py), whose calls are processes. Retries (`max_retries`, after
`backoff_s` x 2^k seconds) are the caller's: it resubmits on a fresh environment (a failed or hung one
is never reused, its state unknown). With `env.workers = 0` calls run inline, one at a time, in a
deterministic order (the default: runs reproduce bit for bit).

Tool latency (`env.tool_latency_*`, rl/envs/tools/latency.py): a call may be submitted with a hold; its
result then reaches `collect` only that many seconds after the call returned. The hold occupies no
worker (the result waits in a heap ordered by its ready time, which `wait` watches) and is not under
`timeout_s` (the call itself returned); a call that raised is not held, so its retry starts at once.
"""
from __future__ import annotations

import asyncio
import ctypes
import heapq
import inspect
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from rl.envs.tools.latency import ToolLatency


class EnvTimeout(TimeoutError):
    """An environment call did not return within `env.timeout_s`."""


class EnvCallAbandoned(BaseException):
    """Raised inside an environment call that timed out, to end it (module docstring)."""


LOG = logging.getLogger(__name__)
INTERRUPT_EVERY_S = 0.1  # how often a timed-out call still running is interrupted again
GRACE_S = 1.0  # how long an inline call's timeout waits for the interrupted call to end
_STRAGGLERS: list[threading.Thread] = []  # inline calls that timed out and could not be ended (blocked in C)


def interrupt(thread: threading.Thread) -> bool:
    """Raise EnvCallAbandoned in `thread` at its next Python instruction; False when it is not running."""
    if not thread.is_alive() or thread.ident is None:
        return False
    return ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                      ctypes.py_object(EnvCallAbandoned)) == 1


DROP_REASONS = ("too_long", "env_error", "timeout", "tokenizer", "bad_reward")
"""Why a trajectory was dropped; each is the iteration metric `dropped/<reason>`."""


class Dropped(Exception):
    """A fault that drops the trajectories it hit: `reason` (one of DROP_REASONS) and the error."""

    def __init__(self, reason: str, error: BaseException) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.reason, self.error = reason, error


def call_with_timeout(fn: Callable[[], object], timeout_s: float | None, what: str) -> object:
    """`fn()`, or EnvTimeout when it has not returned after `timeout_s` seconds (None: a plain call).
    The call runs on a daemon thread; on timeout it is interrupted until it ends (up to GRACE_S; one
    blocked in C is left to end on its own, counted, and at most 8 such are allowed before every timed call
    fails at once); whatever it raises is re-raised here."""
    if timeout_s is None:
        return resolve(fn())
    _STRAGGLERS[:] = [t for t in _STRAGGLERS if t.is_alive()]
    if len(_STRAGGLERS) >= 8:
        raise EnvTimeout(f"{what} not started: {len(_STRAGGLERS)} earlier calls timed out blocked in code Python "
                         f"cannot interrupt (a C call such as a sleep or a socket read) and are still running")
    out: dict[str, object] = {}

    def target() -> None:
        try:
            try:
                out["value"] = resolve(fn())
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                out["error"] = err
        except EnvCallAbandoned:  # a late interrupt, after the call had ended
            pass

    thread = threading.Thread(target=target, name=f"env-call {what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        end = time.monotonic() + GRACE_S
        while thread.is_alive() and time.monotonic() < end:
            interrupt(thread)
            thread.join(INTERRUPT_EVERY_S)
        if thread.is_alive():
            _STRAGGLERS.append(thread)
            LOG.warning("%s timed out and could not be interrupted (blocked outside Python); %d such calls "
                        "still running", what, len(_STRAGGLERS))
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
    tool_latency_median_s: float = 0.0
    """Median of a simulated log-normal latency added to each step's result (a real tool's seconds); 0 = none.
    Needs workers > 0: the result is held without holding a worker, while the engine steps the others."""
    tool_latency_sigma: float = 1.0
    """Log-space standard deviation of that latency: 1.0 puts the 99th percentile near 10x the median."""
    tool_latency_max_s: float | None = None
    """A cap on each simulated latency in seconds; null = uncapped."""

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
        try:
            latency = self.tool_latency
        except ValueError as err:  # ToolLatency names its field; here the knob is tool_latency_<field>
            raise ValueError(f"tool_latency_{err}") from None
        if latency.enabled and self.workers == 0:
            raise ValueError(f"tool_latency_median_s={self.tool_latency_median_s!r} needs env.workers > 0: inline "
                             f"calls (workers=0) would stall the engine for every tool's latency")

    @property
    def tool_latency(self) -> ToolLatency:
        """The simulated tool latency of step calls (rl/envs/tools/latency.py)."""
        return ToolLatency(median_s=self.tool_latency_median_s, sigma=self.tool_latency_sigma,
                           max_s=self.tool_latency_max_s)

    def retry_delay(self, attempt: int) -> float:
        """Seconds before attempt `attempt` (>= 1)."""
        return self.backoff_s * 2 ** (attempt - 1)


@dataclass(eq=False)  # identity: a call is tracked in sets
class _Call:
    key: object
    fn: Callable[[], object]
    not_before: float = 0.0
    hold_s: float = 0.0  # its result reaches collect this long after it returned (a tool's latency)
    ready_at: float | None = None  # when its outcome is (or was) collectable, once known
    started: float | None = None
    finished: bool = False  # its result (or its EnvTimeout) is the caller's
    thread: threading.Thread | None = None
    returned: bool = False  # its thread is done with it
    interrupted_at: float = 0.0
    abandoned_at: float = 0.0  # when it timed out

    def stuck(self, now: float) -> bool:
        """Timed out more than GRACE_S ago, interrupted since, still running: blocked outside Python."""
        return self.abandoned_at > 0 and now - self.abandoned_at > GRACE_S and self.thread.is_alive()


class EnvRunner:
    """A pool of `workers` daemon threads running submitted calls (see the module docstring).
    `submit(key, fn, delay_s, hold_s)`; `collect()` -> [(key, value or the exception)] of the calls that
    ended (timed-out ones included, as EnvTimeout; a held result once its hold passed); `wait(timeout_s)`
    blocks until one may have; `pending` counts calls submitted and not yet collected (held results
    included). One thread submits and collects."""

    def __init__(self, workers: int, timeout_s: float | None) -> None:
        if workers < 1:
            raise ValueError(f"workers={workers}, expected >= 1")
        self.workers, self.timeout_s = workers, timeout_s
        self._lock = threading.Lock()  # entered in C: a late interrupt cannot land between acquire and `with`
        self._cv = threading.Condition(self._lock)
        self._queue: deque[_Call] = deque()
        self._delayed: list[tuple[float, int, _Call]] = []  # (not_before, order, call): retries waiting
        self._order = itertools.count()
        self._running: set[_Call] = set()
        self._abandoned: set[_Call] = set()  # timed out, still running: interrupted until they return
        self._ended: list[tuple[object, object]] = []
        self._held: list[tuple[float, int, _Call, object]] = []  # (ready_at, order, call, value): results on hold
        self._threads = 0  # live worker threads (those of abandoned calls included until they return)
        self.pending = 0
        self.num_calls = self.num_timeouts = 0
        self.busy_seconds = 0.0
        """Summed wall time of the calls that ended (the work the engine did not wait for)."""
        self._closed = False

    @property
    def num_stuck(self) -> int:
        """Calls that timed out, were interrupted, and still run past the grace: blocked outside Python."""
        now = time.monotonic()
        with self._cv:
            return sum(1 for c in self._abandoned if c.stuck(now))

    # ---- the caller's side ---------------------------------------------------------------------------
    def submit(self, key: object, fn: Callable[[], object], delay_s: float = 0.0, hold_s: float = 0.0) -> _Call:
        """Run `fn()` on a worker, starting no sooner than `delay_s` from now (a retry's backoff); a value it
        returns is collectable `hold_s` seconds after it returned (an exception at once). Returns the
        call's handle, for `expected_ready`."""
        call = _Call(key, fn, time.monotonic() + delay_s, hold_s)
        self.pending += 1
        self.num_calls += 1
        with self._cv:
            if delay_s > 0:
                heapq.heappush(self._delayed, (call.not_before, next(self._order), call))
            else:
                self._queue.append(call)
            self._fail_behind_stuck()
            self._grow()
            self._cv.notify_all()
        return call

    def expected_ready(self, call: _Call) -> float:
        """The time.monotonic() at which the call's outcome is collectable: exact once it returned (its
        hold included) or timed out; while it is queued or running, the soonest it can be (its start or
        now, whichever is later, plus its hold). A handle keeps its time after its outcome was collected."""
        with self._cv:
            if call.ready_at is not None:
                return call.ready_at
            return max(time.monotonic(), call.not_before) + call.hold_s

    def collect(self) -> list[tuple[object, object]]:
        """The calls that ended since the last collect, in the order they ended (a held result when its
        hold passed); a call past its timeout ends here as EnvTimeout (and is interrupted until it
        returns; its thread is replaced)."""
        now = time.monotonic()
        with self._cv:
            self._release_delayed(now)
            while self._held and self._held[0][0] <= now:
                _, _, call, value = heapq.heappop(self._held)
                self._ended.append((call.key, value))
            if self.timeout_s is not None:
                for call in [c for c in self._running if now - c.started > self.timeout_s]:
                    self._running.discard(call)
                    self._abandoned.add(call)
                    call.finished, call.abandoned_at, call.ready_at = True, now, now
                    self.num_timeouts += 1
                    self._ended.append((call.key, EnvTimeout(
                        f"the call did not return within env.timeout_s={self.timeout_s:g} s")))
            self._interrupt_abandoned(now)
            self._fail_behind_stuck()
            self._grow()
            ended, self._ended = self._ended, []
        self.pending -= len(ended)
        return ended

    def wait(self, timeout_s: float) -> None:
        """Block until a call ends, a timeout, a delayed retry or a held result falls due, or `timeout_s` passes."""
        with self._cv:
            if self._ended:
                return
            now = time.monotonic()
            due = [now + timeout_s]
            if self._delayed:
                due.append(self._delayed[0][0])
            if self._held:
                due.append(self._held[0][0])
            if self.timeout_s is not None:
                due += [c.started + self.timeout_s for c in self._running if c.started is not None]
            if self._abandoned:
                due.append(now + INTERRUPT_EVERY_S)
            self._cv.wait(max(0.0, min(due) - now) + 1e-3)

    def close(self) -> None:
        """Stop the workers; running calls are interrupted (their results are not collected)."""
        with self._cv:
            self._closed = True
            self._queue.clear()
            self._delayed.clear()
            self._held.clear()
            for call in self._running:
                call.finished, call.abandoned_at = True, time.monotonic()
            self._abandoned |= self._running
            self._running.clear()
            self._interrupt_abandoned(time.monotonic() + INTERRUPT_EVERY_S)
            self._cv.notify_all()

    # ---- the workers (under the lock unless said) -----------------------------------------------------
    def _release_delayed(self, now: float) -> None:
        while self._delayed and self._delayed[0][0] <= now:
            self._queue.append(heapq.heappop(self._delayed)[2])
            self._cv.notify_all()

    def _fail_behind_stuck(self) -> None:
        """With `workers` calls stuck in C past their timeout, fail the queued calls at once instead of
        letting them wait behind the stuck ones."""
        now = time.monotonic()
        stuck = sum(1 for c in self._abandoned if c.stuck(now))
        if stuck < self.workers or not self._queue:
            return
        LOG.warning("%d environment calls timed out blocked in code Python cannot interrupt; failing %d queued "
                    "calls", stuck, len(self._queue))
        while self._queue:
            call = self._queue.popleft()
            call.ready_at = now
            self._ended.append((call.key, EnvTimeout(
                f"not started: {stuck} earlier calls timed out blocked in code Python cannot interrupt (a C call "
                f"such as a sleep or a socket read) and are still running")))
        self._cv.notify_all()

    def _wanted(self) -> int:
        """Threads wanted: `workers` free for calls, plus one per abandoned call still on its thread (at
        most `workers` of those: the pool never exceeds twice its size)."""
        return self.workers + min(self.workers, sum(1 for c in self._abandoned if not c.returned))

    def _grow(self) -> None:
        while self._threads < self._wanted() and not self._closed:
            self._threads += 1
            threading.Thread(target=self._work, name=f"env-worker-{self._threads}", daemon=True).start()

    def _interrupt_abandoned(self, now: float) -> None:
        for call in list(self._abandoned):
            if call.returned:
                self._abandoned.discard(call)
            elif now - call.interrupted_at >= INTERRUPT_EVERY_S:
                call.interrupted_at = now
                interrupt(call.thread)

    def _next(self) -> _Call | None:
        """The next queued call, taken (blocks); None when this thread is to end."""
        with self._cv:
            while not self._queue and not self._closed:
                self._release_delayed(time.monotonic())
                if self._queue:
                    break
                self._cv.wait(self._delayed[0][0] - time.monotonic() if self._delayed else None)
            if self._closed:
                self._threads -= 1
                return None
            call = self._queue.popleft()
            call.started, call.thread = time.monotonic(), threading.current_thread()
            self._running.add(call)
            self._cv.notify_all()  # the caller's wait now has a deadline to watch
            return call

    def _work(self) -> None:
        """A worker thread (not under the lock). An interrupt meant for a timed-out call may land just after
        the call returned: the loop then redoes the call's bookkeeping, which is idempotent."""
        current, value, done = None, None, True
        while True:
            try:
                if not done:
                    if not self._returned(current, value):
                        return
                    done = True
                current = self._next()
                if current is None:
                    return
                done, value = False, None
                try:
                    value = current.fn()
                except BaseException as err:  # noqa: BLE001 - handed to the caller
                    value = err
            except EnvCallAbandoned:
                continue

    def _returned(self, call: _Call, value: object) -> bool:
        """Book a call's end; False when this thread is to retire (a replacement took its place)."""
        with self._lock:
            if not call.returned:
                call.returned = True
                self._abandoned.discard(call)
                self.busy_seconds += time.monotonic() - call.started
                if not call.finished:  # else it timed out: its result is dropped
                    call.finished, call.ready_at = True, time.monotonic()
                    self._running.discard(call)
                    if call.hold_s > 0 and not isinstance(value, BaseException):
                        call.ready_at += call.hold_s  # held off any worker; collect releases it when due
                        heapq.heappush(self._held, (call.ready_at, next(self._order), call, value))
                    else:
                        self._ended.append((call.key, value))
                self._cv.notify_all()
            if self._threads > self._wanted() or self._closed:
                self._threads -= 1
                return False
            return True
