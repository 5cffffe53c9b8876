"""Real sizes on CPU: the middle model (configs/model/kimi_linear_mid.yaml, 0.43B) in fp32 and in
bf16, one engine generate and one train step each, in the same run.

    python -m benchmarks.scale [--quick]        # --quick: the tiny model, small sizes (a smoke run)

Per dtype, the parts come from `rl.train.build` (the policy drawn in FP32 from the run's seed and
cast to `experiment.dtype`, the engine on the policy's own tensors, the trainer with FP32 gradient
slots and host AdamW), with `engine.max_model_len=256`, `trainer.num_chunks=--chunks`,
`trainer.chunk_split=--chunk-split`, no KL reference. Measured:
- (a) device bytes, the peak over the iteration's phases: the policy's weights + the engine's
  weight storage not shared with the policy + the trainer's gradient slots (FP32 in both dtypes,
  allocated bytes), plus the larger of the KV pool pages the generate used (peak pages x page
  bytes, not the configured pool; released while training) and the train step's activation peak
  (tensors saved for backward and each VPP chunk's kept input, one live set:
  benchmarks/train_step.py's meter). --chunks defaults to layers + 2 split by parameters (the
  embedding, each layer and the head a chunk of its own), the leanest split: two slots of the
  largest chunk's FP32 gradients. Not counted: host states
  (FP32 masters, AdamW moments), and the CPU-only fused projection copies the engine makes while it
  generates (printed; dropped at sleep, none on CUDA).
- (b) one greedy generate: --prompts prompts of 32..63 tokens x --new-tokens new tokens; seconds,
  and the share of bf16's tokens equal to fp32's.
- (c) one `Trainer.train_step` on --train-seqs random sequences x --train-len tokens; seconds.
- host syncs of a decode step (tests/sync_audit.py); the MoE's grouped vs per-expert-loop speed at
  this model's MoE shape and the train step's token count (benchmarks/moe.py, measured first); the
  memory planner's relative error (rl/plan/model.py `plan_sizes` on this run's config and train
  batch) on each consumer it sizes: weights, the whole pool, grad slots, the saved-tensor peak,
  host masters and moments.
The FP32 gradient slots are the same bytes in both dtypes, so the ratio is bounded below by
(2 W + S) / (4 W + S) for W parameters and S slot bytes: with the 48B's 27 layers, one per chunk,
S = 2 x 4 B x the largest layer ~ 0.3 B/parameter, a bound of 0.534 (at 12 layers split by layer
count, embedding and head riding with the end layers, it was 0.61).
Final line: device_bytes_bf16_vs_fp32= engine_extra_weight_bytes= host_syncs_per_decode_step=
moe_grouped_vs_loop= planner_max_rel_err= (targets: <= 0.55, 0, <= 2, a speed ratio, <= 0.05),
then the raw figures per dtype.
"""
from __future__ import annotations

import argparse
import gc
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.moe import measure as measure_moe
from benchmarks.train_step import SavedTensorMeter
from models.config import ModelConfig, load_model_config
from rl.config import RunConfig
from rl.config.compose import compose_run_config
from rl.plan.cluster import ClusterConfig, PlanOptions
from rl.plan.model import plan_sizes
from rl.run.build import build
from rl.run.loop import LoopParts
from rollout.engine import Engine
from rollout.sampling import SamplingParams
from tests.sync_audit import audit_step
from trainer.chunks import CHUNK_SPLITS
from trainer.step import Trainer

MAX_MODEL_LEN = 256
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def run_config(model: str, dtype: str, run_dir: Path, args: argparse.Namespace) -> RunConfig:
    """The composed RL config of one side (`model`: a configs/model/ name; `dtype`: "fp32" | "bf16"): the
    components' defaults and this benchmark's choices, not a demo's (`~experiment` drops the default
    experiment=cpu_demo, whose host KV pool, prefix cache, spill and warm-up are no part of this measurement)."""
    overrides = ["~experiment", "engine.host_pool_mb=0",  # device bytes: no host KV pool
                 f"model={model}", f"experiment.dtype={dtype}", f"run_dir={run_dir}", "tracking.wandb_mode=disabled",
                 "tracking.progress=false", f"engine.max_model_len={MAX_MODEL_LEN}", "engine.max_num_batched_tokens=4096",
                 f"engine.pool_mb={args.pool_mb}", f"trainer.num_chunks={args.chunks}",
                 f"trainer.chunk_split={args.chunk_split}", "algo.loss.kl_coef=0",
                 # the planner's train batch (groups x group_size sequences) is then the one measured here
                 "rollout.groups_per_iteration=1", f"algo.group_size={args.train_seqs}"]
    return compose_run_config(overrides)


# ---- measurements ------------------------------------------------------------------------------------
@dataclass
class DtypeFigures:
    cfg: RunConfig
    weight_bytes: int
    engine_extra_bytes: int
    pool_bytes: int
    """The pool pages the generate used at peak."""
    pool_allocated_bytes: int
    """The whole pool (engine.pool_mb worth of pages)."""
    fused_bytes: int
    """CPU-only fused projection copies held while generating (not in device_bytes)."""
    engine_s: float
    tokens: list[list[int]]
    syncs_per_decode_step: float
    slot_bytes: int
    activation_bytes: int
    """Peak of saved tensors + chunk inputs, one live set."""
    saved_bytes: int
    """Peak of the saved tensors alone (what rl/plan/activation.py predicts)."""
    host_state_bytes: dict[str, int]
    """The host optimizer's bytes by kind after the step (masters, grads, moments)."""
    train_s: float
    loss: float

    @property
    def device_bytes(self) -> int:
        """The run's device peak over its phases: weights and gradient slots are held throughout;
        the KV pool only while generating (released for training, memory.release_pool_in_train),
        the activations only while training."""
        return self.weight_bytes + self.engine_extra_bytes + self.slot_bytes + max(self.pool_bytes,
                                                                                  self.activation_bytes)

    def planned_tiers(self) -> dict[str, int]:
        """What the memory planner predicts, measured: its `Sizes` field -> bytes."""
        return {"weights": self.weight_bytes + self.engine_extra_bytes, "pool": self.pool_allocated_bytes,
                "grad_slots": self.slot_bytes, "activation_peak": self.saved_bytes,
                "masters": self.host_state_bytes["masters"], "moments": self.host_state_bytes["moments"]}


def storage_bytes(tensors) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def engine_extra_weight_bytes(parts: LoopParts) -> int:
    """Bytes of the engine model's parameter storage that is not the policy's."""
    policy = storage_bytes(parts.policy.parameters())
    return sum(n for ptr, n in storage_bytes(parts.engine.model.parameters()).items() if ptr not in policy)


def measure_generate(engine: Engine, prompts: list[list[int]], new_tokens: int
                     ) -> tuple[float, list[list[int]], int, int]:
    """One greedy generate -> (seconds, generated tokens per prompt, bytes of the pool pages it used
    at peak, fused weight copy bytes held after it)."""
    engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=2))  # lazy kernels and copies
    engine.peak_pages_used = 0
    t0 = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True))
    seconds = time.perf_counter() - t0
    return (seconds, [o.samples[0].tokens for o in outs], engine.peak_pages_used * engine.pool.page_bytes,
            engine.derived_weight_bytes())


def host_syncs_per_decode_step(engine: Engine, prompts: list[list[int]], num_steps: int = 4) -> float:
    """Mean would-be host syncs of `num_steps` pure decode steps (tests/sync_audit.py), after one
    step that prefills every prompt. Runs the prompts to completion on `engine`."""
    params = SamplingParams(temperature=0.0, max_new_tokens=num_steps + 2, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    engine.step()  # all prompts fit one step's token budget: this is the prefill
    syncs = [audit_step(engine)[0].total("sync") for _ in range(num_steps)]
    while engine.has_unfinished:
        engine.step()
    return sum(syncs) / len(syncs)


def measure_train_step(trainer: Trainer, seq_lens: list[int], vocab: int) -> tuple[float, int, int, float]:
    """One train step on random packed tokens -> (seconds, peak bytes of saved tensors + chunk
    inputs, peak bytes of saved tensors alone, loss). Mutates the policy's weights and the host optimizer."""
    gen = torch.Generator().manual_seed(1)
    num_tokens = sum(seq_lens)
    tokens = torch.randint(0, vocab, (num_tokens,), generator=gen)  # [N]
    targets = torch.randint(0, vocab, (num_tokens,), generator=gen)  # [N]
    meter, saved = SavedTensorMeter(), SavedTensorMeter()
    handles = meter.track_chunk_inputs(trainer)
    # Matmuls save the weights for backward: those are the parameters, counted as weights and alive
    # all along, so left out here as rl/plan/activation.py's meter leaves them out.
    weights = {t.untyped_storage()._cdata for t in [*trainer.model.parameters(), *trainer.model.buffers()]}

    def pack(t: torch.Tensor) -> torch.Tensor:
        return t if t.untyped_storage()._cdata in weights else saved.track(meter.track(t))

    t0 = time.perf_counter()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            metrics = trainer.train_step(tokens, seq_lens, targets, lambda lp, rows, seqs: -lp.sum() / num_tokens)
    finally:
        for handle in handles:
            handle.remove()
    return time.perf_counter() - t0, meter.peak, saved.peak, metrics["loss"]


def run_dtype(model: str, dtype: str, args: argparse.Namespace, prompts: list[list[int]], run_dir: Path
              ) -> DtypeFigures:
    """Build the run's parts in `dtype`, generate, put the engine to sleep, train one step."""
    cfg = run_config(model, dtype, run_dir, args)
    parts = build(cfg, resume_from=None)
    engine, trainer = parts.engine, parts.trainer
    extra = engine_extra_weight_bytes(parts)
    engine_s, tokens, pool_bytes, fused = measure_generate(engine, prompts, args.new_tokens)
    syncs = host_syncs_per_decode_step(engine, prompts)
    engine.sleep()  # the colocated cycle: pool and fused copies released before training
    vocab = min(parts.policy.config.vocab_size, 256)
    train_s, activations, saved, loss = measure_train_step(trainer, [args.train_len] * args.train_seqs, vocab)
    figures = DtypeFigures(
        cfg=cfg, weight_bytes=sum(storage_bytes(parts.policy.parameters()).values()), engine_extra_bytes=extra,
        pool_bytes=pool_bytes, pool_allocated_bytes=engine.pool.num_pages * engine.pool.page_bytes, fused_bytes=fused, engine_s=engine_s, tokens=tokens, syncs_per_decode_step=syncs,
        slot_bytes=trainer.arena.total_bytes, activation_bytes=activations, saved_bytes=saved,
        host_state_bytes=trainer.optimizer.host_bytes_by_kind(), train_s=train_s, loss=loss)
    del parts, engine, trainer
    gc.collect()
    return figures


# ---- the other pieces' own measurements, at this model's shapes -----------------------------------------
def moe_grouped_vs_loop(cfg: ModelConfig, num_tokens: int) -> float:
    """Speed of the grouped expert path over the per-expert loop at this model's MoE shape
    (benchmarks/moe.py, forward + backward, fp32, `num_tokens` tokens: the train step's)."""
    result = measure_moe(cfg.num_experts, cfg.num_experts_per_token, cfg.hidden_size, cfg.moe_intermediate_size,
                     num_tokens, torch.float32, backward=True, device=torch.device("cpu"))
    return float(result["grouped_vs_loop"])


def planner_max_rel_err(runs: dict[str, DtypeFigures], train_len: int) -> float:
    """Max relative error, over both dtypes and every consumer it sizes, of the memory planner's
    bytes (rl/plan/model.py `plan_sizes`, one CPU rank, trajectories of train_len + 1 tokens) vs
    those measured in the run: weights, the whole pool, grad slots, the saved-tensor peak, host
    masters and moments (with their step counters). Prints each consumer's error."""
    errors = []
    for name, r in runs.items():
        # this machine: one CPU process, the "device" is the host (the MoE form the CPU runs)
        sizes = plan_sizes(r.cfg, ClusterConfig(name="cpu", device_is_host=True), PlanOptions(seq_len=train_len + 1))
        planned = {"weights": sizes.weights, "pool": sizes.pool, "grad_slots": sizes.grad_slots,
                   "activation_peak": sizes.activation_peak, "masters": sizes.masters,
                   "moments": sizes.moments + sizes.moment_steps}
        measured = r.planned_tiers()
        row = {k: abs(planned[k] - measured[k]) / measured[k] for k in planned if measured[k]}
        print(f"planner vs measured, {name}: " + ", ".join(
            f"{k} {planned[k] / 2**20:.1f}/{measured[k] / 2**20:.1f} MiB ({row[k]:.1%})" for k in row))
        errors += row.values()
    return max(errors)


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the tiny model and small sizes: a smoke run")
    p.add_argument("--model", default=None, help="configs/model/ name (default: kimi_linear_mid, tiny with --quick)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=None, help="default 32 (4 with --quick)")
    p.add_argument("--train-seqs", type=int, default=2)
    p.add_argument("--train-len", type=int, default=None, help="default 256 (32 with --quick)")
    p.add_argument("--chunks", type=int, default=None,
                   help="VPP chunks (default: layers + 2 with params, layers with layers)")
    p.add_argument("--chunk-split", default="params", choices=CHUNK_SPLITS, help="trainer.chunk_split")
    p.add_argument("--pool-mb", type=int, default=256)
    args = p.parse_args(argv)
    model = args.model or ("tiny" if args.quick else "kimi_linear_mid")
    args.new_tokens = args.new_tokens or (4 if args.quick else 32)
    args.train_len = args.train_len or (32 if args.quick else MAX_MODEL_LEN)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (int(n),), generator=gen).tolist()
               for n in torch.randint(32, 64, (args.prompts,), generator=gen)]

    cfg = load_model_config(CONFIGS / "model" / f"{model}.yaml")
    extra_units = 2 if args.chunk_split == "params" else 0  # the embedding and the head
    args.chunks = args.chunks or cfg.num_hidden_layers + extra_units
    moe = moe_grouped_vs_loop(cfg, args.train_seqs * args.train_len)
    runs: dict[str, DtypeFigures] = {}
    with tempfile.TemporaryDirectory(prefix="scale-") as tmp:
        # One tiny round per dtype first: one-time process costs (lazy imports, the optimizer's
        # extension, thread pools) land there, not on whichever dtype is timed first.
        # (--quick skips it: its times are not the point.)
        tiny_layers = load_model_config(CONFIGS / "model" / "tiny.yaml").num_hidden_layers
        warm = argparse.Namespace(**{**vars(args), "new_tokens": 2, "train_len": 16,
                                     "chunks": min(args.chunks, tiny_layers + extra_units)})
        for dtype in () if args.quick else ("fp32", "bf16"):
            run_dtype("tiny", dtype, warm, prompts[:1], Path(tmp) / f"warm-{dtype}")
        for dtype in ("fp32", "bf16"):
            runs[dtype] = r = run_dtype(model, dtype, args, prompts, Path(tmp) / dtype)
            print(f"{dtype}: weights {r.weight_bytes / 2**20:.1f} MiB, engine extra {r.engine_extra_bytes:,} B "
                  f"(+ {r.fused_bytes / 2**20:.1f} MiB CPU fused copies while generating), pool used "
                  f"{r.pool_bytes / 2**20:.2f} MiB, grad slots {r.slot_bytes / 2**20:.1f} MiB, activations "
                  f"{r.activation_bytes / 2**20:.1f} MiB (saved alone {r.saved_bytes / 2**20:.1f}), host states "
                  f"{sum(r.host_state_bytes.values()) / 2**20:.1f} MiB; generate {r.engine_s:.2f} s, train step {r.train_s:.2f} s "
                  f"(loss {r.loss:.4f})", flush=True)
    fp32, bf16 = runs["fp32"], runs["bf16"]
    pairs = [(a, b) for x, y in zip(fp32.tokens, bf16.tokens) for a, b in zip(x, y)]
    figures = {"device_bytes_bf16_vs_fp32": bf16.device_bytes / fp32.device_bytes,
               "engine_extra_weight_bytes": max(r.engine_extra_bytes for r in runs.values()),
               "host_syncs_per_decode_step": max(r.syncs_per_decode_step for r in runs.values()),  # the worse dtype
               "moe_grouped_vs_loop": moe,
               "planner_max_rel_err": planner_max_rel_err(runs, args.train_len)}
    raw = {"bf16_tokens_same_as_fp32": sum(a == b for a, b in pairs) / len(pairs),
           "weights_bf16_vs_fp32": bf16.weight_bytes / fp32.weight_bytes,
           **{f"{k}_{name}": getattr(r, k) for name, r in runs.items() for k in ("device_bytes", "engine_s", "train_s")}}
    print(" ".join(f"{k}={v:.3g}" for k, v in {**figures, **raw}.items()) + f" model={model}")
    return figures


if __name__ == "__main__":
    main()
