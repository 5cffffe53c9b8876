"""RMSNorm and the gated RMSNorm of KDA's output, in the exact op order of the reference.

Both normalise in float32 (as transformers' `KimiLinearRMSNorm` / fla's `FusedRMSNormGated`), so
a bf16 model keeps fp32 statistics.
"""
import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim] -> same shape and dtype."""
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # The same two products in the same order, in one op: (x * rsqrt(mean(x^2) + eps)) * weight.
            return F.rms_norm(x, (x.shape[-1],), weight=self.weight, eps=self.eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)  # x * rsqrt(mean(x^2) + eps), fp32
        return self.weight * normed.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of KDA's output, multiplied by sigmoid(gate) (weight kept in fp32 math)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate: [..., dim] -> [..., dim] in x's dtype."""
        normed = F.rms_norm(x.float(), (x.shape[-1],), weight=self.weight.float(), eps=self.eps)
        return (normed * torch.sigmoid(gate.float())).to(x.dtype)
