"""NVMe tensor store vs the raw disk: spill + restore of `--gib` GiB of training state.

    python -m benchmarks.nvme [--gib 2] [--dir .cache/nvme_bench] [--rounds 3]

Each round, in the same directory: `dd` writes `--gib` GiB from /dev/zero with oflag=direct
(conv=fsync) and reads it back with iflag=direct, bs = the store's chunk size (the disk's
sequential bandwidth, one large request at a time); and the store spills the same number of
bytes as three groups shaped like master weights + two Adam moments (fp32, random bytes,
tensors of uneven sizes) and restores them in place into the zeroed tensors. Timings include
checksums, fsyncs and renames; the two sides alternate which goes first. The page cache is
dropped before each read when permitted (root); otherwise reads still bypass it (O_DIRECT), said
so. Each side's fastest round counts; the restored bytes are checked against digests taken before
the spill. Files are removed at the end.
Final line (ratios first):
write_vs_disk=... read_vs_disk=... backend=... write_gib_s=... read_gib_s=... disk_write_gib_s=... disk_read_gib_s=...
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import time
from pathlib import Path

import torch
import xxhash

from benchmarks import parse_args
from memory.nvme_store import NvmeStore, NvmeStoreConfig

# Same op cache as the Makefile, so running this outside `make` does not rebuild async_io (~3 min).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions"))

GROUPS = {"master": 1 / 3, "adam_m": 1 / 3, "adam_v": 1 / 3}
SHARES = (0.40, 0.25, 0.15, 0.10, 0.06, 0.04)  # uneven tensor sizes inside a group (+ a few odd small ones)


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def fs_type(directory: Path) -> str:
    out = subprocess.run(["stat", "-f", "-c", "%T", str(directory)], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def dd_round(directory: Path, total_bytes: int, bs: int) -> tuple[float, float]:
    """(write_s, read_s) of dd with direct I/O over total_bytes."""
    f = directory / "dd.bin"
    count = total_bytes // bs
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={f}", f"bs={bs}", f"count={count}", "oflag=direct", "conv=fsync"],
                   check=True, capture_output=True)
    write_s = time.perf_counter() - t0
    drop_page_cache()
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={f}", "of=/dev/null", f"bs={bs}", "iflag=direct"], check=True, capture_output=True)
    read_s = time.perf_counter() - t0
    f.unlink()
    return write_s, read_s


def make_groups(total_bytes: int) -> dict[str, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    groups = {}
    for g, frac in GROUPS.items():
        numel = int(total_bytes * frac) // 4
        sizes = [int(numel * s) for s in SHARES] + [4099, 1, 777]
        sizes[0] += numel - sum(sizes)
        tensors = {}
        for i, n in enumerate(sizes):
            t = torch.empty(n, dtype=torch.float32)  # [n] fp32, filled with random bytes
            t.view(torch.uint8).copy_(torch.randint(0, 256, (n * 4,), dtype=torch.uint8, generator=gen))
            tensors[f"layer{i}.weight"] = t
        groups[g] = tensors
    return groups


def digest(t: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(t.view(torch.uint8).numpy())


def store_round(store: NvmeStore, groups: dict[str, dict[str, torch.Tensor]]) -> tuple[float, float]:
    """(spill_s, restore_s) of every group; restores in place into the zeroed tensors and checks them."""
    before = {(g, k): digest(t) for g, ts in groups.items() for k, t in ts.items()}
    t0 = time.perf_counter()
    for g, ts in groups.items():
        store.spill(g, ts)
    spill_s = time.perf_counter() - t0
    for ts in groups.values():
        for t in ts.values():
            t.zero_()
    drop_page_cache()
    t0 = time.perf_counter()
    for g, ts in groups.items():
        store.restore(g, out=ts)
    restore_s = time.perf_counter() - t0
    bad = [key for key, d in before.items() if digest(groups[key[0]][key[1]]) != d]
    if bad:
        raise SystemExit(f"restored bytes differ from the spilled ones: {bad}")
    for g in groups:
        store.drop(g)
    store.check_integrity()
    return spill_s, restore_s


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--dir", default=".cache/nvme_bench", help="a directory on the disk to measure (not tmpfs)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--backend", default="auto", choices=("auto", "aio", "buffered"))
    p.add_argument("--block-size-kib", type=int, default=NvmeStoreConfig.block_size >> 10)
    p.add_argument("--queue-depth", type=int, default=NvmeStoreConfig.queue_depth)
    p.add_argument("--threads", type=int, default=NvmeStoreConfig.threads)
    p.add_argument("--chunk-mib", type=int, default=NvmeStoreConfig.chunk_bytes >> 20)
    args = parse_args(p, argv, quick={"gib": 0.25, "rounds": 1})

    cfg = NvmeStoreConfig(backend=args.backend, block_size=args.block_size_kib << 10, queue_depth=args.queue_depth,
                          threads=args.threads, chunk_bytes=args.chunk_mib << 20)
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    total = int(args.gib * 2**30) // cfg.chunk_bytes * cfg.chunk_bytes
    free = shutil.disk_usage(directory).free
    if free < 1.2 * total:
        raise SystemExit(f"{directory}: {free / 2**30:.1f} GiB free, the benchmark needs {1.2 * total / 2**30:.1f}")
    fs = fs_type(directory)
    print(f"dir {directory.resolve()} ({fs}), {total / 2**30:.2f} GiB, {args.rounds} rounds, config {cfg}")
    if fs == "tmpfs":
        print("warning: tmpfs is memory, not a disk: the comparison means nothing here")
    if not drop_page_cache():
        print("page cache cannot be dropped here (not root?): reads rely on O_DIRECT to bypass it "
              "(dd iflag=direct, aio); the buffered backend would read from the cache")

    groups = make_groups(total)
    payload = sum(t.numel() * 4 for ts in groups.values() for t in ts.values())
    probe = groups["master"]["layer0.weight"].view(torch.uint8)[:256 << 20].numpy()
    t0 = time.perf_counter()
    xxhash.xxh3_64_intdigest(probe)
    print(f"checksum {cfg.checksum} alone: {len(probe) / (time.perf_counter() - t0) / 2**30:.2f} GiB/s on one core")

    disk_w, disk_r, ours_w, ours_r = [], [], [], []
    with NvmeStore(directory / "store", cfg) as store:
        for r in range(args.rounds):
            for side in ("dd", "store") if r % 2 == 0 else ("store", "dd"):  # alternate who goes first
                if side == "dd":
                    w_s, r_s = dd_round(directory, total, cfg.chunk_bytes)
                    disk_w.append(total / w_s / 2**30)
                    disk_r.append(total / r_s / 2**30)
                else:
                    s_s, l_s = store_round(store, groups)
                    ours_w.append(payload / s_s / 2**30)
                    ours_r.append(payload / l_s / 2**30)
            print(f"round {r}: dd write {disk_w[-1]:.2f} read {disk_r[-1]:.2f} GiB/s | store ({store.backend}) "
                  f"spill {ours_w[-1]:.2f} restore {ours_r[-1]:.2f} GiB/s", flush=True)
        backend = store.backend
    shutil.rmtree(directory / "store", ignore_errors=True)
    w, rd, dw, dr = max(ours_w), max(ours_r), max(disk_w), max(disk_r)
    print(f"write_vs_disk={w / dw:.2f} read_vs_disk={rd / dr:.2f} backend={backend} write_gib_s={w:.2f} "
          f"read_gib_s={rd:.2f} disk_write_gib_s={dw:.2f} disk_read_gib_s={dr:.2f}")


if __name__ == "__main__":
    main()
