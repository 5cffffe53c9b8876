"""JIT-built extensions: whether one is built, and saying so before a build starts (a run must
never compile silently on its hot path; `python -m kernels.prebuild` builds them all ahead)."""
from __future__ import annotations

import sys
from pathlib import Path

BUILD_SECONDS = {"hybridrl_kda_cpu": 30, "async_io": 180, "cpu_adam": 45}
"""Rough first-build times on 2 CPU cores, for the announcement."""


def is_built(name: str) -> bool:
    """Whether the JIT extension `name` has a built library in this process's extensions directory."""
    from torch.utils.cpp_extension import _get_build_directory

    return any(Path(_get_build_directory(name, verbose=False)).glob("*.so"))


def announce_build(name: str, what: str) -> bool:
    """Say on stderr that `what` (extension `name`) is about to be compiled, when it is not built yet;
    returns whether it was already built."""
    if is_built(name):
        return True
    seconds = BUILD_SECONDS.get(name)
    print(f"building {what} ({name}, once{f': ~{seconds} s' if seconds else ''}; `python -m kernels.prebuild` "
          f"or `make install` builds it ahead of a run)...", file=sys.stderr, flush=True)
    return False
