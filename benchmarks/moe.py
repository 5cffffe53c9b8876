"""Routed MoE experts: the sync-free grouped path vs the per-expert loop (and the padded form), one run.

    python -m benchmarks.moe                       # 64 experts top-8, hidden 256, 512 tokens
    python -m benchmarks.moe --backward            # forward + backward instead of forward only
    python -m benchmarks.moe --num-experts 256 --hidden 2304 --inter 1024 --dtype bf16   # Kimi-Linear-48B sizes

Each path runs `models.mlp` on the same random routing (each token's top-k of uniform scores, so
the load is even on average). `grouped` is what `Experts(impl="auto")` runs for many experts:
`torch._grouped_mm` where `models.mlp.grouped_mm_usable` allows it, else the padded form; `padded`
forces the padded form; `dense` runs every expert on every token (what few experts run). Final line:
moe_grouped_vs_loop=<loop_s / grouped_s> moe_padded_vs_loop=... moe_dense_vs_loop=... grouped_backend=...
max_rel_err=...
(> 1 means faster than the loop; on a GPU the loop also waits for the host once per expert).
`measure` is the same measurement as a function, for other benchmarks.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from benchmarks import parse_args
from benchmarks.kernels import bench
from models.mlp import experts_dense, experts_grouped, experts_loop, grouped_mm_usable
from models.precision import DTYPES



def measure(num_experts: int, top_k: int, hidden: int, inter: int, num_tokens: int, dtype: torch.dtype = torch.float32,
            repeats: int = 3, *, backward: bool = False, device: torch.device | None = None,
            paths: tuple[str, ...] = ("grouped",)) -> dict[str, float | str]:
    """Median seconds of the loop and of `paths` (of "grouped", "padded", "dense") on one random
    routing: `{path}_s`, `{path}_vs_loop` (loop_s / path_s), max_rel_err (the paths' outputs against
    the loop's) and grouped_backend. backward=True times forward + backward of the output's sum."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * scale).to(device, dtype).requires_grad_(backward)

    x = rand(num_tokens, hidden)
    w1 = rand(num_experts, inter, hidden, scale=hidden ** -0.5)
    w3 = rand(num_experts, inter, hidden, scale=hidden ** -0.5)
    w2 = rand(num_experts, hidden, inter, scale=inter ** -0.5)
    routing = torch.rand(num_tokens, num_experts, generator=gen).topk(top_k, dim=-1)  # [N, top_k] each
    weights, ids = routing.values.to(device), routing.indices.to(device)
    every = {"loop": lambda: experts_loop(x, weights, ids, w1, w2, w3),
             "grouped": lambda: experts_grouped(x, weights, ids, w1, w2, w3),
             "padded": lambda: experts_grouped(x, weights, ids, w1, w2, w3, padded=True),
             "dense": lambda: experts_dense(x, weights, ids, w1, w2, w3)}
    timed = {name: every[name] for name in ("loop", *paths)}

    def run(path: Callable[[], torch.Tensor]) -> torch.Tensor:
        with torch.set_grad_enabled(backward):
            out = path()
            if backward:
                torch.autograd.grad(out.float().sum(), (x, w1, w2, w3))
        return out

    result: dict[str, float | str] = {"grouped_backend": "grouped_mm" if grouped_mm_usable(x, w1) else "padded"}
    outputs = {name: run(path).detach().double() for name, path in timed.items()}
    result["max_rel_err"] = max(((outputs[name] - outputs["loop"]).norm() / outputs["loop"].norm()).item()
                                for name in paths)
    for name, path in timed.items():
        result[f"{name}_s"] = bench(lambda: run(path), device, repeats)
    for name in paths:
        result[f"{name}_vs_loop"] = result["loop_s"] / result[f"{name}_s"]
    return result


def main(argv: list[str] | None = None) -> dict[str, float | str]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--inter", type=int, default=256)
    p.add_argument("--num-tokens", type=int, default=512)
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backward", action="store_true", help="time forward + backward")
    args = parse_args(p, argv, quick={"num_tokens": 128, "repeats": 1})
    r = measure(args.num_experts, args.top_k, args.hidden, args.inter, args.num_tokens, DTYPES[args.dtype],
                args.repeats, backward=args.backward, paths=("grouped", "padded", "dense"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"{args.num_experts} experts top-{args.top_k}, hidden {args.hidden}, inter {args.inter}, "
          f"{args.num_tokens} tokens, {args.dtype} on {device}, {'forward+backward' if args.backward else 'forward'}")
    for name in ("loop", "grouped", "padded", "dense"):
        print(f"  {name:8s} {r[f'{name}_s'] * 1e3:9.2f} ms")
    print(f"moe_grouped_vs_loop={r['grouped_vs_loop']:.2f} moe_padded_vs_loop={r['padded_vs_loop']:.2f} "
          f"moe_dense_vs_loop={r['dense_vs_loop']:.2f} grouped_backend={r['grouped_backend']} "
          f"max_rel_err={r['max_rel_err']:.2e}")
    return r


if __name__ == "__main__":
    main()
