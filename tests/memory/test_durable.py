"""memory/durable.py: fsync of files and directories (order and coverage), streamed digests equal
one-shot reference digests, durable replace."""
import os
import re
import zlib

import pytest

from memory import durable


def _record_fsyncs(monkeypatch) -> list[str]:
    """Paths fsynced, in order (the fd's path at the time of the call, from /proc/self/fd)."""
    synced: list[str] = []
    real_fsync = os.fsync

    def fake_fsync(fd):
        real_fsync(fd)
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))

    monkeypatch.setattr(os, "fsync", fake_fsync)
    return synced


def test_fsync_tree_syncs_every_file_then_directories_bottom_up(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    (root / "a" / "b").mkdir(parents=True)
    files = [root / "x.pt", root / "a" / "y.json", root / "a" / "b" / "z.bin"]
    for i, f in enumerate(files):
        f.write_bytes(bytes([i]) * (i + 1))
    (root / "link").symlink_to(files[0])
    synced = _record_fsyncs(monkeypatch)
    assert durable.fsync_tree(root) == 3
    assert sorted(s for s in synced if os.path.isfile(s)) == sorted(map(str, files))
    dirs = [s for s in synced if os.path.isdir(s)]
    assert dirs == [str(root / "a" / "b"), str(root / "a"), str(root)], "directories bottom-up, root last"
    for f in files:  # a file is synced before the directory that names it
        assert synced.index(str(f)) < synced.index(str(f.parent))


def test_fsync_file_and_dir_reach_os_fsync(tmp_path, monkeypatch):
    f = tmp_path / "f"
    f.write_bytes(b"x")
    synced = _record_fsyncs(monkeypatch)
    durable.fsync_file(f)
    durable.fsync_dir(tmp_path)
    assert synced == [str(f), str(tmp_path)]
    with pytest.raises(NotADirectoryError):
        durable.fsync_dir(f)


@pytest.mark.parametrize("algo", durable.DIGESTS)
@pytest.mark.parametrize("size", [0, 1, 63, 4096, 3 * 1000 + 17])
def test_streamed_digest_equals_one_shot_reference(tmp_path, monkeypatch, algo, size):
    if algo == "xxh3_64" and durable.xxhash is None:
        pytest.skip("xxhash not installed")
    monkeypatch.setattr(durable, "BLOCK_BYTES", 1000)  # several blocks, a partial last one
    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    want = (f"xxh3_64:{durable.xxhash.xxh3_64(data).hexdigest()}" if algo == "xxh3_64"
            else f"crc32:{zlib.crc32(data):08x}")
    assert durable.file_digest(tmp_path / "f", algo) == want
    assert durable.digest_algo(want) == algo


def test_digest_sees_a_zeroed_block_and_a_flipped_bit(tmp_path):
    data = bytearray(os.urandom(10_000))
    (tmp_path / "f").write_bytes(data)
    before = durable.file_digest(tmp_path / "f")
    data[5000] ^= 1
    (tmp_path / "f").write_bytes(data)
    flipped = durable.file_digest(tmp_path / "f")
    (tmp_path / "f").write_bytes(bytes(len(data)))
    assert len({before, flipped, durable.file_digest(tmp_path / "f")}) == 3


def test_bad_digest_names_are_refused(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(ValueError, match="'md5'"):
        durable.file_digest(tmp_path / "f", "md5")
    for bad in ("deadbeef", "md5:00", "crc32:"):
        with pytest.raises(ValueError, match="expected '<algo>:<hex>'"):
            durable.digest_algo(bad)


def test_write_durable_replaces_atomically_and_syncs_file_then_directory(tmp_path, monkeypatch):
    target = tmp_path / "latest"
    target.write_text("old")
    synced = _record_fsyncs(monkeypatch)
    durable.write_durable(target, b"iter_000002")
    assert target.read_bytes() == b"iter_000002" and sorted(p.name for p in tmp_path.iterdir()) == ["latest"]
    # the temp file's data is synced before the rename, the directory after it
    assert synced[-1] == str(tmp_path) and any(
        re.search(rf"/latest\.tmp-{os.getpid()}-[0-9a-f]{{8}}$", s) for s in synced[:-1])  # a name unique to this writer
