"""NVMe tensor store (SPEC §6; issue 7, item 3): spill named tensor groups to disk, restore them.

After a training iteration the master weights and optimizer states go to NVMe so their host DRAM
can be lent to the KV pool; before the next one they come back. A *group* is a dict of named,
contiguous CPU tensors (any dtype, any shape, empty ones too) spilled and restored as one file.

    store = NvmeStore("/nvme/run1")                     # backend "auto": aio, else buffered (loudly)
    rec = store.spill("adam_m", {"w1": m1, "w2": m2})   # -> SpillRecord; tensors are only read
    ...free m1, m2...
    states = store.restore("adam_m")                    # new tensors, or restore(name, out=dict) in place

File `<name>.spill` (all integers little-endian):
    [0, 24)             magic b"HRLNVME1", u64 manifest length L, u64 zlib.crc32 of the manifest
    [24, 24 + L)        manifest, UTF-8 JSON: format, group, checksum algorithm, data_bytes, and per
                        tensor: name, dtype, shape, offset (from the data start), nbytes, checksum
                        (16 hex digits, fixed width so L is known before the data is written)
    [H, H + data_bytes) data, H = round_up(24 + L, 4 KiB); tensors in the caller's order, each at
                        a 64-byte aligned offset, gaps and tail zero; data_bytes is a multiple of
                        64 KiB, so every transfer splits into 4 KiB-aligned pieces for up to 16
                        threads (O_DIRECT needs aligned offsets, sizes and buffers).
A tensor's checksum covers exactly its bytes (xxh3_64 by default, 5 GiB/s on one core here; crc32
if xxhash is missing, 1.6 GiB/s); the manifest's crc32 covers the manifest.

Data path: two staging buffers of `chunk_bytes` (page-locked, from DeepSpeed's pin manager, for
aio). Spill fills one (copy + checksum, in `_PIECE_BYTES` pieces so the checksum reads cache-hot
bytes) while the other is being written; restore reads chunk k+1 while checksumming and copying
chunk k out. Bytes move with numpy.copyto: torch's copy_ of a 4 MiB slice cost ~10 ms here (two
OpenMP threads on two cores; 0.3 GiB/s against numpy's 3.4). At most one transfer is in flight,
so the host memory used is 2 * chunk_bytes whatever the group size.

Backends (`store.backend` says which one runs):
- "aio": DeepSpeed's async_io handle (libaio, O_DIRECT), `async_pwrite`/`async_pread` + `wait()`
  as deepspeed/runtime/swap_tensor does. The op is built once by JIT into $TORCH_EXTENSIONS_DIR.
- "buffered": os.pwrite/os.preadv through the page cache on one worker thread; same file format.
- "auto": aio when the op loads, the directory takes O_DIRECT (probed: tmpfs before Linux 6.6
  refuses it with EINVAL) and the staging buffers can be page-locked (RLIMIT_MEMLOCK); otherwise
  buffered, announced with warnings.warn and a printed line naming the reason. Asking for "aio"
  explicitly raises instead.

DeepSpeed's aio never reads the completion status of a request (csrc/aio/common/
deepspeed_aio_common.cpp, `_do_io_complete`) and asserts (aborting the process) on a short file
or a failed submit. So the store checks everything it can in Python first: free space (statvfs),
then posix_fallocate of the whole temp file, so ENOSPC / EFBIG (RLIMIT_FSIZE) surface there as
a clean error before any data moves; file sizes before every read; and it never returns data
whose checksums it has not verified, which also covers an I/O error aio did not report.

Atomicity: data and header go to `<name>.tmp`, fsync, rename over `<name>.spill`, fsync the
directory. A spill that fails at any point removes the temp file, leaves a previous good file of
the same name and the caller's tensors untouched, and raises SpillError naming the group, the
path, the bytes needed and the bytes free. Restore raises CorruptSpill (naming the file, and the
tensor when one is at fault) on a bad header, truncation or checksum mismatch; when restoring in
place, the `out` tensors' contents are then undefined.

A directory belongs to one store at a time: a new store indexes the `*.spill` files there (so a
restarted run can restore them) and removes stale `*.tmp` left by a crash. Calls are serialized
by a lock (one handle, one pair of staging buffers).

Invariants (`check_integrity`, when no call is running): every known group has its file, of the
size its record says; no `*.tmp` file exists; staging buffers are 2 x chunk_bytes.
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import struct
import sys
import threading
import time
import warnings
import weakref
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

try:
    import xxhash
except ImportError:  # wandb (a dependency) brings it; without it crc32 is used, announced
    xxhash = None

MAGIC = b"HRLNVME1"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sQQ")  # magic, manifest length, manifest crc32
IO_ALIGN = 4096  # O_DIRECT alignment of offsets, sizes and buffer addresses
FILE_ALIGN = 64 << 10  # data_bytes multiple: 4 KiB per thread for up to 16 threads
TENSOR_ALIGN = 64  # every tensor starts at a 64-byte aligned data offset
_PIECE_BYTES = 4 << 20  # copy+checksum granularity inside a chunk (stays in L2/L3)
_MAX_MANIFEST_BYTES = 256 << 20
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
BACKENDS = ("auto", "aio", "buffered")
CHECKSUMS = ("xxh3_64", "crc32")


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


class CorruptSpill(RuntimeError):
    """A spill file is truncated, corrupted or not ours; `tensor` names the culprit when known."""

    def __init__(self, msg: str, *, path: Path, tensor: str | None = None) -> None:
        super().__init__(msg)
        self.path, self.tensor = path, tensor


class UnknownGroup(KeyError):
    """restore/drop of a group name the store does not hold."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Bytes from the start of the data region; a multiple of TENSOR_ALIGN."""
    nbytes: int
    checksum: int


@dataclass(frozen=True)
class Manifest:
    group: str
    checksum: str
    data_bytes: int
    """Size of the data region, a multiple of FILE_ALIGN (0 when the group holds no bytes)."""
    entries: tuple[TensorEntry, ...]
    header_bytes: int
    """Where the data region starts: round_up(24 + manifest length, IO_ALIGN)."""

    @property
    def file_bytes(self) -> int:
        return self.header_bytes + self.data_bytes

    @property
    def payload_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


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


# ---- checksums ----------------------------------------------------------------------------------
class _Crc32:
    def __init__(self) -> None:
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def intdigest(self) -> int:
        return self.value


def _new_hasher(algo: str):
    if algo == "xxh3_64":
        if xxhash is None:
            raise RuntimeError("nvme store: this file's checksums are xxh3_64 and the xxhash package is missing")
        return xxhash.xxh3_64()
    if algo == "crc32":
        return _Crc32()
    raise ValueError(f"nvme store: unknown checksum algorithm {algo!r}")


# ---- file format ------------------------------------------------------------------------------
def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _manifest_json(m: Manifest) -> bytes:
    return json.dumps({
        "format": FORMAT_VERSION, "group": m.group, "checksum": m.checksum, "data_bytes": m.data_bytes,
        "tensors": [{"name": e.name, "dtype": _dtype_name(e.dtype), "shape": list(e.shape), "offset": e.offset,
                     "nbytes": e.nbytes, "checksum": f"{e.checksum:016x}"} for e in m.entries],
    }, separators=(",", ":")).encode()


def _plan(name: str, tensors: dict[str, torch.Tensor], checksum: str) -> Manifest:
    """Layout of a group's file, checksums still zero (same manifest length as the final ones)."""
    entries, cursor = [], 0
    for key, t in tensors.items():
        cursor = _round_up(cursor, TENSOR_ALIGN)
        nbytes = t.numel() * t.element_size()
        entries.append(TensorEntry(key, t.dtype, tuple(t.shape), cursor, nbytes, 0))
        cursor += nbytes
    m = Manifest(name, checksum, _round_up(cursor, FILE_ALIGN), tuple(entries), 0)
    header_bytes = _round_up(_PREFIX.size + len(_manifest_json(m)), IO_ALIGN)
    return Manifest(m.group, m.checksum, m.data_bytes, m.entries, header_bytes)


def _header_bytes(m: Manifest) -> bytes:
    body = _manifest_json(m)
    head = _PREFIX.pack(MAGIC, len(body), zlib.crc32(body)) + body
    assert len(head) <= m.header_bytes, "manifest grew after planning"
    return head + bytes(m.header_bytes - len(head))


def read_manifest(path: str | os.PathLike) -> Manifest:
    """Parse and verify a spill file's header and size (not the data). Raises CorruptSpill."""
    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(_PREFIX.size)
        if len(prefix) < _PREFIX.size:
            raise CorruptSpill(f"nvme store: {path} is truncated: {size} bytes, shorter than its header", path=path)
        magic, body_len, body_crc = _PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise CorruptSpill(f"nvme store: {path} is not a spill file (magic {magic!r})", path=path)
        if body_len > _MAX_MANIFEST_BYTES:
            raise CorruptSpill(f"nvme store: {path} has a corrupt header (manifest length {body_len})", path=path)
        body = f.read(body_len)
    if len(body) < body_len:
        raise CorruptSpill(f"nvme store: {path} is truncated: {size} bytes, its header alone needs "
                           f"{_PREFIX.size + body_len}", path=path)
    if zlib.crc32(body) != body_crc:
        raise CorruptSpill(f"nvme store: {path} has a corrupt header (manifest checksum mismatch)", path=path)
    try:
        d = json.loads(body)
        if d["format"] != FORMAT_VERSION:
            raise ValueError(f"format {d['format']}, this code reads {FORMAT_VERSION}")
        entries = tuple(TensorEntry(t["name"], _parse_dtype(t["dtype"]), tuple(t["shape"]), t["offset"], t["nbytes"],
                                    int(t["checksum"], 16)) for t in d["tensors"])
        m = Manifest(d["group"], d["checksum"], d["data_bytes"], entries,
                     _round_up(_PREFIX.size + body_len, IO_ALIGN))
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptSpill(f"nvme store: {path} has an unreadable manifest: {e}", path=path) from e
    if size != m.file_bytes:
        what = "truncated" if size < m.file_bytes else "longer than its header says"
        raise CorruptSpill(f"nvme store: {path} is {what}: {size} bytes, expected {m.file_bytes}", path=path)
    return m


# ---- chunk plan ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Chunk:
    offset: int
    """Bytes from the start of the data region."""
    nbytes: int
    pieces: tuple[tuple[int, int, int, int], ...]
    """(entry index, offset in the tensor, offset in the chunk, bytes), in file order."""


def _chunks(m: Manifest, chunk_bytes: int) -> list[_Chunk]:
    out, k = [], 0
    live = [(i, e) for i, e in enumerate(m.entries) if e.nbytes]
    for start in range(0, m.data_bytes, chunk_bytes):
        end = min(start + chunk_bytes, m.data_bytes)
        pieces = []
        while k < len(live) and live[k][1].offset < end:
            i, e = live[k]
            lo, hi = max(e.offset, start), min(e.offset + e.nbytes, end)
            pieces.append((i, lo - e.offset, lo - start, hi - lo))
            if e.offset + e.nbytes > end:
                break  # continues in the next chunk
            k += 1
        out.append(_Chunk(start, end - start, tuple(pieces)))
    return out


def _free_bytes(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _reserve(fd: int, num_bytes: int) -> None:
    """Allocate every byte of the file up front: aio does not report a failed write (module docstring)."""
    os.posix_fallocate(fd, 0, num_bytes)


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """[nbytes] uint8 alias of a contiguous tensor of any dtype (bf16 included)."""
    return t.detach().reshape(-1).view(torch.uint8)


# ---- backends -----------------------------------------------------------------------------------
_AIO_MODULE = None


def load_aio_op():
    """DeepSpeed's async_io op (JIT-built once into $TORCH_EXTENSIONS_DIR). Raises when it cannot."""
    global _AIO_MODULE
    if _AIO_MODULE is None:
        from deepspeed.ops.op_builder import AsyncIOBuilder
        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            raise RuntimeError("DeepSpeed's async_io op is not compatible here (libaio-dev missing? "
                               "`apt-get install libaio-dev`, or `make install` as root)")
        _AIO_MODULE = builder.load(verbose=False)
    return _AIO_MODULE


def _odirect_supported(directory: Path) -> bool:
    probe = directory / f".odirect-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    os.close(fd)
    probe.unlink()
    return True


def _can_lock(num_bytes: int) -> bool:
    """Whether num_bytes can be page-locked (DeepSpeed's pin manager aborts the process if not)."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = torch.empty(num_bytes, dtype=torch.uint8)
    addr, size = ctypes.c_void_p(buf.data_ptr()), ctypes.c_size_t(num_bytes)
    if libc.mlock(addr, size) != 0:
        return False
    libc.munlock(addr, size)
    return True


def _close_backend(io) -> None:
    if io.staging or getattr(io, "handle", None) is not None:
        io.close()


class _AioIO:
    """DeepSpeed aio handle + two page-locked staging buffers. One transfer in flight at a time."""

    name = "aio"

    def __init__(self, cfg: NvmeStoreConfig) -> None:
        op = load_aio_op()
        self.handle = op.aio_handle(cfg.block_size, cfg.queue_depth, False, True, cfg.threads)
        example = torch.empty(0, dtype=torch.uint8)
        self.staging = [self.handle.new_cpu_locked_tensor(cfg.chunk_bytes, example) for _ in range(2)]
        self.pending = 0

    def submit(self, write: bool, buf: torch.Tensor, path: Path, fd: int, offset: int) -> None:
        op = self.handle.async_pwrite if write else self.handle.async_pread
        if op(buf, str(path), offset) != 0:
            raise OSError(errno.EIO, f"aio {'write' if write else 'read'} of {buf.numel()} bytes at {offset} "
                          "was refused (see DeepSpeed's message above)", str(path))
        self.pending += 1

    def wait(self) -> None:
        if self.pending:
            self.pending = 0
            self.handle.wait()

    def close(self) -> None:
        if self.handle is None:
            return
        self.wait()
        for b in self.staging:
            self.handle.free_cpu_locked_tensor(b)
        self.staging = []
        # Destroy the handle (its C++ worker threads) now, not during interpreter teardown, where
        # it can abort the process with "terminate called without an active exception".
        self.handle = None


class _BufferedIO:
    """os.pwrite/os.preadv on one worker thread (they release the GIL), same pipeline as aio."""

    name = "buffered"

    def __init__(self, cfg: NvmeStoreConfig) -> None:
        self.staging = [torch.empty(cfg.chunk_bytes, dtype=torch.uint8) for _ in range(2)]
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="nvme-store")
        self.future: Future | None = None

    @staticmethod
    def _transfer(write: bool, view: memoryview, fd: int, offset: int) -> None:
        done = 0
        while done < len(view):
            n = (os.pwrite(fd, view[done:], offset + done) if write
                 else os.preadv(fd, [view[done:]], offset + done))
            if n == 0:
                raise OSError(errno.EIO, f"unexpected end of file at byte {offset + done}")
            done += n

    def submit(self, write: bool, buf: torch.Tensor, path: Path, fd: int, offset: int) -> None:
        self.future = self.pool.submit(self._transfer, write, memoryview(buf.numpy()), fd, offset)

    def wait(self) -> None:
        f, self.future = self.future, None
        if f is not None:
            f.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.pool.shutdown()
            self.staging = []


# ---- the store ----------------------------------------------------------------------------------
class NvmeStore:
    def __init__(self, directory: str | os.PathLike, config: NvmeStoreConfig | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.config = config = config or NvmeStoreConfig()
        if xxhash is None:
            _announce("the xxhash package is missing: spill checksums fall back to crc32 (~3x slower)")
        self._io = self._open_backend(config)
        # Closed at the latest at interpreter exit (atexit), while the runtime is still whole.
        self._finalizer = weakref.finalize(self, _close_backend, self._io)
        self._lock = threading.Lock()
        self._records: dict[str, SpillRecord] = {}
        for stale in self.directory.glob("*.tmp"):
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

    def _open_backend(self, cfg: NvmeStoreConfig) -> _AioIO | _BufferedIO:
        if cfg.backend == "buffered":
            return _BufferedIO(cfg)
        reason = None
        try:
            load_aio_op()
        except Exception as e:  # any build/load failure: the op is unusable here
            reason = f"DeepSpeed's async_io op could not be loaded: {type(e).__name__}: {e}"
        if reason is None and not _odirect_supported(self.directory):
            reason = f"{self.directory} does not support O_DIRECT (tmpfs?)"
        if reason is None and not _can_lock(2 * cfg.chunk_bytes):
            reason = (f"cannot page-lock 2 x {cfg.chunk_bytes} staging bytes (RLIMIT_MEMLOCK; "
                      "`ulimit -l`, or a smaller chunk_bytes)")
        if reason is None:
            return _AioIO(cfg)
        if cfg.backend == "aio":
            raise RuntimeError(f"nvme store: backend='aio' requested but {reason}")
        _announce(f"nvme store falls back to buffered I/O (page cache, slower) for {self.directory}: {reason}")
        return _BufferedIO(cfg)

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
        """Free the staging buffers (and the aio handle); the files stay."""
        with self._lock:
            self._finalizer()

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
        plan = _plan(name, tensors, self.config.checksum)
        final, tmp = self.path(name), self.directory / f"{name}.tmp"
        needed, free = plan.file_bytes, _free_bytes(self.directory)

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
            _reserve(fd, needed)
            sums = self._write_data(plan, tensors, tmp, fd)
            done = Manifest(plan.group, plan.checksum, plan.data_bytes,
                            tuple(TensorEntry(e.name, e.dtype, e.shape, e.offset, e.nbytes, s)
                                  for e, s in zip(plan.entries, sums)), plan.header_bytes)
            head = _header_bytes(done)
            if os.pwrite(fd, head, 0) != len(head):
                raise OSError(errno.EIO, "short header write", str(tmp))
            if self.config.fsync:
                os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(tmp, final)
        except BaseException as e:
            self._drain_quietly()
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

    def _drain_quietly(self) -> None:
        try:
            self._io.wait()
        except OSError:
            pass  # the first error is the one reported

    def _write_data(self, plan: Manifest, tensors: dict[str, torch.Tensor], path: Path, fd: int) -> list[int]:
        srcs = [_byte_view(t).numpy() for t in tensors.values()]
        hashers = [_new_hasher(plan.checksum) for _ in plan.entries]
        staging = self._io.staging
        np_staging = [s.numpy() for s in staging]
        for k, chunk in enumerate(_chunks(plan, self.config.chunk_bytes)):
            buf = np_staging[k % 2]  # the other buffer may still be in flight
            cursor = 0
            for i, src_off, off, n in chunk.pieces:
                buf[cursor:off] = 0
                for p in range(0, n, _PIECE_BYTES):
                    m = min(_PIECE_BYTES, n - p)
                    np.copyto(buf[off + p:off + p + m], srcs[i][src_off + p:src_off + p + m])
                    hashers[i].update(buf[off + p:off + p + m])  # cache-hot: just copied
                cursor = off + n
            buf[cursor:chunk.nbytes] = 0
            self._io.wait()
            self._io.submit(True, staging[k % 2][:chunk.nbytes], path, fd, plan.header_bytes + chunk.offset)
        self._io.wait()
        return [h.intdigest() for h in hashers]

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
            self._read_data(m, dst, path)
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

    def _read_data(self, m: Manifest, dst: list[torch.Tensor], path: Path) -> None:
        dsts = [_byte_view(t).numpy() for t in dst]
        hashers = [_new_hasher(m.checksum) for _ in m.entries]
        staging = self._io.staging
        np_staging = [s.numpy() for s in staging]
        chunks = _chunks(m, self.config.chunk_bytes)
        fd = os.open(path, os.O_RDONLY)
        try:
            if os.fstat(fd).st_size != m.file_bytes:  # re-checked here: aio asserts on a short file
                raise CorruptSpill(f"nvme store: {path} changed size while being restored", path=path)
            if chunks:
                self._io.submit(False, staging[0][:chunks[0].nbytes], path, fd, m.header_bytes)
            for k, chunk in enumerate(chunks):
                self._io.wait()
                if k + 1 < len(chunks):
                    nxt = chunks[k + 1]
                    self._io.submit(False, staging[(k + 1) % 2][:nxt.nbytes], path, fd, m.header_bytes + nxt.offset)
                buf = np_staging[k % 2]
                for i, dst_off, off, n in chunk.pieces:
                    for p in range(0, n, _PIECE_BYTES):
                        q = min(_PIECE_BYTES, n - p)
                        hashers[i].update(buf[off + p:off + p + q])
                        np.copyto(dsts[i][dst_off + p:dst_off + p + q], buf[off + p:off + p + q])  # cache-hot
        except OSError as e:
            self._drain_quietly()
            raise CorruptSpill(f"nvme store: reading {path} failed: {e}", path=path) from e
        except BaseException:
            self._drain_quietly()
            raise
        finally:
            os.close(fd)
        bad = [e.name for e, h in zip(m.entries, hashers) if h.intdigest() != e.checksum]
        if bad:
            raise CorruptSpill(f"nvme store: {path} is corrupt: checksum mismatch in tensor {bad[0]!r}"
                               + (f" (and {bad[1:]})" if len(bad) > 1 else ""), path=path, tensor=bad[0])

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
            tmps = list(self.directory.glob("*.tmp"))
            if tmps:
                raise RuntimeError(f"nvme store integrity: temp files left: {tmps}")
            if self._io.staging and [s.numel() for s in self._io.staging] != [self.config.chunk_bytes] * 2:
                raise RuntimeError("nvme store integrity: staging buffers resized")
