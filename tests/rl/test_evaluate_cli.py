"""`python -m rl.evaluate`'s argument and config handling (its evaluation itself is compared with the
run's in tests/rl/test_first_day.py): bad arguments name themselves, exit 2 and write nothing."""
import json

import pytest

from rl.evaluate import EvaluateError, main, split_args, stored_config
from rl.config.resume import resolved_config
from tests.rl.test_config import composed


def test_arguments_split_into_own_and_overrides_and_model_keys_are_refused():
    own, overrides = split_args(["run_dir=r", "iteration=3", "eval.n=8", "data.val_files=[a.jsonl]"])
    assert own == {"run_dir": "r", "iteration": "3"} and overrides == ["eval.n=8", "data.val_files=[a.jsonl]"]
    with pytest.raises(EvaluateError, match="run_dir is missing"):
        split_args(["eval.n=8"])
    with pytest.raises(EvaluateError, match="'model.hidden_size=8': the model is the checkpoint's"):
        split_args(["run_dir=r", "model.hidden_size=8"])
    with pytest.raises(EvaluateError, match="argument 'eval', expected key=value"):
        split_args(["run_dir=r", "eval"])


def test_the_stored_config_takes_overrides_checked_as_at_composition(tmp_path):
    checkpoint = tmp_path / "iter_000001"
    checkpoint.mkdir()
    with pytest.raises(EvaluateError, match="stores no run_config.json"):
        stored_config(checkpoint, [])
    (checkpoint / "run_config.json").write_text(json.dumps(resolved_config(composed("eval.n=2"))))
    cfg = stored_config(checkpoint, ["eval.n=8", "eval.temperature=0", "tokenizer.stop_strings=[x,yz]"])
    assert cfg.eval.n == 8 and cfg.eval.temperature == 0 and cfg.tokenizer.stop_strings == ["x", "yz"]
    assert resolved_config(cfg)["task"] == resolved_config(composed("eval.n=2"))["task"]  # the rest is the run's
    with pytest.raises(EvaluateError, match="'eval.nn=8'"):
        stored_config(checkpoint, ["eval.nn=8"])
    with pytest.raises(ValueError, match="n=0, expected an integer >= 1"):
        stored_config(checkpoint, ["eval.n=0"])


def test_the_command_exits_2_naming_the_problem_and_writes_nothing(tmp_path, capsys):
    assert main([f"run_dir={tmp_path / 'nope'}"]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert main([f"run_dir={tmp_path / 'run'}", "iteration=x"]) == 2
    assert "iteration='x', expected an integer or latest" in capsys.readouterr().err
    assert main([f"run_dir={tmp_path / 'run'}"]) == 2
    assert "holds no complete checkpoint" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoints"]
