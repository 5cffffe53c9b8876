"""`SeqKV`: where one sequence's MLA entries are once token eviction (rollout/kv/kv_eviction.py) has
touched them. Its own module so that `rollout.request.Sequence` can hold one without importing
the evictor."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def long_tensor(values=()) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.long)


@dataclass
class SeqKV:
    """Where a sequence's MLA entries are: slot i on the device holds token `positions[i]`."""

    positions: torch.Tensor
    """[n] long: token position of each resident slot, in slot order."""
    scores: torch.Tensor
    """[n] float64: attention each resident token has received (summed over heads and layers)."""
    off_positions: torch.Tensor = field(default_factory=long_tensor)
    """[m] long: offloaded tokens (InfiniGen)."""
    off_scores: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))
    off_rows: torch.Tensor = field(default_factory=long_tensor)
    """[m] host token store rows."""
    off_partial: list[torch.Tensor] = field(default_factory=list)
    """Per MLA layer, [m, r] partial keys of the offloaded tokens (device)."""
    num_dropped: int = 0
    pruned: bool = False
    """Sticky: the resident slots are no longer the full prefix."""

    @classmethod
    def fresh(cls, num_tokens: int) -> "SeqKV":
        return cls(torch.arange(num_tokens), torch.zeros(num_tokens, dtype=torch.float64))

    @property
    def length(self) -> int:
        return self.positions.numel()

    @property
    def num_offloaded(self) -> int:
        return self.off_positions.numel()
