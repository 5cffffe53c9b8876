"""Training step: our chunked trainer vs a plain torch forward/backward/AdamW, same model and batch.

    python -m benchmarks.train_step [--chunks 4] [--tokens 4096] [--config configs/model/tiny.yaml]

Both sides start from the same weights, run the same mixer math (`PackedMixer`: the sequences
padded into a few batched buckets) and take one step on the same packed batch. Measured in the
same run:
- peak "device" bytes of training state: the live peak of the tensors kept for backward (tracked
  with autograd saved-tensor hooks, forward and backward both inside the meter) + gradient buffers
  + optimizer states kept beside the weights.
  Plain: one forward and one backward of the whole model (`HybridLM.run_layers` with a
  `PackedMixer`, `packed_logprobs`), every parameter's fp32 gradient, torch AdamW's moments.
  Ours: `Trainer.train_step` with --chunks VPP chunks: the hidden state entering each chunk, kept
  from the graph-free forward until that chunk's backward (num_chunks x [N, D] in the model dtype
  at the start of backward, counted in the same live set as the saved activations, so a chunk input
  its recompute also saves is counted once), one chunk's activations at a time, the two-slot
  gradient arena; AdamW moments live on the host.
- tokens per second of the step (best of --repeats), and the loss of both sides (same math: they
  agree to float rounding).
Earlier versions ran the plain side through `StateMixer` (a loop over sequences, slower than the
batched mixer ours uses) and left our chunk inputs out of the bytes; both sides now do the same work.
Final line: peak_bytes_ratio=<ours/plain> tok_s_ratio=<ours/plain> chunks=... dp=1 loss_rel_diff=...
"""
from __future__ import annotations

import argparse
import time
import weakref

import torch

from benchmarks import parse_args
from models.config import load_model_config
from models.model import HybridLM, PackedMixer
from models.state import SegmentBatch
from trainer.host_adam import OptimizerConfig
from trainer.step import Trainer, TrainerConfig


class SavedTensorMeter:
    """Live and peak bytes of the tensors kept for backward (distinct storages counted once, each
    until its storage is freed)."""

    def __init__(self) -> None:
        self.live, self.peak = 0, 0
        self._seen: dict[int, int] = {}

    def track(self, t: torch.Tensor) -> torch.Tensor:
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
        return torch.autograd.graph.saved_tensors_hooks(self.track, lambda t: t)

    def track_chunk_inputs(self, trainer: Trainer) -> list:
        """Count the hidden state entering each VPP chunk during the graph-free forward (it stays
        alive until the chunk's backward), and the attention outputs that pass keeps for the
        recompute (PackedMixer.kept): `trainer.chunked._run_chunk` is wrapped to record its
        input when no graph is built (chunks without layers included: an embedding-only chunk's
        input is the embedding output, a head-only chunk's the last layer's output). Returns a
        handle list; `remove()` each to unwrap."""
        chunked = trainer.chunked
        run_chunk = chunked._run_chunk

        def tracked(chunk, hidden, mixer):
            if torch.is_grad_enabled():
                return run_chunk(chunk, hidden, mixer)
            self.track(hidden)
            out = run_chunk(chunk, hidden, mixer)
            for kept in (getattr(mixer, "kept", None) or {}).values():  # MLA outputs kept for the recompute
                for t in kept:
                    self.track(t)
            return out

        class Unwrap:
            def remove(self) -> None:
                chunked.__dict__.pop("_run_chunk", None)

        chunked._run_chunk = tracked
        return [Unwrap()]


def batch(num_tokens: int, seed: int = 0, vocab_size: int = 256):
    gen = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < num_tokens:
        lens.append(int(torch.randint(64, 513, (1,), generator=gen)))
    lens[-1] -= sum(lens) - num_tokens
    tokens = torch.randint(0, vocab_size, (num_tokens,), generator=gen)
    targets = torch.randint(0, vocab_size, (num_tokens,), generator=gen)
    weights = torch.randn(num_tokens, generator=gen)
    return [n for n in lens if n > 0], tokens, targets, weights


def plain_step(model: HybridLM, lens, tokens, targets, weights, lr: float) -> tuple[int, float]:
    """Whole model, one forward + one backward (the same PackedMixer as the trainer's chunks), torch
    AdamW. Mutates the model's weights and .grad. Returns (peak training-state bytes, loss)."""
    meter = SavedTensorMeter()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    with meter.hooks():
        mixer = PackedMixer(SegmentBatch(new_lens=lens, starts=[0] * len(lens)))
        hidden = model.run_layers(tokens, mixer)  # [N, D] final-normed
        logp = model.packed_logprobs(hidden, targets)
        loss = -(logp * weights).sum() / weights.numel()
        loss.backward()
    opt.step()
    grad_bytes = sum(p.grad.numel() * 4 for p in model.parameters() if p.grad is not None)
    state_bytes = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                      if torch.is_tensor(t) and t.dim() > 0)
    return meter.peak + grad_bytes + state_bytes, loss.item()


def ours_step(trainer: Trainer, lens, tokens, targets, weights) -> tuple[int, float]:
    """One `Trainer.train_step` (mutates the model and the host optimizer). Returns (peak device
    bytes: saved activations + chunk inputs + gradient arena, loss); the AdamW moments are on the host."""
    meter = SavedTensorMeter()
    handles = meter.track_chunk_inputs(trainer)
    try:
        with meter.hooks():
            metrics = trainer.train_step(tokens, lens, targets,
                                         lambda lp, rows, seqs: -(lp * weights[rows]).sum() / weights.numel())
    finally:
        for handle in handles:
            handle.remove()
    return meter.peak + trainer.arena.total_bytes, metrics["loss"]


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--config", default="configs/model/tiny.yaml")
    args = parse_args(p, argv, quick={"tokens": 1024, "repeats": 1})
    cfg = load_model_config(args.config)
    lens, tokens, targets, weights = batch(args.tokens, vocab_size=min(256, cfg.vocab_size))
    lr = 1e-4
    best_plain = best_ours = float("inf")
    for _ in range(args.repeats):  # rounds alternate the two sides (noisy host)
        model = HybridLM(cfg).init_weights(seed=0, std=0.1)
        t0 = time.perf_counter()
        plain_bytes, plain_loss = plain_step(model, lens, tokens, targets, weights, lr)
        best_plain = min(best_plain, time.perf_counter() - t0)
        del model
        trainer = Trainer(HybridLM(cfg).init_weights(seed=0, std=0.1),
                          TrainerConfig(num_chunks=args.chunks, optimizer=OptimizerConfig(lr=lr, backend="torch")))
        t0 = time.perf_counter()
        ours_bytes, ours_loss = ours_step(trainer, lens, tokens, targets, weights)
        best_ours = min(best_ours, time.perf_counter() - t0)
        del trainer
    print(f"plain: {plain_bytes / 2**20:.1f} MiB training state, {args.tokens / best_plain:.0f} tok/s")
    print(f"ours ({args.chunks} chunks): {ours_bytes / 2**20:.1f} MiB on device (+ host AdamW shards), "
          f"{args.tokens / best_ours:.0f} tok/s")
    figures = {"peak_bytes_ratio": ours_bytes / plain_bytes, "tok_s_ratio": best_plain / best_ours,
               "loss_rel_diff": abs(ours_loss - plain_loss) / max(abs(plain_loss), 1e-30)}
    print(f"peak_bytes_ratio={figures['peak_bytes_ratio']:.3g} tok_s_ratio={figures['tok_s_ratio']:.3g} "
          f"chunks={args.chunks} dp=1 loss_rel_diff={figures['loss_rel_diff']:.2g}")
    return figures


if __name__ == "__main__":
    main()
