"""Token eviction in long-context decode: full KV vs H2O vs InfiniGen on the tiny model.

    python -m benchmarks.kv_eviction [--prompts 4] [--prompt-len 64] [--new-tokens 448] [--budget 128]

Contexts grow to prompt + new tokens (4x the budget by default). The full-KV engine decodes
greedily first; its tokens become the reference. Each policy then decodes *teacher-forced* on those
tokens (the harness records every next-token distribution and makes the sampler pick the
reference token), so every step compares the same context:
- token_agree: fraction of steps whose greedy choice equals full KV's;
- kl: mean KL(full || policy) of the next-token distributions;
- kv_bytes: peak device bytes of MLA cache (pages held by the sequences, 16-token pages) plus, for
  InfiniGen, its partial keys and the rows fetched for a step; KDA state pages are the same for
  every policy and reported apart;
- tok_s: decode throughput of the forced run (the same work as free decoding).
Final line: h2o_kv_bytes_vs_full=... h2o_token_agree=... infinigen_kv_bytes_vs_full=...
infinigen_token_agree=... h2o_kl=... infinigen_kl=... full_tok_s=... h2o_tok_s=... infinigen_tok_s=...
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks import parse_args
from models.config import load_model_config
from models.model import HybridLM
from rollout.engine import Engine, EngineConfig
from rollout.kv import KVBudgetConfig
from rollout.sampling import SamplingParams

BLOCK_TOKENS = 16


class Forced:
    """Wraps an engine's model runner: records each sampling row's logits and forces the
    reference token (the sampler is greedy, so a one-hot row picks it)."""

    def __init__(self, engine: Engine, reference: dict[str, list[int]] | None) -> None:
        self.engine, self.reference = engine, reference
        self.logits: dict[str, list[torch.Tensor]] = {}
        self.peak_mla_pages = 0
        self._run = engine.runner.run
        engine.runner.run = self

    def __call__(self, step, *args):
        held = sum(len(pages) for s in self.engine.scheduler.running for pages in s.mla_pages)
        self.peak_mla_pages = max(self.peak_mla_pages, held)
        sampling, logits, settings, verify_logits = self._run(step, *args)  # no speculation with a KV budget
        logits = logits.clone()  # an inference tensor: edit a copy
        for row, index in enumerate(sampling):
            seq = step.seqs[index]
            self.logits.setdefault(seq.request_id, []).append(logits[row].clone())
            if self.reference is not None:
                forced = torch.full_like(logits[row], float("-inf"))
                forced[self.reference[seq.request_id][seq.num_generated]] = 0.0
                logits[row] = forced
        return sampling, logits, settings, verify_logits


def run(model: HybridLM, prompts: list[list[int]], new_tokens: int, kv: KVBudgetConfig | None,
        reference: dict[str, list[int]] | None) -> dict:
    engine = Engine(model, EngineConfig(max_model_len=len(max(prompts, key=len)) + new_tokens + 1,
                                        block_tokens=BLOCK_TOKENS, max_num_batched_tokens=256,
                                        kv_budget=kv))
    forced = Forced(engine, reference)
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params, request_id=str(i)) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    outputs = {}
    while engine.has_unfinished:
        for out in engine.step():
            outputs[out.request_id] = out
    seconds = time.perf_counter() - t0
    page_bytes = engine.layout.page_bytes
    extra = engine.evictor.peak_extra_bytes if engine.evictor is not None else 0
    return {"tokens": {i: outputs[i].samples[0].tokens for i in ids}, "logits": forced.logits,
            "kv_bytes": forced.peak_mla_pages * page_bytes + extra, "extra_bytes": extra,
            "kda_bytes": len(prompts) * len(engine.layout.kda_groups) * page_bytes,
            "tok_s": len(prompts) * new_tokens / seconds,
            "stats": dict(engine.evictor.stats) if engine.evictor is not None else {}}


def compare(full: dict, other: dict) -> tuple[float, float]:
    agree, kl, steps = 0, 0.0, 0
    for rid, ref_logits in full["logits"].items():
        for a, b in zip(ref_logits, other["logits"][rid]):
            agree += int(a.argmax() == b.argmax())
            p, q = torch.log_softmax(a.double(), -1), torch.log_softmax(b.double(), -1)
            kl += float((p.exp() * (p - q)).sum())
            steps += 1
    return agree / steps, kl / steps


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=448)
    p.add_argument("--budget", type=int, default=128, help="MLA tokens per sequence on the device")
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--recent", type=int, default=32)
    p.add_argument("--channels", type=int, default=None, help="InfiniGen partial-key channels (default 1/4)")
    p.add_argument("--max-fetch", type=int, default=32)
    p.add_argument("--config", default="configs/model/tiny.yaml")
    p.add_argument("--seed", type=int, default=0)
    args = parse_args(p, argv, quick={"prompts": 2, "new_tokens": 128, "budget": 64})

    model = HybridLM(load_model_config(args.config)).init_weights(seed=args.seed, std=0.15).eval()
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, 256, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]
    common = dict(budget_tokens=args.budget, sink_tokens=args.sink, recent_tokens=args.recent)
    full = run(model, prompts, args.new_tokens, None, None)
    reference = full["tokens"]
    figures: dict[str, float] = {"full_tok_s": full["tok_s"]}
    print(f"full KV: {args.prompts} x ({args.prompt_len} + {args.new_tokens}) tokens, peak MLA KV "
          f"{full['kv_bytes']:,} B (+ KDA states {full['kda_bytes']:,} B), {full['tok_s']:.0f} tok/s")
    for name, kv in (("h2o", KVBudgetConfig(policy="h2o", **common)),
                     ("infinigen", KVBudgetConfig(policy="infinigen", partial_channels=args.channels,
                                                  max_fetch=args.max_fetch, **common))):
        result = run(model, prompts, args.new_tokens, kv, reference)
        agree, kl = compare(full, result)
        figures.update({f"{name}_kv_bytes_vs_full": result["kv_bytes"] / full["kv_bytes"],
                        f"{name}_token_agree": agree, f"{name}_kl": kl, f"{name}_tok_s": result["tok_s"]})
        print(f"{name}: budget {args.budget} tokens, peak MLA KV {result['kv_bytes']:,} B "
              f"(of which partial keys + fetched rows {result['extra_bytes']:,} B), token agreement {agree:.3f}, "
              f"mean KL {kl:.4f}, {result['tok_s']:.0f} tok/s, {result['stats']}")
    keys = ["h2o_kv_bytes_vs_full", "h2o_token_agree", "infinigen_kv_bytes_vs_full", "infinigen_token_agree",
            "h2o_kl", "infinigen_kl", "full_tok_s", "h2o_tok_s", "infinigen_tok_s"]
    print(" ".join(f"{k}={figures[k]:.3g}" for k in keys))
    return figures


if __name__ == "__main__":
    main()
