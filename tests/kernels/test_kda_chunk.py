"""Chunked KDA: the Triton kernels (64-token chunks, 16-token sub-chunks) must match the naive
chunked form in outputs, final state and the states at requested positions, and their backward
must match autograd through the naive form in every gradient, at odd lengths and head counts,
with and without an initial state, under strong and slow decay (fp32, <= 1e-5 relative)."""

import pytest
import torch
import torch.nn.functional as F

from kernels.kda.chunk import chunk_kda
from kernels.kda.naive import naive_chunk_kda

TOL = 1e-5
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def make_inputs(B=2, T=19, H=2, K=24, V=40, *, seed=0, with_state=True, strong_decay=True):
    """L2-normalised q, k; g uniform in [-5, 0] per channel per token (strong decay: exp(G)
    reaches ~1e-35 within 16 tokens) or log-sigmoid around -0.13 (slow decay, old tokens stay
    alive and (I + A) is hardest to invert); sigmoid-range beta."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)  # [B, T, H, K]
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)  # [B, T, H, K]
    v = torch.randn(B, T, H, V, generator=gen)  # [B, T, H, V]
    if strong_decay:
        g = -5.0 * torch.rand(B, T, H, K, generator=gen)  # [B, T, H, K]
    else:
        g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen) + 2.0)  # [B, T, H, K]
    beta = torch.rand(B, T, H, generator=gen)  # [B, T, H]
    h0 = torch.randn(B, H, K, V, generator=gen) if with_state else None  # [B, H, K, V]
    moved = [x.to(DEVICE) for x in (q, k, v, g, beta)]
    return (*moved, None if h0 is None else h0.to(DEVICE))


def check_triton_matches_naive(T, positions, *, with_state, strong_decay, K=24, V=40, H=2, B=2, seed=0):
    q, k, v, g, beta, h0 = make_inputs(
        B=B, T=T, H=H, K=K, V=V, seed=seed, with_state=with_state, strong_decay=strong_decay
    )
    h0_before = None if h0 is None else h0.clone()
    kw = dict(initial_state=h0, state_positions=positions)
    o_n, s_n, ps_n = chunk_kda(q, k, v, g, beta, impl="naive", **kw)
    o_t, s_t, ps_t = chunk_kda(q, k, v, g, beta, impl="triton", **kw)
    assert (o_t.shape, o_t.dtype) == (o_n.shape, o_n.dtype)
    assert ps_t.shape == ps_n.shape == (B, len(positions), H, K, V)
    if T > 0:
        assert rel_err(o_t, o_n) <= TOL
    assert rel_err(s_t, s_n) <= TOL
    for i, p in enumerate(positions):
        if p == 0 and not with_state:
            assert not ps_t[:, i].any()
        else:
            assert rel_err(ps_t[:, i], ps_n[:, i]) <= TOL, p
    if h0 is not None:
        assert torch.equal(h0, h0_before)


@pytest.mark.triton
@pytest.mark.parametrize("T, with_state", [(1, False), (17, True), (63, True), (65, False), (200, True)])
def test_triton_matches_naive(T, with_state):
    # 0, T, a point mid-chunk, a sub-chunk boundary (16), a chunk boundary (64) and the token
    # after it; 3 heads (not a power of two).
    positions = sorted({0, T, T // 2, min(T, 16), min(T, 64), min(T, 65)})
    B = 2 if T < 63 else 1  # two sequences at short T (batch offsets), one past a chunk (interpreter time)
    check_triton_matches_naive(T, positions, with_state=with_state, strong_decay=True, H=3, B=B)


@pytest.mark.triton
@pytest.mark.parametrize(
    "T, positions, K, V",
    [
        (33, (5, 32), 16, 16),  # powers of two, one V block; no position 0 or T
        (19, (), 32, 7),  # no positions; V below one block
        (0, (0,), 24, 40),  # empty call: final state is the initial state
    ],
)
def test_triton_matches_naive_slow_decay(T, positions, K, V):
    check_triton_matches_naive(T, positions, with_state=True, strong_decay=False, K=K, V=V)


@pytest.mark.triton
def test_triton_matches_naive_chunk_len_16():
    # The naive path cut at other points than the Triton one (16 vs 64): agreement is not an
    # accident of the cut.
    q, k, v, g, beta, h0 = make_inputs(T=33, seed=4)
    kw = dict(initial_state=h0, state_positions=(3, 16, 30))
    o_n, s_n, ps_n = naive_chunk_kda(q, k, v, g, beta, chunk_len=16, **kw)
    o_t, s_t, ps_t = chunk_kda(q, k, v, g, beta, impl="triton", **kw)
    for got, expected in ((o_t, o_n), (s_t, s_n), (ps_t, ps_n)):
        assert rel_err(got, expected) <= TOL


def grads_of(impl, inputs, positions, weights):
    """Gradients of sum(o * do) + sum(final * dfinal) + sum(position_states * dpos) w.r.t.
    (q, k, v, g, beta, h0); a weight of None leaves that output out of the loss."""
    leaves = [x.clone().requires_grad_(True) for x in inputs]
    h0 = leaves[5] if len(leaves) > 5 else None
    o, final, pos = chunk_kda(*leaves[:5], initial_state=h0, state_positions=positions, impl=impl)
    loss = sum((out * w).sum() for out, w in zip((o, final, pos), weights) if w is not None)
    loss.backward()
    return [x.grad for x in leaves]


def recurrent_float64(q, k, v, g, beta, h0, positions):
    """KDA token by token in float64 (naive_recurrent_kda's math without its fp32 casts): the
    gradients' ground truth, since both fp32 paths round a gate gradient summed over a chunk."""
    scale = q.shape[-1] ** -0.5
    S, outs = h0, []
    states = [S] if 0 in positions else []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp().unsqueeze(-1)
        delta = beta[:, t].unsqueeze(-1) * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S))  # [B, H, V]
        S = S + k[:, t].unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append(torch.einsum("bhk,bhkv->bhv", scale * q[:, t], S))
        if t + 1 in positions:
            states.append(S)
    return torch.stack(outs, 1), S, torch.stack(states, 1)


@pytest.mark.triton
@pytest.mark.parametrize("T", [1, 17, 63, 65, 200])
def test_triton_backward_matches_naive_autograd(T):
    # Every gradient, including the initial state's, with the loss reading o, the final state and
    # the states at positions (0 and a chunk boundary among them); 3 heads; slow decay at T=65.
    B = 2 if T == 17 else 1  # two sequences once (batch offsets), one elsewhere (interpreter time)
    inputs = make_inputs(B=B, T=T, H=3, seed=T, strong_decay=T != 65)
    positions = sorted({0, T // 3, min(T, 64), T})
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(B, T, 3, 40, generator=gen), torch.randn(B, 3, 24, 40, generator=gen),
               torch.randn(B, len(positions), 3, 24, 40, generator=gen)]
    leaves = [x.double().requires_grad_(True) for x in inputs]
    outputs = recurrent_float64(*leaves, positions)
    sum((out * w.double()).sum() for out, w in zip(outputs, weights)).backward()
    naive = grads_of("naive", inputs, positions, weights)
    got = grads_of("triton", inputs, positions, weights)
    for name, a, b, truth in zip(("q", "k", "v", "g", "beta", "h0"), got, naive, leaves):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        # Both fp32 paths within 1e-5 of the float64 truth (the Triton one is as close as the twin:
        # dg sits at 5e-6 for both at T=200), and within 2e-5 of each other.
        assert rel_err(a, truth.grad) <= TOL and rel_err(b, truth.grad) <= TOL, (name, rel_err(a, truth.grad))
        assert rel_err(a, b) <= 2 * TOL, (name, rel_err(a, b))


@pytest.mark.triton
def test_triton_backward_through_outputs_only():
    # Only o in the loss (the training path): the unused outputs' gradients arrive as zeros;
    # without an initial state there is no h0 gradient. K = 80 and V = 72 take two 64-wide blocks
    # each in every kernel that loops over them.
    q, k, v, g, beta, _ = make_inputs(B=1, T=70, H=1, K=80, V=72, seed=3)
    do = torch.randn(1, 70, 1, 72, generator=torch.Generator().manual_seed(2))
    got = grads_of("triton", (q, k, v, g, beta), (), (do, None, None))
    expected = grads_of("naive", (q, k, v, g, beta), (), (do, None, None))
    for a, b in zip(got, expected):
        assert rel_err(a, b) <= TOL


def test_naive_impl_is_naive_chunk_kda():
    q, k, v, g, beta, h0 = make_inputs(T=7)
    kw = dict(initial_state=h0, state_positions=(0, 3), chunk_len=4)
    expected = naive_chunk_kda(q, k, v, g, beta, **kw)
    for got, want in zip(chunk_kda(q, k, v, g, beta, **kw), expected):
        assert torch.equal(got, want)


@pytest.mark.parametrize("impl", ["naive", "triton"])
def test_bad_inputs_raise(impl):
    q, k, v, g, beta, h0 = make_inputs(T=7)
    with pytest.raises(ValueError, match="k shape .* must equal q shape"):
        chunk_kda(q, k[:, :3], v, g, beta, impl=impl)
    with pytest.raises(ValueError, match="initial_state shape"):
        chunk_kda(q, k, v, g, beta, initial_state=h0[:1], impl=impl)
    with pytest.raises(ValueError, match=r"state position 8 out of range: expected 0 <= p <= T=7"):
        chunk_kda(q, k, v, g, beta, state_positions=(2, 8), impl=impl)
    with pytest.raises(ValueError, match="strictly increasing, got 2 after 3"):
        chunk_kda(q, k, v, g, beta, state_positions=(3, 2), impl=impl)
    with pytest.raises(ValueError, match="chunk_len must be a positive int, got 0"):
        chunk_kda(q, k, v, g, beta, chunk_len=0, impl=impl)
    with pytest.raises(ValueError, match="impl must be one of .* got 'chunk'"):
        chunk_kda(q, k, v, g, beta, impl="chunk")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_triton_without_interpreter_raises(monkeypatch):
    q, k, v, g, beta, h0 = make_inputs(T=7)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        chunk_kda(q, k, v, g, beta, initial_state=h0, impl="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_bf16_on_gpu_forward_backward_and_compile_count():
    # The bf16 path (bf16 workspaces and tensor-core dots, fp32 gates and states) cannot be checked
    # under the interpreter. At Kimi Linear's head size (K = V = 128), vs the fp32 naive twin on the
    # same bf16-rounded inputs; then odd lengths must not compile new kernel variants, and a forward
    # makes no host sync.
    from kernels.kda.chunk import TRITON_KERNELS

    gen = torch.Generator(device="cuda").manual_seed(0)
    B, T, H, K = 1, 300, 4, 128
    q, k = (F.normalize(torch.randn(B, T, H, K, device="cuda", generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(B, T, H, K, device="cuda", generator=gen)
    g = F.logsigmoid(torch.randn(B, T, H, K, device="cuda", generator=gen) + 3)
    beta = torch.sigmoid(torch.randn(B, T, H, device="cuda", generator=gen))
    inputs = [x.to(torch.bfloat16) for x in (q, k, v, g, beta)]
    weights = [torch.randn(B, T, H, K, device="cuda", generator=gen), None, None]
    got = grads_of("triton", inputs, (), weights)
    expected = grads_of("naive", [x.float() for x in inputs], (), weights)
    for name, a, b in zip(("q", "k", "v", "g", "beta"), got, expected):
        assert rel_err(a.float(), b) <= 3e-2, (name, rel_err(a.float(), b))
    def variants():  # compiled variants per kernel (an autotuned kernel's jit function is .fn)
        device = torch.cuda.current_device()
        return {name: len(getattr(fn, "fn", fn).device_caches[device][0]) for name, fn in TRITON_KERNELS.items()}

    before = variants()
    for T in (17, 1000, 1025):
        x = [t[:, :1].expand(B, T, *t.shape[2:]).contiguous().requires_grad_(True) for t in inputs]
        o, _, _ = chunk_kda(*x, state_positions=[T // 2], impl="triton")
        o.float().sum().backward()
    assert variants() == before
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # the engine's prefill path: no host sync, new lengths included
    try:
        with torch.no_grad():
            x = [t[:, :1].expand(B, 777, *t.shape[2:]).contiguous() for t in inputs]
            chunk_kda(*x, state_positions=[64, 700], impl="triton")
    finally:
        torch.cuda.set_sync_debug_mode(0)
