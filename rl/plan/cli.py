"""The memory planner: `python -m rl.plan [cluster=<preset>] [cluster.key=value] [plan.key=value] [parallel.expert=N] [parallel.context=C] <rl.train overrides>`.

Composes the same config as `python -m rl.train` (configs/config.yaml, the same overrides), plus a
cluster preset (configs/cluster/<preset>.yaml: cpu, h200x8, h200x8x2; `cluster.*` overrides),
the planner's workload options (`plan.seq_len`, `plan.png`; rl/plan/cluster.py). The run config
is composed for the cluster's world (its rank checks, parallel.expert among them, see WORLD_SIZE =
the cluster's ranks). Prints, for one
rank, every memory consumer's bytes on each tier in each phase of a steady-state iteration
(rl/plan/model.py: the formulas and helpers the run itself uses), whether each tier fits the
cluster in every phase (device per GPU; host and NVMe per node, i.e. ranks per node x one rank),
the largest engine.pool_mb the rollout phase leaves room for, the longest context one
sequence's KV fits in the pool, and its own wall time. Exit status 1 when a tier does not fit (each one named, with the
phase and the shortfall), 2 on a bad config. `plan.png=<path>` draws the planned timeline the way a
run draws its memory.png (rl/run/tracking.py), from the same records phases.jsonl would hold.

    python -m rl.plan cluster=h200x8 model=kimi_linear_48b_a3b experiment.dtype=bf16 ...
"""
from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from rl.config import RunConfig
from rl.config.compose import CONFIGS, compose_run_config
from rl.plan.cluster import GIB, ClusterConfig, PlanOptions
from memory.tiers import DEVICE_KEYS, DISK_KEYS, HOST_KEYS
from rl.plan.model import (PhaseMemory, Sizes, expert_parallel_size, host_budget_bytes, meta_policy, plan_phases,
                           plan_sizes)
from rl.run.tracking import plot_memory
from trainer.chunks import chunk_specs


@dataclass(frozen=True)
class Verdict:
    tier: str
    """"device" (per GPU), "host" (per node), "disk" (per node), "device+host" (device_is_host),
    "startup" (host per node at start-up or resume: `Sizes.startup_host_peak` x ranks), or "pool":
    one sequence of engine.max_model_len in the KV pool (the engine refuses to start otherwise)."""
    need_bytes: int
    """The most the tier holds in any phase."""
    capacity_bytes: int
    phase: str
    """The phase where it holds the most."""

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.capacity_bytes


@dataclass(frozen=True)
class Plan:
    cfg: RunConfig
    cluster: ClusterConfig
    sizes: Sizes
    phases: list[PhaseMemory]
    verdicts: list[Verdict]
    max_pool_mb: int
    """The largest engine.pool_mb every phase holding the pool leaves room for (0: none)."""
    seconds: float
    """Wall time of planning it (`make_plan`)."""

    @property
    def fits(self) -> bool:
        return all(v.fits for v in self.verdicts)

    def steady(self) -> list[PhaseMemory]:
        return [p for p in self.phases if p.iteration == 1]

    def longest_context(self, pool_pages: int) -> int:
        """Tokens of the longest sequence whose KV fits `pool_pages` pages (rollout/kv/cache_manager.py
        `pages_for_tokens`: one KDA state page per KDA group, ceil(tokens / block_tokens) pages per
        MLA group)."""
        layout = self.sizes.layout
        kda, mla = len(layout.kda_groups), len(layout.mla_groups)
        if pool_pages < kda + mla:
            return 0
        return (pool_pages - kda) // mla * layout.block_tokens if mla else sys.maxsize


host_capacity_bytes = host_budget_bytes  # one node's host budget (rl/plan/model.py)


def device_need(sizes: Sizes, phase: PhaseMemory) -> int:
    """Device bytes of one rank at the phase's peak: its logged total, and in the train phase the
    transients beside the activations (`Sizes.train_transient`: the chunk-input stash, or the
    optimizer's all-gather temporaries)."""
    extra = sizes.train_transient - sizes.activation_peak if phase.phase == "train" else 0
    return phase.memory["device_total"] + extra


def make_plan(cfg: RunConfig, cluster: ClusterConfig, options: PlanOptions = PlanOptions()) -> Plan:
    """The plan of `cfg` on `cluster`: sizes, per-phase bytes, a verdict per tier, the largest pool."""
    start = time.perf_counter()
    sizes = plan_sizes(cfg, cluster, options, cfg.parallel.context)
    phases = plan_phases(cfg, sizes, cluster.world)
    ranks = cluster.gpus_per_node
    host_cap = host_capacity_bytes(cfg, cluster)

    def verdict(tier: str, need, capacity: int) -> Verdict:
        worst = max(phases, key=need)
        return Verdict(tier, need(worst), capacity, worst.phase)

    if cluster.device_is_host:  # one memory: every rank's device and host bytes share the node's DRAM
        device_cap = host_cap // ranks
        verdicts = [verdict("device+host", lambda p: ranks * (device_need(sizes, p) + p.memory["host_total"]),
                            host_cap)]
    else:
        device_cap = int(cluster.gpu_memory_gib * GIB)
        verdicts = [verdict("device", lambda p: device_need(sizes, p), device_cap),
                    verdict("host", lambda p: ranks * (p.memory["host_total"] + sizes.grad_staging), host_cap)]
    verdicts.append(verdict("disk", lambda p: ranks * p.memory["disk_total"], int(cluster.nvme_gib * GIB)))
    verdicts.append(Verdict("startup", ranks * sizes.startup_host_peak, host_cap, "start"))
    longest = cfg.engine.longest_kv_tokens  # a KV budget caps what one sequence holds
    verdicts.append(Verdict("pool", sizes.layout.sequence_pages(longest) * sizes.layout.page_bytes, sizes.pool, "rollout"))
    # The pool gets whatever device memory the phases that hold it leave free (all of them when it
    # is not released for training).
    holding = [p for p in phases if not cfg.memory.release_pool_in_train
               or p.phase in ("wake", "load_weights", "rollout")]
    headroom = [device_cap - (device_need(sizes, p) - p.memory["device_pool"])
                - (p.memory["host_total"] if cluster.device_is_host else 0) for p in holding]
    return Plan(cfg, cluster, sizes, phases, verdicts, max(0, min(headroom, default=0)) >> 20,
                time.perf_counter() - start)


WORKLOAD_48B = ("experiment.dtype=bf16", "trainer.num_chunks=27", "rollout.groups_per_iteration=8",
                "memory.reference=stream", "algo.loss.kl_coef=0.01", "memory.spill_dir=/local_nvme/spill",
                "engine.max_model_len=8192", "trainer.micro_batch_tokens=8192", "engine.pool_mb=20480")
"""docs/plan-48b.md's workload: bf16, one layer per chunk, 16 sequences of 8k tokens per rank (one per
micro-batch), a streamed KL reference, the optimizer states spilled to NVMe, a 20 GiB pool."""


def plan_summary(model: str, cluster: str, expert: int = 1, overrides: list[str] | tuple[str, ...] = WORKLOAD_48B
                 ) -> dict:
    """The headline figures of `python -m rl.plan model=<model> cluster=<cluster> parallel.expert=<expert>
    *overrides`, for benchmarks: device weights per GPU (gpu_weights_gib), the largest engine.pool_mb
    that fits (largest_pool_gib), the train phase's device peak (train_device_gib), whether every tier
    fits, and the planning wall time in seconds (seconds: composition and plan)."""
    start = time.perf_counter()
    cfg, cluster_config, options = compose_plan_inputs(
        [f"model={model}", f"cluster={cluster}", f"parallel.expert={expert}", *overrides])
    plan = make_plan(cfg, cluster_config, options)
    train = next(p for p in plan.steady() if p.phase == "train")
    return {"gpu_weights_gib": plan.sizes.weights / GIB, "largest_pool_gib": plan.max_pool_mb / 1024,
            "train_device_gib": device_need(plan.sizes, train) / GIB, "fits": plan.fits,
            "seconds": time.perf_counter() - start}


def fmt_bytes(n: int) -> str:
    if n == 0:
        return "0"
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n} B"


def render(plan: Plan, console: Console) -> None:
    """Print the plan: the per-phase table (one rank, steady state), the verdicts, pool and context."""
    cfg, cluster, sizes = plan.cfg, plan.cluster, plan.sizes
    steady = plan.steady()
    console.print(f"[bold]memory plan[/bold]: model {cfg.model.num_hidden_layers} layers, "
                  f"{fmt_bytes(sizes.weights)} of weights per GPU ({cfg.experiment.dtype}; "
                  f"{fmt_bytes(sizes.weights_replicated)} replicated + {fmt_bytes(sizes.weights_routed)} routed experts, "
                  f"parallel.expert={sizes.expert_parallel}), cluster {cluster.name}: {cluster.nodes} x "
                  f"{cluster.gpus_per_node} ranks (world {cluster.world}); trainer.num_chunks={cfg.trainer.num_chunks}, "
                  f"engine.pool_mb={cfg.engine.pool_mb}, memory.reference={cfg.memory.reference}, "
                  f"memory.spill_dir={cfg.memory.spill_dir}, {sizes.num_train_tokens:,} trained tokens per rank "
                  f"(micro_batch_tokens={cfg.trainer.micro_batch_tokens})")
    console.print(_phase_table(plan, steady))
    for v in plan.verdicts:
        scope = {"device": "per GPU", "pool": f"one sequence of max_model_len={cfg.engine.max_model_len:,}",
                 "startup": "host per node, start-up or resume"}.get(v.tier, "per node")
        if v.fits:
            console.print(f"{v.tier} ({scope}): fits, {fmt_bytes(v.need_bytes)} of {fmt_bytes(v.capacity_bytes)} "
                          f"at most (in {v.phase})")
        else:
            console.print(f"[red]{v.tier} ({scope}): does not fit[/red]: {fmt_bytes(v.need_bytes)} in {v.phase}, "
                          f"{fmt_bytes(v.capacity_bytes)} available ({fmt_bytes(v.need_bytes - v.capacity_bytes)} short)")
    _render_activations(plan, console)
    train = next(p for p in steady if p.phase == "train")
    console.print(f"chunk-input stash (device, train forward/backward): {fmt_bytes(sizes.chunk_input_stash)}; "
                  f"optimizer all-gather temporaries (device, optimizer step): {fmt_bytes(sizes.optimizer_gather_peak)}")
    console.print(f"train phase device peak (per GPU): {fmt_bytes(device_need(sizes, train))} (the table's train total "
                  f"less the activation peak, plus the larger of activations + stash and the all-gather temporaries)")
    locked = (f"; torch's caching host allocator locks {fmt_bytes(sizes.host_pool_locked)} for the host KV pool's "
              f"{fmt_bytes(sizes.host_pool)}" if sizes.host_pool_locked > sizes.host_pool else "")
    console.print(f"host pinned (per rank): {fmt_bytes(sizes.host_pinned)} (host KV pool + streamed reference + "
                  f"gradient staging {fmt_bytes(sizes.grad_staging)}, exact sizes){locked}")
    console.print(f"host at start-up (per rank): {fmt_bytes(sizes.startup_host_peak)} (this rank's weights in "
                  f"{cfg.experiment.dtype} while loading + its FP32 master shards)")
    layout = sizes.layout
    console.print(f"KV pool: {sizes.pool_pages:,} pages of {fmt_bytes(layout.page_bytes)} ({layout.block_tokens} "
                  f"tokens per MLA page; padding {layout.kda_padding_fraction:.1%} of each KDA page, "
                  f"{layout.mla_padding_fraction:.1%} of each MLA page); "
                  f"one sequence of engine.max_model_len={cfg.engine.max_model_len:,} "
                  f"takes {layout.sequence_pages(cfg.engine.max_model_len)} pages; longest context in this pool: "
                  f"{_tokens(plan.longest_context(sizes.pool_pages))} (rollout KV only: train at that length is another plan.seq_len)")
    max_pages = (plan.max_pool_mb << 20) // layout.page_bytes
    console.print(f"largest engine.pool_mb that fits: {plan.max_pool_mb:,} ({max_pages:,} pages; longest context "
                  f"{_tokens(plan.longest_context(max_pages))}, "
                  f"{max_pages // max(1, layout.sequence_pages(cfg.engine.max_model_len)):,} sequences of max_model_len "
                  f"at once)")
    if cfg.memory.spill_dir is not None:
        seconds = cluster.gpus_per_node * sizes.spill_payload / (cluster.nvme_gb_s * 1e9)
        console.print(f"NVMe: {fmt_bytes(sizes.spill_payload)} spilled per rank per iteration, ~{seconds:.1f} s each "
                      f"way for the node's {cluster.gpus_per_node} ranks at {cluster.nvme_gb_s} GB/s")


def _phase_table(plan: Plan, steady: list) -> Table:
    """The per-phase table of one rank's bytes by tier and consumer."""
    cluster = plan.cluster
    peak = max(v for p in steady for v in p.memory.values())
    unit, scale = ("GiB", GIB) if peak >= GIB else ("MiB", 1 << 20)
    table = Table(title=f"{unit} per rank by phase (steady-state iteration)")
    table.add_column("tier")
    table.add_column("consumer")
    for p in steady:
        table.add_column(p.phase, justify="right")

    def cells(values, bold: bool = False) -> list[str]:
        return [(f"[bold]{v / scale:,.2f}[/bold]" if bold else f"{v / scale:,.2f}") if v else "0" for v in values]

    for tier, keys in (("device", DEVICE_KEYS), ("host", HOST_KEYS), ("disk", DISK_KEYS)):
        for key in keys:
            table.add_row(tier, key.removeprefix(f"{tier}_") + ("*" if key == "host_parked" else ""),
                          *cells(p.memory[key] for p in steady))
        table.add_row(tier, "[bold]total[/bold]", *cells((p.memory[f"{tier}_total"] for p in steady), bold=True),
                      end_section=cluster.gpus_per_node == 1 or tier == "device")
        if tier != "device" and cluster.gpus_per_node > 1:
            table.add_row(tier, f"x {cluster.gpus_per_node} ranks (node)",
                          *cells(cluster.gpus_per_node * p.memory[f"{tier}_total"] for p in steady), end_section=True)
    table.caption = ("activation_peak: autograd's saved tensors, largest chunk x micro-batch (rl/plan/activation.py); "
                     "*parked: an upper bound, inside pool")
    return table


def _render_activations(plan: Plan, console: Console) -> None:
    """The chunk holding the activation peak and, under context parallelism, its exchange buffers."""
    cfg, sizes = plan.cfg, plan.sizes
    peaks = sizes.chunk_activation_peaks
    spec = chunk_specs(meta_policy(cfg), cfg.trainer.num_chunks, cfg.trainer.chunk_split)[(top := peaks.index(max(peaks)))]
    layers = spec.layers
    parts = ([f"layers {layers.start}-{layers.stop - 1}: " + ", ".join(
        f"{cfg.model.layer_types[i]}+{cfg.model.mlp_layer_types[i]}" for i in layers)] if layers else [])
    parts += (["head"] if spec.has_head else []) + (["embedding"] if spec.has_embedding else [])
    console.print(f"activation peak: chunk {top} of {len(peaks)} ({', '.join(parts)}), "
                  f"{fmt_bytes(peaks[top])} for micro-batches of {_tokens(max(sum(b) for b in sizes.micro_batches))}; "
                  f"smallest chunk peak {fmt_bytes(min(peaks))}")
    if sizes.context > 1:
        b = sizes.context_buffers
        console.print(f"context parallelism: parallel.context={sizes.context}, each rank holds 2 of {2 * sizes.context} "
                      f"fragments of every sequence; exchange buffers per layer (inside the activation peak): KDA "
                      f"states {fmt_bytes(b.kda_states)} + conv halos {fmt_bytes(b.kda_halos)}, MLA latents "
                      f"{fmt_bytes(b.mla_latents)}; in flight beside them: one key block's K/V and their gradients "
                      f"{fmt_bytes(2 * b.mla_block_kv)}")


def _tokens(n: int) -> str:
    return "unbounded (no MLA layer)" if n == sys.maxsize else f"{n:,} tokens"


def phase_records(plan: Plan) -> list[dict]:
    """The plan as phases.jsonl records (seconds 0), for rl/run/tracking.py's memory plot."""
    moved = {"sleep": plan.sizes.pool, "offload": plan.sizes.spill_payload if plan.cfg.memory.spill_dir else 0,
             "restore": plan.sizes.spill_payload}
    return [{"iteration": p.iteration, "phase": p.phase, "seconds": 0.0, "bytes_moved": moved.get(p.phase, 0),
             "memory": p.memory} for p in plan.phases]


@contextmanager
def world_size(world: int):
    """WORLD_SIZE set to `world` inside (the run config checks its rank rules against it)."""
    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world)
    try:
        yield
    finally:
        if saved is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = saved


def compose_plan_inputs(argv: list[str]) -> tuple[RunConfig, ClusterConfig, PlanOptions]:
    """Split the command line into the run's overrides (composed as rl.train composes them, for a
    world of the cluster's ranks), the cluster preset and its `cluster.*` overrides, and `plan.*`
    options. Raises ValueError (bad values, among them a parallel.expert that does not divide the
    world size or the expert count), FileNotFoundError (unknown preset) or Hydra/OmegaConf errors
    (unknown keys, bad types)."""
    preset, cluster_args, plan_args, run_args = "cpu", [], [], []
    for arg in argv:
        if arg.startswith("cluster="):
            preset = arg.split("=", 1)[1]
        elif arg.startswith("cluster."):
            cluster_args.append(arg.removeprefix("cluster."))
        elif arg.startswith("plan."):
            plan_args.append(arg.removeprefix("plan."))
        else:
            run_args.append(arg)
    path = CONFIGS / "cluster" / f"{preset}.yaml"
    if not path.exists():
        presets = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise FileNotFoundError(f"cluster={preset}: no preset {path}; presets: {', '.join(presets)}")
    cluster = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ClusterConfig), OmegaConf.load(path),
                                                  OmegaConf.from_dotlist(cluster_args)))
    options = OmegaConf.merge(OmegaConf.structured(PlanOptions), OmegaConf.from_dotlist(plan_args))
    with world_size(cluster.world):
        cfg = compose_run_config(run_args)
    expert_parallel_size(cfg, cluster)
    return cfg, cluster, OmegaConf.to_object(options)


def main(argv: list[str] | None = None, console: Console | None = None) -> int:
    """The command; returns the exit status (0 fits, 1 does not fit, 2 bad config)."""
    start = time.perf_counter()
    argv = sys.argv[1:] if argv is None else argv
    console = console or Console(width=None if sys.stdout.isatty() else 160)
    if any(a in ("-h", "--help") for a in argv):
        console.print(__doc__)
        return 0
    try:
        cfg, cluster, options = compose_plan_inputs(argv)
    except Exception as err:  # composition errors of every kind name the bad key or value
        console.print(f"[red]rl.plan: bad config[/red]: {type(err).__name__}: {err}")
        return 2
    plan = make_plan(cfg, cluster, options)
    render(plan, console)
    if options.png is not None:
        plot_memory(phase_records(plan), Path(options.png), last_iterations=2)
        console.print(f"memory timeline: {options.png}")
    console.print(f"planned in {time.perf_counter() - start:.1f} s (the activation probe ran "
                  f"{plan.sizes.activation_layer_runs} layer forwards on the meta device)")
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
