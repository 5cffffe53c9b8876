"""`DeviceAudit`: which repository lines create tensors on a device other than the model's.

A tensor factory call without `device=` lands on the default device (the CPU) whatever the
model's device: on a GPU run the first op mixing it with CUDA tensors fails, a bug a CPU-only
machine cannot see otherwise. The audit is a TorchFunctionMode that records such calls by the
repository file:line that made them (calls from inside torch and other libraries are theirs).
Same idea as `ImplicitDeviceCalls` in tests/rl/test_device.py, plus calls that name a device other
than the expected one (seen only when the model is elsewhere, i.e. on a GPU host); that helper is
not imported because it lives in a test module that pulls the whole RL loop in.
"""
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

ROOT = Path(__file__).resolve().parents[1]
FORWARDERS = {("models/state.py", "positions")}
"""(file, function) that pass their caller's `device` argument on: a call without a device there is
charged to the caller (e.g. `SegmentBatch.positions()` called with no device)."""


def resolved(device: torch.device | str | int) -> torch.device:
    """A device with its index filled in (`cuda` means the current GPU)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class DeviceAudit(TorchFunctionMode):
    """Records, by repository file:line, factory calls that name no device (`implicit`) and ones
    that name a device other than `expected` (`elsewhere`). A draw with a `generator=` on the device
    it names is never `elsewhere` (per-request generators are CPU generators by design), nor is a
    pinned host tensor (`pin_memory=True`: a staging buffer for one non-blocking copy). `seen`
    counts every factory call made from the `audited` path prefixes, with a device or not."""

    FACTORIES = frozenset({torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.full, torch.empty,
                           torch.arange, torch.rand, torch.randn, torch.randint, torch.randperm, torch.eye,
                           torch.linspace, torch.logspace, torch.scalar_tensor, torch.empty_strided})
    MACHINERY = ("torch/overrides.py", "torch/utils/_device.py")
    """Frames of the mode dispatch itself, not callers."""

    def __init__(self, expected: torch.device, audited: tuple[str, ...], known: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.expected, self.audited, self.known = resolved(expected), audited, known
        self.implicit: Counter[str] = Counter()
        self.elsewhere: Counter[str] = Counter()
        self.seen: Counter[str] = Counter()

    def _site(self) -> str | None:
        """file:line of the innermost repository caller (past FORWARDERS); None outside the repo."""
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.endswith(self.MACHINERY):
            frame = frame.f_back
        while frame is not None:
            path = Path(frame.f_code.co_filename)
            if not path.is_relative_to(ROOT) or ".venv" in path.parts:
                return None
            rel = path.relative_to(ROOT).as_posix()
            if (rel, frame.f_code.co_name) not in FORWARDERS:
                return f"{rel}:{frame.f_lineno}"
            frame = frame.f_back
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        from_tensor = func is torch.as_tensor and args and isinstance(args[0], torch.Tensor)
        if func in self.FACTORIES and not from_tensor:
            site = self._site()
            if site is not None:
                if site.startswith(self.audited):
                    self.seen[site] += 1
                device, generator = kwargs.get("device"), kwargs.get("generator")
                if device is None:
                    self.implicit[site] += 1
                elif resolved(device) != self.expected and not (
                        generator is not None and resolved(device) == resolved(generator.device)) and not (
                        kwargs.get("pin_memory") and resolved(device).type == "cpu"):  # host staging buffer
                    self.elsewhere[site] += 1
        return func(*args, **kwargs)

    def report(self) -> tuple[dict[str, int], dict[str, int]]:
        """Prints every flagged site (tagged audited / known / outside); returns (implicit, elsewhere)
        restricted to the audited files that are not known."""
        print(f"\nfactory calls without device= or off {self.expected} (site: calls):")
        for kind, sites in (("no device", self.implicit), ("other device", self.elsewhere)):
            for site, n in sorted(sites.items()):
                tag = "known" if site.startswith(self.known) else "AUDITED" if site.startswith(self.audited) else "outside"
                print(f"  [{tag}] {kind} {site}: {n}")

        def ours(sites: Counter[str]) -> dict[str, int]:
            return {s: n for s, n in sites.items() if s.startswith(self.audited) and not s.startswith(self.known)}

        return ours(self.implicit), ours(self.elsewhere)
