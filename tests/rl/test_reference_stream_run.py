"""RL runs with a KL reference: streamed through the gradient slots == resident, weights bit for bit."""
import json

import pytest
from safetensors.torch import load_file

from rl.train import run
from rl.run.build import build
from tests.rl.test_config import composed
from tests.rl.test_train_run import SMALL
from trainer.ref_stream import StreamedReference


def test_memory_reference_is_validated():
    assert composed().memory.reference == "stream"
    with pytest.raises(Exception, match="memory.reference='nvme', expected 'stream' or 'resident'"):
        composed("memory.reference=nvme")


def test_streamed_reference_run_equals_resident_run(tmp_path):
    results = {}
    for mode in ("stream", "resident"):
        # 6 groups of 8: at least one group with unequal rewards in the first iteration, so the first
        # update moves the policy (the KL term alone has zero gradient at the reference)
        cfg = composed(f"run_dir={tmp_path / mode}", "experiment.iterations=2", "algo.loss.kl_coef=0.1",
                       f"memory.reference={mode}", "tracking.plots=false", *SMALL, "algo.group_size=8",
                       "rollout.groups_per_iteration=6")
        history = run(cfg)
        assert len(history) == 2 and all(h["groups_trained"] == 6 for h in history)
        results[mode] = (history, load_file(tmp_path / mode / "checkpoints" / "iter_000001" / "model.safetensors"))
    (streamed, w_stream), (resident, w_resident) = results["stream"], results["resident"]
    # the reference runs the policy's own ops on its own weights: exactly zero before any update
    assert streamed[0]["loss/kl"] == 0.0
    assert streamed[1]["loss/kl"] > 0, "after one update the policy differs from the reference"
    assert [h["loss/kl"] for h in streamed] == [h["loss/kl"] for h in resident]
    assert w_stream.keys() == w_resident.keys() and all((w_stream[k] == w_resident[k]).all() for k in w_stream)
    summary = json.loads((tmp_path / "stream" / "summary.json").read_text())
    assert summary["iterations"] == 2.0


def test_build_streams_over_the_trainers_arena(tmp_path):
    cfg = composed(f"run_dir={tmp_path}", "algo.loss.kl_coef=0.1", *SMALL)
    parts = build(cfg, resume_from=None)
    assert isinstance(parts.ref_model, StreamedReference)
    assert parts.ref_model.arena is parts.trainer.arena and parts.ref_model.num_chunks == cfg.trainer.num_chunks
    assert sum(p.numel() for _, p in parts.ref_model.bound_parameters()) == 0  # nothing on the device between uses
    assert build(composed(f"run_dir={tmp_path}", *SMALL), resume_from=None).ref_model is None  # kl_coef 0
