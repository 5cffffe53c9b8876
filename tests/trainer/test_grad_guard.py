"""The gradient guard: the global gradient norm (FP32, over every rank's host shards), torch's
clip_grad_norm_ rule, a skipped step when the norm is not finite, and finite weights before a save.

AdamW's first step moves a weight by lr * g / (|g| + eps): nearly scale-free where |g| >> eps, so
the clipped-step tests use eps = 1e-2 (larger than most gradient entries) to make the update
depend on the gradient's scale; `test_the_clip_changes_the_step` shows the bound really separates
a clipped step from an unclipped one."""
import copy
import os

import pytest
import torch

from models.precision import cast_parameters
from tests.trainer.test_step import make_batch, make_model, rel_err
from tests.trainer.test_step import reference_step as plain_step
from trainer.host_adam import OptimizerConfig
from trainer.step import Trainer, TrainerConfig

pytestmark = [pytest.mark.numerics]  # compares two computation orders: run under every CPU kernel path (make test-slow)

OPT = OptimizerConfig(lr=1e-3, weight_decay=0.01, eps=1e-2, backend="torch")
MAX_NORM = 0.05
INJECTED = "model.layers.1.self_attn.o_proj.weight"
"""The parameter whose gradient gets an inf (in the middle of the model: neither the first nor the last chunk)."""


def loss_of(weights):
    return lambda lp, rows, seqs: -(lp * weights[rows]).sum() / weights.numel()


def reference_step(model, lens, tokens, targets, weights, max_norm):
    """tests/trainer/test_step.py's plain step with this file's optimizer and clip; the pre-clip norm."""
    return plain_step(model, lens, tokens, targets, weights, OPT, max_norm)


def poison(param: torch.nn.Parameter, value: float = float("inf")):
    """A tensor hook writing `value` into the first element of every gradient `param` receives."""
    def hook(grad):
        grad = grad.clone()
        grad.view(-1)[0] = value
        return grad

    return param.register_hook(hook)


def snapshot(trainer: Trainer) -> dict:
    return {"weights": {n: t.clone() for n, t in trainer.model.state_dict().items()},
            "optimizer": copy.deepcopy(trainer.optimizer.state_dict()), "step": trainer.step_count}


def assert_same(a, b, path="state"):
    if torch.is_tensor(a):
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


@pytest.mark.parametrize("micro_batch_tokens", [None, 40])
def test_clipped_step_equals_clip_grad_norm_then_adamw(micro_batch_tokens):
    lens, tokens, targets, weights = make_batch()
    ours, ref = make_model(), make_model()
    norm = reference_step(ref, lens, tokens, targets, weights, MAX_NORM)
    trainer = Trainer(ours, TrainerConfig(num_chunks=4, optimizer=OPT, max_grad_norm=MAX_NORM))
    metrics = trainer.train_step(tokens, lens, targets, loss_of(weights), micro_batch_tokens=micro_batch_tokens)
    # 1e-5: chunked recompute gradients equal a whole-model backward to ~1e-5 (tests/trainer/test_chunks.py)
    assert abs(metrics["grad_norm"] - norm.item()) <= 1e-5 * norm.item()
    assert metrics["grad_norm"] > 4 * MAX_NORM and metrics["grad_clip_coef"] < 0.25  # the clip is active
    assert metrics["skipped"] == 0.0 and metrics["nonfinite_grad"] == 0.0 and trainer.step_count == 1
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert rel_err(p.detach(), q.detach()) <= 1e-6, name


def test_the_clip_changes_the_step_and_none_leaves_it_alone():
    """Without clipping the trainer is plain AdamW (grad_norm still reported); that step is far from
    the clipped one, so the 1e-6 comparison above can fail."""
    lens, tokens, targets, weights = make_batch()
    ours, plain, clipped = make_model(), make_model(), make_model()
    norm = reference_step(plain, lens, tokens, targets, weights, max_norm=1e9)  # returns the norm, clips nothing
    reference_step(clipped, lens, tokens, targets, weights, MAX_NORM)
    trainer = Trainer(ours, TrainerConfig(num_chunks=4, optimizer=OPT))
    metrics = trainer.train_step(tokens, lens, targets, loss_of(weights))
    assert abs(metrics["grad_norm"] - norm.item()) <= 1e-5 * norm.item() and metrics["grad_clip_coef"] == 1.0
    far = 0
    for (name, p), q, c in zip(ours.named_parameters(), plain.parameters(), clipped.parameters()):
        assert rel_err(p.detach(), q.detach()) <= 1e-6, name
        far += rel_err(p.detach(), c.detach()) > 1e-4
    assert far > 0.5 * len(list(ours.parameters()))
    with pytest.raises(ValueError, match=r"max_grad_norm=0.0, expected > 0 or None"):
        TrainerConfig(max_grad_norm=0.0)


@pytest.mark.parametrize("dtype,value", [("fp32", float("inf")), ("fp32", float("nan")), ("bf16", float("inf"))])
def test_a_non_finite_gradient_skips_the_step_then_stops(dtype, value):
    lens, tokens, targets, weights = make_batch()
    model = make_model() if dtype == "fp32" else cast_parameters(make_model(), torch.bfloat16)
    trainer = Trainer(model, TrainerConfig(num_chunks=4, optimizer=OPT, max_grad_norm=MAX_NORM, max_bad_steps=2))
    trainer.train_step(tokens, lens, targets, loss_of(weights))  # a real step first: AdamW moments exist
    before = snapshot(trainer)
    handle = poison(dict(model.named_parameters())[INJECTED], value)
    for _ in range(2):
        metrics = trainer.train_step(tokens, lens, targets, loss_of(weights))
        assert metrics["skipped"] == 1.0 and metrics["nonfinite_grad"] == 1.0, metrics
        assert metrics["grad_norm"] != metrics["grad_norm"] or metrics["grad_norm"] == float("inf")
        assert abs(metrics["loss"]) < float("inf")  # the loss itself is finite
        assert_same(before, snapshot(trainer))  # weights, masters, moments, step counters: bit for bit
    with pytest.raises(FloatingPointError, match=r"non-finite gradient norm in 3 consecutive steps "
                                                 r"\(max_bad_steps=2\)"):
        trainer.train_step(tokens, lens, targets, loss_of(weights))
    assert_same(before, snapshot(trainer))
    handle.remove()
    trainer.bad_steps_in_a_row = 0
    assert trainer.train_step(tokens, lens, targets, loss_of(weights))["skipped"] == 0.0
    assert trainer.step_count == 2  # a finite step trains again


def test_save_refuses_non_finite_weights_naming_the_parameter(tmp_path):
    trainer = Trainer(make_model(), TrainerConfig(num_chunks=2, optimizer=OPT))
    trainer.save(tmp_path / "good")
    with torch.no_grad():
        dict(trainer.model.named_parameters())[INJECTED].view(-1)[5] = float("nan")
    with pytest.raises(FloatingPointError, match=f"refusing to save a checkpoint to .*bad: parameter '{INJECTED}' "
                                                 r"holds non-finite values"):
        trainer.save(tmp_path / "bad")
    assert not (tmp_path / "bad").exists()  # nothing written


def dp_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """2-process worker: one clipped step (the batch split by sequences), then an inf in one gradient
    of rank 1 only (skipped on both ranks), then again (max_bad_steps=1: raises on both ranks)."""
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from megatron.core import parallel_state

    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        lens, tokens, targets, weights = make_batch()
        half = len(lens) // 2
        mine = range(0, half) if rank == 0 else range(half, len(lens))
        offsets = [sum(lens[:i]) for i in range(len(lens) + 1)]
        rows = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in mine])
        w, total = weights[rows], weights.numel()
        trainer = Trainer(make_model(), TrainerConfig(num_chunks=4, optimizer=OPT, max_grad_norm=MAX_NORM,
                                                      max_bad_steps=1),
                          group=parallel_state.get_data_parallel_group())

        def step():
            return trainer.train_step(tokens[rows], [lens[i] for i in mine], targets[rows],
                                      lambda lp, r, seqs: -(lp * w[r]).sum() / total)

        out = {"metrics": step(), "state": {n: t.clone() for n, t in trainer.model.state_dict().items()}}
        before = snapshot(trainer)
        if rank == 1:
            poison(dict(trainer.model.named_parameters())[INJECTED])
        out["skipped_metrics"] = step()
        assert_same(before, snapshot(trainer))
        try:
            step()
            out["error"] = None
        except FloatingPointError as err:
            out["error"] = str(err)
        assert_same(before, snapshot(trainer))
        out["unchanged"] = True
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_two_processes_over_gloo_clip_like_one_and_skip_together(tmp_path):
    """DP=2: the global norm over both ranks' shards equals DP=1's, so does the clipped step; an inf
    in one gradient of rank 1 skips the step on both ranks (state bit for bit), then raises on both."""
    import torch.multiprocessing as mp

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.environ["PYTHONPATH"] = root + os.pathsep + os.environ.get("PYTHONPATH", "")
    mp.spawn(dp_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    lens, tokens, targets, weights = make_batch()
    one = Trainer(make_model(), TrainerConfig(num_chunks=4, optimizer=OPT, max_grad_norm=MAX_NORM))
    want = one.train_step(tokens, lens, targets, loss_of(weights))
    assert want["grad_clip_coef"] < 0.25
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt")
        got = out["metrics"]
        # 1e-5, as against the whole-model backward: the ranks' packed batches are bucketed differently
        assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-5 * want["grad_norm"], rank
        for name, tensor in out["state"].items():
            assert rel_err(tensor, one.model.state_dict()[name]) <= 1e-6, (rank, name)
        skipped = out["skipped_metrics"]
        assert skipped["skipped"] == 1.0 and skipped["nonfinite_grad"] == 1.0 and skipped["grad_norm"] == float("inf")
        assert out["unchanged"]
        assert out["error"] is not None and "non-finite gradient norm in 2 consecutive steps" in out["error"], rank
