"""The spill file format of the NVMe store (memory/nvme_store.py): layout, manifest, checksums.

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

`spill_layout` lays a group out (checksums still zero), `spill_header_bytes` encodes the header once the
checksums are known, `read_manifest` parses and verifies one, and `spill_chunks` cuts the data region
into the staging-buffer-sized transfers the I/O path (memory/nvme_io.py) moves.
"""
from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

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
_MAX_MANIFEST_BYTES = 256 << 20
CHECKSUMS = ("xxh3_64", "crc32")


class CorruptSpill(RuntimeError):
    """A spill file is truncated, corrupted or not ours; `tensor` names the culprit when known."""

    def __init__(self, msg: str, *, path: Path, tensor: str | None = None) -> None:
        super().__init__(msg)
        self.path, self.tensor = path, tensor


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


# ---- checksums ----------------------------------------------------------------------------------
class _Crc32:
    def __init__(self) -> None:
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def intdigest(self) -> int:
        return self.value


def new_hasher(algo: str):
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


def spill_layout(name: str, tensors: dict[str, torch.Tensor], checksum: str) -> Manifest:
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


def spill_header_bytes(m: Manifest) -> bytes:
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


def spill_chunks(m: Manifest, chunk_bytes: int) -> list[_Chunk]:
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

