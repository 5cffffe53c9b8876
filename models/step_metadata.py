"""A step's integer metadata, gathered on the host and moved to the device in one copy (the paged
forward's, models/paged.py, and whatever its caller adds: token ids, rows to sample, the sampler's draws).
"""
from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Iterable

import torch


class StepMetadata:
    """One step's integer metadata, gathered on the host and moved to the device in one copy.

    `add(values, *shape)` appends Python ints and returns a key; `move(device)` turns everything
    into one int64 host tensor (pinned when `device` is CUDA) and copies it with one non-blocking
    `.to`; `self[key]` is then a view of the device copy, shaped as added. Per step that is one
    host-to-device transfer instead of one per tensor (a pageable copy of a small tensor blocks
    the host on CUDA). Keys added after `move` are an error: add everything first.
    """

    def __init__(self) -> None:
        self._values: list[int] = []
        self._fields: list[tuple[int, tuple[int, ...]]] = []  # (offset, shape) of each key
        self._fills: list[tuple[int, Callable[[torch.Tensor], None]]] = []  # (key, writer) run by move()
        self._device_buffer: torch.Tensor | None = None

    def add(self, values: Iterable[int], *shape: int) -> int:
        if self._device_buffer is not None:
            raise RuntimeError("StepMetadata.add after move(): add every field before moving the buffer")
        offset = len(self._values)
        self._values.extend(values)
        num = len(self._values) - offset
        shape = shape or (num,)
        if math.prod(shape) != num:
            raise ValueError(f"{num} values do not fill shape {shape}")
        self._fields.append((offset, shape))
        return len(self._fields) - 1

    def add_floats(self, rows: list[list[float]], fill: Callable[[torch.Tensor], None] | None = None) -> int:
        """Python floats [rows][cols] as a field (their float64 bit patterns, exact), read back with
        `floats(key)`. `fill(view)` runs in `move` on the field's float64 host view [rows, cols],
        right before the copy: it may write values only known then (the sampler's draws)."""
        bits = array("q")
        bits.frombytes(array("d", (x for row in rows for x in row)).tobytes())  # the same 8 bytes, as int64
        key = self.add(bits, len(rows), len(rows[0]) if rows else 0)
        if fill is not None:
            self._fills.append((key, fill))
        return key

    def floats(self, key: int) -> torch.Tensor:
        """A float64 view of a field added with `add_floats` (on the device, after `move`)."""
        return self[key].view(torch.float64)

    def move(self, device: torch.device) -> None:
        if self._device_buffer is not None:
            raise RuntimeError("StepMetadata moved twice: one buffer, one copy per step")
        host = torch.tensor(self._values, dtype=torch.long, device="cpu",
                            pin_memory=device.type == "cuda")  # [total] every field, flat
        for key, fill in self._fills:  # written in place on the host, before the one copy
            offset, shape = self._fields[key]
            fill(host[offset:offset + math.prod(shape)].view(torch.float64).view(shape))
        self._device_buffer = host.to(device, non_blocking=True)

    def __getitem__(self, key: int) -> torch.Tensor:
        if self._device_buffer is None:
            raise RuntimeError("StepMetadata read before move()")
        offset, shape = self._fields[key]
        return self._device_buffer[offset:offset + math.prod(shape)].view(shape)
