"""The NVMe store's I/O path (memory/nvme_store.py): backends, disk probes, the double-buffered stream.

Backends (`NvmeStore.backend` says which one runs; the store picks one, see `NvmeStore._open_backend`):
- "aio" (`AioIO`): DeepSpeed's async_io handle (libaio, O_DIRECT), `async_pwrite`/`async_pread` +
  `wait()` as deepspeed/runtime/swap_tensor does. The op is built once by JIT into $TORCH_EXTENSIONS_DIR.
- "buffered" (`BufferedIO`): os.pwrite/os.preadv through the page cache on one worker thread; same
  file format.
Both own two staging buffers of `chunk_bytes` (page-locked, from DeepSpeed's pin manager, for aio)
and have at most one transfer in flight (`submit`, then `wait`).

DeepSpeed's aio never reads the completion status of a request (csrc/aio/common/
deepspeed_aio_common.cpp, `_do_io_complete`) and asserts (aborting the process) on a short file
or a failed submit. So the store checks everything it can in Python first: free space
(`free_bytes`, statvfs), then posix_fallocate of the whole temp file (`reserve`), so ENOSPC /
EFBIG (RLIMIT_FSIZE) surface there as a clean error before any data moves; file sizes before every
read; and it never returns data whose checksums it has not verified, which also covers an I/O
error aio did not report.

Data path (`write_data`, `read_data`): spill fills one staging buffer (copy + checksum, in
`_PIECE_BYTES` pieces so the checksum reads cache-hot bytes) while the other is being written;
restore reads chunk k+1 while checksumming and copying chunk k out. Bytes move with numpy.copyto:
torch's copy_ of a 4 MiB slice cost ~10 ms here (two OpenMP threads on two cores; 0.3 GiB/s
against numpy's 3.4). The host memory used is 2 * chunk_bytes whatever the group size.
"""
from __future__ import annotations

import ctypes
import errno
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from kernels.jit import building
from memory.spill_format import CorruptSpill, Manifest, spill_chunks, new_hasher

_PIECE_BYTES = 4 << 20  # copy+checksum granularity inside a chunk (stays in L2/L3)


# ---- disk checks (before any data moves) --------------------------------------------------------
def free_bytes(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def reserve(fd: int, num_bytes: int) -> None:
    """Allocate every byte of the file up front: aio does not report a failed write (module docstring)."""
    os.posix_fallocate(fd, 0, num_bytes)


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
        with building("async_io", "DeepSpeed's async_io op (NVMe store)"):
            _AIO_MODULE = builder.load(verbose=False)
    return _AIO_MODULE


def odirect_supported(directory: Path) -> bool:
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


def can_lock(num_bytes: int) -> bool:
    """Whether num_bytes can be page-locked (DeepSpeed's pin manager aborts the process if not)."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = torch.empty(num_bytes, dtype=torch.uint8)
    addr, size = ctypes.c_void_p(buf.data_ptr()), ctypes.c_size_t(num_bytes)
    if libc.mlock(addr, size) != 0:
        return False
    libc.munlock(addr, size)
    return True


def close_backend(io) -> None:
    if io.staging or getattr(io, "handle", None) is not None:
        io.close()


class AioIO:
    """DeepSpeed aio handle + two page-locked staging buffers. One transfer in flight at a time."""

    name = "aio"

    def __init__(self, chunk_bytes: int, *, block_size: int, queue_depth: int, threads: int) -> None:
        op = load_aio_op()
        self.handle = op.aio_handle(block_size, queue_depth, False, True, threads)
        example = torch.empty(0, dtype=torch.uint8)
        self.staging = [self.handle.new_cpu_locked_tensor(chunk_bytes, example) for _ in range(2)]
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


class BufferedIO:
    """os.pwrite/os.preadv on one worker thread (they release the GIL), same pipeline as aio."""

    name = "buffered"

    def __init__(self, chunk_bytes: int) -> None:
        self.staging = [torch.empty(chunk_bytes, dtype=torch.uint8) for _ in range(2)]
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


# ---- data path ----------------------------------------------------------------------------------
def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """[nbytes] uint8 alias of a contiguous tensor of any dtype (bf16 included)."""
    return t.detach().reshape(-1).view(torch.uint8)


def drain_quietly(io: AioIO | BufferedIO) -> None:
    try:
        io.wait()
    except OSError:
        pass  # the first error is the one reported


def write_data(io: AioIO | BufferedIO, plan: Manifest, tensors: dict[str, torch.Tensor], path: Path, fd: int,
                chunk_bytes: int) -> list[int]:
    """Stream `tensors` into the data region of `fd` as `plan` lays it out; returns their checksums."""
    srcs = [_byte_view(t).numpy() for t in tensors.values()]
    hashers = [new_hasher(plan.checksum) for _ in plan.entries]
    staging = io.staging
    np_staging = [s.numpy() for s in staging]
    for k, chunk in enumerate(spill_chunks(plan, chunk_bytes)):
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
        io.wait()
        io.submit(True, staging[k % 2][:chunk.nbytes], path, fd, plan.header_bytes + chunk.offset)
    io.wait()
    return [h.intdigest() for h in hashers]


def read_data(io: AioIO | BufferedIO, m: Manifest, dst: list[torch.Tensor], path: Path, chunk_bytes: int) -> None:
    """Stream the data region of `path` into `dst` (one contiguous CPU tensor per entry), verifying
    every checksum; raises CorruptSpill (then `dst` contents are undefined)."""
    dsts = [_byte_view(t).numpy() for t in dst]
    hashers = [new_hasher(m.checksum) for _ in m.entries]
    staging = io.staging
    np_staging = [s.numpy() for s in staging]
    chunks = spill_chunks(m, chunk_bytes)
    fd = os.open(path, os.O_RDONLY)
    try:
        if os.fstat(fd).st_size != m.file_bytes:  # re-checked here: aio asserts on a short file
            raise CorruptSpill(f"nvme store: {path} changed size while being restored", path=path)
        if chunks:
            io.submit(False, staging[0][:chunks[0].nbytes], path, fd, m.header_bytes)
        for k, chunk in enumerate(chunks):
            io.wait()
            if k + 1 < len(chunks):
                nxt = chunks[k + 1]
                io.submit(False, staging[(k + 1) % 2][:nxt.nbytes], path, fd, m.header_bytes + nxt.offset)
            buf = np_staging[k % 2]
            for i, dst_off, off, n in chunk.pieces:
                for p in range(0, n, _PIECE_BYTES):
                    q = min(_PIECE_BYTES, n - p)
                    hashers[i].update(buf[off + p:off + p + q])
                    np.copyto(dsts[i][dst_off + p:dst_off + p + q], buf[off + p:off + p + q])  # cache-hot
    except OSError as e:
        drain_quietly(io)
        raise CorruptSpill(f"nvme store: reading {path} failed: {e}", path=path) from e
    except BaseException:
        drain_quietly(io)
        raise
    finally:
        os.close(fd)
    bad = [e.name for e, h in zip(m.entries, hashers) if h.intdigest() != e.checksum]
    if bad:
        raise CorruptSpill(f"nvme store: {path} is corrupt: checksum mismatch in tensor {bad[0]!r}"
                           + (f" (and {bad[1:]})" if len(bad) > 1 else ""), path=path, tensor=bad[0])
