"""Activation bytes of a training step: measured in a run, and predicted on the meta device.

What "activation peak" means here (the same quantity on both sides): the most bytes of tensors
that autograd saves for backward that are alive at once during the step, each storage counted
once, the model's own parameters and buffers not counted (they are the weights; matmuls save
them, or views of them, for backward) (`SavedTensorMeter`: a saved-tensor pack hook records a
storage the first time it is saved, `weakref.finalize` forgets it when the storage is freed). The trainer recomputes one VPP chunk at
a time (trainer/chunks.py), so this is about one chunk's graph for the largest micro-batch. Not
in it: the chunk-boundary hidden states kept by the no-grad forward ([N, D] per chunk), gradients
of activations in flight during backward, and op temporaries (the [chunk_len, vocab] logits of
the head are recomputed inside a checkpoint, so they are temporaries too). On CUDA the run also
records `torch.cuda.max_memory_allocated` deltas, which include all of those.

The prediction (`activation_peak_bytes`) runs the trainer's own `ChunkedModel.forward_backward`
on a `HybridLM` built on the meta device (no storage: the 48B shape costs nothing) under the same
meter, so every layer's saved tensors come from the code that will run, not from a formula.
Meta tensors carry no values, and a few ops need some: token positions (`repeat_interleave`),
expert batches of a routed MoE (`unique`, `where`), `.tolist()`. `_IndexShadow` keeps a real CPU
copy of every tensor computed only from known values (python lists, other shadowed tensors: the
small integer index tensors) and runs those ops on the copies. Router top-k indices have no
values on meta: they are shadowed as a balanced assignment (row n takes experts n*k .. n*k+k-1
mod E). The routed path's bytes depend on how many token-expert pairs there are (N * k), not on
how they split, so the figure holds for any routing that reaches every expert.

Which MoE form runs depends on the device (models/mlp.py `grouped_mm_usable`): `torch._grouped_mm`
(bf16 on SM90/SM100 GPUs, and on CPUs), else the padded blocked form, which saves a gathered copy
of the expert weights per block for backward (tens of GiB at the 48B shape). The meta device has
no verdict of its own, so the caller says which form the planned device takes (`grouped_mm`).
Meta's `_grouped_mm` kernel takes bf16 only; for other dtypes (a CPU runs fp32 grouped matmuls) the
probe runs `_MetaGroupedMM`, which saves what the real op saves for backward (its input, the
weight view, the offsets), so the plan is the form that runs, not the padded one.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from unittest import mock

from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

import models.mlp
from models.config import ModelConfig
from models.model import HybridLM
from models.precision import cast_parameters
from trainer.activation_meter import SavedTensorMeter
from trainer.chunks import ChunkedModel


class _MetaGroupedMM(torch.autograd.Function):
    """`torch._grouped_mm(a [M, K], b [G, K, N], offs=[G])` on the meta device in dtypes its meta
    kernel refuses: the output's shape and dtype, and the tensors the real op saves for backward
    (a, b and offs; checked against the CPU op in tests/rl/test_plan.py)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b, offs)
        return a.new_empty(a.shape[0], b.shape[-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b, _ = ctx.saved_tensors
        return torch.empty_like(a), torch.empty_like(b), None


def _grouped_mm_on_meta(a: torch.Tensor, b: torch.Tensor, *, offs: torch.Tensor, **kwargs) -> torch.Tensor:
    """The probe's torch._grouped_mm: the meta kernel where it exists (bf16), else `_MetaGroupedMM`."""
    if a.dtype == b.dtype == torch.bfloat16 or a.device.type != "meta" or kwargs:
        return _REAL_GROUPED_MM(a, b, offs=offs, **kwargs)
    return _MetaGroupedMM.apply(a, b, offs)


_REAL_GROUPED_MM = getattr(torch, "_grouped_mm", None)

_MAX_SHADOW_NUMEL = 1 << 24
"""Outputs larger than this keep no values (an [L, L] causal mask, say: nothing needs its values, and
computing them for real would cost what the meta device saves); data-dependent ops still get theirs."""


def _numel(out) -> int:
    return sum(t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))


class _FromData(TorchFunctionMode):
    """`torch.tensor(values, device="meta")` does not pass through dispatch modes: give its result
    the values it was built from (the shadow's entry point for python lists)."""

    def __init__(self, shadow: "_IndexShadow") -> None:
        super().__init__()
        self.shadow = shadow

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if (func in (torch.tensor, torch.as_tensor) and isinstance(out, torch.Tensor) and out.device.type == "meta"
                and not isinstance(args[0], torch.Tensor)):
            self.shadow.values[out] = func(*args, **{**kwargs, "device": "cpu"})
        return out


class _IndexShadow(TorchDispatchMode):
    """Meta execution with real values where values are known (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.values = WeakTensorKeyDictionary()  # meta tensor -> its real CPU twin

    def _value(self, x: torch.Tensor) -> torch.Tensor | None:
        if x.device.type != "meta":
            return x
        return self.values.get(x)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if func is aten._local_scalar_dense.default:  # .item(), int(), .tolist() element
            value = self._value(args[0])
            if value is None:
                raise RuntimeError(f"activation probe: a {args[0].dtype} {tuple(args[0].shape)} value is needed but "
                                   f"was computed from weights or activations (meta tensors have none)")
            return value.item()
        leaves, _ = tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        known = all(self._value(t) is not None for t in tensors)
        try:
            out = func(*args, **kwargs)
        except (RuntimeError, NotImplementedError):  # data-dependent output shape on meta
            if not known:
                raise
            out = None
        if func is aten.topk.default and not known:
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            self._balanced_indices(out[1], args[0].shape[dim])
            return out
        if not known or (out is not None and _numel(out) > _MAX_SHADOW_NUMEL):
            self._forget_mutated(func, args)
            return out
        real = func(*tree_map(self._real, args), **tree_map(self._real, kwargs))
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cpu":
            return real  # an explicit copy to the host: the caller wants the values
        if out is None:
            out = tree_map(lambda r: torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device="meta")
                           if isinstance(r, torch.Tensor) else r, real)
        small = bool(tensors) or all(not r.is_floating_point() for r in tree_flatten(real)[0]
                                     if isinstance(r, torch.Tensor))
        if small:  # factories of floats (zeros(N, D)) stay meta only
            for o, r in zip(tree_flatten(out)[0], tree_flatten(real)[0]):
                if isinstance(o, torch.Tensor) and o.device.type == "meta":
                    self.values[o] = r
        return out

    def _real(self, x):
        if isinstance(x, torch.Tensor):
            return self._value(x)
        if isinstance(x, torch.device) and x.type == "meta":
            return torch.device("cpu")
        return x

    def _balanced_indices(self, ids: torch.Tensor, width: int) -> None:
        """Shadow top-k indices [..., k] (over a dimension of `width` entries) as a balanced
        assignment: row n takes n*k .. n*k+k-1 mod width (distinct within a row)."""
        rows, k = ids.shape[:-1].numel(), ids.shape[-1]
        self.values[ids] = (torch.arange(rows * k, dtype=ids.dtype) % width).view(ids.shape)

    def _forget_mutated(self, func, args) -> None:
        """An op with unknown inputs that writes into a shadowed tensor makes its copy stale."""
        if not func._schema.is_mutable or not self.values:
            return
        for arg, x in zip(func._schema.arguments, args):
            if arg.alias_info is not None and arg.alias_info.is_write and isinstance(x, torch.Tensor):
                self.values.pop(x, None)


def activation_peak_bytes(model_config: ModelConfig, micro_batches: Sequence[Sequence[int]], num_chunks: int,
                          dtype: torch.dtype = torch.float32, logprob_chunk_len: int = 1024,
                          grouped_mm: bool = False, split: str = "layers") -> int:
    """The saved-tensor peak (`SavedTensorMeter`) of one training step over `micro_batches` (each a
    list of sequence lengths, run one after the other as the trainer does), for a model of
    `model_config` with parameters in `dtype` (models/precision.py's rule: a few stay FP32), split
    into `num_chunks` VPP chunks by `split` (trainer/chunks.py). Runs on the meta device: allocates
    nothing of the model's size."""
    return max(chunk_activation_peaks(model_config, micro_batches, num_chunks, dtype, logprob_chunk_len, grouped_mm,
                                      split))


def chunk_activation_peaks(model_config: ModelConfig, micro_batches: Sequence[Sequence[int]], num_chunks: int,
                           dtype: torch.dtype = torch.float32, logprob_chunk_len: int = 1024,
                           grouped_mm: bool = False, split: str = "layers") -> list[int]:
    """Per VPP chunk, the saved-tensor peak while it is recomputed and backpropagated (max over the
    micro-batches); the step's peak is their max (nothing is saved in the no-grad forward before).
    grouped_mm: the planned device runs routed experts through torch._grouped_mm (module docstring)."""

    def usable(x: torch.Tensor, w: torch.Tensor) -> bool:
        align = 16 // x.element_size()  # grouped_mm_usable's stride rule (dims of 16-byte multiples)
        return grouped_mm and x.dtype == w.dtype and not (w.shape[1] % align or w.shape[2] % align)

    with torch.device("meta"):
        model = HybridLM(model_config)
    cast_parameters(model, dtype)
    chunked = ChunkedModel(model, num_chunks, split)
    meter, shadow = SavedTensorMeter(exclude=[*model.parameters(), *model.buffers()]), _IndexShadow()
    peaks = [0] * num_chunks

    def chunk_done(chunk: int) -> None:
        peaks[chunk] = max(peaks[chunk], meter.peak)
        meter.peak = meter.live  # the next chunk's window starts here

    done: set[tuple[int, ...]] = set()
    for lens in micro_batches:
        key = tuple(lens)  # the mixer's buckets and row order follow the lengths in order
        if key in done:
            continue
        done.add(key)
        num_tokens = sum(lens)
        with (_FromData(shadow), shadow, meter.hooks(), warnings.catch_warnings(),
              mock.patch.object(models.mlp, "grouped_mm_usable", usable),
              mock.patch.object(torch, "_grouped_mm", _grouped_mm_on_meta, create=True)):
            warnings.filterwarnings("ignore", message="MoE experts: torch._grouped_mm not used")
            tokens = torch.zeros(num_tokens, dtype=torch.long, device="meta")  # [N]
            targets = torch.zeros(num_tokens, dtype=torch.long, device="meta")  # [N]
            meter.peak = meter.live
            chunked.forward_backward(tokens, list(lens), targets, lambda logp: -logp.sum(),
                                     on_chunk_done=chunk_done, logprob_chunk_len=logprob_chunk_len)
        for p in model.parameters():
            p.grad = None
    return peaks
