"""Validation (rl/episodes/validation.py) on the tiny engine: held-out episodes, pass@k / mean@k, the dump,
an engine left as found, the training rollout undisturbed, and the loop's "eval" phase."""
import json
import math
from dataclasses import dataclass

import pytest

from models.tokenizer import ByteTokenizer
from rl.run.loop import run_loop
from rl.run.ranks import merge_metrics
from rl.episodes.driver import DriverConfig, RolloutDriver
from rl.envs.tasks.base import TASKS, register_task
from rl.run.build import build
from rl.episodes.validation import EvalConfig, eval_due, evaluate, evaluator
from rollout.kv import PrefixCacheConfig
from tests.rl.test_config import composed
from tests.rl.test_rollout_driver import engine

TASK_PARAMS = {"majority_digit": {"length": 3}, "key_lookup": {"brackets": False}}


@dataclass(frozen=True)
class Scored:
    """A step result carrying the environment's own verdict (`is_correct`)."""
    observation: str
    reward: float
    done: bool
    is_correct: bool | None = None


@dataclass
class EvenByte:
    """Single turn: correct (is_correct=True) when the answer's first byte is even, with a reward of
    only 0.5, so correctness comes from the environment's verdict, not from reward >= 1."""
    max_turns: int = 1

    def reset(self, seed: int) -> str:
        return f"q{seed % 1000}="

    def step(self, answer: str) -> Scored:
        even = bool(answer) and ord(answer[0]) % 2 == 0
        return Scored("", 0.5 if even else 0.0, True, is_correct=even)


if "test_even_byte" not in TASKS:
    register_task("test_even_byte")(EvenByte)


def run_eval(e, task="majority_digit", tmp_path=None, **config):
    cfg = EvalConfig(**{"num_prompts": 6, "max_new_tokens": 3} | config)
    return evaluate(e, ByteTokenizer(), task, TASK_PARAMS.get(task, {}), cfg, seed=7, iteration=3, out_dir=tmp_path)


def without_time(metrics):
    return {k: v for k, v in metrics.items() if k != "val/seconds"}


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("task", ["majority_digit", "key_lookup"])
def test_greedy_evaluation_is_deterministic_and_its_pass_at_1_is_its_correct_frac(task, tmp_path):
    first = run_eval(engine(), task, tmp_path / "a")
    again = run_eval(engine(), task, tmp_path / "b")
    assert without_time(first) == without_time(again)
    assert lines(tmp_path / "a" / "val" / "iter_3.jsonl") == lines(tmp_path / "b" / "val" / "iter_3.jsonl")
    assert first["val/pass@1"] == first["val/correct_frac"]
    assert first["val/mean@1"] == pytest.approx(first["val/reward_mean"])
    assert first["val/num_prompts"] == first["val/num_samples"] == 6 and first["val/tokens"] > 0
    assert first["val/errors"] == 0


def test_dump_has_one_line_per_prompt_with_each_samples_answers_rewards_and_verdict(tmp_path):
    m = run_eval(engine(), "key_lookup", tmp_path, n=2, temperature=1.0, num_prompts=5)
    rows = lines(tmp_path / "val" / "iter_3.jsonl")
    assert [r["index"] for r in rows] == list(range(5)) and all(r["iteration"] == 3 for r in rows)
    assert len({r["prompt"] for r in rows}) > 1 and all(r["prompt"].startswith("get ") for r in rows)
    for r in rows:
        assert [s["member"] for s in r["samples"]] == [0, 1]
        for s in r["samples"]:
            assert 1 <= len(s["answers"]) == len(s["rewards"]) <= 2  # two turns at most
            assert s["reward"] == pytest.approx(sum(s["rewards"])) and s["correct"] == (s["reward"] >= 1.0)
            assert s["error"] is None and 1 <= s["tokens"] <= 3 * len(s["answers"])
    samples = [s for r in rows for s in r["samples"]]
    assert m["val/tokens"] == sum(s["tokens"] for s in samples)
    assert m["val/reward_mean"] == pytest.approx(sum(s["reward"] for s in samples) / len(samples))
    assert not list((tmp_path / "val").glob("*.tmp")), "the dump is renamed into place"


@pytest.mark.parametrize("task", ["majority_digit", "test_even_byte"])
def test_sampled_pass_at_k_is_at_least_the_correct_rate_and_matches_the_dump(task, tmp_path):
    m = run_eval(engine(), task, tmp_path, n=4, temperature=1.0, num_prompts=8)
    rows = lines(tmp_path / "val" / "iter_3.jsonl")
    assert m["val/num_samples"] == 32
    assert m["val/pass@4"] >= m["val/correct_frac"]
    assert m["val/pass@4"] == sum(any(s["correct"] for s in r["samples"]) for r in rows) / 8
    per_prompt = [sum(s["reward"] for s in r["samples"]) / 4 for r in rows]
    assert m["val/mean@4"] == pytest.approx(sum(per_prompt) / 8)
    if task == "test_even_byte":  # the environment's verdict, not reward >= 1 (its reward is 0.5)
        assert 0 < m["val/correct_frac"] < m["val/pass@4"]
        assert m["val/reward_mean"] == pytest.approx(0.5 * m["val/correct_frac"])


@pytest.mark.parametrize("prefix", [False, True])
def test_the_engine_is_left_as_found(prefix):
    e = engine(**({"prefix_cache": PrefixCacheConfig(hash_block=4)} if prefix else {}))
    e.generate([[1, 2, 3]], None)  # some history
    if prefix:
        e.weights_updated(1)  # a weight load empties the prefix cache, as before an evaluation in a run
    used, version, ids = e.pool.num_used, e.policy_version, set(e.requests)
    run_eval(e, "key_lookup", n=3, temperature=1.0)
    assert set(e.requests) == ids == set() and e.pool.num_used == used and e.policy_version == version
    assert not e.has_unfinished
    e.check_integrity()
    if prefix:
        assert not e.cache.prefix.index.mla and not e.cache.prefix.index.kda


def test_evaluation_refuses_a_sleeping_or_busy_engine():
    e = engine()
    e.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        run_eval(e)
    e.wake()
    e.add_request([1, 2, 3])
    with pytest.raises(RuntimeError, match="1 waiting"):
        run_eval(e)


def trajectories(d: RolloutDriver):
    d.engine.weights_updated(1)
    d.run_iteration()
    return [(t.traj_id, t.tokens, t.logprobs, t.versions, t.answers, t.reward)
            for g in d.take_finished_groups() for t in g]


@pytest.mark.parametrize("task", ["majority_digit", "key_lookup"])
def test_a_training_rollout_after_an_evaluation_equals_one_without(task):
    def driver():
        return RolloutDriver(engine(), ByteTokenizer(), task, TASK_PARAMS[task],
                             DriverConfig(groups_per_iteration=3, max_new_tokens=3), group_size=4, seed=7)

    plain, evaluated = driver(), driver()
    evaluated.engine.weights_updated(1)
    run_eval(evaluated.engine, task, n=2, temperature=1.0)
    assert trajectories(evaluated) == trajectories(plain)


def test_ranks_share_the_prompts_and_merge_to_the_one_rank_figures():
    """Rank r plays prompts i with i % world == r; merge_metrics sums the counts and recomputes the
    ratios, so two ranks report what one rank does."""
    cfg = EvalConfig(num_prompts=5, n=2, temperature=1.0, max_new_tokens=3)

    def ev(rank, world):
        return evaluate(engine(), ByteTokenizer(), "test_even_byte", {}, cfg, seed=7, iteration=0, out_dir=None,
                        rank=rank, world=world)

    one = ev(0, 1)
    shares = [ev(0, 2), ev(1, 2)]
    assert [s["val/num_prompts"] for s in shares] == [3, 2]
    merged = merge_metrics(shares)
    for key in ("val/reward_mean", "val/correct_frac", "val/pass@2", "val/mean@2"):
        assert merged[key] == pytest.approx(one[key]), key
    for key in ("val/num_samples", "val/num_correct", "val/num_pass", "val/tokens"):
        assert merged[key] == one[key], key
    lonely = evaluate(engine(), ByteTokenizer(), "test_even_byte", {}, cfg, seed=7, iteration=0, out_dir=None,
                      rank=5, world=6)  # more ranks than prompts: no prompt, NaN ratios, zero counts
    assert lonely["val/num_prompts"] == 0 and math.isnan(lonely["val/pass@2"])
    assert merge_metrics([one, lonely])["val/pass@2"] == one["val/pass@2"]


@pytest.mark.parametrize("bad, message", [
    ({"n": 0}, "n=0, expected an integer >= 1"), ({"every": 0}, "every=0, expected an integer >= 1 or null"),
    ({"temperature": -0.5}, "temperature=-0.5, expected a finite number >= 0"),
    ({"top_p": 0.0}, "top_p=0.0, expected a number in"), ({"num_prompts": 0}, "num_prompts=0"),
    ({"max_new_tokens": 0}, "max_new_tokens=0"), ({"n": True}, "n=True")])
def test_config_errors_name_the_value(bad, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        EvalConfig(**bad)


def test_when_evaluations_are_due():
    assert [it for it in range(7) if eval_due(it, 3, False)] == [3, 6]
    assert [it for it in range(7) if eval_due(it, 3, True)] == [0, 3, 6]
    assert [it for it in range(7) if eval_due(it, None, True)] == [0]
    assert not any(eval_due(it, None, False) for it in range(7))
    assert evaluator(engine(), ByteTokenizer(), "majority_digit", {"length": 3}, EvalConfig(), seed=0,
                     out_dir=None) is None


KV_CARRY = ("rollout.max_new_tokens=4", "rollout.budget_tokens=12", "rollout.partial_resume=kv",
            "engine.host_pool_mb=4", "prefix_cache=on", "engine.prefix_cache.hash_block=16")
"""Partial rollouts parked with their KV over the evaluation, and the prefix cache on."""


@pytest.mark.parametrize("extra", [("rollout.max_new_tokens=2",), KV_CARRY], ids=["plain", "kv_carry_prefix_cache"])
def test_the_loop_runs_an_eval_phase_and_logs_val_metrics(tmp_path, extra):
    """Iterations through run_loop with an evaluation before training and at every iteration: an
    "eval" phase after load_weights in phases.jsonl, val/ metrics in metrics.jsonl, a dump per
    evaluation, and the training figures of a run without evaluation (also with partial rollouts
    parked with their KV over the evaluation and the prefix cache on)."""
    iterations = 3 if extra == KV_CARRY else 2  # the carried groups train in a later iteration

    def loop(run_dir, every):
        evaluation = ("eval.every=1", "eval.before_train=true", "eval.num_prompts=3", "eval.n=2",
                      "eval.temperature=1.0") if every else ()
        cfg = composed(f"run_dir={run_dir}", f"experiment.iterations={iterations}", "tracking.wandb_mode=disabled",
                       "tracking.progress=false", "rollout.groups_per_iteration=2", "algo.group_size=4",
                       *evaluation, *extra)
        parts = build(cfg, resume_from=None)
        return run_loop(parts, 0, iterations, max_drop_fraction=cfg.rollout.max_drop_fraction,
                        max_idle_iterations=cfg.experiment.max_idle_iterations)

    with_eval, plain = loop(tmp_path / "eval", True), loop(tmp_path / "plain", False)
    logged = lines(tmp_path / "eval" / "metrics.jsonl")
    for m in (*with_eval, *logged):
        assert m["val/num_prompts"] == 3 and m["val/num_samples"] == 6 and 0 <= m["val/pass@2"] <= 1
        assert m["seconds/eval"] >= 0
    phases = [(r["iteration"], r["phase"]) for r in lines(tmp_path / "eval" / "phases.jsonl")]
    for it in (0, 1):
        mine = [p for i, p in phases if i == it]
        assert mine.index("eval") == mine.index("load_weights") + 1 and mine[mine.index("eval") + 1] == "rollout"
    assert [len(lines(tmp_path / "eval" / "val" / f"iter_{it}.jsonl")) for it in (0, 1)] == [3, 3]
    for a, b in zip(with_eval, plain):
        assert not any(k.startswith("val/") for k in b)
        for key in ("reward_mean", "rollout_tokens", "trajectories_carried", "loss", "engine_checksum"):
            assert a.get(key) == b.get(key) or math.isnan(a[key]) and math.isnan(b[key]), key
    assert any(m["groups_trained"] for m in with_eval), "some group should train, so the losses are compared"
    if extra == KV_CARRY:
        assert with_eval[0]["trajectories_carried"] > 0, "the budget should leave work parked over the evaluation"


EVEN = '''
def compute_score(solution_str, ground_truth, extra_info):
    even = bool(solution_str) and ord(solution_str[0]) % 2 == 0
    return {"score": 0.25 * even, "acc": even}
'''


def test_validation_rows_feed_a_data_task_and_its_verdict_counts(tmp_path):
    """Given validation rows (data.val_files), prompt i is rows[i] (messages rendered as they are),
    at most num_prompts of them; correctness is the reward function's "acc"."""
    reward = tmp_path / "reward.py"
    reward.write_text(EVEN)
    rows = [{"prompt": f"q{i}=", "label": str(i)} for i in range(4)] + [{"prompt": [{"role": "user", "content": "hi"}]}]
    cfg = EvalConfig(num_prompts=16, n=4, temperature=1.0, max_new_tokens=2)
    m = evaluate(engine(), ByteTokenizer(), "scored", {"reward_path": str(reward)}, cfg, seed=7, iteration=0,
                 out_dir=tmp_path, rows=rows)
    dumped = lines(tmp_path / "val" / "iter_0.jsonl")
    assert [r["prompt"] for r in dumped] == [r["prompt"] for r in rows] and m["val/num_prompts"] == 5
    assert 0 < m["val/correct_frac"] < 1 and m["val/reward_mean"] == pytest.approx(0.25 * m["val/correct_frac"])
    assert m["val/errors"] == 0
    capped = evaluate(engine(), ByteTokenizer(), "scored", {"reward_path": str(reward)},
                      EvalConfig(num_prompts=2, max_new_tokens=2), seed=7, iteration=0, out_dir=None, rows=rows)
    assert capped["val/num_prompts"] == 2
    with pytest.raises(ValueError, match="'majority_digit'.s reset takes no `row`"):
        evaluate(engine(), ByteTokenizer(), "majority_digit", {"length": 3}, cfg, seed=7, iteration=0, out_dir=None,
                 rows=rows)
    with pytest.raises(ValueError, match="the list is empty"):
        evaluator(engine(), ByteTokenizer(), "scored", {"reward_path": str(reward)}, EvalConfig(every=1), seed=7,
                  out_dir=None, rows=[])


@dataclass
class SlowLookup:
    """key_lookup whose steps take 20 ms, and whose step raises (seed % 3 == 1) or hangs past the
    pool's timeout (seed % 3 == 2) when `faulty`."""
    faulty: bool = False
    max_turns: int = 2
    length: int = 0  # unused: the default config's task param, kept by a task.name override
    steps = []  # every step's thread name (class-wide)
    answer_tokens = 1  # what a run with rollout.max_new_tokens=null (experiment=single_turn) gives each turn

    def __post_init__(self):
        from rl.envs.tasks.base import make_task
        self.inner = make_task("key_lookup", brackets=False)
        self.max_turns = self.inner.max_turns

    def reset(self, seed: int) -> str:
        self.seed = seed
        return self.inner.reset(seed)

    def step(self, answer: str):
        import threading
        import time
        SlowLookup.steps.append(threading.current_thread().name)
        time.sleep(0.02)
        if self.faulty and self.seed % 3 == 1:
            raise RuntimeError("tool crashed")
        if self.faulty and self.seed % 3 == 2:
            time.sleep(3.0)
        return self.inner.step(answer)


if "test_slow_lookup" not in TASKS:
    register_task("test_slow_lookup")(SlowLookup)


def test_environment_steps_on_the_worker_pool_give_the_inline_evaluation():
    # env.workers > 0: the steps run on the pool while the engine steps the other samples; greedy
    # results, dump included, equal the inline evaluation's. A step that raises or outlives the pool's
    # timeout ends its sample with the error; the evaluation completes.
    from rl.episodes.env_runner import EnvRunner

    cfg = EvalConfig(num_prompts=6, n=2, max_new_tokens=3, temperature=0.0)
    runs, runner = [], EnvRunner(4, timeout_s=1.0)
    try:
        for pool in (None, runner):
            SlowLookup.steps.clear()
            runs.append(evaluate(engine(), ByteTokenizer(), "test_slow_lookup", {}, cfg, seed=7, iteration=0,
                                 out_dir=None, runner=pool))
            steps = list(SlowLookup.steps)
            if pool is None:
                inline = steps
        assert len(steps) == len(inline) == runner.num_calls >= runs[0]["val/num_samples"]
        assert all(name.startswith("env-worker-") for name in steps)
        assert not any(name.startswith("env-worker-") for name in inline)
        faulty = evaluate(engine(), ByteTokenizer(), "test_slow_lookup", {"faulty": True}, cfg, seed=7, iteration=0,
                          out_dir=None, runner=runner)
    finally:
        runner.close()
    assert without_time(runs[1]) == without_time(runs[0]) and runs[0]["val/errors"] == 0
    assert 0 < faulty["val/errors"] < faulty["val/num_samples"] and runner.num_timeouts > 0


def test_a_run_with_env_workers_evaluates_on_its_driver_pool(tmp_path):
    cfg = composed(f"run_dir={tmp_path}", "tracking.wandb_mode=disabled", "tracking.progress=false", "env.workers=2",
                   "eval.every=1", "eval.num_prompts=2", "eval.n=2", "task.name=test_slow_lookup")
    parts = build(cfg, resume_from=None)
    SlowLookup.steps.clear()
    metrics = parts.evaluate(0)
    assert metrics["val/num_samples"] == 4 and metrics["val/errors"] == 0
    assert len(SlowLookup.steps) >= 4 and all(name.startswith("env-worker-") for name in SlowLookup.steps)
    assert parts.driver.runner.pending == 0
