"""The engine's fast token loop against the reference recurrence."""
import pytest
import torch

from kernels.kda.naive import naive_recurrent_kda
from kernels.kda.recurrent import recurrent_kda, recurrent_kda_states
from tests.bounds import scaled_err

pytestmark = [pytest.mark.numerics]  # compares two computation orders: run under every CPU kernel path (make test-slow)


def inputs(B, T, H, K, V, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = -torch.rand(B, T, H, K, generator=gen) * 2  # log-decays in (-2, 0]
    beta = torch.rand(B, T, H, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("B, T, H, K, V", [(1, 1, 1, 4, 4), (3, 17, 2, 8, 6), (5, 40, 3, 16, 16)])
@pytest.mark.parametrize("with_state", [False, True])
def test_matches_reference(B, T, H, K, V, with_state):
    q, k, v, g, beta = inputs(B, T, H, K, V, seed=T)
    init = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(7)) if with_state else None
    before = None if init is None else init.clone()
    o, final = recurrent_kda(q, k, v, g, beta, initial_state=init, scale=0.3)
    o_ref, final_ref, _ = naive_recurrent_kda(q, k, v, g, beta, initial_state=init, scale=0.3)
    # batched ops vs the reference's per-head loop: the same recurrence summed in other orders, so the bound is
    # relative to each output's largest entry (1e-5, ~100 fp32 ulps)
    assert scaled_err(o, o_ref) <= 1e-5 and scaled_err(final, final_ref) <= 1e-5
    if init is not None:
        assert torch.equal(init, before), "initial_state was mutated"


def test_bad_shapes_are_named():
    q, k, v, g, beta = inputs(2, 3, 1, 4, 4, seed=0)
    with pytest.raises(ValueError, match="beta shape"):
        recurrent_kda(q, k, v, g, beta[:, :2])


@pytest.mark.parametrize("positions", [[], [0], [1, 2, 5], [0, 3, 17]])
def test_states_at_positions_match_the_references(positions):
    """The states after the first p tokens (speculative verification's rollback slots) equal the
    reference recurrence's, which returns them the same way; o and the final state are unchanged."""
    q, k, v, g, beta = inputs(3, 17, 2, 8, 6, seed=4)
    init = torch.randn(3, 2, 8, 6, generator=torch.Generator().manual_seed(1))
    o, final, kept = recurrent_kda_states(q, k, v, g, beta, initial_state=init, state_positions=positions)
    o_ref, final_ref, kept_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=init, state_positions=positions)
    assert kept.shape == (3, len(positions), 2, 8, 6)
    assert scaled_err(kept, kept_ref) <= 1e-5  # other summation orders, as above
    assert scaled_err(o, o_ref) <= 1e-5 and scaled_err(final, final_ref) <= 1e-5
    if 0 in positions:
        assert torch.equal(kept[:, 0], init)
    with pytest.raises(ValueError, match="strictly increasing"):
        recurrent_kda_states(q, k, v, g, beta, state_positions=[3, 2])
