"""Routed MoE experts: the sync-free grouped path (grouped matmul and padded forms) against the
per-expert loop reference, alone and inside the engine, and an audit that it reads nothing back."""
import dataclasses

import pytest
import torch
from torch.overrides import TorchFunctionMode

from models import mlp
from models.config import load_model_config
from models.mlp import EXPERT_IMPLS, Experts, experts_grouped, experts_loop, grouped_mm_usable
from models.model import HybridLM
from rollout.engine import Engine, EngineConfig
from rollout.sampling import SamplingParams

pytestmark = [pytest.mark.numerics]  # compares two computation orders: run under every CPU kernel path (make test-slow)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def problem(num_tokens, top_k, num_experts, dim, inter, dtype=torch.float32, device="cpu", seed=0):
    """Random x [N, D], weights w1, w3 [E, I, D], w2 [E, D, I] (requires grad), and a routing
    (weights, ids [N, top_k]) that leaves some experts without tokens when N * top_k is small."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(shape, generator=gen) * scale).to(device, dtype).requires_grad_()

    x = rand(num_tokens, dim)
    w1 = rand(num_experts, inter, dim, scale=dim ** -0.5)
    w3 = rand(num_experts, inter, dim, scale=dim ** -0.5)
    w2 = rand(num_experts, dim, inter, scale=inter ** -0.5)
    ids = torch.rand(num_tokens, num_experts, generator=gen).topk(top_k, dim=-1).indices.to(device)
    weights = torch.rand(num_tokens, top_k, generator=gen).to(device).requires_grad_()  # float32, as the router's
    return x, weights, ids, w1, w2, w3


def run(fn, inputs, **kwargs):
    """Output and gradients of (x, weights, w1, w2, w3) for a fixed random output gradient."""
    x, weights, ids, w1, w2, w3 = inputs
    out = fn(x, weights, ids, w1, w2, w3, **kwargs)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    return (out, *torch.autograd.grad(out, (x, weights, w1, w2, w3), grad))


# (N, top_k, E, D, I): odd token counts; experts left empty (5 * 2 rows for 16 experts: decode);
# D, I multiples of 4 (fp32's 16 bytes: "grouped" runs torch._grouped_mm) and not (it falls back to
# the dense path at 29x4x9, to the blocked form at 150x2x32; "padded" always runs the blocked form).
SIZES = [(37, 3, 11, 20, 12), (5, 2, 16, 16, 8), (63, 8, 64, 32, 16), (29, 4, 9, 17, 13), (150, 2, 32, 17, 13)]


@pytest.mark.parametrize("padded", [False, True], ids=["grouped", "padded"])
@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
def test_grouped_equals_the_loop_forward_and_backward(size, padded):
    inputs = problem(*size)
    want = run(experts_loop, inputs)
    got = run(experts_grouped, inputs, padded=padded)
    for name, g, w in zip(["out", "x", "weights", "w1", "w2", "w3"], got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert rel(g, w) <= 1e-6, (name, rel(g, w))


def test_grouped_mm_runs_where_its_rules_allow_and_falls_back_loudly(monkeypatch):
    x, _, _, w1, _, _ = problem(4, 2, 8, 20, 12)
    assert grouped_mm_usable(x, w1)  # the fp32 grouped_mm cases above really ran torch._grouped_mm
    monkeypatch.setattr(mlp, "_GROUPED_MM", {})
    x, _, _, w1, _, _ = problem(4, 2, 8, 17, 13)
    with pytest.warns(UserWarning, match=r"torch._grouped_mm not used .*multiples of 4.*padded"):
        assert not grouped_mm_usable(x, w1)
    assert not grouped_mm_usable(x, w1)  # once per case: no second warning (pytest.warns would fail above)


def test_every_impl_of_the_module_agrees_and_a_bad_impl_is_refused():
    x, weights, ids, w1, w2, w3 = problem(23, 2, 8, 16, 12)
    experts = Experts(8, 16, 12)
    with torch.no_grad():
        experts.w1.copy_(w1), experts.w2.copy_(w2), experts.w3.copy_(w3)
        want = experts_loop(x, weights, ids, w1, w2, w3)
        for impl in EXPERT_IMPLS:
            experts.impl = impl
            assert rel(experts(x, weights, ids), want) <= 1e-6, impl
    with pytest.raises(ValueError, match=r"impl='grouped_mm', expected one of"):
        Experts(8, 16, 12, impl="grouped_mm")


@pytest.mark.parametrize("padded", [False, True], ids=["grouped", "padded"])
def test_bf16_runs_and_stays_close_to_the_fp32_loop(padded):
    # Against the fp32 loop on the same (bf16-rounded) inputs: each projection rounds its output to
    # bf16 (8-bit mantissa: 2^-9 ~ 2e-3 relative per rounding), three in a row plus the weighted
    # sum, so a few 1e-3; 2e-2 leaves room for the accumulation order without hiding a wrong expert
    # (a wrong row is an O(1) error).
    inputs = problem(37, 4, 16, 32, 16, dtype=torch.bfloat16)
    got = run(experts_grouped, inputs, padded=padded)
    as_fp32 = [t.detach().float().requires_grad_(t.requires_grad) if t.is_floating_point() else t for t in inputs]
    want = run(experts_loop, as_fp32)
    assert got[0].dtype == torch.bfloat16
    for name, g, w in zip(["out", "x", "weights", "w1", "w2", "w3"], got, want):
        assert rel(g, w) <= 2e-2, (name, rel(g, w))


class HostReads(TorchFunctionMode):
    """Records calls that read tensor values on the host (a device sync on a GPU) or whose output
    shape depends on tensor values."""

    METHODS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
               torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero,
               torch.Tensor.unique, torch.unique, torch.unique_consecutive, torch.masked_select,
               torch.Tensor.masked_select, torch.Tensor.cpu, torch.Tensor.numpy, torch.bincount,
               torch.Tensor.bincount, torch.repeat_interleave, torch.Tensor.repeat_interleave}

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.METHODS or (func is torch.where and len(args) + len(kwargs) == 1) or (
                func is torch.Tensor.to and any(str(a) == "cpu" for a in [*args[1:], *kwargs.values()])):
            self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **kwargs)


@pytest.mark.parametrize("padded", [False, True], ids=["grouped", "padded"])
def test_the_grouped_path_reads_nothing_on_the_host(padded):
    inputs = problem(37, 4, 16, 32, 16)
    experts_grouped(*inputs, padded=padded)  # the once-per-case grouped_mm probe runs outside the audit
    with HostReads() as audit:
        out = experts_grouped(*inputs, padded=padded)
    assert audit.calls == []
    with HostReads() as audit:  # the audit sees the loop's syncs: it can fail
        experts_loop(*inputs)
    assert {"unique", "tolist", "where"} <= set(audit.calls)
    assert rel(out, experts_loop(*inputs)) <= 1e-6


def many_expert_model(impl: str) -> HybridLM:
    config = dataclasses.replace(load_model_config("configs/model/tiny.yaml"), num_experts=16, num_expert_group=4,
                                 topk_group=2)
    model = HybridLM(config).init_weights(seed=7, std=0.15).eval()
    moe_experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert moe_experts and not moe_experts[0].runs_dense(config.num_experts_per_token)
    for experts in moe_experts:
        experts.impl = impl
    return model


def test_engine_greedy_output_with_the_grouped_path_equals_the_loop():
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 70, 23)]  # 70: chunked prefill
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    results = {}
    for impl in ("loop", "grouped", "padded"):
        model = many_expert_model(impl)
        engine = Engine(model, EngineConfig.for_pages(model, 64, max_model_len=256, max_num_batched_tokens=64,
                                                      check_every_step=True))
        results[impl] = [out.samples[0] for out in engine.generate(prompts, params)]
    for impl in ("grouped", "padded"):
        for got, want in zip(results[impl], results["loop"]):
            assert got.tokens == want.tokens, impl
            assert rel(torch.tensor(got.logprobs), torch.tensor(want.logprobs)) <= 1e-5, impl


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("padded", [False, True], ids=["grouped", "padded"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_grouped_path_never_syncs_and_equals_the_loop(padded, dtype):
    inputs = problem(61, 8, 64, 64, 32, dtype=dtype, device="cuda")
    run(experts_grouped, inputs, padded=padded)  # first use: the grouped_mm probe may sync, once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync in forward or backward raises
    try:
        got = run(experts_grouped, inputs, padded=padded)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = run(experts_loop, inputs)
    for name, g, w in zip(["out", "x", "weights", "w1", "w2", "w3"], got, want):
        assert rel(g, w) <= (1e-5 if dtype == torch.float32 else 2e-2), (name, rel(g, w))
