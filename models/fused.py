"""Fused projection weights for inference: several linears that read the same input, run as one.

On CPU a decode step is bound by per-op overhead (hundreds of small ops per token batch), so the
layers run their sibling projections (KDA's q|k|v|f_a|g_a|b, the MoE's expert and shared
gate|up) as one matmul when no gradient is recorded. The concatenated weight is cached on the
module and rebuilt whenever any source weight changes: new storage (load, `.to()`) or an in-place
update (optimizer step, `load_state_dict`'s copy), which bumps the tensor's version counter.
Training (grad enabled) always runs the separate modules, so autograd sees the plain graph.
The cache costs one extra copy of the fused weights, hence CPU only (GPU runs use the kernels).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn


def use_fused(x: torch.Tensor) -> bool:
    """Whether a layer should take its fused inference path for input x."""
    return not torch.is_grad_enabled() and x.device.type == "cpu"


def fused_weight(owner: nn.Module, name: str, sources: Sequence[torch.Tensor],
                 build: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
    """The fused weight `build()` (default: torch.cat(sources)), cached on `owner` under `name`
    while every source tensor (parameters, not views of them) is unchanged."""
    key = tuple((w.data_ptr(), w._version, tuple(w.shape), w.dtype) for w in sources)
    cache: dict[str, tuple[tuple, torch.Tensor]] = owner.__dict__.setdefault("_fused_weights", {})
    hit = cache.get(name)
    if hit is None or hit[0] != key:
        with torch.no_grad():
            hit = (key, build() if build is not None else torch.cat([w.detach() for w in sources]))
        cache[name] = hit
    return hit[1]
