"""Rollout throughput: our engine vs transformers' `generate` on the same KimiLinear weights.

    python -m benchmarks.rollout_throughput [--num-prompts 64] [--new-tokens 128]

The tiny model (configs/model/tiny.yaml) is randomly initialised, saved as a Hugging Face
checkpoint and loaded by both sides: ours through models/checkpoint.py, transformers through
`KimiLinearForCausalLM.from_pretrained` (torch fallbacks, fla absent). Both decode greedily,
ignoring eos, `new_tokens` tokens for every prompt (prompt lengths 16..64, fixed seed); transformers
gets the whole batch left-padded in one `generate` call. Also reported: how many sequences the two
produce identically (left padding in transformers can legitimately flip near-ties).
Final line: ratio=<ours/hf> engine_tok_s=... hf_tok_s=... block_tokens=...
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch

from models.checkpoint import save_checkpoint
from models.config import load_model_config
from models.model import HybridLM
from rollout.engine import Engine, EngineConfig
from rollout.sampling import SamplingParams


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--config", default="configs/model/tiny.yaml")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-hf", action="store_true", help="time only our engine")
    args = p.parse_args(argv)

    model = HybridLM(load_model_config(args.config)).init_weights(seed=args.seed, std=0.1).eval()
    gen = torch.Generator().manual_seed(args.seed)
    lens = torch.randint(16, 65, (args.num_prompts,), generator=gen).tolist()
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lens]
    total = args.num_prompts * args.new_tokens

    engine = Engine(model, EngineConfig(max_model_len=64 + args.new_tokens + 1, show_progress=False,
                                        max_num_batched_tokens=2048))
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(temperature=0.0, max_new_tokens=2))  # warm-up
    t0 = time.perf_counter()
    ours = engine.generate(prompts, params)
    engine_s = time.perf_counter() - t0
    engine_tok_s = total / engine_s
    print(f"engine: {total} tokens in {engine_s:.2f} s = {engine_tok_s:.0f} tok/s "
          f"(steps {engine.num_steps}, peak pages {engine.peak_pages_used}/{engine.pool.num_pages}, "
          f"{engine.layout.describe()})", flush=True)
    figures = {"engine_tok_s": engine_tok_s, "block_tokens": engine.layout.block_tokens}
    if not args.skip_hf:
        sys.modules.setdefault("fla", None)  # transformers must use its torch path on CPU
        from transformers import KimiLinearForCausalLM

        with tempfile.TemporaryDirectory() as tmp:
            save_checkpoint(model, tmp)
            hf = KimiLinearForCausalLM.from_pretrained(tmp).eval()
        pad = model.config.pad_token_id
        width = max(lens)
        ids = torch.full((len(prompts), width), pad)
        mask = torch.zeros_like(ids)
        for i, pr in enumerate(prompts):
            ids[i, width - len(pr):] = torch.tensor(pr)
            mask[i, width - len(pr):] = 1
        # No eos at all (rather than min_new_tokens, which would mask eos out of the argmax while our
        # engine, with ignore_eos, may still pick it): both run exactly new_tokens plain greedy steps.
        hf.generation_config.eos_token_id = None
        kwargs = dict(max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=pad)
        with torch.no_grad():
            hf.generate(input_ids=ids[:2], attention_mask=mask[:2], **{**kwargs, "max_new_tokens": 2})
            t0 = time.perf_counter()
            out = hf.generate(input_ids=ids, attention_mask=mask, **kwargs)
            hf_s = time.perf_counter() - t0
        hf_tokens = out[:, width:].tolist()
        same = sum(o.samples[0].tokens == h for o, h in zip(ours, hf_tokens))
        figures["hf_tok_s"] = total / hf_s
        figures["ratio"] = engine_tok_s / figures["hf_tok_s"]
        figures["same_sequences"] = same
        print(f"transformers generate: {total} tokens in {hf_s:.2f} s = {figures['hf_tok_s']:.0f} tok/s; "
              f"identical greedy sequences: {same}/{len(prompts)}", flush=True)
    keys = ["ratio", "engine_tok_s", "hf_tok_s", "block_tokens", "same_sequences"]
    print(" ".join(f"{k}={figures[k]:.3g}" if isinstance(figures[k], float) else f"{k}={figures[k]}"
                   for k in keys if k in figures))
    return figures


if __name__ == "__main__":
    main()
