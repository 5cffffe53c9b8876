"""bf16 parameters with FP32 main gradients (Megatron's recipe) in the trainer.

The plain reference of the recipe: the whole model in one piece on bf16 weights (the same packed
forward as the trainer's chunks), each micro-batch's bf16 gradients added into FP32 buffers,
torch AdamW on FP32 masters, masters cast back into the bf16 weights. The trainer's masters must
equal the reference's to 1e-6 relative (the only differences are fp32 summation orders)."""
import os

import pytest
import torch

from models.model import HybridLM, PackedMixer
from models.precision import KEEP_FP32, cast_parameters
from models.state import SegmentBatch
from tests.trainer.test_step import OPT, make_batch, make_model, rel_err
from trainer.step import Trainer, TrainerConfig, micro_batches

pytestmark = [pytest.mark.numerics]  # compares two computation orders: run under every CPU kernel path (make test-slow)

BF16 = torch.bfloat16


def bf16_model(seed: int = 3) -> HybridLM:
    return cast_parameters(make_model(seed), BF16)


def reference_recipe_step(model: HybridLM, lens, tokens, targets, weights, budget=None) -> list[torch.Tensor]:
    """One step of the recipe, written plainly; returns the FP32 masters (model order) and updates
    `model`'s parameters to their cast."""
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    main_grads = [torch.zeros_like(m) for m in masters]
    offsets = [sum(lens[:i]) for i in range(len(lens) + 1)]
    for seqs in micro_batches(lens, budget):
        rows = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in seqs])
        sub = [lens[i] for i in seqs]
        hidden = model.run_layers(tokens[rows], PackedMixer(SegmentBatch(new_lens=sub, starts=[0] * len(sub))))
        logp = model.packed_logprobs(hidden, targets[rows])
        (-(logp * weights[rows]).sum() / weights.numel()).backward()
        for g, p in zip(main_grads, params):
            if p.grad is not None:
                g.add_(p.grad.float())  # the FP32 main gradient of this micro-batch's bf16 gradient
                p.grad = None
    opt = torch.optim.AdamW(masters, lr=OPT.lr, betas=OPT.betas, eps=OPT.eps, weight_decay=OPT.weight_decay,
                            foreach=False)
    for m, g in zip(masters, main_grads):
        m.grad = g
    opt.step()
    with torch.no_grad():
        for p, m in zip(params, masters):
            p.copy_(m.to(p.dtype))
    return [m.detach() for m in masters]


def trainer_masters(trainer: Trainer) -> list[torch.Tensor]:
    """The trainer's FP32 masters unflattened per parameter, model order (one rank: whole chunks)."""
    out = {}
    for params, master in zip(trainer.chunk_params, trainer.optimizer.masters):
        offset = 0
        for p in params:
            out[id(p)] = master.data[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
    return [out[id(p)] for p in trainer.model.parameters()]


def test_cast_keeps_the_routing_and_decay_parameters_in_fp32():
    model = bf16_model()
    kinds = {n: p.dtype for n, p in model.named_parameters()}
    assert {kinds[n] for n in kinds if n.endswith(KEEP_FP32)} == {torch.float32}
    assert {kinds[n] for n in kinds if not n.endswith(KEEP_FP32)} == {BF16}
    assert all(b.dtype == torch.float32 for b in model.buffers())  # router correction biases


@pytest.mark.parametrize("budget", [None, 40])
def test_one_bf16_step_equals_the_plain_recipe(budget):
    lens, tokens, targets, weights = make_batch()
    ours, ref = bf16_model(), bf16_model()
    expected = reference_recipe_step(ref, lens, tokens, targets, weights, budget)
    trainer = Trainer(ours, TrainerConfig(num_chunks=4, optimizer=OPT))
    bound = []  # what a bf16 parameter's .grad holds when its chunk's gradients are handed over

    def watch(c):
        bound.extend(p.grad for p in trainer.chunk_params[c] if p.dtype == BF16)
        reduce(c)

    reduce, trainer._reduce_and_release = trainer._reduce_and_release, watch
    trainer.train_step(tokens, lens, targets, lambda lp, rows, seqs: -(lp * weights[rows]).sum() / weights.numel(),
                       micro_batch_tokens=budget)
    assert bound and all(g is None for g in bound)  # the real gradient lives in the FP32 slot only
    for (name, p), got, want in zip(ours.named_parameters(), trainer_masters(trainer), expected):
        assert got.dtype == torch.float32
        assert rel_err(got, want) <= 1e-6, name
        assert torch.equal(p.detach(), got.to(p.dtype)), name  # the device weights are the masters' cast
    start = bf16_model()  # the masters moved (a bf16 weight near 1.0 may not: its spacing there is 2**-7)
    moved = sum(not torch.equal(m, p.detach().float()) for m, p in zip(trainer_masters(trainer), start.parameters()))
    assert moved > 0.9 * len(list(start.parameters()))
    assert all(p.grad is None and getattr(p, "main_grad", None) is None for p in ours.parameters())


def test_bf16_masters_are_not_the_bf16_weights():
    """Small updates accumulate in the FP32 masters even where the bf16 weight cannot move yet."""
    lens, tokens, targets, weights = make_batch()
    model = bf16_model()
    trainer = Trainer(model, TrainerConfig(num_chunks=2, optimizer=OPT))
    start = [m.clone() for m in trainer_masters(trainer)]
    trainer.train_step(tokens, lens, targets, lambda lp, rows, seqs: -(lp * weights[rows]).sum() * 1e-3)
    finer = 0
    for p, master, before in zip(model.parameters(), trainer_masters(trainer), start):
        assert torch.equal(master.to(p.dtype), p.detach())
        if p.dtype == BF16 and not torch.equal(master, before):
            finer += not torch.equal(master, p.detach().float())  # the master keeps what the cast drops
    assert finer > 0.9 * sum(p.dtype == BF16 for p in model.parameters())


def test_a_bf16_checkpoint_resumes_bit_for_bit_and_refuses_another_dtype(tmp_path):
    batches = [make_batch(seed=s) for s in range(3)]

    def step(trainer, b):
        lens, tokens, targets, weights = b
        trainer.train_step(tokens, lens, targets, lambda lp, rows, seqs: -(lp * weights[rows]).sum() / weights.numel())

    straight = Trainer(bf16_model(), TrainerConfig(num_chunks=4, optimizer=OPT))
    for b in batches:
        step(straight, b)
    first = Trainer(bf16_model(), TrainerConfig(num_chunks=4, optimizer=OPT))
    step(first, batches[0])
    first.save(tmp_path / "ckpt")
    resumed = Trainer(bf16_model(seed=99), TrainerConfig(num_chunks=4, optimizer=OPT))
    resumed.load(tmp_path / "ckpt")
    for b in batches[1:]:
        step(resumed, b)
    for a, b in zip(straight.optimizer.masters, resumed.optimizer.masters):
        assert torch.equal(a, b)
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    fp32 = Trainer(make_model(), TrainerConfig(num_chunks=4, optimizer=OPT))
    before = [p.detach().clone() for p in fp32.model.parameters()]
    with pytest.raises(ValueError, match=r"written by a dtype='bf16' run; this trainer's parameters are dtype='fp32'"):
        fp32.load(tmp_path / "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(before, fp32.model.parameters()))  # nothing loaded


@pytest.mark.slow
def test_bf16_two_processes_over_gloo_equal_one_process(tmp_path):
    """DP=2 in bf16 equals DP=1 in bf16: each rank's FP32 slot is reduce-scattered, masters compared.
    Bound 1e-6 relative on the masters, as in fp32: the ranks add the same bf16 per-sequence
    gradients into FP32 in another order (the bf16 forward of a sequence does not depend on its
    batch neighbours: buckets are padded and causal)."""
    import torch.multiprocessing as mp

    from tests.trainer.dp_worker import run

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.environ["PYTHONPATH"] = root + os.pathsep + os.environ.get("PYTHONPATH", "")
    mp.spawn(run, args=(2, str(tmp_path / "init"), str(tmp_path), 45, "bf16"), nprocs=2, join=True)
    lens, tokens, targets, weights = make_batch()
    one = Trainer(bf16_model(), TrainerConfig(num_chunks=4, optimizer=OPT))
    one.train_step(tokens, lens, targets, lambda lp, rows, seqs: -(lp * weights[rows]).sum() / weights.numel(),
                   micro_batch_tokens=45)
    flat_one = [m.detach() for m in one.optimizer.masters]  # [chunk numel] each (world 1: no padding)
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt")
        for c, (mine, whole) in enumerate(zip(out["masters"], flat_one)):
            shard = mine.numel()
            piece = whole[rank * shard:(rank + 1) * shard]
            assert rel_err(mine[:piece.numel()], piece) <= 1e-6, (rank, c)
        flipped, total = 0, 0
        for name, tensor in out["state"].items():
            want = one.model.state_dict()[name]
            assert tensor.dtype == want.dtype
            if not tensor.is_floating_point():
                continue
            if tensor.dtype != torch.bfloat16:  # the parameters kept in FP32: their masters' bound
                assert rel_err(tensor, want) <= 1e-6, (rank, name)
                continue
            # a master within 1e-6 may still round to the neighbouring bf16 value, never further
            # (same-sign bf16 values are neighbours when their bit patterns differ by one)
            steps = (tensor.view(torch.int16).int() - want.view(torch.int16).int()).abs()
            assert int(steps.max()) <= 1, (rank, name, int(steps.max()))
            flipped, total = flipped + int((steps > 0).sum()), total + tensor.numel()
        assert flipped <= 1e-3 * total, (rank, flipped, total)  # over the whole model
