"""The simulated tool latency (rl/envs/tools/latency.py) and how the rollout applies it: step results held
on the worker pool without holding a worker (rl/episodes/env_runner.py, rl/episodes/env_calls.py)."""
from __future__ import annotations

import math
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import pytest

from models.config import load_model_config
from models.model import HybridLM
from models.tokenizer import ByteTokenizer
from rl.config.compose import compose_run_config
from rl.envs.tasks.base import TASKS, StepResult, register_task
from rl.envs.tools.latency import ToolLatency
from rl.episodes.driver import DriverConfig, RolloutDriver
from rl.episodes.env_calls import EnvCalls
from rl.episodes.env_runner import EnvConfig, EnvRunner
from rl.episodes.rollout_metrics import new_counters
from rl.episodes.runner import mix_seed
from rl.episodes.trajectory import Trajectory
from rollout.engine import Engine, EngineConfig

TURNS = 3


@dataclass
class ThreeTurnTool:
    """Three turns whatever is answered; each observation depends on the answer (a deterministic tool)."""
    max_turns: int = TURNS
    turn: int = 0

    def reset(self, seed: int) -> str:
        self.turn = 0
        return f"k{seed % 97}:"

    def step(self, answer: str) -> StepResult:
        self.turn += 1
        return StepResult(f" ={len(answer) % 7};", float(len(answer) % 3) / 2, self.turn >= TURNS)


if "test_three_turn_tool" not in TASKS:
    register_task("test_three_turn_tool")(ThreeTurnTool)


# ---- the distribution ---------------------------------------------------------------------------------
def test_a_draw_depends_on_seed_episode_member_and_turn_only():
    latency = ToolLatency(median_s=0.3, sigma=1.0, seed=5)
    keys = [(episode, turn, member) for episode in (0, 17, 2 ** 61) for turn in range(4) for member in range(3)]
    first = {k: latency.draw(k[0], k[1], member=k[2]) for k in keys}
    shuffled = keys[:]
    random.Random(1).shuffle(shuffled)
    again = ToolLatency(median_s=0.3, sigma=1.0, seed=5)  # a fresh object, in another order
    assert {k: again.draw(k[0], k[1], member=k[2]) for k in shuffled} == first
    assert len(set(first.values())) == len(keys)  # each (episode, turn, member) its own draw
    other_seed = ToolLatency(median_s=0.3, sigma=1.0, seed=6)
    assert all(other_seed.draw(*k) != v for k, v in first.items())
    assert latency.draw(17, 2) == latency.draw(17, 2, member=0)


def test_a_draw_is_the_same_in_another_process_under_another_hash_seed():
    code = ("from rl.envs.tools.latency import ToolLatency; "
            "print(repr(ToolLatency(median_s=0.3, seed=2).draw(123, 4, 1)))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert float(out.stdout) == ToolLatency(median_s=0.3, seed=2).draw(123, 4, 1)


def test_the_draws_follow_the_log_normal_median_quantiles_and_mean():
    n, median, sigma = 4000, 0.3, 1.0
    latency = ToolLatency(median_s=median, sigma=sigma)
    draws = [latency.draw(episode, turn) for episode in range(n // 4) for turn in range(4)]
    # the sample median of n log-normal draws: its log has standard error ~ sigma * sqrt(pi / 2) / sqrt(n)
    bound = 5 * sigma * math.sqrt(math.pi / 2) / math.sqrt(n)
    assert abs(math.log(statistics.median(draws) / median)) < bound
    # the 99th percentile of median 0.3 s, sigma 1 is near 3 s (the docstring's example)
    assert latency.quantile(0.5) == pytest.approx(median) and 2.9 < latency.quantile(0.99) < 3.2
    assert abs(math.log(sorted(draws)[int(0.9 * n)] / latency.quantile(0.9))) < 4 * bound
    narrow = ToolLatency(median_s=0.2, sigma=0.5)  # the mean: its relative error is sqrt(e^sigma^2 - 1) / sqrt(n)
    mean = statistics.fmean(narrow.draw(e, 0) for e in range(n))
    assert abs(mean / narrow.mean_s - 1) < 5 * math.sqrt(math.exp(0.25) - 1) / math.sqrt(n)
    assert narrow.mean_s == pytest.approx(0.2 * math.exp(0.125))


def test_the_cap_and_the_degenerate_knobs():
    capped = ToolLatency(median_s=0.3, sigma=1.0, max_s=0.5)
    draws = [capped.draw(e, 0) for e in range(500)]
    assert max(draws) == 0.5 and sum(d == 0.5 for d in draws) > 50  # P(draw > 0.5) = P(z > 0.51) ~ 0.3
    assert capped.quantile(0.99) == 0.5
    assert {ToolLatency(median_s=0.25, sigma=0.0).draw(e, t) for e in range(20) for t in range(3)} == {0.25}
    off = ToolLatency()
    assert not off.enabled and off.draw(3, 1) == 0.0 and off.mean_s == 0.0


@pytest.mark.parametrize("kwargs, words", [
    ({"median_s": -0.1}, "median_s=-0.1, expected a finite number of seconds >= 0"),
    ({"median_s": float("inf")}, "median_s=inf"),
    ({"median_s": True}, "median_s=True"),
    ({"sigma": -1.0}, "sigma=-1.0, expected a finite number >= 0"),
    ({"sigma": float("nan")}, "sigma=nan"),
    ({"max_s": 0.0}, r"max_s=0.0, expected a finite number of seconds > 0, or None"),
    ({"seed": "a"}, "seed='a', expected an integer"),
])
def test_bad_latency_values_are_refused_by_name(kwargs, words):
    with pytest.raises(ValueError, match=words):
        ToolLatency(**kwargs)


def test_the_env_group_names_its_latency_knobs_and_needs_workers():
    with pytest.raises(ValueError, match=r"tool_latency_median_s=0.3 needs env.workers > 0"):
        EnvConfig(tool_latency_median_s=0.3)
    for kwargs, words in (({"tool_latency_median_s": -1.0}, "tool_latency_median_s=-1.0"),
                          ({"tool_latency_sigma": -1.0}, "tool_latency_sigma=-1.0"),
                          ({"tool_latency_max_s": 0.0}, "tool_latency_max_s=0.0")):
        with pytest.raises(ValueError, match=words):
            EnvConfig(workers=2, **kwargs)
    env = EnvConfig(workers=2, tool_latency_median_s=0.3, tool_latency_sigma=0.5, tool_latency_max_s=2.0)
    assert env.tool_latency == ToolLatency(median_s=0.3, sigma=0.5, max_s=2.0)
    assert not EnvConfig().tool_latency.enabled


def test_the_run_config_composes_the_latency_knobs():
    cfg = compose_run_config(("experiment=single_turn", "env.workers=2", "env.tool_latency_median_s=0.3",
                              "env.tool_latency_max_s=5"))
    assert cfg.env.tool_latency == ToolLatency(median_s=0.3, sigma=1.0, max_s=5.0)
    with pytest.raises(Exception, match="needs env.workers > 0"):
        compose_run_config(("experiment=single_turn", "env.tool_latency_median_s=0.3"))


# ---- the worker pool ----------------------------------------------------------------------------------
L = 0.2  # the latency the pool tests hold results for, in seconds


def drain(runner: EnvRunner, deadline_s: float = 10.0) -> list[tuple[object, object, float]]:
    """Every pending call's (key, value, time.monotonic() it was collected)."""
    got, end = [], time.monotonic() + deadline_s
    while runner.pending and time.monotonic() < end:
        runner.wait(1.0)
        got += [(key, value, time.monotonic()) for key, value in runner.collect()]
    return got


def test_a_held_result_occupies_no_worker():
    runner = EnvRunner(workers=1, timeout_s=5.0)
    started: dict[str, float] = {}
    t0 = time.monotonic()
    handles = [runner.submit(name, lambda name=name: started.setdefault(name, time.monotonic()) and name, hold_s=L)
               for name in ("a", "b")]
    time.sleep(L / 4)
    assert runner.collect() == [] and runner.pending == 2  # both returned, both held, both still pending
    got = drain(runner)
    elapsed = time.monotonic() - t0
    assert sorted(k for k, _, _ in got) == ["a", "b"] and runner.pending == 0
    # one worker: "b" started as soon as "a" returned, not after a's latency; both came back after about L
    assert started["b"] - t0 < L / 2
    assert L <= elapsed < 1.7 * L
    for handle, (_, _, at) in zip(handles, sorted(got)):
        assert at >= runner.expected_ready(handle) >= handle.not_before + L
    runner.close()


def test_wait_wakes_when_a_held_result_becomes_ready():
    runner = EnvRunner(workers=1, timeout_s=None)
    handle = runner.submit("x", lambda: 1, hold_s=L)
    while handle.ready_at is None:  # set once the call returned (its result is then held)
        time.sleep(0.005)
    ready = runner.expected_ready(handle)
    runner.wait(30.0)
    woke = time.monotonic()
    assert ready <= woke < ready + L / 2  # not the 30 s timeout
    assert runner.collect() == [("x", 1)]
    runner.close()


def test_a_failed_call_is_not_held_and_expected_ready_bounds_a_queued_call():
    runner = EnvRunner(workers=1, timeout_s=5.0)
    gate = threading.Event()
    runner.submit("blocker", lambda: gate.wait(5), hold_s=0.0)
    failing = runner.submit("boom", lambda: 1 / 0, hold_s=10.0)
    t = time.monotonic()
    assert runner.expected_ready(failing) >= t + 10.0  # queued behind the blocker: at least its hold from now
    gate.set()
    got = drain(runner, deadline_s=3.0)
    assert {k for k, _, _ in got} == {"blocker", "boom"}
    assert isinstance(dict((k, v) for k, v, _ in got)["boom"], ZeroDivisionError)
    assert time.monotonic() - t < 3.0  # the error came back at once, not after its 10 s hold
    runner.close()


def test_env_calls_hold_a_step_for_its_trajectory_latency_and_say_when():
    env = EnvConfig(workers=1, tool_latency_median_s=L, tool_latency_sigma=0.0)
    calls = EnvCalls("test_three_turn_tool", {}, env, seed=3)
    traj = Trajectory("0/1", 0, 1, [], [], [], [], 0, answers=["ab"])
    assert calls.expected_ready(traj.traj_id) is None
    assert calls.step_latency(traj) == env.tool_latency.draw(mix_seed(3, 0), 1, 1) == L
    stats = new_counters()
    t0 = time.monotonic()
    calls.submit_step(traj, "cd", stats)
    assert calls.expected_ready(traj.traj_id) >= t0 + L and calls.pending == 1
    ended, end = [], time.monotonic() + 5
    while not ended and time.monotonic() < end:
        calls.wait(1.0)
        ended = calls.collect()
    assert time.monotonic() - t0 >= L and len(ended) == 1 and ended[0].latency_s == L
    assert ended[0].value.observation == " =2;" and ended[0].env.turn == 2  # replayed "ab", then stepped "cd"
    assert stats["tool_calls_delayed"] == 1 and stats["tool_wait_seconds"] == L
    assert calls.expected_ready(traj.traj_id) is None
    calls.pool.close()


# ---- a rollout -----------------------------------------------------------------------------------------
def driver(env: EnvConfig, groups: int = 2) -> RolloutDriver:
    model = HybridLM(load_model_config("configs/model/tiny.yaml")).init_weights(seed=7, std=0.15)
    engine = Engine(model, EngineConfig.for_pages(model, 96, max_model_len=128))
    d = RolloutDriver(engine, ByteTokenizer(), "test_three_turn_tool", {},
                      DriverConfig(groups_per_iteration=groups, max_new_tokens=3), group_size=4, seed=3, env=env)
    d.sampling["temperature"] = 0.0  # greedy: the runs with and without latency must give the same trajectories
    engine.load_weights(engine.model.state_dict(), version=1)
    return d


def trajectories(d: RolloutDriver) -> list[tuple]:
    return sorted((t.traj_id, t.group_id, t.member, tuple(t.tokens), tuple(t.policy), t.reward, tuple(t.answers))
                  for g in d.take_finished_groups() for t in g)


def test_a_rollout_with_tool_latency_gives_the_same_trajectories_and_waits_on_its_tools():
    plain = driver(EnvConfig(workers=2))
    plain_metrics = plain.run_iteration()
    expected = trajectories(plain)
    assert "tool_calls_delayed" not in plain_metrics
    env = EnvConfig(workers=2, tool_latency_median_s=0.02)
    delayed = driver(env)
    metrics = delayed.run_iteration()
    got = trajectories(delayed)
    assert got == expected and len(got) == 8 and all(len(t[6]) == TURNS for t in got)
    latencies = {t[0]: [env.tool_latency.draw(mix_seed(3, t[1]), turn, t[2]) for turn in range(TURNS)] for t in got}
    assert metrics["tool_calls_delayed"] == 8 * TURNS
    assert metrics["tool_wait_seconds"] == pytest.approx(sum(sum(v) for v in latencies.values()))
    # a trajectory's turns run one after another: the iteration lasts at least its slowest one's latencies
    assert metrics["rollout_seconds"] >= max(sum(v) for v in latencies.values())
    assert delayed.calls.pending == 0 and all(delayed.calls.expected_ready(t[0]) is None for t in got)
    delayed.calls.pool.close()
    plain.calls.pool.close()
