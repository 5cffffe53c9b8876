"""Host KV pool on an agentic trace whose working set does not fit the device pool.

    python -m benchmarks.kv_pool [--pages 40] [--host-pages 2000] [--sessions 12] [--turns 4]

The trace of benchmarks/prefix_cache.py (shared system prompt and tools, sessions interleaved,
every turn the whole conversation so far) runs on the tiny model four times, same device pool:
- write-back: the prefix cache's evictions go to the host pool, and hits there are prefetched;
- write-through (the baseline): every registered page is also copied to the host when registered
  (again as its registered end advances), so eviction finds it there;
- no host pool: evicted prefixes are gone and re-prefilled;
- a device pool large enough for everything (the oracle's reference for hits).
Then the multiplexed case (benchmarks/kv_multiplex.py): host DRAM shared in time by the training
states and an `auto` host pool, KV kept across two iterations through NVMe.
Final line: host_pool_bytes_vs_budget_minus_states=... kv_kept_across_iterations_hit=...
wb_copy_bytes_vs_wt=... reprefill_tokens_wb_vs_none=... hit_vs_oracle_wb=... (then the raw figures). Copy bytes are device -> host bytes; re-prefill tokens are prompt tokens computed
beyond what the large pool computed.
"""
from __future__ import annotations

import argparse

from benchmarks import parse_args
from benchmarks.kv_multiplex import multiplex_arguments, multiplexed
from benchmarks.prefix_cache import make_trace, run, trace_arguments
from models.config import load_model_config
from models.model import HybridLM


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = multiplex_arguments(trace_arguments(argparse.ArgumentParser(description=__doc__.split("\n")[0])))
    p.add_argument("--pages", type=int, default=40, help="device pool pages (too few for the working set)")
    p.add_argument("--host-pages", type=int, default=2000)
    args = parse_args(p, argv, quick={"sessions": 4, "turns": 3, "pages": 24})
    model = HybridLM(load_model_config("configs/model/tiny.yaml")).init_weights(seed=args.seed, std=0.1).eval()
    system, users = make_trace(args.sessions, args.turns, args.seed)
    common = (model, system, users, args.hash_block, args.new_tokens)
    results = {}
    runs = (("large", 4000, 0, "write_back"), ("wb", args.pages, args.host_pages, "write_back"),
            ("wt", args.pages, args.host_pages, "write_through"), ("none", args.pages, 0, "write_back"))
    for name, pages, host, mode in runs:
        engine, requests, hits, computed = run(*common, pages, host_pages=host, host_mode=mode)
        prefix = engine.cache.prefix
        results[name] = {"hits": hits, "computed": computed,
                         "stored": engine.host.bytes_stored if engine.host else 0,
                         "loaded": engine.host.bytes_loaded if engine.host else 0,
                         "written_back": prefix.pages_written_back, "prefetched": prefix.pages_prefetched,
                         "preemptions": engine.scheduler.num_preemptions}
        print(f"{name:>5}: device pages {pages}, host pages {host} ({mode if host else 'no host pool'}): "
              f"hit {hits} tokens, computed {computed}, host bytes stored {results[name]['stored']:,} "
              f"loaded {results[name]['loaded']:,}, pages prefetched {prefix.pages_prefetched}")
    oracle = sum(best // args.hash_block * args.hash_block for _, best in requests)
    base = results["large"]["computed"]
    mux = multiplexed(HybridLM(load_model_config("configs/model/tiny.yaml")).init_weights(seed=args.seed, std=0.1), args)
    figures = {
        "host_pool_bytes_vs_budget_minus_states": mux.pop("host_pool_bytes_vs_budget_minus_states"),
        "kv_kept_across_iterations_hit": mux.pop("kv_kept_across_iterations_hit"),
        "wb_copy_bytes_vs_wt": results["wb"]["stored"] / max(1, results["wt"]["stored"]),
        "reprefill_tokens_wb_vs_none": (results["wb"]["computed"] - base) / max(1, results["none"]["computed"] - base),
        "hit_vs_oracle_wb": results["wb"]["hits"] / oracle if oracle else 1.0,
        "hit_vs_oracle_wt": results["wt"]["hits"] / oracle if oracle else 1.0,
        "hit_vs_oracle_none": results["none"]["hits"] / oracle if oracle else 1.0,
        "hit_vs_oracle_large": results["large"]["hits"] / oracle if oracle else 1.0,
        "wb_bytes_stored": results["wb"]["stored"], "wt_bytes_stored": results["wt"]["stored"],
        "device_pages": args.pages, **mux,
    }
    print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items()))
    return figures


if __name__ == "__main__":
    main()
