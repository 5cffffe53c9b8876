"""rl/run/tracking.py: metric files survive kills and resumes, plots and summary are written, wandb
is wired to persist its run id. wandb is always disabled or faked: no test touches the network."""
import json
import sys
import types

import numpy as np
import pytest

from rl.run.tracking import Tracker, TrackingConfig, read_jsonl

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
OFF = TrackingConfig(wandb_mode="disabled", progress=False)


def memory(device_pool: int, train_device: int, **extra: int) -> dict[str, int]:
    return {"device_pool": device_pool, "host_pool": 0, "train_device": train_device, "train_host": 0,
            "train_disk": 0, **extra}


def log_iterations(tracker: Tracker, iterations) -> None:
    for it in iterations:
        tracker.log(it, {"reward_mean": 0.1 * it, "reward_correct_frac": 0.05 * it, "num_tokens": 100 * it})
        tracker.log_phase(it, "rollout", 2.0, 0, memory(8 << 30, 0))
        tracker.log_phase(it, "train", 3.0, 4 << 30, memory(0, 6 << 30))


def test_log_appends_one_json_line_per_call(tmp_path):
    tracker = Tracker(tmp_path, OFF, run_config={"lr": 1e-6})
    log_iterations(tracker, [1, 2, 3])
    text = (tmp_path / "metrics.jsonl").read_text()
    assert text.endswith("\n")
    records = [json.loads(line) for line in text.splitlines()]
    assert records == [{"iteration": it, "reward_mean": 0.1 * it, "reward_correct_frac": 0.05 * it,
                        "num_tokens": 100 * it} for it in [1, 2, 3]]
    phases = read_jsonl(tmp_path / "phases.jsonl")
    assert [(p["iteration"], p["phase"]) for p in phases] == [(i, ph) for i in [1, 2, 3] for ph in ("rollout", "train")]
    assert phases[1] == {"iteration": 1, "phase": "train", "seconds": 3.0, "bytes_moved": 4 << 30,
                         "memory": memory(0, 6 << 30)}


def test_numpy_scalars_are_stored_as_plain_numbers(tmp_path):
    tracker = Tracker(tmp_path, OFF, run_config={})
    tracker.log(1, {"loss": np.float32(0.5), "num_steps": np.int64(4)})
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"iteration": 1, "loss": 0.5, "num_steps": 4}]


@pytest.mark.parametrize("bad", ["0.5", None, [1.0], True])
def test_non_numeric_metric_raises_and_writes_nothing(tmp_path, bad):
    tracker = Tracker(tmp_path, OFF, run_config={})
    with pytest.raises(TypeError, match="'reward_mean'"):
        tracker.log(1, {"loss": 1.0, "reward_mean": bad})
    assert read_jsonl(tmp_path / "metrics.jsonl") == []


def test_bad_wandb_mode_names_value_and_allowed_modes():
    with pytest.raises(ValueError, match="'ofline'") as err:
        TrackingConfig(wandb_mode="ofline")
    for mode in ("offline", "online", "disabled"):
        assert mode in str(err.value)


def test_resume_keeps_iterations_up_to_n_and_drops_later(tmp_path):
    log_iterations(Tracker(tmp_path, OFF, run_config={}), [1, 2, 3, 4, 5])
    resumed = Tracker(tmp_path, OFF, run_config={}, resume_from_iteration=3)
    assert [r["iteration"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert [r["iteration"] for r in read_jsonl(tmp_path / "phases.jsonl")] == [1, 1, 2, 2, 3, 3]
    log_iterations(resumed, [4])
    assert [r["iteration"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    assert not list(tmp_path.glob("*.tmp"))


def test_read_jsonl_tolerates_truncated_last_line(tmp_path):
    log_iterations(Tracker(tmp_path, OFF, run_config={}), [1, 2])
    path = tmp_path / "metrics.jsonl"
    with path.open("a") as f:
        f.write('{"iteration": 3, "reward_me')  # killed mid-write
    assert [r["iteration"] for r in read_jsonl(path)] == [1, 2]
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_read_jsonl_rejects_corruption_before_the_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 1}\n{"iterat\n{"iteration": 2}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_jsonl(path)


def test_resume_after_kill_mid_write_leaves_a_clean_file(tmp_path):
    log_iterations(Tracker(tmp_path, OFF, run_config={}), [1, 2])
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"iteration": 3, "rew')
    resumed = Tracker(tmp_path, OFF, run_config={}, resume_from_iteration=2)
    resumed.log(3, {"reward_mean": 0.3})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in lines] == [1, 2, 3]


def test_finish_writes_plots_and_summary(tmp_path, capsys):
    tracker = Tracker(tmp_path, OFF, run_config={})
    log_iterations(tracker, [1, 2, 3])
    # the memory plot takes any keys, including ones missing from some records
    tracker.log_phase(4, "sync_weights", 0.5, 1 << 30, {"device_pool": 1 << 30, "scratch": 123})
    tracker.finish({"final_reward_mean": 0.123456, "num_iterations": 3})
    for name in ("reward.png", "memory.png"):
        data = (tmp_path / name).read_bytes()
        assert len(data) > len(PNG_SIGNATURE) and data[:8] == PNG_SIGNATURE
    assert json.loads((tmp_path / "summary.json").read_text()) == {"final_reward_mean": 0.123456, "num_iterations": 3}
    out = capsys.readouterr().out
    assert "final_reward_mean" in out and "0.1235" in out and "0.123456" not in out


def test_a_warmup_and_the_mechanisms_are_plotted(tmp_path):
    """With a warm-up record the reward plot draws it before iteration 0; the mechanisms plot has a
    panel per mechanism with data (a run with none writes no mechanisms.png)."""
    tracker = Tracker(tmp_path, OFF, run_config={})
    for it in range(4):
        tracker.log(it, {"reward_mean": 0.3 + 0.1 * it, "prefix_hit_frac": 0.5, "ref_stream_s": 0.2,
                         "trajectories_carried": float(it % 2)})
        tracker.log_phase(it, "rollout", 1.0, 0, memory(8 << 20, 0, host_parked=1 << 20, disk_spilled=7 << 20))
    warmup = {"steps": [{"step": s, "loss": 3.0 - s} for s in range(3)], "reward_before": 0.0, "reward_after": 0.28,
              "seconds": 1.0}
    tracker.finish({"x": 1.0}, warmup=warmup, ceiling=0.034)
    for name in ("reward.png", "memory.png", "mechanisms.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_SIGNATURE
    other = tmp_path / "plain"
    tracker = Tracker(other, OFF, run_config={})
    log_iterations(tracker, [1, 2])
    tracker.finish({})
    assert (other / "reward.png").exists() and not (other / "mechanisms.png").exists()


def test_probes_add_their_figures_to_every_line(tmp_path):
    tracker = Tracker(tmp_path, OFF, run_config={})
    calls = iter([{"ref_stream_s": 0.5}, {}])
    tracker.add_probe(lambda: next(calls))
    tracker.log(0, {"reward_mean": 0.1})
    tracker.log(1, {"reward_mean": 0.2})
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"iteration": 0, "reward_mean": 0.1, "ref_stream_s": 0.5},
                                                      {"iteration": 1, "reward_mean": 0.2}]


@pytest.mark.parametrize("with_metrics", [False, True])
def test_finish_without_data_writes_no_plot(tmp_path, with_metrics):
    tracker = Tracker(tmp_path, OFF, run_config={})
    if with_metrics:
        tracker.log(1, {"loss": 1.0})  # no reward_mean, no phases: nothing to plot
    tracker.finish({})
    assert not (tmp_path / "reward.png").exists() and not (tmp_path / "memory.png").exists()
    assert json.loads((tmp_path / "summary.json").read_text()) == {}


def test_plots_off_writes_no_plot(tmp_path):
    tracker = Tracker(tmp_path, TrackingConfig(wandb_mode="disabled", progress=False, plots=False), run_config={})
    log_iterations(tracker, [1])
    tracker.finish({"x": 1.0})
    assert not list(tmp_path.glob("*.png"))


def drive_progress(tracker: Tracker) -> None:
    with tracker.rollout_progress(total=4) as bar:
        for done in range(1, 5):
            bar.update(done=done, tokens=1000 * done, kv_utilization=0.5, concurrency=3)
    with tracker.train_progress(total_steps=2) as bar:
        bar.advance(loss=0.75)
        bar.advance(loss=0.5)


def test_progress_off_prints_nothing(tmp_path, capsys):
    drive_progress(Tracker(tmp_path, OFF, run_config={}))
    assert capsys.readouterr() == ("", "")


def test_progress_on_shows_fields(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    drive_progress(Tracker(tmp_path, TrackingConfig(wandb_mode="disabled"), run_config={}))
    out = capsys.readouterr().out
    assert "rollout" in out and "4/4" in out and "tok/s" in out and "KV 50%" in out and "conc 3" in out
    assert "train" in out and "2/2" in out and "loss 0.5" in out


def test_disabled_never_imports_wandb(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # any `import wandb` now raises ImportError
    tracker = Tracker(tmp_path, OFF, run_config={})
    tracker.log(1, {"reward_mean": 1.0})
    tracker.finish({})
    assert not (tmp_path / "wandb_id.txt").exists()


class FakeRun:
    def __init__(self, calls: list):
        self.calls, self.summary = calls, {}

    def log(self, metrics, step):
        self.calls.append(("log", metrics, step))

    def finish(self):
        self.calls.append(("finish",))


def test_wandb_run_id_persists_across_resume(tmp_path, monkeypatch):
    calls = []

    def init(**kwargs):
        calls.append(("init", kwargs))
        return FakeRun(calls)

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    config = TrackingConfig(wandb_mode="offline", progress=False, plots=False, run_name="r1")
    first = Tracker(tmp_path, config, run_config={"lr": 1e-6})
    first.log(1, {"reward_mean": 0.5})
    Tracker(tmp_path, config, run_config={"lr": 1e-6}, resume_from_iteration=1).finish({"x": 1.0})
    inits = [c[1] for c in calls if c[0] == "init"]
    assert inits[0]["id"] == inits[1]["id"] == (tmp_path / "wandb_id.txt").read_text().strip()
    assert inits[0]["resume"] == "allow" and inits[0]["mode"] == "offline" and inits[0]["config"] == {"lr": 1e-6}
    assert inits[0]["project"] == "hybridrl" and inits[0]["name"] == "r1" and inits[0]["dir"] == str(tmp_path)
    assert ("log", {"reward_mean": 0.5}, 1) in calls and calls[-1] == ("finish",)


def _wandb_history(run_file) -> list[dict]:
    """The history rows of a wandb offline run file (`run-<id>.wandb`): LevelDB-log framed records (a 7-byte
    file header; 32 KiB blocks; each record: crc32 (4), length (2), type (1: full, 2: first, 3: middle,
    4: last)), each a wandb_internal_pb2.Record. Written here because wandb no longer ships a reader."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    raw, block, pos = run_file.read_bytes(), 32768, 7
    assert raw[:4] == b":W&B", raw[:7]
    payloads, partial = [], b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        data, pos = raw[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            payloads.append(partial + data)
            partial = b""
        elif kind in (2, 3):
            partial += data
    rows = []
    for payload in payloads:
        record = pb.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


@pytest.mark.slow
def test_wandb_offline_for_real_writes_the_logged_metrics(tmp_path):
    """The real wandb (what `make run` uses), offline: init writes its run under run_dir/wandb, and the run
    file holds every logged iteration's metrics at its step."""
    config = TrackingConfig(wandb_mode="offline", progress=False, plots=False, run_name="real")
    tracker = Tracker(tmp_path, config, run_config={"lr": 1e-6})
    tracker.log(0, {"reward_mean": 0.25, "loss": 1.5})
    tracker.log(1, {"reward_mean": 0.75, "loss": 0.5})
    tracker.finish({"reward_final": 0.75})
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    run_id = (tmp_path / "wandb_id.txt").read_text().strip()
    assert run_file.name == f"run-{run_id}.wandb"
    rows = [r for r in _wandb_history(run_file) if "reward_mean" in r]
    assert [(r["_step"], r["reward_mean"], r["loss"]) for r in rows] == [(0, 0.25, 1.5), (1, 0.75, 0.5)]
