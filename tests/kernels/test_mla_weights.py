"""Per-token attention weights and split attention: the pieces token eviction reads.

`paged_mla_weights` must give exactly the softmax probabilities of `paged_mla_decode` summed over
heads (so each row sums to H), for both implementations; the lse both decode paths return must
agree; `merge_attention` of two disjoint row sets must equal one softmax over their union."""

import pytest
import torch

from kernels.mla.paged import paged_mla_decode
from kernels.mla.split_kv import MAX_GRID_X, MAX_GRID_YZ
from kernels.mla.weights import dense_attention, merge_attention, paged_mla_weights, weights_grid
from tests.kernels.test_mla_paged import make_paged, rel_err

pytestmark = [pytest.mark.numerics]  # compares two computation orders: run under every CPU kernel path (make test-slow)


TOKENS_4M = 4 * 1024 * 1024 + 17


def explicit_weights(q_lat, q_rope, kv_per_seq, scale):
    """Reference: per sequence, softmax over its rows, summed over heads."""
    out = []
    for b, kv in enumerate(kv_per_seq):
        q = torch.cat([q_lat[b], q_rope[b]], dim=-1).cpu()  # [H, W]
        out.append(((q @ kv.T) * scale).softmax(dim=-1).sum(0))  # [S]
    return out


@pytest.mark.parametrize("Dr", [0, 8])
def test_naive_weights_are_the_decode_softmax(Dr):
    seq_lens, scale = [1, 5, 17, 30], 0.37
    q_lat, q_rope, cache, tables, lens, kv = make_paged(seq_lens, H=3, Dc=24, Dr=Dr, block_tokens=5)
    o, lse = paged_mla_decode(q_lat, q_rope, cache, tables, lens, scale=scale, return_lse=True)
    assert torch.equal(o, paged_mla_decode(q_lat, q_rope, cache, tables, lens, scale=scale))
    w = paged_mla_weights(q_lat, q_rope, cache, tables, lens, lse, scale=scale)
    assert w.shape == (4, 30)
    for b, ref in enumerate(explicit_weights(q_lat, q_rope, kv, scale)):
        assert rel_err(w[b, :seq_lens[b]], ref) <= 1e-5
        assert torch.all(w[b, seq_lens[b]:] == 0)
    torch.testing.assert_close(w.sum(1), torch.full((4,), 3.0))


@pytest.mark.triton
@pytest.mark.parametrize("Dr, Dc, H", [(0, 16, 2), (8, 24, 3), (4, 20, 17)])
def test_triton_weights_and_lse_match_naive(Dr, Dc, H):
    seq_lens, scale = [1, 5, 17, 30], 0.3
    q_lat, q_rope, cache, tables, lens, _ = make_paged(seq_lens, H=H, Dc=Dc, Dr=Dr, block_tokens=5, seed=1)
    o_n, lse_n = paged_mla_decode(q_lat, q_rope, cache, tables, lens, scale=scale, return_lse=True)
    o_t, lse_t = paged_mla_decode(q_lat, q_rope, cache, tables, lens, scale=scale, return_lse=True, impl="triton")
    assert rel_err(o_t, o_n) <= 1e-5 and rel_err(lse_t, lse_n) <= 1e-5
    for width in (32, 37):  # 2 and 3 token blocks of 16 per sequence on the one grid axis
        w_n = paged_mla_weights(q_lat, q_rope, cache, tables, lens, lse_n, scale=scale, width=width)
        w_t = paged_mla_weights(q_lat, q_rope, cache, tables, lens, lse_n, scale=scale, width=width, impl="triton")
        assert rel_err(w_t, w_n) <= 1e-5 and torch.all(w_t[:, 30:] == 0), width


def test_merge_equals_one_softmax_over_the_union():
    gen = torch.Generator().manual_seed(0)
    B, H, M, W, Dc = 3, 4, 11, 12, 8
    q, kv = torch.randn(B, H, W, generator=gen), torch.randn(B, M, W, generator=gen)
    split = torch.zeros(B, M, dtype=torch.bool)
    split[:, :5] = True
    split[2] = True  # sequence 2: every row in part A, part B empty
    o_a, lse_a, _ = dense_attention(q, kv, split, scale=0.5, value_dim=Dc)
    o_b, lse_b, _ = dense_attention(q, kv, ~split, scale=0.5, value_dim=Dc)
    assert torch.isinf(lse_b[2]).all() and torch.all(o_b[2] == 0)
    o, lse = merge_attention(o_a, lse_a, o_b, lse_b)
    o_all, lse_all, _ = dense_attention(q, kv, torch.ones(B, M, dtype=torch.bool), scale=0.5, value_dim=Dc)
    assert rel_err(o, o_all) <= 1e-6 and rel_err(lse, lse_all) <= 1e-6


def test_weights_with_a_larger_lse_are_relative_to_the_union():
    # Probabilities of the paged rows under the lse of (paged rows + other rows) sum to less than H.
    q_lat, q_rope, cache, tables, lens, _ = make_paged([7, 12], H=2, Dc=16, Dr=4, block_tokens=4)
    _, lse = paged_mla_decode(q_lat, q_rope, cache, tables, lens, scale=0.5, return_lse=True)
    w = paged_mla_weights(q_lat, q_rope, cache, tables, lens, lse + torch.log(torch.tensor(2.0)), scale=0.5)
    torch.testing.assert_close(w.sum(1), torch.full((2,), 1.0))
    with pytest.raises(ValueError, match=r"lse shape \(2,\) must be \[B, H\]"):
        paged_mla_weights(q_lat, q_rope, cache, tables, lens, lse[:, 0], scale=0.5)


def test_weights_grid_at_4m_tokens():
    # Token blocks used to be grid axis y: past 65,535 blocks of 16 (~1M tokens) CUDA refused the launch.
    assert -(-TOKENS_4M // 16) > MAX_GRID_YZ
    for batch in (1, 64, 1024):
        (programs,) = weights_grid(batch, TOKENS_4M)
        assert programs == batch * -(-TOKENS_4M // 16) <= MAX_GRID_X
    with pytest.raises(ValueError, match=r"weights grid of 1024 x ceil\(33554432 / 16\) .* exceeds"):
        weights_grid(1024, 32 * 2**20)
