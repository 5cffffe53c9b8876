"""One run per run_dir (rl/run/run_lock.py): a second run on a run_dir in use is refused before it writes
anything, naming the holder (pid, host, start time); a holder killed with SIGKILL holds nothing, and a resume
takes the lock at once."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rl.run.run_lock import LOCK_FILE, lock_run_dir, unlock_run_dir

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["experiment=single_turn", "rollout.groups_per_iteration=2", "algo.group_size=2", "tracking.wandb_mode=disabled",
        "tracking.progress=false", "tracking.plots=false", "experiment.num_threads=1"]


def train(run_dir: Path, *extra: str, wait: bool = True):
    cmd = [sys.executable, "-m", "rl.train", *ARGS, f"run_dir={run_dir}", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if wait:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)


@pytest.mark.slow
def test_a_second_run_on_a_run_dir_in_use_is_refused_and_a_killed_holder_frees_it(tmp_path):
    run_dir = tmp_path / "run"
    first = train(run_dir, "experiment.iterations=400", wait=False)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists():  # the first run is past its set-up and training
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not start"
            time.sleep(0.2)
        files_before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*") if ".hydra" in p.parts)
        second = train(run_dir, "experiment.iterations=3", "seed=2")
        assert second.returncode != 0
        assert f"is in use by another run (pid {first.pid} on " in second.stderr and "started 20" in second.stderr
        assert second.stderr.count("\n") == 1, second.stderr  # one line, no traceback
        # nothing of the second's written: no Hydra record of its start beside the first's
        assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*") if ".hydra" in p.parts) == files_before
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    resumed = train(run_dir, "experiment.iterations=3", "resume=true")  # the dead holder holds nothing
    assert resumed.returncode == 0, resumed.stderr[-2000:]


def test_the_lock_is_reentrant_in_one_process_and_refused_to_another(tmp_path):
    lock_run_dir(tmp_path)
    lock_run_dir(tmp_path)
    other = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
             f"from rl.run.run_lock import lock_run_dir\nlock_run_dir({str(tmp_path)!r})"]
    try:
        done = subprocess.run(other, capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and "RunDirLocked" in done.stderr and f"pid {os.getpid()}" in done.stderr
        unlock_run_dir(tmp_path)  # one of two given back: still held
        assert subprocess.run(other, capture_output=True, timeout=60).returncode != 0
    finally:
        unlock_run_dir(tmp_path)
    assert subprocess.run(other, capture_output=True, timeout=60).returncode == 0  # released with the last
    assert (tmp_path / LOCK_FILE).read_text().startswith("pid ")
