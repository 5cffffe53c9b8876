"""One optimizer step of the chunked, arena-backed, sharded trainer == plain torch AdamW."""
import pytest
import torch

from memory.grad_arena import ArenaFull, GradArena
from tests.trainer.plain import plain_packed_logprobs
from models.config import load_model_config
from models.model import HybridLM
from trainer.host_adam import OptimizerConfig
from trainer.step import Trainer, TrainerConfig

pytestmark = [pytest.mark.numerics]  # compares two computation orders: run under every CPU kernel path (make test-slow)

# eps 1e-4, not AdamW's 1e-8: the first step moves a weight by lr * g / (|g| + eps), so where |g| ~ eps
# the fp32 rounding of summing a gradient's terms in another order (DP ranks), ~3e-8 absolute for an
# embedding row that collects many tokens, is amplified by lr / eps. Seen with eps=1e-8: an entry with
# g = 4e-8 moved 8.8e-4 vs 8.0e-4 (every other entry within 1e-8). This is AdamW's conditioning,
# not the trainer's: with eps=1e-4 the same rounding stays below 1e-6.
OPT = OptimizerConfig(lr=1e-3, weight_decay=0.01, eps=1e-4, backend="torch")


def make_model(seed: int = 3) -> HybridLM:
    return HybridLM(load_model_config("configs/model/tiny.yaml")).init_weights(seed=seed, std=0.1)


def make_batch(seed: int = 0, lens=(33, 9, 50, 17)):
    gen = torch.Generator().manual_seed(seed)
    n = sum(lens)
    return (list(lens), torch.randint(0, 259, (n,), generator=gen), torch.randint(0, 259, (n,), generator=gen),
            torch.randn(n, generator=gen))


def reference_step(model: HybridLM, lens, tokens, targets, weights, opt_config: OptimizerConfig = OPT,
                   max_norm: float | None = None) -> torch.Tensor | None:
    """Plain torch: the whole model in one piece, `clip_grad_norm_(max_norm)` over every parameter
    when given, one AdamW step (zero, not None, gradients). Returns the pre-clip norm (None unclipped)."""
    opt = torch.optim.AdamW(model.parameters(), lr=opt_config.lr, betas=opt_config.betas, eps=opt_config.eps,
                            weight_decay=opt_config.weight_decay, foreach=False)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    packed = plain_packed_logprobs(model, lens, tokens, targets)
    (-(packed * weights).sum() / weights.numel()).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) if max_norm is not None else None
    opt.step()
    return norm


def rel_err(a, b) -> float:
    denom = b.double().norm()
    return ((a.double() - b.double()).norm() / denom).item() if denom > 0 else (a.double().norm()).item()


@pytest.mark.parametrize("micro_batch_tokens,num_micro,split", [(None, 1, "layers"), (40, 4, "layers"),
                                                                (40, 4, "params")])
def test_one_step_equals_plain_adamw_in_one_process(micro_batch_tokens, num_micro, split):
    lens, tokens, targets, weights = make_batch()
    ours, ref = make_model(), make_model()
    reference_step(ref, lens, tokens, targets, weights)
    trainer = Trainer(ours, TrainerConfig(num_chunks=4, chunk_split=split, optimizer=OPT))
    metrics = trainer.train_step(tokens, lens, targets, lambda lp, rows, seqs: -(lp * weights[rows]).sum() / weights.numel(),
                                 micro_batch_tokens=micro_batch_tokens)
    assert metrics["grad_slots_high_water"] <= 2 and metrics["micro_batches"] == num_micro
    assert trainer.arena.total_bytes < 4 * sum(p.numel() for p in ours.parameters())  # < the whole model's fp32 grads
    moved = 0
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert rel_err(p.detach(), q.detach()) <= 1e-6, name
        moved += int(not torch.equal(p.detach(), make_model().state_dict()[name]))
    assert moved > 0.9 * len(list(ours.parameters()))  # the step really changed the weights
    assert all(p.grad is None for p in ours.parameters())  # gradients left the device


def test_arena_slots_are_bounded_and_checked():
    arena = GradArena(slot_numel=10, num_slots=2)
    a = arena.acquire(0)
    a += 1
    arena.acquire(1)
    with pytest.raises(ArenaFull, match="all 2 slots held"):
        arena.acquire(2)
    arena.release(0)
    assert arena.acquire(2).abs().sum() == 0  # a reused slot comes back zeroed
    with pytest.raises(ValueError, match="chunk 5 holds no slot"):
        arena.release(5)
    arena.check_integrity()
    assert arena.high_water_slots == 2 and arena.total_bytes == 80


@pytest.mark.slow
def test_one_step_equals_plain_adamw_in_two_processes_over_gloo(tmp_path):
    """DP=2: the batch split between two ranks, gradients summed over gloo, optimizer shards per rank."""
    import os

    import torch.multiprocessing as mp

    from tests.trainer.dp_worker import run

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.environ["PYTHONPATH"] = root + os.pathsep + os.environ.get("PYTHONPATH", "")
    # budget 45: rank 0 packs its two sequences (33 + 9) in one micro-batch, rank 1 needs two (50, 17),
    # so rank 0 runs a zero-gradient round to keep the collectives in step
    mp.spawn(run, args=(2, str(tmp_path / "init"), str(tmp_path), 45), nprocs=2, join=True)
    lens, tokens, targets, weights = make_batch()
    ref = make_model()
    reference_step(ref, lens, tokens, targets, weights)
    expected = ref.state_dict()
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt")
        assert out["metrics"]["grad_slots_high_water"] <= 2
        assert out["metrics"]["micro_batches"] == [1, 2][rank]
        for name, tensor in out["state"].items():
            assert rel_err(tensor, expected[name]) <= 1e-6, (rank, name)


def test_resume_at_step_k_equals_uninterrupted_run_at_k_plus_2(tmp_path):
    batches = [make_batch(seed=s) for s in range(4)]

    def step(trainer, b):
        lens, tokens, targets, weights = b
        trainer.train_step(tokens, lens, targets, lambda lp, rows, seqs: -(lp * weights[rows]).sum() / weights.numel())

    straight = Trainer(make_model(), TrainerConfig(num_chunks=4, optimizer=OPT))
    for b in batches[:3]:
        step(straight, b)
    first = Trainer(make_model(), TrainerConfig(num_chunks=4, optimizer=OPT))
    step(first, batches[0])
    first.save(tmp_path / "ckpt")
    resumed = Trainer(make_model(seed=99), TrainerConfig(num_chunks=4, optimizer=OPT))  # different init: all must come from disk
    resumed.load(tmp_path / "ckpt")
    assert resumed.step_count == 1
    for b in batches[1:3]:
        step(resumed, b)
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="num_chunks=4; this trainer has world_size=1, num_chunks=2"):
        Trainer(make_model(), TrainerConfig(num_chunks=2, optimizer=OPT)).load(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="chunk_split='layers' .*; this trainer has chunk_split='params'"):
        Trainer(make_model(), TrainerConfig(num_chunks=4, chunk_split="params", optimizer=OPT)).load(tmp_path / "ckpt")


def test_non_finite_loss_skips_the_step_then_stops():
    lens, tokens, targets, weights = make_batch()
    model = make_model()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    trainer = Trainer(model, TrainerConfig(num_chunks=2, optimizer=OPT, max_bad_steps=1))
    metrics = trainer.train_step(tokens, lens, targets, lambda lp, rows, seqs: lp.sum() * float("nan"))
    assert metrics["skipped"] == 1.0 and trainer.step_count == 0
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())
    with pytest.raises(FloatingPointError, match="non-finite loss in 2 consecutive steps"):
        trainer.train_step(tokens, lens, targets, lambda lp, rows, seqs: lp.sum() * float("inf"))
    with pytest.raises(ValueError, match="empty batch"):
        trainer.train_step(tokens[:0], [], targets[:0], lambda lp, rows, seqs: lp.sum())


def test_a_batch_on_another_device_than_the_model_is_refused_before_any_work():
    """The batch must live where the model does (a CUDA model fed host tensors would otherwise
    fail deep in the forward); the meta device stands in for a GPU here."""
    lens, tokens, targets, _ = make_batch()
    model = make_model()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    trainer = Trainer(model, TrainerConfig(num_chunks=2, optimizer=OPT))
    with pytest.raises(ValueError, match=r"token_ids on meta, targets on cpu: the model and its gradients are on cpu"):
        trainer.train_step(tokens.to("meta"), lens, targets, lambda lp, rows, seqs: lp.sum())
    assert trainer.step_count == 0 and trainer.arena.num_held == 0
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())
    trainer.train_step(tokens, lens, targets, lambda lp, rows, seqs: (lp * rows.float()).sum() * 1e-4)  # rows live with lp
    assert trainer.step_count == 1


@pytest.mark.slow
def test_deepspeed_cpu_adam_backend_matches_plain_adamw():
    """DeepSpeed's JIT-built CPU Adam on the host shards (first build ~1 min, then cached)."""
    import dataclasses

    lens, tokens, targets, weights = make_batch()
    ours, ref = make_model(), make_model()
    reference_step(ref, lens, tokens, targets, weights)
    trainer = Trainer(ours, TrainerConfig(num_chunks=4, optimizer=dataclasses.replace(OPT, backend="deepspeed")))
    assert trainer.optimizer.backend == "deepspeed"
    trainer.train_step(tokens, lens, targets, lambda lp, rows, seqs: -(lp * weights[rows]).sum() / weights.numel())
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert rel_err(p.detach(), q.detach()) <= 1e-6, name


@pytest.mark.parametrize("num_chunks", [1, 3])
def test_deepspeed_adam_resume_at_step_3_is_bit_for_bit(tmp_path, num_chunks):
    """DeepSpeed's C++ Adam carries beta^t from call to call (a product for a step's first
    parameter, pow(beta, t) for the others); a resumed optimizer replays that, so a run resumed
    after 2 steps equals the run that never stopped (a fresh object alone would differ from step 3)."""
    ds = OptimizerConfig(lr=1e-3, weight_decay=0.01, eps=1e-4, backend="deepspeed")
    batches = [make_batch(seed=s) for s in range(4)]

    def step(trainer, b):
        lens, tokens, targets, weights = b
        trainer.train_step(tokens, lens, targets, lambda lp, rows, seqs: -(lp * weights[rows]).sum() / weights.numel())

    straight = Trainer(make_model(), TrainerConfig(num_chunks=num_chunks, optimizer=ds))
    assert straight.optimizer.backend == "deepspeed"
    for b in batches:
        step(straight, b)
    first = Trainer(make_model(), TrainerConfig(num_chunks=num_chunks, optimizer=ds))
    for b in batches[:2]:
        step(first, b)
    first.save(tmp_path / "ckpt")
    resumed = Trainer(make_model(seed=99), TrainerConfig(num_chunks=num_chunks, optimizer=ds))
    resumed.load(tmp_path / "ckpt")
    for b in batches[2:]:
        step(resumed, b)
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
