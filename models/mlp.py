"""Channel mixers: dense SwiGLU MLP and the MoE block of Kimi Linear / DeepSeek-V3.

MoE routing (transformers' `KimiLinearTopkRouter`, DeepSeek-V3's "noaux_tc"): sigmoid scores;
choice scores = scores + e_score_correction_bias (a load-balancing bias that steers selection
only); experts are split into groups, each group scored by the sum of its top-2 choice scores,
the top `topk_group` groups are kept; top-k experts among them; weights are the plain sigmoid
scores of the chosen experts, renormalised (optional), times routed_scaling_factor. Shared
experts run on every token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from kernels.cpu import ops as cpu_ops
from models.fused import fused_weight, use_fused


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """The routed experts' SwiGLU weights, stacked: w1 (gate) and w3 (up) [E, I, D], w2 (down) [E, D, I].

    Stacked so that all experts run in a few batched matmuls; the checkpoint keeps one tensor per
    expert (`experts.N.w1.weight`), see models/checkpoint.py.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def runs_dense(self, top_k: int) -> bool:
        """Whether every expert runs on every token (few experts: at most 4x the routed FLOPs)."""
        return self.w1.shape[0] <= 4 * top_k

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [N, D]; weights, ids: [N, top_k] -> sum_k weights * expert_ids(x): [N, D]."""
        num_experts, top_k = self.w1.shape[0], ids.shape[1]
        if self.runs_dense(top_k):
            # Few experts: run every expert on every token (at most 4x the routed FLOPs), as two
            # matmuls against all experts' weights at once, and fold the routing weights (zero for
            # unchosen experts) in before the down projection: ~8 ops instead of ~10 per expert.
            num_tokens, inter = x.shape[0], self.w1.shape[1]
            gate = F.linear(x, self.w1.reshape(-1, self.w1.shape[-1]))  # [N, E*I]
            up = F.linear(x, self.w3.reshape(-1, self.w3.shape[-1]))  # [N, E*I]
            dense = torch.zeros(num_tokens, num_experts, dtype=weights.dtype, device=x.device)
            dense.scatter_(1, ids, weights)  # [N, E] routing weights
            h = (F.silu(gate) * up).view(num_tokens, num_experts, inter) * dense[:, :, None].to(x.dtype)
            down = self.w2.permute(1, 0, 2).reshape(self.w2.shape[1], -1)  # [D, E*I]
            return F.linear(h.reshape(num_tokens, -1), down)  # [N, D]
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, slot = torch.where(ids == e)
            xe = x[token]
            y = F.linear(F.silu(F.linear(xe, self.w1[e])) * F.linear(xe, self.w3[e]), self.w2[e])
            # index_put_ with accumulate rather than index_add_: the same sum (a token meets each
            # expert once), and index_add_ is orders of magnitude slower on a busy 2-core CPU.
            out.index_put_((token,), (y * weights[token, slot, None]).to(out.dtype), accumulate=True)
        return out


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
        if self.topk_group < self.num_groups:  # group-limited routing: experts of the best groups only
            grouped = choice.view(-1, self.num_groups, self.num_experts // self.num_groups)  # [N, G, E/G]
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [N, G]
            kept_groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices  # [N, topk_group]
            dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, False)  # [N, G]
            choice = grouped.masked_fill(dropped[:, :, None], float("-inf")).view(-1, self.num_experts)
        ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class MoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = Router(config)
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_experts = (SwiGLU(config.hidden_size, config.moe_intermediate_size * config.num_shared_experts)
                               if config.num_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, D] -> [N, D]."""
        experts, shared = self.experts, self.shared_experts
        if (use_fused(x) and shared is not None and experts.runs_dense(self.gate.top_k)
                and shared.gate_proj.weight.shape[0] % experts.w1.shape[1] == 0):
            return self._fused_dense(x)
        weights, ids = self.gate(x)
        out = experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _routing_dense(self, x: torch.Tensor, num_shared: int) -> torch.Tensor:
        """[N, E + num_shared] routing weights: the router's, zero for unchosen experts, 1 for the
        shared ones. On CPU fp32 with the fused kernels built, one C++ op after the scores
        (kernels/cpu/, same comparisons and float ops as `Router.forward`); else the router + scatter."""
        gate = self.gate
        if x.dtype == torch.float32 and gate.weight.dtype == torch.float32 and cpu_ops() is not None:
            scores = F.linear(x, gate.weight).sigmoid_()  # [N, E]
            return cpu_ops().moe_route_dense(scores, gate.e_score_correction_bias.float(), gate.top_k, gate.num_groups,
                                             gate.topk_group, gate.renormalize, float(gate.scaling), num_shared)
        weights, ids = gate(x)
        dense = torch.zeros(x.shape[0], gate.num_experts + num_shared, dtype=weights.dtype, device=x.device)
        dense[:, gate.num_experts:] = 1.0  # the shared experts
        return dense.scatter_(1, ids, weights)

    def _fused_dense(self, x: torch.Tensor) -> torch.Tensor:
        """Inference form of the dense all-experts path plus the shared experts, with the shared
        intermediate (num_shared * I channels) run as `num_shared` extra experts of routing weight 1
        (SwiGLU is per channel and the down projection sums channels, so the split is exact):
        one matmul for every gate|up projection, one for every down projection."""
        experts, shared = self.experts, self.shared_experts
        num_experts, inter, dim = experts.w1.shape
        num_shared = shared.gate_proj.weight.shape[0] // inter
        total, num_tokens = num_experts + num_shared, x.shape[0]
        sources = [experts.w1, experts.w3, experts.w2, shared.gate_proj.weight, shared.up_proj.weight,
                   shared.down_proj.weight]
        w_in = fused_weight(self, "in", sources, lambda: torch.cat(
            [experts.w1.reshape(-1, dim), shared.gate_proj.weight, experts.w3.reshape(-1, dim), shared.up_proj.weight]))
        w_out = fused_weight(self, "out", sources, lambda: torch.cat(
            [experts.w2.permute(1, 0, 2).reshape(dim, -1), shared.down_proj.weight], dim=1))  # [D, (E + S) * I]
        gate, up = F.linear(x, w_in).chunk(2, dim=-1)  # [N, (E + S) * I] each
        dense = self._routing_dense(x, num_shared)  # [N, E + S] routing weights, zero for unchosen experts
        hidden = (F.silu(gate) * up).view(num_tokens, total, inter) * dense[:, :, None].to(x.dtype)
        return F.linear(hidden.view(num_tokens, -1), w_out)
