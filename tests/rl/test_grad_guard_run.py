"""The gradient guard in a real RL run of the tiny model: an inf written into one gradient (a tensor
hook on one policy parameter) skips that iteration's update on the trainer (weights and optimizer
state bit for bit), the run goes on and finishes; an inf in every iteration stops the run after
trainer.max_bad_steps skipped steps with the trainer's error."""
import copy

import pytest
import torch

import rl.train
from rl.train import run
from tests.rl.test_config import composed
from tests.rl.test_train_run import SMALL

INJECTED = "model.layers.1.self_attn.o_proj.weight"
RUN = [*SMALL, "rollout.groups_per_iteration=8", "algo.group_size=8"]
"""Enough groups that every iteration has one with unequal rewards (GRPO: a non-zero gradient)."""


def inject_inf(monkeypatch, poisoned_steps) -> list[dict]:
    """Patch rl.train.build so the run's policy gets a hook writing inf into one element of
    INJECTED's gradient during the trainer steps numbered in `poisoned_steps` (0-based, or "all").
    Returns a list filled with one record per train_step: the trainer's state before and after."""
    calls: list[dict] = []
    build = rl.train.build

    def patched(*args, **kwargs):
        parts = build(*args, **kwargs)
        trainer = parts.trainer
        param = dict(parts.policy.named_parameters())[INJECTED]
        poisoned = {"on": False}

        def hook(grad):
            if not poisoned["on"]:
                return grad
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
            return grad

        param.register_hook(hook)
        train_step = trainer.train_step

        def state():
            return {"weights": {n: t.clone() for n, t in parts.policy.state_dict().items()},
                    "optimizer": copy.deepcopy(trainer.optimizer.state_dict()), "step": trainer.step_count}

        def watched(*a, **k):
            poisoned["on"] = poisoned_steps == "all" or len(calls) in poisoned_steps
            record = {"poisoned": poisoned["on"], "before": state()}
            calls.append(record)
            record["metrics"] = train_step(*a, **k)
            record["after"] = state()
            return record["metrics"]

        trainer.train_step = watched
        return parts

    monkeypatch.setattr(rl.train, "build", patched)
    return calls


def same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_an_inf_gradient_skips_that_update_and_the_run_goes_on(tmp_path, monkeypatch):
    calls = inject_inf(monkeypatch, poisoned_steps={1})
    history = run(composed(f"run_dir={tmp_path}", "experiment.iterations=3", *RUN))
    assert len(history) == 3 and [c["poisoned"] for c in calls] == [False, True, False]
    assert [h["skipped"] for h in history] == [0.0, 1.0, 0.0]
    assert [h["nonfinite_grad"] for h in history] == [0.0, 1.0, 0.0]
    assert history[1]["grad_norm"] == float("inf") and all(0 < history[i]["grad_norm"] < float("inf") for i in (0, 2))
    # trainer.max_grad_norm (default 1.0) reaches the trainer: these norms are clipped
    assert all(history[i]["grad_norm"] > 1.0 and history[i]["grad_clip_coef"] == pytest.approx(
        1.0 / history[i]["grad_norm"], rel=1e-5) for i in (0, 2))
    assert same(calls[1]["before"], calls[1]["after"])  # weights, masters, moments, step: untouched
    assert calls[2]["before"]["step"] == 1 and calls[2]["after"]["step"] == 2
    for i in (0, 2):  # the other iterations did train
        assert not same(calls[i]["before"]["weights"], calls[i]["after"]["weights"])
    # the engine ran the same weights in iterations 1 and 2 (the skipped update changed nothing)
    assert history[2]["engine_checksum"] == history[1]["engine_checksum"] != history[0]["engine_checksum"]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "iter_000002"
    assert all(torch.isfinite(t).all() for t in calls[2]["after"]["weights"].values())


def test_an_inf_gradient_in_every_iteration_stops_the_run_after_max_bad_steps(tmp_path, monkeypatch):
    calls = inject_inf(monkeypatch, poisoned_steps="all")
    with pytest.raises(FloatingPointError, match=r"non-finite gradient norm in 3 consecutive steps "
                                                 r"\(max_bad_steps=2\)"):
        run(composed(f"run_dir={tmp_path}", "experiment.iterations=5", "trainer.max_bad_steps=2", *RUN))
    assert len(calls) == 3 and all(same(c["before"], c["after"]) for c in calls[:2])
    assert (tmp_path / "checkpoints" / "latest").read_text() == "iter_000001"  # the two skipped iterations
