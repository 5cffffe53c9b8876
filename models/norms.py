"""RMSNorm and the gated RMSNorm of KDA's output, in the exact op order of the reference.

Both normalise in float32 (as transformers' `KimiLinearRMSNorm` / fla's `FusedRMSNormGated`), so
a bf16 model keeps fp32 statistics.
"""
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim] -> same shape and dtype."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of KDA's output, multiplied by sigmoid(gate) (weight kept in fp32 math)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate: [..., dim] -> [..., dim] in x's dtype."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        x32 = self.weight.float() * x32 * torch.sigmoid(gate.float())
        return x32.to(x.dtype)
