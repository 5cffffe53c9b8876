"""Helpers that build transformers' KimiLinearForCausalLM (the independent reference) on CPU.

transformers binds fla's Triton kernels when `fla` is importable; blocking the import keeps its
torch fallbacks, which are what runs on CPU (fla's kernels need a GPU).
"""
from __future__ import annotations

import sys

import torch

sys.modules.setdefault("fla", None)  # never let transformers bind fla's kernels in the tests

from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402


def hf_config(*, moe: bool, q_lora_rank: int | None = None, num_layers: int = 4, vocab_size: int = 97,
              **overrides) -> KimiLinearConfig:
    """A tiny random kimi_linear config: KDA layers with one MLA every 4th (1-indexed) layer."""
    kda = [i + 1 for i in range(num_layers) if (i + 1) % 4]
    full = [i + 1 for i in range(num_layers) if (i + 1) % 4 == 0]
    kwargs = dict(
        vocab_size=vocab_size, hidden_size=48, intermediate_size=80, moe_intermediate_size=24,
        num_hidden_layers=num_layers, num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=20,
        q_lora_rank=q_lora_rank, qk_rope_head_dim=6, v_head_dim=10, qk_nope_head_dim=14,
        num_experts=8, num_experts_per_token=3, n_group=4, topk_group=2, n_shared_experts=1,
        routed_scaling_factor=2.446, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        linear_attn_config={"head_dim": 12, "num_heads": 2, "short_conv_kernel_size": 4,
                            "kda_layers": kda, "full_attn_layers": full},
        first_k_dense_replace=1 if moe else num_layers,
    )
    kwargs.update(overrides)
    return KimiLinearConfig(**kwargs)


def random_hf_model(config: KimiLinearConfig, seed: int = 0) -> KimiLinearForCausalLM:
    """HF model with every tensor randomised, norms and routing biases included, so no weight
    can be ignored or mis-mapped without changing the logits."""
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(config).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if name.endswith("A_log"):
                tensor.copy_(torch.empty_like(tensor).uniform_(1, 16).log())
            elif name.endswith("dt_bias"):
                tensor.copy_(torch.randn_like(tensor) - 4.0)
            elif "norm" in name:
                tensor.copy_(1.0 + 0.3 * torch.randn_like(tensor))
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(0.3 * torch.randn_like(tensor))
            else:
                tensor.copy_(torch.randn_like(tensor) * (0.5 / tensor.shape[-1] ** 0.5))
    return model
