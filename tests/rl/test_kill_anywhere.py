"""kill -9 at any instant: a short multi-phase run with the optimizer states spilled to NVMe, the host KV pool,
the prefix cache and partial rollouts that park their KV, killed with SIGKILL at seeded random instants (mid
train step, mid spill, mid host-pool copy, mid rollout, mid checkpoint: wherever the instant falls), then
resumed with resume=true: every trial ends with the uninterrupted run's weights,
optimizer state (masters and moments) and per-iteration rewards, bit for bit. HYBRIDRL_KILL_TRIALS sets the
number of trials (12 by default)."""
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.rl.test_train_run import ROOT, SMALL, records

RUN = [*SMALL, "task=key_lookup", "experiment.iterations=6", "memory.spill_dir=spill", "engine.host_pool_mb=4",
       "prefix_cache=on", "engine.prefix_cache.hash_block=4", "engine.max_model_len=64", "rollout.partial_resume=kv",
       "rollout.budget_tokens=40", "trainer.optimizer.backend=torch", "experiment.num_threads=1"]
TRIALS = int(os.environ.get("HYBRIDRL_KILL_TRIALS", "12"))
FINAL = "checkpoints/iter_000005"


def command(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "rl.train", f"run_dir={run_dir}", *RUN, *extra]


def env() -> dict:
    out = {k: v for k, v in os.environ.items() if k not in ("HYBRIDRL_FAULT", "HYBRIDRL_TEST_FAULTS")}
    return out | {"PYTHONPATH": str(ROOT)}


def final_state(run_dir: Path) -> tuple[dict, dict, list]:
    weights = load_file(run_dir / FINAL / "model.safetensors")
    optimizer = torch.load(run_dir / FINAL / "optimizer-rank0.pt", weights_only=True)
    rewards = [(m["iteration"], m["reward_mean"], m["loss"]) for m in records(run_dir / "metrics.jsonl")]
    return weights, optimizer, rewards


def same_tensors(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same_tensors(x, y) for x, y in zip(a, b))
    return a == b


def timed_run(run_dir: Path) -> tuple[float, float, float]:
    """One uninterrupted run: its wall time, and when its first and its last phase record appeared (the
    loop's phases lie between; before: imports, composition, the build; after: the summary, the exit)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(command(run_dir), cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    first = last = None
    seen = 0
    phases = run_dir / "phases.jsonl"
    while proc.poll() is None:
        count = phases.read_bytes().count(b"\n") if phases.exists() else 0
        if count > seen:
            seen, last = count, time.monotonic() - t0
            first = last if first is None else first
        time.sleep(0.02)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0 and first is not None, err[-3000:]
    return time.monotonic() - t0, first, last


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, float, float, float]:
    """The uninterrupted run, its wall time, and when its first and last phase records appeared. Run twice:
    the second, warm (a first run can pay one-time costs), gives the times, and equals the first."""
    base = tmp_path_factory.mktemp("straight")
    timed_run(base / "cold")
    times = timed_run(base / "run")
    assert all(same_tensors(a, b) for a, b in zip(final_state(base / "cold"), final_state(base / "run"))), \
        "two uninterrupted runs differ"
    return base / "run", *times


def wait_for_records(proc: subprocess.Popen, path: Path, count: int) -> None:
    """Until `path` holds `count` records (lines) or the process ends."""
    while proc.poll() is None and (path.read_bytes().count(b"\n") if path.exists() else 0) < count:
        time.sleep(0.005)


def phase_at_kill(run_dir: Path, phases: list[str]) -> str:
    """The phase the kill fell in: the one after the killed run's last phase record (records are written as
    each phase ends), named as the uninterrupted run's `phases` (phase names) list names it."""
    done = len(records(run_dir / "phases.jsonl")) if (run_dir / "phases.jsonl").exists() else 0
    return phases[done] if done < len(phases) else "after the last phase"


@pytest.mark.slow
def test_sigkill_at_random_instants_then_resume_reproduces_the_uninterrupted_run(straight, tmp_path):
    reference, seconds, first, last = straight
    want = final_state(reference)
    rng = random.Random(20261204)
    killed_at: list[float] = []
    phases = [r["phase"] for r in records(reference / "phases.jsonl")]
    phases[0] = f"set-up or {phases[0]}"
    hit: dict[str, int] = {}
    for trial in range(TRIALS):
        run_dir = tmp_path / f"trial{trial}"
        # One in four at an instant of the whole run (set-up and exit included); the others a random delay
        # after a random phase record (records as the straight run wrote them), so the kills spread over
        # the loop's phases whatever the jitter of the set-up's time.
        after = None if trial % 4 == 0 else rng.randrange(len(phases))
        delay = rng.uniform(0.0, seconds) if after is None else rng.uniform(0.0, 0.15)
        proc = subprocess.Popen(command(run_dir), cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        if after is not None:
            wait_for_records(proc, run_dir / "phases.jsonl", after)
        at = f"{delay:.2f} s" + ("" if after is None else f" after phase record {after}")
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            killed_at.append(at)
            phase = phase_at_kill(run_dir, phases)
            hit[phase] = hit.get(phase, 0) + 1
        again = subprocess.run(command(run_dir, "resume=true"), cwd=ROOT, env=env(), capture_output=True,
                               text=True, timeout=600)
        assert again.returncode == 0, f"trial {trial} (killed at {at}): {again.stderr[-3000:]}"
        got = final_state(run_dir)
        assert same_tensors(got[0], want[0]), f"trial {trial} (killed at {at}): the weights differ"
        assert same_tensors(got[1], want[1]), f"trial {trial} (killed at {at}): the optimizer state differs"
        assert got[2] == want[2], f"trial {trial} (killed at {at}): rewards {got[2]} vs {want[2]}"
    print(f"kill_trials={TRIALS} killed={len(killed_at)} run_seconds={seconds:.1f} "
          f"loop_seconds={first:.1f}-{last:.1f} "
          f"by_phase={hit} instants={killed_at}")
    assert len(killed_at) >= TRIALS // 2, "most instants fall inside the run"
