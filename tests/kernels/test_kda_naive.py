"""The chunked KDA reference must match the token-by-token one, including the states it
returns at requested positions, and the recurrent one must match transformers' independent
torch fallback for Kimi Linear."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.kda.naive import naive_chunk_kda, naive_recurrent_kda

pytestmark = [pytest.mark.numerics]  # compares two computation orders: run under every CPU kernel path (make test-slow)

TOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def make_inputs(B=2, T=65, H=2, K=16, V=8, *, seed=0, with_state=True, decay_shift=2.0):
    """Inputs shaped like the model's: L2-normalised q/k, log-sigmoid decay, sigmoid beta.

    decay_shift=2 gives slow decay (mean g ~ -0.13), which keeps old tokens alive and makes
    (I + A) hardest to invert; negative shifts give fast decay and exp(G) near underflow.
    """
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)  # [B, T, H, K]
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)  # [B, T, H, K]
    v = torch.randn(B, T, H, V, generator=gen)  # [B, T, H, V]
    g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen) + decay_shift)  # [B, T, H, K] < 0
    beta = torch.randn(B, T, H, generator=gen).sigmoid()  # [B, T, H]
    h0 = torch.randn(B, H, K, V, generator=gen) if with_state else None  # [B, H, K, V]
    return q, k, v, g, beta, h0


def check_chunk_matches_recurrent(T, chunk_len, positions, with_state, seed=0, decay_shift=2.0):
    q, k, v, g, beta, h0 = make_inputs(
        T=T, seed=seed, with_state=with_state, decay_shift=decay_shift
    )
    o_r, s_r, ps_r = naive_recurrent_kda(
        q, k, v, g, beta, initial_state=h0, state_positions=positions
    )
    o_c, s_c, ps_c = naive_chunk_kda(
        q, k, v, g, beta, initial_state=h0, state_positions=positions, chunk_len=chunk_len
    )
    assert ps_r.shape == (2, len(positions), 2, 16, 8)
    assert rel_err(o_c, o_r) <= TOL
    assert rel_err(s_c, s_r) <= TOL
    for i in range(len(positions)):
        assert rel_err(ps_c[:, i], ps_r[:, i]) <= TOL, positions[i]


@pytest.mark.parametrize("T", [1, 7, 63, 65, 130, 200])
@pytest.mark.parametrize("chunk_len", [16, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_matches_recurrent(T, chunk_len, with_state):
    # 0, T, a point inside the first chunk, one just past a chunk boundary, one at a boundary.
    positions = sorted({0, T, T // 3, min(T, chunk_len + 1), min(T, chunk_len)})
    check_chunk_matches_recurrent(T, chunk_len, positions, with_state)


@pytest.mark.parametrize("decay_shift", [-4.0, 0.0, 6.0])
def test_chunk_matches_recurrent_across_decay_rates(decay_shift):
    # -4: G reaches ~ -260 within a 64-chunk, exp(G) underflows to 0 and must stay harmless;
    # 6: almost no decay, the delta rule alone bounds the state.
    check_chunk_matches_recurrent(200, 64, [0, 31, 64, 200], True, decay_shift=decay_shift)


def test_position_states_are_the_states_at_those_positions():
    q, k, v, g, beta, h0 = make_inputs(T=40)
    positions = [0, 9, 17, 40]
    _, final, ps = naive_recurrent_kda(
        q, k, v, g, beta, initial_state=h0, state_positions=positions
    )
    assert torch.equal(ps[:, 0], h0)
    assert torch.equal(ps[:, -1], final)
    for i, p in enumerate(positions):
        prefix = [x[:, :p] for x in (q, k, v, g, beta)]
        _, s_p, _ = naive_recurrent_kda(*prefix, initial_state=h0)
        assert rel_err(ps[:, i], s_p) <= TOL


@pytest.mark.parametrize("fn", [naive_recurrent_kda, naive_chunk_kda])
@pytest.mark.parametrize("split", [0, 1, 23, 64, 77])
def test_split_and_resume_equals_full_run(fn, split):
    q, k, v, g, beta, h0 = make_inputs(T=77)
    o_full, s_full, ps = fn(q, k, v, g, beta, initial_state=h0, state_positions=[split])
    rest = [x[:, split:] for x in (q, k, v, g, beta)]
    o_rest, s_rest, _ = fn(*rest, initial_state=ps[:, 0])
    if split < 77:
        assert rel_err(o_rest, o_full[:, split:]) <= TOL
    assert rel_err(s_rest, s_full) <= TOL


def test_initial_state_matters_and_is_not_mutated():
    q, k, v, g, beta, h0 = make_inputs(T=20)
    h0_copy = h0.clone()
    o_h, _, _ = naive_chunk_kda(q, k, v, g, beta, initial_state=h0, chunk_len=8)
    o_0, _, _ = naive_chunk_kda(q, k, v, g, beta, chunk_len=8)
    assert torch.equal(h0, h0_copy)
    assert rel_err(o_h, o_0) > 1e-2


@pytest.mark.parametrize("fn", [naive_recurrent_kda, naive_chunk_kda])
def test_empty_call_returns_initial_state(fn):
    q, k, v, g, beta, h0 = make_inputs(T=0)
    o, s, ps = fn(q, k, v, g, beta, initial_state=h0, state_positions=[0])
    assert o.shape == (2, 0, 2, 8)
    assert torch.equal(s, h0) and torch.equal(ps[:, 0], h0)
    _, _, none = fn(q, k, v, g, beta)
    assert none.shape == (2, 0, 2, 16, 8)


def test_dtype_and_scale():
    q, k, v, g, beta, h0 = make_inputs(T=30)
    o_bf, s_bf, _ = naive_chunk_kda(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta, chunk_len=16)
    assert o_bf.dtype == torch.bfloat16 and s_bf.dtype == torch.float32
    # o is linear in the query scale, so doubling scale doubles o.
    o1, _, _ = naive_recurrent_kda(q, k, v, g, beta, scale=0.25)
    o2, _, _ = naive_recurrent_kda(q, k, v, g, beta, scale=0.5)
    assert rel_err(o2, 2 * o1) <= TOL


# transformers' Kimi Linear torch fallbacks: written independently of ours (fla port).
@pytest.mark.parametrize("T", [7, 63, 130])
@pytest.mark.parametrize("with_state", [False, True])
def test_recurrent_matches_transformers(T, with_state):
    kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    q, k, v, g, beta, h0 = make_inputs(T=T, seed=1, with_state=with_state)
    o, s, _ = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0)
    o_rr, s_rr = kimi.recurrent_kimi_delta_attention(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=False
    )
    assert rel_err(o, o_rr) <= TOL and rel_err(s, s_rr) <= TOL
    o_rc, s_rc = kimi.chunk_kimi_delta_attention(
        q, k, v, g, beta, chunk_size=64, initial_state=h0, output_final_state=True,
        use_qk_l2norm_in_kernel=False,
    )
    assert rel_err(o, o_rc) <= TOL and rel_err(s, s_rc) <= TOL


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_chunk_matches_recurrent_property(data):
    T = data.draw(st.integers(0, 90), label="T")
    chunk_len = data.draw(st.sampled_from([1, 5, 16, 32, 64]), label="chunk_len")
    positions = sorted(data.draw(st.sets(st.integers(0, T), max_size=5), label="positions"))
    with_state = data.draw(st.booleans(), label="with_state")
    if T == 0:
        q, k, v, g, beta, h0 = make_inputs(T=0, with_state=with_state)
        _, s, ps = naive_chunk_kda(q, k, v, g, beta, initial_state=h0, state_positions=positions)
        assert ps.shape[1] == len(positions)
        return
    check_chunk_matches_recurrent(T, chunk_len, positions, with_state, seed=T)


@pytest.mark.parametrize("fn", [naive_recurrent_kda, naive_chunk_kda])
@pytest.mark.parametrize(
    "positions, match",
    [([5, 3], "3 after 5"), ([4, 4], "4 after 4"), ([-1], "-1"), ([11], "11"), ([2.5], "2.5")],
)
def test_bad_positions_raise(fn, positions, match):
    q, k, v, g, beta, _ = make_inputs(T=10)
    with pytest.raises(ValueError, match=match):
        fn(q, k, v, g, beta, state_positions=positions)


@pytest.mark.parametrize("fn", [naive_recurrent_kda, naive_chunk_kda])
def test_bad_shapes_raise(fn):
    q, k, v, g, beta, h0 = make_inputs(T=10)
    with pytest.raises(ValueError, match=r"k shape \(2, 9, 2, 16\)"):
        fn(q, k[:, :9], v, g, beta)
    with pytest.raises(ValueError, match=r"g shape \(2, 10, 2, 15\)"):
        fn(q, k, v, g[..., :15], beta)
    with pytest.raises(ValueError, match=r"v shape \(2, 10, 1, 8\)"):
        fn(q, k, v[:, :, :1], g, beta)
    with pytest.raises(ValueError, match=r"beta shape \(2, 10\)"):
        fn(q, k, v, g, beta[..., 0])
    with pytest.raises(ValueError, match=r"initial_state shape \(2, 2, 8, 16\)"):
        fn(q, k, v, g, beta, initial_state=h0.transpose(-1, -2))
    with pytest.raises(ValueError, match=r"q must be \[B, T, H, K\]"):
        fn(q[0], k, v, g, beta)


def test_bad_chunk_len_raises():
    q, k, v, g, beta, _ = make_inputs(T=10)
    with pytest.raises(ValueError, match="chunk_len must be a positive int, got 0"):
        naive_chunk_kda(q, k, v, g, beta, chunk_len=0)
