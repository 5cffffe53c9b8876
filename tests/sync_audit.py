"""`SyncAudit`: which repository lines would make the host wait for the accelerator, and which move
host data onto it, counted by file:line and by whether a decoder layer was running.

On CUDA the host queues kernels and runs ahead; any op whose *result the host must know* (a value,
or a shape that depends on values) stops it until the queue drains, and a blocking copy of host
data onto the device does too. A step that does either per layer serialises host and device. A
CPU machine cannot see any of it (everything is synchronous there), so the audit counts the ops
by rule, and the rules are written so the same count comes out on a CPU run as on a GPU one.

The audit is told `device`, the accelerator (the model's device; on a CPU run, the CPU stands in).
It counts two kinds of event:

- **sync**, a read of a tensor on `device` by the host: `Tensor.item`, `.tolist`, `bool(t)`/`if t:`,
  `int(t)`, `float(t)`, `t.__index__` (a tensor used as a Python index), formatting a tensor,
  `torch.equal`/`allclose`/`Tensor.is_nonzero`, and copies to the host (`.cpu()`, `.to("cpu")`, and,
  when `device` is not the CPU, any `.to`/`copy_` of a device tensor onto the CPU; a CPU run counts
  `.to("cpu")` only when blocking: with non_blocking it reads as rule (c) below); and the ops whose
  output shape depends on values: `nonzero`, `argwhere`, one-argument `torch.where`, `unique`,
  `unique_consecutive`, `masked_select`, `bincount`, indexing (`t[m]`, `t[m] = x`) with a bool
  tensor, and `repeat_interleave` with a tensor of repeats and no `output_size`.
  (`.numpy()` is not counted: it only works on a host tensor, so the copy before it was.)
- **transfer**, host data reaching `device`: (a) `torch.tensor` / `as_tensor` / `Tensor.new_tensor`
  of Python or numpy data (not a tensor) whose result is on `device`, and indexing a tensor on
  `device` with a Python list (torch builds the index on the host and copies it over); (b) `.to`,
  `.cuda`, `copy_` or `as_tensor(t, device=)` that moves a tensor from another device onto
  `device`; (c) `.to(device, non_blocking=True)` of a tensor already on `device` (a CPU run: the
  call declares a host-to-device copy) unless (a) already counted that tensor's storage.
  So "build on the host, then one `.to(device, non_blocking=True)`" counts 1 on either machine:
  (b) on a GPU, (a) on the CPU; `torch.tensor(list, device=device)` counts 1 on both.

What a CPU run cannot tell apart, and how it errs: every tensor is "on `device`", so reads of
tensors that would live on the host in a GPU run (host bookkeeping) are counted too (over-counted,
the safe side); a blocking `.to(device)` of a tensor the host computed from tensors (not Python
data), e.g. uniform draws from a CPU generator, is invisible there (it is a no-op on the CPU).

Each event is charged to the innermost repository frame (file:line; calls inside torch are their
caller's) and tagged `in_layer` when `HybridLM.run_layer` (models/model.py) is on the stack, i.e.
while one decoder layer runs. Ops torch makes inside a function it handles are not seen (the mode
is off while it runs them), so e.g. `torch.unique` counts once, not for its internals.
"""
from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

ROOT = Path(__file__).resolve().parents[1]
LAYER_FRAME = ("models/model.py", "run_layer")
"""(file, function) on the stack while one decoder layer runs."""

_READS = frozenset({torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
                    torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.__format__, torch.Tensor.__repr__,
                    torch.Tensor.is_nonzero, torch.equal, torch.allclose, torch.Tensor.allclose,
                    torch.Tensor.equal, torch.Tensor.__contains__})
"""Ops that hand the host a value computed from a tensor."""
_SHAPE_OF_VALUES = frozenset({torch.nonzero, torch.Tensor.nonzero, torch.argwhere, torch.Tensor.argwhere,
                              torch.unique, torch.Tensor.unique, torch.unique_consecutive,
                              torch.Tensor.unique_consecutive, torch.masked_select, torch.Tensor.masked_select,
                              torch.bincount, torch.Tensor.bincount})
"""Ops whose output shape depends on tensor values (the host needs it to allocate the output)."""
_INDEXING = frozenset({torch.Tensor.__getitem__, torch.Tensor.__setitem__})
_CREATE_FROM_DATA = frozenset({torch.tensor, torch.as_tensor, torch.Tensor.new_tensor})
_MOVES = frozenset({torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu, torch.Tensor.copy_})


def _is_bool_tensor(x: object) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype == torch.bool


def _index_parts(index: object) -> tuple:
    return index if isinstance(index, tuple) else (index,)


def _resolved(device: torch.device | str | int) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _target_device(args: tuple, kwargs: dict) -> torch.device | None:
    """The device a `Tensor.to(...)` call names (positional device/str/tensor or device=), or None."""
    if "device" in kwargs and kwargs["device"] is not None:
        return _resolved(kwargs["device"])
    for arg in args[1:]:
        if isinstance(arg, (torch.device, str, int)) and not isinstance(arg, bool):
            return _resolved(arg)
        if isinstance(arg, torch.Tensor):
            return arg.device
    return None


@dataclass
class SyncCounts:
    """Events of one audited region: (kind, in_layer, site) -> count; kind is "sync" or "transfer"."""

    events: Counter = field(default_factory=Counter)

    def total(self, kind: str | None = None, *, in_layer: bool | None = None, exclude: tuple[str, ...] = ()) -> int:
        """Events of `kind` (None = both), inside layers / outside (None = both), not from files
        whose path starts with one of `exclude`."""
        return sum(n for (k, inside, site), n in self.events.items()
                   if (kind is None or k == kind) and (in_layer is None or inside == in_layer)
                   and not site.startswith(exclude))

    def sites(self, *, prefix: tuple[str, ...] = ("",)) -> dict[str, int]:
        """"kind[layer] site" -> count, for sites under `prefix`, sorted (for messages and prints)."""
        return {f"{k}{'[layer]' if inside else ''} {site}": n
                for (k, inside, site), n in sorted(self.events.items()) if site.startswith(prefix)}

    def __add__(self, other: "SyncCounts") -> "SyncCounts":
        return SyncCounts(self.events + other.events)

    def summary(self) -> str:
        return (f"{self.total('sync')} syncs + {self.total('transfer')} transfers "
                f"({self.total(in_layer=True)} inside layers)")


class SyncAudit(TorchFunctionMode):
    """Counts, by repository file:line, the events described in the module docstring, for tensors on
    `device`. `with SyncAudit(device) as audit: ...`, then `audit.counts` (a `SyncCounts`); `reset()`
    starts a new count (e.g. per engine step) without leaving the mode."""

    def __init__(self, device: torch.device | str) -> None:
        super().__init__()
        self.device = _resolved(device)
        self.counts = SyncCounts()
        self._from_data: dict[int, torch.Tensor] = {}  # storage ptr -> tensor counted by rule (a), kept alive

    def reset(self) -> SyncCounts:
        """Returns the counts so far and starts new ones."""
        counts, self.counts = self.counts, SyncCounts()
        self._from_data.clear()
        return counts

    def _where(self) -> tuple[str, bool] | None:
        """(file:line of the innermost repository caller, whether a layer is running); None when
        no repository code is on the stack (torch calling itself)."""
        frame = sys._getframe(3)
        site, in_layer = None, False
        while frame is not None:
            path = Path(frame.f_code.co_filename)
            if path.is_relative_to(ROOT) and ".venv" not in path.parts:
                rel = path.relative_to(ROOT).as_posix()
                if site is None and not rel.startswith("tests/sync_audit.py"):
                    site = f"{rel}:{frame.f_lineno}"
                if (rel, frame.f_code.co_name) == LAYER_FRAME:
                    in_layer = True
                    break
            frame = frame.f_back
        return None if site is None else (site, in_layer)

    def _record(self, kind: str) -> None:
        where = self._where()
        if where is not None:
            self.counts.events[(kind, where[1], where[0])] += 1

    def _on_device(self, x: object) -> bool:
        return isinstance(x, torch.Tensor) and _resolved(x.device) == self.device

    def _kind(self, func, args: tuple, kwargs: dict) -> str | None:
        """"sync", "transfer" or None for a call before it runs (rule (a) is checked after)."""
        first = args[0] if args else None
        if func in _READS:
            return "sync" if any(self._on_device(a) for a in args) else None
        if func in _SHAPE_OF_VALUES:
            return "sync" if self._on_device(first) else None
        if func is torch.where and len(args) + len(kwargs) == 1:
            return "sync" if self._on_device(first) else None
        if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats", first if len(args) == 1 else None)
            if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None:
                return "sync" if self._on_device(repeats) else None  # the output's length is sum(repeats)
            return None
        if func in _INDEXING and self._on_device(first):
            parts = _index_parts(args[1])
            if any(_is_bool_tensor(p) for p in parts):
                return "sync"
            if any(isinstance(p, list) for p in parts):
                return "transfer"
            return None
        if func is torch.Tensor.cpu:
            return "sync" if self._on_device(first) else None
        if func in _MOVES and isinstance(first, torch.Tensor):
            if func is torch.Tensor.copy_:  # dst.copy_(src)
                moved, dst = args[1] if len(args) > 1 else kwargs.get("src"), first.device
            else:
                moved = first
                dst = _resolved("cuda") if func is torch.Tensor.cuda else _target_device(args, kwargs)
            if not isinstance(moved, torch.Tensor) or dst is None:
                return None
            src, dst = _resolved(moved.device), _resolved(dst)
            non_blocking = bool(kwargs.get("non_blocking")) or (
                func is torch.Tensor.to and any(a is True for a in args[2:]))  # .to(device, dtype, True)
            named_cpu = func is torch.Tensor.to and not non_blocking and any(
                a == "cpu" for a in (*args[1:2], kwargs.get("device")) if isinstance(a, str))
            if src == self.device and (named_cpu or (dst.type == "cpu" and self.device.type != "cpu")):
                return "sync"  # device -> host: the host waits for the value
            if dst == self.device and src != self.device:
                return "transfer"  # rule (b)
            if (dst == self.device and non_blocking
                    and moved.untyped_storage().data_ptr() not in self._from_data):
                return "transfer"  # rule (c)
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = self._kind(func, args, kwargs)
        if kind is not None:
            self._record(kind)
        out = func(*args, **kwargs)
        if func in _CREATE_FROM_DATA and self._on_device(out):
            data = args[1] if func is torch.Tensor.new_tensor else (args[0] if args else kwargs.get("data"))
            if not isinstance(data, torch.Tensor):  # rule (a)
                self._record("transfer")
                self._from_data[out.untyped_storage().data_ptr()] = out
            elif not self._on_device(data):  # as_tensor(host tensor, device=device): rule (b)
                self._record("transfer")
        return out


def audit_step(engine, device: torch.device | str | None = None) -> tuple[SyncCounts, list]:
    """Runs `engine.step()` once under a `SyncAudit` of `device` (default: the engine pool's).
    Returns (the step's counts, the step's finished outputs)."""
    with SyncAudit(device if device is not None else engine.pool.device) as audit:
        finished = engine.step()
    return audit.counts, finished
