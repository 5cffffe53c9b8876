"""Fused C++ CPU kernels (`impl="cpu"`; MoE routing on CPU): built on first use with torch's JIT
extension builder (g++, ~40 s once; cached under $TORCH_EXTENSIONS_DIR, which the Makefile puts in
.cache/). Their torch twins are the `impl="naive"` paths, and tests compare the two
(tests/kernels/test_kda_cpu.py).

`ops()` returns the built module, or None (with one loud warning naming the error) when it cannot
be built here; `kernels.impl.default_impl()` then picks "naive".
"""
from __future__ import annotations

import warnings
from pathlib import Path

from kernels.jit import building

_SOURCE = Path(__file__).with_name("kda_cpu.cpp")
_NAME = "hybridrl_kda_cpu"
_state: dict[str, object] = {}


def ops():
    """The compiled module (kda_decode_step, kda_conv_step, moe_route_dense), or None if it cannot be built."""
    if "module" not in _state:
        try:
            from torch.utils.cpp_extension import load

            with building(_NAME, f"the fused CPU kernels ({_SOURCE.name})"):
                _state["module"] = load(name=_NAME, sources=[str(_SOURCE)], extra_cflags=["-O3"], verbose=False)
        except Exception as err:  # no compiler, no headers: the torch path still works
            warnings.warn(f"fused CPU kernels unavailable ({type(err).__name__}: {err}); using impl='naive'",
                          RuntimeWarning, stacklevel=2)
            _state["module"] = None
    return _state["module"]


def available() -> bool:
    return ops() is not None
