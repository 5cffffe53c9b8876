"""What a new user types first is taken as meant, or refused at once naming the fix: one data file given as a
plain string, data files with a task that would ignore them, WANDB_MODE from the environment."""
import pytest

from rl.run.tracking import TrackingConfig
from tests.rl.test_config import composed

REWARD = "def compute_score(solution_str, ground_truth):\n    return float(solution_str == ground_truth)\n"


@pytest.fixture()
def files(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"prompt": "a", "label": "b"}\n')
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
