"""Prefix cache on a synthetic agentic trace: hits vs the oracle, vs the classic block-hash baseline.

    python -m benchmarks.prefix_cache [--sessions 12] [--turns 4] [--hash-block 8]

Trace (seeded): every session starts with the same system prompt and tool text, then alternates
user text and the model's greedy answers; sessions start one round apart and run interleaved (each
round, every live session submits its next turn: the whole conversation so far, turn boundaries
marked). The same trace runs three times on the tiny model: our cache (hash block `--hash-block`
inside 64-token pages: the 1:8 ratio of 512-token hash blocks in 4,096-token pages), the classic
baseline (hash granularity = the physical page), and no cache.
Oracle, per request: the longest prefix shared with any request finished in an earlier round,
rounded down to the hash block, leaving at least one token to compute.
With `--small-pages`, our cache runs again in a pool too small for the trace, once with turn-aware
eviction (turn-boundary checkpoints and the pages under them go last) and once with plain LRU.
Final line: hit_vs_oracle=... baseline_hit_vs_oracle=... prefill_tokens_vs_nocache=... hash_block=...
block_tokens=... small_pool_hit_vs_oracle_turn_aware=... small_pool_hit_vs_oracle_lru=...
"""
from __future__ import annotations

import argparse
import random

from benchmarks import parse_args
from models.config import load_model_config
from models.model import HybridLM
from rollout.engine import Engine, EngineConfig
from rollout.kv import PrefixCacheConfig
from rollout.sampling import SamplingParams


def make_trace(sessions: int, turns: int, seed: int) -> tuple[list[int], list[list[list[int]]]]:
    rng = random.Random(seed)
    system = [rng.randrange(256) for _ in range(150)] + [rng.randrange(256) for _ in range(60)]  # prompt + tools
    users = [[[rng.randrange(256) for _ in range(rng.randint(8, 40))] for _ in range(turns)] for _ in range(sessions)]
    return system, users


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def run(model: HybridLM, system: list[int], users, hash_block: int | None, new_tokens: int, pages: int,
        eviction: str = "turn_aware", host_pages: int = 0, host_mode: str = "write_back"):
    """The trace through one engine; returns (engine, [(prompt, oracle prefix)], hit tokens, tokens computed)."""
    cache = (PrefixCacheConfig(hash_block=hash_block, model_id="tiny", eviction=eviction, host_mode=host_mode)
             if hash_block else None)
    cfg = EngineConfig.for_pages(model, pages, host_pages=host_pages, max_model_len=1024, max_num_batched_tokens=512,
                                 prefix_cache=cache)
    engine = Engine(model, cfg)
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    history = [list(system) for _ in users]
    boundaries = [[len(system)] for _ in users]
    seen: list[list[int]] = []  # conversations finished in earlier rounds
    requests = []  # (prompt, oracle prefix length before rounding)
    computed = 0
    turns = len(users[0])
    for r in range(len(users) + turns - 1):
        live = [s for s in range(len(users)) if s <= r < s + turns]
        ids = {}
        for s in live:
            history[s] += users[s][r - s]
            boundaries[s].append(len(history[s]))
            best = max((common_prefix(history[s], old) for old in seen), default=0)
            requests.append((list(history[s]), min(best, len(history[s]) - 1)))
            ids[s] = engine.add_request(history[s], params, turn_boundaries=boundaries[s])
        done = {}
        while len(done) < len(ids):
            for out in engine.step():
                done[out.request_id] = out
        for s, rid in ids.items():
            history[s] += done[rid].samples[0].tokens
            boundaries[s].append(len(history[s]))
            seen.append(list(history[s]))
        computed = engine.num_computed_tokens
    prefix = engine.cache.prefix
    return engine, requests, (prefix.hit_tokens if prefix else 0), computed


def trace_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The trace's options (shared with benchmarks/kv_pool.py)."""
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--hash-block", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = trace_arguments(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    p.add_argument("--pages", type=int, default=2000, help="pool pages (large: nothing evicted)")
    p.add_argument("--small-pages", type=int, default=48,
                   help="pool pages of the eviction comparison (turn-aware vs LRU); 0 skips it")
    args = parse_args(p, argv, quick={"sessions": 4, "turns": 3, "small_pages": 24})
    model = HybridLM(load_model_config("configs/model/tiny.yaml")).init_weights(seed=args.seed, std=0.1).eval()
    system, users = make_trace(args.sessions, args.turns, args.seed)
    ours, requests, hits, computed = run(model, system, users, args.hash_block, args.new_tokens, args.pages)
    block_tokens = ours.layout.block_tokens
    _, _, base_hits, base_computed = run(model, system, users, block_tokens, args.new_tokens, args.pages)
    _, _, _, plain_computed = run(model, system, users, None, args.new_tokens, args.pages)
    oracle = sum(best // args.hash_block * args.hash_block for _, best in requests)
    generated = len(requests) * (args.new_tokens - 1)  # decode steps compute the previous sampled token
    figures = {
        "hit_vs_oracle": hits / oracle if oracle else 1.0,
        "baseline_hit_vs_oracle": base_hits / oracle if oracle else 1.0,
        "prefill_tokens_vs_nocache": (computed - generated) / (plain_computed - generated),
        "hash_block": args.hash_block, "block_tokens": block_tokens,
    }
    if args.small_pages:  # a pool too small for the trace: which cached pages should go first?
        for policy in ("turn_aware", "lru"):
            _, _, small_hits, _ = run(model, system, users, args.hash_block, args.new_tokens, args.small_pages, policy)
            figures[f"small_pool_hit_vs_oracle_{policy}"] = small_hits / oracle if oracle else 1.0
    print(f"{len(requests)} requests, {sum(len(q) for q, _ in requests)} prompt tokens; oracle {oracle} reusable, "
          f"ours hit {hits}, classic (hash = {block_tokens}-token page) hit {base_hits}; prefill tokens computed: "
          f"ours {computed - generated}, classic {base_computed - generated}, no cache {plain_computed - generated}")
    print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items()))
    return figures


if __name__ == "__main__":
    main()
