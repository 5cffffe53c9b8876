"""Reference forward: streamed through the trainer's gradient slots vs a resident reference model.

    python -m benchmarks.ref_stream [--chunks 4] [--sequences 128] [--repeats 5] [--threads 1]

One RL-sized packed batch (default 128 sequences of 32..96 tokens, ~64 on average) scored by the
same reference weights two ways, in the same run, rounds alternating (each side first in every
other round), the fastest round of each side counting:
- resident: the whole reference model on the device, `ChunkedModel.forward_logprobs`;
- streamed: `trainer.ref_stream.StreamedReference` over a `Trainer`'s two-slot gradient arena
  (host vectors copied chunk by chunk into the slots, the next chunk's copy overlapping compute).
Device bytes: resident = what the resident reference holds after a forward: parameters, buffers
and, on CPU, the fused projection weights its layers cache (models/fused.py). Extra for streamed =
the most reference-weight bytes the streamed forward holds outside the trainer's arena at once:
bound parameters outside the slots and, on CUDA, memory_allocated() growth while materialising a
chunk (both asserted 0 by the forward), plus, on CPU, one chunk's transient fused copies (built by
the chunk, dropped after it; none on CUDA). Its buffers (MoE router biases, allocated once at
construction, not per forward) are printed on their own line. The two sides' logprobs must be
bit-identical on CPU fp32, or the script fails.

Timing on a shared CPU host: by default one torch thread (`--threads 0`: torch's default). With two
OpenMP threads on our busy 2-core host the same resident forward took anywhere from 5 s to 32 s
(CPU time = wall time; cause not pinned down: flushing subnormals to zero removed it in one
setting and not in another, and which side was slow depended on what the process ran first),
while one thread gave both sides 5.2-5.4 s in every run. glibc malloc's mmap threshold adapts to the sizes freed so
far, so whether a large activation reuses heap memory or faults in fresh pages depends on the
process's history; the script pins it (mallopt; `--no-pin-malloc` to skip) so both sides
allocate alike.
Final line: time_ratio=<streamed/resident> extra_device_bytes= resident_device_bytes= streamed_s= resident_s=
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import time

import torch

from benchmarks import parse_args
from models.config import load_model_config
from models.model import HybridLM
from trainer.chunks import ChunkedModel
from trainer.host_adam import OptimizerConfig
from trainer.ref_stream import StreamedReference
from trainer.step import Trainer, TrainerConfig


def rl_batch(num_sequences: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(32, 97, (num_sequences,), generator=gen).tolist()
    n = sum(lens)
    return torch.randint(0, vocab, (n,), generator=gen), lens, torch.randint(0, vocab, (n,), generator=gen)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _fused_bytes(model: torch.nn.Module) -> int:
    """Bytes of the fused weight copies the model's layers cache on CPU (models/fused.py)."""
    return sum(t.untyped_storage().nbytes() for m in model.modules()
               for _, t in m.__dict__.get("_fused_weights", {}).values())


def pin_malloc() -> bool:
    """Fix glibc's mmap threshold (32 MiB) and never trim the heap, so large blocks are reused
    instead of mapped afresh depending on history. False where glibc is not there."""
    path = ctypes.util.find_library("c")
    if path is None:
        return False
    libc = ctypes.CDLL(path)
    if not hasattr(libc, "mallopt"):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 32 << 20)) and bool(libc.mallopt(m_trim_threshold, 1 << 34))


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--sequences", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--config", default="configs/model/tiny.yaml")
    p.add_argument("--no-pin-malloc", action="store_true", help="leave glibc malloc's adaptive thresholds on")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads; 0 = torch's default (see the module docstring)")
    args = parse_args(p, argv, quick={"sequences": 16, "repeats": 2})
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if not args.no_pin_malloc and not pin_malloc():
        print("warning: could not pin glibc malloc's thresholds (no glibc?); times may depend on allocation history")
    cfg = load_model_config(args.config)
    tokens, lens, targets = rl_batch(args.sequences, cfg.vocab_size)

    trainer = Trainer(HybridLM(cfg).init_weights(seed=1, std=0.1),
                      TrainerConfig(num_chunks=args.chunks, optimizer=OptimizerConfig(backend="torch")))
    resident = HybridLM(cfg).init_weights(seed=0, std=0.1).eval()
    streamed = StreamedReference(resident, trainer.arena, args.chunks)
    chunked = ChunkedModel(resident, args.chunks)

    best_resident = best_streamed = float("inf")
    cpu_resident = cpu_streamed = float("inf")  # process CPU seconds (all threads): less sensitive to a busy host
    extra = 0
    for r in range(args.repeats):  # alternating, each side first in every other round
        for side in (("resident", "streamed") if r % 2 == 0 else ("streamed", "resident")):
            t0, c0 = time.perf_counter(), time.process_time()
            if side == "resident":
                expected = chunked.forward_logprobs(tokens, lens, targets)
                best_resident = min(best_resident, time.perf_counter() - t0)
                cpu_resident = min(cpu_resident, time.process_time() - c0)
            else:
                got = streamed.logprobs(tokens, lens, targets)
                best_streamed = min(best_streamed, time.perf_counter() - t0)
                cpu_streamed = min(cpu_streamed, time.process_time() - c0)
        if not torch.equal(got, expected):
            raise SystemExit(f"streamed logprobs differ from resident: max |diff| {(got - expected).abs().max():.3g}")
        st = streamed.stats
        extra = max(extra, st.weights_outside_arena_bytes + st.device_alloc_delta_bytes + st.derived_weight_bytes)

    resident_bytes = _bytes(resident.parameters()) + _bytes(resident.buffers()) + _fused_bytes(resident)
    buffer_bytes = _bytes(streamed.module.buffers())
    stats = streamed.stats
    print(f"batch: {len(lens)} sequences, {sum(lens)} tokens; {torch.get_num_threads()} threads; "
          f"{args.chunks} chunks, arena {trainer.arena.num_slots} x {trainer.arena.slot_bytes} B (the trainer's gradient slots)")
    fused = _fused_bytes(resident)
    print(f"resident: {resident_bytes} B of reference weights on the device (parameters + buffers "
          f"{resident_bytes - fused} B, fused copies {fused} B), {best_resident:.3f} s")
    print(f"streamed: {stats.bytes_loaded} B copied host->slots per forward, {stats.load_wait_s * 1e3:.1f} ms waited "
          f"for copies, {best_streamed:.3f} s; logprobs bit-identical; outside the arena: parameters "
          f"{stats.weights_outside_arena_bytes} B, allocation growth {stats.device_alloc_delta_bytes} B, "
          f"fused copies built {stats.derived_weight_bytes} B (the forward runs unfused)")
    print(f"streamed keeps {buffer_bytes} B of buffers (router correction biases) resident, allocated once at "
          f"construction")
    print(f"process CPU time: streamed {cpu_streamed:.3f} s, resident {cpu_resident:.3f} s, "
          f"cpu_time_ratio={cpu_streamed / cpu_resident:.3f}")
    figures = {"time_ratio": best_streamed / best_resident, "extra_device_bytes": float(extra),
               "resident_device_bytes": float(resident_bytes), "streamed_s": best_streamed, "resident_s": best_resident}
    print(f"time_ratio={figures['time_ratio']:.3f} extra_device_bytes={extra} resident_device_bytes={resident_bytes} "
          f"streamed_s={best_streamed:.4f} resident_s={best_resident:.4f}")
    return figures


if __name__ == "__main__":
    main()
