"""NVMe tensor store: spill named tensor groups to disk, restore them.

After a training iteration the master weights and optimizer states go to NVMe so their host DRAM
can be lent to the KV pool; before the next one they come back. A *group* is a dict of named,
contiguous CPU tensors (any dtype, any shape, empty ones too) spilled and restored as one file.

    store = NvmeStore("/nvme/run1")                     # backend "auto": aio, else buffered (loudly)
    rec = store.spill("adam_m", {"w1": m1, "w2": m2})   # -> SpillRecord; tensors are only read
    ...free m1, m2...
    states = store.restore("adam_m")                    # new tensors, or restore(name, out=dict) in place

Split across three modules:
- memory/spill_format.py: the `<name>.spill` file (header, JSON manifest, aligned data region),
  per-tensor checksums (xxh3_64, else crc32), and the chunk plan of a transfer.
- memory/nvme_io.py: the backends (DeepSpeed aio, buffered), the disk probes and checks aio needs
  (it reports no failed write), and the double-buffered stream through two staging buffers of
  `chunk_bytes` (so the host memory used is 2 * chunk_bytes whatever the group size).
- here: the config, the store (naming, atomicity, backend choice, restore targets) and its errors.

Backend choice ("auto"): aio when the op loads, the directory takes O_DIRECT (probed: tmpfs before
Linux 6.6 refuses it with EINVAL) and the staging buffers can be page-locked (RLIMIT_MEMLOCK);
otherwise buffered, announced with warnings.warn and a printed line naming the reason. Asking for
"aio" explicitly raises instead. `store.backend` says which one runs.

Atomicity: data and header go to `<name>.tmp-<pid>-<random>` (memory/durable.py temp_path), fsync, rename over `<name>.spill`, fsync the
directory. A spill that fails at any point removes the temp file, leaves a previous good file of
the same name and the caller's tensors untouched, and raises SpillError naming the group, the
path, the bytes needed and the bytes free. Restore raises CorruptSpill (naming the file, and the
tensor when one is at fault) on a bad header, truncation or checksum mismatch; when restoring in
place, the `out` tensors' contents are then undefined.

A directory belongs to one store at a time, enforced: the store holds an exclusive `flock` on
`<dir>/.lock` (which names the holder: pid, host, owner) until `close()` or its process dies; a
second store on the same directory, in this process or another, raises `SpillDirLocked` naming
the holder. Holding the lock, a new store indexes the `*.spill` files there (so a restarted run can
restore them) and removes stale `*.tmp-*`: left by a crash of an earlier holder, never another live
store's. A run gives each store its own subdirectory (`owner_directory`). Calls are serialized by
a thread lock (one handle, one pair of staging buffers).

Invariants (`check_integrity`, when no call is running): every known group has its file, of the
size its record says; no `*.tmp-*` file exists; staging buffers are 2 x chunk_bytes.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import socket
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

# Imported by name on purpose: NvmeStore calls the probes and disk checks through this module's
# globals, which is where tests patch them (tests/memory/test_nvme_store.py); the tests also reach
# the layout and chunk plan (`spill_layout`, `spill_chunks`) through here.
from memory.durable import temp_path
from memory.nvme_io import (AioIO, BufferedIO, can_lock, close_backend, drain_quietly, free_bytes,
                            odirect_supported, read_data, reserve, write_data, load_aio_op)
from memory.spill_format import (CHECKSUMS, FILE_ALIGN, FORMAT_VERSION, IO_ALIGN, MAGIC, TENSOR_ALIGN, CorruptSpill,
                                 Manifest, TensorEntry, spill_header_bytes, spill_layout, read_manifest, xxhash)
from memory.spill_format import spill_chunks  # noqa: F401 - re-exported for the tests

__all__ = ["BACKENDS", "CHECKSUMS", "FILE_ALIGN", "FORMAT_VERSION", "IO_ALIGN", "MAGIC", "TENSOR_ALIGN", "CorruptSpill",
           "Manifest", "NvmeStore", "NvmeStoreConfig", "SpillDirLocked", "SpillError", "SpillRecord", "TensorEntry",
           "UnknownGroup", "load_aio_op", "owner_directory", "read_manifest"]

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
LOCK_FILE = ".lock"


class SpillDirLocked(RuntimeError):
    """Another live store holds the directory (its lock file names it)."""

    def __init__(self, msg: str, *, directory: Path, holder: str) -> None:
        super().__init__(msg)
        self.directory, self.holder = directory, holder


def owner_directory(root: str | os.PathLike, owner: str | os.PathLike) -> Path:
    """`root`'s subdirectory for one owner (a run directory, say): its name plus a digest of its
    resolved path, so two runs sharing `root` never share a store, and a resumed run finds its own."""
    resolved = str(Path(owner).resolve())
    return Path(root) / f"{Path(resolved).name or 'root'}-{hashlib.sha1(resolved.encode()).hexdigest()[:10]}"


def _lock_directory(directory: Path, owner: str) -> int:
    """Take `directory`'s lock file (exclusive, non-blocking) and write the holder into it; returns
    the descriptor, whose closing (or the process's death) releases the lock."""
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "a holder that wrote no name"
        os.close(fd)
        raise SpillDirLocked(f"nvme store: {directory} is in use by another store ({holder}); two runs must not "
                             f"share a spill directory (each store locks its own; give this run another "
                             f"memory.spill_dir, or stop the other one)", directory=directory, holder=holder) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}{', ' + owner if owner else ''}\n".encode(), 0)
    return fd
BACKENDS = ("auto", "aio", "buffered")


def _announce(msg: str) -> None:
    """A fallback the user must see: a warning and a printed line (STYLE: no silent fallbacks)."""
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    print(f"[nvme_store] WARNING: {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True, kw_only=True)
class NvmeStoreConfig:
    backend: str = "auto"
    """"aio" (DeepSpeed async_io, O_DIRECT), "buffered" (page cache), or "auto" (aio, else buffered, loudly)."""
    block_size: int = 4 << 20
    """Bytes per aio request (DeepSpeed block_size); a multiple of 4 KiB."""
    queue_depth: int = 16
    """aio requests in flight per thread."""
    threads: int = 1
    """DeepSpeed intra_op_parallelism: threads splitting each transfer; 1, 2, 4, 8 or 16."""
    chunk_bytes: int = 64 << 20
    """Bytes per staging buffer (two of them, page-locked for aio); a multiple of 64 KiB."""
    checksum: str = "xxh3_64" if xxhash is not None else "crc32"
    """Per-tensor checksum written on spill: "xxh3_64" or "crc32"; restore uses the file's own."""
    fsync: bool = True
    """fsync file and directory before a spill returns. Off only for throwaway data."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"nvme store: backend={self.backend!r}, expected one of {BACKENDS}")
        if self.block_size < IO_ALIGN or self.block_size % IO_ALIGN:
            raise ValueError(f"nvme store: block_size={self.block_size}, expected a positive multiple of {IO_ALIGN}")
        if self.queue_depth < 1:
            raise ValueError(f"nvme store: queue_depth={self.queue_depth}, expected >= 1")
        if self.threads not in (1, 2, 4, 8, 16):
            raise ValueError(f"nvme store: threads={self.threads}, expected 1, 2, 4, 8 or 16")
        if self.chunk_bytes < FILE_ALIGN or self.chunk_bytes % FILE_ALIGN:
            raise ValueError(f"nvme store: chunk_bytes={self.chunk_bytes}, expected a positive multiple of "
                             f"{FILE_ALIGN}")
        if self.checksum not in CHECKSUMS:
            raise ValueError(f"nvme store: checksum={self.checksum!r}, expected one of {CHECKSUMS}")
        if self.checksum == "xxh3_64" and xxhash is None:
            raise ValueError("nvme store: checksum='xxh3_64' needs the xxhash package; install it or use 'crc32'")


class SpillError(RuntimeError):
    """A spill failed (disk full, file too large, I/O error); nothing changed on disk or in memory."""

    def __init__(self, msg: str, *, name: str, path: Path, bytes_needed: int, bytes_free: int) -> None:
        super().__init__(msg)
        self.name, self.path, self.bytes_needed, self.bytes_free = name, path, bytes_needed, bytes_free


class UnknownGroup(KeyError):
    """restore/drop of a group name the store does not hold."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class SpillRecord:
    name: str
    path: Path
    backend: str
    num_tensors: int
    payload_bytes: int
    """Tensor bytes in the group."""
    file_bytes: int
    """Bytes the file takes (header + aligned data region)."""
    spill_s: float


# ---- the store ----------------------------------------------------------------------------------
class NvmeStore:
    def __init__(self, directory: str | os.PathLike, config: NvmeStoreConfig | None = None, owner: str = "") -> None:
        """`owner`: who holds the directory, written into its lock file (a run directory, say)."""
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.config = config = config or NvmeStoreConfig()
        if xxhash is None:
            _announce("the xxhash package is missing: spill checksums fall back to crc32 (~3x slower)")
        self._io = self._open_backend(config)
        # Closed at the latest at interpreter exit (atexit), while the runtime is still whole.
        self._finalizer = weakref.finalize(self, close_backend, self._io)
        try:
            lock_fd = _lock_directory(self.directory, owner)
        except SpillDirLocked:
            self._finalizer()
            raise
        self._unlock = weakref.finalize(self, os.close, lock_fd)
        self._lock = threading.Lock()
        self._records: dict[str, SpillRecord] = {}
        for stale in [*self.directory.glob("*.tmp-*"), *self.directory.glob("*.tmp")]:  # (older runs: "<name>.tmp")
            print(f"[nvme_store] removing {stale}, left by an interrupted spill", file=sys.stderr)
            stale.unlink()
        for f in sorted(self.directory.glob("*.spill")):  # groups an earlier run left
            name = f.name.removesuffix(".spill")
            if not _NAME_RE.fullmatch(name):
                continue
            try:
                m = read_manifest(f)
                self._records[name] = SpillRecord(name, f, "unknown", len(m.entries), m.payload_bytes,
                                                  m.file_bytes, 0.0)
            except CorruptSpill as e:  # kept, so that restore says what is wrong with it
                print(f"[nvme_store] WARNING: {e}", file=sys.stderr)
                self._records[name] = SpillRecord(name, f, "unknown", -1, -1, f.stat().st_size, 0.0)

    def _open_backend(self, cfg: NvmeStoreConfig) -> AioIO | BufferedIO:
        if cfg.backend == "buffered":
            return BufferedIO(cfg.chunk_bytes)
        reason = None
        try:
            load_aio_op()
        except Exception as e:  # any build/load failure: the op is unusable here
            reason = f"DeepSpeed's async_io op could not be loaded: {type(e).__name__}: {e}"
        if reason is None and not odirect_supported(self.directory):
            reason = f"{self.directory} does not support O_DIRECT (tmpfs?)"
        if reason is None and not can_lock(2 * cfg.chunk_bytes):
            reason = (f"cannot page-lock 2 x {cfg.chunk_bytes} staging bytes (RLIMIT_MEMLOCK; "
                      "`ulimit -l`, or a smaller chunk_bytes)")
        if reason is None:
            return AioIO(cfg.chunk_bytes, block_size=cfg.block_size, queue_depth=cfg.queue_depth, threads=cfg.threads)
        if cfg.backend == "aio":
            raise RuntimeError(f"nvme store: backend='aio' requested but {reason}")
        _announce(f"nvme store falls back to buffered I/O (page cache, slower) for {self.directory}: {reason}")
        return BufferedIO(cfg.chunk_bytes)

    @property
    def backend(self) -> str:
        """The backend that runs: "aio" or "buffered"."""
        return self._io.name

    @property
    def bytes_on_disk(self) -> int:
        return sum(r.file_bytes for r in self._records.values())

    def names(self) -> list[str]:
        return sorted(self._records)

    def path(self, name: str) -> Path:
        return self.directory / f"{name}.spill"

    def close(self) -> None:
        """Free the staging buffers (and the aio handle) and release the directory; the files stay."""
        with self._lock:
            self._finalizer()
            self._unlock()

    def __enter__(self) -> "NvmeStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- spill --------------------------------------------------------------------------------
    def spill(self, name: str, tensors: dict[str, torch.Tensor]) -> SpillRecord:
        """Write `tensors` (contiguous CPU, any dtype) as group `name`, replacing an earlier spill of it.

        Only reads the tensors: on return the caller may free them. On failure raises SpillError and
        leaves the previous file of this name (if any) and the tensors as they were.
        """
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise ValueError(f"nvme store: group name {name!r} must match {_NAME_RE.pattern} (it names a file)")
        for key, t in tensors.items():
            if not isinstance(key, str) or not isinstance(t, torch.Tensor):
                raise TypeError(f"nvme store: group {name!r}: expected str -> Tensor, "
                                f"got {key!r} -> {type(t).__name__}")
            if t.device.type != "cpu" or t.layout != torch.strided or not t.is_contiguous():
                raise ValueError(f"nvme store: group {name!r}: tensor {key!r} must be a contiguous CPU tensor "
                                 f"(device {t.device}, layout {t.layout}, contiguous {t.is_contiguous()})")
        with self._lock:
            if not self._io.staging:
                raise RuntimeError("nvme store: closed")
            return self._spill_locked(name, tensors)

    def _spill_locked(self, name: str, tensors: dict[str, torch.Tensor]) -> SpillRecord:
        t0 = time.perf_counter()
        plan = spill_layout(name, tensors, self.config.checksum)
        final, tmp = self.path(name), temp_path(self.directory / name)
        needed, free = plan.file_bytes, free_bytes(self.directory)

        def fail(why: str) -> SpillError:
            return SpillError(f"nvme store: spill of group {name!r} to {tmp} failed: {why}; it needs {needed} bytes, "
                              f"{free} bytes free on {self.directory}. Nothing changed: the tensors are intact"
                              + (f" and {final} still holds the previous spill" if final.exists() else ""),
                              name=name, path=tmp, bytes_needed=needed, bytes_free=free)

        if needed > free:
            raise fail("not enough free space")
        fd = -1
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            reserve(fd, needed)
            sums = write_data(self._io, plan, tensors, tmp, fd, self.config.chunk_bytes)
            done = Manifest(plan.group, plan.checksum, plan.data_bytes,
                            tuple(TensorEntry(e.name, e.dtype, e.shape, e.offset, e.nbytes, s)
                                  for e, s in zip(plan.entries, sums)), plan.header_bytes)
            head = spill_header_bytes(done)
            if os.pwrite(fd, head, 0) != len(head):
                raise OSError(errno.EIO, "short header write", str(tmp))
            if self.config.fsync:
                os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(tmp, final)
        except BaseException as e:
            drain_quietly(self._io)
            if fd >= 0:
                os.close(fd)
            tmp.unlink(missing_ok=True)
            if isinstance(e, OSError):
                raise fail(f"{e.strerror or e} (errno {e.errno})") from e
            raise
        if self.config.fsync:
            self._fsync_dir()
        rec = SpillRecord(name, final, self.backend, len(done.entries), done.payload_bytes, done.file_bytes,
                          time.perf_counter() - t0)
        self._records[name] = rec
        return rec

    def _fsync_dir(self) -> None:
        dfd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    # ---- restore ------------------------------------------------------------------------------
    def restore(self, name: str, out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Read group `name` back: into `out`'s tensors in place (same names, dtypes, shapes; contiguous
        CPU), or into new tensors. Returns name -> tensor in spill order, every checksum verified.

        Raises UnknownGroup, CorruptSpill (truncated/corrupt file; `out` contents then undefined), or
        ValueError when `out` does not match the group (checked before any byte is read).
        """
        with self._lock:
            if name not in self._records:
                raise UnknownGroup(f"nvme store: no group {name!r} in {self.directory} (groups: {self.names()})")
            if not self._io.staging:
                raise RuntimeError("nvme store: closed")
            path = self.path(name)
            m = read_manifest(path)
            if m.group != name:
                raise CorruptSpill(f"nvme store: {path} holds group {m.group!r}, not {name!r}", path=path)
            dst = self._destinations(name, m, out)
            read_data(self._io, m, dst, path, self.config.chunk_bytes)
            return dict(zip((e.name for e in m.entries), dst))

    def _destinations(self, name: str, m: Manifest, out: dict[str, torch.Tensor] | None) -> list[torch.Tensor]:
        if out is None:
            return [torch.empty(e.shape, dtype=e.dtype) for e in m.entries]
        want = [e.name for e in m.entries]
        if set(out) != set(want):
            raise ValueError(f"nvme store: restore of {name!r}: out has names {sorted(set(out) - set(want))} not in "
                             f"the group and lacks {sorted(set(want) - set(out))}")
        for e in m.entries:
            t = out[e.name]
            if (t.dtype, tuple(t.shape)) != (e.dtype, e.shape) or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"nvme store: restore of {name!r}: out[{e.name!r}] is {t.dtype} {tuple(t.shape)} on "
                                 f"{t.device} (contiguous {t.is_contiguous()}); the file holds {e.dtype} {e.shape}, "
                                 "and it must be a contiguous CPU tensor")
        return [out[e.name] for e in m.entries]

    # ---- drop, integrity ------------------------------------------------------------------------
    def drop(self, name: str) -> None:
        """Delete group `name`'s file."""
        with self._lock:
            if name not in self._records:
                raise UnknownGroup(f"nvme store: no group {name!r} in {self.directory} (groups: {self.names()})")
            self.path(name).unlink(missing_ok=True)
            del self._records[name]
            if self.config.fsync:
                self._fsync_dir()

    def check_integrity(self) -> None:
        with self._lock:
            for name, rec in self._records.items():
                p = self.path(name)
                if not p.exists():
                    raise RuntimeError(f"nvme store integrity: group {name!r} has no file {p}")
                if p.stat().st_size != rec.file_bytes:
                    raise RuntimeError(f"nvme store integrity: {p} has {p.stat().st_size} bytes, record says "
                                       f"{rec.file_bytes}")
            tmps = list(self.directory.glob("*.tmp-*"))
            if tmps:
                raise RuntimeError(f"nvme store integrity: temp files left: {tmps}")
            if self._io.staging and [s.numel() for s in self._io.staging] != [self.config.chunk_bytes] * 2:
                raise RuntimeError("nvme store integrity: staging buffers resized")
