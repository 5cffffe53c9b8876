"""FP32 gradient slots for VPP chunks: a fixed number of flat buffers, reused.

The trainer backpropagates one VPP chunk at a time; a chunk holds a slot from just before its
backward until its gradients have been reduced over data parallel ranks and moved to the host
optimizer, then releases it. With two slots, chunk n+1's reduction can overlap chunk n's backward
(double buffering), and the device never holds more than two chunks' FP32 gradients, whatever
the number of chunks.

Between training steps the slots hold nothing, and `lend(borrower)` hands all of them out as raw
buffers (the reference model streams its weights through them, trainer/ref_stream.py):
only while no chunk holds a slot, and `acquire` during the loan raises `ArenaBusy`. Nothing is
allocated for the loan; what the borrower writes stays in the slots, which is harmless because
`acquire` zeroes a slot before a chunk's gradients accumulate into it. The borrower must drop
every view of the slots before the with-block ends.

Invariant (`check_integrity`): every slot is free or held by exactly one chunk, a chunk holds at
most one slot, `high_water_slots` <= num_slots, and no chunk holds a slot while the arena is lent.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class ArenaFull(RuntimeError):
    """acquire() with every slot held."""


class ArenaBusy(RuntimeError):
    """lend() while a chunk holds a slot or the arena is already lent; acquire() during a loan."""


class GradArena:
    def __init__(self, slot_numel: int, num_slots: int = 2, device: str | torch.device = "cpu") -> None:
        if slot_numel < 1 or num_slots < 1:
            raise ValueError(f"grad arena: slot_numel={slot_numel}, num_slots={num_slots}, expected both >= 1")
        self.slot_numel, self.num_slots = slot_numel, num_slots
        self._slots = [torch.zeros(slot_numel, dtype=torch.float32, device=device) for _ in range(num_slots)]
        self._holder: list[int | None] = [None] * num_slots  # chunk holding each slot
        self.high_water_slots = 0
        self.lent_to: str | None = None
        """Who borrows every slot right now (`lend`), or None."""
        self.num_loans = 0

    @property
    def num_held(self) -> int:
        return sum(h is not None for h in self._holder)

    @property
    def device(self) -> torch.device:
        return self._slots[0].device

    @property
    def slot_bytes(self) -> int:
        return self.slot_numel * 4

    @property
    def total_bytes(self) -> int:
        """Device bytes the arena owns (constant: slots are allocated once)."""
        return self.slot_bytes * self.num_slots

    def acquire(self, chunk: int) -> torch.Tensor:
        """A zeroed fp32 [slot_numel] buffer for `chunk`'s gradients, valid until release(chunk)."""
        if self.lent_to is not None:
            raise ArenaBusy(f"grad arena: lent to {self.lent_to!r}; chunk {chunk} cannot acquire a slot until the "
                            f"loan ends")
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

    @contextmanager
    def lend(self, borrower: str) -> Iterator[list[torch.Tensor]]:
        """Every slot, as the arena's own fp32 [slot_numel] buffers (contents undefined), for the
        with-block. Raises ArenaBusy if a chunk holds a slot or the arena is already lent; during
        the loan acquire() raises ArenaBusy. The buffers (and views of them, e.g. `.view(dtype)`
        for other weight types) are the borrower's until the block ends, and must not be used
        after it: the next acquire() zeroes a slot and hands it to a chunk's gradients."""
        if not borrower:
            raise ValueError("grad arena: lend() needs the borrower's name")
        if self.lent_to is not None:
            raise ArenaBusy(f"grad arena: already lent to {self.lent_to!r}; {borrower!r} must wait")
        if self.num_held:
            raise ArenaBusy(f"grad arena: chunks {[h for h in self._holder if h is not None]} hold slots; "
                            f"{borrower!r} can borrow the slots only between training steps")
        self.lent_to = borrower
        self.num_loans += 1
        try:
            yield list(self._slots)
        finally:
            self.lent_to = None

    def check_integrity(self) -> None:
        if self.lent_to is not None and self.num_held:
            raise RuntimeError(f"grad arena integrity: lent to {self.lent_to!r} while chunks hold slots {self._holder}")
        held = [h for h in self._holder if h is not None]
        if len(held) != len(set(held)):
            raise RuntimeError(f"grad arena integrity: a chunk holds two slots: {self._holder}")
        if not self.num_held <= self.high_water_slots <= self.num_slots:
            raise RuntimeError(f"grad arena integrity: held {self.num_held}, high water {self.high_water_slots}, "
                               f"slots {self.num_slots}")
        if any(s.numel() != self.slot_numel or s.dtype != torch.float32 for s in self._slots):
            raise RuntimeError("grad arena integrity: a slot was resized or retyped")
