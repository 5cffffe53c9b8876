"""NVMe tensor store: bit-identical spill -> restore on both backends, in-place restore, truncation and
corruption detection, disk full (tmpfs, RLIMIT_FSIZE, a failure midway), atomic replace, many groups."""
import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import warnings
from pathlib import Path

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import memory.nvme_store as ns
from memory.nvme_store import (FILE_ALIGN, IO_ALIGN, TENSOR_ALIGN, CorruptSpill, NvmeStore, NvmeStoreConfig, SpillError,
                               UnknownGroup, read_manifest)

REPO = Path(__file__).resolve().parents[2]
# The same op cache as the Makefile's `make test`, so a plain `pytest` reuses the async_io build (~3 min once).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))

# Small chunks: the 8 MiB tensor spans 32 chunks and small tensors share chunks, so the streaming
# (pieces across chunk boundaries, gaps, tail padding) is exercised, not just one big transfer.
SMALL = dict(chunk_bytes=256 << 10, block_size=64 << 10, queue_depth=4)


@pytest.fixture(scope="session")
def aio_op():
    """Build (once, cached under TORCH_EXTENSIONS_DIR) and load DeepSpeed's async_io op.

    Skipped, with the reason in the -ra summary, only when DeepSpeed says the op cannot be built
    here (libaio-dev missing); a failing build of a compatible op fails the aio tests instead.
    """
    from deepspeed.ops.op_builder import AsyncIOBuilder
    if not AsyncIOBuilder().is_compatible(verbose=False):
        pytest.skip("DeepSpeed async_io is not compatible here (libaio-dev missing): aio backend not tested")
    return ns.load_aio_op()


@pytest.fixture
def disk_dir(tmp_path):
    """A directory that takes O_DIRECT (tmp_path, unless /tmp is tmpfs: then one under the repo's .cache)."""
    if ns.odirect_supported(tmp_path):
        yield tmp_path
        return
    d = Path(tempfile.mkdtemp(prefix="nvme-test-", dir=REPO / ".cache"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(params=["aio", "buffered"])
def backend(request):
    if request.param == "aio":
        request.getfixturevalue("aio_op")
    return request.param


def make_store(directory, backend, **kw) -> NvmeStore:
    store = NvmeStore(directory, NvmeStoreConfig(backend=backend, **{**SMALL, **kw}))
    assert store.backend == backend
    return store


def random_bytes_(t: torch.Tensor, seed: int) -> torch.Tensor:
    """Fill t with random bytes (NaN payloads included for floats: compare bytes, not values)."""
    if t.numel():
        b = t.reshape(-1).view(torch.uint8)
        b.copy_(torch.randint(0, 256, (b.numel(),), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
        if t.dtype == torch.bool:
            b.bitwise_and_(1)  # other bytes are not valid bools (clone() would canonicalize them)
    return t


def mixed_group(seed: int = 0) -> dict[str, torch.Tensor]:
    shapes = {"w_fp32": ((1000, 3), torch.float32), "w_bf16": ((17, 33), torch.bfloat16), "step": ((5,), torch.int64),
              "empty": ((0, 4), torch.float32), "scalar": ((), torch.float64), "mask": ((4097,), torch.bool),
              "odd_u8": ((4095,), torch.uint8), "big": ((2 << 20,), torch.float32)}  # big: [2M] fp32 = 8 MiB
    return {k: random_bytes_(torch.empty(shape, dtype=dt), seed + i)
            for i, (k, (shape, dt)) in enumerate(shapes.items())}


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_bit_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert raw(got[k]) == raw(want[k]), k


def snapshot(group: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in group.items()}


# ---- round trips ------------------------------------------------------------------------------
def test_round_trip_is_bit_identical(disk_dir, backend):
    store = make_store(disk_dir, backend)
    group = mixed_group()
    want = snapshot(group)
    rec = store.spill("opt", group)
    assert_bit_identical(group, want)  # spill only reads
    path = disk_dir / "opt.spill"
    assert rec.path == path and rec.backend == backend and rec.num_tensors == len(group)
    assert rec.payload_bytes == sum(t.numel() * t.element_size() for t in group.values())
    assert rec.file_bytes == path.stat().st_size == store.bytes_on_disk
    # The manifest's checksums are those of the bytes (recomputed here, not trusted).
    m = read_manifest(path)
    assert m.header_bytes % IO_ALIGN == 0 and m.data_bytes % FILE_ALIGN == 0
    data = path.read_bytes()
    for e in m.entries:
        assert e.offset % TENSOR_ALIGN == 0
        on_disk = data[m.header_bytes + e.offset:m.header_bytes + e.offset + e.nbytes]
        assert on_disk == raw(group[e.name]), e.name
        assert e.checksum == xxhash.xxh3_64_intdigest(on_disk), e.name
    del group  # the caller frees its tensors: the file alone brings them back
    assert_bit_identical(store.restore("opt"), want)
    store.check_integrity()
    store.close()


def test_round_trip_with_default_config_and_reading_under_another_config(disk_dir, aio_op):
    store = NvmeStore(disk_dir)  # auto -> aio here (the op loads and the directory takes O_DIRECT)
    assert store.backend == "aio"
    group = mixed_group(seed=7)
    store.spill("master", group)
    assert_bit_identical(store.restore("master"), group)
    store.close()
    # The file does not depend on the writer's chunking or threads: other settings read it back.
    for cfg in (NvmeStoreConfig(backend="buffered", **SMALL), NvmeStoreConfig(backend="aio", threads=16, **SMALL)):
        with NvmeStore(disk_dir, cfg) as other:
            assert_bit_identical(other.restore("master"), group)


def test_groups_without_bytes_round_trip(disk_dir, backend):
    store = make_store(disk_dir, backend)
    empties = {"a": torch.empty(0), "b": torch.empty(3, 0, dtype=torch.bfloat16)}
    for name, group in (("nothing", {}), ("empties", empties)):
        rec = store.spill(name, group)
        assert rec.payload_bytes == 0 and rec.file_bytes == IO_ALIGN  # the header alone
        assert_bit_identical(store.restore(name), group)
    store.check_integrity()


def test_restore_in_place_into_preallocated_tensors(disk_dir, backend):
    store = make_store(disk_dir, backend)
    group = mixed_group()
    store.spill("g", group)
    out = {k: random_bytes_(torch.empty_like(v), 99) for k, v in group.items()}
    ptrs = {k: v.data_ptr() for k, v in out.items()}
    got = store.restore("g", out=out)
    assert all(got[k] is out[k] and got[k].data_ptr() == ptrs[k] for k in out)
    assert_bit_identical(got, group)


def test_restore_in_place_rejects_a_mismatched_out_before_reading(disk_dir, backend):
    store = make_store(disk_dir, backend)
    group = mixed_group()
    store.spill("g", group)
    cases = {"dtype": {**group, "w_bf16": torch.zeros(17, 33, dtype=torch.float16)},
             "shape": {**group, "step": torch.zeros(6, dtype=torch.int64)},
             "missing": {k: v for k, v in group.items() if k != "mask"},
             "extra": {**group, "other": torch.zeros(1)},
             "strided": {**group, "w_fp32": torch.zeros(3, 1000).t()}}
    for why, out in cases.items():
        out = {k: torch.zeros_like(v) for k, v in out.items()}  # keeps the strided one strided
        assert why != "strided" or not out["w_fp32"].is_contiguous()
        before = snapshot(out)
        with pytest.raises(ValueError, match="restore of 'g'"):
            store.restore("g", out=out)
        assert_bit_identical(out, before)  # nothing was read into it


def test_crc32_checksums_round_trip_and_catch_corruption(disk_dir, backend):
    store = make_store(disk_dir, backend, checksum="crc32")
    group = mixed_group()
    store.spill("g", group)
    assert read_manifest(disk_dir / "g.spill").checksum == "crc32"
    assert_bit_identical(store.restore("g"), group)
    flip_byte(disk_dir / "g.spill", "big", 12345)
    with pytest.raises(CorruptSpill, match="'big'"):
        store.restore("g")


# ---- corruption -------------------------------------------------------------------------------
def flip_byte(path: Path, tensor: str, at: int) -> None:
    m = read_manifest(path)
    (e,) = [e for e in m.entries if e.name == tensor]
    with open(path, "r+b") as f:
        f.seek(m.header_bytes + e.offset + at)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize("tensor,at", [("w_bf16", 5), ("big", (8 << 20) - 1), ("scalar", 0)])
def test_one_flipped_byte_is_detected_and_names_the_tensor(disk_dir, backend, tensor, at):
    store = make_store(disk_dir, backend)
    store.spill("g", mixed_group())
    path = disk_dir / "g.spill"
    flip_byte(path, tensor, at)
    with pytest.raises(CorruptSpill, match=f"checksum mismatch in tensor '{tensor}'") as ei:
        store.restore("g")
    assert ei.value.tensor == tensor and ei.value.path == path and str(path) in str(ei.value)


def test_corrupt_header_is_detected(disk_dir, backend):
    store = make_store(disk_dir, backend)
    store.spill("g", mixed_group())
    path = disk_dir / "g.spill"
    with open(path, "r+b") as f:
        f.seek(40)  # inside the manifest JSON
        b = f.read(1)
        f.seek(40)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(CorruptSpill, match="manifest checksum"):
        store.restore("g")
    path.write_bytes(b"not a spill file at all" * 10)
    with pytest.raises(CorruptSpill, match="not a spill file"):
        store.restore("g")


@pytest.mark.parametrize("new_size", ["minus_4k", "minus_1", "header_only", "10_bytes", "plus_4k"])
def test_truncated_or_extended_file_is_detected(disk_dir, backend, new_size):
    store = make_store(disk_dir, backend)
    store.spill("g", mixed_group())
    path = disk_dir / "g.spill"
    size, m = path.stat().st_size, read_manifest(path)
    os.truncate(path, {"minus_4k": size - 4096, "minus_1": size - 1, "header_only": m.header_bytes,
                       "10_bytes": 10, "plus_4k": size + 4096}[new_size])
    with pytest.raises(CorruptSpill, match="truncated|longer than") as ei:
        store.restore("g")  # must raise, not assert inside DeepSpeed or return short data
    assert ei.value.path == path


# ---- failures while spilling ----------------------------------------------------------------------
def assert_failed_cleanly(store: NvmeStore, err: SpillError, name: str, old: dict | None, group: dict, before: dict):
    assert err.name == name and name in str(err) and str(err.path) in str(err)
    assert f"needs {err.bytes_needed} bytes" in str(err) and f"{err.bytes_free} bytes free" in str(err)
    assert not list(store.directory.glob("*.tmp"))
    assert_bit_identical(group, before)  # in-memory state untouched
    if old is None:
        assert name not in store.names() and not (store.directory / f"{name}.spill").exists()
    else:
        assert_bit_identical(store.restore(name), old)  # the previous good spill survives
    store.check_integrity()


def test_failure_midway_keeps_the_previous_spill(disk_dir, backend, monkeypatch):
    """An I/O error on the third chunk (as a full disk would raise it from pwrite) mid-spill."""
    store = make_store(disk_dir, backend)
    old = mixed_group(seed=1)
    store.spill("g", old)
    new = mixed_group(seed=2)
    before = snapshot(new)
    submit, calls = store._io.submit, []

    def failing_submit(write, *a):
        calls.append(write)
        if write and len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        submit(write, *a)

    monkeypatch.setattr(store._io, "submit", failing_submit)
    with pytest.raises(SpillError, match="No space left on device") as ei:
        store.spill("g", new)
    assert_failed_cleanly(store, ei.value, "g", snapshot(old), new, before)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 1 MiB filesystem (root only). Its absence skips only the tmpfs tests, not the RLIMIT one."""
    d = tmp_path / "tmpfs"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); disk full is tested with RLIMIT_FSIZE instead")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=True)


def refuse_op():
    raise RuntimeError("simulated build failure")


@pytest.mark.parametrize("patch,match", [
    (("odirect_supported", lambda d: False), "does not support O_DIRECT"),
    (("can_lock", lambda n: False), "cannot page-lock"),
    (("load_aio_op", refuse_op), "async_io op could not be loaded"),
], ids=["no_odirect", "no_mlock", "op_fails"])
def test_auto_falls_back_to_buffered_loudly_and_aio_refuses(disk_dir, aio_op, monkeypatch, capsys, patch, match):
    monkeypatch.setattr(ns, *patch)
    with pytest.warns(RuntimeWarning, match=match):
        store = NvmeStore(disk_dir, NvmeStoreConfig(backend="auto", **SMALL))
    assert store.backend == "buffered"
    assert "falls back to buffered" in capsys.readouterr().err
    group = mixed_group()
    store.spill("g", group)
    assert_bit_identical(store.restore("g"), group)
    with pytest.raises(RuntimeError, match=f"backend='aio' requested but .*{match}"):
        NvmeStore(disk_dir, NvmeStoreConfig(backend="aio", **SMALL))


def tmpfs_takes_odirect(d: Path) -> bool:
    try:
        fd = os.open(d / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
    except OSError as e:
        assert e.errno == errno.EINVAL
        return False
    os.close(fd)
    os.unlink(d / "probe")
    return True


def test_auto_on_tmpfs_follows_its_odirect_support(small_tmpfs, aio_op):
    """tmpfs refuses O_DIRECT (EINVAL) before Linux 6.6 and takes it since: auto must probe, not assume."""
    takes = tmpfs_takes_odirect(small_tmpfs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = NvmeStore(small_tmpfs, NvmeStoreConfig(backend="auto", **SMALL))
    assert store.backend == ("aio" if takes else "buffered")
    assert any("O_DIRECT" in str(w.message) for w in caught) == (not takes)
    group = {"w": random_bytes_(torch.empty(1000, 7), 3)}
    store.spill("g", group)
    assert_bit_identical(store.restore("g"), group)


@pytest.mark.parametrize("backend_name,stage", [
    ("buffered", "free_space_check"), ("buffered", "fallocate"), ("buffered", "write"),
    ("aio", "free_space_check"), ("aio", "fallocate")])
def test_disk_full_fails_cleanly(small_tmpfs, backend_name, stage, monkeypatch, request):
    """A 1 MiB tmpfs: a 256 KiB group fits, a 2 MiB one does not. Each stage is reached for real by
    disabling the ones before it: the statvfs check, then posix_fallocate, then the data writes.
    (aio is not run without posix_fallocate: DeepSpeed's aio does not report a failed write, which
    is why the store reserves the space first.)"""
    if backend_name == "aio":
        request.getfixturevalue("aio_op")
        if not tmpfs_takes_odirect(small_tmpfs):
            pytest.skip("tmpfs takes no O_DIRECT on this kernel (< 6.6): aio disk full is covered by "
                        "test_file_size_limit_fails_cleanly_in_a_subprocess[aio]")
    store = NvmeStore(small_tmpfs, NvmeStoreConfig(backend=backend_name, **SMALL))
    assert store.backend == backend_name
    old = {"m": random_bytes_(torch.empty(64 << 10), 1)}  # [64K] fp32 = 256 KiB
    store.spill("adam_m", old)
    if stage in ("fallocate", "write"):
        monkeypatch.setattr(ns, "free_bytes", lambda d: 1 << 40)
    if stage == "write":
        monkeypatch.setattr(ns, "reserve", lambda fd, n: None)
    big = {"m": random_bytes_(torch.empty(512 << 10), 2)}  # 2 MiB
    before = snapshot(big)
    for name, prev in (("adam_m", old), ("adam_v", None)):  # replacing a group, and a new one
        with pytest.raises(SpillError, match="not enough free space" if stage == "free_space_check"
                           else "No space left on device") as ei:
            store.spill(name, big)
        assert ei.value.bytes_needed > 2 << 20
        assert_failed_cleanly(store, ei.value, name, snapshot(prev) if prev else None, big, before)
    assert store.names() == ["adam_m"]
    store.close()


RLIMIT_CHILD = textwrap.dedent("""
    import json, resource, sys, torch
    from memory.nvme_store import NvmeStore, NvmeStoreConfig, SpillError
    directory, backend = sys.argv[1], sys.argv[2]
    store = NvmeStore(directory, NvmeStoreConfig(backend=backend, chunk_bytes=256 << 10, block_size=64 << 10))
    small = {"w": torch.arange(32 << 10, dtype=torch.float32)}        # 128 KiB
    store.spill("g", small)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))     # files may not pass 1 MiB from here
    big = {"w": torch.arange(1 << 20, dtype=torch.float32)}           # 4 MiB
    out = {"backend": store.backend}
    try:
        store.spill("g", big)
        out["error"] = None
    except SpillError as e:
        out.update(error=str(e), needed=e.bytes_needed)
    out["big_intact"] = bool(torch.equal(big["w"], torch.arange(1 << 20, dtype=torch.float32)))
    out["restored_old"] = bool(torch.equal(store.restore("g")["w"], small["w"]))
    print("RESULT " + json.dumps(out))
""")


def test_file_size_limit_fails_cleanly_in_a_subprocess(disk_dir, backend):
    """RLIMIT_FSIZE (EFBIG) on a real disk directory: needs no root, and reaches the aio backend too."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", RLIMIT_CHILD, str(disk_dir), backend], capture_output=True, text=True,
                       env=env, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    out = json.loads(line.removeprefix("RESULT "))
    assert out["backend"] == backend
    assert out["error"] and "File too large" in out["error"] and "'g'" in out["error"] and out["needed"] > 4 << 20
    assert out["big_intact"] and out["restored_old"]
    assert not list(disk_dir.glob("*.tmp"))


# ---- many groups, names, restart ------------------------------------------------------------------
def test_named_groups_coexist_and_threads_can_spill_concurrently(disk_dir, backend):
    store = make_store(disk_dir, backend)
    groups = {name: mixed_group(seed=10 * i) for i, name in enumerate(["master", "adam_m", "adam_v"])}
    errors = []

    def spill(name):
        try:
            store.spill(name, groups[name])
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=spill, args=(n,)) for n in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert store.names() == sorted(groups)
    assert store.bytes_on_disk == sum((disk_dir / f"{n}.spill").stat().st_size for n in groups)
    store.drop("adam_m")
    assert store.names() == ["adam_v", "master"] and not (disk_dir / "adam_m.spill").exists()
    for name in ("master", "adam_v"):
        assert_bit_identical(store.restore(name), groups[name])
    store.check_integrity()
    # A new store over the same directory (a restarted run) finds the groups and drops stale temp files.
    store.close()
    (disk_dir / "crashed.tmp").write_bytes(b"partial")
    again = make_store(disk_dir, backend)
    assert again.names() == ["adam_v", "master"] and not (disk_dir / "crashed.tmp").exists()
    assert_bit_identical(again.restore("master"), groups["master"])
    again.check_integrity()


def test_unknown_group_is_a_clear_error(disk_dir, backend):
    store = make_store(disk_dir, backend)
    store.spill("master", {"w": torch.ones(3)})
    with pytest.raises(UnknownGroup, match=r"no group 'adam_m' .*\['master'\]"):
        store.restore("adam_m")
    with pytest.raises(KeyError):
        store.drop("adam_m")


def test_bad_inputs_are_rejected_before_writing(disk_dir):
    store = NvmeStore(disk_dir, NvmeStoreConfig(backend="buffered", **SMALL))
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        store.spill("g", {"w": torch.zeros(4, 3).t()})
    with pytest.raises(ValueError, match="group name"):
        store.spill("../escape", {"w": torch.zeros(1)})
    with pytest.raises(TypeError, match="str -> Tensor"):
        store.spill("g", {"w": [1, 2, 3]})
    assert store.names() == [] and [p.name for p in disk_dir.iterdir()] == [ns.LOCK_FILE]  # only the lock
    for bad in (dict(backend="nvme"), dict(block_size=1000), dict(threads=3), dict(chunk_bytes=100 << 10),
                dict(checksum="md5"), dict(queue_depth=0)):
        with pytest.raises(ValueError):
            NvmeStoreConfig(**bad)


# ---- the chunk plan (pure) --------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 300_000), max_size=8), chunk_kib=st.sampled_from([64, 128, 192, 1024]))
def test_chunk_plan_covers_every_tensor_byte_exactly_once(sizes, chunk_kib):
    tensors = {f"t{i}": torch.empty(n, dtype=torch.uint8) for i, n in enumerate(sizes)}
    m = ns.spill_layout("g", tensors, "crc32")
    chunks = ns.spill_chunks(m, chunk_kib << 10)
    assert sum(c.nbytes for c in chunks) == m.data_bytes and m.data_bytes % FILE_ALIGN == 0
    seen = {i: 0 for i in range(len(sizes))}  # next expected byte of each tensor (order is file order)
    for c in chunks:
        assert c.nbytes % FILE_ALIGN == 0 or c is chunks[-1]
        end = 0
        for i, off_t, off_c, n in c.pieces:
            assert n > 0 and off_c >= end and off_c + n <= c.nbytes
            assert off_t == seen[i] and m.entries[i].offset + off_t == c.offset + off_c
            seen[i] += n
            end = off_c + n
    assert [seen[i] for i in range(len(sizes))] == sizes
