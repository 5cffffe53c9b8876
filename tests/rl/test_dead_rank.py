"""A rank that dies mid-iteration: its peer fails with a clear error within the collective timeout
(never hangs), and the run resumes on two ranks to the uninterrupted run's result."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.rl.test_distributed_run import RUN, final_weights, free_port, launch, ok

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 30


def start_rank(run_dir: Path, rank: int, port: int, *overrides: str, fault: str | None = None) -> subprocess.Popen:
    """One rank of a 2-rank run started by hand (torchrun would kill the survivor itself)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "RANK": str(rank), "WORLD_SIZE": "2",
           "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env.pop("HYBRIDRL_FAULT", None)
    if fault is not None:
        env.update(HYBRIDRL_FAULT=fault, HYBRIDRL_TEST_FAULTS="1")
    return subprocess.Popen([sys.executable, "-m", "rl.train", f"run_dir={run_dir}", *overrides], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_dead_rank_stops_its_peer_with_a_clear_error_and_the_run_resumes(tmp_path):
    args = [*RUN, "experiment.iterations=3", f"experiment.collective_timeout_s={TIMEOUT_S}"]
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    ok(launch(straight, *args, nproc=2))
    port = free_port()
    survivor = start_rank(crashed, 0, port, *args)
    victim = start_rank(crashed, 1, port, *args, fault="train:1")  # SIGKILL as iteration 1's train phase starts
    _, victim_err = victim.communicate(timeout=300)
    assert victim.returncode == -signal.SIGKILL, victim_err[-2000:]
    died = time.monotonic()
    out, err = survivor.communicate(timeout=TIMEOUT_S + 120)  # never a hang
    waited = time.monotonic() - died
    assert survivor.returncode not in (0, None), out[-2000:]
    assert waited < TIMEOUT_S + 60, waited
    said = " ".join((out + err).split())
    assert "rank 0: a collective with the other ranks failed" in said and "experiment.collective_timeout_s=30" in said, \
        said[-3000:]
    ok(launch(crashed, *args, "resume=true", nproc=2))  # from iteration 0's checkpoint
    a, b = final_weights(straight, 2), final_weights(crashed, 2)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
