"""What a new user types first is taken as meant, or refused at once naming the fix: one data file given as a
plain string, data files with a task that would ignore them, WANDB_MODE from the environment."""
import math

import pytest

from rl.run.tracking import TrackingConfig
from tests.rl.test_config import composed

REWARD = "def compute_score(solution_str, ground_truth):\n    return float(solution_str == ground_truth)\n"


@pytest.fixture()
def files(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"prompt": "a", "label": "b"}\n{"prompt": "c", "label": "d"}\n')
    (tmp_path / "reward.py").write_text(REWARD)
    return tmp_path


def test_one_data_file_as_a_plain_string_is_a_one_file_list(files):
    cfg = composed("task=scored", f"data.train_files={files / 'train.jsonl'}", f"data.val_files={files / 'train.jsonl'}",
                   f"task.params.reward_path={files / 'reward.py'}")
    assert cfg.data.train_files == [str(files / "train.jsonl")] and cfg.data.val_files == [str(files / "train.jsonl")]


def test_data_files_with_a_task_that_ignores_rows_are_refused_naming_the_fix(files):
    with pytest.raises(ValueError, match=r"task.name='key_lookup' generates its own prompts .* use task=scored"):
        composed("experiment=cpu_demo", f"data.train_files=[{files / 'train.jsonl'}]")


def test_wandb_mode_comes_from_the_environment_unless_set(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert TrackingConfig().mode == "offline"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert TrackingConfig().mode == "disabled" and TrackingConfig(wandb_mode="offline").mode == "offline"
    assert composed("experiment=cpu_demo").tracking.mode == "disabled"
    monkeypatch.setenv("WANDB_MODE", "dryrun")
    assert TrackingConfig().mode == "offline"
    monkeypatch.setenv("WANDB_MODE", "sideways")
    with pytest.raises(ValueError, match="WANDB_MODE='sideways'"):
        TrackingConfig()


def test_validation_before_training_every_n_and_after_the_last_update(files, tmp_path, capsys):
    import json

    from rl.train import run

    with pytest.warns(UserWarning, match="eval.n=2 with eval.temperature=0 .* identical samples"):
        cfg = composed("task=scored", f"data.train_files={files / 'train.jsonl'}", f"data.val_files={files / 'train.jsonl'}",
                       f"task.params.reward_path={files / 'reward.py'}", "experiment.iterations=3", "eval.every=2",
                       "eval.n=2", "eval.num_prompts=2", "rollout.groups_per_iteration=1", "algo.group_size=2",
                       "rollout.max_new_tokens=2", "tracking.wandb_mode=disabled",
                       f"run_dir={tmp_path / 'run'}")
    assert cfg.eval.before_train  # null becomes on: validation rows are given
    history = run(cfg)
    assert ["val/reward_mean" in h for h in history] == [True, False, True]  # before training, then every 2
    assert all({"response_length/mean", "reward/std", "groups_zero_std_frac", "advantage/std"} <= set(h) for h in history)
    # the policy's entropy per sampled token: a random init samples from a near-uniform distribution
    assert all(0.5 * math.log(cfg.model.vocab_size) < h["entropy"] <= math.log(cfg.model.vocab_size) for h in history)
    assert sorted(p.name for p in (tmp_path / "run" / "val").iterdir()) == ["iter_0.jsonl", "iter_2.jsonl", "iter_3.jsonl"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert 0.0 <= summary["final_val/reward_mean"] <= 1.0 and summary["final_val/num_prompts"] == 2
    assert summary["final_val/iteration"] == 3
    out = capsys.readouterr().out
    assert "validation after the last update (iteration 3)" in out and "val reward" in out
    assert "CPU threads per rank (" in out  # chosen from the machine, said at start
    assert (tmp_path / "run" / "reward.png").stat().st_size > 0


def test_rollout_statistics_by_hand():
    from types import SimpleNamespace

    from rl.run.figures import rollout_statistics, trajectory_lengths

    traj = SimpleNamespace(policy=[False, False, True, True, False, True, True, True])  # prompt 2, turns of 2 and 3
    assert trajectory_lengths(traj) == (5, 2, 3)
    groups = [(0, [(1.0, 4, 10, 4), (0.0, 2, 10, 2)]), (1, [(0.5, 3, 6, 3), (0.5, 1, 6, 1)])]
    figures = rollout_statistics(groups, max_new_tokens=4, advantage="grpo")
    assert figures["response_length/mean"] == 2.5 and figures["response_length/max"] == 4
    assert figures["response_length/clip_frac"] == 0.25 and figures["prompt_length/mean"] == 8
    assert figures["reward/std"] == pytest.approx(0.3535534, rel=1e-6)  # rewards 1, 0, .5, .5
    assert figures["groups_zero_std_frac"] == 0.5  # group 1's members scored alike
    # a group's advantages sum to zero by construction; 1e-6 is relative to their unit scale (std ~1)
    assert figures["advantage/mean"] == pytest.approx(0.0, abs=1e-6) and figures["advantage/std"] > 0


def test_the_run_progress_says_done_rate_and_time_left(monkeypatch):
    from rl.run import tracking

    tracker = tracking.Tracker.__new__(tracking.Tracker)
    monkeypatch.setattr(tracking.time, "monotonic", lambda: 100.0)
    tracker.run_started(start=2, iterations=12)
    monkeypatch.setattr(tracking.time, "monotonic", lambda: 130.0)
    assert tracker.run_progress(4) == "[5/12 10.0s/it 1m10s left]"  # 3 iterations in 30 s, 7 to go


def test_memory_png_has_no_empty_panel(tmp_path, monkeypatch):
    from rl.run import tracking

    panels = []
    real = tracking._pyplot

    def spy():
        plt = real()
        subplots = plt.subplots

        def counted(n, *args, **kwargs):
            panels.append(n)
            return subplots(n, *args, **kwargs)

        monkeypatch.setattr(plt, "subplots", counted)
        return plt

    monkeypatch.setattr(tracking, "_pyplot", spy)
    records = [{"iteration": 0, "phase": p, "seconds": 0.1,
                "memory": {"device_weights": 10 << 20, "device_total": 10 << 20, "host_states": v << 20,
                           "host_total": v << 20, "disk_spill": 0, "disk_total": 0}}
               for p, v in (("rollout", 1), ("train", 2))]
    tracking.plot_memory(records, tmp_path / "memory.png")
    assert panels == [2] and (tmp_path / "memory.png").exists()  # device and host; the disk tier held nothing


def test_any_task_keyword_is_set_without_a_plus_and_a_misspelt_one_is_named():
    assert composed("experiment=single_turn", "task.params.length=4").task.params == {"length": 4}
    with pytest.raises(ValueError, match="unexpected keyword argument 'lenght'"):
        composed("experiment=single_turn", "task.params.lenght=4")


def test_single_turn_answers_as_long_as_its_task_needs(files, tmp_path):
    """experiment=single_turn leaves rollout.max_new_tokens to the task: majority_digit's one digit,
    a scored task's labels (2 x the longest label in tokens + 1, at least 8); a value given is kept."""
    assert composed("experiment=single_turn").rollout.max_new_tokens == 1
    (tmp_path / "long.jsonl").write_text('{"prompt": "a", "label": "abcdefghij"}\n{"prompt": "c", "label": "d"}\n')
    scored = ("experiment=single_turn", "task=scored", f"task.params.reward_path={files / 'reward.py'}")
    assert composed(*scored, f"data.train_files={files / 'train.jsonl'}").rollout.max_new_tokens == 8
    assert composed(*scored, f"data.train_files={tmp_path / 'long.jsonl'}").rollout.max_new_tokens == 21  # 10 bytes
    assert composed(*scored, f"data.train_files={tmp_path / 'long.jsonl'}",
                    "rollout.max_new_tokens=5").rollout.max_new_tokens == 5
    with pytest.raises(ValueError, match="task.name='code_reward' states none .* set rollout.max_new_tokens"):
        composed("experiment=single_turn", "task=code_reward")


def test_a_bad_row_anywhere_in_a_file_is_refused_at_composition_naming_file_line_and_key(files, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "label": "b"}\n' * 30 + '{"prompt": "a"}\n')
    with pytest.raises(ValueError, match=r"data.train_files: .*bad.jsonl, line 31: no key 'label'"):
        composed("task=scored", f"data.train_files={bad}", f"task.params.reward_path={files / 'reward.py'}")
    bad.write_text('{"prompt": "a", "label": "b"}\n{"prompt": "a", "label": "b"\n')
    with pytest.raises(ValueError, match=r"bad.jsonl, line 2: not JSON"):
        composed("task=scored", f"data.train_files={bad}", f"task.params.reward_path={files / 'reward.py'}")
