"""Training step: our chunked trainer vs a plain torch forward/backward/AdamW, same model and batch.

    python -m benchmarks.train_step [--chunks 4] [--tokens 4096]

Both sides start from the same weights and take one step on the same packed batch. Measured in
the same run:
- peak "device" bytes of training state: activations saved for backward (tracked with
  autograd saved-tensor hooks, the live peak) + gradient buffers + optimizer states kept beside
  the weights. Plain: all activations, every parameter's fp32 gradient, AdamW moments. Ours: one
  chunk's activations at a time, the two-slot gradient arena; AdamW moments live on the host.
- tokens per second of the step (best of --repeats).
Final line: peak_bytes_ratio=<ours/plain> tok_s_ratio=<ours/plain> chunks=... dp=1
"""
from __future__ import annotations

import argparse
import time
import weakref

import torch

from models.config import load_model_config
from models.model import HybridLM, StateMixer
from models.state import SegmentBatch
from trainer.optimizer import OptimizerConfig
from trainer.step import Trainer, TrainerConfig


class SavedTensorMeter:
    """Live and peak bytes of tensors autograd saves for backward (distinct storages counted once)."""

    def __init__(self) -> None:
        self.live, self.peak = 0, 0
        self._seen: dict[int, int] = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key and key not in self._seen:
            self._seen[key] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key)
        return t

    def _free(self, key: int) -> None:
        self.live -= self._seen.pop(key, 0)

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)


def batch(num_tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < num_tokens:
        lens.append(int(torch.randint(64, 513, (1,), generator=gen)))
    lens[-1] -= sum(lens) - num_tokens
    tokens = torch.randint(0, 256, (num_tokens,), generator=gen)
    targets = torch.randint(0, 256, (num_tokens,), generator=gen)
    weights = torch.randn(num_tokens, generator=gen)
    return [n for n in lens if n > 0], tokens, targets, weights


def plain_step(model: HybridLM, lens, tokens, targets, weights, lr: float) -> int:
    """Whole model, one backward, torch AdamW. Returns peak training-state bytes."""
    meter = SavedTensorMeter()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    with meter.hooks():
        sb = SegmentBatch(new_lens=lens, starts=[0] * len(lens))
        hidden = model.run_layers(tokens, StateMixer(sb, [None] * len(lens), [[]] * len(lens)))
        logp = model.packed_logprobs(hidden, targets)
        loss = -(logp * weights).sum() / weights.numel()
    activation_peak = meter.peak
    loss.backward()
    opt.step()
    grad_bytes = sum(p.grad.numel() * 4 for p in model.parameters() if p.grad is not None)
    state_bytes = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                      if torch.is_tensor(t) and t.dim() > 0)
    return activation_peak + grad_bytes + state_bytes


def ours_step(trainer: Trainer, lens, tokens, targets, weights) -> int:
    meter = SavedTensorMeter()
    with meter.hooks():
        trainer.train_step(tokens, lens, targets, lambda lp, rows: -(lp * weights[rows]).sum() / weights.numel())
    return meter.peak + trainer.arena.total_bytes  # optimizer moments are on the host


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--config", default="configs/model/tiny.yaml")
    args = p.parse_args(argv)
    cfg = load_model_config(args.config)
    lens, tokens, targets, weights = batch(args.tokens)
    lr = 1e-4
    best_plain = best_ours = float("inf")
    for _ in range(args.repeats):  # rounds alternate the two sides (noisy host)
        model = HybridLM(cfg).init_weights(seed=0, std=0.1)
        t0 = time.perf_counter()
        plain_bytes = plain_step(model, lens, tokens, targets, weights, lr)
        best_plain = min(best_plain, time.perf_counter() - t0)
        trainer = Trainer(HybridLM(cfg).init_weights(seed=0, std=0.1),
                          TrainerConfig(num_chunks=args.chunks, optimizer=OptimizerConfig(lr=lr, backend="torch")))
        t0 = time.perf_counter()
        ours_bytes = ours_step(trainer, lens, tokens, targets, weights)
        best_ours = min(best_ours, time.perf_counter() - t0)
    print(f"plain: {plain_bytes / 2**20:.1f} MiB training state, {args.tokens / best_plain:.0f} tok/s")
    print(f"ours ({args.chunks} chunks): {ours_bytes / 2**20:.1f} MiB on device (+ host AdamW shards), "
          f"{args.tokens / best_ours:.0f} tok/s")
    figures = {"peak_bytes_ratio": ours_bytes / plain_bytes, "tok_s_ratio": best_plain / best_ours}
    print(f"peak_bytes_ratio={figures['peak_bytes_ratio']:.3g} tok_s_ratio={figures['tok_s_ratio']:.3g} "
          f"chunks={args.chunks} dp=1")
    return figures


if __name__ == "__main__":
    main()
