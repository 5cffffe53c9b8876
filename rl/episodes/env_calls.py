"""The rollout driver's environment calls (a mixin of rl/episodes/driver.py's RolloutDriver).

A finished turn is scored inline, with retries (env.workers = 0), or handed to the worker pool
(rl/episodes/env_runner.py) while the engine keeps stepping the other requests; its result is applied on the
driver's thread when `EnvCalls.collect` (the dispatcher's Background) finds it ended. A group's first
prompt (its environment's reset) goes the same way. A call that fails for good (after
env.max_retries retries, each on a fresh environment replayed to the turn) drops its trajectory, or
with on_failure=score ends its episode with the failure reward. Worker jobs touch no driver state:
they read the trajectory (not modified while its call is out) and return what the driver applies.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from rl.episodes.env_runner import Dropped, EnvTimeout, resolve
from rl.envs.tasks.base import Environment, make_task
from rl.episodes.trajectory import Trajectory
from rollout.dispatcher import Submission


@dataclass
class EnvCalls:
    """The dispatcher's `Background` (rollout/dispatcher.py): the driver's environment calls on its
    worker pool; a collected call is applied on the driver's thread (`_step_done`, `_reset_done`)."""

    driver: "EnvCallMethods"
    """The RolloutDriver (rl/episodes/driver.py) whose calls these are."""

    @property
    def pending(self) -> int:
        return self.driver.runner.pending

    def wait(self, timeout_s: float) -> None:
        self.driver.runner.wait(timeout_s)

    def collect(self) -> list[Submission]:
        out: list[Submission] = []
        for key, value in self.driver.runner.collect():
            out += (self.driver._step_done if key[0] == "step" else self.driver._reset_done)(key, value)
        return out


class EnvCallMethods:
    """RolloutDriver's environment-call methods (they use its runner, envs, env_config and stats)."""

    # ---- inline (env.workers = 0) ----------------------------------------------------------------------
    def _end_turn(self, traj: Trajectory, stats: dict) -> bool:
        """Score the finished turn inline, retrying per the env group; True when another turn follows."""
        try:
            answer = self._answer(traj)
        except Dropped as fault:
            self._drop([traj], fault, stats)
            return False
        for attempt in range(self.env_config.max_retries + 1):
            if attempt:  # a fresh environment, replayed to this turn: the failed one's state is unknown
                time.sleep(self.env_config.retry_delay(attempt))
                self.envs.pop(traj.traj_id, None)
                stats["env_retries"] += 1
            try:
                env = self._env(traj)
                result = self._env_call("step", env.step, answer)
                break
            except Dropped as fault:
                stats["env_timeouts"] += fault.reason == "timeout"
                failure = fault
        else:
            self._fail(traj, failure, stats)
            return False
        return self._apply(traj, answer, env, result, stats)

    def _fail(self, traj: Trajectory, fault: Dropped, stats: dict) -> None:
        """An environment call failed for good: drop the trajectory, or under on_failure=score end its
        episode with failure_reward (it trains; one logged line either way)."""
        if self.on_failure == "drop" or fault.reason not in ("timeout", "env_error"):
            self._drop([traj], fault, stats)
            return
        self.errors.append(f"trajectory {traj.traj_id} (group {traj.group_id}, turn {len(traj.answers) + 1}): "
                           f"{fault} (scored {self.failure_reward:g}: on_failure=score)")
        stats["env_failures_scored"] += 1
        self.envs.pop(traj.traj_id, None)
        traj.answers.append("")
        traj.reward += self.failure_reward
        self._finish(traj, stats)

    def _reset_call(self, env: Environment, group: int, row_index: int | None) -> Callable[[], object]:
        """env.reset for group `group` as a call, with the data row when the task takes one."""
        if self.pass_row and row_index is not None:
            return lambda: env.reset(self._episode_seed(group), row=self.rows[row_index])
        return lambda: env.reset(self._episode_seed(group))

    # ---- on the worker pool (env.workers > 0) ----------------------------------------------------------
    def _submit_step(self, traj: Trajectory, stats: dict, attempt: int = 0, answer: str | None = None) -> None:
        """Hand the turn's step to a worker (after the retry delay for attempt > 0); its end comes
        back through `EnvCalls.collect` -> `_step_done`."""
        if answer is None:
            try:
                answer = self._answer(traj)
            except Dropped as fault:
                self._drop([traj], fault, stats)
                return
        env = None if attempt else self.envs.get(traj.traj_id)  # a failed one is never reused
        delay = self.env_config.retry_delay(attempt) if attempt else 0.0
        self.runner.submit(("step", traj, answer, attempt, stats), lambda: self._step_job(traj, answer, env), delay)

    def _step_job(self, traj: Trajectory, answer: str, env: Environment | None) -> tuple[Environment, object]:
        """On a worker: the trajectory's environment (built and replayed to this turn when missing)
        and its step."""
        if env is None:
            env = make_task(self.task_name, **self.task_params)
            resolve(self._reset_call(env, traj.group_id, traj.row_index)())
            for previous in traj.answers:
                resolve(env.step(previous))
        return env, resolve(env.step(answer))

    def _step_done(self, key: tuple, value: object) -> list[Submission]:
        """On the driver's thread: a step call ended; its trajectory's next request, if any."""
        _, traj, answer, attempt, stats = key
        if isinstance(value, BaseException):
            fault = Dropped("timeout" if isinstance(value, EnvTimeout) else "env_error", value)
            stats["env_timeouts"] += fault.reason == "timeout"
            self.envs.pop(traj.traj_id, None)
            if attempt < self.env_config.max_retries:
                stats["env_retries"] += 1
                self._submit_step(traj, stats, attempt + 1, answer)
            else:
                self._fail(traj, fault, stats)
            return []
        env, result = value
        self.envs[traj.traj_id] = env
        return self._admissible([traj], stats) if self._apply(traj, answer, env, result, stats) else []

    def _reset_job(self, group: int, row_index: int | None) -> object:
        """On a worker: the group's first prompt (a fresh environment's reset)."""
        return resolve(self._reset_call(make_task(self.task_name, **self.task_params), group, row_index)())

    def _reset_done(self, key: tuple, value: object) -> list[Submission]:
        """On the driver's thread: a group's reset ended; its first request (retried per env group)."""
        _, trajs, attempt, stats = key
        if isinstance(value, BaseException):
            fault = Dropped("timeout" if isinstance(value, EnvTimeout) else "env_error", value)
            stats["env_timeouts"] += fault.reason == "timeout"
            if attempt < self.env_config.max_retries:
                stats["env_retries"] += 1
                group, row_index = trajs[0].group_id, trajs[0].row_index
                self.runner.submit(("reset", trajs, attempt + 1, stats), lambda: self._reset_job(group, row_index),
                                   self.env_config.retry_delay(attempt + 1))
            else:
                self._drop(trajs, fault, stats)  # no prompt, no group: never scored
            return []
        return self._first_request(trajs, value, stats)
