"""Auto-throttling vs fixed concurrency on a multi-turn workload whose contexts grow.

    python -m benchmarks.throttle

`--conversations` conversations of `--turns` turns each: a turn's prompt is the whole
conversation so far plus `--user-tokens` new tokens, and the model answers `--answer-tokens`
greedy tokens, so contexts grow turn by turn. The device pool is small (`--pages`), so sending
everything at once forces preemptions (recompute) while sending too little leaves the engine
idle. Each setting runs the same workload on a fresh engine, all in this run, in `--repeats`
interleaved rounds (each setting's fastest round counts); throughput is generated tokens per second.
`--prefix-cache 16` runs every setting with the prefix cache on (later turns hit earlier ones; the
throttle counts pages only the cache holds as free and projects each sequence's resume point in the
cache; each setting also prints the tokens run through the model and the prompt tokens the cache
served). Final line:
auto_vs_best_fixed=... auto_vs_worst_fixed=... preemptions_auto=... preemptions_best_fixed=...
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks import parse_args
from models.config import load_model_config
from models.model import HybridLM
from rollout.dispatcher import Dispatcher, Submission, ThrottleConfig
from rollout.engine import Engine, EngineConfig
from rollout.kv import PrefixCacheConfig
from rollout.sampling import SamplingParams


def run_setting(model: HybridLM, args: argparse.Namespace, max_concurrency: int | None) -> dict[str, float]:
    cache = (PrefixCacheConfig(hash_block=args.prefix_cache, model_id="tiny") if args.prefix_cache else None)
    engine = Engine(model, EngineConfig.for_pages(model, args.pages, max_model_len=args.max_len,
                                                  max_num_batched_tokens=512, prefix_cache=cache))
    dispatcher = Dispatcher(engine, ThrottleConfig(max_concurrency=max_concurrency))
    gen = torch.Generator().manual_seed(0)
    user_turns = {c: [torch.randint(0, 256, (args.user_tokens,), generator=gen).tolist() for _ in range(args.turns)]
                  for c in range(args.conversations)}
    params = SamplingParams(temperature=0.0, max_new_tokens=args.answer_tokens, ignore_eos=True)

    def follow_up_for(conversation: int):
        turn = {"n": 1}

        def follow_up(out):
            if turn["n"] >= args.turns:
                return []
            history = out.prompt + out.samples[0].tokens
            nxt = history + user_turns[conversation][turn["n"]]
            turn["n"] += 1
            return [Submission(nxt, params, follow_up)]

        return follow_up

    for c in range(args.conversations):
        dispatcher.add(Submission(list(user_turns[c][0]), params, follow_up_for(c)))
    t0 = time.perf_counter()
    outputs = dispatcher.run()
    elapsed = time.perf_counter() - t0
    generated = sum(len(o.samples[0].tokens) for o in outputs)
    assert len(outputs) == args.conversations * args.turns
    return {"tok_s": generated / elapsed, "preemptions": engine.scheduler.num_preemptions,
            "steps": engine.num_steps, "computed": engine.num_computed_tokens,
            "hit": engine.cache.prefix.hit_tokens if engine.cache.prefix is not None else 0, "mean_limit": (sum(dispatcher.auto.history) / len(dispatcher.auto.history)
                                                      if dispatcher.auto else float(max_concurrency))}


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--user-tokens", type=int, default=24)
    p.add_argument("--answer-tokens", type=int, default=24)
    p.add_argument("--pages", type=int, default=64)
    p.add_argument("--fixed", type=int, nargs="+", default=[2, 8, 32])
    p.add_argument("--repeats", type=int, default=3, help="rounds over all settings; each setting's best counts")
    p.add_argument("--prefix-cache", type=int, default=None, metavar="HASH_BLOCK",
                   help="turn the engine's prefix cache on with this hash block (every setting; later turns hit)")
    args = parse_args(p, argv, quick={"conversations": 8, "turns": 3, "repeats": 1})
    args.max_len = args.turns * (args.user_tokens + args.answer_tokens) + 1
    model = HybridLM(load_model_config("configs/model/tiny.yaml")).init_weights(seed=0, std=0.1).eval()
    results: dict[str, dict[str, float]] = {}
    for _ in range(args.repeats):  # rounds interleave the settings (this host's speed drifts)
        for setting in [None] + args.fixed:
            name = "auto" if setting is None else f"fixed{setting}"
            r = run_setting(model, args, setting)
            if name not in results or r["tok_s"] > results[name]["tok_s"]:
                results[name] = r
    for name, r in results.items():
        cache = f"  computed {r['computed']:6d}  hit {r['hit']:5d}" if args.prefix_cache else ""
        print(f"{name:8s} {r['tok_s']:7.0f} tok/s  preemptions {r['preemptions']:4d}  steps {r['steps']:4d}  "
              f"mean limit {r['mean_limit']:.1f}{cache}", flush=True)
    fixed = [results[f"fixed{s}"] for s in args.fixed]
    best = max(fixed, key=lambda r: r["tok_s"])
    worst = min(fixed, key=lambda r: r["tok_s"])
    figures = {"auto_vs_best_fixed": results["auto"]["tok_s"] / best["tok_s"],
               "auto_vs_worst_fixed": results["auto"]["tok_s"] / worst["tok_s"],
               "preemptions_auto": results["auto"]["preemptions"], "preemptions_best_fixed": best["preemptions"]}
    print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items()))
    return figures


if __name__ == "__main__":
    main()
