"""Sample text from a model built or loaded here, with a plain loop (no engine, no page pool).

    python -m models.sample --config configs/model/tiny.yaml --max-new-tokens 48
    python -m models.sample --checkpoint DIR --prompt "..."

Without --checkpoint the model is randomly initialised from the config (seeded), saved as a
Hugging Face-format checkpoint directory and loaded back, so the text is gibberish by design:
there is no trained tiny checkpoint yet. Decoding uses the explicit-state API (prefill once, then
one token per step from the returned state); at the end the job re-scores the whole sequence in one
full pass and reports the largest relative difference of the logits, a live check of the
state/resume path. Sampling (temperature, top-k, top-p, seed) here is the plain reference loop;
the rollout engine will own batched sampling.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress

from models.checkpoint import load_checkpoint, save_checkpoint
from models.config import load_model_config
from models.model import HybridLM
from models.tokenizer import ByteTokenizer


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, gen: torch.Generator) -> int:
    """logits: [vocab] -> one token id. temperature 0 = greedy; top_k 0 / top_p 1 = off."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = sorted_probs.cumsum(0) - sorted_probs >= top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs, 1, generator=gen))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", default="configs/model/tiny.yaml", help="model YAML (random init)")
    src.add_argument("--checkpoint", type=Path, help="HF-format checkpoint directory to load")
    p.add_argument("--save-dir", type=Path, default=Path("runs/tiny-init"), help="where a random init is saved")
    p.add_argument("--prompt", default="The colocated RL loop")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens={args.max_new_tokens}, expected >= 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0:
        p.error(f"--temperature={args.temperature} (>= 0), --top-p={args.top_p} (in (0, 1]), "
                f"--top-k={args.top_k} (>= 0) out of range")
    return args


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    console = Console(soft_wrap=True)
    tok = ByteTokenizer()
    t0 = time.perf_counter()
    if args.checkpoint is None:
        model = HybridLM(load_model_config(args.config)).init_weights(seed=args.seed)
        save_checkpoint(model, args.save_dir)
        path = args.save_dir
    else:
        path = args.checkpoint
    model = load_checkpoint(path)
    cfg = model.config
    if cfg.vocab_size < tok.vocab_size:
        raise SystemExit(f"error: {path} has vocab_size={cfg.vocab_size}; the byte tokenizer needs >= {tok.vocab_size}")
    how = "random init saved and loaded back" if args.checkpoint is None else "loaded"
    console.print(f"model {path}: {cfg.num_hidden_layers} layers ({''.join(t[0].upper() for t in cfg.layer_types)}), "
                  f"{sum(p.numel() for p in model.parameters()):,} parameters, {how} in {time.perf_counter() - t0:.2f} s")
    prompt = torch.tensor(tok.encode(args.prompt))
    gen = torch.Generator().manual_seed(args.seed)
    generated: list[int] = []
    with torch.no_grad(), Progress(console=console, transient=True) as progress:
        task = progress.add_task("decoding", total=args.max_new_tokens)
        t_prefill = time.perf_counter()
        out = model.forward_with_state([prompt], last_logits_only=True)
        prefill_s = time.perf_counter() - t_prefill
        stepwise = [out.logits[0][-1]]
        t_decode = time.perf_counter()
        for _ in range(args.max_new_tokens):
            token = sample_next(stepwise[-1], args.temperature, args.top_k, args.top_p, gen)
            generated.append(token)
            progress.advance(task)
            if token == cfg.eos_token_id or len(generated) == args.max_new_tokens:
                break
            out = model.forward_with_state([torch.tensor([token])], out.states)
            stepwise.append(out.logits[0][-1])
        decode_s = time.perf_counter() - t_decode
        full = model(torch.cat([prompt, torch.tensor(generated)])[None])[0, prompt.numel() - 1:-1]
    diff = max(((a - b).norm() / b.norm()).item() for a, b in zip(stepwise, full))
    console.print(f"prompt: {args.prompt!r}\nsample: {tok.decode(generated)!r}")
    console.print(f"prefill {prompt.numel()} tokens in {prefill_s:.3f} s; decoded {len(generated)} tokens at "
                  f"{len(generated) / decode_s:.1f} tok/s; stepwise vs full-pass logits: max rel diff {diff:.1e}")
    return diff


if __name__ == "__main__":
    main()
