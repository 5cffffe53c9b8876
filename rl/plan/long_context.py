"""The 48B's million-token plan: which context x expert layouts train one 1M-token sequence per GPU.

    python -m rl.plan.long_context [--png docs/plan-1m.png]

Every row is `python -m rl.plan` (rl/plan/cli.py `make_plan`) for `model=kimi_linear_48b_a3b` on
a cluster preset with `parallel.context=C parallel.expert=EP` and WORKLOAD_1M: the same
composition and checks as `python -m rl.train`, the activations from the trainer's own layers on
the meta device at a rank's local tokens (rl/plan/context_memory.py), a one-sequence micro-batch
probed by `affine_activations` (seconds, not minutes). `--png` draws the per-GPU train peak
against sequence length (32k to 1M) for C = 1, 2, 4, 8, 16 on 2 x 8 H200 with the device limit.
Nothing here has run on a GPU: these are plans.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from omegaconf import OmegaConf

from rl.config.compose import CONFIGS
from rl.plan.cli import compose_plan_inputs, device_need, make_plan
from rl.plan.cluster import GIB, ClusterConfig

MILLION = 1 << 20
"""1,048,576 tokens: the sequence length planned."""
WORKLOAD_1M = ("experiment.dtype=bf16", "trainer.num_chunks=27", "algo.group_size=2", "trainer.micro_batch_tokens=8192",
               "memory.reference=stream", "algo.loss.kl_coef=0.01", "memory.spill_dir=/local_nvme/spill",
               "engine.pool_mb=20480", "warmup.steps=0", "plan.activation_probe=affine")
"""bf16, one layer per VPP chunk, one group of 2 samples per data-parallel replica (each rank trains
its 2F-token share of 2 sequences, one per micro-batch), a streamed KL reference, the optimizer
states spilled to NVMe, a 20 GiB KV pool, no supervised warm-up (refused under context parallelism)."""
LAYOUTS = {"h200x8": [(c, ep) for c in (1, 2, 4, 8) for ep in (4, 8)],
           "h200x8x2": [(c, ep) for c in (1, 2, 4, 8, 16) for ep in (8, 16)]}
"""(context, expert) pairs planned per cluster preset (world 8 and 16)."""
FIGURE_LENGTHS = (32768, 65536, 131072, 262144, 524288, MILLION)
FIGURE_CONTEXTS = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class LayoutPlan:
    """One layout's plan of 48B sequences of `seq_len` tokens, per GPU (GiB)."""

    cluster: str
    context: int
    expert: int
    seq_len: int
    fits: bool
    """Every tier fits (device, host, disk, start-up, one sequence's KV in the pool)."""
    train_device_gib: float
    """The train phase's device peak: weights, grad slots, activations with their transients, stash."""
    device_gib: float
    weights_gib: float
    activation_gib: float
    """The largest chunk's saved tensors (exchange buffers included) for one micro-batch."""
    cp_saved_gib: float
    """Per layer, the exchange buffers kept for backward: the largest of a KDA layer's gathered states
    and halos and an MLA layer's gathered latents (0 at C = 1)."""
    cp_in_flight_gib: float
    """One key block's K/V and their gradients, in flight beside the saved tensors (0 at C = 1)."""
    stash_gib: float
    """The chunk inputs of every micro-batch of the step (chunk-major micro-batches keep them)."""
    pool_sequences: int
    """Sequences of seq_len whose whole KV fits the largest pool rollout leaves room for on one GPU."""
    seconds: float
    """Wall time of composing and planning this row."""


def plan_layout(cluster: str, context: int, expert: int, seq_len: int = MILLION) -> LayoutPlan:
    """The 48B's plan on preset `cluster` at `parallel.context=context parallel.expert=expert` for
    sequences of `seq_len` tokens (one group per data-parallel replica). ValueError on a layout
    the run would refuse (C or EP not dividing the world, EP not dividing DP x C or the experts)."""
    start = time.perf_counter()
    args = [f"cluster={cluster}", "model=kimi_linear_48b_a3b", f"parallel.context={context}",
            f"parallel.expert={expert}", f"engine.max_model_len={seq_len}", *WORKLOAD_1M]
    cfg, cluster_config, options = compose_plan_inputs(
        [*args, f"rollout.groups_per_iteration={max(1, _world(cluster) // context)}"])
    plan = make_plan(cfg, cluster_config, options)
    sizes = plan.sizes
    train = next(p for p in plan.steady() if p.phase == "train")
    b = sizes.context_buffers
    max_pages = (plan.max_pool_mb << 20) // sizes.layout.page_bytes
    return LayoutPlan(
        cluster=cluster, context=context, expert=expert, seq_len=seq_len, fits=plan.fits,
        train_device_gib=device_need(sizes, train) / GIB, device_gib=cluster_config.gpu_memory_gib,
        weights_gib=sizes.weights / GIB, activation_gib=sizes.activation_peak / GIB,
        cp_saved_gib=max(b.kda_states + b.kda_halos, b.mla_latents) / GIB, cp_in_flight_gib=2 * b.mla_block_kv / GIB,
        stash_gib=sizes.chunk_input_stash / GIB, pool_sequences=max_pages // sizes.layout.sequence_pages(seq_len),
        seconds=time.perf_counter() - start)


def _world(cluster: str) -> int:
    """GPUs of preset `cluster` (configs/cluster/<cluster>.yaml)."""
    preset = OmegaConf.merge(OmegaConf.structured(ClusterConfig), OmegaConf.load(CONFIGS / "cluster" / f"{cluster}.yaml"))
    return OmegaConf.to_object(preset).world


def plan_1m(layouts: dict[str, list[tuple[int, int]]] = LAYOUTS) -> list[LayoutPlan]:
    """`plan_layout` at 1M tokens for every (context, expert) of every preset in `layouts`."""
    return [plan_layout(cluster, c, ep) for cluster, pairs in layouts.items() for c, ep in pairs]


def format_row(r: LayoutPlan) -> str:
    return (f"{r.cluster:9s} C={r.context:<2d} EP={r.expert:<2d} {'fits' if r.fits else 'does not fit':12s} "
            f"train {r.train_device_gib:8.1f} of {r.device_gib:.0f} GiB: weights {r.weights_gib:.2f}, activations "
            f"{r.activation_gib:7.1f} (CP buffers {r.cp_saved_gib:.2f} saved per layer, {r.cp_in_flight_gib:.2f} in "
            f"flight), stash {r.stash_gib:6.1f}; pool holds {r.pool_sequences} x 1M; planned in {r.seconds:.1f} s")


def draw(path: str, cluster: str = "h200x8x2", expert: int = 8) -> list[LayoutPlan]:
    """The figure of docs/plan-1m.md: per-GPU train peak vs sequence length, one line per C."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [plan_layout(cluster, c, expert, n) for c in FIGURE_CONTEXTS for n in FIGURE_LENGTHS]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c in FIGURE_CONTEXTS:
        mine = [r for r in rows if r.context == c]
        ax.plot([r.seq_len for r in mine], [r.train_device_gib for r in mine], marker="o", label=f"C = {c}")
    ax.axhline(rows[0].device_gib, color="red", linestyle="--", label=f"H200 ({rows[0].device_gib:.0f} GiB)")
    ax.set(xscale="log", yscale="log", xlabel="tokens per sequence", ylabel="train peak per GPU (GiB)",
           title=f"Kimi-Linear-48B-A3B, {cluster}, EP = {expert}: planned, not run")
    ax.set_xticks(FIGURE_LENGTHS, [f"{n // 1024}k" for n in FIGURE_LENGTHS])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--png", help="draw the per-GPU train peak vs length for C = 1..16 here")
    args = p.parse_args(argv)
    for row in plan_1m():
        print(format_row(row), flush=True)
    if args.png:
        for r in draw(args.png):
            print(f"figure: C={r.context:<2d} {r.seq_len:>9,} tokens: train {r.train_device_gib:8.1f} GiB", flush=True)
        print(f"figure: {args.png}")


if __name__ == "__main__":
    main()
