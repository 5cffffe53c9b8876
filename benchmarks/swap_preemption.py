"""Preemption by swapping to the host pool vs by recompute, on a device pool too small for the batch.

    python -m benchmarks.swap_preemption [--requests 32] [--pages 24] [--host-pages 400] [--new-tokens 96] [--forks 4]

The tiny model generates `--new-tokens` tokens for each of `--requests` prompts (random lengths, a
quarter of them with `--forks` seeded forks, 1 = none) three times: in a pool that never preempts, in the small pool
without a host pool (every victim recomputed from token 0), and in the small pool with one (victims
swapped to host slots and back). Final line: extra_tokens_swap_vs_recompute=... (tokens computed
beyond the large pool's, swap / recompute) tok_s_swap_vs_recompute=... (then the raw figures).
Wall time is process time on this machine's CPU: the copies are synchronous here. Forks add extra
tokens that are not preemption's: a prompt whose forks' private pages do not fit is recomputed per
fork (`Engine._fork`), with or without a host pool.
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks import parse_args
from models.config import load_model_config
from models.model import HybridLM
from rollout.engine import Engine, EngineConfig
from rollout.sampling import SamplingParams


def workload(num: int, new_tokens: int, seed: int, forks: int) -> tuple[list[list[int]], list[SamplingParams]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(20, 120, (num,), generator=gen).tolist()
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lens]
    params = [SamplingParams(temperature=0.8, top_k=40, n=forks, seed=i, max_new_tokens=new_tokens, ignore_eos=True)
              if i % 4 == 3 else SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
              for i in range(num)]
    return prompts, params


def run(model: HybridLM, pages: int, host_pages: int, prompts, params) -> dict[str, float]:
    engine = Engine(model, EngineConfig.for_pages(model, pages, host_pages=host_pages, max_model_len=512,
                                                  max_num_batched_tokens=256))
    start = time.process_time()
    outs = engine.generate(prompts, params)
    elapsed = time.process_time() - start
    stats = engine.stats()
    generated = sum(len(s.tokens) for o in outs for s in o.samples)
    return {"computed": engine.num_computed_tokens, "tok_s": generated / elapsed, "steps": engine.num_steps,
            "preemptions": stats["preemptions"], "swapped_out": stats["swapped_out"],
            "recomputed": stats["recomputed"],
            "host_bytes": (engine.host.bytes_stored + engine.host.bytes_loaded) if engine.host else 0}


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--pages", type=int, default=24, help="device pool pages (too few for the batch)")
    p.add_argument("--host-pages", type=int, default=400)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--forks", type=int, default=4, help="samples of every fourth request (1 = no forks)")
    p.add_argument("--seed", type=int, default=0)
    args = parse_args(p, argv, quick={"requests": 12, "new_tokens": 48})
    torch.set_num_threads(1)
    model = HybridLM(load_model_config("configs/model/tiny.yaml")).init_weights(seed=7, std=0.15).eval()
    prompts, params = workload(args.requests, args.new_tokens, args.seed, args.forks)
    results = {"large": run(model, 4000, 0, prompts, params),
               "recompute": run(model, args.pages, 0, prompts, params),
               "swap": run(model, args.pages, args.host_pages, prompts, params)}
    for name, r in results.items():
        print(f"{name:>9}: computed {r['computed']} tokens in {r['steps']} steps, {r['tok_s']:.0f} tok/s, "
              f"preemptions {r['preemptions']} (swapped {r['swapped_out']}, recomputed {r['recomputed']}), "
              f"host bytes moved {r['host_bytes']:,}")
    base = results["large"]["computed"]
    figures = {"extra_tokens_swap_vs_recompute": (results["swap"]["computed"] - base)
               / max(1, results["recompute"]["computed"] - base),
               "tok_s_swap_vs_recompute": results["swap"]["tok_s"] / results["recompute"]["tok_s"]}
    print(" ".join(f"{k}={v:.3f}" for k, v in figures.items()))
    return figures


if __name__ == "__main__":
    main()
