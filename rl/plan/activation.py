"""Activation bytes of a training step: measured in a run, and predicted on the meta device.

What "activation peak" means here (the same quantity on both sides): the most bytes of tensors
that autograd saves for backward that are alive at once during the step, each storage counted
once, the model's own parameters and buffers not counted (they are the weights; matmuls save
them, or views of them, for backward) (`SavedTensorMeter`: a saved-tensor pack hook records a
storage the first time it is saved, `weakref.finalize` forgets it when the storage is freed). The
trainer recomputes one VPP chunk at a time (trainer/chunks.py), so this is about one chunk's graph
for the largest micro-batch. Not in it: the chunk-boundary hidden states kept by the no-grad
forward ([N, D] per chunk: rl/plan/model.py `Sizes.chunk_input_stash`), gradients
of activations in flight during backward, and op temporaries (the [chunk_len, vocab] logits of
the head are recomputed inside a checkpoint, so they are temporaries too). On CUDA the run also
records `torch.cuda.max_memory_allocated` deltas, which include all of those.

The prediction (`probe_activations`) runs the trainer's own layers on a `HybridLM` built on the
meta device (no storage: the 48B shape costs nothing) under the same meter, so every layer's saved
tensors come from the code that will run, not from a formula. Two methods give the same figure
(METHODS): "full" runs `ChunkedModel.forward_backward` for every distinct micro-batch, the
reference; "compose" (the default) meters one forward of each distinct layer kind (mixer, MLP,
input dtype) plus the embedding and the head, and composes every chunk from them
(`_composed_peaks` says why that is exact): three layer forwards for the 48B instead of 53 forwards
and 27 backwards, each of whose KDA layers loops over 128 checkpointed 64-token segments at 8k
tokens (seconds instead of minutes). Meta tensors carry no values, and a few ops need some: token positions (`repeat_interleave`),
expert batches of a routed MoE (`unique`, `where`), `.tolist()`. `IndexShadow` keeps a real CPU
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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from unittest import mock

from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

import models.mlp
import models.model
from models.config import ModelConfig
from models.model import HybridLM, PackedMixer
from models.state import SegmentBatch
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

    def __init__(self, shadow: "IndexShadow") -> None:
        super().__init__()
        self.shadow = shadow

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if (func in (torch.tensor, torch.as_tensor) and isinstance(out, torch.Tensor) and out.device.type == "meta"
                and not isinstance(args[0], torch.Tensor)):
            self.shadow.values[out] = func(*args, **{**kwargs, "device": "cpu"})
        return out


class IndexShadow(TorchDispatchMode):
    """Meta execution with real values where values are known (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.values = WeakTensorKeyDictionary()  # meta tensor -> its real CPU twin
        self.num_ops = 0
        """Aten ops dispatched so far (the probe's work, for comparing its methods)."""

    def _value(self, x: torch.Tensor) -> torch.Tensor | None:
        if x.device.type != "meta":
            return x
        return self.values.get(x)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        self.num_ops += 1
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


METHODS = ("compose", "full")
"""How the probe meters a step: "full" runs `ChunkedModel.forward_backward` for every distinct
micro-batch (every layer's graph-free forward, recompute and backward: the reference), "compose"
meters one forward of each distinct layer kind and composes the chunks from them (`_composed_peaks`,
equal to "full" to the byte: tests/rl/test_plan_speed.py)."""


@dataclass(frozen=True)
class ActivationProbe:
    """What the probe measured, and what it cost."""

    chunk_peaks: list[int]
    """Per VPP chunk, its saved-tensor peak (max over the micro-batches)."""
    layer_runs: int
    """Decoder-layer forwards the probe ran on the meta device (with or without a graph)."""
    num_ops: int
    """Aten ops dispatched on the meta device."""
    method: str


def activation_peak_bytes(model_config: ModelConfig, micro_batches: Sequence[Sequence[int]], num_chunks: int,
                          dtype: torch.dtype = torch.float32, logprob_chunk_len: int = 1024,
                          grouped_mm: bool = False, split: str = "layers", method: str = "compose") -> int:
    """The saved-tensor peak (`SavedTensorMeter`) of one training step over `micro_batches` (each a
    list of sequence lengths, run one after the other as the trainer does), for a model of
    `model_config` with parameters in `dtype` (models/precision.py's rule: a few stay FP32), split
    into `num_chunks` VPP chunks by `split` (trainer/chunks.py). Runs on the meta device: allocates
    nothing of the model's size."""
    return max(chunk_activation_peaks(model_config, micro_batches, num_chunks, dtype, logprob_chunk_len, grouped_mm,
                                      split, method))


def chunk_activation_peaks(model_config: ModelConfig, micro_batches: Sequence[Sequence[int]], num_chunks: int,
                           dtype: torch.dtype = torch.float32, logprob_chunk_len: int = 1024,
                           grouped_mm: bool = False, split: str = "layers", method: str = "compose") -> list[int]:
    """Per VPP chunk, the saved-tensor peak while it is recomputed and backpropagated (max over the
    micro-batches); the step's peak is their max (nothing is saved in the no-grad forward before).
    grouped_mm: the planned device runs routed experts through torch._grouped_mm (module docstring).
    method: one of METHODS (the same figure; "compose" is the fast one)."""
    return probe_activations(model_config, micro_batches, num_chunks, dtype, logprob_chunk_len, grouped_mm, split,
                             method).chunk_peaks


def probe_activations(model_config: ModelConfig, micro_batches: Sequence[Sequence[int]], num_chunks: int,
                      dtype: torch.dtype = torch.float32, logprob_chunk_len: int = 1024,
                      grouped_mm: bool = False, split: str = "layers", method: str = "compose",
                      context_parallel: bool = False) -> ActivationProbe:
    """`chunk_activation_peaks` with the probe's cost: how many layer forwards and aten ops it ran.
    context_parallel: KDA layers run their kernel as a context-parallel rank does (`_transition_columns_kda`);
    `micro_batches` are then a rank's local lengths (rl/plan/context_memory.py)."""
    if method not in METHODS:
        raise ValueError(f"method={method!r}, expected one of {METHODS}")
    chunked, layer_runs, hooks = probe_model(model_config, num_chunks, dtype, split)
    shadow = IndexShadow()
    batches = list(dict.fromkeys(tuple(lens) for lens in micro_batches))  # the mixer follows the lengths, in order
    try:
        with meta_probe(shadow, grouped_mm, context_parallel):
            if method == "full":
                peaks = _full_peaks(chunked, batches, logprob_chunk_len)
            else:
                peaks = _composed_peaks(chunked, batches, logprob_chunk_len)
    finally:
        for hook in hooks:
            hook.remove()
    return ActivationProbe(peaks, layer_runs[0], shadow.num_ops, method)


def probe_model(model_config: ModelConfig, num_chunks: int, dtype: torch.dtype, split: str):
    """The probed model on the meta device, chunked, with a counter of its layer forwards (one mlp
    call per layer run) and the hooks that count (for the caller to remove)."""
    with torch.device("meta"):
        model = HybridLM(model_config)
    cast_parameters(model, dtype)
    chunked = ChunkedModel(model, num_chunks, split)
    layer_runs = [0]

    def count(module, args) -> None:
        layer_runs[0] += 1

    return chunked, layer_runs, [layer.mlp.register_forward_pre_hook(count) for layer in model.model.layers]


def _transition_columns_kda(q, k, v, g, beta, *, chunk_len: int = 64, impl: str = "naive", **kwargs):
    """`chunk_kda` as a context-parallel rank runs it on its fragments (models/context_parallel.py
    `ContextParallelMixer.kda`): the values widened by K zero columns from a start state [0 | I], so
    the final state carries the fragment's transition M beside S_local ([B, T, H, V + K] values and
    outputs, every value-sized tensor the kernel keeps (V + K) / V as large), and the output is the
    zero-start part plus the extra columns times the fragment's start state. Same signature and
    results' shapes as `chunk_kda`."""
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    v_ext = torch.cat([v, v.new_zeros(b, t, h, dk)], dim=-1)  # [B, T, H, V + K]
    init = torch.zeros(b, h, dk, dv + dk, dtype=torch.float32, device=q.device)  # [B, H, K, V + K]: [0 | I]
    o, final, at = _REAL_CHUNK_KDA(q, k, v_ext, g, beta, initial_state=init, chunk_len=chunk_len, impl=impl, **kwargs)
    start = torch.zeros(b, h, dk, dv, dtype=torch.float32, device=q.device)  # [B, H, K, V]: S0 from the gather
    return o[..., :dv] + torch.einsum("bthk,bhkv->bthv", o[..., dv:], start), final[..., :dv], at


_REAL_CHUNK_KDA = models.model.chunk_kda


@contextmanager
def meta_probe(shadow: IndexShadow, grouped_mm: bool, context_parallel: bool = False) -> Iterator[None]:
    """Meta execution with index values (`IndexShadow`), the MoE form of the planned device and,
    under context parallelism, KDA's kernel with the transition columns (`_transition_columns_kda`)."""

    def usable(x: torch.Tensor, w: torch.Tensor) -> bool:
        align = 16 // x.element_size()  # grouped_mm_usable's stride rule (dims of 16-byte multiples)
        return grouped_mm and x.dtype == w.dtype and not (w.shape[1] % align or w.shape[2] % align)

    kda = _transition_columns_kda if context_parallel else _REAL_CHUNK_KDA
    with (_FromData(shadow), shadow, warnings.catch_warnings(),
          mock.patch.object(models.mlp, "grouped_mm_usable", usable),
          mock.patch.object(models.model, "chunk_kda", kda),
          mock.patch.object(torch, "_grouped_mm", _grouped_mm_on_meta, create=True)):
        warnings.filterwarnings("ignore", message="MoE experts: torch._grouped_mm not used")
        yield


def _meter(model: HybridLM) -> SavedTensorMeter:
    return SavedTensorMeter(exclude=[*model.parameters(), *model.buffers()])


def _full_peaks(chunked: ChunkedModel, batches: list[tuple[int, ...]], logprob_chunk_len: int) -> list[int]:
    """The reference: the trainer's `forward_backward` of each micro-batch under one meter."""
    model = chunked.model
    meter = _meter(model)
    peaks = [0] * len(chunked.specs)

    def chunk_done(chunk: int) -> None:
        peaks[chunk] = max(peaks[chunk], meter.peak)
        meter.peak = meter.live  # the next chunk's window starts here

    for lens in batches:
        num_tokens = sum(lens)
        with meter.hooks():
            tokens = torch.zeros(num_tokens, dtype=torch.long, device="meta")  # [N]
            targets = torch.zeros(num_tokens, dtype=torch.long, device="meta")  # [N]
            meter.peak = meter.live
            chunked.forward_backward(tokens, list(lens), targets, lambda logp: -logp.sum(),
                                     on_chunk_done=chunk_done, logprob_chunk_len=logprob_chunk_len)
        for p in model.parameters():
            p.grad = None
    return peaks


@dataclass(frozen=True)
class _Piece:
    """One metered forward (the embedding, a decoder layer, or the head with the loss) from a fresh
    input, bytes above the meter's level at its start."""

    peak: int
    """The most bytes alive at once during the forward."""
    kept: int
    """Bytes alive at its end: what its graph holds for backward (its input's storage among them)."""
    input_saved: int
    """Bytes of its input's own storage among `kept` (0 when no op saved the input itself, e.g. a
    bf16 input that the first norm saves as an FP32 copy)."""
    other_saved: int
    """Bytes of another storage the caller names among `kept`: the staged mixer's indices for a
    layer, the targets for the head (0 when unsaved)."""
    out_dtype: torch.dtype


def _meter_piece(meter: SavedTensorMeter, x: torch.Tensor, other: torch.Tensor | None,
                 run: Callable[[torch.Tensor], torch.Tensor]) -> _Piece:
    """Meter `run(x)` on a fresh input x; whether an op saved x's storage, or `other`'s (a tensor the
    run reads; its storage only matters), is watched in the pack hook."""
    meter_hooks = meter.hooks()
    watched = {"input": x.untyped_storage(), "other": other.untyped_storage() if other is not None else None}
    hit: set[str] = set()

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        hit.update(name for name, s in watched.items() if storage is s)
        return meter_hooks.pack_hook(t)

    start = meter.live
    meter.peak = start
    with torch.autograd.graph.saved_tensors_hooks(pack, meter_hooks.unpack_hook):
        out = run(x)
    return _Piece(meter.peak - start, meter.live - start,
                  watched["input"].nbytes() if "input" in hit else 0,
                  watched["other"].nbytes() if "other" in hit else 0, out.dtype)


@dataclass(frozen=True)
class _StepPieces:
    """One micro-batch's metered pieces: what `compose_chunk_peaks` builds every chunk from."""

    embedding: _Piece
    layers: list[_Piece]
    """Per decoder layer, the piece of its kind (one metered forward per distinct kind)."""
    head: _Piece
    mixer_bytes: int
    """The staged mixer's index storage, when a layer saves it (counted once per step)."""

    def extrapolate(self, other: "_StepPieces", steps: float) -> "_StepPieces":
        """Every byte figure moved `steps` times the difference `other - self` on (an affine model of
        pieces measured at two lengths; `affine_activations`)."""

        def line(a: int, b: int) -> int:
            return round(a + steps * (b - a))

        def piece(a: _Piece, b: _Piece) -> _Piece:
            return _Piece(line(a.peak, b.peak), line(a.kept, b.kept), line(a.input_saved, b.input_saved),
                          line(a.other_saved, b.other_saved), a.out_dtype)

        return _StepPieces(piece(self.embedding, other.embedding),
                           [piece(a, b) for a, b in zip(self.layers, other.layers)],
                           piece(self.head, other.head), line(self.mixer_bytes, other.mixer_bytes))


def measure_pieces(model: HybridLM, lens: Sequence[int], logprob_chunk_len: int) -> _StepPieces:
    """Meter the embedding, one forward of each distinct layer kind (mixer, MLP, input dtype) and the
    head with the loss, for one micro-batch of sequences of `lens` tokens."""
    device = torch.device("meta")
    hidden_size, num_tokens = model.config.hidden_size, sum(lens)
    # what `_staged_forward` builds for this micro-batch; its index tensors are views of one storage
    mixer = PackedMixer(SegmentBatch(new_lens=list(lens), starts=[0] * len(lens)), keep_attention=True).stage(device)
    indices = mixer.positions(device)
    meter = SavedTensorMeter(exclude=[*model.parameters(), *model.buffers(), indices])  # indices: in the base
    targets = torch.zeros(num_tokens, dtype=torch.long, device=device)  # [N]

    def hidden(dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(num_tokens, hidden_size, dtype=dtype, device=device, requires_grad=True)  # [N, D]

    tokens = torch.zeros(num_tokens, dtype=torch.long, device=device)  # [N]
    embedding = _meter_piece(meter, tokens, None, model.model.embed_tokens)
    kinds: dict[tuple, _Piece] = {}
    layers, dtype = [], embedding.out_dtype
    for i in range(len(model.model.layers)):
        key = (model.config.layer_types[i], model.config.mlp_layer_types[i], dtype)
        if key not in kinds:
            kinds[key] = _meter_piece(meter, hidden(dtype), indices, lambda x, i=i: model.run_layer(i, x, mixer))
        layers.append(kinds[key])
        dtype = kinds[key].out_dtype
    head = _meter_piece(meter, hidden(dtype), targets,
                        lambda x: -model.packed_logprobs(model.model.norm(x), targets, logprob_chunk_len).sum())
    return _StepPieces(embedding, layers, head, max((p.other_saved for p in kinds.values()), default=0))


def compose_chunk_peaks(specs, pieces: _StepPieces) -> list[int]:
    """Every chunk's peak for one micro-batch, from its pieces (`_composed_peaks` says why)."""
    embedding, layers, head = pieces.embedding, pieces.layers, pieces.head
    last = len(specs) - 1
    steps = [(p.peak, p.kept) for p in layers]

    def own(spec) -> int:  # the chunk's forward, piece after piece
        level = peak = 0
        for piece_peak, piece_kept in (([(embedding.peak, embedding.kept)] if spec.has_embedding else [])
                                       + [steps[i] for i in spec.layers]):
            peak = max(peak, level + piece_peak)
            level += piece_kept
        return max(peak, level + head.peak) if spec.has_head else peak

    def input_saved(spec) -> int:
        return layers[spec.layers[0]].input_saved if spec.layers else head.input_saved

    peaks = []
    for c, spec in enumerate(specs):
        base = pieces.mixer_bytes if any(s.layers for s in specs[c:]) else 0
        if c < last:
            base += head.other_saved + input_saved(specs[last])
            if c + 1 < last:
                base += input_saved(specs[c + 1])
            elif specs[last].layers:
                base += head.input_saved
        peaks.append(base + own(spec))
    return peaks


def _composed_peaks(chunked: ChunkedModel, batches: list[tuple[int, ...]], logprob_chunk_len: int) -> list[int]:
    """The chunk peaks of `_full_peaks`, composed from one forward of each distinct layer kind.

    Why this is the same number. A chunk's saved tensors only accumulate during its recompute and
    are only released by its backward (backward saves nothing the meter sees: the checkpointed
    segments and logprob pieces recompute under their own hooks), so its peak is reached in the
    forward: the running sum of the pieces' kept bytes, each piece's own peak on top. A layer's
    bytes depend on its kind (mixer, MLP, input dtype) and the micro-batch's lengths only, never on
    its index; it never saves its own output (a residual add). Shared by the layers of a step: the
    staged mixer's index tensors (one storage, counted once), alive from the first layer that saves
    them to the end of the step. Alive when chunk c's window opens (trainer/chunks.py
    `forward_backward_batches`' locals): the targets and the head chunk's input (the loss's graph
    keeps the latter), and the previous chunk's `out`, until the name is rebound after chunk c's
    forward: the head chunk's output below the head chunk, else (its graph keeps it) the input of
    the chunk above. Each of those counts when an op saved it."""
    peaks = [0] * len(chunked.specs)
    for lens in batches:
        one = compose_chunk_peaks(chunked.specs, measure_pieces(chunked.model, lens, logprob_chunk_len))
        peaks = [max(a, b) for a, b in zip(peaks, one)]
    return peaks
