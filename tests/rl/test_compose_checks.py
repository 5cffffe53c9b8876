"""Composition checks: a bad value of a data, task, eval or experiment key is refused when the config
is composed, naming the key and its value, and `python -m rl.train` writes nothing (no run_dir, no .hydra record)."""
import json
import subprocess
import sys

import pytest

from rl.train import precheck
from tests.rl.test_config import composed
from tests.tokenizer_dirs import build_remote_code_dir


@pytest.fixture
def user_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths, as a user types them
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"question": f"{i}+1", "answer": str(i + 1)}) + "\n"
                                                  for i in range(3)))
    (tmp_path / "reward.py").write_text("def compute_score(solution_str, ground_truth, extra_info=None):\n"
                                        "    return float(solution_str.strip() == ground_truth)\n")
    return ["task=scored", "data.train_files=[train.jsonl]", "data.prompt_key=question", "data.label_key=answer",
            "task.params.reward_path=reward.py"]


def bad_values(tmp_path):
    """(overrides, words the error must contain) for each kind of bad value checked."""
    return [
        (["data.train_files=[nope.jsonl]"], r"data.train_files: \['nope.jsonl'\] do not exist"),
        (["data.val_files=[train.csv]"], r"data.val_files: \['train.csv'\] do not exist"),
        (["data.extra_keys=[source]"], r"data.extra_keys\[0\]='source', but train.jsonl, line 1 has no such key"),
        (["data.label_key=solution"], r"data.label_key='solution', but train.jsonl, line 1 has no such key.*null"),
        (["data.label_key=null"], r"task.name=scored hands each row's label.*data.label_key=null"),
        (["data.prompt_key=prompt"], r"data.prompt_key='prompt', but .* has no such key \(it has \['answer', "
                                     r"'question'\]; a nested key is named by its dotted path\)"),
        ([f"tokenizer.path={build_remote_code_dir(tmp_path / 'remote')}"],
         r"tokenizer.path=.*remote.*set tokenizer.trust_remote_code=true"),
        (["eval.n=0"], r"n=0, expected an integer >= 1"),
        (["experiment.iterations=3", "algo.ppo_epochs=2", "trainer.optimizer.lr_schedule=cosine",
          "trainer.optimizer.warmup_steps=50"], r"warmup_steps=50, but the run takes 6 optimizer steps"),
        (["task.params.reward_path=nope.py"], r"reward_path='nope.py': no such file"),
        (["+task.params.reward_nam=compute_score"], r"task.params=.*reward_nam"),
        (["task.name=no_such_task"], r"task.name='no_such_task': unknown task"),
    ]


def test_each_bad_value_is_refused_at_composition_naming_it(tmp_path, user_files):
    composed(*user_files)  # the good config composes
    for overrides, words in bad_values(tmp_path):
        with pytest.raises(ValueError, match=words):
            composed(*user_files, *overrides)


def test_the_command_line_writes_nothing_for_a_bad_value(tmp_path, user_files, capsys):
    run_dir = tmp_path / "run"
    for overrides, words in bad_values(tmp_path):
        with pytest.raises(SystemExit) as exit_:
            precheck(["experiment=single_turn", f"run_dir={run_dir}", *user_files, *overrides])
        assert exit_.value.code.startswith("error: ") and "ValueError" in exit_.value.code, overrides
        assert not run_dir.exists()
    precheck(["experiment=single_turn", f"run_dir={run_dir}", *user_files])  # good: returns, still nothing written
    assert not run_dir.exists()


def test_python_m_rl_train_refuses_before_hydra_writes(tmp_path, user_files):
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "rl.train", f"run_dir={run_dir}", *user_files,
                           "data.train_files=[missing.jsonl]"], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**__import__("os").environ, "PYTHONPATH": str(__import__("pathlib").Path(
                              __file__).resolve().parents[2])})
    assert done.returncode == 1
    assert "data.train_files: ['missing.jsonl'] do not exist" in done.stderr and "Traceback" not in done.stderr
    assert not run_dir.exists()
