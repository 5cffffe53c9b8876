"""Expert parallelism over 2 gloo processes (each holding half of every MoE layer's experts) against
one process holding them all, in the same run, plus the start-up's host peak and the planner.

    python -m benchmarks.expert_parallel [--quick]

On a tiny-shaped model whose routed experts are most of its weights (32 experts): the logits of a
batch, one train step with several micro-batches (gradient reductions per chunk per step), greedy
decoding with the prefix cache on (each rank decodes its own prompts), and each rank's device
weight bytes. The start-up: a subprocess per path materialises the policy from a checkpoint with
rl/run/build.py `initial_policy` (the lean path: meta build, this rank's tensors read alone; the
one-rank path: the whole model built, then loaded), its peak RSS growth over the bytes it keeps
(measured from after a first meta build, whose one-time import of torch code is not the model's).
The planner (rl/plan): its weights, gradient slots and host states per rank against the measured
ones at EP 1 and 2, and the 48B at parallel.expert=8 on h200x8 (its weights per GPU, largest KV
pool and planning seconds).

Last line: ep_logits_max_abs_err= ep_greedy_tokens_equal= ep2_device_weight_bytes_vs_ep1=
grad_reductions_per_chunk_per_step= startup_host_peak_vs_shard= plan_48b_ep8_gpu_weights_gib=
plan_48b_ep8_largest_pool_gib= plan_48b_seconds= planner_max_rel_err= (targets: <= 1e-6, 1, <= 0.6,
1, <= 1.5, <= 16, >= 90, <= 30, <= 0.05), then the one-rank start-up ratio and the expert share.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks import parse_args

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["num_experts=32", "moe_intermediate_size=64"]
"""The tiny config with 32 experts: the routed experts are ~86% of its weights."""
STARTUP_MODEL = [*MODEL, "hidden_size=256", "moe_intermediate_size=256", "intermediate_size=512",
                 "linear_head_dim=128", "kv_lora_rank=128"]
"""A larger shape for the start-up, so that its bytes stand well above the RSS noise (~190 MB)."""
PROMPTS = [[5, 6, 7] * 7, [9] * 30, [5, 6, 7] * 7 + [11, 12], [40, 41] * 9, [3] * 17, [7, 8] * 12]
MICRO_BATCH_TOKENS = 40
NUM_CHUNKS = 4


def model_config(overrides: list[str]):
    from models.config import load_model_config

    return load_model_config(ROOT / "configs/model/tiny.yaml", overrides)


def batch():
    gen = torch.Generator().manual_seed(0)
    lens = [33, 9, 50, 17, 21, 12]
    n = sum(lens)
    return lens, torch.randint(0, 259, (n,), generator=gen), torch.randint(0, 259, (n,), generator=gen)


def measure(model, ranks: int, rank: int, new_tokens: int) -> dict:
    """Logits, one train step on this rank's share (sequences and prompts round robin), greedy
    tokens twice (the second pass hits the prefix cache) and the bytes held."""
    from rollout.engine import Engine, EngineConfig
    from rollout.kv import PrefixCacheConfig
    from rollout.sampling import SamplingParams
    from trainer.host_adam import OptimizerConfig
    from trainer.step import Trainer, TrainerConfig

    lens, tokens, targets = batch()
    out: dict = {"weight_bytes": sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])}
    with torch.no_grad():
        out["logits"] = model(tokens[:64].view(2, 32))
    group = ep = None
    if ranks > 1:
        from megatron.core import parallel_state
        group, ep = parallel_state.get_data_parallel_group(), parallel_state.get_expert_data_parallel_group()
    trainer = Trainer(model, TrainerConfig(num_chunks=NUM_CHUNKS, optimizer=OptimizerConfig(lr=1e-3, eps=1e-4,
                                                                                            backend="torch")),
                      group=group, expert_group=ep)
    mine = [i for i in range(len(lens)) if i % ranks == rank]
    offsets = [sum(lens[:i]) for i in range(len(lens) + 1)]
    rows = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in mine])
    m = trainer.train_step(tokens[rows], [lens[i] for i in mine], targets[rows],
                           lambda lp, r, s: -lp.sum() / tokens.numel(), micro_batch_tokens=MICRO_BATCH_TOKENS)
    out.update(micro_batches=m["micro_batches"], reductions=trainer.num_grad_reductions,
               grad_slot_bytes=trainer.arena.total_bytes, host=trainer.optimizer.host_bytes_by_kind())
    engine = Engine(model, EngineConfig.for_pages(model, 64, max_model_len=160,
                                                  prefix_cache=PrefixCacheConfig(hash_block=16, model_id="bench")))
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    prompts = [p for i, p in enumerate(PROMPTS) if i % ranks == rank]
    out["tokens"] = [[o.samples[0].tokens for o in engine.generate(prompts, params)] for _ in range(2)]
    out["prefix_hits"] = engine.stats().get("prefix_hit_tokens", 0)
    return out


def worker(rank: int, world: int, init_file: str, out_dir: str, new_tokens: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from megatron.core import parallel_state

    try:
        from models.model import HybridLM
        from rl.run.ranks import expert_groups

        ep, _ = expert_groups(world)
        model = HybridLM(model_config(MODEL), ep).init_weights(seed=1)
        torch.save(measure(model, world, rank, new_tokens), Path(out_dir) / f"rank{rank}.pt")
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


# ---- start-up: a fresh process per path ----------------------------------------------------------------
def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def startup_child(checkpoint: str, expert: int) -> None:
    """Materialise the policy from `checkpoint` as rank 0 of `expert` would (1: the whole model), print JSON."""
    from models.expert_parallel import ExpertParallel
    from rl.config.compose import compose_run_config
    from rl.run.build import initial_policy

    os.environ["WORLD_SIZE"] = str(expert)  # the composition checks parallel.expert against it
    cfg = compose_run_config(["~experiment", "tracking.wandb_mode=disabled", f"experiment.checkpoint={checkpoint}",
                              f"parallel.expert={expert}", *(f"model.{o}" for o in STARTUP_MODEL)])
    ep = ExpertParallel(None, 0, expert) if expert > 1 else None
    from models.model import HybridLM

    with torch.device("meta"):  # the meta device's first use imports ~75 MB of torch's Python code: not the model's
        HybridLM(cfg.model, ep)
    before = _rss("VmRSS")
    model = initial_policy(cfg, ep)
    peak = _rss("VmHWM") - before
    kept = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    print(json.dumps({"peak": peak, "kept": kept}))


def startup(tmp: Path) -> dict[str, float]:
    from models.checkpoint import save_checkpoint
    from models.model import HybridLM

    path = tmp / "startup_ckpt"
    save_checkpoint(HybridLM(model_config(STARTUP_MODEL)).init_weights(seed=2), path)
    out = {}
    for expert in (2, 1):
        done = subprocess.run([sys.executable, "-m", "benchmarks.expert_parallel", "--startup-child", str(path),
                               "--expert", str(expert)], cwd=ROOT, capture_output=True, text=True, check=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        fig = json.loads(done.stdout.strip().splitlines()[-1])
        out[expert] = fig["peak"] / fig["kept"]
        print(f"start-up at parallel.expert={expert}: keeps {fig['kept'] / 2**20:.1f} MiB, host peak growth "
              f"{fig['peak'] / 2**20:.1f} MiB ({out[expert]:.2f}x)")
    return out


# ---- the planner -----------------------------------------------------------------------------------------
def planner_errors(measured: dict[int, dict]) -> float:
    """Max relative error of the planner's per-rank weights, gradient slots, host masters and
    moments against the measured ones at parallel.expert 1 and 2."""
    from rl.config.compose import compose_run_config
    from rl.plan.cluster import ClusterConfig, PlanOptions
    from rl.plan.model import plan_sizes

    lens, _, _ = batch()
    errors = []
    for expert, fig in measured.items():
        saved = os.environ.get("WORLD_SIZE")
        os.environ["WORLD_SIZE"] = str(expert)
        try:
            cfg = compose_run_config(["~experiment", "tracking.wandb_mode=disabled", f"parallel.expert={expert}",
                                      *(f"model.{o}" for o in MODEL), f"trainer.num_chunks={NUM_CHUNKS}",
                                      "engine.host_pool_mb=0", "algo.loss.kl_coef=0"])
        finally:
            os.environ.pop("WORLD_SIZE") if saved is None else os.environ.update(WORLD_SIZE=saved)
        sizes = plan_sizes(cfg, ClusterConfig(name="cpu", gpus_per_node=expert, device_is_host=True),
                           PlanOptions(seq_len=max(lens)))
        planned = {"weights": sizes.weights, "grad_slots": sizes.grad_slots, "masters": sizes.masters,
                   "moments": sizes.moments + sizes.moment_steps}
        got = {"weights": fig["weight_bytes"], "grad_slots": fig["grad_slot_bytes"], "masters": fig["host"]["masters"],
               "moments": fig["host"]["moments"]}
        row = {k: abs(planned[k] - got[k]) / got[k] for k in planned}
        print(f"planner vs measured at parallel.expert={expert}: " + ", ".join(
            f"{k} {planned[k] / 2**10:.1f}/{got[k] / 2**10:.1f} KiB ({row[k]:.1%})" for k in row))
        errors += row.values()
    return max(errors)


def plan_48b() -> dict[str, float]:
    """The 48B at parallel.expert=8 on h200x8 (rl/plan `plan_summary`)."""
    from rl.plan.cli import plan_summary

    return plan_summary("kimi_linear_48b_a3b", "h200x8", expert=8)


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=int, default=12, help="greedy tokens per prompt")
    p.add_argument("--startup-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--expert", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--skip-48b", action="store_true", help="leave out the 48B plan (its keys print nan)")
    args = parse_args(p, argv, {"new_tokens": 4, "skip_48b": True})
    if args.startup_child is not None:
        startup_child(args.startup_child, args.expert)
        return {}
    torch.set_num_threads(1)
    from models.model import HybridLM
    from trainer.shards import expert_parameters

    whole_model = HybridLM(model_config(MODEL)).init_weights(seed=1)
    expert_bytes = sum(p.numel() * p.element_size() for p, _ in expert_parameters(whole_model).values())
    share = expert_bytes / sum(p.numel() * p.element_size() for p in whole_model.parameters())
    whole = measure(whole_model, 1, 0, args.new_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(2, str(Path(tmp) / "init"), tmp, args.new_tokens), nprocs=2, join=True)
        ranks = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(2)]
        ratios = startup(Path(tmp))
    err = max((r["logits"] - whole["logits"]).abs().max().item() for r in ranks)
    same = all(r["tokens"][k] == [whole["tokens"][k][i] for i in range(len(PROMPTS)) if i % 2 == rank]
               for rank, r in enumerate(ranks) for k in range(2))
    weight_ratio = max(r["weight_bytes"] for r in ranks) / whole["weight_bytes"]
    reductions = max(r["reductions"] for r in ranks) / NUM_CHUNKS
    print(f"model: tiny shape with 32 experts, routed experts {share:.1%} of the weights; 2 ranks over gloo, "
          f"micro-batches per rank {[int(r['micro_batches']) for r in ranks]}, one rank {int(whole['micro_batches'])}")
    print(f"logits max |EP=2 - one rank| {err:.2e}; greedy tokens equal {same} (prefix hits "
          f"{[r['prefix_hits'] for r in ranks]}); device weights per rank {weight_ratio:.3f} of one rank's")
    plan_err = planner_errors({1: whole, 2: ranks[0]})
    plan = {"gpu_weights_gib": float("nan"), "largest_pool_gib": float("nan"), "seconds": float("nan")}
    if not args.skip_48b:
        plan = plan_48b()
        print(f"48B at parallel.expert=8 on h200x8: {plan['gpu_weights_gib']:.1f} GiB of weights per GPU, largest KV "
              f"pool {plan['largest_pool_gib']:.1f} GiB, planned in {plan['seconds']:.1f} s")
    figures = {"ep_logits_max_abs_err": err, "ep_greedy_tokens_equal": float(same),
               "ep2_device_weight_bytes_vs_ep1": weight_ratio, "grad_reductions_per_chunk_per_step": reductions,
               "startup_host_peak_vs_shard": ratios[2], "plan_48b_ep8_gpu_weights_gib": plan["gpu_weights_gib"],
               "plan_48b_ep8_largest_pool_gib": plan["largest_pool_gib"], "plan_48b_seconds": plan["seconds"],
               "planner_max_rel_err": plan_err, "startup_one_rank_peak_vs_model": ratios[1], "expert_share": share}
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items()))
    return figures


if __name__ == "__main__":
    main()
