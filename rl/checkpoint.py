"""Per-iteration checkpoints of an RL run: `run_dir/checkpoints/iter_N` (trainer weights and
optimizer shards, the rollout driver's state, RNG), written into a temporary directory renamed
into place, then the `latest` marker replaced; a kill at any point leaves the previous complete
checkpoint in charge. Older ones are removed once the new one is in place.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rl.orchestrator import LoopParts


def save_iteration(p: LoopParts, iteration: int) -> Path:
    """Write iteration `iteration`'s checkpoint (trainer, rollout state, RNG) atomically: into a
    temporary directory renamed into place, then `latest` updated; older ones removed."""
    final = p.checkpoint_dir / f"iter_{iteration:06d}"
    tmp = p.checkpoint_dir / f".tmp_iter_{iteration:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    p.trainer.save(tmp)
    (tmp / "driver.json").write_text(json.dumps(p.driver.state_dict()))
    torch.save({"torch": torch.get_rng_state()}, tmp / "rng.pt")
    (tmp / "iteration.json").write_text(json.dumps({"iteration": iteration}))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    latest_tmp = p.checkpoint_dir / "latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, p.checkpoint_dir / "latest")
    for old in p.checkpoint_dir.glob("iter_*"):
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_latest(p: LoopParts) -> int | None:
    """Restore the last complete iteration's checkpoint; returns its iteration (None if none)."""
    marker = p.checkpoint_dir / "latest"
    if not marker.exists():
        return None
    path = p.checkpoint_dir / marker.read_text().strip()
    p.trainer.load(path)
    p.driver.load_state_dict(json.loads((path / "driver.json").read_text()))
    torch.set_rng_state(torch.load(path / "rng.pt")["torch"])
    return json.loads((path / "iteration.json").read_text())["iteration"]
