"""MLA layer (multi-head latent attention, DeepSeek-V2), as Kimi Linear uses it.

c_kv = RMSNorm(W_dkv x)[:d_c] is the per-token latent; k_r = (W_dkv x)[d_c:] is a key part shared by
all heads (rotated by RoPE unless `mla_use_nope`, Kimi Linear's default). Per head:
k = [W_uk c_kv, k_r], v = W_uv c_kv, q = [q_nope, q_rope] from q_proj (or the low-rank q path).
**Cached per token: [c_kv, k_r] only** (kv_lora_rank + qk_rope_head_dim numbers per layer).
Prefill expands keys/values from the latent; one-token decode uses weight absorption (scores
against c_kv directly), as vLLM/FlashMLA do. Optional "Gated MLA": the attention output is
multiplied by sigmoid(o_gate_proj x) before o_proj.

Names and op order follow transformers' `KimiLinearAttention` (softmax scale = qk_head_dim^-0.5).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels.mla.naive import naive_mla_attention, naive_mla_attention_absorbed
from models.config import ModelConfig
from models.norms import RMSNorm
from models.state import SegmentBatch

# The latent norms use a fixed epsilon, not rms_norm_eps: transformers' KimiLinearAttention builds
# q_a_layernorm / kv_a_layernorm with the RMSNorm default (as DeepSeek-V2/V3 do).
LATENT_NORM_EPS = 1e-6


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE (GPT-NeoX layout). x: [N, ..., d] (d even); positions: [N] -> x's shape."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))  # [d/2]
    angles = positions.float()[:, None] * inv_freq[None]  # [N, d/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1).view(x.shape[0], *([1] * (x.dim() - 2)), d)
    sin = torch.cat([angles.sin(), angles.sin()], -1).view(x.shape[0], *([1] * (x.dim() - 2)), d)
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


_LINEAR_MEMORY_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]


class _KeptAttention(torch.autograd.Function):
    """Causal CPU flash attention whose forward already ran (in the graph-free pass, which kept its
    output and log-sum-exp): the forward hands that output back, the backward is the flash kernel's
    own, from the same saved tensors SDPA's autograd would hold (q, k, v, output, log-sum-exp)."""

    @staticmethod
    def forward(ctx, q, k, v, out, lse, scale):
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, True, scale=ctx.scale)
        return dq, dk, dv, None, None, None


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     kept: dict | None = None, key=None) -> torch.Tensor:
    """Causal softmax attention without the [L, L] score matrix: q, k [B, H, L, Dk], v [B, H, L, Dv]
    -> [B, H, L, Dv]. `scaled_dot_product_attention` restricted to its flash / memory-efficient
    kernels (memory linear in L; backward recomputes the scores from the saved log-sum-exp); the
    quadratic math fallback is excluded, so an unsupported input fails instead of silently building
    L x L. CPU flash attention needs Dv == Dk: MLA's values (128 wide vs 192 for keys at Kimi
    Linear's shape) are zero-padded to Dk and the extra output columns dropped (exact: they are 0).
    On the meta device (the memory planner's probe) SDPA would pick its math form, which saves the
    [L, L] probabilities; the probe runs the CPU flash op instead, which saves what the flash kernels
    save (q, k, v, the output and a [B, H, L] log-sum-exp).

    `kept` (a dict, with `key` naming this call; CPU only): the trainer's graph-free forward stores
    (output, log-sum-exp) under `key`, and the recompute of the same chunk with a graph takes them
    back instead of running the quadratic forward again (`_KeptAttention`); the kept tensors are
    O(L) like the chunk inputs. Valid because the recompute's inputs are bit for bit the first
    pass's (trainer/chunks.py; tests/models/test_long_attention.py checks the gradients are too)."""
    dk, dv = q.shape[-1], v.shape[-1]
    if dv < dk:
        v = F.pad(v, (0, dk - dv))
    if kept is not None and q.device.type == "cpu":
        if not torch.is_grad_enabled():
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
            kept[key] = (out, lse)
            return out[..., :dv]
        if key in kept:
            out, lse = kept.pop(key)
            return _KeptAttention.apply(q, k, v, out, lse, scale)[..., :dv]
    if q.device.type == "meta":
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)[0]
    else:
        with sdpa_kernel(_LINEAR_MEMORY_BACKENDS):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return out[..., :dv]


def causal_attention_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                           kept: dict | None = None, key=None) -> torch.Tensor:
    """`causal_attention`'s plain twin (tests): the [B, H, L, L] scores, masked, softmax, times v
    (`kept`, `key`: accepted and ignored, for drop-in use)."""
    scores = (q @ k.transpose(-1, -2)) * scale  # [B, H, L, L]
    length = q.shape[-2]
    future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)  # [L, L]
    return scores.masked_fill(future, float("-inf")).softmax(dim=-1) @ v


class MLALayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, h = config.hidden_size, config.num_attention_heads
        self.num_heads = h
        self.kv_lora_rank, self.rope_dim = config.kv_lora_rank, config.qk_rope_head_dim
        self.nope_dim, self.v_dim = config.qk_nope_head_dim, config.v_head_dim
        self.use_rope = not config.mla_use_nope and self.rope_dim > 0
        self.rope_theta = config.rope_theta
        self.scale = config.qk_head_dim ** -0.5
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * config.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, h * config.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, config.mla_latent_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, h * (self.nope_dim + self.v_dim), bias=False)
        self.o_gate_proj = nn.Linear(d, h * self.v_dim, bias=False) if config.mla_output_gate else None
        self.o_proj = nn.Linear(h * self.v_dim, d, bias=False)

    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_uk [H, nope, d_c], w_uv [H, v, d_c]) views of kv_b_proj."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, :self.nope_dim], w[:, self.nope_dim:]

    def latent(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Cache entries of the new tokens. x: [N, D] -> [N, d_c + d_r] = [c_kv, k_rope]."""
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        if self.use_rope:
            k_rope = apply_rope(k_rope, positions, self.rope_theta)
        return torch.cat([self.kv_a_layernorm(c_kv), k_rope], dim=-1)

    def queries(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, D], positions: [N] -> (q_nope [N, H, nope], q_rope [N, H, rope])."""
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(x.shape[0], self.num_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        if self.use_rope:
            q_rope = apply_rope(q_rope, positions, self.rope_theta)
        return q_nope, q_rope

    def output(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """(Gate and) o_proj. x: [N, D] layer input, attn: [N, H, v] -> [N, D]."""
        out = attn.to(x.dtype).flatten(1)
        if self.o_gate_proj is not None:
            out = out * torch.sigmoid(self.o_gate_proj(x))
        return self.o_proj(out)

    def forward(self, x: torch.Tensor, batch: SegmentBatch, caches: Sequence[torch.Tensor | None]
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Attend the packed new tokens of every sequence over its cached prefix + themselves.

        x: [N, D]; caches[i]: [starts[i], d_c + d_r] latent cache of sequence i, or None when empty.
        Returns (out [N, D], new caches [starts[i] + new_lens[i], d_c + d_r]); inputs not mutated.
        """
        positions = batch.positions(x.device)
        q_nope, q_rope = self.queries(x, positions)
        new_latent = self.latent(x, positions)  # [N, d_c + d_r]
        w_uk, w_uv = self.up_projections()
        out = x.new_empty(x.shape[0], self.num_heads, self.v_dim)
        new_caches = []
        for i, (start, new_len) in enumerate(zip(batch.starts, batch.new_lens)):
            rows = batch.rows(i)
            old = caches[i]
            if (0 if old is None else old.shape[0]) != start:
                raise ValueError(f"sequence {i}: MLA cache holds {0 if old is None else old.shape[0]} tokens, "
                                 f"expected {start}")
            cache = new_latent[rows] if old is None else torch.cat([old.to(new_latent.dtype), new_latent[rows]])
            attend = naive_mla_attention_absorbed if new_len == 1 else naive_mla_attention
            out[rows] = attend(q_nope[rows], q_rope[rows], cache, w_uk, w_uv, scale=self.scale, q_start=start)
            new_caches.append(cache)
        return self.output(x, out), new_caches
