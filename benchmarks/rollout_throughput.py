"""Rollout throughput: our engine vs transformers' `generate` on the same KimiLinear weights.

    python -m benchmarks.rollout_throughput [--num-prompts 64] [--new-tokens 128]

The tiny model (configs/model/tiny.yaml) is randomly initialised, saved as a Hugging Face
checkpoint and loaded by both sides: ours through models/checkpoint.py, transformers through
`KimiLinearForCausalLM.from_pretrained` (torch fallbacks, fla absent). Both decode greedily,
ignoring eos, `new_tokens` tokens for every prompt (prompt lengths 16..64, fixed seed); transformers
gets the whole batch left-padded in one `generate` call. Each side runs `--repeats` times and its
fastest run counts (this host's speed varies by 2x from minute to minute). Also reported: how many sequences the two
produce identically (left padding in transformers can legitimately flip near-ties).
Final line: ratio=<ours/hf> engine_tok_s=... hf_tok_s=... block_tokens=...
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from benchmarks import parse_args
from models.checkpoint import save_checkpoint
from models.config import load_model_config
from models.model import HybridLM
from rollout.engine import Engine, EngineConfig
from rollout.sampling import SamplingParams


def hf_runner(model: HybridLM, prompts: list[list[int]], new_tokens: int) -> Callable[[], list[list[int]]]:
    """transformers' KimiLinearForCausalLM on the same weights; returns a function generating the
    whole batch (left-padded, greedy, exactly new_tokens each) and returning the new tokens."""
    sys.modules.setdefault("fla", None)  # transformers must use its torch path on CPU
    from transformers import KimiLinearForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(model, tmp)
        hf = KimiLinearForCausalLM.from_pretrained(tmp).eval()
    pad, width = model.config.pad_token_id, max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):] = torch.tensor(prompt)
        mask[i, width - len(prompt):] = 1
    # No eos at all (rather than min_new_tokens, which masks eos out of the argmax while our engine,
    # with ignore_eos, may still pick it): both sides run exactly new_tokens plain greedy steps.
    hf.generation_config.eos_token_id = None

    @torch.no_grad()
    def run(num: int = len(prompts), max_new_tokens: int = new_tokens) -> list[list[int]]:
        out = hf.generate(input_ids=ids[:num], attention_mask=mask[:num], max_new_tokens=max_new_tokens,
                          do_sample=False, pad_token_id=pad)
        return out[:, width:].tolist()

    return run


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--config", default="configs/model/tiny.yaml")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=5, help="timed rounds; each side's fastest run counts")
    p.add_argument("--skip-hf", action="store_true", help="time only our engine")
    args = parse_args(p, argv, quick={"num_prompts": 8, "new_tokens": 16, "repeats": 1})

    model = HybridLM(load_model_config(args.config)).init_weights(seed=args.seed, std=0.1).eval()
    gen = torch.Generator().manual_seed(args.seed)
    lens = torch.randint(16, 65, (args.num_prompts,), generator=gen).tolist()
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lens]
    total = args.num_prompts * args.new_tokens

    engine = Engine(model, EngineConfig(max_model_len=64 + args.new_tokens + 1,
                                        max_num_batched_tokens=4096))
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    hf = None if args.skip_hf else hf_runner(model, prompts, args.new_tokens)
    engine.generate(prompts[:2], SamplingParams(temperature=0.0, max_new_tokens=2))  # warm-up
    if hf is not None:
        hf(2, 2)
    # Rounds alternate the two sides so both see the same host conditions (this machine's speed
    # drifts by up to 2x from minute to minute); each side's fastest round counts.
    engine_s = hf_s = float("inf")
    for _ in range(args.repeats):
        steps = engine.num_steps
        elapsed, ours = timed(lambda: engine.generate(prompts, params))
        engine_s, engine_steps = min(engine_s, elapsed), engine.num_steps - steps
        if hf is not None:
            elapsed, hf_tokens = timed(hf)
            hf_s = min(hf_s, elapsed)
    figures = {"engine_tok_s": total / engine_s, "block_tokens": engine.layout.block_tokens}
    print(f"engine: {total} tokens in {engine_s:.2f} s = {figures['engine_tok_s']:.0f} tok/s "
          f"({engine_steps} steps, peak pages {engine.peak_pages_used}/{engine.pool.num_pages}, "
          f"{engine.layout.describe()})")
    if hf is not None:
        figures["hf_tok_s"] = total / hf_s
        figures["ratio"] = figures["engine_tok_s"] / figures["hf_tok_s"]
        figures["same_sequences"] = sum(o.samples[0].tokens == h for o, h in zip(ours, hf_tokens))
        print(f"transformers generate: {total} tokens in {hf_s:.2f} s = {figures['hf_tok_s']:.0f} tok/s; "
              f"identical greedy sequences: {figures['same_sequences']}/{len(prompts)}")
    keys = ["ratio", "engine_tok_s", "hf_tok_s", "block_tokens", "same_sequences"]
    print(" ".join(f"{k}={figures[k]:.3g}" if isinstance(figures[k], float) else f"{k}={figures[k]}"
                   for k in keys if k in figures))
    return figures


if __name__ == "__main__":
    main()
