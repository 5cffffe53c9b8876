"""Worker of the 2-process page-transfer test (spawned; must stay importable as a module).

TP-1 pages on process 0 -> TP-2 pages on processes 0 and 1 -> TP-1 pages on process 1, over gloo.
"""
import os

import torch
import torch.distributed as dist

from memory.layout import CacheLayout
from memory.tp_reshard import transfer_pages
from tests.memory.test_tp_reshard import SENTINEL, TINY, filled_pool, sentinel_pool


def run(rank: int, world: int, init_file: str, out_dir: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        full = CacheLayout.for_model(TINY)
        half = full.shard(2)
        out: dict = {}
        # process 0 holds the TP-1 pages (random bytes); the shard pools start at SENTINEL with
        # ids that differ per process (rank + 1 decoy pages allocated first)
        src_pool, src_ids = filled_pool(full, seed=11) if rank == 0 else (None, {})
        mid_pool, mid_ids = sentinel_pool(half, num_decoys=rank + 1)
        back_pool, back_ids = sentinel_pool(full, num_decoys=2) if rank == 1 else (None, {})
        if rank == 0:
            out["original"] = src_pool.read_pages(src_ids["kda"] + src_ids["mla"])
        for kind in ("kda", "mla"):
            out[f"forward_{kind}"] = transfer_pages(
                kind, full, half, src_ranks=[0], dst_ranks=[0, 1], src_pool=src_pool,
                src_pages=src_ids.get(kind, ()), dst_pool=mid_pool, dst_pages=mid_ids[kind]).__dict__
            out[f"back_{kind}"] = transfer_pages(
                kind, half, full, src_ranks=[0, 1], dst_ranks=[1], src_pool=mid_pool, src_pages=mid_ids[kind],
                dst_pool=back_pool, dst_pages=back_ids.get(kind, ())).__dict__
        out["shard"] = mid_pool.read_pages(mid_ids["kda"] + mid_ids["mla"])
        if rank == 1:
            out["round_trip"] = back_pool.read_pages(back_ids["kda"] + back_ids["mla"])
        for pool in (src_pool, mid_pool, back_pool):
            if pool is not None:
                pool.check_integrity()
        out["sentinel"] = SENTINEL
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
