"""Activation memory as autograd sees it: the bytes of the storages saved for backward."""
from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch


class SavedTensorMeter:
    """Live and peak bytes of the storages autograd saves for backward (each storage once), except
    the `exclude`d tensors' storages: a model's parameters and buffers, which every matmul saves for
    its input gradient but which are weights, counted as such, and alive whatever backward does.

        meter = SavedTensorMeter(exclude=model.parameters())
        with meter.hooks():
            loss.backward() ...          # meter.peak: the largest live total seen

    Works for any device, meta included (storages are keyed by their C++ object, not their data
    pointer). Hooks are thread-local and nest: inside a checkpointed region the checkpoint's own
    hooks apply, which save no activation."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self.live, self.peak = 0, 0
        self._seen: dict[int, int] = {}
        self._excluded = {t.untyped_storage()._cdata for t in exclude}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self._seen and key not in self._excluded:
            nbytes = storage.nbytes()
            self._seen[key] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key)
        return t

    def _free(self, key: int) -> None:
        self.live -= self._seen.pop(key, 0)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
