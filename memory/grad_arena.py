"""FP32 gradient slots for VPP chunks (SPEC §6/§7): a fixed number of flat buffers, reused.

The trainer backpropagates one VPP chunk at a time; a chunk holds a slot from just before its
backward until its gradients have been reduced over data parallel ranks and moved to the host
optimizer, then releases it. With two slots, chunk n+1's reduction can overlap chunk n's backward
(double buffering), and the device never holds more than two chunks' FP32 gradients, whatever
the number of chunks. The reference model (issue 7) will borrow the same slot storage as raw
bytes between training phases.

Invariant (`check_integrity`): every slot is free or held by exactly one chunk, a chunk holds at
most one slot, and `high_water_slots` <= num_slots.
"""
from __future__ import annotations

import torch


class ArenaFull(RuntimeError):
    """acquire() with every slot held."""


class GradArena:
    def __init__(self, slot_numel: int, num_slots: int = 2, device: str | torch.device = "cpu") -> None:
        if slot_numel < 1 or num_slots < 1:
            raise ValueError(f"grad arena: slot_numel={slot_numel}, num_slots={num_slots}, expected both >= 1")
        self.slot_numel, self.num_slots = slot_numel, num_slots
        self._slots = [torch.zeros(slot_numel, dtype=torch.float32, device=device) for _ in range(num_slots)]
        self._holder: list[int | None] = [None] * num_slots  # chunk holding each slot
        self.high_water_slots = 0

    @property
    def num_held(self) -> int:
        return sum(h is not None for h in self._holder)

    @property
    def slot_bytes(self) -> int:
        return self.slot_numel * 4

    @property
    def total_bytes(self) -> int:
        """Device bytes the arena owns (constant: slots are allocated once)."""
        return self.slot_bytes * self.num_slots

    def acquire(self, chunk: int) -> torch.Tensor:
        """A zeroed fp32 [slot_numel] buffer for `chunk`'s gradients, valid until release(chunk)."""
        if chunk in self._holder:
            raise ValueError(f"grad arena: chunk {chunk} already holds slot {self._holder.index(chunk)}")
        if None not in self._holder:
            raise ArenaFull(f"grad arena: all {self.num_slots} slots held (by chunks {self._holder}); "
                            f"release one before acquiring for chunk {chunk}")
        slot = self._holder.index(None)
        self._holder[slot] = chunk
        self.high_water_slots = max(self.high_water_slots, self.num_held)
        return self._slots[slot].zero_()

    def release(self, chunk: int) -> None:
        if chunk not in self._holder:
            raise ValueError(f"grad arena: chunk {chunk} holds no slot (holders: {self._holder})")
        self._holder[self._holder.index(chunk)] = None

    def check_integrity(self) -> None:
        held = [h for h in self._holder if h is not None]
        if len(held) != len(set(held)):
            raise RuntimeError(f"grad arena integrity: a chunk holds two slots: {self._holder}")
        if not self.num_held <= self.high_water_slots <= self.num_slots:
            raise RuntimeError(f"grad arena integrity: held {self.num_held}, high water {self.high_water_slots}, "
                               f"slots {self.num_slots}")
        if any(s.numel() != self.slot_numel or s.dtype != torch.float32 for s in self._slots):
            raise RuntimeError("grad arena integrity: a slot was resized or retyped")
