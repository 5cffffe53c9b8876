"""RL runs with one copy of the weights and with bf16 parameters, and the dtype knob's errors.

The engine runs on the policy's own parameter tensors (a weight sync is a version bump); the run
must equal the former two-copy layout (the engine's own model, refreshed by a state-dict copy every
iteration) bit for bit in fp32."""
import functools
import json

import pytest
import torch
from safetensors.torch import load_file

import models.precision
import rl.train
from models.checkpoint import save_checkpoint
from models.config import load_model_config
from models.model import HybridLM
from models.precision import cast_parameters
from rl.train import run
from rl.run.build import build
from tests.rl.test_config import composed
from tests.rl.test_train_run import SMALL, records

FINAL = "checkpoints/iter_000001"


def test_the_engine_runs_on_the_policy_s_own_parameter_storage(tmp_path):
    parts = build(composed(f"run_dir={tmp_path}", *SMALL, "algo.loss.kl_coef=0.1"), resume_from=None)
    assert parts.engine.model is parts.policy
    policy = {n: p.data_ptr() for n, p in parts.policy.named_parameters()}
    engine = {n: p.data_ptr() for n, p in parts.engine.model.named_parameters()}
    assert engine == policy
    copy = build(composed(f"run_dir={tmp_path}/copy", *SMALL), resume_from=None, engine_copy=True)
    assert not {p.data_ptr() for p in copy.engine.model.parameters()} & {p.data_ptr() for p in copy.policy.parameters()}


def test_shared_weights_run_equals_the_two_copy_run_bit_for_bit(tmp_path, monkeypatch):
    shared, copied = tmp_path / "shared", tmp_path / "copied"
    overrides = ["experiment.iterations=2", *SMALL, "algo.loss.kl_coef=0.05"]
    run(composed(f"run_dir={shared}", *overrides))
    monkeypatch.setattr(rl.train, "build", functools.partial(build, engine_copy=True))
    run(composed(f"run_dir={copied}", *overrides))
    a, b = load_file(shared / FINAL / "model.safetensors"), load_file(copied / FINAL / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    oa, ob = (torch.load(d / FINAL / "optimizer-rank0.pt") for d in (shared, copied))
    assert all(torch.equal(x, y) for x, y in zip(oa["masters"], ob["masters"]))
    keys = ("reward_mean", "loss", "engine_checksum", "rollout_tokens")
    assert [[m[k] for k in keys] for m in records(shared / "metrics.jsonl")] == \
           [[m[k] for k in keys] for m in records(copied / "metrics.jsonl")]
    syncs = [r for r in records(shared / "phases.jsonl") if r["phase"] == "load_weights"]
    assert [r["bytes_moved"] for r in syncs] == [0, 0]  # a version bump copies nothing
    copies = [r for r in records(copied / "phases.jsonl") if r["phase"] == "load_weights"]
    assert all(r["bytes_moved"] > 0 for r in copies)
    # phases.jsonl: the weights counted once; the engine's CPU fused copies exist only while it generates
    shared_phases, copied_phases = records(shared / "phases.jsonl"), records(copied / "phases.jsonl")
    assert all(2 * a["memory"]["device_weights"] == b["memory"]["device_weights"]
               for a, b in zip(shared_phases, copied_phases))
    assert all(r["memory"]["engine_weight_copies"] > 0 for r in shared_phases if r["phase"] == "rollout")
    assert all(r["memory"]["engine_weight_copies"] == 0 for r in shared_phases if r["phase"] in ("train", "sleep"))


def test_without_releasing_the_pool_the_engine_still_drops_its_weight_copies_for_training(tmp_path):
    run(composed(f"run_dir={tmp_path}", "experiment.iterations=1", *SMALL, "memory.release_pool_in_train=false"))
    train = [r for r in records(tmp_path / "phases.jsonl") if r["phase"] == "train"]
    assert train and all(r["memory"]["engine_weight_copies"] == 0 and r["memory"]["device_pool"] > 0 for r in train)


def test_a_bf16_run_trains_with_half_the_weight_bytes(tmp_path):
    fp32, bf16 = tmp_path / "fp32", tmp_path / "bf16"
    overrides = ["experiment.iterations=2", *SMALL, "algo.loss.kl_coef=0.05"]
    run(composed(f"run_dir={fp32}", *overrides))
    history = run(composed(f"run_dir={bf16}", *overrides, "experiment.dtype=bf16"))
    assert all(h["groups_trained"] == 4 and h["skipped"] == 0.0 for h in history)
    weights = load_file(bf16 / FINAL / "model.safetensors")
    kinds = {t.dtype for t in weights.values()}
    assert kinds == {torch.bfloat16, torch.float32}  # router and KDA decay parameters stay float32
    assert json.loads((bf16 / FINAL / "trainer.json").read_text())["dtype"] == "bf16"
    masters = torch.load(bf16 / FINAL / "optimizer-rank0.pt")["masters"]
    assert {m.dtype for m in masters} == {torch.float32}
    size = {d: sum(t.numel() * t.element_size() for t in load_file(d / FINAL / "model.safetensors").values())
            for d in (fp32, bf16)}
    assert 0.5 <= size[bf16] / size[fp32] < 0.52


def test_dtype_values_are_checked_at_composition(monkeypatch):
    assert composed().experiment.dtype == "fp32" and composed().experiment.torch_dtype == torch.float32
    assert composed("experiment.dtype=bf16").experiment.torch_dtype == torch.bfloat16
    with pytest.raises(Exception, match=r"experiment.dtype='fp16', expected one of \['bf16', 'fp32'\]"):
        composed("experiment.dtype=fp16")
    with pytest.raises(Exception, match=r"engine.kda_state_dtype='int8', expected one of"):
        composed("engine.kda_state_dtype=int8")
    monkeypatch.setattr(models.precision, "bf16_matmul_works", lambda device: False)
    with pytest.raises(Exception, match=r"experiment.dtype='bf16' requested on cpu, which has no working bf16 matmul"):
        composed("experiment.dtype=bf16")
    composed("experiment.dtype=fp32")  # fp32 needs nothing


def test_a_checkpoint_of_another_dtype_is_refused_before_anything_is_written(tmp_path):
    start = tmp_path / "start"
    save_checkpoint(cast_parameters(HybridLM(load_model_config("configs/model/tiny.yaml")).init_weights(seed=1),
                                    torch.bfloat16), start)
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError, match=r"experiment.checkpoint=.* holds torch.bfloat16 weights but "
                                         r"experiment.dtype='fp32'.*set experiment.dtype to the checkpoint's \(bf16\)"):
        run(composed(f"run_dir={run_dir}", *SMALL, f"experiment.checkpoint={start}"))
    assert not run_dir.exists()
    history = run(composed(f"run_dir={run_dir}", *SMALL, f"experiment.checkpoint={start}", "experiment.dtype=bf16",
                           "experiment.iterations=1"))
    assert len(history) == 1
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    with pytest.raises(ValueError, match=r"was trained with experiment.dtype='bf16'; resuming it with "
                                         r"experiment.dtype='fp32' is refused"):
        run(composed(f"run_dir={run_dir}", *SMALL, "resume=true", "experiment.iterations=2"))
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before
