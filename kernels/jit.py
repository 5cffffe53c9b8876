"""JIT-built extensions: whether one is built and current, saying so truly before a build starts (a run
must never compile silently on its hot path; `python -m kernels.prebuild` builds them all ahead), and
torch's build lock freed when the build that took it was killed.

torch's JIT build takes a lock file (`<build dir>/lock`, `torch.utils.file_baton.FileBaton`) that names
no holder; a build killed midway (Ctrl-C during the first build, a test stopped by its timeout) leaves it,
and every later load of that extension waits on it forever, at 0% CPU, saying nothing. `building()` holds
an flock on `<build dir>/lock.holder` around each build of ours: the kernel drops it when its process
dies, so a `lock` found while nobody holds `lock.holder` is a dead build's, and is removed (said on stderr).

In a checkout, $TORCH_EXTENSIONS_DIR defaults to the project's `.cache/torch_extensions` (where `make install`
builds them), so `python -m rl.train` run by hand finds the ops built instead of building them again under
~/.cache; a value set in the environment is kept.
"""
from __future__ import annotations

import fcntl
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PROJECT_EXTENSIONS_DIR = Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions"
"""The build cache of a checkout (the Makefile's $TORCH_EXTENSIONS_DIR)."""
if (PROJECT_EXTENSIONS_DIR.parents[1] / "pyproject.toml").exists():  # a checkout, not an installed package
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(PROJECT_EXTENSIONS_DIR))

_HELD: set[str] = set()  # extensions whose lock.holder this process holds now

BUILD_SECONDS = {"hybridrl_kda_cpu": 30, "async_io": 180, "cpu_adam": 45}
"""Rough first-build times on 2 CPU cores, for the announcement."""


def build_directory(name: str) -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def build_state(name: str) -> str:
    """"built" (a library newer than its build file and every source that file compiles), "missing" (no
    library), or "stale: <file> changed since the last build" (torch's ninja will compile it again)."""
    directory = build_directory(name)
    libraries = list(directory.glob("*.so"))
    if not libraries:
        return "missing"
    built = min(p.stat().st_mtime for p in libraries)
    ninja = directory / "build.ninja"
    sources = [ninja] if ninja.exists() else []
    if ninja.exists():
        sources += [Path(s) for s in re.findall(r"^build \S+: \w+ (\S+\.(?:cpp|cc|cu|c))$", ninja.read_text(), re.M)]
    for source in sources:
        if not source.exists() or source.stat().st_mtime > built:
            return f"stale: {source} changed since the last build"
    return "built"


def is_built(name: str) -> bool:
    """Whether the JIT extension `name` is built and current in this process's extensions directory."""
    return build_state(name) == "built"


def announce_build(name: str, what: str) -> bool:
    """Say on stderr that `what` (extension `name`) is about to be compiled, and why, when it is not built
    and current; returns whether it was."""
    state = build_state(name)
    if state == "built":
        return True
    seconds = BUILD_SECONDS.get(name)
    why = "not built yet" if state == "missing" else state
    print(f"building {what} ({name}, {why}{f'; ~{seconds} s' if seconds else ''}; `python -m kernels.prebuild` "
          f"or `make install` builds it ahead of a run)...", file=sys.stderr, flush=True)
    return False


@contextmanager
def building(name: str, what: str) -> Iterator[bool]:
    """Around a JIT load of extension `name` (module docstring): waits for a live build of it by another
    process, frees the lock of a dead one, announces a build (`announce_build`); yields whether the
    extension was built and current."""
    if name in _HELD:  # a build of ours already holds it in this process (prebuild -> kernels.cpu): nested
        yield announce_build(name, what)
        return
    directory = build_directory(name)
    directory.mkdir(parents=True, exist_ok=True)
    holder = os.open(directory / "lock.holder", os.O_CREAT | os.O_RDWR, 0o644)
    _HELD.add(name)
    try:
        try:
            fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process building {what} ({directory})...", file=sys.stderr, flush=True)
            fcntl.flock(holder, fcntl.LOCK_EX)  # its process ending (even by SIGKILL) releases it
        lock = directory / "lock"
        if lock.exists():  # nobody holds lock.holder: the build that took torch's lock is dead
            lock.unlink(missing_ok=True)
            print(f"removed the stale build lock {lock} (a build of {what} was stopped midway)", file=sys.stderr,
                  flush=True)
        yield announce_build(name, what)
    finally:
        _HELD.discard(name)
        os.close(holder)
