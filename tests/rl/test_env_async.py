"""Environment calls on worker threads: tool latency hidden behind generation, the same
trajectories as inline calls, timeouts and retries on fresh environments, the failure policy, async
environments, and the token-in/token-out invariant (the engine's prompts are prefixes of what the
trainer scores; the policy tokens are exactly the engine's samples)."""
import asyncio
import threading
import time
from dataclasses import dataclass, field

import pytest

from models.config import load_model_config
from models.model import HybridLM
from models.tokenizer import ByteTokenizer
from rl.episodes.env_runner import EnvConfig, EnvRunner, EnvTimeout
from rl.episodes.driver import DriverConfig, RolloutDriver, mix_seed
from rl.envs.tasks.base import TASKS, StepResult, register_task
from rollout.engine import Engine, EngineConfig
from rollout.kv import PrefixCacheConfig

SLEEP = {"s": 0.0}  # the sleepy task's per-step delay, set by each test
HANGS: dict[str, int] = {}  # episode seed -> calls of step() that still hang (the hung/flaky tasks)
RELEASE = threading.Event()


@dataclass
class Sleepy:
    """Four turns; each step sleeps SLEEP["s"] seconds (a slow tool), then replies with a fixed text."""
    max_turns: int = 4
    turn: int = 0

    def reset(self, seed: int) -> str:
        self.turn = 0
        return f"q{seed % 89}:"

    def step(self, answer: str) -> StepResult:
        with IN_FLIGHT["lock"]:
            IN_FLIGHT["now"] += 1
            IN_FLIGHT["most"] = max(IN_FLIGHT["most"], IN_FLIGHT["now"])
        time.sleep(SLEEP["s"])
        with IN_FLIGHT["lock"]:
            IN_FLIGHT["now"] -= 1
        self.turn += 1
        return StepResult(f" t{self.turn};", float(len(answer) % 3) / 2, self.turn >= 4)


IN_FLIGHT = {"lock": threading.Lock(), "now": 0, "most": 0}  # Sleepy steps running at once


@dataclass
class AsyncSleepy(Sleepy):
    """Sleepy with an `async def step`."""

    async def step(self, answer: str) -> StepResult:
        await asyncio.sleep(SLEEP["s"])
        self.turn += 1
        return StepResult(f" t{self.turn};", float(len(answer) % 3) / 2, self.turn >= 4)


@dataclass
class Flaky(Sleepy):
    """Sleepy whose first step of a few episodes hangs until RELEASE (HANGS counts them down), or
    raises when the count is negative; a fresh environment replayed to the turn then succeeds."""
    seed: int = 0
    calls: list = field(default_factory=list)

    def reset(self, seed: int) -> str:
        self.seed = seed
        return super().reset(seed)

    def step(self, answer: str) -> StepResult:
        left = HANGS.get(self.seed, 0)
        if left and self.turn == 0:
            HANGS[self.seed] = left - 1 if left > 0 else left + 1
            if left > 0:
                RELEASE.wait(30)
            else:
                raise RuntimeError("tool server exploded")
        return super().step(answer)


@dataclass
class AlwaysFails(Sleepy):
    failure_reward: float = -0.5  # class attribute: the task's own failure reward
    on_failure: str = "score"

    def step(self, answer: str) -> StepResult:
        raise RuntimeError("tool down")


for name, cls in (("test_sleepy", Sleepy), ("test_async_sleepy", AsyncSleepy), ("test_flaky_tool", Flaky),
                  ("test_always_fails", AlwaysFails)):
    if name not in TASKS:
        register_task(name)(cls)


def driver(task: str, env: EnvConfig, groups: int = 4, **config) -> RolloutDriver:
    model = HybridLM(load_model_config("configs/model/tiny.yaml")).init_weights(seed=7, std=0.15)
    engine = Engine(model, EngineConfig.for_pages(model, 96, max_model_len=128))
    d = RolloutDriver(engine, ByteTokenizer(), task, {}, DriverConfig(groups_per_iteration=groups, max_new_tokens=3,
                                                                        **config), group_size=4, seed=3, env=env)
    d.sampling["temperature"] = 0.0  # greedy: the inline and threaded runs must give the same trajectories
    engine.load_weights(engine.model.state_dict(), version=1)
    return d


def record_engine(d: RolloutDriver) -> dict[str, list]:
    """Every engine output's (prompt, samples), recorded as the engine returns them."""
    seen = {"outputs": []}
    step = d.engine.step

    def recording_step():
        outs = step()
        seen["outputs"] += [(list(o.prompt), [list(s.tokens) for s in o.samples]) for o in outs]
        return outs

    d.engine.step = recording_step
    return seen


def trajectories(d: RolloutDriver) -> list[tuple]:
    return [(t.traj_id, tuple(t.tokens), tuple(t.policy), t.reward, tuple(t.answers))
            for g in d.take_finished_groups() for t in g]


def check_token_identity(trajs, outputs) -> None:
    """Each trajectory's policy tokens are the concatenation of the samples the engine returned for
    it, and every prompt the engine got is a prefix of the trajectory (no text round trip)."""
    for t in trajs:
        policy_tokens = [tok for tok, p in zip(t[1], t[2]) if p]
        mine = {tuple(prompt): sample for prompt, samples in outputs for sample in samples  # one per request
                if list(t[1][:len(prompt)]) == prompt and list(t[1][len(prompt):len(prompt) + len(sample)]) == sample}
        rebuilt = [tok for prompt in sorted(mine, key=len) for tok in mine[prompt]]
        assert rebuilt == policy_tokens and len(mine) == len(t[4])  # one request per turn


def test_slow_tools_run_behind_generation_with_the_same_trajectories():
    SLEEP["s"] = 0.0
    inline = driver("test_sleepy", EnvConfig(workers=0))
    inline.run_iteration()
    expected = sorted(trajectories(inline))
    SLEEP["s"] = 0.5
    threaded = driver("test_sleepy", EnvConfig(workers=16))
    seen = record_engine(threaded)
    IN_FLIGHT["most"] = 0
    metrics = threaded.run_iteration()
    got = sorted(trajectories(threaded))
    assert got == expected and len(got) == 16 and all(len(t[4]) == 4 for t in got)
    assert metrics["env_calls"] == 64 + 4  # the steps, and each group's reset
    # behind generation and beside each other: a group's 4 members end their first turn in one engine step,
    # and their 4 slow steps then run at once on the pool (inline they ran one after another)
    assert IN_FLIGHT["most"] >= 4
    assert metrics["env_busy_seconds"] >= 64 * SLEEP["s"] and metrics["env_timeouts"] == 0
    check_token_identity(got, seen["outputs"])


def test_later_turns_hit_the_prefix_cache_when_tools_run_on_workers():
    SLEEP["s"] = 0.05
    model = HybridLM(load_model_config("configs/model/tiny.yaml")).init_weights(seed=7, std=0.15)
    engine = Engine(model, EngineConfig.for_pages(model, 96, max_model_len=128,
                                                  prefix_cache=PrefixCacheConfig(hash_block=4, model_id="tiny")))
    d = RolloutDriver(engine, ByteTokenizer(), "test_sleepy", {}, DriverConfig(groups_per_iteration=2, max_new_tokens=3),
                      group_size=4, seed=3, env=EnvConfig(workers=8))
    engine.load_weights(engine.model.state_dict(), version=1)
    metrics = d.run_iteration()
    assert metrics["trajectories_finished"] == 8 and metrics["prefix_hit_tokens"] > 0
    assert metrics["prefix_hit_frac"] > 0.4  # turns 2-4 reuse the conversation so far (in hash blocks of 4)


def test_async_def_environments_run_inline_and_on_workers():
    SLEEP["s"] = 0.01
    runs = []
    for workers in (0, 4):
        d = driver("test_async_sleepy", EnvConfig(workers=workers), groups=2)
        d.run_iteration()
        runs.append(sorted(trajectories(d)))
    assert runs[0] == runs[1] and len(runs[0]) == 8


@pytest.mark.parametrize("workers", [0, 4])
def test_a_hung_or_failing_call_is_retried_on_a_fresh_environment(workers):
    SLEEP["s"] = 0.0
    reference = driver("test_flaky_tool", EnvConfig(workers=workers))
    reference.run_iteration()
    expected = sorted(trajectories(reference))
    d = driver("test_flaky_tool", EnvConfig(workers=workers, timeout_s=0.5, max_retries=2, backoff_s=0.05))
    first, second = mix_seed(3, 0), mix_seed(3, 1)
    HANGS.clear()
    HANGS.update({first: 1, second: -1})  # group 0: one call hangs; group 1: one call raises
    RELEASE.clear()
    try:
        metrics = d.run_iteration()
    finally:
        RELEASE.set()
    assert sorted(trajectories(d)) == expected  # the retries replayed fresh environments to the same turn
    assert metrics["env_timeouts"] == 1 and metrics["env_retries"] == 2 and metrics["trajectories_dropped"] == 0


def test_a_call_failing_for_good_drops_or_scores_per_the_task():
    SLEEP["s"] = 0.0
    d = driver("test_always_fails", EnvConfig(workers=2, max_retries=1, backoff_s=0.0), groups=1)
    metrics = d.run_iteration()
    trajs = [t for g in d.take_finished_groups() for t in g]
    assert len(trajs) == 4 and all(t.reward == -0.5 for t in trajs)  # the task's own policy: score -0.5
    assert metrics["env_failures_scored"] == 4 and metrics["env_retries"] == 4 and metrics["trajectories_dropped"] == 0
    assert len(d.errors) == 4 and "scored -0.5: on_failure=score" in d.errors[0]
    timing_out = driver("test_sleepy", EnvConfig(workers=2, timeout_s=0.2), groups=1)
    SLEEP["s"] = 1.0  # every step times out; the env group's policy (drop) applies
    metrics = timing_out.run_iteration()
    assert metrics["dropped/timeout"] == 4 and metrics["env_timeouts"] == 4 and not timing_out.take_finished_groups()


def test_a_budget_stop_waits_for_the_calls_out_and_carries_their_trajectories_over():
    SLEEP["s"] = 0.2
    d = driver("test_sleepy", EnvConfig(workers=8), budget_tokens=48, max_groups_in_flight=4)
    metrics = d.run_iteration()
    assert metrics["trajectories_carried"] > 0 and d.runner.pending == 0
    finished, dropped = [t.traj_id for g in d.take_finished_groups() for t in g], metrics["trajectories_dropped"]
    for _ in range(12):
        if len(finished) >= 16:
            break
        dropped += d.run_iteration()["trajectories_dropped"]
        finished += [t.traj_id for g in d.take_finished_groups() for t in g]
    assert sorted(finished) == sorted(f"{g}/{m}" for g in range(4) for m in range(4)) and dropped == 0  # none lost


def test_the_runner_replaces_a_hung_thread_and_keeps_its_capacity():
    runner = EnvRunner(workers=2, timeout_s=0.3)
    hold = threading.Event()
    runner.submit("hung", lambda: hold.wait(10))
    for i in range(4):
        runner.submit(i, lambda i=i: i * i)
    done = {}
    deadline = time.monotonic() + 10
    while runner.pending and time.monotonic() < deadline:
        runner.wait(0.2)
        done.update(runner.collect())
    hold.set()
    assert {k: v for k, v in done.items() if k != "hung"} == {0: 0, 1: 1, 2: 4, 3: 9}
    assert isinstance(done["hung"], EnvTimeout) and runner.num_timeouts == 1
    runner.submit("delayed", lambda: "late", delay_s=0.2)
    t0 = time.monotonic()
    while runner.pending:
        runner.wait(1.0)
        done.update(runner.collect())
    assert done["delayed"] == "late" and time.monotonic() - t0 >= 0.2
    runner.close()


def test_env_config_refuses_bad_values_by_name():
    for kwargs, words in (({"workers": -1}, "workers=-1"), ({"timeout_s": 0}, "timeout_s=0"),
                          ({"max_retries": -2}, "max_retries=-2"), ({"on_failure": "ignore"}, "on_failure='ignore'")):
        with pytest.raises(ValueError, match=words):
            EnvConfig(**kwargs)
