"""Per-iteration checkpoints of an RL run: `run_dir/checkpoints/iter_N` (trainer weights and
optimizer shards, the rollout driver's state, RNG), written into a temporary directory renamed
into place, then the `latest` marker replaced; a kill at any point leaves the previous complete
checkpoint in charge. Older ones are removed once the new one is in place.

With several ranks (run_dir on a filesystem every rank sees): rank 0 prepares and publishes the
directory and writes the weights; every rank writes its optimizer shard (`optimizer-rank{r}.pt`),
its driver state (`driver-rank{r}.json`: its groups in flight) and its RNG (`rng-rank{r}.pt`: CPU,
and its GPU's on CUDA); barriers between the steps. Everything is written from host copies and read
back onto the host (the trainer copies the weights into the model wherever it lives), so a
checkpoint does not depend on the device that wrote it (not tried across devices: no GPU has run
the loop yet). `iteration.json` records the world size; a checkpoint resumes only with the same
number of ranks.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Protocol

import torch

from rl.ranks import Ranks
from rl.rollout import RolloutDriver
from trainer.step import Trainer


class CheckpointParts(Protocol):
    """What a checkpoint reads and restores (rl/orchestrator.py's `LoopParts` is one)."""

    trainer: Trainer
    driver: RolloutDriver
    ranks: Ranks
    checkpoint_dir: Path


def save_iteration(p: CheckpointParts, iteration: int) -> Path:
    """Write iteration `iteration`'s checkpoint (trainer, rollout state, RNG) atomically: into a
    temporary directory renamed into place, then `latest` updated; older ones removed. Collective
    over the ranks: on return the checkpoint is complete for every rank."""
    ranks = p.ranks
    final = p.checkpoint_dir / f"iter_{iteration:06d}"
    tmp = p.checkpoint_dir / f".tmp_iter_{iteration:06d}"
    if ranks.is_writer:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    ranks.barrier()  # the directory exists, empty, before anyone writes into it
    p.trainer.save(tmp)
    (tmp / f"driver-rank{ranks.rank}.json").write_text(json.dumps(p.driver.state_dict()))
    rng = {"torch": torch.get_rng_state()}
    if ranks.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(ranks.device)  # the rank's GPU generator (a CPU byte tensor)
    torch.save(rng, tmp / f"rng-rank{ranks.rank}.pt")
    ranks.barrier()  # every rank's files are written
    if ranks.is_writer:
        (tmp / "iteration.json").write_text(json.dumps({"iteration": iteration, "world_size": ranks.world}))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest_tmp = p.checkpoint_dir / "latest.tmp"
        latest_tmp.write_text(final.name)
        os.replace(latest_tmp, p.checkpoint_dir / "latest")
        for old in p.checkpoint_dir.glob("iter_*"):
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    ranks.barrier()  # published before any rank goes on
    return final


def latest_info(checkpoint_dir: Path) -> dict | None:
    """The last complete checkpoint's `iteration.json` ({"iteration", "world_size"}), None if none."""
    marker = checkpoint_dir / "latest"
    if not marker.exists():
        return None
    info = json.loads((checkpoint_dir / marker.read_text().strip() / "iteration.json").read_text())
    return {"world_size": 1, **info}


def check_world_size(info: dict, world: int, checkpoint_dir: Path) -> None:
    if info["world_size"] != world:
        raise ValueError(f"{checkpoint_dir} holds iteration {info['iteration']} of a run with {info['world_size']} "
                         f"rank(s) (its optimizer shards and groups in flight are split that way); resume it with "
                         f"the same number of ranks (torchrun --nproc_per_node ... with {info['world_size']} in all), "
                         f"not {world}")


def load_latest(p: CheckpointParts) -> int | None:
    """Restore the last complete iteration's checkpoint (this rank's shard and state); returns its
    iteration (None if none). A checkpoint of another world size raises ValueError."""
    info = latest_info(p.checkpoint_dir)
    if info is None:
        return None
    check_world_size(info, p.ranks.world, p.checkpoint_dir)
    path = p.checkpoint_dir / (p.checkpoint_dir / "latest").read_text().strip()
    p.trainer.load(path)
    p.driver.load_state_dict(json.loads((path / f"driver-rank{p.ranks.rank}.json").read_text()))
    rng = torch.load(path / f"rng-rank{p.ranks.rank}.pt", map_location="cpu")
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and p.ranks.device.type == "cuda":  # absent when a CPU run wrote it
        torch.cuda.set_rng_state(rng["cuda"], p.ranks.device)
    return info["iteration"]
