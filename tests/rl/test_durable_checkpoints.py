"""Checkpoints that survive power loss (rl/run/checkpoint.py): a manifest of sizes and digests, fsync
before publishing, retention of the last K, and a resume that falls back past a damaged newest
checkpoint and still reproduces the uninterrupted run bit for bit."""
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from memory.durable import file_digest
from rl.run import checkpoint as ckpt
from rl.run.checkpoint import CheckpointDamaged, find_resumable, save_iteration
from rl.config import CheckpointConfig
from rl.train import run
from rl.run.build import build
from tests.rl.test_config import composed
from tests.rl.test_train_run import SMALL, records

ITERATIONS = 3
# torch's AdamW: DeepSpeed's CPU Adam keeps beta^t in its C++ object, multiplied up step by step,
# while a fresh one (after a resume) computes pow(beta, t): the last bit can differ from step 3 on.
RUN = [*SMALL, "trainer.optimizer.backend=torch", f"experiment.iterations={ITERATIONS}"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """An uninterrupted 3-iteration run (default checkpoint config: every 1, keep_last 2)."""
    run_dir = tmp_path_factory.mktemp("straight")
    run(composed(f"run_dir={run_dir}", *RUN))
    return run_dir


def _copy(straight: Path, tmp_path: Path) -> Path:
    """The straight run's directory as a run that lost power after its last checkpoint."""
    shutil.copytree(straight, tmp_path / "run")
    return tmp_path / "run"


def _all_files(directory: Path) -> set[str]:
    return {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()}


def _assert_same_final_state(a: Path, b: Path) -> None:
    final = f"checkpoints/iter_{ITERATIONS - 1:06d}"
    wa, wb = load_file(a / final / "model.safetensors"), load_file(b / final / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), "resumed weights differ"
    oa = torch.load(a / final / "optimizer-rank0.pt", weights_only=True)
    ob = torch.load(b / final / "optimizer-rank0.pt", weights_only=True)
    assert all(torch.equal(x, y) for x, y in zip(oa["masters"], ob["masters"], strict=True))
    ma, mb = records(a / "metrics.jsonl"), records(b / "metrics.jsonl")
    assert [m["iteration"] for m in mb] == list(range(ITERATIONS))
    keys = ["reward_mean", "loss", "train_tokens", "engine_checksum"]
    assert [[m.get(k) for k in keys] for m in ma] == [[m.get(k) for k in keys] for m in mb]


def _truncate(path: Path) -> str:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    return f"model.safetensors is {size // 2} bytes, expected {size}"


def _zero(path: Path) -> str:
    path.write_bytes(bytes(path.stat().st_size))  # same size: only the digest tells
    return "optimizer-rank0.pt has digest"


@pytest.mark.parametrize("damage", ["truncate", "zero", "remove"])
def test_power_loss_falls_back_to_the_previous_checkpoint_and_reproduces_the_run(straight, tmp_path, capsys, damage):
    """The newest checkpoint loses a file's tail, has a file zeroed, or is missing altogether while
    `latest` names it: resume says which one it skipped and why, starts after the previous one and
    ends with the uninterrupted run's weights, optimizer and metrics bit for bit."""
    crashed = _copy(straight, tmp_path)
    newest = crashed / "checkpoints" / "iter_000002"
    if damage == "truncate":
        why = _truncate(newest / "model.safetensors")
    elif damage == "zero":
        why = _zero(newest / "optimizer-rank0.pt")
    else:
        shutil.rmtree(newest)
        why = "the directory is missing"
    assert (crashed / "checkpoints" / "latest").read_text() == "iter_000002"
    capsys.readouterr()
    history = run(composed(f"run_dir={crashed}", *RUN, "resume=true"))
    out = capsys.readouterr().out
    skipped = [line for line in out.splitlines() if line.startswith("skipping checkpoint")]
    assert len(skipped) == 1 and "iter_000002" in skipped[0] and why in skipped[0], out
    assert "after iteration 1" in " ".join(out.split())  # rich wraps the console line
    assert len(history) == 1  # iteration 2 again
    _assert_same_final_state(straight, crashed)
    assert find_resumable(crashed / "checkpoints", say=pytest.fail) == newest  # rewritten, verifies


def test_no_verifying_checkpoint_raises_naming_each_one_tried(straight, tmp_path):
    crashed = _copy(straight, tmp_path)
    _truncate(crashed / "checkpoints" / "iter_000002" / "model.safetensors")
    (crashed / "checkpoints" / "iter_000001" / ckpt.MANIFEST).write_bytes(bytes(100))  # a zeroed manifest
    with pytest.raises(CheckpointDamaged) as err:
        run(composed(f"run_dir={crashed}", *RUN, "resume=true"))
    msg = str(err.value)
    assert "iter_000002: model.safetensors is" in msg and "iter_000001: manifest.json is unreadable" in msg, msg
    assert records(crashed / "metrics.jsonl") == records(straight / "metrics.jsonl"), "a refused resume wrote"


def test_a_checkpoint_under_its_temporary_name_is_never_resumed(straight, tmp_path):
    """A crash between writing everything and the rename leaves `.tmp_iter_N` complete, manifest and
    all: it is not a checkpoint until renamed, even when `latest` is lost and every published one
    is damaged."""
    checkpoints = _copy(straight, tmp_path) / "checkpoints"
    tmp = checkpoints / ".tmp_iter_000003"
    shutil.copytree(checkpoints / "iter_000002", tmp)
    manifest = json.loads((tmp / ckpt.MANIFEST).read_text())
    (tmp / ckpt.MANIFEST).write_text(json.dumps({**manifest, "iteration": 3}))  # it would verify as iter 3
    assert find_resumable(checkpoints, say=pytest.fail) == checkpoints / "iter_000002"
    (checkpoints / "latest").unlink()
    said: list[str] = []
    assert find_resumable(checkpoints, say=said.append) == checkpoints / "iter_000002"
    assert said == [f"checkpoint marker {checkpoints / 'latest'} is missing; trying the complete checkpoints "
                    f"newest first"]
    for name in ("iter_000002", "iter_000001"):
        _zero(checkpoints / name / "optimizer-rank0.pt")
    with pytest.raises(CheckpointDamaged) as err:
        find_resumable(checkpoints, say=lambda line: None)
    assert ".tmp_iter" not in str(err.value) and "iter_000001: optimizer-rank0.pt has digest" in str(err.value)


def test_keep_last_two_leaves_the_two_newest_and_no_temporary(straight):
    checkpoints = straight / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["iter_000001", "iter_000002", "latest"]
    assert (checkpoints / "latest").read_text() == "iter_000002"


def test_manifest_lists_every_file_with_its_size_and_digest(straight):
    for it in (1, 2):
        path = straight / "checkpoints" / f"iter_{it:06d}"
        manifest = json.loads((path / ckpt.MANIFEST).read_text())
        assert manifest["iteration"] == it and manifest["world_size"] == 1
        assert set(manifest["files"]) == _all_files(path) - {ckpt.MANIFEST}
        assert {"model.safetensors", "config.json", "trainer.json", "optimizer-rank0.pt", "rng-rank0.pt",
                "driver-rank0.json", "iteration.json"} <= set(manifest["files"])
        for rel, entry in manifest["files"].items():  # recomputed, not trusted
            assert entry == {"bytes": (path / rel).stat().st_size, "digest": file_digest(path / rel)}


def test_a_checkpoint_without_manifest_is_skipped_unless_accepted_unverified(straight, tmp_path, capsys):
    """The newest checkpoint's manifest deleted: `resume=true` resumes from the previous checkpoint, saying
    why, and ends where the uninterrupted run ended; only `checkpoint.accept_unverified` takes the newest."""
    crashed = _copy(straight, tmp_path)
    checkpoints = crashed / "checkpoints"
    (checkpoints / "iter_000002" / ckpt.MANIFEST).unlink()
    said: list[str] = []
    assert find_resumable(checkpoints, say=said.append) == checkpoints / "iter_000001"  # the newest that verifies
    assert len(said) == 1 and "skipping checkpoint" in said[0] and "iter_000002: no manifest.json" in said[0]
    assert "checkpoint.accept_unverified=true" in said[0]
    said.clear()
    assert find_resumable(checkpoints, say=said.append, accept_unverified=True) == checkpoints / "iter_000002"
    assert len(said) == 1 and "unverified" in said[0]
    capsys.readouterr()
    history = run(composed(f"run_dir={crashed}", *RUN, "resume=true"))
    out = " ".join(capsys.readouterr().out.split())
    assert "skipping checkpoint" in out and "iter_000002: no manifest.json" in out, out
    assert len(history) == 1  # iteration 2 again, from iteration 1's checkpoint
    _assert_same_final_state(straight, crashed)


def test_a_file_that_verifies_but_does_not_load_is_damage_not_advice(straight, tmp_path, capsys):
    """The newest checkpoint's optimizer file zeroed and its manifest rewritten to match (a manifest that
    verifies): the resume falls back to the older checkpoint naming the file, and never repeats torch's
    advice to load with weights_only=False."""
    crashed = _copy(straight, tmp_path)
    newest = crashed / "checkpoints" / "iter_000002"
    _zero(newest / "optimizer-rank0.pt")
    manifest = json.loads((newest / ckpt.MANIFEST).read_text())
    manifest["files"]["optimizer-rank0.pt"]["digest"] = file_digest(newest / "optimizer-rank0.pt")
    (newest / ckpt.MANIFEST).write_text(json.dumps(manifest))
    capsys.readouterr()
    history = run(composed(f"run_dir={crashed}", *RUN, "resume=true"))
    out = " ".join(capsys.readouterr().out.split())
    assert "skipping checkpoint" in out and "optimizer-rank0.pt does not load as a torch file" in out, out
    assert "weights_only" not in out and len(history) == 1  # iteration 2 again, from iteration 1's checkpoint
    _assert_same_final_state(straight, crashed)


def _expected_kept(saved: list[int], config: CheckpointConfig) -> set[int]:
    """Plain twin of the retention rule: the newest keep_last saved, plus keep_every multiples."""
    kept = set(saved[-config.keep_last:])
    return kept | ({i for i in saved if i % config.keep_every == 0} if config.keep_every else set())


@pytest.mark.parametrize("config", [CheckpointConfig(keep_last=2, keep_every=3),
                                    CheckpointConfig(every=3, keep_last=2),
                                    CheckpointConfig(every=2, keep_last=1, keep_every=4)],
                         ids=["keep_every3", "every3", "every2_keep1_keep_every4"])
def test_retention_and_every_follow_the_config_and_delete_only_after_publishing(tmp_path, monkeypatch, config):
    """save_iteration over iterations 0..7 (7 the run's last): only due iterations are written, the
    directory holds exactly what the retention rule keeps, and older checkpoints are deleted only
    once `latest` names the new one."""
    parts = build(composed(f"run_dir={tmp_path}", *RUN), resume_from=None)
    checkpoints = parts.checkpoint_dir
    retire = ckpt._retire

    def watched(checkpoint_dir, newest, cfg):
        assert (checkpoint_dir / "latest").read_text() == f"iter_{newest:06d}", "deleting before publishing"
        return retire(checkpoint_dir, newest, cfg)

    monkeypatch.setattr(ckpt, "_retire", watched)
    saved: list[int] = []
    for it in range(8):
        out = save_iteration(parts, it, config, final=it == 7)
        due = it % config.every == 0 or it == 7
        assert (out is not None) == due
        if due:
            saved.append(it)
            assert find_resumable(checkpoints, say=pytest.fail) == out
        kept = {int(p.name.removeprefix("iter_")) for p in checkpoints.glob("iter_*")}
        assert kept == _expected_kept(saved, config), (it, kept)
        assert not list(checkpoints.glob(".tmp_*"))


def test_every_file_and_directory_is_fsynced_before_the_rename_and_latest_after(tmp_path, monkeypatch):
    parts = build(composed(f"run_dir={tmp_path}", *RUN), resume_from=None)
    checkpoints = parts.checkpoint_dir
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        real_fsync(fd)
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))

    def replace(src, dst):
        real_replace(src, dst)
        events.append(("replace", f"{src} -> {dst}"))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    final = save_iteration(parts, 0)
    tmp = str(checkpoints / ".tmp_iter_000000")
    rename = events.index(("replace", f"{tmp} -> {final}"))
    before = {path for kind, path in events[:rename] if kind == "fsync"}
    files = {str(Path(tmp) / rel) for rel in _all_files(final)}
    assert files <= before, f"not fsynced before the rename: {sorted(files - before)}"
    assert tmp in before and str(checkpoints) in before
    after = events[rename + 1:]
    # latest is written under a name unique to this writer (two runs never share a temporary file)
    publish = next(i for i, (kind, what) in enumerate(after) if kind == "replace"
                   and re.fullmatch(rf"{checkpoints / 'latest'}\.tmp-{os.getpid()}-[0-9a-f]{{8}} -> {checkpoints / 'latest'}", what))
    assert ("fsync", str(checkpoints)) in after[:publish], "the rename is not made durable before latest moves"
    assert ("fsync", str(checkpoints)) in after[publish + 1:], "latest's rename is not made durable"


def test_save_checkpoint_fsyncs_each_file_before_its_rename_and_the_directory_last(tmp_path, monkeypatch):
    """models/checkpoint.py on its own (a start checkpoint, an export): durable without the RL tree's
    fsync; a file is synced under its temporary name, the directory after every rename."""
    from models.checkpoint import save_checkpoint
    from models.model import HybridLM

    model = HybridLM(composed(*SMALL).model)
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (real_fsync(fd), events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))))
    monkeypatch.setattr(os, "replace", lambda a, b: (real_replace(a, b), events.append(("replace", str(b)))))
    save_checkpoint(model, tmp_path / "ckpt", max_shard_bytes=1 << 16)
    written = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert len(written) > 3 and [e for e in events if e[0] == "replace"] != []
    for name in written:
        final = str(tmp_path / "ckpt" / name)
        synced = [i for i, e in enumerate(events) if e[0] == "fsync" and e[1].startswith(final + f".tmp-{os.getpid()}-")]
        assert synced and synced[0] < events.index(("replace", final)), name
    assert events[-1] == ("fsync", str(tmp_path / "ckpt"))


def test_resume_reads_its_pickles_with_weights_only(straight, tmp_path, monkeypatch):
    """rl/run/checkpoint.py's torch.load never unpickles arbitrary objects (weights_only=True)."""
    copy = _copy(straight, tmp_path)
    parts = build(composed(f"run_dir={copy}", *RUN), resume_from=None)
    calls: list[tuple[str, object]] = []
    real_load = torch.load

    def load(f, *args, **kwargs):
        calls.append((Path(f).name, kwargs.get("weights_only")))
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", load)
    assert ckpt.load_iteration(parts, copy / "checkpoints" / "iter_000002") == 2
    assert ("rng-rank0.pt", True) in calls and ("optimizer-rank0.pt", True) in calls
    assert all(weights_only is True for _, weights_only in calls), calls  # every load, not one
