"""Channel mixers: dense SwiGLU MLP and the MoE block of Kimi Linear / DeepSeek-V3.

MoE routing (transformers' `KimiLinearTopkRouter`, DeepSeek-V3's "noaux_tc"): sigmoid scores;
choice scores = scores + e_score_correction_bias (a load-balancing bias that steers selection
only); experts are split into groups, each group scored by the sum of its top-2 choice scores,
the top `topk_group` groups are kept; top-k experts among them; weights are the plain sigmoid
scores of the chosen experts, renormalised (optional), times routed_scaling_factor. Shared
experts run on every token. Expert weights are named like the checkpoint (`experts.N.w1/w2/w3`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Expert(nn.Module):
    """One routed expert, SwiGLU with the checkpoint's names: w1 = gate, w3 = up, w2 = down."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w3 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Router(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.num_experts = config.num_experts_per_token, config.num_experts
        self.num_groups, self.topk_group = config.num_expert_group, config.topk_group
        self.renormalize, self.scaling = config.moe_renormalize, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        # Updated by load balancing, not by gradients: a buffer that is saved with the weights.
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, D] -> (weights [N, top_k] float32, expert ids [N, top_k])."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [N, E]
        choice = scores + self.e_score_correction_bias.float()
        grouped = choice.view(-1, self.num_groups, self.num_experts // self.num_groups)  # [N, G, E/G]
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [N, G]
        kept_groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores).scatter_(1, kept_groups, 1.0).bool()
        expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(-1, self.num_experts)
        ids = choice.masked_fill(~expert_mask, float("-inf")).topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class MoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = Router(config)
        self.experts = nn.ModuleList(Expert(config.hidden_size, config.moe_intermediate_size)
                                     for _ in range(config.num_experts))
        self.shared_experts = (SwiGLU(config.hidden_size, config.moe_intermediate_size * config.num_shared_experts)
                               if config.num_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, D] -> [N, D]. Each expert runs once on the tokens routed to it."""
        weights, ids = self.gate(x)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, slot = torch.where(ids == e)
            y = self.experts[e](x[token]) * weights[token, slot, None]
            # index_put_ with accumulate rather than index_add_: the same sum (a token meets each
            # expert once), and index_add_ is ~10^4x slower on CPU in torch 2.13.
            out.index_put_((token,), y.to(out.dtype), accumulate=True)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
