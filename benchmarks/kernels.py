"""Triton kernels vs their torch twins at Kimi-Linear sizes: agreement and timings, in one run.

    python -m benchmarks.kernels            # on a CUDA machine: native Triton vs torch
    python -m benchmarks.kernels --small    # quick shapes

Without CUDA it times only the torch paths (the Triton ones are checked under the interpreter by
`pytest -m triton`), unless TRITON_INTERPRET=1 is set (then `--small` checks this script end to end). Sizes follow Kimi-Linear-48B: KDA 32 heads of 128x128, MLA latent 512 + 64
rope dims over 32 heads, pages of `--block-tokens` tokens. Final line:
kda_decode_speedup=... mla_decode_speedup=... mla_weights_speedup=... kda_chunk_speedup=...
kda_chunk_bwd_speedup=... max_rel_err=...
(torch time / Triton time: > 1 means the Triton kernel is faster; the backward figure is forward +
backward through autograd). On CPU the fused C++ KDA decode (`impl="cpu"`) is timed against torch
too: kda_decode_cpu_speedup=.... On CUDA, with the anchors importable (the `[gpu]` extra, in an
environment of its own: benchmarks/baselines.py), also anchor time / our time on the same inputs:
kda_decode_vs_fla=... kda_chunk_vs_fla=... kda_chunk_bwd_vs_fla=... mla_decode_vs_flashinfer=...
(bf16 inputs for FlashInfer, whose MLA takes fp16/bf16 only).
"""
from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from benchmarks import parse_args
from kernels.kda.chunk import chunk_kda
from kernels.kda.decode import kda_decode_step
from kernels.mla.paged import paged_mla_decode
from kernels.mla.weights import paged_mla_weights


def bench(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of `fn` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", action="store_true", help="small shapes (fast smoke run)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--block-tokens", type=int, default=1024)
    args = parse_args(p, argv, quick={"small": True, "repeats": 3})
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    native = device.type == "cuda"
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    # Under TRITON_INTERPRET=1 (CPU) the Triton side runs too: slow, but it checks this script.
    impls = ("naive", "triton") if native or os.environ.get("TRITON_INTERPRET") == "1" else ("naive",)
    run = _Run(args, device, impls, gen, randn)
    if native:
        from benchmarks.baselines import availability

        run.anchors = availability()
        print("anchors: " + ", ".join(f"{k}: {v}" for k, v in run.anchors.items()))
    _kda_decode(run)
    _mla_decode_and_weights(run)
    _kda_chunk(run)
    _kda_chunk_backward(run)
    if "triton" not in impls:
        print("no CUDA device: torch paths timed only (Triton checked under the interpreter by pytest -m triton)")
    figures = run.figures
    if run.errors:
        figures["max_rel_err"] = max(run.errors)
    print(" ".join(f"{k}={v:.3g}" for k, v in figures.items()) or "native=0")
    return figures


@dataclass
class _Run:
    """One benchmark run's settings and what it collects."""

    args: argparse.Namespace
    device: torch.device
    impls: tuple[str, ...]
    gen: torch.Generator
    randn: Callable[..., torch.Tensor]
    figures: dict[str, float] = field(default_factory=dict)
    errors: list[float] = field(default_factory=list)
    anchors: dict[str, str] = field(default_factory=dict)
    """name -> "<dist> <version>" or "unavailable: ..." (benchmarks/baselines.py), CUDA only."""

    def has(self, anchor: str) -> bool:
        return self.with_triton and self.anchors.get(anchor, "unavailable").split(":")[0] != "unavailable"

    @property
    def with_triton(self) -> bool:
        return "triton" in self.impls

    @property
    def shapes(self) -> tuple[int, ...]:
        """(H, K, B, ctx, T, Dc, Dr, Hm, block_tokens)."""
        small = self.args.small
        return ((4, 32) if small else (32, 128)) + ((8, 300, 256) if small else (64, 4096, 4096)) + \
            ((64, 16, 4) if small else (512, 64, 32)) + (64 if small else self.args.block_tokens,)


def _kda_decode(run: _Run) -> None:
    args, device, impls, gen, randn = run.args, run.device, run.impls, run.gen, run.randn
    H, K, B, *_ = run.shapes
    figures, errors, with_triton = run.figures, run.errors, run.with_triton
    # KDA decode: B sequences' states in pool pages, updated in place.
    num_pages = 2 * B
    state = randn(num_pages, H, K, K) * 0.1
    pages = torch.randperm(num_pages, generator=gen)[:B].to(device)
    q, k = F.normalize(randn(B, H, K), dim=-1), F.normalize(randn(B, H, K), dim=-1)
    v, g, beta = randn(B, H, K), F.logsigmoid(randn(B, H, K)), torch.sigmoid(randn(B, H))
    outs, times = {}, {}
    for impl in impls + (("cpu",) if device.type == "cpu" else ()):
        work = state.clone()
        outs[impl] = kda_decode_step(q, k, v, g, beta, work, pages, impl=impl)
        times[impl] = bench(lambda: kda_decode_step(q, k, v, g, beta, state.clone(), pages, impl=impl), device,
                            args.repeats)
    print(f"kda_decode B={B} H={H} K=V={K}: " + ", ".join(f"{i} {t * 1e3:.3f} ms" for i, t in times.items()))
    if with_triton:
        errors.append(rel_err(outs["triton"], outs["naive"]))
        figures["kda_decode_speedup"] = times["naive"] / times["triton"]
    if "cpu" in outs:
        errors.append(rel_err(outs["cpu"], outs["naive"]))
        figures["kda_decode_cpu_speedup"] = times["naive"] / times["cpu"]
    if run.has("fla"):
        from benchmarks.baselines import fla_decode

        gathered, work = state[pages], state.clone()  # [B, H, K, V]: fla takes states by sequence, not page
        errors.append(rel_err(fla_decode(q, k, v, g, beta, gathered.clone(), scale=K ** -0.5)[0], outs["naive"]))
        # both without the per-call copy of the timings above (the states evolve; the work does not change)
        fla_s = bench(lambda: fla_decode(q, k, v, g, beta, gathered, scale=K ** -0.5), device, args.repeats)
        ours_s = bench(lambda: kda_decode_step(q, k, v, g, beta, work, pages, impl="triton", check=False), device,
                       args.repeats)
        print(f"kda_decode in place: triton {ours_s * 1e3:.3f} ms, fla fused_recurrent_kda {fla_s * 1e3:.3f} ms")
        figures["kda_decode_vs_fla"] = fla_s / ours_s


def _mla_decode_and_weights(run: _Run) -> None:
    args, device, impls, gen, randn = run.args, run.device, run.impls, run.gen, run.randn
    H, _, B, ctx, _, Dc, Dr, Hm, bt = run.shapes
    figures, errors, with_triton = run.figures, run.errors, run.with_triton
    # Paged MLA decode (absorbed) over ctx tokens per sequence.
    blocks = -(-ctx // bt)
    cache = randn(B * blocks + 1, bt, Dc + Dr)
    tables = torch.randperm(B * blocks + 1, generator=gen)[:B * blocks].view(B, blocks).to(device)
    lens = torch.randint(ctx // 2, ctx + 1, (B,), generator=gen).to(device)
    q_lat, q_rope = randn(B, Hm, Dc), randn(B, Hm, Dr)
    scale = (128 + Dr) ** -0.5
    outs, times = {}, {}
    for impl in impls:
        outs[impl] = paged_mla_decode(q_lat, q_rope, cache, tables, lens, scale=scale, impl=impl)
        times[impl] = bench(lambda: paged_mla_decode(q_lat, q_rope, cache, tables, lens, scale=scale, impl=impl),
                            device, args.repeats)
    print(f"mla_decode B={B} H={Hm} ctx<={ctx} block_tokens={bt}: "
          + ", ".join(f"{i} {t * 1e3:.3f} ms" for i, t in times.items()))
    if with_triton:
        errors.append(rel_err(outs["triton"], outs["naive"]))
        figures["mla_decode_speedup"] = times["naive"] / times["triton"]
    if run.has("flashinfer"):
        _flashinfer(run, q_lat, q_rope, cache, tables, lens, scale)

    # Attention weight per cached token (token eviction's scores), from the decode's lse.
    _, lse = paged_mla_decode(q_lat, q_rope, cache, tables, lens, scale=scale, return_lse=True)
    width = int(lens.max())
    outs, times = {}, {}
    for impl in impls:
        outs[impl] = paged_mla_weights(q_lat, q_rope, cache, tables, lens, lse, scale=scale, width=width, impl=impl)
        times[impl] = bench(lambda: paged_mla_weights(q_lat, q_rope, cache, tables, lens, lse, scale=scale,
                                                      width=width, impl=impl), device, args.repeats)
    print(f"mla_weights B={B} H={Hm} ctx<={ctx}: " + ", ".join(f"{i} {t * 1e3:.3f} ms" for i, t in times.items()))
    if with_triton:
        errors.append(rel_err(outs["triton"], outs["naive"]))
        figures["mla_weights_speedup"] = times["naive"] / times["triton"]


def _kda_chunk(run: _Run) -> None:
    args, device, impls, randn = run.args, run.device, run.impls, run.randn
    H, K, _, _, T, *_ = run.shapes
    figures, errors, with_triton = run.figures, run.errors, run.with_triton
    # KDA chunked prefill of one long sequence with states at hash-block ends.
    q, k = F.normalize(randn(1, T, H, K), dim=-1), F.normalize(randn(1, T, H, K), dim=-1)
    v, g, beta = randn(1, T, H, K), F.logsigmoid(randn(1, T, H, K)), torch.sigmoid(randn(1, T, H))
    positions = list(range(0, T + 1, 512 if not args.small else 64))
    outs, times = {}, {}
    for impl in impls:
        outs[impl] = chunk_kda(q, k, v, g, beta, state_positions=positions, impl=impl)
        times[impl] = bench(lambda: chunk_kda(q, k, v, g, beta, state_positions=positions, impl=impl), device,
                            max(1, args.repeats // 3))
    print(f"kda_chunk T={T} H={H} K=V={K} positions={len(positions)}: "
          + ", ".join(f"{i} {t * 1e3:.1f} ms" for i, t in times.items()))
    if with_triton:
        errors += [rel_err(a, b) for a, b in zip(outs["triton"], outs["naive"])]
        figures["kda_chunk_speedup"] = times["naive"] / times["triton"]
    if run.has("fla"):
        from benchmarks.baselines import fla_chunk

        o_fla, s_fla = fla_chunk(q, k, v, g, beta, scale=K ** -0.5, initial_state=None)
        errors += [rel_err(o_fla, outs["naive"][0]), rel_err(s_fla, outs["naive"][1])]
        fla_s = bench(lambda: fla_chunk(q, k, v, g, beta, scale=K ** -0.5, initial_state=None), device,
                      max(1, args.repeats // 3))
        print(f"kda_chunk fla chunk_kda {fla_s * 1e3:.1f} ms (no position states: fla emits none)")
        figures["kda_chunk_vs_fla"] = fla_s / times["triton"]


def _flashinfer(run: _Run, q_lat, q_rope, cache, tables, lens, scale: float) -> None:
    """Our Triton decode vs FlashInfer's MLA paged decode, both on bf16 copies of the inputs."""
    from benchmarks.baselines import FlashInferMLADecode

    q_lat, q_rope, cache = (x.to(torch.bfloat16) for x in (q_lat, q_rope, cache))
    ref = paged_mla_decode(q_lat, q_rope, cache, tables, lens, scale=scale, impl="naive")
    fi = FlashInferMLADecode(cache, tables, lens, num_heads=q_lat.shape[1], latent_dim=q_lat.shape[2], scale=scale,
                             q_dtype=q_lat.dtype)
    print(f"mla_decode bf16: FlashInfer rel. err {rel_err(fi(q_lat, q_rope), ref):.2e} (vs the torch path)")
    ours = bench(lambda: paged_mla_decode(q_lat, q_rope, cache, tables, lens, scale=scale, impl="triton", check=False),
                 run.device, run.args.repeats)
    theirs = bench(lambda: fi(q_lat, q_rope), run.device, run.args.repeats)
    print(f"mla_decode bf16: triton {ours * 1e3:.3f} ms, FlashInfer {theirs * 1e3:.3f} ms")
    run.figures["mla_decode_vs_flashinfer"] = theirs / ours


def _grads(q, k, v, g, beta, d_o, impl: str, chunk=None) -> tuple[torch.Tensor, ...]:
    """d<o, d_o>/d(q, k, v, g, beta) through chunk_kda(impl) (or `chunk`, a callable with its signature)."""
    leaves = tuple(x.detach().requires_grad_() for x in (q, k, v, g, beta))
    o = (chunk or (lambda *a: chunk_kda(*a, impl=impl)[0]))(*leaves)
    return torch.autograd.grad((o.float() * d_o).sum(), leaves)


def _kda_chunk_backward(run: _Run) -> None:
    args, device, randn = run.args, run.device, run.randn
    H, K, _, _, T, *_ = run.shapes
    T = min(T, 1024) if not args.small else 40  # the torch side keeps a graph per 64-token segment
    q, k = F.normalize(randn(1, T, H, K), dim=-1), F.normalize(randn(1, T, H, K), dim=-1)
    v, g, beta = randn(1, T, H, K), F.logsigmoid(randn(1, T, H, K)), torch.sigmoid(randn(1, T, H))
    d_o = randn(1, T, H, K)  # [1, T, H, V], V = K
    grads, times = {}, {}
    for impl in run.impls:
        grads[impl] = _grads(q, k, v, g, beta, d_o, impl)
        times[impl] = bench(lambda: _grads(q, k, v, g, beta, d_o, impl), device, max(1, args.repeats // 3))
    print(f"kda_chunk forward+backward T={T} H={H} K=V={K}: "
          + ", ".join(f"{i} {t * 1e3:.1f} ms" for i, t in times.items()))
    if run.with_triton:
        run.errors += [rel_err(a, b) for a, b in zip(grads["triton"], grads["naive"])]
        run.figures["kda_chunk_bwd_speedup"] = times["naive"] / times["triton"]
    if run.has("fla"):
        from benchmarks.baselines import fla_chunk

        def fla(*a):
            return fla_chunk(*a, scale=K ** -0.5, initial_state=None)[0]

        run.errors += [rel_err(a, b) for a, b in zip(_grads(q, k, v, g, beta, d_o, "", fla), grads["naive"])]
        fla_s = bench(lambda: _grads(q, k, v, g, beta, d_o, "", fla), device, max(1, args.repeats // 3))
        print(f"kda_chunk forward+backward fla chunk_kda {fla_s * 1e3:.1f} ms")
        run.figures["kda_chunk_bwd_vs_fla"] = fla_s / times["triton"]


if __name__ == "__main__":
    main()
