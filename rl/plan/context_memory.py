"""Context parallelism in the memory plan: what a rank holds when C ranks share every sequence.

The runtime (models/context_parallel.py) cuts each trained sequence of n tokens into 2C fragments
of F = max(ceil(n / 2C), conv_kernel - 1) tokens (`ZigZagSplit`); rank r holds fragments r and
2C-1-r, 2F tokens of every sequence. World = DP x C: the C ranks of a context-parallel group train
the same sequences, so a data-parallel replica (DP = world / C of them) takes ceil(groups / DP)
groups, and every rank holds 2F tokens of each of their sequences. What that changes per rank:

- every token-linear activation (norms, MLPs, projections, logprob chunks, KDA's chunk
  intermediates) is that of its 2F local tokens: the activation probe runs on the local lengths
  (rl/plan/activation.py), KDA's kernel with V + K value columns (the transition M rides in K extra
  columns: its value-sized saved tensors are (V + K) / V as large; `_transition_columns_kda`);
- plus the buffers of the cross-rank exchanges, per layer (`ContextBuffers`), kept for backward
  (the meter of a run sees them: they are in the activation peak):
  KDA: the all-gathered [S_local | M] of every fragment, FP32 C x 2 x H x K x (K + V) per sequence,
  and the conv halo gather, C x 2 x (kernel - 1) x 3HK values in the model's dtype;
  MLA: the gathered latents of the whole (padded) sequence, L x (d_c + d_r) in the model's dtype;
- and a transient, not saved: the up-projected keys and values of one key block (L / 2C tokens,
  FP32 [block, H, (Dn + Dr) + Dv]), made one block at a time in the forward and again in the
  backward, which also holds their gradients (2 x one block's K/V).

The trainer recomputes one VPP chunk at a time (trainer/chunks.py), so the buffers alive at once
are those of one chunk's layers, for one micro-batch: its saved buffers are added to that chunk's
activation peak and its transient on top (an upper bound: the peak inside a layer's forward meets
the layers' buffers of the whole chunk and a block's K/V in flight).

C = 1 changes nothing: every function here is then the planner's plan without context parallelism.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from models.config import ModelConfig
from models.context_parallel import ZigZagSplit
from rl.config import RunConfig
from rl.plan.activation import probe_activations
from rl.plan.affine_probe import affine_activations
from rl.plan.cluster import PlanOptions
from trainer.chunks import ChunkedModel


@dataclass(frozen=True, kw_only=True)
class ContextBuffers:
    """One rank's context-parallel exchange buffers for one micro-batch, bytes per layer."""

    context: int
    """C: ranks sharing every sequence."""
    kda_states: int
    """Per KDA layer: every fragment's gathered [S_local | M], FP32 [C, S, 2, H, K, V + K] (saved)."""
    kda_halos: int
    """Per KDA layer: every fragment's conv halo, [C, S, 2, kernel - 1, 3HK] in the model's dtype (saved)."""
    mla_latents: int
    """Per MLA layer: the micro-batch's gathered latents, [sum of padded lengths, d_c + d_r] in the
    model's dtype (saved)."""
    mla_block_kv: int
    """One key block's up-projected keys and values, FP32 [F, H, (Dn + Dr) + Dv] (F = L / 2C of the
    longest sequence): in flight one block at a time; the backward holds them and their gradients."""

    def saved(self, layer_types: Sequence[str]) -> int:
        """Bytes kept for backward by layers of `layer_types` ("kda" | "mla"), e.g. one chunk's."""
        return sum(self.kda_states + self.kda_halos if t == "kda" else self.mla_latents for t in layer_types)

    def transient(self, layer_types: Sequence[str]) -> int:
        """The most bytes in flight beside the saved ones: one block's K/V and their gradients
        (2 x mla_block_kv) when an MLA layer is among `layer_types`, else 0."""
        return 2 * self.mla_block_kv if "mla" in layer_types else 0


def check_context(context: int, world: int, expert: int, cluster_name: str) -> int:
    """`context` checked against the planned world: ValueError naming the value unless C >= 1 and
    C divides the cluster's GPUs, and unless parallel.expert divides DP x C (DP = world / C: the
    expert-parallel groups span the data- and context-parallel ranks). Returns DP."""
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"context={context!r}: expected an int >= 1 (1 = no context parallelism)")
    if world % context:
        raise ValueError(f"context={context} does not divide the {world} GPUs of cluster {cluster_name}; expected a "
                         f"divisor of them (world = data-parallel x context-parallel ranks)")
    dp = world // context
    if expert < 1 or (dp * context) % expert:
        raise ValueError(f"parallel.expert={expert} does not divide DP x context = {dp} x {context} = {dp * context} "
                         f"ranks (cluster {cluster_name}, context={context}); the expert-parallel groups span the "
                         f"data- and context-parallel ranks, so expected a divisor of {dp * context}")
    return dp


def split_of(config: ModelConfig, seq_lens: Sequence[int], context: int) -> ZigZagSplit:
    """The runtime's zig-zag split of trained sequences of `seq_lens` tokens over C ranks (every
    fragment at least the conv halo, conv_kernel - 1 tokens)."""
    return ZigZagSplit(seq_lens, context, config.linear_conv_kernel_dim - 1)


def local_lens(config: ModelConfig, seq_lens: Sequence[int], context: int) -> list[int]:
    """Tokens of each sequence on one rank: 2F (the unsplit lengths at C = 1)."""
    return list(seq_lens) if context == 1 else split_of(config, seq_lens, context).local_lens


def context_buffers(config: ModelConfig, seq_lens: Sequence[int], context: int, dtype_bytes: int) -> ContextBuffers:
    """`ContextBuffers` of one micro-batch of trained sequences of `seq_lens` tokens (unsplit) on one
    rank of a context-parallel group of C; all zeros at C = 1 (nothing is exchanged)."""
    if context == 1:
        return ContextBuffers(context=1, kda_states=0, kda_halos=0, mla_latents=0, mla_block_kv=0)
    split = split_of(config, seq_lens, context)
    num_seqs, c = len(seq_lens), context
    h, k = config.linear_num_heads, config.linear_head_dim
    v = k  # KDA's value heads are as wide as its key heads (models/kda.py)
    key_dim, value_dim = config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    return ContextBuffers(
        context=c,
        kda_states=c * num_seqs * 2 * h * k * (k + v) * 4,
        kda_halos=c * num_seqs * 2 * (config.linear_conv_kernel_dim - 1) * 3 * h * k * dtype_bytes,
        mla_latents=sum(split.padded_lens) * config.mla_latent_dim * dtype_bytes,
        mla_block_kv=max(split.fragment_lens, default=0) * config.num_attention_heads * (key_dim + value_dim) * 4)


def chunk_layer_types(cfg: RunConfig, chunked: ChunkedModel) -> list[list[str]]:
    """Per VPP chunk, its decoder layers' mixer types ("kda" | "mla")."""
    return [[cfg.model.layer_types[i] for i in spec.layers] for spec in chunked.specs]


def activation_chunks(cfg: RunConfig, chunked: ChunkedModel, dtype: torch.dtype, grouped_mm: bool,
                      options: PlanOptions, batches: list[list[int]], context: int) -> tuple[list[int], list[int], ContextBuffers, int]:
    """(per chunk: saved-tensor peak, context-parallel transient; the largest micro-batch's
    `ContextBuffers`; layer forwards the probe ran) over this rank's micro-batches of unsplit
    `batches`. Each micro-batch is probed at the rank's local lengths (a one-sequence micro-batch by
    `affine_activations` when options.activation_probe="affine"), and under context parallelism its
    exchange buffers are added per chunk (`context_buffers`)."""
    t, grouped = cfg.trainer, grouped_mm
    types = chunk_layer_types(cfg, chunked)
    cp = context > 1
    peaks, transients, runs = [0] * len(types), [0] * len(types), 0
    if context == 1 and options.activation_probe == "compose":  # the plan without context parallelism, as ever
        probe = probe_activations(cfg.model, batches, t.num_chunks, dtype, grouped_mm=grouped, split=t.chunk_split)
        return probe.chunk_peaks, transients, context_buffers(cfg.model, [], 1, 0), probe.layer_runs
    largest = max(batches, key=sum)
    dtype_bytes = torch.empty(0, dtype=dtype).element_size()
    for lens in dict.fromkeys(tuple(b) for b in batches):
        local = local_lens(cfg.model, lens, context)
        if options.activation_probe == "affine" and len(local) == 1:
            probe = affine_activations(cfg.model, local[0], t.num_chunks, dtype, grouped_mm=grouped,
                                       split=t.chunk_split, context_parallel=cp)
        else:
            probe = probe_activations(cfg.model, [local], t.num_chunks, dtype, grouped_mm=grouped,
                                      split=t.chunk_split, context_parallel=cp)
        buffers = context_buffers(cfg.model, lens, context, dtype_bytes)
        runs += probe.layer_runs
        peaks = [max(a, p + buffers.saved(ts)) for a, p, ts in zip(peaks, probe.chunk_peaks, types)]
        transients = [max(a, buffers.transient(ts)) for a, ts in zip(transients, types)]
    return peaks, transients, context_buffers(cfg.model, largest, context, dtype_bytes), runs
