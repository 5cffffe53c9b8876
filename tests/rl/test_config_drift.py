"""A resume refuses a changed config outside the documented keys; resume=must; a start checkpoint
of another model; a refused start leaves earlier starts' records alone."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from models.checkpoint import save_checkpoint
from models.config import load_model_config
from models.model import HybridLM
from rl.run.checkpoint import RUN_CONFIG
from rl.train import run
from rl.config.resume import RESUME_MAY_CHANGE, check_config_drift, resolved_config
from tests.rl.test_config import composed
from tests.rl.test_train_run import SMALL

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("drift") / "run"
    run(composed(f"run_dir={run_dir}", *SMALL, "experiment.iterations=1"))
    return run_dir


def test_each_checkpoint_stores_the_resolved_config(finished):
    stored = json.loads((finished / "checkpoints" / "iter_000000" / "run_config.json").read_text())
    assert stored["trainer"]["optimizer"]["lr"] > 0 and stored["model"]["hidden_size"] == 64
    manifest = json.loads((finished / "checkpoints" / "iter_000000" / "manifest.json").read_text())
    assert "run_config.json" in json.dumps(manifest)  # verified like every other file


@pytest.mark.parametrize("override, key", [("trainer.optimizer.lr=0.5", "trainer.optimizer.lr"),
                                           ("model.rms_norm_eps=0.001", "model.rms_norm_eps"),
                                           ("seed=7", "seed")])
def test_a_resume_with_a_changed_config_is_refused_naming_the_key(finished, override, key):
    with pytest.raises(ValueError, match=f"changed config: {key}: .* in the checkpoint, .* now"):
        run(composed(f"run_dir={finished}", *SMALL, "experiment.iterations=2", "resume=true", override))
    assert not (finished / "checkpoints" / "iter_000001").exists()  # nothing ran


def test_a_resume_may_change_the_whitelisted_keys(tmp_path, finished):
    assert "experiment.iterations" in RESUME_MAY_CHANGE
    import shutil
    copy = tmp_path / "run"
    shutil.copytree(finished, copy)
    history = run(composed(f"run_dir={copy}", *SMALL, "experiment.iterations=2", "resume=true",
                           "tracking.progress=false", "checkpoint.keep_last=3"))
    assert len(history) == 1  # iteration 1 ran on the resumed run


def test_resume_must_refuses_an_empty_run_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="resume=must but run_dir .* holds no checkpoint"):
        run(composed(f"run_dir={tmp_path / 'none'}", *SMALL, "resume=must"))
    with pytest.raises(Exception, match="resume='maybe', expected false, true or must"):
        composed("resume=maybe")


def test_a_start_checkpoint_gives_the_model_config_and_a_conflicting_model_group_is_refused(tmp_path):
    start = tmp_path / "start"
    save_checkpoint(HybridLM(load_model_config("configs/model/tiny.yaml", ["rms_norm_eps=0.001"])).init_weights(seed=1),
                    start)
    # no model group or key on the command line: the checkpoint's config.json is the model config
    assert composed(*SMALL, f"experiment.checkpoint={start}").model.rms_norm_eps == 0.001
    with pytest.raises(ValueError, match="another model than the config's `model` group: rms_norm_eps: 0.001"):
        run(composed(f"run_dir={tmp_path / 'run'}", *SMALL, "model=tiny", f"experiment.checkpoint={start}"))
    assert not (tmp_path / "run").exists()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        composed(*SMALL, f"experiment.checkpoint={tmp_path}")


def test_a_refused_start_leaves_the_earlier_starts_hydra_records(tmp_path):
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "rl.train", f"run_dir={run_dir}", *SMALL, "experiment.iterations=1",
            "tracking.wandb_mode=disabled"]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    if "TORCH_EXTENSIONS_DIR" in os.environ:  # the JIT-built ops of make's cache, not a rebuild in the fresh HOME
        env["TORCH_EXTENSIONS_DIR"] = os.environ["TORCH_EXTENSIONS_DIR"]
    assert subprocess.run(args, cwd=ROOT, env=env, capture_output=True).returncode == 0
    first = {p: p.read_bytes() for p in (run_dir / ".hydra").rglob("*") if p.is_file()}
    assert first
    refused = subprocess.run([*args, "resume=true", "trainer.optimizer.lr=0.5"], cwd=ROOT, env=env,
                             capture_output=True, text=True)
    assert refused.returncode != 0 and "changed config" in refused.stderr
    assert all(p.read_bytes() == data for p, data in first.items())  # every earlier record unchanged


def test_a_checkpoint_from_before_a_knob_existed_resumes_at_its_default(tmp_path):
    """Keys a stored config lacks (knobs added since) count at the schema's default, the behaviour
    the checkpoint ran with: the same run resumes; setting such a knob otherwise is a change."""
    cfg = composed(*SMALL)
    tree = resolved_config(cfg)
    for key in ("max_groups_in_flight", "max_staleness"):
        del tree["rollout"][key]
    for key in ("lr_schedule", "warmup_steps", "min_lr_ratio", "total_steps"):
        del tree["trainer"]["optimizer"][key]
    del tree["algo"]["ppo_epochs"], tree["algo"]["mini_batches"]
    (tmp_path / RUN_CONFIG).write_text(json.dumps(tree))
    check_config_drift(cfg, tmp_path)
    with pytest.raises(ValueError, match="rollout.max_groups_in_flight: None in the checkpoint, 8 now"):
        check_config_drift(composed(*SMALL, "rollout.max_groups_in_flight=8"), tmp_path)
    with pytest.raises(ValueError, match="algo.ppo_epochs: 1 in the checkpoint, 2 now"):
        check_config_drift(composed(*SMALL, "algo.ppo_epochs=2"), tmp_path)


def test_task_params_are_stored_complete_and_compared_at_the_constructors_defaults(tmp_path):
    """The stored config lists every task keyword (a constructor default the YAML leaves out is what
    the run ran with); a stored config that lists only some is compared at today's defaults."""
    cfg = composed(*SMALL)
    tree = resolved_config(cfg)
    assert tree["task"] == {"name": "majority_digit", "params": {"length": 3, "format_reward": 0.1, "max_turns": 1}}
    tree["task"]["params"] = {"length": 3}
    (tmp_path / RUN_CONFIG).write_text(json.dumps(tree))
    check_config_drift(cfg, tmp_path)
    with pytest.raises(ValueError, match="task.params.format_reward: 0.1 in the checkpoint, 0.2 now"):
        check_config_drift(composed(*SMALL, "+task.params.format_reward=0.2"), tmp_path)
