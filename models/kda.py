"""KDA layer (Kimi Delta Attention): the linear-attention mixer of Kimi Linear.

Per token x: q, k, v = linear projections, each through a short causal depthwise convolution
(kernel 4) and SiLU; q, k are L2-normalised per head; beta = sigmoid(b_proj x) per head; a
per-channel log-decay g = -exp(A_log) * softplus(f_b(f_a x) + dt_bias); the gated delta rule
(kernels/kda) mixes tokens; the output is a per-head RMSNorm gated by sigmoid(g_b(g_a x)), then
o_proj. Reference: Kimi Linear (arXiv:2510.26692) and transformers' `KimiLinearDeltaAttention`,
whose op order this follows so logits match to fp32 rounding.

Parameter names are those of the public checkpoints (`q_conv1d`, `A_log`, `dt_bias`, ...) so the
name map to disk stays trivial; see models/checkpoint.py.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kernels.kda.naive import naive_chunk_kda, naive_recurrent_kda
from models.config import ModelConfig
from models.fused import fused_weight, use_fused
from models.norms import GatedRMSNorm
from models.state import KDALayerState, SegmentBatch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim: fla's form (eps inside the sqrt, not a clamp)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class KDALayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, h, dk = config.hidden_size, config.linear_num_heads, config.linear_head_dim
        self.num_heads, self.head_dim, self.kernel = h, dk, config.linear_conv_kernel_dim
        qkv = h * dk
        self.q_proj = nn.Linear(d, qkv, bias=False)
        self.k_proj = nn.Linear(d, qkv, bias=False)
        self.v_proj = nn.Linear(d, qkv, bias=False)
        # Depthwise conv filters (weights [channels, 1, kernel]); applied in forward() over the
        # previous tokens' tail + the new tokens, never with the modules' own zero padding.
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            nn.Conv1d(qkv, qkv, self.kernel, groups=qkv, bias=False) for _ in range(3))
        self.f_a_proj = nn.Linear(d, dk, bias=False)
        self.f_b_proj = nn.Linear(dk, qkv, bias=False)
        self.A_log = nn.Parameter(torch.empty(h))  # one decay rate per head
        self.dt_bias = nn.Parameter(torch.empty(qkv))
        self.b_proj = nn.Linear(d, h, bias=False)
        self.g_a_proj = nn.Linear(d, dk, bias=False)
        self.g_b_proj = nn.Linear(dk, qkv, bias=False)
        self.o_norm = GatedRMSNorm(dk, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(qkv, d, bias=False)

    @property
    def conv_weight(self) -> torch.Tensor:
        """[3 * qkv, kernel]: q, k, v depthwise filters stacked in that order."""
        return torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]).squeeze(1)

    def empty_state(self, device: torch.device, dtype: torch.dtype) -> KDALayerState:
        h, dk = self.num_heads, self.head_dim
        return KDALayerState(
            recurrent=torch.zeros(h, dk, dk, device=device, dtype=torch.float32),  # [H, dk, dv]
            conv_tail=torch.zeros(self.kernel - 1, 3 * h * dk, device=device, dtype=dtype),  # [K-1, 3*qkv]
        )

    def decay(self, f_a: torch.Tensor) -> torch.Tensor:
        """Per-channel log-decay g (<= 0), float32. f_a = f_a_proj(x): [N, dk] -> [N, H, dk]."""
        if use_fused(f_a) and f_a.dtype == self.dt_bias.dtype == torch.float32:
            raw = F.linear(f_a, self.f_b_proj.weight, self.dt_bias)  # bias added inside the matmul
            rate = fused_weight(self, "rate", [self.A_log], lambda: -torch.exp(self.A_log.float())[:, None])
        else:
            raw = self.f_b_proj(f_a).float() + self.dt_bias.float()
            rate = -torch.exp(self.A_log.float())[:, None]  # [H, 1]
        raw = raw.view(f_a.shape[0], self.num_heads, self.head_dim)
        # softplus with the reference's overflow guard (identity above 20), which F.softplus shares.
        return rate * F.softplus(raw, beta=1.0, threshold=20.0)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-token inputs of the mixer. x: [N, D] -> (pre-conv q|k|v [N, 3*qkv], g [N, H, dk] fp32,
        beta [N, H] fp32, output gate logits [N, H, dk] for `output`)."""
        h, dk = self.num_heads, self.head_dim
        if use_fused(x):  # one matmul for the six projections of x (models/fused.py)
            weight = fused_weight(self, "in", [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight,
                                               self.f_a_proj.weight, self.g_a_proj.weight, self.b_proj.weight])
            mixed, f_a, g_a, b = F.linear(x, weight).split([3 * h * dk, dk, dk, h], dim=-1)
        else:
            mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # [N, 3*qkv]
            f_a, g_a, b = self.f_a_proj(x), self.g_a_proj(x), self.b_proj(x)
        gate = self.g_b_proj(g_a).view(x.shape[0], h, dk)
        return mixed, self.decay(f_a), torch.sigmoid(b.float()), gate

    def short_conv(self, mixed: torch.Tensor, tail: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Causal depthwise conv + SiLU of B sequences' new tokens after their conv tails.

        mixed: [B, L, 3*qkv] pre-conv inputs; tail: [B, kernel-1, 3*qkv] the previous tokens' inputs.
        Returns (q, k, v [B, L, H, dk] fp32 with q, k L2-normalised, ext [B, kernel-1+L, 3*qkv]);
        the conv tail after token j of the new ones is ext[:, j+1 : j+kernel].
        """
        bsz, new_len, channels = mixed.shape
        ext = torch.cat([tail.to(mixed.dtype), mixed], dim=1)  # [B, K-1+L, 3*qkv]
        # Depthwise causal conv as K shifted multiply-adds over contiguous slices (cheaper on CPU
        # than conv1d or an unfolded window product for short inputs; same sum).
        if use_fused(mixed):
            taps = fused_weight(self, "taps", [self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight],
                                lambda: self.conv_weight.t().contiguous())
        else:
            taps = self.conv_weight.t().contiguous()  # [K, 3*qkv]: tap j of every channel, contiguous
        if new_len == 1:  # decode: one window, one product and one sum
            conv = (ext * taps).sum(dim=1, keepdim=True)  # [B, 1, 3*qkv]
        else:
            conv = ext[:, :new_len] * taps[0]  # [B, L, 3*qkv], a fresh tensor: safe to accumulate into
            for j in range(1, self.kernel):
                conv.addcmul_(ext[:, j:j + new_len], taps[j])
        qkv = F.silu(conv).float().view(bsz, new_len, 3, self.num_heads, self.head_dim)
        q, k = l2norm(qkv[:, :, :2]).unbind(2)  # q and k normalised in one go
        return q, k, qkv[:, :, 2], ext

    def decode_conv(self, mixed: torch.Tensor, tails: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`short_conv` of one new token per sequence, with conv tails in head-major layout (the
        page pool's): tails [B, H, 3 (q, k, v), kernel-1, dk], mixed [B, 3*qkv].
        Returns (q, k, v [B, H, dk] fp32, q and k L2-normalised; new tails [B, H, 3, kernel-1, dk],
        a view). Same sums as `short_conv` (tests compare the engine with the plain model)."""
        bsz, h, dk = mixed.shape[0], self.num_heads, self.head_dim
        new = mixed.view(bsz, 3, h, 1, dk).transpose(1, 2)  # [B, H, 3, 1, dk]
        ext = torch.cat([tails.to(mixed.dtype), new], dim=3)  # [B, H, 3, K, dk]
        qkv = F.silu((ext * self.head_major_taps()).sum(dim=3)).float()  # [B, H, 3, dk]
        q, k = l2norm(qkv[:, :, :2]).unbind(2)
        return q, k, qkv[:, :, 2], ext[:, :, :, 1:]

    def head_major_taps(self) -> torch.Tensor:
        """Conv taps in the pool's tail layout, [H, 3 (q, k, v), kernel, dk] (cached per weight version)."""
        h, dk = self.num_heads, self.head_dim
        return fused_weight(self, "head_major_taps", [self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight],
                            lambda: self.conv_weight.view(3, h, dk, self.kernel).permute(1, 0, 3, 2).contiguous())

    def output(self, core: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Gated per-head norm + o_proj. core: [N, H, dv] mixer output, gate: [N, H, dv] from
        `project` -> [N, D] in gate's dtype."""
        return self.o_proj(self.o_norm(core.to(gate.dtype), gate).flatten(1))

    def forward(self, x: torch.Tensor, batch: SegmentBatch, states: Sequence[KDALayerState | None],
                state_positions: Sequence[Sequence[int]]
                ) -> tuple[torch.Tensor, list[KDALayerState], list[list[KDALayerState]]]:
        """Mix the packed new tokens of every sequence, starting from `states` (None = empty).

        x: [N, D] packed hidden states. `state_positions[i]` are absolute token positions of
        sequence i (start <= p <= start + new_len) at which to return its layer state.
        Returns (out [N, D], the final state of every sequence, the requested states). Inputs are
        not mutated.
        """
        mixed, g, beta, gate = self.project(x)
        core = torch.empty(x.shape[0], self.num_heads, self.head_dim, dtype=torch.float32, device=x.device)
        finals, requested = [], []
        for i, (start, new_len) in enumerate(zip(batch.starts, batch.new_lens)):
            rows = batch.rows(i)
            state = states[i] if states[i] is not None else self.empty_state(x.device, mixed.dtype)
            q, k, v, ext = self.short_conv(mixed[None, rows], state.conv_tail[None])
            rel = [p - start for p in state_positions[i]]
            if any(r < 0 or r > new_len for r in rel):
                raise ValueError(f"state positions {list(state_positions[i])} of sequence {i} must lie in "
                                 f"[{start}, {start + new_len}]")
            # One-token decode uses the recurrent form, longer runs the chunked (WY) form.
            kda = naive_recurrent_kda if new_len == 1 else naive_chunk_kda
            o, final, at = kda(q, k, v, g[None, rows], beta[None, rows],
                               initial_state=state.recurrent[None], state_positions=rel)
            core[rows] = o[0]
            finals.append(KDALayerState(final[0], ext[0, new_len:].clone()))
            requested.append([KDALayerState(at[0, j], ext[0, r:r + self.kernel - 1].clone())
                              for j, r in enumerate(rel)])
        return self.output(core, gate), finals, requested
