"""The run's `tokenizer` group: a local tokenizer directory with a chat template drives an
RL run; a tokenizer larger than the model's vocabulary and a directory that needs remote code are
refused before anything is written."""
import json

import pytest

from rl.train import run
from tests.rl.test_config import composed
from tests.tokenizer_dirs import build_bpe_tokenizer, build_remote_code_dir

SMALL = ["experiment.iterations=1", "tracking.wandb_mode=disabled", "tracking.progress=false", "tracking.plots=false",
         "rollout.groups_per_iteration=2", "algo.group_size=4", "rollout.max_new_tokens=3"]


def test_a_chat_tokenizer_directory_runs_an_iteration(tmp_path):
    tok = build_bpe_tokenizer(tmp_path / "tok")
    history = run(composed(f"run_dir={tmp_path / 'run'}", *SMALL, f"tokenizer.path={tok}", "model.vocab_size=320"))
    assert len(history) == 1
    stored = json.loads(next((tmp_path / "run" / "checkpoints").glob("iter_*/run_config.json")).read_text())
    assert stored["tokenizer"]["path"] == str(tok) and "tokenizer" not in stored["task"]


def test_a_tokenizer_too_large_or_needing_remote_code_is_refused(tmp_path):
    tok = build_bpe_tokenizer(tmp_path / "tok")
    with pytest.raises(ValueError, match=r"has 3\d\d tokens but the model's vocab_size is 259"):
        run(composed(f"run_dir={tmp_path / 'run'}", *SMALL, f"tokenizer.path={tok}"))
    assert not (tmp_path / "run" / "checkpoints").exists()
    remote = build_remote_code_dir(tmp_path / "remote")
    with pytest.raises(Exception, match="tokenizer.trust_remote_code=true"):
        run(composed(f"run_dir={tmp_path / 'run2'}", *SMALL, f"tokenizer.path={remote}"))
