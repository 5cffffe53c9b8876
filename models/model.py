"""The hybrid KDA/MLA decoder-only LM (Kimi Linear architecture).

Every layer: pre-RMSNorm -> mixer (KDA or MLA) -> residual; pre-RMSNorm -> MLP (dense or MoE) ->
residual. Module names match the public checkpoints (`model.layers.N.self_attn...`), so
models/checkpoint.py maps names with two documented rules only.

Entry points:
- `forward(input_ids, lengths)`: logits of a right-padded batch (full sequences, no state).
- `token_logprobs(input_ids, targets, lengths)`: log p(target_t | prefix) computed in chunks of
  tokens, never materialising [T, vocab] float32 for the whole sequence (training and the
  reference model use this).
- `forward_with_state(token_ids, states, state_positions)`: continue sequences from explicit
  states and return new states, plus KDA checkpoints at requested positions (prefix caching).
All run on the plain torch references of kernels/ (CPU default).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from kernels.kda.chunk import chunk_kda
from models.config import ModelConfig
from models.kda import KDALayer
from models.context_parallel import ContextParallel, ContextParallelMixer
from models.mla import MLALayer, causal_attention
from models.expert_parallel import ExpertParallel
from models.mlp import Experts, MoE, Router, SwiGLU
from models.norms import GatedRMSNorm, RMSNorm
from models.state import KDACheckpoint, SegmentBatch, SequenceState


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, expert_parallel: ExpertParallel | None = None) -> None:
        super().__init__()
        self.mixer_type = config.layer_types[index]
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = KDALayer(config) if self.mixer_type == "kda" else MLALayer(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = (SwiGLU(config.hidden_size, config.intermediate_size)
                    if config.mlp_layer_types[index] == "dense" else MoE(config, expert_parallel))


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig, expert_parallel: ExpertParallel | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, expert_parallel) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


@dataclass
class StatefulOutput:
    logits: list[torch.Tensor]
    """Per sequence, [new_len, vocab] (or [1, vocab] with last_logits_only)."""
    states: list[SequenceState]
    """Per sequence, the state after all its tokens."""
    checkpoints: list[list[KDACheckpoint]]
    """Per sequence, the KDA states at the requested positions, in order."""


class HybridLM(nn.Module):
    """`expert_parallel`: this rank's share of the routed experts (models/expert_parallel.py);
    None = every expert here. `context_parallel`: the group this rank shares every whole-sequence
    forward with (models/context_parallel.py; its batches hold this rank's zig-zag share of each
    sequence); None = whole sequences here. Neither changes the weights, only where tokens and
    experts live."""

    def __init__(self, config: ModelConfig, expert_parallel: ExpertParallel | None = None,
                 context_parallel: ContextParallel | None = None) -> None:
        super().__init__()
        self.config = config
        self.expert_parallel = expert_parallel if expert_parallel is not None and expert_parallel.active else None
        self.context_parallel = context_parallel if context_parallel is not None and context_parallel.active else None
        self.model = Backbone(config, self.expert_parallel)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def output_weight(self) -> torch.Tensor:
        """[vocab, D] matrix of the output projection (the embedding when tied)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02) -> "HybridLM":
        """Random init as fla/transformers do for Kimi Linear (deterministic given `seed`)."""
        # Drawn on the host from a CPU generator whatever the parameters' device, then copied over:
        # the same seed gives the same weights on every device.
        gen = torch.Generator().manual_seed(seed)
        host = gen.device

        def normal_(t: torch.Tensor) -> None:
            t.copy_(torch.randn(t.shape, generator=gen, device=host) * std)

        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d, Router)):
                normal_(module.weight)
            elif isinstance(module, (RMSNorm, GatedRMSNorm)):
                module.weight.fill_(1.0)
            if isinstance(module, Router):
                module.e_score_correction_bias.zero_()
            if isinstance(module, Experts):  # all of the layer's experts drawn, this rank's kept
                mine = slice(module.first, module.first + module.w1.shape[0])
                for weight in (module.w1, module.w2, module.w3):
                    shape = (module.num_global, *weight.shape[1:])
                    weight.copy_((torch.randn(shape, generator=gen, device=host) * std)[mine])
            if isinstance(module, KDALayer):
                # A in [1, 16] (log-stored); dt in [1e-3, 1e-1] stored as its inverse softplus.
                module.A_log.copy_(torch.empty(module.A_log.shape, device=host).uniform_(1, 16, generator=gen).log())
                dt = torch.exp(torch.empty(module.dt_bias.shape, device=host).uniform_(
                    math.log(1e-3), math.log(1e-1), generator=gen))
                module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        return self

    # ---- the layer stack ---------------------------------------------------------------------------
    def whole_sequence_mixer(self, seq_lens: Sequence[int], keep_attention: bool = False
                             ) -> "PackedMixer | ContextParallelMixer":
        """The mixer of a forward over whole sequences from position 0 (training, old logprobs, the
        reference): `PackedMixer`, or under context parallelism `ContextParallelMixer` over this
        rank's local rows (`seq_lens`: each sequence's 2F local tokens). keep_attention: see
        PackedMixer (ignored under context parallelism)."""
        batch = SegmentBatch(new_lens=list(seq_lens), starts=[0] * len(seq_lens))
        if self.context_parallel is not None:
            return ContextParallelMixer(batch, self.context_parallel)
        return PackedMixer(batch, keep_attention=keep_attention)

    def run_layers(self, token_ids: torch.Tensor, mixer: "Mixer") -> torch.Tensor:
        """token_ids: [N] packed tokens -> final-normed hidden states [N, D].

        The mixer owns where the caches live (explicit states here, pool pages in the rollout
        engine); everything else (embeddings, norms, residuals, MLPs) is this one code path.
        """
        hidden = self.model.embed_tokens(token_ids)  # [N, D]
        for index in range(len(self.model.layers)):
            hidden = self.run_layer(index, hidden, mixer)
        return self.model.norm(hidden)

    def run_layer(self, index: int, hidden: torch.Tensor, mixer: "Mixer") -> torch.Tensor:
        """One decoder layer on packed hidden states [N, D] (pipeline/VPP chunks call this)."""
        layer = self.model.layers[index]
        mix = mixer.kda if layer.mixer_type == "kda" else mixer.mla
        hidden = hidden + mix(index, layer.self_attn, layer.input_layernorm(hidden))
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def join_experts(self, layers: Sequence[int] | None = None) -> torch.Tensor:
        """Join the expert exchanges of the MoE layers among `layers` (default all) with zero
        tokens, in layer order: what a rank without tokens runs while its expert-parallel peers run
        those layers. Chained (each layer's output feeds the next), so a backward of the result
        (`.sum().backward()`) joins their backward exchanges in reverse order too. -> [0, D]."""
        moes = [mlp for i in (range(len(self.model.layers)) if layers is None else layers)
                if isinstance(mlp := self.model.layers[i].mlp, MoE)]
        # the layers' own device and dtype (a streamed reference binds only the chunk that runs)
        weight = moes[0].experts.w1 if moes else self.model.embed_tokens.weight
        hidden = torch.zeros(0, self.config.hidden_size, dtype=weight.dtype, device=weight.device,
                             requires_grad=torch.is_grad_enabled())
        for mlp in moes:
            hidden = hidden + mlp(hidden)
        return hidden

    def _run(self, token_ids: torch.Tensor, batch: SegmentBatch, states: Sequence[SequenceState | None],
             state_positions: Sequence[Sequence[int]]
             ) -> tuple[torch.Tensor, list[SequenceState], list[list[KDACheckpoint]]]:
        """token_ids: [N] packed new tokens -> (final hidden [N, D], new states, KDA checkpoints)."""
        mixer = StateMixer(batch, states, state_positions)
        return self.run_layers(token_ids, mixer), mixer.new_states, mixer.checkpoints

    def forward_with_state(self, token_ids: Sequence[torch.Tensor], states: Sequence[SequenceState | None] | None = None,
                           state_positions: Sequence[Sequence[int]] | None = None,
                           last_logits_only: bool = False) -> StatefulOutput:
        """Continue each sequence i by `token_ids[i]` ([new_len] int64, new_len >= 1) from `states[i]`.

        states[i] = None starts a fresh sequence. `state_positions[i]` lists absolute positions p
        (start <= p <= start + new_len, increasing) at which to return the KDA states of every KDA
        layer (S and conv tails): the checkpoints prefix caching persists. Input states are never
        mutated; the returned states are new objects.
        """
        num_seqs = len(token_ids)
        states = list(states) if states is not None else [None] * num_seqs
        state_positions = [list(p) for p in state_positions] if state_positions is not None else [[]] * num_seqs
        if len(states) != num_seqs or len(state_positions) != num_seqs:
            raise ValueError(f"got {num_seqs} token sequences but {len(states)} states and "
                             f"{len(state_positions)} position lists")
        for i, t in enumerate(token_ids):
            if t.dim() != 1 or t.numel() == 0:
                raise ValueError(f"token_ids[{i}] has shape {tuple(t.shape)}, expected a non-empty 1-D tensor")
        batch = SegmentBatch(new_lens=[t.numel() for t in token_ids],
                             starts=[0 if s is None else s.num_tokens for s in states])
        hidden, new_states, checkpoints = self._run(torch.cat(list(token_ids)), batch, states, state_positions)
        logits = []
        for i in range(num_seqs):
            rows = hidden[batch.rows(i)]
            logits.append(self._logits(rows[-1:] if last_logits_only else rows))
        return StatefulOutput(logits, new_states, checkpoints)

    # ---- full-sequence entry points -----------------------------------------------------------------
    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.output_weight)

    def _packed_hidden(self, input_ids: torch.Tensor, lengths: Sequence[int] | torch.Tensor | None
                       ) -> tuple[torch.Tensor, list[int]]:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}, expected [batch, seq_len]")
        bsz, seq_len = input_ids.shape
        lens = [seq_len] * bsz if lengths is None else [int(n) for n in lengths]
        if len(lens) != bsz or any(not 1 <= n <= seq_len for n in lens):
            raise ValueError(f"lengths {lens} must hold {bsz} values in [1, {seq_len}]")
        packed = torch.cat([input_ids[b, :n] for b, n in enumerate(lens)])
        # whole sequences, no states wanted: the training path's mixer (flash attention, chunked KDA), whose
        # memory is linear in length; StateMixer (forward_with_state) is its reference twin
        mixer = PackedMixer(SegmentBatch(new_lens=lens, starts=[0] * bsz)).stage(packed.device)
        return self.run_layers(packed, mixer), lens

    def _unpack(self, packed: torch.Tensor, lens: list[int], seq_len: int) -> torch.Tensor:
        out = packed.new_zeros(len(lens), seq_len, *packed.shape[1:])
        offset = 0
        for b, n in enumerate(lens):
            out[b, :n] = packed[offset:offset + n]
            offset += n
        return out

    def forward(self, input_ids: torch.Tensor, lengths: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
        """input_ids: [B, T] right-padded; lengths: valid tokens per row (default all T).

        Returns logits [B, T, vocab] in the model dtype; padded positions hold zeros.
        """
        hidden, lens = self._packed_hidden(input_ids, lengths)
        return self._unpack(self._logits(hidden), lens, input_ids.shape[1])

    def token_logprobs(self, input_ids: torch.Tensor, targets: torch.Tensor,
                       lengths: Sequence[int] | torch.Tensor | None = None, chunk_len: int = 1024) -> torch.Tensor:
        """log p(targets[b, t] | input_ids[b, :t+1]) as float32 [B, T] (zeros at padded positions).

        Logits are formed `chunk_len` tokens at a time; under autograd each chunk is recomputed in
        backward (activation checkpointing), so at most [chunk_len, vocab] float32 is ever alive.
        """
        if targets.shape != input_ids.shape:
            raise ValueError(f"targets shape {tuple(targets.shape)} != input_ids shape {tuple(input_ids.shape)}")
        if chunk_len <= 0:
            raise ValueError(f"chunk_len={chunk_len}, expected a positive integer")
        hidden, lens = self._packed_hidden(input_ids, lengths)
        packed_targets = torch.cat([targets[b, :n] for b, n in enumerate(lens)])
        return self._unpack(self.packed_logprobs(hidden, packed_targets, chunk_len), lens, input_ids.shape[1])

    def packed_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, chunk_len: int = 1024) -> torch.Tensor:
        """Final-normed hidden [N, D] and targets [N] -> float32 [N] log-probabilities, formed
        `chunk_len` tokens at a time (recomputed in backward under autograd)."""
        weight = self.output_weight
        pieces = []
        for start in range(0, hidden.shape[0], chunk_len):
            h, t = hidden[start:start + chunk_len], targets[start:start + chunk_len]
            if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
                pieces.append(checkpoint(_chunk_logprobs, h, weight, t, use_reentrant=False))
            else:
                pieces.append(_chunk_logprobs(h, weight, t))
        return torch.cat(pieces)


class Mixer(Protocol):
    """Runs the token-mixing half of a layer against some cache storage."""

    def kda(self, index: int, layer: KDALayer, x: torch.Tensor) -> torch.Tensor: ...
    def mla(self, index: int, layer: MLALayer, x: torch.Tensor) -> torch.Tensor: ...


class StateMixer:
    """Mixer over explicit per-sequence states (`SequenceState`); collects the new states."""

    def __init__(self, batch: SegmentBatch, states: Sequence[SequenceState | None],
                 state_positions: Sequence[Sequence[int]]) -> None:
        self.batch, self.states, self.state_positions = batch, states, state_positions
        self.new_states = [SequenceState(s + n) for s, n in zip(batch.starts, batch.new_lens)]
        self.checkpoints = [[KDACheckpoint(p, {}) for p in positions] for positions in state_positions]

    def kda(self, index: int, layer: KDALayer, x: torch.Tensor) -> torch.Tensor:
        prev = [None if s is None else s.kda[index] for s in self.states]
        out, finals, at = layer(x, self.batch, prev, self.state_positions)
        for i, new in enumerate(self.new_states):
            new.kda[index] = finals[i]
            for ckpt, layer_state in zip(self.checkpoints[i], at[i]):
                ckpt.layers[index] = layer_state
        return out

    def mla(self, index: int, layer: MLALayer, x: torch.Tensor) -> torch.Tensor:
        prev = [None if s is None else s.mla[index] for s in self.states]
        out, caches = layer(x, self.batch, prev)
        for new, cache in zip(self.new_states, caches):
            new.mla[index] = cache
        return out


@dataclass
class _Bucket:
    """Sequences padded together: packed rows `src_rows` go to rows `dst_rows` of a [num * width]
    layout. Its index tensors are built on the device of the tensors they index, once per device."""

    num: int
    width: int
    src_rows: list[int]
    dst_rows: list[int]
    seq_lens: list[int]
    _index: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, init=False, repr=False)

    def index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(src [n], dst [n], lens [num]) int64 on `device` (staged by `PackedMixer.stage`, which
        moves every bucket's indices in one copy; made here if it was not called)."""
        if device not in self._index:
            self._index[device] = tuple(torch.tensor(v, dtype=torch.long, device=device)
                                        for v in self.host_lists())
        return self._index[device]

    def host_lists(self) -> tuple[list[int], list[int], list[int]]:
        return self.src_rows, self.dst_rows, self.seq_lens

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """Packed [N, *rest] -> [num, width, *rest] (zeros past each length)."""
        src, dst, _ = self.index(x.device)
        out = x.new_zeros(self.num * self.width, *x.shape[1:]).index_copy(0, dst, x.index_select(0, src))
        return out.view(self.num, self.width, *x.shape[1:])

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """[num, width, *rest] -> the bucket's packed rows [n, *rest] (in src order)."""
        _, dst, _ = self.index(x.device)
        return x.reshape(self.num * self.width, *x.shape[2:]).index_select(0, dst)


class PackedMixer:
    """Mixer for whole sequences from position 0 with no states wanted (training, scoring): the
    sequences are right-padded into a few [B, Lmax] buckets so KDA and MLA run as batched ops
    instead of a loop over sequences. Same math as `StateMixer` (its reference twin,
    tests/models/test_packed_mixer.py), differentiable; padded positions come after each sequence's
    real tokens, so causality keeps them from touching real outputs, and they are dropped.
    Buckets (longest first) keep padding under 2x a bucket's real tokens and its attention scores
    [B, L, L] under `max_score_elements` per head, so one long sequence never pads a crowd of short
    ones to its length. Built from lengths alone: its index tensors follow the hidden states'
    device (made on first use there)."""

    def __init__(self, batch: SegmentBatch, max_score_elements: int = 1 << 22, keep_attention: bool = False,
                 kda_impl: str | None = None) -> None:
        """kda_impl: the chunk_kda kernel ("naive" | "triton"); None picks Triton for CUDA tensors
        (its Triton backward is the autograd of training) and the torch twin elsewhere."""
        self.kda_impl = kda_impl
        if any(batch.starts):
            raise ValueError(f"PackedMixer needs sequences starting at position 0, got starts {batch.starts}")
        lens, offsets = batch.new_lens, batch.offsets
        groups: list[list[int]] = []
        total = 0
        for i in sorted(range(len(lens)), key=lambda i: -lens[i]):
            if groups:
                width, size = lens[groups[-1][0]], len(groups[-1]) + 1
                if size * width <= 2 * (total + lens[i]) and size * width * width <= max_score_elements:
                    groups[-1].append(i)
                    total += lens[i]
                    continue
            groups.append([i])
            total = lens[i]
        self.buckets = []
        for seqs in groups:
            width = lens[seqs[0]]
            src = [offsets[i] + t for i in seqs for t in range(lens[i])]
            dst = [j * width + t for j, i in enumerate(seqs) for t in range(lens[i])]
            self.buckets.append(_Bucket(len(seqs), width, src, dst, [lens[i] for i in seqs]))
        self.batch = batch
        self.num_tokens = batch.num_tokens
        # one bucket already in packed order: its rows need no regather
        self.in_order = len(self.buckets) == 1 and self.buckets[0].src_rows == list(range(self.num_tokens))
        self._positions: dict[torch.device, torch.Tensor] = {}
        self.kept: dict | None = {} if keep_attention else None
        """keep_attention: MLA outputs of a graph-free pass, per (layer, bucket), taken back by the
        recompute of the same layers with a graph (models.mla.causal_attention; the trainer's chunks)."""

    def stage(self, device: torch.device) -> "PackedMixer":
        """Move every bucket's index tensors and the positions to `device` in one copy (pinned and
        non-blocking on CUDA), before the layers run: a layer then reads them without a host copy.
        Idempotent per device; returns self."""
        if device in self._positions:
            return self
        pieces = [v for b in self.buckets for v in b.host_lists()] + [self.batch.position_list()]
        flat = torch.tensor([x for v in pieces for x in v], dtype=torch.long, device="cpu",
                            pin_memory=device.type == "cuda")  # [total] every index, back to back
        moved = flat.to(device, non_blocking=True)
        views, offset = [], 0
        for v in pieces:
            views.append(moved[offset:offset + len(v)])
            offset += len(v)
        for i, b in enumerate(self.buckets):
            b._index[device] = tuple(views[3 * i:3 * i + 3])
        self._positions[device] = views[-1]
        return self

    def positions(self, device: torch.device) -> torch.Tensor:
        """[N] int64 position of every packed token (RoPE), on `device`, built once per device."""
        if device not in self._positions:
            self._positions[device] = self.batch.positions(device)
        return self._positions[device]

    def _gather(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Per-bucket packed rows -> [N, *rest] in the batch's packed order (differentiable)."""
        if self.in_order:
            return parts[0]
        out = parts[0].new_zeros(self.num_tokens, *parts[0].shape[1:])
        for bucket, part in zip(self.buckets, parts):
            out = out.index_copy(0, bucket.index(part.device)[0], part)
        return out

    def kda(self, index: int, layer: KDALayer, x: torch.Tensor) -> torch.Tensor:
        mixed, g, beta, gate = layer.project(x)
        parts = []
        for b in self.buckets:
            tails = mixed.new_zeros(b.num, layer.kernel - 1, mixed.shape[-1])
            q, k, v, _ = layer.short_conv(b.pad(mixed), tails)
            impl = self.kda_impl or ("triton" if q.is_cuda else "naive")
            o, _, _ = chunk_kda(q, k, v, b.pad(g), b.pad(beta), chunk_len=min(64, b.width), impl=impl)
            parts.append(b.unpad(o))
        return layer.output(self._gather(parts), gate)

    def mla(self, index: int, layer: MLALayer, x: torch.Tensor) -> torch.Tensor:
        positions = self.positions(x.device)  # [N]; every sequence starts at 0
        q_nope, q_rope = layer.queries(x, positions)
        latent_rows = layer.latent(x, positions)  # [N, d_c + d_r]
        w_uk, w_uv = (w.float() for w in layer.up_projections())  # [H, Dn, d_c], [H, Dv, d_c]
        heads, parts = layer.num_heads, []
        for number, b in enumerate(self.buckets):
            latent = b.pad(latent_rows).float()  # [B, L, d_c + d_r]
            c_kv, k_rope = latent[..., :layer.kv_lora_rank], latent[..., layer.kv_lora_rank:]
            k_nope = torch.einsum("hnc,blc->bhln", w_uk, c_kv)  # [B, H, L, Dn]
            keys = torch.cat([k_nope, k_rope[:, None].expand(-1, heads, -1, -1)], dim=-1)  # [B, H, L, Dn + Dr]
            values = torch.einsum("hvc,blc->bhlv", w_uv, c_kv)  # [B, H, L, Dv]
            queries = torch.cat([b.pad(q_nope), b.pad(q_rope)], dim=-1).float().transpose(1, 2)  # [B, H, L, *]
            # Right padding needs no mask beyond causality: a real row never sees a later (padded) one.
            attn = causal_attention(queries, keys, values, layer.scale, self.kept, (index, number))  # [B, H, L, Dv]
            parts.append(b.unpad(attn.transpose(1, 2)))  # [n, H, Dv]
        return layer.output(x, self._gather(parts).to(x.dtype))


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """hidden [n, D], weight [V, D], targets [n] -> float32 [n] log-probabilities of the targets."""
    logits = F.linear(hidden, weight).float()  # [n, V]
    return logits.gather(1, targets[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
