"""The lr schedule: its shapes, the lr a trainer step really runs at, and resume continuing it."""
import dataclasses
import math

import pytest
import torch

from tests.trainer.test_step import OPT, make_batch, make_model, reference_step, rel_err
from trainer.lr_schedule import lr_factor
from trainer.host_adam import OptimizerConfig
from trainer.step import Trainer, TrainerConfig


def factors(name: str, num_steps: int, **kw) -> list[float]:
    return [lr_factor(name, s, **kw) for s in range(num_steps)]


def test_warmup_ramps_linearly_from_zero_then_every_schedule_starts_at_one():
    for name in ("constant", "linear", "cosine"):
        f = factors(name, 6, warmup_steps=4, min_lr_ratio=0.1, total_steps=20)
        assert f[:4] == [1 / 5, 2 / 5, 3 / 5, 4 / 5]  # (step + 1) / (warmup + 1): never a step at lr 0
        assert f[4] == 1.0 and f[5] <= 1.0


def test_constant_is_exactly_one_without_warmup_or_horizon():
    assert factors("constant", 50, warmup_steps=0, min_lr_ratio=0.5, total_steps=None) == [1.0] * 50


@pytest.mark.parametrize("name", ["linear", "cosine"])
@pytest.mark.parametrize("min_lr_ratio", [0.0, 0.1])
def test_decays_monotonically_to_the_floor_at_total_steps_and_stays_there(name, min_lr_ratio):
    kw = dict(warmup_steps=3, min_lr_ratio=min_lr_ratio, total_steps=13)
    f = factors(name, 20, **kw)
    decay = f[3:14]
    assert all(a > b for a, b in zip(decay, decay[1:]))
    assert f[13] == pytest.approx(min_lr_ratio, abs=1e-12) and f[12] > min_lr_ratio
    assert all(x == pytest.approx(min_lr_ratio, abs=1e-12) for x in f[13:])
    middle = lr_factor(name, 8, **kw)  # halfway through the decay: both schedules at the mean of 1 and the floor
    assert middle == pytest.approx((1 + min_lr_ratio) / 2, abs=1e-12)
    quarter = lr_factor(name, 3 + 10 // 4, **kw)  # progress 0.2
    expected = (1 - 0.2) if name == "linear" else 0.5 * (1 + math.cos(math.pi * 0.2))
    assert quarter == pytest.approx(min_lr_ratio + (1 - min_lr_ratio) * expected, abs=1e-12)


@pytest.mark.parametrize("bad,message", [
    (dict(lr_schedule="step"), "lr_schedule='step', expected one of"),
    (dict(warmup_steps=-1), "warmup_steps=-1, expected >= 0"),
    (dict(min_lr_ratio=-0.1), r"min_lr_ratio=-0.1, expected a value in \[0, 1\]"),
    (dict(min_lr_ratio=1.5), r"min_lr_ratio=1.5, expected a value in \[0, 1\]"),
    (dict(warmup_steps=11, total_steps=10), "warmup_steps=11 > total_steps=10"),
    (dict(total_steps=0), "total_steps=0, expected >= 1"),
])
def test_config_rejects_bad_values_naming_them(bad, message):
    with pytest.raises(ValueError, match=message):
        OptimizerConfig(**bad)


def test_the_horizon_from_the_trainer_is_checked_and_a_decay_needs_one():
    with pytest.raises(ValueError, match="warmup_steps=5 > total_steps=4"):
        Trainer(make_model(), TrainerConfig(num_chunks=2, optimizer=dataclasses.replace(OPT, warmup_steps=5)),
                total_steps=4)
    with pytest.raises(ValueError, match="lr_schedule='cosine' decays over total_steps, but none is known"):
        Trainer(make_model(), TrainerConfig(num_chunks=2, optimizer=dataclasses.replace(OPT, lr_schedule="cosine")))
    cfg = dataclasses.replace(OPT, lr_schedule="linear", total_steps=7)
    assert Trainer(make_model(), TrainerConfig(num_chunks=2, optimizer=cfg), total_steps=100).optimizer.total_steps == 7


def loss_fn(weights):
    return lambda lp, rows, seqs: -(lp * weights[rows]).sum() / weights.numel()


@pytest.mark.parametrize("backend", ["torch", "deepspeed"])
def test_a_step_runs_at_the_scheduled_lr_and_the_configured_lr_stays_in_the_param_groups(backend):
    """Warm-up of 3: the first step runs at lr / 4, i.e. equals plain AdamW at lr / 4."""
    cfg = dataclasses.replace(OPT, backend=backend, lr_schedule="cosine", warmup_steps=3, total_steps=10)
    lens, tokens, targets, weights = make_batch()
    ours, ref = make_model(), make_model()
    reference_step(ref, lens, tokens, targets, weights, dataclasses.replace(OPT, lr=OPT.lr / 4))
    trainer = Trainer(ours, TrainerConfig(num_chunks=2, optimizer=cfg))
    assert trainer.optimizer.backend == backend
    metrics = trainer.train_step(tokens, lens, targets, loss_fn(weights))
    assert metrics["lr"] == OPT.lr / 4
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert rel_err(p.detach(), q.detach()) <= 1e-6, name
    assert [g["lr"] for g in trainer.optimizer.adam.param_groups] == [OPT.lr]
    assert trainer.optimizer.schedule_step == 1 and trainer.optimizer.lr == OPT.lr * 2 / 4


@pytest.mark.parametrize("backend", ["torch", "deepspeed"])
def test_resume_continues_the_schedule_bit_for_bit(tmp_path, backend):
    cfg = dataclasses.replace(OPT, backend=backend, lr_schedule="linear", warmup_steps=1, min_lr_ratio=0.2)
    batches = [make_batch(seed=s) for s in range(4)]

    def run(trainer, bs):
        return [trainer.train_step(b[1], b[0], b[2], loss_fn(b[3]))["lr"] for b in bs]

    straight = Trainer(make_model(), TrainerConfig(num_chunks=2, optimizer=cfg), total_steps=4)
    lrs = run(straight, batches)
    assert lrs == pytest.approx([OPT.lr * f for f in (0.5, 1.0, 0.2 + 0.8 * 2 / 3, 0.2 + 0.8 / 3)], rel=1e-12)
    first = Trainer(make_model(), TrainerConfig(num_chunks=2, optimizer=cfg), total_steps=4)
    run(first, batches[:2])
    first.save(tmp_path / "ckpt")
    resumed = Trainer(make_model(seed=9), TrainerConfig(num_chunks=2, optimizer=cfg), total_steps=4)
    resumed.load(tmp_path / "ckpt")
    assert resumed.optimizer.schedule_step == 2
    assert run(resumed, batches[2:]) == lrs[2:]
    for (name, p), q in zip(resumed.model.named_parameters(), straight.model.parameters()):
        assert torch.equal(p, q), name


def test_shards_saved_before_the_schedule_resume_at_adams_step_count(tmp_path):
    cfg = dataclasses.replace(OPT, lr_schedule="linear", total_steps=10)
    trainer = Trainer(make_model(), TrainerConfig(num_chunks=2, optimizer=cfg))
    lens, tokens, targets, weights = make_batch()
    for _ in range(3):
        trainer.train_step(tokens, lens, targets, loss_fn(weights))
    state = trainer.optimizer.state_dict()
    del state["schedule_step"]
    other = Trainer(make_model(), TrainerConfig(num_chunks=2, optimizer=cfg))
    other.optimizer.load_state_dict(state)
    assert other.optimizer.schedule_step == 3 and other.optimizer.lr == trainer.optimizer.lr


def test_unscheduled_steps_keep_the_groups_lr_and_do_not_advance_the_schedule():
    cfg = dataclasses.replace(OPT, warmup_steps=4)
    trainer = Trainer(make_model(), TrainerConfig(num_chunks=2, optimizer=cfg))
    lens, tokens, targets, weights = make_batch()
    with trainer.optimizer.unscheduled():
        for g in trainer.optimizer.adam.param_groups:
            g["lr"] = 0.5
        assert trainer.train_step(tokens, lens, targets, loss_fn(weights))["lr"] == 0.5
        for g in trainer.optimizer.adam.param_groups:
            g["lr"] = OPT.lr
    assert trainer.optimizer.schedule_step == 0
    assert trainer.train_step(tokens, lens, targets, loss_fn(weights))["lr"] == OPT.lr / 5
