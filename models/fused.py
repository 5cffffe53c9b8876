"""Fused projection weights for inference: several linears that read the same input, run as one.

On CPU a decode step is bound by per-op overhead (hundreds of small ops per token batch), so the
layers run their sibling projections (KDA's q|k|v|f_a|g_a|b, the MoE's expert and shared
gate|up) as one matmul when no gradient is recorded. The concatenated weight is cached on the
module and rebuilt whenever any source weight changes: new storage (load, `.to()`) or an in-place
update (optimizer step, `load_state_dict`'s copy), which bumps the tensor's version counter.
Training (grad enabled) always runs the separate modules, so autograd sees the plain graph.
The cache costs one extra copy of the fused weights, hence CPU only (GPU runs use the kernels);
the rollout engine drops it when it sleeps (`drop_fused`), so the copy exists only while it
generates, and `unfused()` turns the path off where no copy may be built at all.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn


_UNFUSED_DEPTH = 0
"""How many `unfused()` blocks are open (the flag is process-wide: the forwards that open one run
on the main thread)."""


def use_fused(x: torch.Tensor) -> bool:
    """Whether a layer should take its fused inference path for input x."""
    return not torch.is_grad_enabled() and x.device.type == "cpu" and _UNFUSED_DEPTH == 0


@contextmanager
def unfused() -> Iterator[None]:
    """Inside: every layer takes its plain (unfused) path and builds no fused weight copy. For
    forwards whose weights must have no copy outside their storage (the reference model streamed
    through the gradient slots) and their twins (the resident reference), which must run the same ops."""
    global _UNFUSED_DEPTH
    _UNFUSED_DEPTH += 1
    try:
        yield
    finally:
        _UNFUSED_DEPTH -= 1


def drop_fused(module: nn.Module) -> int:
    """Drop every fused weight cached in `module` and its submodules; returns their bytes (each
    storage counted once). They are rebuilt on the next fused forward."""
    dropped: dict[int, int] = {}
    for m in module.modules():
        for _, tensor in m.__dict__.pop("_fused_weights", {}).values():
            dropped[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(dropped.values())


def fused_bytes(module: nn.Module) -> int:
    """Bytes of the fused weights cached in `module` and its submodules now (each storage once)."""
    held: dict[int, int] = {}
    for m in module.modules():
        for _, tensor in m.__dict__.get("_fused_weights", {}).values():
            held[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(held.values())


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
