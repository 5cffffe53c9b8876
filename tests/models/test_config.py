"""Model configs: YAML schemas, validation errors, HF config.json conversion, the 48B shape."""
import dataclasses
import json

import pytest
from omegaconf.errors import ConfigKeyError, ValidationError

from models.config import ModelConfig, hybrid_layer_types, load_model_config
from models.model import HybridLM


def test_tiny_config_builds_and_counts_its_parameters():
    cfg = load_model_config("configs/model/tiny.yaml")
    model = HybridLM(cfg).init_weights()  # (no wall-clock bound: a loaded host makes any flaky)
    assert cfg.num_parameters() == sum(p.numel() for p in model.parameters())
    assert cfg.layer_types == hybrid_layer_types(8)  # KKKM x 2


def test_kimi_linear_48b_shape_is_valid_and_sized_as_published():
    cfg = load_model_config("configs/model/kimi_linear_48b_a3b.yaml")
    assert cfg.layer_types.count("kda") == 20 and cfg.mla_layers == [3, 7, 11, 15, 19, 23, 26]
    assert 48e9 < cfg.num_parameters() < 50e9  # "48B" total
    active = dataclasses.replace(cfg, num_experts=cfg.num_experts_per_token)  # routed experts a token uses
    assert 3e9 < active.num_parameters() < 4e9  # "A3B" activated (embeddings included)
    # MLA caches [c_kv, k_rope] = 576 numbers per token and layer; a KDA state is 32 heads of 128x128
    assert cfg.mla_latent_dim == 576 and cfg.linear_qkv_dim == 4096
    # config.json round trip, in the keys transformers reads
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict()))) == cfg


def test_kimi_linear_config_json_keys_are_understood():
    """Moonshot's published config.json style: 1-indexed layer lists and first_k_dense_replace."""
    hf = {"model_type": "kimi_linear", "vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 4,
          "intermediate_size": 64, "num_attention_heads": 2, "kv_lora_rank": 16, "q_lora_rank": None,
          "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "first_k_dense_replace": 1,
          "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4], "head_dim": 8, "num_heads": 2,
                                 "short_conv_kernel_size": 4},
          "num_experts": 4, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": 8,
          "eos_token_id": [7, 8]}
    cfg = ModelConfig.from_hf_dict(hf)
    assert cfg.layer_types == ["kda", "kda", "kda", "mla"]
    assert cfg.mlp_layer_types == ["dense", "moe", "moe", "moe"]
    assert cfg.eos_token_id == 7 and cfg.linear_head_dim == 8


@pytest.mark.parametrize("override,message", [
    (["hidden_size=0"], "hidden_size=0, expected a positive integer"),
    (["num_experts_per_token=9"], "num_experts_per_token=9, expected 1..num_experts=8"),
    (["num_expert_group=3"], "num_experts=8 is not divisible by num_expert_group=3"),
    (["num_hidden_layers=7"], "layer_types has 8 entries, expected num_hidden_layers=7"),
    (["layer_types=[kda,kda,kda,mla,kda,kda,gdn,mla]"], r"unknown layer type 'gdn' at layer_types\[6\]"),
    (["mla_use_nope=false", "qk_rope_head_dim=7"], "qk_rope_head_dim=7 must be even"),
    (["eos_token_id=300"], r"eos_token_id=300, expected an id in \[0, 259\)"),
])
def test_bad_values_are_named(override, message):
    with pytest.raises(ValueError, match=message):
        load_model_config("configs/model/tiny.yaml", override)


def test_misspelt_or_mistyped_yaml_keys_fail_at_composition():
    with pytest.raises(ConfigKeyError, match="hiden_size"):
        load_model_config("configs/model/tiny.yaml", ["hiden_size=64"])
    with pytest.raises(ValidationError, match="hidden_size"):
        load_model_config("configs/model/tiny.yaml", ["hidden_size=wide"])


def test_hybrid_pattern_rejects_unknown_letters():
    assert hybrid_layer_types(5, "KM") == ["kda", "mla", "kda", "mla", "kda"]
    with pytest.raises(ValueError, match="'KXM'"):
        hybrid_layer_types(4, "KXM")
