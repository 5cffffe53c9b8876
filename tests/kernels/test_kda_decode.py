"""KDA decode step over pool pages: the naive path is `naive_recurrent_kda` at T = 1 on the
gathered states, the Triton kernel matches it, both update exactly the batch's state pages
in place (every other element of the pool stays bit-identical), and bad pages raise."""

import pytest
import torch
import torch.nn.functional as F

from kernels.impl import IMPLS
from kernels.kda.decode import kda_decode_step
from kernels.kda.naive import naive_recurrent_kda

pytestmark = [pytest.mark.numerics]  # compares two computation orders: run under every CPU kernel path (make test-slow)

TOL = 1e-5
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_for(impl: str) -> torch.device:
    """Where a test of `impl` puts its tensors: the fused CPU kernels take CPU tensors on any host."""
    return torch.device("cpu") if impl == "cpu" else DEVICE


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def make_pool(num_pages, H, K, V, *, num_layers=3, layer=1, seed=0, device=DEVICE):
    """A flat pool buffer and one layer's state view into it, as the page pool lays it out.

    Per page the heads of all layers in the group are interleaved (head stride = num_layers
    * K * V), and each page carries padding past them. Returns (buf, state), state
    [num_pages, H, K, V] a non-contiguous view of buf.
    """
    gen = torch.Generator().manual_seed(seed)
    unit = K * V  # one head's [K, V] state
    page_elems = H * num_layers * unit + 13
    buf = torch.randn(num_pages, page_elems, generator=gen).to(device)  # [num_pages, page_elems]
    heads = buf[:, : H * num_layers * unit].view(num_pages, H, num_layers, K, V)
    state = heads[:, :, layer]  # [num_pages, H, K, V] strides (page_elems, num_layers*unit, V, 1)
    assert not state.is_contiguous()
    return buf, state


def touched_mask(buf, pages, H, K, V, *, num_layers=3, layer=1):
    """[num_pages, page_elems] bool, True on the elements of `pages`' states in `layer`."""
    mask = torch.zeros(buf.shape, dtype=torch.bool, device=buf.device)
    view = mask[:, : H * num_layers * K * V].view(mask.shape[0], H, num_layers, K, V)
    view[pages.long(), :, layer] = True
    return mask


def make_step(B, H, K, V, *, seed=0, strong_decay=True, device=DEVICE):
    """One token's inputs: L2-normalised q, k; g in [-5, 0] (strong) or log-sigmoid (slow)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, H, K, generator=gen), dim=-1)  # [B, H, K]
    k = F.normalize(torch.randn(B, H, K, generator=gen), dim=-1)  # [B, H, K]
    v = torch.randn(B, H, V, generator=gen)  # [B, H, V]
    if strong_decay:
        g = -5.0 * torch.rand(B, H, K, generator=gen)  # [B, H, K]
    else:
        g = F.logsigmoid(torch.randn(B, H, K, generator=gen) + 2.0)  # [B, H, K]
    beta = torch.rand(B, H, generator=gen)  # [B, H]
    return tuple(x.to(device) for x in (q, k, v, g, beta))


PAGES = torch.tensor([5, 0, 3], dtype=torch.int32)  # shuffled, not the first B pages


def test_naive_is_recurrent_reference_and_in_place():
    B, H, K, V = 3, 2, 16, 8
    buf, state = make_pool(7, H, K, V)
    pages = PAGES.to(DEVICE)
    before = buf.clone()
    q, k, v, g, beta = make_step(B, H, K, V)
    o = kda_decode_step(q, k, v, g, beta, state, pages, scale=0.7)

    gathered = before[:, : H * 3 * K * V].view(7, H, 3, K, V)[pages.long(), :, 1]  # [B, H, K, V]
    step = [x.unsqueeze(1) for x in (q, k, v, g, beta)]  # [B, 1, H, *]
    o_ref, s_ref, _ = naive_recurrent_kda(*step, scale=0.7, initial_state=gathered)
    assert rel_err(o, o_ref[:, 0]) <= 1e-6  # same recurrence, batched ops (rounding only)
    assert rel_err(state[pages.long()], s_ref) <= 1e-6
    touched = touched_mask(buf, pages, H, K, V)
    assert torch.equal(buf[~touched], before[~touched])
    assert not torch.equal(buf[touched], before[touched])


@pytest.mark.triton
@pytest.mark.parametrize(
    "K, V, strong_decay",
    [
        (16, 16, True),
        (24, 40, True),  # K not a power of two; V spans a full and a partial block of 32
        (32, 7, False),  # V below one block
    ],
)
def test_triton_matches_naive(K, V, strong_decay):
    B, H = 3, 2
    pages = PAGES.to(DEVICE)
    buf_naive, state_naive = make_pool(7, H, K, V, seed=1)
    buf_triton, state_triton = make_pool(7, H, K, V, seed=1)
    before = buf_triton.clone()
    inputs = make_step(B, H, K, V, seed=2, strong_decay=strong_decay)
    o_naive = kda_decode_step(*inputs, state_naive, pages)
    o_triton = kda_decode_step(*inputs, state_triton, pages, impl="triton")
    assert o_triton.dtype == o_naive.dtype
    assert rel_err(o_triton, o_naive) <= TOL
    assert rel_err(state_triton[pages.long()], state_naive[pages.long()]) <= TOL
    touched = touched_mask(buf_triton, pages, H, K, V)
    assert torch.equal(buf_triton[~touched], before[~touched])


@pytest.mark.parametrize("impl", IMPLS)
def test_steps_follow_recurrent_kda(impl):
    # Six decode steps through the pool equal one recurrent call over the six tokens.
    B, H, K, V, T = 2, 2, 16, 24, 6
    dev = device_for(impl)
    pages = torch.tensor([4, 1], device=dev)
    buf, state = make_pool(6, H, K, V, seed=3, device=dev)
    h0 = state[pages].clone()  # [B, H, K, V]
    steps = [make_step(B, H, K, V, seed=10 + t, device=dev) for t in range(T)]
    outs = [kda_decode_step(*inputs, state, pages, impl=impl) for inputs in steps]
    seq = [torch.stack(xs, dim=1) for xs in zip(*steps)]  # [B, T, H, *]
    o_ref, s_ref, _ = naive_recurrent_kda(*seq, initial_state=h0)
    assert rel_err(torch.stack(outs, dim=1), o_ref) <= TOL
    assert rel_err(state[pages], s_ref) <= TOL


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_pages_raise_and_write_nothing(impl):
    B, H, K, V = 3, 2, 16, 8
    dev = device_for(impl)
    buf, state = make_pool(7, H, K, V, device=dev)
    before = buf.clone()
    inputs = make_step(B, H, K, V, device=dev)
    with pytest.raises(ValueError, match="page 3 appears more than once"):
        kda_decode_step(*inputs, state, torch.tensor([3, 1, 3], device=dev), impl=impl)
    with pytest.raises(ValueError, match=r"state page id 7 is not in \[0, num_pages=7\)"):
        kda_decode_step(*inputs, state, torch.tensor([0, 7, 2], device=dev), impl=impl)
    with pytest.raises(ValueError, match=r"state page id -1 is not in"):
        kda_decode_step(*inputs, state, torch.tensor([0, -1, 2], device=dev), impl=impl)
    assert torch.equal(buf, before)


def test_bad_inputs_raise():
    B, H, K, V = 3, 2, 16, 8
    _, state = make_pool(7, H, K, V)
    q, k, v, g, beta = make_step(B, H, K, V)
    pages = PAGES.to(DEVICE)
    with pytest.raises(ValueError, match=r"q must be \[B, H, K\]"):
        kda_decode_step(q[0], k, v, g, beta, state, pages)
    with pytest.raises(ValueError, match="k shape .* must equal q shape"):
        kda_decode_step(q, k[:, :1], v, g, beta, state, pages)
    with pytest.raises(ValueError, match="g shape"):
        kda_decode_step(q, k, v, g[..., :8], beta, state, pages)
    with pytest.raises(ValueError, match="v shape"):
        kda_decode_step(q, k, v[:2], g, beta, state, pages)
    with pytest.raises(ValueError, match="beta shape"):
        kda_decode_step(q, k, v, g, beta[:, None], state, pages)
    with pytest.raises(ValueError, match=r"state shape .* \[num_pages, 2, 16, 4\]"):
        kda_decode_step(q, k, v[..., :4], g, beta, state, pages)
    with pytest.raises(ValueError, match="state dtype must be torch.float32, got torch.float64"):
        kda_decode_step(q, k, v, g, beta, state.double(), pages)
    with pytest.raises(ValueError, match="state_pages shape"):
        kda_decode_step(q, k, v, g, beta, state, pages[:2])
    with pytest.raises(ValueError, match="state_pages dtype .* torch.float32"):
        kda_decode_step(q, k, v, g, beta, state, pages.float())
    with pytest.raises(ValueError, match="impl must be one of .* got 'Triton'"):
        kda_decode_step(q, k, v, g, beta, state, pages, impl="Triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_triton_without_interpreter_raises(monkeypatch):
    B, H, K, V = 3, 2, 16, 8
    buf, state = make_pool(7, H, K, V)
    before = buf.clone()
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kda_decode_step(*make_step(B, H, K, V), state, PAGES, impl="triton")
    assert torch.equal(buf, before)
