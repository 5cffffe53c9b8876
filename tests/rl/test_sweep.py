"""Sweeps: `python -m rl.train -m key=a,b` runs one job per value, each in its own run_dir
(the experiment's timestamped default plus -job<N>); a plain start gets a fresh timestamped run_dir."""
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.rl.test_config import composed

ROOT = Path(__file__).resolve().parents[2]


def test_the_default_run_dir_names_the_experiment_and_the_start_time():
    assert composed().run_dir.startswith("runs/single_turn-20")
    assert composed("experiment=cpu_demo").run_dir.startswith("runs/cpu_demo-20")


def test_a_two_job_sweep_runs_each_job_in_its_own_run_dir(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    out = subprocess.run([sys.executable, "-m", "rl.train", "-m", "experiment=single_turn", "experiment.iterations=1",
                          "tracking.wandb_mode=disabled", "tracking.progress=false", "tracking.plots=false",
                          "rollout.groups_per_iteration=2", "algo.group_size=2", "rollout.max_new_tokens=2",
                          "trainer.optimizer.lr=1e-3,2e-3", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = sorted((tmp_path / "runs").iterdir())
    assert [r.name[-5:] for r in runs] == ["-job0", "-job1"]
    lrs = [json.loads(next(r.glob("checkpoints/iter_*/run_config.json")).read_text())["trainer"]["optimizer"]["lr"]
           for r in runs]
    assert lrs == [1e-3, 2e-3]
