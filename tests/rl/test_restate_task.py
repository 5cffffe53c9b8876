"""The long-tail restate task (rl/envs/tasks/restate.py): deterministic episodes, file lengths spread
log-uniformly over [min_chars, max_chars], the demonstration scores 1, partial answers score the new
name and the share of the rest restated before the first difference."""
import json
import math

import pytest

from rl.envs.tasks import make_task
from rl.train import run
from tests.rl.test_config import composed


def test_episodes_are_deterministic_and_the_demonstration_scores_one():
    env = make_task("restate")
    for seed in range(30):
        prompt = env.reset(seed)
        target = env.target
        assert env.reset(seed) == prompt and env.target == target
        new = prompt.split()[1]
        call, answer = env.demonstration(seed)
        assert call == "cat" and answer == target and target[0] == new
        first = env.step(call)
        assert not first.done and first.role == "tool" and first.observation[0] == "=" and first.observation[-1] == ";"
        assert first.observation[2:-1] == target[1:] and first.observation[1] != new  # one change: the first name
        result = env.step(answer)
        assert result.done and result.reward == 1.0 and result.is_correct


def test_file_lengths_spread_log_uniformly_over_the_range():
    env = make_task("restate")
    lengths = []
    for seed in range(3000):
        env.reset(seed)
        lengths.append(len(env.target))
    assert min(lengths) >= 10 and max(lengths) <= 400
    logs = sorted(math.log(n / 10) / math.log(40) for n in lengths)  # uniform on [0, 1] if log-uniform
    for q in (0.1, 0.25, 0.5, 0.75, 0.9):  # 3000 draws: a quantile's sd ~0.01
        assert abs(logs[int(q * len(logs))] - q) < 0.05, q
    assert sum(n > 200 for n in lengths) > 300  # the long tail is there: ~19% above 200


def test_partial_and_wrong_answers_score_their_shared_prefix():
    env = make_task("restate")
    env.reset(7)
    target = env.target
    env.step("cat")
    half = target[:len(target) // 2]
    assert env.step(half).reward == pytest.approx(len(half) / len(target))
    env.reset(7)
    env.step("cat")  # the file unchanged: everything right but the new name
    assert env.step("#" + target[1:]).reward == pytest.approx((len(target) - 1) / len(target))
    env.reset(7)
    env.step("cat")
    longer = env.step(target + "zz")
    assert longer.reward == pytest.approx(len(target) / (len(target) + 2)) and not longer.is_correct
    env.reset(7)
    wrong = env.step("dog")  # a wrong call ends the episode with 0
    assert wrong.done and wrong.reward == 0.0
    with pytest.raises(RuntimeError):
        env.step("cat")


def test_bad_lengths_are_refused():
    with pytest.raises(ValueError, match="min_chars=50, max_chars=20"):
        make_task("restate", min_chars=50, max_chars=20)


def test_the_long_tail_preset_speculates_with_suffix_trees_and_a_divided_rollout(tmp_path):
    """One iteration of `experiment=long_tail` at small sizes (no warm-up, files of 10-40 characters):
    suffix proposals under the fitted cost model, two leaders per group; the speculation counters reach
    metrics.jsonl and every trajectory finishes or is dropped."""
    cfg = composed("experiment=long_tail", f"run_dir={tmp_path / 'run'}", "warmup.steps=0", "experiment.iterations=1",
                   "rollout.groups_per_iteration=2", "algo.group_size=4", "task.params.max_chars=40",
                   "tracking.wandb_mode=disabled", "tracking.progress=false", "tracking.plots=false")
    assert cfg.engine.speculative == "suffix" and cfg.engine.speculative_row_cost == "fitted"
    assert cfg.rollout.stagger_lead == 2 and cfg.task.name == "restate"
    (h,) = run(cfg)
    assert h["trajectories_finished"] + h["trajectories_dropped"] == 8
    stored = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert {"spec_proposed", "spec_accepted", "spec_gated_steps"} <= set(stored)
