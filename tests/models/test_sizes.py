"""Real model sizes, counted on the `meta` device (shapes and dtypes, no storage): the
Kimi-Linear-48B-A3B shape against its published size, and the middle config
(configs/model/kimi_linear_mid.yaml) in its 0.3-0.5B band, with the bytes their weights take in
fp32 and bf16. Nothing here allocates a real parameter."""
from pathlib import Path

import pytest
import torch

from models.config import ModelConfig, load_model_config
from models.mlp import MoE
from models.model import HybridLM

BIG = "configs/model/kimi_linear_48b_a3b.yaml"
MID = "configs/model/kimi_linear_mid.yaml"


def meta_model(path: str) -> HybridLM:
    with torch.device("meta"):
        return HybridLM(load_model_config(path))


def total_parameters(model: HybridLM) -> int:
    return sum(p.numel() for p in model.parameters())


def activated_parameters(model: HybridLM) -> int:
    """Parameters one token's forward multiplies by: everything but the input embedding table (a
    row lookup) and, in each MoE layer, the routed experts it is not sent to (top_k of num_experts
    run; the shared experts and the router always do). Counted from the module tensors, not the
    config's closed form."""
    cfg = model.config
    unused = 0
    for module in model.modules():
        if isinstance(module, MoE):
            routed = sum(p.numel() for p in module.experts.parameters())  # [E, ...] stacked
            unused += routed // cfg.num_experts * (cfg.num_experts - cfg.num_experts_per_token)
    return total_parameters(model) - model.model.embed_tokens.weight.numel() - unused


def weight_bytes(model: HybridLM) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def assert_kimi_linear_pattern(cfg: ModelConfig) -> None:
    """3 KDA : 1 MLA with MLA every 4th layer and last; first layer dense, the rest MoE with a shared
    expert and enough routed experts (> 4 x top_k) that the MoE routes instead of running every expert."""
    layers = cfg.num_hidden_layers
    assert cfg.mla_layers == sorted({i for i in range(3, layers, 4)} | {layers - 1})
    assert cfg.mlp_layer_types == ["dense"] + ["moe"] * (layers - 1)
    assert cfg.num_shared_experts == 1 and cfg.num_experts > 4 * cfg.num_experts_per_token
    assert cfg.mla_use_nope and cfg.linear_head_dim in (64, 128)


def test_48b_shape_on_meta_matches_the_published_size():
    model = meta_model(BIG)
    assert all(p.is_meta for p in model.parameters())
    assert_kimi_linear_pattern(model.config)
    total, activated = total_parameters(model), activated_parameters(model)
    assert total == model.config.num_parameters() == 49_122_675_072
    assert activated == 3_106_965_888
    # The model card's rounded figures are "48B total, 3B activated" (the name's "48B" and "A3B").
    assert abs(total / 49.1e9 - 1) < 0.01 and abs(total / 48e9 - 1) < 0.03
    assert abs(activated / 3e9 - 1) < 0.05
    # Routed experts are 96% of the weights: why only top_k of them per token makes it "A3B".
    assert model.config.num_experts_per_token == 8 and model.config.num_experts == 256


@pytest.mark.parametrize("path,total,activated", [
    (BIG, 49_122_675_072, 3_106_965_888),
    (MID, 432_525_480, 153_669_800),
])
def test_weight_bytes_per_dtype_on_meta(path, total, activated):
    model = meta_model(path)
    assert total_parameters(model) == total and activated_parameters(model) == activated
    assert weight_bytes(model) == 4 * total  # fp32 as built
    model = model.to(torch.bfloat16)  # still meta: only the element sizes change
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in model.parameters())
    assert weight_bytes(model) == 2 * total


def test_middle_config_keeps_the_48b_pattern_in_the_03_to_05b_band():
    big, mid = load_model_config(BIG), load_model_config(MID)
    model = meta_model(MID)
    assert_kimi_linear_pattern(mid)
    total = total_parameters(model)
    assert 0.3e9 <= total <= 0.5e9 and total == mid.num_parameters()
    assert activated_parameters(model) < total / 2  # a sparse MoE, as the 48B
    # Same per-head shapes as the 48B: NoPE MLA head dims, KDA 128x128 states, top-8 + 1 shared.
    for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "linear_head_dim", "linear_conv_kernel_dim",
                 "num_experts_per_token", "num_shared_experts", "routed_scaling_factor"):
        assert getattr(mid, name) == getattr(big, name), name
    assert mid.intermediate_size / mid.hidden_size == big.intermediate_size / big.hidden_size
    # the 48B's 27 layers, layer for layer (attention and MLP kinds)
    assert (mid.layer_types, mid.mlp_layer_types) == (big.layer_types, big.mlp_layer_types)
    # The YAML's comment states the counts: keep it honest.
    text = Path(MID).read_text()
    assert f"{total:,} total" in text and f"{activated_parameters(model):,} activated" in text
