"""The rollout driver's environment calls: `EnvCalls`, a component the driver (rl/episodes/driver.py) owns.

It holds the trajectories' environments (one per trajectory, built by the task's factory, reset to
its group's episode seed and data row, and rebuilt by replaying the finished turns when missing:
after a resume, or a failed call) and makes every call to them, under `env.timeout_s`. A turn's
step runs inline, with retries (env.workers = 0), or on the worker pool (rl/episodes/env_runner.py)
while the engine keeps stepping the other requests; a group's first prompt (a reset) goes the same
way. A retry (up to env.max_retries, after the env group's backoff) runs on a fresh environment
replayed to the turn: a failed one's state is unknown, so it is never reused. What the calls end
with goes back to the driver, which alone touches trajectories, the tokenizer and the dispatcher:
inline calls return their result or raise `Dropped`; pool calls come back from `collect` as
`CallEnded`, once their retries are spent. Worker jobs touch no state of the driver's or of this
object's: they read the trajectory (not modified while its call is out) and return what the
driver applies.
Tool latency (env.tool_latency_*, rl/envs/tools/latency.py): a step call on the pool is submitted with
the latency drawn for its trajectory (episode seed, member, turn), and its result comes back that long
after the step returned, so the conversation waits on its tool while the engine decodes the others;
resets and replays are not delayed, a retry draws the same latency (only the result that ends the call
is held). `expected_ready(traj_id)` says when a held step result is due.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from rl.envs.tasks.base import Environment, make_task, resolve_task
from rl.episodes.env_runner import Dropped, EnvConfig, EnvRunner, EnvTimeout, call_with_timeout, resolve
from rl.episodes.runner import mix_seed
from rl.episodes.trajectory import Trajectory


@dataclass(frozen=True, eq=False)
class CallEnded:
    """A call on the worker pool: submitted with what it is for; `collect` hands it back once it
    ended for good (it returned, or its last retry failed), with `value` or `fault` set."""
    kind: str
    """"reset" (a group's first prompt) or "step" (a turn's answer scored)."""
    trajs: list[Trajectory]
    """The group (reset) or the one trajectory (step) the call is for."""
    stats: dict
    """The iteration's counters its retries and timeouts are counted in."""
    answer: str = ""
    """The answer stepped on (step)."""
    attempt: int = 0
    value: object = None
    """What the call returned: the prompt (reset) or the StepResult (step); None after a fault."""
    fault: Dropped | None = None
    """Why the call failed after its retries ("timeout" or "env_error"); None when it returned."""
    env: Environment | None = None
    """The environment that stepped, now at the next turn (step, when it returned)."""
    latency_s: float = 0.0
    """The simulated tool latency its result is held for (step, env.tool_latency_*); 0 = none."""


class EnvCalls:
    """The environments of one driver's trajectories and its calls to them (module docstring).
    `stats` arguments are the iteration's counters: env_retries and env_timeouts are counted there, and
    tool_calls_delayed / tool_wait_seconds (the simulated latencies its step results were held for)."""

    def __init__(self, task_name: str, task_params: dict, config: EnvConfig, *, seed: int,
                 rows=None, pass_row: bool = False) -> None:
        """`seed`: the run's; group g's episode is `reset(mix_seed(seed, g))`, with `row=rows[i]` for
        the group's data row i when `pass_row`."""
        self.task_name, self.task_params, self.config = task_name, task_params, config
        self.seed, self.rows, self.pass_row = seed, rows, pass_row
        self.pool = EnvRunner(config.workers, config.timeout_s) if config.workers else None
        """The worker pool (env.workers > 0), else None: every call runs inline."""
        self.envs: dict[str, Environment] = {}
        """Trajectory id -> its environment, at the trajectory's current turn."""
        self.latency = config.tool_latency
        """The simulated tool latency of pool step calls (none unless env.tool_latency_median_s > 0)."""
        self._steps_out: dict[str, object] = {}
        """Trajectory id -> the pool's handle of its step call out (submitted, not yet ended for good)."""

    # ---- the environments ------------------------------------------------------------------------------
    def guarded(self, what: str, fn: Callable, *args) -> object:
        """`fn(*args)`, an environment call under env.timeout_s; raises Dropped("timeout" or "env_error")."""
        try:
            return call_with_timeout(lambda: fn(*args), self.config.timeout_s, what)
        except EnvTimeout as err:
            raise Dropped("timeout", err) from err
        except Exception as err:  # noqa: BLE001 - a broken environment must not stop the run
            raise Dropped("env_error", err) from err

    def episode_seed(self, group: int) -> int:
        """The seed of global group `group`'s episode (the same on every rank)."""
        return mix_seed(self.seed, group)

    def _reset_call(self, env: Environment, group: int, row_index: int | None) -> Callable[[], object]:
        """env.reset for group `group` as a call, with the data row when the task takes one."""
        if self.pass_row and row_index is not None:
            return lambda: env.reset(self.episode_seed(group), row=self.rows[row_index])
        return lambda: env.reset(self.episode_seed(group))

    def _new_env(self) -> Environment:
        return self.guarded("task factory", lambda: make_task(self.task_name, **self.task_params))

    def first_prompt(self, group: int, row_index: int | None) -> object:
        """Group `group`'s first prompt: a fresh environment's reset (inline). Raises Dropped."""
        return self.guarded("reset", self._reset_call(self._new_env(), group, row_index))

    def env(self, traj: Trajectory) -> Environment:
        """The trajectory's environment, rebuilt by replaying its finished turns when missing (resume).
        Raises Dropped."""
        env = self.envs.get(traj.traj_id)
        if env is None:
            env = self._new_env()
            self.guarded("reset", self._reset_call(env, traj.group_id, traj.row_index))
            for answer in traj.answers:
                self.guarded("step (replay)", env.step, answer)
            self.envs[traj.traj_id] = env
        return env

    def forget(self, traj_id: str) -> None:
        """The trajectory's environment is not used again (its episode ended, or it was dropped)."""
        self.envs.pop(traj_id, None)

    # ---- inline (env.workers = 0) ----------------------------------------------------------------------
    def step(self, traj: Trajectory, answer: str, stats: dict) -> tuple[Environment, object]:
        """Step the trajectory's environment on `answer`, retrying per the env group: (the environment,
        the step's result). Raises the last Dropped when every attempt failed."""
        for attempt in range(self.config.max_retries + 1):
            if attempt:  # a fresh environment, replayed to this turn: the failed one's state is unknown
                time.sleep(self.config.retry_delay(attempt))
                self.forget(traj.traj_id)
                stats["env_retries"] += 1
            try:
                env = self.env(traj)
                return env, self.guarded("step", env.step, answer)
            except Dropped as fault:
                stats["env_timeouts"] += fault.reason == "timeout"
                failure = fault
        raise failure

    def steps(self, trajs: list[Trajectory], answers: list[str], stats: dict) -> list[tuple[Environment, object] | Dropped]:
        """Each trajectory stepped on its answer (`step`): (environment, result) or the Dropped it
        ended with, in order. A task whose class defines `step_many(envs, answers) -> results` (the
        scored task, for rewards that take a batch or are async) is stepped in one call for all of
        them, under one env.timeout_s; when that call fails, each is stepped on its own on a fresh
        environment (a failed one's state is unknown), with its retries."""
        many = getattr(resolve_task(self.task_name), "step_many", None)
        if many is not None and len(trajs) > 1:
            try:
                envs = [self.env(t) for t in trajs]
                results = self.guarded("step", many, envs, answers)
                if isinstance(results, (list, tuple)) and len(results) == len(envs):
                    return list(zip(envs, results))
            except Dropped:
                pass
            for t in trajs:
                self.forget(t.traj_id)
        out: list[tuple[Environment, object] | Dropped] = []
        for traj, answer in zip(trajs, answers):
            try:
                out.append(self.step(traj, answer, stats))
            except Dropped as fault:
                out.append(fault)
        return out

    # ---- on the worker pool (env.workers > 0) ----------------------------------------------------------
    @property
    def pending(self) -> int:
        """Pool calls out (submitted, not yet collected)."""
        return self.pool.pending

    def wait(self, timeout_s: float) -> None:
        """Block until a pool call may have ended (a held step result's ready time included), or `timeout_s`."""
        self.pool.wait(timeout_s)

    def expected_ready(self, traj_id: str) -> float | None:
        """The time.monotonic() at which the trajectory's step result is collectable: exact once its step
        returned and is held for its tool latency; while the step is queued or running, the soonest it can
        be (now or its retry's start, plus its latency); None when no step call of it is out. For ordering
        waiting conversations (the soonest to resume first); a bound, not a promise, before the step returned."""
        call = self._steps_out.get(traj_id)
        return None if call is None else self.pool.expected_ready(call)

    def step_latency(self, traj: Trajectory) -> float:
        """The simulated latency of the tool call ending the trajectory's current turn (0 without one)."""
        return self.latency.draw(self.episode_seed(traj.group_id), len(traj.answers), traj.member)

    def submit_reset(self, trajs: list[Trajectory], stats: dict, attempt: int = 0) -> None:
        """Hand the group's reset to a worker (after the retry delay for attempt > 0); it comes back
        from `collect`."""
        group, row_index = trajs[0].group_id, trajs[0].row_index
        delay = self.config.retry_delay(attempt) if attempt else 0.0
        self.pool.submit(CallEnded("reset", trajs, stats, attempt=attempt), lambda: self._reset_job(group, row_index),
                         delay)

    def submit_step(self, traj: Trajectory, answer: str, stats: dict, attempt: int = 0) -> None:
        """Hand the turn's step to a worker (after the retry delay for attempt > 0); it comes back
        from `collect`."""
        env = None if attempt else self.envs.get(traj.traj_id)  # a failed one is never reused
        delay = self.config.retry_delay(attempt) if attempt else 0.0
        latency = self.step_latency(traj)
        key = CallEnded("step", [traj], stats, answer, attempt, latency_s=latency)
        self._steps_out[traj.traj_id] = self.pool.submit(key, lambda: self._step_job(traj, answer, env), delay, latency)

    def _reset_job(self, group: int, row_index: int | None) -> object:
        """On a worker: the group's first prompt (a fresh environment's reset)."""
        return resolve(self._reset_call(make_task(self.task_name, **self.task_params), group, row_index)())

    def _step_job(self, traj: Trajectory, answer: str, env: Environment | None) -> tuple[Environment, object]:
        """On a worker: the trajectory's environment (built and replayed to this turn when missing)
        and its step."""
        if env is None:
            env = make_task(self.task_name, **self.task_params)
            resolve(self._reset_call(env, traj.group_id, traj.row_index)())
            for previous in traj.answers:
                resolve(env.step(previous))
        return env, resolve(env.step(answer))

    def collect(self) -> list[CallEnded]:
        """The pool calls that ended for good since the last collect, in the order they ended; a
        failed one with retries left is resubmitted instead. Never blocks."""
        out: list[CallEnded] = []
        for call, value in self.pool.collect():
            if not isinstance(value, BaseException):
                env, value = value if call.kind == "step" else (None, value)
                if env is not None:
                    self.envs[call.trajs[0].traj_id] = env
                    self._steps_out.pop(call.trajs[0].traj_id, None)
                    if call.latency_s > 0:
                        call.stats["tool_calls_delayed"] += 1
                        call.stats["tool_wait_seconds"] += call.latency_s
                out.append(replace(call, value=value, env=env))
                continue
            fault = Dropped("timeout" if isinstance(value, EnvTimeout) else "env_error", value)
            call.stats["env_timeouts"] += fault.reason == "timeout"
            if call.kind == "step":
                self.forget(call.trajs[0].traj_id)
            if call.attempt < self.config.max_retries:
                call.stats["env_retries"] += 1
                if call.kind == "step":
                    self.submit_step(call.trajs[0], call.answer, call.stats, call.attempt + 1)
                else:
                    self.submit_reset(call.trajs, call.stats, call.attempt + 1)
            else:
                if call.kind == "step":
                    self._steps_out.pop(call.trajs[0].traj_id, None)
                out.append(replace(call, fault=fault))
        return out
