"""The multiplexed case of benchmarks/kv_pool.py: host DRAM shared in time by the training states and
the host KV pool, KV kept across iterations through NVMe.

Real components on the tiny model: one host ledger (`--budget-mb`), a Trainer whose host states
lease from it, an Engine on the policy's own weights with `host_pool_mb="auto"`, a device pool of
`--mux-pages` (one rollout's working set: it is released between rollouts anyway, so what the next
iteration hits crossed the update on the host and NVMe), the prefix cache with stale reuse, an NvmeStore in a temporary directory. Two iterations
of the agentic trace of benchmarks/prefix_cache.py, as the phase orchestrator runs them:
    offload states -> host_in (the pool leases what the ledger has free) -> rollout 1 (every session's
    first turns) -> sleep -> host_out (pool contents to NVMe) -> restore states -> "update" (the
    weights move) -> offload -> host_in (contents read back) -> wake -> rollout 2 (each session's
    continuation: its conversation so far plus a new user turn).
Figures: host_pool_bytes_vs_budget_minus_states = the pool's lease during a rollout over (budget -
the training states' bytes): the pool really uses the DRAM the spill freed; and
kv_kept_across_iterations_hit = rollout 2's prefix hit tokens over the reusable ones (each
continuation's previous conversation, rounded down to the hash block).
"""
from __future__ import annotations

import argparse
import tempfile

import torch

from benchmarks.prefix_cache import make_trace
from memory.host_ledger import HostLedger
from memory.nvme_store import NvmeStore, NvmeStoreConfig
from models.model import HybridLM
from rollout.engine import Engine, EngineConfig
from rollout.kv import PrefixCacheConfig
from rollout.sampling import SamplingParams
from trainer.step import Trainer, TrainerConfig


def multiplex_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--budget-mb", type=int, default=48, help="host ledger budget of the multiplexed case, MiB")
    p.add_argument("--first-turns", type=int, default=2, help="turns per session in rollout 1 (the rest: rollout 2)")
    p.add_argument("--mux-pages", type=int, default=160,
                   help="device pool pages of the multiplexed case: one rollout's working set (device-pool "
                        "pressure within a rollout is the other cases' subject; between rollouts the pool is released)")
    return p


def _rollout(engine: Engine, histories, boundaries, turns, params) -> None:
    """One turn per session, every session at once: append its user turn, generate, append the answer."""
    ids = {}
    for s, user in turns.items():
        histories[s] += user
        boundaries[s].append(len(histories[s]))
        ids[s] = engine.add_request(histories[s], params, turn_boundaries=boundaries[s])
    done = {}
    while len(done) < len(ids):
        done.update((o.request_id, o) for o in engine.step())
    for s, rid in ids.items():
        histories[s] += done[rid].samples[0].tokens
        boundaries[s].append(len(histories[s]))


def multiplexed(model: HybridLM, args: argparse.Namespace) -> dict[str, float]:
    budget = args.budget_mb << 20
    ledger = HostLedger(budget_bytes=budget)
    trainer = Trainer(model, TrainerConfig(), ledger=ledger)
    states = ledger.held("train_states")
    cache = PrefixCacheConfig(hash_block=args.hash_block, model_id="tiny", reuse_stale=True)
    engine = Engine(model, EngineConfig.for_pages(model, args.mux_pages, host_pool_mb="auto", max_model_len=1024,
                                                  max_num_batched_tokens=512, prefix_cache=cache),
                    ledger=ledger)
    system, users = make_trace(args.sessions, args.turns, args.seed)
    histories, boundaries = [list(system) for _ in users], [[len(system)] for _ in users]
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    page_bytes = engine.layout.page_bytes
    with tempfile.TemporaryDirectory() as tmp, NvmeStore(tmp, NvmeStoreConfig(fsync=False)) as store:
        trainer.offload_states(store)
        engine.cache.restore_host(store, [], ledger.free // page_bytes)
        pool_bytes = engine.host.pool_bytes
        engine.weights_updated(1)
        for t in range(args.first_turns):
            _rollout(engine, histories, boundaries, {s: u[t] for s, u in enumerate(users)}, params)
        engine.sleep()
        kept = engine.cache.spill_host(store, [], next_version=2, max_staleness=1)
        trainer.restore_states()  # the states come back into the DRAM the pool returned
        with torch.no_grad():  # the update: new weights, so the kept prefixes are one version stale
            for p in model.parameters():
                p.mul_(1.0 + 1e-3)
        trainer.offload_states(store)
        read = engine.cache.restore_host(store, [], ledger.free // page_bytes)
        engine.wake()
        engine.weights_updated(2)
        hits_before = engine.cache.prefix.hit_tokens
        reusable = sum(len(h) // args.hash_block * args.hash_block for h in histories)
        _rollout(engine, histories, boundaries, {s: u[args.first_turns] for s, u in enumerate(users)}, params)
        hits = engine.cache.prefix.hit_tokens - hits_before
        stale = engine.cache.prefix.stale_hit_tokens
    print(f"multiplexed: budget {budget:,} B, training states {states:,} B, host pool leased {pool_bytes:,} B "
          f"during rollout; {kept:,} B of KV kept on NVMe over the update ({read:,} B read back); rollout 2 hit "
          f"{hits} of {reusable} reusable tokens ({stale} stale)", flush=True)
    return {"host_pool_bytes_vs_budget_minus_states": pool_bytes / (budget - states),
            "kv_kept_across_iterations_hit": hits / reusable if reusable else 1.0,
            "kv_kept_bytes": kept, "host_pool_bytes_multiplexed": pool_bytes, "train_state_bytes": states}
