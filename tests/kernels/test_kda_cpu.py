"""Fused C++ CPU kernels (kernels/cpu/) against their torch twins: the KDA decode step in pool
pages (also covered by tests/kernels/test_kda_decode.py, parametrised over every impl) and the
short-conv step whose tails live in pool pages (twin: KDALayer.decode_conv + gather/scatter)."""
import pytest
import torch

from kernels.cpu import ops
from kernels.kda.decode import kda_decode_step
from models.config import load_model_config
from models.kda import KDALayer
from tests.kernels.test_kda_decode import make_pool, make_step, rel_err, touched_mask

# CPU kernels; they compare two computation orders, so they run under every CPU kernel path (make test-slow)
pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="CPU kernels"), pytest.mark.numerics]


@pytest.mark.parametrize("strong_decay", [True, False])
def test_fused_decode_equals_naive_and_touches_only_its_pages(strong_decay):
    B, H, K, V = 5, 3, 16, 24
    pages = torch.tensor([6, 0, 3, 8, 2])
    buf_n, state_n = make_pool(9, H, K, V, seed=1)
    buf_c, state_c = make_pool(9, H, K, V, seed=1)
    before = buf_c.clone()
    inputs = make_step(B, H, K, V, seed=2, strong_decay=strong_decay)
    o_n = kda_decode_step(*inputs, state_n, pages, impl="naive")
    o_c = kda_decode_step(*inputs, state_c, pages, impl="cpu")
    assert rel_err(o_c, o_n) <= 1e-6 and rel_err(state_c[pages], state_n[pages]) <= 1e-6
    touched = touched_mask(buf_c, pages, H, K, V)
    assert torch.equal(buf_c[~touched], before[~touched])


def test_fused_conv_equals_decode_conv_and_shifts_the_tails_in_place():
    config = load_model_config("configs/model/tiny.yaml")
    layer = KDALayer(config)
    torch.manual_seed(0)
    for p in layer.parameters():
        p.data.normal_(0, 0.3)
    H, D, KK, P = layer.num_heads, layer.head_dim, layer.kernel, 7
    buf = torch.randn(P, H * 3 * (KK - 1) * D + 5)  # pages with padding: tails are a strided view
    tails = buf[:, :H * 3 * (KK - 1) * D].view(P, H, 3, KK - 1, D)
    pages = torch.tensor([5, 1, 3])
    mixed = torch.randn(3, 3 * H * D)
    expected_q, expected_k, expected_v, new_tails = layer.decode_conv(mixed, tails.index_select(0, pages))
    expected_tails = tails.clone()
    expected_tails[pages] = new_tails
    untouched = buf[:, H * 3 * (KK - 1) * D:].clone()
    qkv = ops().kda_conv_step(mixed, tails, layer.head_major_taps().detach(), pages)
    q, k, v = qkv.unbind(2)
    for got, want in ((q, expected_q), (k, expected_k), (v, expected_v)):
        assert rel_err(got, want) <= 1e-6
    assert torch.equal(tails, expected_tails)  # the shift copies values: bit for bit
    assert torch.equal(buf[:, H * 3 * (KK - 1) * D:], untouched)
    torch.testing.assert_close(q.norm(dim=-1), torch.ones(3, H), rtol=1e-5, atol=1e-5)


def test_fused_ops_reject_wrong_dtypes():
    B, H, K, V = 2, 2, 8, 8
    _, state = make_pool(4, H, K, V)
    q, k, v, g, beta = make_step(B, H, K, V)
    with pytest.raises(RuntimeError, match="q must be float32"):
        ops().kda_decode_step(q.double(), k, v, g, beta, state, torch.tensor([0, 1]), 0.5)


@pytest.mark.parametrize("groups, topk_group, top_k, renormalize", [(2, 1, 2, True), (1, 1, 2, True),
                                                                    (4, 2, 3, False), (8, 3, 4, True)])
def test_fused_routing_equals_the_router(groups, topk_group, top_k, renormalize):
    import dataclasses

    from models.mlp import Router

    config = dataclasses.replace(load_model_config("configs/model/tiny.yaml"), num_experts=16, num_expert_group=groups,
                                 topk_group=topk_group, num_experts_per_token=top_k, moe_renormalize=renormalize)
    router = Router(config)
    gen = torch.Generator().manual_seed(groups * 10 + top_k)
    router.weight.data = torch.randn(16, config.hidden_size, generator=gen) * 0.3
    router.e_score_correction_bias.data = torch.randn(16, generator=gen) * 0.05
    x = torch.randn(200, config.hidden_size, generator=gen)
    with torch.no_grad():
        weights, ids = router(x)
        expected = torch.zeros(200, 16 + 2).scatter_(1, ids, weights)
        expected[:, 16:] = 1.0
        scores = torch.nn.functional.linear(x, router.weight).sigmoid()
        got = ops().moe_route_dense(scores, router.e_score_correction_bias, top_k, groups, topk_group, renormalize,
                                    float(router.scaling), 2)
    assert torch.equal((got[:, :16] != 0), (expected[:, :16] != 0))  # the same experts
    if top_k <= 2:
        assert torch.equal(got, expected)  # two weights: the same float ops in any order
    else:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
