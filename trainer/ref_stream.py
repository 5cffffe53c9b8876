"""The reference model on the trainer's FP32 gradient slots, idle between updates.

The KL term needs log p_ref of every trained token: one forward of a frozen copy of the initial
policy per iteration. Kept resident it would cost a whole model of device memory for a forward
that runs once per step. Instead its weights live on the host, one flat vector per VPP chunk
(pinned on CUDA), and for the forward they are copied, chunk by chunk, into the trainer's gradient
arena (`memory.grad_arena.GradArena.lend`): the slots are idle between training steps and each
is sized for the largest chunk's parameters, so the reference needs no new device allocation.

    ref = StreamedReference(initial_model, trainer.arena, num_chunks)   # then drop initial_model
    logp = ref.logprobs(token_ids, seq_lens, targets)                   # [N] float32

Double buffering with two slots: chunk n computes from slot n % 2 while chunk n+1's host vector is
copied into the other slot (a background thread on CPU; a side stream from pinned memory on CUDA),
then they swap. With one slot the copies are not overlapped. Chunk n+1's copy starts only after
chunk n-1 (the slot's previous user) has finished (CPU: synchronous; CUDA: the side stream waits
for the compute stream).

Layout: chunk c's parameters in `ChunkedModel.chunk_parameters(c)` order, packed back to back in
bytes from the start of the slot, each aligned to its element size. A tied output head (embedding owned by
chunk 0) is appended to the last chunk as well, so the last chunk carries its own copy. A chunk
larger than a slot is a ValueError at construction. Parameters keep their own dtype: a slot is
seen as bytes and each parameter as a dtype view of its range, so a bf16 model (with its few
float32 parameters, models/precision.py) fits in about half a slot sized for its FP32 gradients.

The module: a `HybridLM` built on the meta device (no storage). Binding chunk c sets each of its
parameters to an `nn.Parameter` over a view of the slot; unbinding puts a meta parameter back, so
no view of the arena outlives the loan. Buffers (the MoE routers' `e_score_correction_bias`,
[num_experts] per MoE layer) are copied to the device once at construction and stay resident:
they are not parameters and the slots are sized for parameters only.

The forward runs exactly the ops of `ChunkedModel.forward_logprobs` (embedding, each chunk's
layers through one `PackedMixer`, final norm, `packed_logprobs`) on bit-equal weights, so on CPU
fp32 its logprobs equal a resident reference's bit for bit (tests/trainer/test_ref_stream.py).
No growth of device memory for weights is asserted on every chunk: every bound parameter's bytes
must lie inside the lent slots (data_ptr ranges) and on CUDA `torch.cuda.memory_allocated()` must
not change across copying and binding a chunk (activations are allocated elsewhere in the
forward, so they are outside that window). Figures of the last call: `stats`.

The forward runs with the layers' fused inference projections off (models/fused.py `unfused`):
on CPU those concatenate sibling weights into cached copies, which here would be a copy of the
chunk's weights outside the slots. So no derived weight is built (`stats.derived_weight_bytes`
is asserted 0), and `ChunkedModel.forward_logprobs` (the resident twin) runs unfused as well.

Host bytes: pass a `memory.host_ledger.HostLedger` to lease the host vectors' bytes as consumer
"reference" before they are allocated; `close()` frees them and returns the lease.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from memory.grad_arena import GradArena
from memory.host_ledger import HostLedger
from memory.pinned import pinned_empty
from models.fused import drop_fused, unfused
from models.model import HybridLM
from trainer.chunks import chunk_specs

LEDGER_CONSUMER = "reference"


@dataclass(frozen=True)
class _Entry:
    name: str
    """Parameter name in the model (`model.layers.3.mlp.w1`...)."""
    module: nn.Module
    """The skeleton module that owns it."""
    leaf: str
    shape: torch.Size
    dtype: torch.dtype
    offset: int
    """First byte in the slot (a multiple of the element size)."""

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass
class StreamStats:
    """Figures of the last `logprobs` call."""

    chunks_loaded: int = 0
    bytes_loaded: int = 0
    """Host -> slot bytes copied."""
    load_wait_s: float = 0.0
    """Seconds the forward waited for a chunk's weights (the part of the copies not hidden)."""
    weights_outside_arena_bytes: int = 0
    """Bytes of bound reference parameters outside the lent slots, max over chunks (asserted 0)."""
    device_alloc_delta_bytes: int = 0
    """CUDA: change of memory_allocated() across copying and binding a chunk, max over chunks
    (asserted 0). Not measurable on CPU: 0."""
    derived_weight_bytes: int = 0
    """Bytes of weight copies the layers cached during a chunk's forward, max over chunks (asserted 0:
    the forward runs unfused)."""


class StreamedReference:
    def __init__(self, model: HybridLM, arena: GradArena, num_chunks: int, ledger: HostLedger | None = None,
                 split: str = "layers") -> None:
        """Copy `model`'s weights into per-chunk host vectors (the model is not kept: drop it to free
        its memory). `arena`: the trainer's gradient slots the forward borrows; `num_chunks`: the
        trainer's VPP split (the slots are sized for it), with `split` its chunk_split. Raises ValueError if a chunk does not fit
        a slot."""
        self.arena, self.num_chunks, self.split, self.config = arena, num_chunks, split, model.config
        self.device = arena.device
        self.slot_capacity = arena.slot_bytes  # bytes per slot
        self.specs = chunk_specs(model, num_chunks, split)

        with torch.device("meta"):  # this rank's share of the experts, as `model` holds (expert parallelism)
            self.module = HybridLM(model.config, model.expert_parallel, model.context_parallel).eval()
        for name, buf in model.named_buffers():  # small, resident (see the module docstring)
            owner, leaf = self._owner(name)
            owner._buffers[leaf] = buf.detach().to(self.device, copy=True)
        self._dtypes = {n: p.dtype for n, p in model.named_parameters(remove_duplicate=False)}
        self.layout = [self._chunk_layout(c) for c in range(num_chunks)]
        for c, entries in enumerate(self.layout):
            if entries[-1].end > self.slot_capacity:
                raise ValueError(f"streamed reference: chunk {c} has {entries[-1].end} B of weights but a gradient slot "
                                 f"holds {self.slot_capacity} B; the arena must be sized for the largest chunk of "
                                 f"this split (num_chunks={num_chunks}, chunk_split={split!r})")
        self.ledger = ledger
        self.host_bytes = sum(e[-1].end for e in self.layout)
        if ledger is not None:
            ledger.lease(LEDGER_CONSUMER, self.host_bytes)  # before allocating: a refusal leaves nothing behind
        pinned = self.device.type == "cuda"
        source = dict(model.named_parameters(remove_duplicate=False))
        self.host: list[torch.Tensor] | None = []  # None after close()
        with torch.no_grad():
            for entries in self.layout:
                flat = pinned_empty(entries[-1].end, torch.uint8, pin=pinned)  # locked at its exact size
                for e in entries:
                    flat[e.offset:e.end].view(e.dtype).copy_(source[e.name].reshape(-1))
                self.host.append(flat)  # [chunk bytes] uint8
        self.stats = StreamStats()

    def _owner(self, name: str) -> tuple[nn.Module, str]:
        path, _, leaf = name.rpartition(".")
        return self.module.get_submodule(path), leaf

    def _chunk_layout(self, chunk: int) -> list[_Entry]:
        spec = self.specs[chunk]
        prefixes = (["model.embed_tokens."] if spec.has_embedding else []) + [f"model.layers.{i}." for i in spec.layers]
        if spec.has_head:
            prefixes.append("model.norm.")
            prefixes.append("lm_head." if self.module.lm_head is not None else "model.embed_tokens.")
        names: dict[str, None] = {}  # chunk_parameters order; a tied head's embedding is listed once per chunk
        for prefix in prefixes:
            names.update((prefix + n, None) for n, _ in self.module.get_submodule(prefix[:-1]).named_parameters())
        entries, offset = [], 0
        for name in names:
            owner, leaf = self._owner(name)
            dtype = self._dtypes[name]
            offset = -(-offset // dtype.itemsize) * dtype.itemsize  # a dtype view needs an aligned start
            entry = _Entry(name, owner, leaf, owner._parameters[leaf].shape, dtype, offset)
            entries.append(entry)
            offset = entry.end
        return entries

    # ---- one chunk's weights -----------------------------------------------------------------------
    def _load(self, chunk: int, slot: torch.Tensor) -> None:
        """Copy chunk `chunk`'s host vector into the front of `slot` (a byte view of a lent slot).
        Runs on the loader (background thread / side stream)."""
        host = self.host[chunk]
        slot[:host.numel()].copy_(host, non_blocking=host.is_pinned())

    def _bind(self, chunk: int, slot: torch.Tensor, slot_ranges: list[tuple[int, int]]) -> None:
        outside = 0
        for e in self.layout[chunk]:
            param = nn.Parameter(slot[e.offset:e.end].view(e.dtype).view(e.shape), requires_grad=False)
            start = param.data_ptr()
            end = start + e.nbytes
            if not any(lo <= start and end <= hi for lo, hi in slot_ranges):
                outside += end - start
            e.module._parameters[e.leaf] = param
        self.stats.weights_outside_arena_bytes = max(self.stats.weights_outside_arena_bytes, outside)
        if outside:
            raise RuntimeError(f"streamed reference: chunk {chunk} binds {outside} B of weights outside the lent "
                               f"gradient slots")

    def _unbind(self, chunk: int) -> None:
        for e in self.layout[chunk]:
            e.module._parameters[e.leaf] = nn.Parameter(torch.empty(e.shape, dtype=e.dtype, device="meta"),
                                                        requires_grad=False)

    def _drop_derived(self) -> int:
        """Drop any fused-weight cache the layers built from the bound weights (none: the forward runs
        unfused; kept as the check that says so); returns their bytes."""
        return drop_fused(self.module)

    def bound_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """(name, parameter) of every parameter that currently has storage (tests: none outside a forward)."""
        return [(n, p) for n, p in self.module.named_parameters(remove_duplicate=False) if not p.is_meta]

    # ---- the forward -------------------------------------------------------------------------------
    @torch.no_grad()
    def logprobs(self, token_ids: torch.Tensor, seq_lens: Sequence[int], targets: torch.Tensor,
                 logprob_chunk_len: int = 1024) -> torch.Tensor:
        """Per-token log p_ref(targets | prefix) [N] float32 for packed sequences (token_ids,
        targets [N]; sequence i owns `seq_lens[i]` consecutive rows). Borrows every arena slot for
        the call (ArenaBusy if a chunk holds one); leaves garbage in them and no view of them."""
        if self.host is None:
            raise RuntimeError("streamed reference: used after close()")
        self.stats = StreamStats()
        idle = not len(seq_lens)  # an expert-parallel rank without rows still joins every exchange
        if idle and self.module.expert_parallel is None:
            return torch.zeros(0, dtype=torch.float32, device=token_ids.device)
        if idle:
            hidden = torch.zeros(0, dtype=torch.float32, device=token_ids.device)
        mixer = self.module.whole_sequence_mixer(seq_lens).stage(token_ids.device)
        num_slots = self.arena.num_slots
        with self.arena.lend(LEDGER_CONSUMER) as raw, unfused():
            slots = [s.view(torch.uint8) for s in raw]  # [slot_capacity] bytes each
            ranges = [(s.data_ptr(), s.data_ptr() + s.numel() * s.element_size()) for s in slots]
            loader = _StreamLoader(self, slots) if self.device.type == "cuda" else _ThreadLoader(self, slots)
            pending: dict[int, object] = {}
            try:
                hidden = hidden if idle else token_ids
                for c, spec in enumerate(self.specs):
                    slot = c % num_slots
                    before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
                    if c not in pending:
                        pending[c] = loader.start(c, slot)
                    t0 = time.perf_counter()
                    loader.wait(pending.pop(c))
                    self.stats.load_wait_s += time.perf_counter() - t0
                    if num_slots > 1 and c + 1 < self.num_chunks:
                        pending[c + 1] = loader.start(c + 1, (c + 1) % num_slots)  # overlaps chunk c's compute
                    self._bind(c, slots[slot], ranges)
                    if self.device.type == "cuda":
                        delta = torch.cuda.memory_allocated(self.device) - before
                        self.stats.device_alloc_delta_bytes = max(self.stats.device_alloc_delta_bytes, abs(delta))
                        if delta:
                            raise RuntimeError(f"streamed reference: device allocation changed by {delta} B while "
                                               f"materialising chunk {c}'s weights")
                    self.stats.chunks_loaded += 1
                    self.stats.bytes_loaded += self.host[c].numel()
                    # The ops of ChunkedModel.forward_logprobs, chunk by chunk.
                    if idle:  # no rows here: the chunk's expert exchanges with zero tokens
                        self.module.join_experts(spec.layers)
                    elif spec.has_embedding:
                        hidden = self.module.model.embed_tokens(token_ids)  # [N, D]
                    for index in [] if idle else spec.layers:
                        hidden = self.module.run_layer(index, hidden, mixer)
                    if spec.has_head and not idle:
                        hidden = self.module.packed_logprobs(self.module.model.norm(hidden), targets,
                                                             logprob_chunk_len)
                    self.stats.derived_weight_bytes = max(self.stats.derived_weight_bytes, self._drop_derived())
                    self._unbind(c)
            finally:
                loader.close()  # no copy may still be writing into the slots when the loan ends
                self._drop_derived()
                for c in range(self.num_chunks):
                    self._unbind(c)
        return hidden

    def close(self) -> None:
        """Free the host vectors and return their lease."""
        if self.host is not None:
            self.host = None
            if self.ledger is not None:
                self.ledger.release(LEDGER_CONSUMER, self.host_bytes)


class _ThreadLoader:
    """CPU: copies run on one background thread (torch releases the GIL inside copy_)."""

    def __init__(self, ref: StreamedReference, slots: list[torch.Tensor]) -> None:
        self.ref, self.slots = ref, slots
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ref-stream")

    def start(self, chunk: int, slot: int) -> Future:
        return self.pool.submit(self.ref._load, chunk, self.slots[slot])

    def wait(self, handle: Future) -> None:
        handle.result()  # re-raises the loader's exception here

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class _StreamLoader:
    """CUDA: copies from pinned host vectors on a side stream; events order them against compute.
    (Written for the GPU; the CPU test machines exercise only _ThreadLoader.)"""

    def __init__(self, ref: StreamedReference, slots: list[torch.Tensor]) -> None:
        self.ref, self.slots = ref, slots
        self.compute = torch.cuda.current_stream(ref.device)
        self.stream = torch.cuda.Stream(ref.device)

    def start(self, chunk: int, slot: int) -> torch.cuda.Event:
        self.stream.wait_stream(self.compute)  # the slot's previous chunk has finished computing
        with torch.cuda.stream(self.stream):
            self.ref._load(chunk, self.slots[slot])
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def wait(self, handle: torch.cuda.Event) -> None:
        self.compute.wait_event(handle)

    def close(self) -> None:
        self.stream.synchronize()
