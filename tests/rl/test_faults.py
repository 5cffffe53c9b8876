"""Faults inside an iteration cost trajectories, not the run: real short RL runs of the tiny model
with a test task that fails on purpose (an exception, a hang, a non-finite reward, text the
tokenizer cannot encode), the circuit breaker that stops a run whose faults are the norm, and the
kill hook that only a test flag arms."""
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import ClassVar

import pytest

from rl.run.loop import RunBroken
from rl.run.ranks import merge_metrics
from rl.episodes.env_runner import DROP_REASONS
from rl.envs.tasks.base import TASKS, StepResult, register_task
from rl.train import run
from tests.rl.test_config import composed
from tests.rl.test_train_run import ROOT, SMALL

LONE_SURROGATE = "\ud800"
"""A str no UTF-8 tokenizer can encode (ByteTokenizer.encode raises UnicodeEncodeError)."""


@dataclass
class Faulty:
    """Majority-digit-like single-turn task ("1" is right) that faults on its `at_call`-th call of
    `reset` (modes reset_*) or `step` (the others), counted over the process (tests reset `calls`);
    "*_all" modes fault on every call. Group starts call `reset` first, in group order, before any
    step, so reset call k is group k-1's prompt."""
    mode: str = "none"
    at_call: int = 1
    length: int = 3
    """Accepted for the majority_digit task group's params; unused."""
    max_turns: int = 2
    calls: ClassVar[dict[str, int]] = {"reset": 0, "step": 0}
    release: ClassVar[threading.Event] = threading.Event()
    """Set by the tests to let a hung `step` return (its thread was abandoned long before)."""

    def _hit(self, kind: str) -> bool:
        Faulty.calls[kind] += 1
        return self.mode.endswith("_all") or Faulty.calls[kind] == self.at_call

    def reset(self, seed: int) -> str:
        if self.mode.startswith("reset_") and self._hit("reset"):
            if self.mode == "reset_bad_prompt":
                return LONE_SURROGATE + "="
            raise RuntimeError("episode server down")
        return "1231="

    def step(self, answer: str) -> StepResult:
        reward = float(answer[:1] == "1")
        if self.mode.startswith("reset_") or not self._hit("step"):
            return StepResult("", reward, True)
        if self.mode in ("raise", "raise_all"):
            raise RuntimeError("tool server exploded")
        if self.mode == "hang":
            Faulty.release.wait(120)
        if self.mode == "bad_reward":
            return StepResult("", float("nan"), True)
        if self.mode == "bad_obs":
            return StepResult(LONE_SURROGATE + ";", 0.0, False)  # a second turn whose tool reply fails to encode
        return StepResult("", reward, True)


if "test_faulty" not in TASKS:
    register_task("test_faulty")(Faulty)


@pytest.fixture
def faulty():
    Faulty.calls.update(reset=0, step=0)
    Faulty.release.clear()
    yield
    Faulty.release.set()


def faulty_run(tmp_path, mode: str, *extra: str, at_call: int = 3, iterations: int = 1):
    return run(composed(f"run_dir={tmp_path}", f"experiment.iterations={iterations}", *SMALL,
                        "task.name=test_faulty", f"+task.params.mode={mode}", f"+task.params.at_call={at_call}",
                        *extra))


@pytest.mark.parametrize("mode, reason, num_dropped", [
    ("raise", "env_error", 1),  # step raises for one trajectory
    ("bad_reward", "bad_reward", 1),  # step returns a NaN reward
    ("bad_obs", "tokenizer", 1),  # the tool reply cannot be encoded
    ("reset_raise", "env_error", 4),  # a group's reset raises: the whole group, before its first request
    ("reset_bad_prompt", "tokenizer", 4),  # a group's prompt cannot be encoded: the whole group
])
def test_a_fault_drops_only_its_trajectory_or_its_group_and_the_run_completes(tmp_path, capsys, faulty, mode,
                                                                              reason, num_dropped):
    (h,) = faulty_run(tmp_path, mode)
    assert h[f"dropped/{reason}"] == num_dropped and h["trajectories_dropped"] == num_dropped
    assert all(h[f"dropped/{r}"] == 0 for r in DROP_REASONS if r != reason)
    # 4 groups of 4: the others are trained (a group that lost one member trains its 3 others)
    assert h["train_sequences"] == 16 - num_dropped and h["groups_trained"] == (3 if num_dropped == 4 else 4)
    assert h["trajectories_finished"] == 16 - num_dropped and h["reward_mean"] == h["reward_mean"]
    lines = [" ".join(line.split()) for line in capsys.readouterr().out.split("dropped ")[1:]]
    assert len(lines) == 1 and f"(reason: {reason})" in lines[0], lines  # one line per drop event
    assert lines[0].startswith("group 2 (4 trajectories)" if num_dropped == 4 else "trajectory "), lines
    drops = {k: v for k, v in h.items() if k.startswith("dropped/") or k == "trajectories_dropped"}
    merged = merge_metrics([drops, drops])  # every new metric has a rule: summed over ranks
    assert merged[f"dropped/{reason}"] == 2 * num_dropped and merged["trajectories_dropped"] == 2 * num_dropped


def test_an_environment_call_past_the_timeout_drops_that_trajectory(tmp_path, capsys, faulty):
    (h,) = faulty_run(tmp_path, "hang", "env.timeout_s=2")  # the one hung call waits for the test's release
    assert h["dropped/timeout"] == 1 and h["trajectories_dropped"] == 1 and h["train_sequences"] == 15
    out = " ".join(capsys.readouterr().out.split())
    assert "EnvTimeout: step did not return within env.timeout_s=2 (reason: timeout)" in out, out


def test_an_environment_failing_every_trajectory_stops_the_run(tmp_path, faulty):
    with pytest.raises(RunBroken) as err:
        faulty_run(tmp_path, "raise_all", iterations=3)
    message = str(err.value)
    for words in ("iteration 0:", "16 of the 16 trajectories", "env_error 16", "rollout.max_drop_fraction=0.5"):
        assert words in message, message
    # with drops tolerated, the idle breaker stops it: no iteration trains anything
    with pytest.raises(RunBroken) as err:
        faulty_run(tmp_path / "idle", "raise_all", "rollout.max_drop_fraction=1.0",
                   "experiment.max_idle_iterations=2", iterations=4)
    message = str(err.value)
    for words in ("iteration 1:", "2 iterations in a row", "experiment.max_idle_iterations=2", "env_error 16"):
        assert words in message, message


def test_more_drops_than_max_drop_fraction_stops_the_run(tmp_path, faulty):
    # one group of four (4 of 16 trajectories, 0.25) is dropped: over a 0.2 limit, under the default 0.5
    with pytest.raises(RunBroken, match=r"iteration 0: 4 of the 16 .* \(env_error 4\), a fraction of 0.25 > "
                                        r"rollout.max_drop_fraction=0.2"):
        faulty_run(tmp_path, "reset_raise", "rollout.max_drop_fraction=0.2", at_call=2, iterations=2)
    Faulty.calls.update(reset=0, step=0)
    history = faulty_run(tmp_path / "tolerated", "reset_raise", at_call=2, iterations=2)
    assert [h["trajectories_dropped"] for h in history] == [4, 0]


def launch(run_dir, **env_vars: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("HYBRIDRL_FAULT", "HYBRIDRL_TEST_FAULTS")}
    return subprocess.run([sys.executable, "-m", "rl.train", f"run_dir={run_dir}", "experiment.iterations=1", *SMALL],
                          cwd=ROOT, env={**env, **env_vars}, capture_output=True, text=True, timeout=600)


def test_the_kill_hook_is_armed_only_by_the_test_flag(tmp_path):
    ignored = launch(tmp_path / "prod", HYBRIDRL_FAULT="load_weights:0")
    assert ignored.returncode == 0, ignored.stderr[-2000:]
    assert "HYBRIDRL_FAULT='load_weights:0' is ignored" in ignored.stderr
    assert (tmp_path / "prod" / "checkpoints" / "latest").read_text() == "iter_000000"
    armed = launch(tmp_path / "test", HYBRIDRL_FAULT="load_weights:0", HYBRIDRL_TEST_FAULTS="1")
    assert armed.returncode == -signal.SIGKILL, armed.stderr[-2000:]
