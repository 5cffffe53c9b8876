"""Training attention and KDA in memory linear in the sequence length.

MLA in training (`PackedMixer.mla`) runs `models.mla.causal_attention` (flash / memory-efficient
SDPA kernels, never the [L, L] scores); its plain twin `causal_attention_dense` is the former path.
KDA in training checkpoints each 64-token segment (kernels/kda/naive.py): only segment inputs and
the state entering each segment are saved. Checked here: equality with the dense paths (outputs,
every parameter's gradient), and the memory shape: no op output of L x L elements anywhere in a
training step, saved bytes growing linearly with L."""
import contextlib
import random
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import models.model
from kernels.kda.naive import naive_chunk_kda
from models.config import load_model_config
from models.mla import causal_attention, causal_attention_dense
from models.model import HybridLM, PackedMixer
from models.state import SegmentBatch
from rl.plan.activation import SavedTensorMeter

pytestmark = [pytest.mark.numerics]  # compares two computation orders: run under every CPU kernel path (make test-slow)

TINY = "configs/model/tiny.yaml"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item() if b.norm() > 0 else a.norm().item()


class LargestOutput(TorchDispatchMode):
    """The most elements of any tensor an op returned (what a kernel materialises between ops)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.op = t.numel(), func
        return out


def train_pass(model: HybridLM, lens: list[int], seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 259, (sum(lens),), generator=gen)
    weight = torch.randn(sum(lens), model.config.hidden_size, generator=gen)
    model.zero_grad()
    out = model.run_layers(ids, PackedMixer(SegmentBatch(new_lens=lens, starts=[0] * len(lens))))
    (out * weight).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("seed", range(4))
def test_training_attention_equals_the_dense_path_over_random_packs(seed):
    """Random packed lengths, 1-token sequences included, rope on and off: outputs and every
    parameter's gradient within 1e-5 relative of the dense-scores path."""
    rng = random.Random(seed)
    lens = [rng.choice([1, 1, 2, rng.randint(3, 90)]) for _ in range(rng.randint(1, 6))]
    nope = "true" if seed % 2 else "false"
    model = HybridLM(load_model_config(TINY, [f"mla_use_nope={nope}"])).init_weights(seed=seed, std=0.1)
    got, got_grads = train_pass(model, lens, seed)
    with mock.patch.object(models.model, "causal_attention", causal_attention_dense):
        want, want_grads = train_pass(model, lens, seed)
    assert rel(got, want) <= 1e-5, lens
    assert got_grads.keys() == want_grads.keys()
    floor = 1e-6 * max(g.double().norm() for g in want_grads.values())  # see test_packed_mixer.py
    for name, want_grad in want_grads.items():
        err = (got_grads[name].double() - want_grad.double()).norm()
        assert err <= 1e-5 * want_grad.double().norm() + floor, (lens, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_attention_with_narrower_values_equals_its_dense_twin(dtype):
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 50, 24, generator=gen).to(dtype).requires_grad_() for _ in range(2))
    v = torch.randn(2, 3, 50, 16, generator=gen).to(dtype).requires_grad_()  # Dv < Dk, as MLA's
    grad = torch.randn(2, 3, 50, 16, generator=gen).to(dtype)
    out = causal_attention(q, k, v, 0.2)
    assert out.shape == (2, 3, 50, 16) and out.dtype == dtype
    got = (out, *torch.autograd.grad(out, (q, k, v), grad))
    ref = causal_attention_dense(q.float(), k.float(), v.float(), 0.2)
    want = (ref, *torch.autograd.grad(ref, (q, k, v), grad.float()))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(got, want):
        assert rel(a.float(), b) <= tol


def test_a_training_step_never_materialises_l_by_l():
    """One 2048-token sequence through the whole model, forward and backward: no op returns a
    tensor of L x L / 4 elements or more (the dense path made [H, L, L] scores per MLA layer; the
    KDA's per-segment [64, 64, K] decay and the logprob chunks stay far below)."""
    length = 2048
    model = HybridLM(load_model_config(TINY)).init_weights(seed=0, std=0.1)
    spy = LargestOutput()
    with spy:
        train_pass(model, [length])
    assert spy.numel < length * length // 4, (spy.numel, spy.op)
    with LargestOutput() as dense, mock.patch.object(models.model, "causal_attention", causal_attention_dense):
        train_pass(model, [length])
    assert dense.numel >= length * length  # the check can see the dense path's scores


def saved_bytes(model: HybridLM, length: int) -> int:
    meter = SavedTensorMeter(exclude=[*model.parameters(), *model.buffers()])
    with meter.hooks():
        train_pass(model, [length])
    return meter.peak


def test_saved_activations_grow_linearly_with_length():
    """The bytes autograd keeps for backward at 2048 tokens are ~4x those at 512 (linear), where
    L x L scores would make them ~16x."""
    model = HybridLM(load_model_config(TINY)).init_weights(seed=0, std=0.1)
    short, long = saved_bytes(model, 512), saved_bytes(model, 2048)
    assert 3.5 <= long / short <= 4.5, (short, long)


def test_kda_training_saves_segment_states_not_decay_tensors():
    """naive_chunk_kda under autograd (checkpointed segments) equals the same segments kept whole
    (gradients bit for bit), and its saved bytes per token do not grow with the length."""
    def run(length: int, recompute: bool):
        gen = torch.Generator().manual_seed(length)
        B, H, K, V = 1, 2, 32, 32
        q, k = (torch.nn.functional.normalize(torch.randn(B, length, H, K, generator=gen), dim=-1) for _ in range(2))
        v = torch.randn(B, length, H, V, generator=gen)
        g = -torch.rand(B, length, H, K, generator=gen) * 0.1
        beta = torch.rand(B, length, H, generator=gen)
        inputs = [x.requires_grad_() for x in (q, k, v, g, beta)]
        meter = SavedTensorMeter(exclude=inputs)
        keep_all = mock.patch("kernels.kda.naive.checkpoint", lambda fn, *a, **kw: fn(*a))
        with meter.hooks(), (contextlib.nullcontext() if recompute else keep_all):
            o, _, _ = naive_chunk_kda(*inputs)
        grads = torch.autograd.grad(o.square().sum(), inputs)
        return meter.peak, grads

    kept, kept_grads = run(512, recompute=False)
    short, short_grads = run(512, recompute=True)
    long, _ = run(2048, recompute=True)
    for a, b in zip(short_grads, kept_grads):
        assert torch.equal(a, b)
    assert short * 4 < kept  # the [64, 64, K] decay tensors are what the plain graph keeps
    assert 3.5 <= long / short <= 4.5, (short, long)


def test_kept_attention_gives_the_recompute_bit_for_bit():
    """The trainer's chunks keep each MLA output of the graph-free pass for the recompute: the
    step's loss, logprobs and every gradient are bit for bit those of recomputing the attention,
    and the kept entries are all taken back (none left over, none for the last chunk)."""
    from trainer.chunks import ChunkedModel

    model = HybridLM(load_model_config(TINY)).init_weights(seed=0, std=0.1)
    lens = [70, 1, 33]
    gen = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, 259, (sum(lens),), generator=gen) for _ in range(2))
    mixers = []
    original = PackedMixer.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        mixers.append(self)

    def step(keep: bool):
        model.zero_grad()
        recompute = mock.patch("models.model.causal_attention",
                               lambda q, k, v, scale, kept=None, key=None: causal_attention(q, k, v, scale))
        with mock.patch.object(PackedMixer, "__init__", spy), (contextlib.nullcontext() if keep else recompute):
            loss, logp = ChunkedModel(model, 2).forward_backward(tokens, lens, targets, lambda lp: -lp.sum())
        return loss, logp, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    import models.mla
    applied = []
    reuse = models.mla._KeptAttention.apply
    with mock.patch.object(models.mla._KeptAttention, "apply", lambda *a: applied.append(1) or reuse(*a)):
        kept_loss, kept_logp, kept_grads = step(True)
    assert applied, "the recompute took no kept attention output"
    assert mixers[-1].kept == {} and mixers[-1].kept is not None  # every kept output was taken back
    loss, logp, grads = step(False)
    assert torch.equal(kept_loss, loss) and torch.equal(kept_logp, logp)
    assert kept_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert torch.equal(kept_grads[name], grad), name
