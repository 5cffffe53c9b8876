"""Per-iteration checkpoints of an RL run that survive a kill and a power loss.

A checkpoint is the directory `run_dir/checkpoints/iter_N` (trainer weights and optimizer shards,
the rollout driver's state, RNG, `iteration.json`, `manifest.json`); `latest` names the newest
*published* one. Publishing (`save_iteration`), in this order:
  1. everything is written under the temporary name `.tmp_iter_N` (never resumed from);
  2. each rank fsyncs and digests the files it wrote (`*-rank{r}.*`; rank 0 also the rest);
  3. rank 0 writes `manifest.json` ({"iteration", "world_size", "files": {relative path:
     {"bytes", "digest"}}}, every file but itself), fsyncs the whole tree and the parent;
  4. renames it to `iter_N` and fsyncs the parent; 5. replaces `latest` (temp + rename + fsync);
  6. only then deletes what retention lets go: it keeps the newest `checkpoint.keep_last`
     checkpoints up to N plus every multiple of `checkpoint.keep_every`.
A kill or power loss at any point leaves `latest` naming a checkpoint whose bytes are on disk, and
at least one older complete checkpoint (keep_last >= 2) should the newest be damaged anyway (a
disk that lies about fsync, a file clobbered later).

`checkpoint.every`: iteration N is saved when N % every == 0 and after the run's last iteration;
`save_iteration` returns None (writing nothing) otherwise.
`checkpoint.export_every`: rank 0 also exports a published iteration N with N % export_every == 0
for serving (rl/export: bf16, to run_dir/export/iter_N, replacing an export of an abandoned timeline).

Resume (`find_resumable`): `latest`'s target is checked against its manifest (every file present,
of its size and digest) and each file opened as what it is (`probe`: JSON, torch with weights_only,
safetensors); a checkpoint that fails is skipped with one line naming it, the file and what is wrong,
and the next older `iter_*` is tried. None verifying raises `CheckpointDamaged` listing each one tried.
A checkpoint without `manifest.json` cannot be verified and is skipped the same way, unless
`checkpoint.accept_unverified=true` (then it is taken with a warning).

With several ranks (run_dir on a filesystem every rank sees): rank 0 prepares and publishes the
directory and writes the weights; every rank writes its optimizer shard (`optimizer-rank{r}.pt`),
its driver state (`driver-rank{r}.json`: its groups in flight) and its RNG (`rng-rank{r}.pt`: CPU,
and its GPU's on CUDA); barriers between the steps. Rank 0 verifies on resume and tells the others
which checkpoint to load. Everything is written from host copies and read back onto the host, so
a checkpoint does not depend on the device that wrote it. `iteration.json` records the world
size; a checkpoint resumes only with the same number of ranks.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from memory.durable import digest_algo, file_digest, fsync_dir, fsync_file, fsync_tree, write_durable
from rl.config import CheckpointConfig
from rl.export import export_checkpoint
from rl.run.ranks import Ranks
from rl.episodes.driver import RolloutDriver
from trainer.step import Trainer

MANIFEST = "manifest.json"
UNVERIFIED = (f"no {MANIFEST}: its files cannot be verified (checkpoint.accept_unverified=true takes it "
              f"unverified)")
RUN_CONFIG = "run_config.json"
LATEST = "latest"
_COMPLETE = re.compile(r"^iter_(\d+)$")
_RANK_FILE = re.compile(r"-rank(\d+)\.")


class CheckpointParts(Protocol):
    """What a checkpoint reads and restores (rl/run/loop.py's `LoopParts` is one)."""

    trainer: Trainer
    driver: RolloutDriver
    ranks: Ranks
    checkpoint_dir: Path


class CheckpointDamaged(RuntimeError):
    """No checkpoint of the run verifies against its manifest."""


def checkpoint_name(iteration: int) -> str:
    return f"iter_{iteration:06d}"


def is_due(iteration: int, config: CheckpointConfig, final: bool) -> bool:
    """Whether iteration `iteration` is checkpointed: a multiple of `config.every`, or the run's last."""
    return final or iteration % config.every == 0


def save_iteration(p: CheckpointParts, iteration: int, config: CheckpointConfig = CheckpointConfig(),
                   final: bool = False, fault: Callable[[int, str], None] | None = None) -> Path | None:
    """Write and publish iteration `iteration`'s checkpoint (module docstring: the order, the
    fsyncs, retention), or nothing when it is not due (`is_due`: returns None). `final`: the run's
    last iteration (always saved). Collective over the ranks: on return the checkpoint is published
    and durable for every rank."""
    if not is_due(iteration, config, final):
        return None
    ranks = p.ranks
    final_dir = p.checkpoint_dir / checkpoint_name(iteration)
    tmp = p.checkpoint_dir / f".tmp_{final_dir.name}"
    if ranks.is_writer:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    ranks.barrier()  # the directory exists, empty, before anyone writes into it
    p.trainer.save(tmp)
    critic, kl_ctl = getattr(p, "critic", None), getattr(p, "kl_ctl", None)
    if critic is not None:  # PPO's value model: its weights and optimizer shards under critic/
        critic.trainer.save(tmp / "critic")
    if kl_ctl is not None and ranks.is_writer:
        (tmp / "kl_controller.json").write_text(json.dumps(kl_ctl.state_dict()))
    (tmp / f"driver-rank{ranks.rank}.json").write_text(json.dumps(p.driver.state_dict()))
    rng = {"torch": torch.get_rng_state()}
    if ranks.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(ranks.device)  # the rank's GPU generator (a CPU byte tensor)
    torch.save(rng, tmp / f"rng-rank{ranks.rank}.pt")
    if ranks.is_writer:
        (tmp / "iteration.json").write_text(json.dumps({"iteration": iteration, "world_size": ranks.world}))
        run_config = getattr(p, "run_config", None)
        if run_config:  # the run's resolved config: a resume refuses changes outside RESUME_MAY_CHANGE
            (tmp / RUN_CONFIG).write_text(json.dumps(run_config, indent=1, sort_keys=True) + "\n")
    ranks.barrier()  # every rank's files are written
    entries = {}
    for rel in _owned_files(tmp, ranks.rank):  # each rank syncs and digests its own files (in parallel)
        fsync_file(tmp / rel)
        entries[rel] = {"bytes": (tmp / rel).stat().st_size, "digest": file_digest(tmp / rel)}
    gathered = ranks.all_gather(entries)
    if ranks.is_writer:
        files = {rel: e for part in gathered for rel, e in sorted(part.items())}
        manifest = {"iteration": iteration, "world_size": ranks.world, "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        fsync_tree(tmp)
        fsync_dir(p.checkpoint_dir)
        if fault is not None:  # tests: a crash with the checkpoint written, not yet renamed
            fault(iteration, "checkpoint_written")
        shutil.rmtree(final_dir, ignore_errors=True)  # a stale one of an abandoned timeline (resumed before it)
        os.replace(tmp, final_dir)
        fsync_dir(p.checkpoint_dir)
        write_durable(p.checkpoint_dir / LATEST, final_dir.name.encode())
        if fault is not None:  # tests: a crash with `latest` moved, the old checkpoints not yet retired
            fault(iteration, "checkpoint_published")
        _retire(p.checkpoint_dir, iteration, config)
        if config.export_every is not None and iteration % config.export_every == 0:
            # after publishing: a failed export leaves the checkpoint resumable (the other ranks wait here)
            export_checkpoint(final_dir, p.checkpoint_dir.parent / "export" / final_dir.name, overwrite=True)
    ranks.barrier()  # published before any rank goes on
    return final_dir


def _owned_files(directory: Path, rank: int) -> list[str]:
    """Files under `directory` (relative, sorted) that rank `rank` wrote: its `*-rank{rank}.*`,
    and for rank 0 also every file without a rank in its name."""
    out = []
    for path in sorted(directory.rglob("*")):
        if not path.is_file() or path.name == MANIFEST:
            continue
        m = _RANK_FILE.search(path.name)
        if (int(m.group(1)) if m else 0) == rank:
            out.append(path.relative_to(directory).as_posix())
    return out


def complete_checkpoints(checkpoint_dir: Path) -> dict[int, Path]:
    """Published-name checkpoint directories (`iter_N`, never a `.tmp_*` one) by iteration."""
    if not checkpoint_dir.is_dir():
        return {}
    return {int(m.group(1)): d for d in checkpoint_dir.iterdir() if (m := _COMPLETE.match(d.name)) and d.is_dir()}


def _retire(checkpoint_dir: Path, newest: int, config: CheckpointConfig) -> None:
    """After `newest` is published: keep the newest `keep_last` checkpoints up to it and every
    multiple of `keep_every`; delete the others (also those after `newest`, from a timeline a
    resume abandoned) and any leftover temporary directory."""
    have = complete_checkpoints(checkpoint_dir)
    upto = sorted(i for i in have if i <= newest)
    keep = set(upto[-config.keep_last:])
    if config.keep_every is not None:
        keep |= {i for i in upto if i % config.keep_every == 0}
    for i, path in have.items():
        if i not in keep:
            shutil.rmtree(path, ignore_errors=True)
    for leftover in checkpoint_dir.glob(".tmp_iter_*"):
        shutil.rmtree(leftover, ignore_errors=True)
    fsync_dir(checkpoint_dir)


def verify(path: Path) -> str | None:
    """Why checkpoint directory `path` cannot be trusted (one line), or None when every file its
    manifest lists is present with its size and digest, and each loads as what it is (`probe`). A
    checkpoint without a manifest cannot be verified: UNVERIFIED is its reason."""
    if not path.is_dir():
        return "the directory is missing"
    if not (path / MANIFEST).exists():
        return UNVERIFIED if (path / "iteration.json").exists() else f"neither {MANIFEST} nor iteration.json present"
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
        int(manifest["iteration"])
        for rel, e in files.items():
            int(e["bytes"]), digest_algo(e["digest"])
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as err:
        return f"{MANIFEST} is unreadable ({type(err).__name__}: {err})"
    named = _COMPLETE.match(path.name)
    if named and manifest["iteration"] != int(named.group(1)):
        return f"{MANIFEST} is of iteration {manifest['iteration']}, not the directory's {int(named.group(1))}"
    for rel, e in sorted(files.items()):
        file = path / rel
        if not file.is_file():
            return f"{rel} is missing (expected {e['bytes']} bytes)"
        size = file.stat().st_size
        if size != e["bytes"]:
            return f"{rel} is {size} bytes, expected {e['bytes']}"
        found = file_digest(file, digest_algo(e["digest"]))
        if found != e["digest"]:
            return f"{rel} has digest {found}, expected {e['digest']} ({size} bytes)"
    return probe(path)


def probe(path: Path) -> str | None:
    """Why a file of checkpoint `path` does not load as what its name says (one line), or None: JSON
    parses, torch files open with weights_only=True (memory-mapped: the tensors are not read),
    safetensors headers parse. What a load error says (torch's advice to lower weights_only included)
    is not repeated: the file is damaged or not one of ours, and that is the reason."""
    from safetensors import safe_open

    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = file.relative_to(path).as_posix()
        try:
            if file.suffix == ".json":
                json.loads(file.read_text())
            elif file.suffix == ".pt":
                torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            elif file.suffix == ".safetensors":
                with safe_open(file, framework="pt") as f:
                    list(f.keys())
        except Exception as err:  # noqa: BLE001 - any load error is the checkpoint's damage
            kind = {".json": "JSON", ".pt": "a torch file", ".safetensors": "safetensors"}[file.suffix]
            return f"{rel} does not load as {kind} ({type(err).__name__}): damaged or not written by this run"
    return None


def has_manifest(path: Path) -> bool:
    return (path / MANIFEST).exists()


def published(checkpoint_dir: Path) -> str | None:
    """The name `latest` holds ('' when the marker is empty or unreadable), or None when there is
    no marker and no complete checkpoint: whether the run directory holds a run at all."""
    marker = checkpoint_dir / LATEST
    if marker.exists():
        try:
            return marker.read_text().strip()
        except (OSError, UnicodeDecodeError):
            return ""
    return "" if complete_checkpoints(checkpoint_dir) else None


def find_resumable(checkpoint_dir: Path, say: Callable[[str], None] = print, accept_unverified: bool = False
                   ) -> Path | None:
    """The checkpoint to resume from: `latest`'s target when it verifies, else the newest older
    `iter_*` that does (each skipped one is reported through `say` with the reason). None when the
    run has no checkpoint; `CheckpointDamaged` naming every one tried when none verifies. Reads
    every file of the checkpoints it tries."""
    name = published(checkpoint_dir)
    if name is None:
        return None
    have = complete_checkpoints(checkpoint_dir)
    m = _COMPLETE.match(name)
    tried: list[str] = []
    if m:
        newest = int(m.group(1))
        candidates = [checkpoint_dir / name] + [have[i] for i in sorted(have, reverse=True) if i < newest]
    else:
        # `latest` is missing, empty or garbled (not one of ours): every complete one, newest first
        what = f"holds {name!r}, not a checkpoint name" if (checkpoint_dir / LATEST).exists() else "is missing"
        tried.append(f"{LATEST}: {what}")
        say(f"checkpoint marker {checkpoint_dir / LATEST} {what}; trying the complete checkpoints newest first")
        candidates = [have[i] for i in sorted(have, reverse=True)]
    for path in candidates:
        reason = verify(path)
        if reason == UNVERIFIED and accept_unverified:
            reason = probe(path)
            if reason is None:
                say(f"warning: checkpoint {path} has no {MANIFEST}: resuming from it unverified "
                    f"(checkpoint.accept_unverified=true)")
                return path
        if reason is None:
            return path
        tried.append(f"{path.name}: {reason}")
        say(f"skipping checkpoint {path}: {reason}")
    raise CheckpointDamaged(f"no checkpoint in {checkpoint_dir} verifies against its manifest; tried:\n  "
                            + "\n  ".join(tried or ["(none)"]))


def resumable(checkpoint_dir: Path, ranks: Ranks, say: Callable[[str], None] = print,
              accept_unverified: bool = False) -> Path | None:
    """`find_resumable` run on rank 0 (it alone reads the files and reports), its answer given to
    every rank; a `CheckpointDamaged` raises on every rank."""
    if ranks.is_writer:
        try:
            answer: object = find_resumable(checkpoint_dir, say, accept_unverified)
        except CheckpointDamaged as err:
            answer = err
    else:
        answer = None
    answer = ranks.all_gather(answer)[0]
    if isinstance(answer, CheckpointDamaged):
        raise CheckpointDamaged(str(answer))
    return answer


def checkpoint_info(path: Path) -> dict:
    """A checkpoint's `iteration.json` ({"iteration", "world_size"})."""
    return {"world_size": 1, **json.loads((path / "iteration.json").read_text())}


def check_world_size(info: dict, world: int, checkpoint_dir: Path) -> None:
    if info["world_size"] != world:
        raise ValueError(f"{checkpoint_dir} holds iteration {info['iteration']} of a run with {info['world_size']} "
                         f"rank(s) (its optimizer shards and groups in flight are split that way); resume it with "
                         f"the same number of ranks (torchrun --nproc_per_node ... with {info['world_size']} in all), "
                         f"not {world}")


def load_iteration(p: CheckpointParts, path: Path) -> int:
    """Restore checkpoint `path` (this rank's shard and state; `resumable` picks it); returns its
    iteration. A checkpoint of another world size raises ValueError."""
    info = checkpoint_info(path)
    check_world_size(info, p.ranks.world, p.checkpoint_dir)
    try:
        p.trainer.load(path)
        if getattr(p, "critic", None) is not None:
            p.critic.trainer.load(path / "critic")
        if getattr(p, "kl_ctl", None) is not None:
            p.kl_ctl.load_state_dict(json.loads((path / "kl_controller.json").read_text()))
        p.driver.load_state_dict(json.loads((path / f"driver-rank{p.ranks.rank}.json").read_text()))
        rng = torch.load(path / f"rng-rank{p.ranks.rank}.pt", map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - past verify and probe: still the checkpoint's damage, said as such
        said = "" if "weights_only" in str(err) else f": {str(err).splitlines()[0][:200]}" if str(err) else ""
        raise CheckpointDamaged(f"checkpoint {path} is damaged: loading it raised {type(err).__name__}{said}; "
                                f"resume from an older one (remove this directory) or start a new run") from None
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and p.ranks.device.type == "cuda":  # absent when a CPU run wrote it
        torch.cuda.set_rng_state(rng["cuda"], p.ranks.device)
    return info["iteration"]
