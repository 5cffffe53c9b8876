"""One run per run_dir: an exclusive lock taken before anything is written there.

`run_dir/.run.lock` is held with flock(LOCK_EX | LOCK_NB) for the life of the run (rank 0's process; the
other ranks of the same run write into the directory it holds) and names its holder: pid, host and start
time. A second run on the same directory is refused with that line; a holder that died (kill -9, a lost
node's process) holds nothing, since the kernel drops the lock with its process, so the next run takes it
without any clean-up. Re-entrant within one process (rl.train's entry point takes it before Hydra writes
its files, `run` again around the loop). flock is local to one host: two hosts sharing a run_dir over a
network filesystem are not told apart (each rank 0 must be the only one launched for a run_dir).
"""
from __future__ import annotations

import datetime
import fcntl
import os
import socket
from pathlib import Path

LOCK_FILE = ".run.lock"
_HELD: dict[str, tuple[int, int, bool]] = {}
"""Resolved run_dir -> (lock descriptor, times taken, whether taking it made the directory) in this process."""


class RunDirLocked(RuntimeError):
    """Another live run holds the run_dir."""


def lock_run_dir(run_dir: str | os.PathLike) -> None:
    """Take `run_dir`'s lock (the directory is made if missing, and removed again by the last
    `unlock_run_dir` when the run wrote nothing else), or raise RunDirLocked naming the holder."""
    path = Path(run_dir)
    key = str(path.resolve())
    if key in _HELD:
        fd, count, made = _HELD[key]
        _HELD[key] = (fd, count + 1, made)
        return
    made = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "a holder that wrote no name"
        os.close(fd)
        raise RunDirLocked(f"run_dir {str(run_dir)!r} is in use by another run ({holder}; lock {path / LOCK_FILE}): "
                           f"two runs must not write one run_dir; wait for it to end, stop it, or choose another "
                           f"run_dir") from None
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n".encode(), 0)
    os.fsync(fd)
    _HELD[key] = (fd, 1, made)


def unlock_run_dir(run_dir: str | os.PathLike) -> None:
    """Give back one `lock_run_dir` of this process; the lock is released with the last one."""
    key = str(Path(run_dir).resolve())
    fd, count, made = _HELD.pop(key, (None, 0, False))
    if fd is None:
        return
    if count > 1:
        _HELD[key] = (fd, count - 1, made)
        return
    path = Path(run_dir)
    if made and [p.name for p in path.iterdir()] == [LOCK_FILE]:  # a run refused before it wrote: nothing left
        (path / LOCK_FILE).unlink()
        path.rmdir()
    os.close(fd)  # otherwise the file stays (it names the last holder); the lock goes with the descriptor
