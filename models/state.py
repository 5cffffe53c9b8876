"""Explicit per-sequence model state: what a sequence's cache holds after `num_tokens` tokens.

These are the plain, unpaged containers of the reference path. The rollout engine's paged pool
stores the same bytes in pages; prefix caching relies on one property proven by the tests:
running tokens [0, p) and then [p, T) from the returned state gives the same logits as one pass.

Words:
- KDA layer state: the recurrent matrix S of every head plus the short-conv tails (the last
  kernel-1 pre-convolution inputs of q, k and v). Both are needed to resume; they are saved and
  restored together.
- MLA cache: one latent entry [c_kv, k_rope] per token and layer.
- checkpoint: the KDA layer states of a sequence at one token position (e.g. a hash-block end).
States are never mutated by the model: a forward returns new objects, so a state shared with
others (a cached checkpoint) stays valid.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass
class KDALayerState:
    recurrent: torch.Tensor
    """[num_heads, head_dim (k), head_dim (v)] float32 recurrent matrix S."""
    conv_tail: torch.Tensor
    """[kernel - 1, 3 * num_heads * head_dim]: pre-conv q|k|v inputs of the last kernel-1 tokens
    (zeros for positions before the sequence start)."""

    def clone(self) -> "KDALayerState":
        return KDALayerState(self.recurrent.clone(), self.conv_tail.clone())


@dataclass
class SequenceState:
    """Everything needed to continue one sequence after its first `num_tokens` tokens."""

    num_tokens: int
    kda: dict[int, KDALayerState] = field(default_factory=dict)
    """layer index -> recurrent state, for every KDA layer."""
    mla: dict[int, torch.Tensor] = field(default_factory=dict)
    """layer index -> latent cache [num_tokens, kv_lora_rank + qk_rope_head_dim], every MLA layer."""

    def clone(self) -> "SequenceState":
        return SequenceState(self.num_tokens, {i: s.clone() for i, s in self.kda.items()},
                             {i: c.clone() for i, c in self.mla.items()})


@dataclass
class KDACheckpoint:
    """The KDA states of one sequence after its first `position` tokens (all KDA layers)."""

    position: int
    layers: dict[int, KDALayerState]


@dataclass
class SegmentBatch:
    """Several sequences' new tokens packed along one axis (varlen layout, as vLLM/fla use).

    Sequence i owns rows [offsets[i], offsets[i] + new_lens[i]) of the packed tensors; its first new
    token sits at absolute position starts[i] (the number of tokens already in its state).
    """

    new_lens: list[int]
    starts: list[int]

    @cached_property
    def offsets(self) -> list[int]:
        """First packed row of each sequence (computed once: a batch is not modified after it is built)."""
        out, acc = [], 0
        for n in self.new_lens:
            out.append(acc)
            acc += n
        return out

    @property
    def num_tokens(self) -> int:
        return sum(self.new_lens)

    def rows(self, i: int) -> slice:
        start = self.offsets[i]
        return slice(start, start + self.new_lens[i])

    def position_list(self) -> list[int]:
        """[num_tokens] absolute position of every packed token, as host ints."""
        return [s + t for s, n in zip(self.starts, self.new_lens) for t in range(n)]

    def positions(self, device: torch.device | None = None) -> torch.Tensor:
        """[num_tokens] absolute position of every packed token."""
        # token j of sequence i sits at starts[i] + (j - offsets[i]): a few ops whatever the batch,
        # one copy of 2 x num_seqs ints, and no host sync (the output size is known here)
        shift = [s - o for s, o in zip(self.starts, self.offsets)]
        lens, shift = torch.tensor([self.new_lens, shift], dtype=torch.long, device=device)  # [num_seqs] each
        return torch.arange(self.num_tokens, device=device) + torch.repeat_interleave(
            shift, lens, output_size=self.num_tokens)
