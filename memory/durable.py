"""Making files survive power loss, and telling whether they did.

A write reaches the disk only once it is fsynced, and a new or renamed directory entry only once
its *directory* is fsynced (rename(2) is atomic but not durable; see the ext4 `auto_da_alloc`
notes and LWN's "Ensuring data reaches disk"). So a durable publish is: write every file, fsync
every file, fsync every directory bottom-up, rename into place, fsync the parent.

`file_digest` streams a file in 4 MiB blocks through xxh3_64 (the xxhash package, ~20 GB/s here)
or, without it, zlib's crc32 (~4 GB/s); the digest names its algorithm (`"xxh3_64:1f..."`), so a
file digested with one is checked with the same one.
"""
from __future__ import annotations

import os
import secrets
import zlib
from pathlib import Path

try:
    import xxhash
except ImportError:  # optional: crc32 from the standard library instead
    xxhash = None

BLOCK_BYTES = 4 << 20
DIGESTS = ("xxh3_64", "crc32")
DEFAULT_DIGEST = "xxh3_64" if xxhash is not None else "crc32"


def fsync_file(path: str | os.PathLike) -> None:
    """Flush `path`'s data and metadata to the disk (its directory entry is `fsync_dir`'s job)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush directory `path`'s entries (files created, renamed or removed in it) to the disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> int:
    """fsync every regular file under `root`, then every directory bottom-up (`root` last), so each
    entry is durable after what it names. Symlinks are not followed. Returns the files synced."""
    num_files = 0
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            path = os.path.join(dirpath, name)
            if os.path.isfile(path) and not os.path.islink(path):
                fsync_file(path)
                num_files += 1
        fsync_dir(dirpath)
    return num_files


def file_digest(path: str | os.PathLike, algo: str = DEFAULT_DIGEST) -> str:
    """`"<algo>:<hex>"` of the file's bytes, read in 4 MiB blocks (memory stays flat)."""
    if algo not in DIGESTS:
        raise ValueError(f"digest algorithm {algo!r}, expected one of {DIGESTS}")
    if algo == "xxh3_64" and xxhash is None:
        raise ValueError("digest xxh3_64 needs the xxhash package (not installed)")
    h = xxhash.xxh3_64() if algo == "xxh3_64" else None
    crc = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(BLOCK_BYTES)
        view = memoryview(buf)
        while n := f.readinto(buf):
            if h is not None:
                h.update(view[:n])
            else:
                crc = zlib.crc32(view[:n], crc)
    return f"{algo}:{h.hexdigest() if h is not None else f'{crc:08x}'}"


def digest_algo(digest: str) -> str:
    """The algorithm a `file_digest` result names (ValueError for anything else)."""
    algo, sep, value = digest.partition(":")
    if not sep or algo not in DIGESTS or not value:
        raise ValueError(f"digest {digest!r}, expected '<algo>:<hex>' with algo one of {DIGESTS}")
    return algo


def temp_path(path: str | os.PathLike) -> Path:
    """A temporary name beside `path` for an atomic rename onto it, unique to this process and call:
    two writers (two runs racing on one file, or two threads) never write the same temporary file."""
    path = Path(path)
    return path.with_name(f"{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def write_durable(path: str | os.PathLike, data: bytes) -> None:
    """Replace `path` with `data` atomically and durably: a temp file beside it (`temp_path`), fsynced,
    renamed over it, the directory fsynced. A crash leaves the old content or the new, never a mix."""
    path = Path(path)
    tmp = temp_path(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
