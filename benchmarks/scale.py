"""Real sizes on CPU: the middle model (configs/model/kimi_linear_mid.yaml, 0.46B) in fp32 and in
bf16, one engine generate and one train step each, in the same run.

    python -m benchmarks.scale [--quick]        # --quick: the tiny model, seconds (a smoke run)

Per dtype (the policy built in fp32 from one seed, then cast by models.precision):
- (a) device bytes of a colocated iteration: the policy's weights + the engine's weight storage
  not shared with the policy + the trainer's gradient slots (FP32 in both dtypes) + the KV pool
  pages the generate used (peak pages x page bytes) + the train step's activation peak (tensors
  saved for backward and each VPP chunk's kept input, one live set: benchmarks/train_step.py's
  meter). Host states (FP32 masters, AdamW moments) are host bytes, not counted.
- (b) one engine generate, greedy: --prompts prompts of 32..63 tokens x --new-tokens new tokens,
  max_model_len 256; seconds, and how many tokens bf16 generates identically to fp32.
- (c) one `Trainer.train_step` (--chunks VPP chunks) on --train-seqs sequences x --train-len
  tokens; seconds.
Pieces that other work provides are behind the adapters below; until one exists its key prints
`NA` (with the reason on stderr), never a stand-in number.
Final line: device_bytes_bf16_vs_fp32= engine_extra_weight_bytes= host_syncs_per_decode_step=
moe_grouped_vs_loop= planner_max_rel_err= (targets: <= 0.55, 0, <= 2, a speed ratio, <= 0.05),
then the raw figures per dtype.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import dataclass

import torch

from benchmarks.train_step import SavedTensorMeter
from models.config import ModelConfig, load_model_config
from models.model import HybridLM
from rollout.engine import Engine, EngineConfig
from rollout.sampling import SamplingParams
from trainer.optimizer import OptimizerConfig
from trainer.step import Trainer, TrainerConfig

MAX_MODEL_LEN = 256


def say(message: str) -> None:
    print(f"[scale] {message}", file=sys.stderr, flush=True)


# ---- adapters: pieces built elsewhere; each returns None (printed NA) until its piece exists ----------
def cast_policy(model: HybridLM, dtype: torch.dtype) -> HybridLM | None:
    """The policy in the run's dtype, as `experiment.dtype` makes it (models/precision.py)."""
    if dtype == torch.float32:
        return model
    try:
        from models.precision import cast_parameters
    except ImportError as err:
        say(f"{dtype} policy: NA ({err})")
        return None
    return cast_parameters(model, dtype)


def make_trainer(policy: HybridLM, num_chunks: int) -> Trainer | None:
    """The trainer over the policy's own parameters (FP32 gradient slots whatever their dtype)."""
    try:
        return Trainer(policy, TrainerConfig(num_chunks=num_chunks, optimizer=OptimizerConfig(lr=1e-5)))
    except NotImplementedError as err:  # the trainer before bf16 parameters were supported
        say(f"trainer: NA ({err})")
        return None


def make_engine(policy: HybridLM, config: EngineConfig) -> tuple[Engine, int | None]:
    """(the engine on the policy, its weight bytes not shared with the policy; None = not measured).
    Until the engine shares the policy's weights in rl.train, this is an engine run directly on the
    policy module (right for timing) and the extra bytes are unknown."""
    say("engine_extra_weight_bytes: NA (rl.train's shared-weight engine is not there yet)")
    return Engine(policy, config), None


def host_syncs_per_decode_step(engine: Engine, prompts: list[list[int]], num_steps: int = 4) -> float | None:
    """Mean would-be host syncs of `num_steps` pure decode steps (tests/sync_audit.py), after one
    step that prefills every prompt. Runs the prompts to completion on `engine`."""
    try:
        from tests.sync_audit import audit_step
    except ImportError as err:
        say(f"host_syncs_per_decode_step: NA ({err})")
        return None
    params = SamplingParams(temperature=0.0, max_new_tokens=num_steps + 2, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    engine.step()  # all prompts fit one step's token budget: this is the prefill
    syncs = [audit_step(engine)[0].total("sync") for _ in range(num_steps)]
    while engine.has_unfinished:
        engine.step()
    return sum(syncs) / len(syncs)


def moe_grouped_vs_loop(cfg: ModelConfig, num_tokens: int) -> float | None:
    """Speed of the grouped expert matmul over the per-expert loop at this model's MoE shape
    (benchmarks/moe.py, forward + backward, fp32)."""
    try:
        from benchmarks.moe import measure
    except ImportError as err:
        say(f"moe_grouped_vs_loop: NA ({err})")
        return None
    result = measure(cfg.num_experts, cfg.num_experts_per_token, cfg.hidden_size, cfg.moe_intermediate_size,
                     num_tokens, torch.float32, backward=True, device=torch.device("cpu"))
    return float(result["grouped_vs_loop"])


def planner_max_rel_err(cfg: ModelConfig, measured: dict[str, dict[str, int]]) -> float | None:
    """Max relative error of the memory planner's per-tier bytes (rl/plan.py) vs `measured`
    ({dtype name: {tier: bytes}})."""
    try:
        import rl.plan  # noqa: F401
    except ImportError as err:
        say(f"planner_max_rel_err: NA ({err})")
        return None
    say("planner_max_rel_err: NA (rl/plan.py found; its comparison is not wired here yet)")
    return None


# ---- measurements ------------------------------------------------------------------------------------
@dataclass
class DtypeFigures:
    weight_bytes: int
    engine_extra_bytes: int | None
    pool_bytes: int
    engine_s: float
    tokens: list[list[int]]
    syncs_per_decode_step: float | None = None
    slot_bytes: int | None = None
    activation_bytes: int | None = None
    """Peak of saved tensors + chunk inputs, one live set."""
    saved_bytes: int | None = None
    """Peak of the saved tensors alone (what rl/plan_activation.py predicts)."""
    host_state_bytes: int | None = None
    """The host optimizer's FP32 masters + AdamW moments after the step."""
    train_s: float | None = None
    loss: float | None = None

    @property
    def device_bytes(self) -> int | None:
        parts = (self.weight_bytes, self.engine_extra_bytes, self.slot_bytes, self.pool_bytes, self.activation_bytes)
        return None if any(p is None for p in parts) else sum(parts)


def parameter_bytes(model: HybridLM) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def measure_generate(engine: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]], int]:
    """One greedy generate -> (seconds, generated tokens per prompt, bytes of the pool pages it used at peak)."""
    engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=2))  # builds lazy kernels/caches
    engine.peak_pages_used = 0
    t0 = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True))
    seconds = time.perf_counter() - t0
    return seconds, [o.samples[0].tokens for o in outs], engine.peak_pages_used * engine.pool.page_bytes


def measure_train_step(trainer: Trainer, seq_lens: list[int], vocab: int) -> tuple[float, int, int, float]:
    """One train step on random packed tokens -> (seconds, peak bytes of saved tensors + chunk
    inputs, peak bytes of saved tensors alone, loss). Mutates the policy's weights and the host optimizer."""
    gen = torch.Generator().manual_seed(1)
    num_tokens = sum(seq_lens)
    tokens = torch.randint(0, vocab, (num_tokens,), generator=gen)  # [N]
    targets = torch.randint(0, vocab, (num_tokens,), generator=gen)  # [N]
    meter, saved = SavedTensorMeter(), SavedTensorMeter()
    handles = meter.track_chunk_inputs(trainer)
    t0 = time.perf_counter()
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.track(meter.track(t)), lambda t: t):
            metrics = trainer.train_step(tokens, seq_lens, targets, lambda lp, rows: -lp.sum() / num_tokens)
    finally:
        for handle in handles:
            handle.remove()
    return time.perf_counter() - t0, meter.peak, saved.peak, metrics["loss"]


def run_dtype(cfg: ModelConfig, dtype: torch.dtype, args: argparse.Namespace,
              prompts: list[list[int]]) -> DtypeFigures | None:
    """Build the policy in `dtype`, generate, put the engine to sleep, train one step. None when
    the policy cannot be built in `dtype` yet."""
    policy = cast_policy(HybridLM(cfg).init_weights(seed=0, std=0.02), dtype)
    if policy is None:
        return None
    engine, extra = make_engine(policy, EngineConfig(max_model_len=MAX_MODEL_LEN, show_progress=False,
                                                     pool_bytes=args.pool_mb << 20, max_num_batched_tokens=4096))
    engine_s, tokens, pool_bytes = measure_generate(engine, prompts, args.new_tokens)
    figures = DtypeFigures(parameter_bytes(policy), extra, pool_bytes, engine_s, tokens)
    figures.syncs_per_decode_step = host_syncs_per_decode_step(engine, prompts)
    engine.sleep()  # the colocated cycle: pool (and CPU fused weight copies) released before training
    trainer = make_trainer(policy, args.chunks)
    if trainer is not None:
        seconds, activations, saved, loss = measure_train_step(trainer, [args.train_len] * args.train_seqs,
                                                               min(cfg.vocab_size, 256))
        figures.train_s, figures.activation_bytes, figures.saved_bytes, figures.loss = seconds, activations, saved, loss
        figures.slot_bytes, figures.host_state_bytes = trainer.arena.total_bytes, trainer.optimizer.host_bytes()
    del engine, trainer, policy
    gc.collect()
    return figures


def warm_up() -> None:
    """One tiny-model train step per dtype: one-time process costs (lazy imports, the optimizer's
    extension load, thread pools) land here, not on whichever dtype is timed first."""
    tiny = load_model_config("configs/model/tiny.yaml")
    for dtype in (torch.float32, torch.bfloat16):
        policy = cast_policy(HybridLM(tiny).init_weights(seed=0), dtype)
        trainer = make_trainer(policy, 2) if policy is not None else None
        if trainer is not None:
            measure_train_step(trainer, [16, 16], 256)


def fmt(value: float | int | None, spec: str = ".3g") -> str:
    return "NA" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> dict[str, float | None]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the tiny model and small sizes: a seconds-long smoke run")
    p.add_argument("--config", default=None, help="model YAML (default: kimi_linear_mid, or tiny with --quick)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=None, help="default 32 (4 with --quick)")
    p.add_argument("--train-seqs", type=int, default=2)
    p.add_argument("--train-len", type=int, default=None, help="default 256 (32 with --quick)")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--pool-mb", type=int, default=256)
    args = p.parse_args(argv)
    quick = args.quick
    args.config = args.config or f"configs/model/{'tiny' if quick else 'kimi_linear_mid'}.yaml"
    args.new_tokens = args.new_tokens or (4 if quick else 32)
    args.train_len = args.train_len or (32 if quick else MAX_MODEL_LEN)
    cfg = load_model_config(args.config)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, min(cfg.vocab_size, 256), (int(n),), generator=gen).tolist()
               for n in torch.randint(32, 64, (args.prompts,), generator=gen)]
    say(f"{args.config}: {cfg.num_parameters():,} parameters")

    warm_up()
    runs = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        runs[name] = run_dtype(cfg, dtype, args, prompts)
        r = runs[name]
        if r is not None:
            print(f"{name}: weights {r.weight_bytes / 2**20:.1f} MiB, engine extra {fmt(r.engine_extra_bytes, ',')} B, "
                  f"pool used {r.pool_bytes / 2**20:.2f} MiB, grad slots {fmt(r.slot_bytes and r.slot_bytes / 2**20, '.1f')} "
                  f"MiB, activations {fmt(r.activation_bytes and r.activation_bytes / 2**20, '.1f')} MiB; "
                  f"generate {r.engine_s:.2f} s, train step {fmt(r.train_s, '.2f')} s (loss {fmt(r.loss, '.4f')})")
    fp32, bf16 = runs["fp32"], runs["bf16"]
    same = None
    if fp32 is not None and bf16 is not None:
        pairs = [(a, b) for x, y in zip(fp32.tokens, bf16.tokens) for a, b in zip(x, y)]
        same = sum(a == b for a, b in pairs) / len(pairs)
    ratio = (bf16.device_bytes / fp32.device_bytes
             if fp32 is not None and bf16 is not None and None not in (fp32.device_bytes, bf16.device_bytes) else None)
    extra = None if bf16 is None else bf16.engine_extra_bytes
    counted = [r.syncs_per_decode_step for r in runs.values() if r is not None and r.syncs_per_decode_step is not None]
    syncs = max(counted) if counted else None  # the worse dtype
    moe = moe_grouped_vs_loop(cfg, args.train_seqs * args.train_len)
    planner = planner_max_rel_err(cfg, {})
    figures = {"device_bytes_bf16_vs_fp32": ratio, "engine_extra_weight_bytes": extra,
               "host_syncs_per_decode_step": syncs, "moe_grouped_vs_loop": moe, "planner_max_rel_err": planner}
    raw = {f"{k}_{name}": getattr(r, k) if r is not None else None
           for name, r in runs.items() for k in ("device_bytes", "engine_s", "train_s")}
    print(" ".join(f"{k}={fmt(v)}" for k, v in {**figures, "bf16_tokens_same_as_fp32": same, **raw}.items())
          + f" model={args.config.rsplit('/', 1)[-1].removesuffix('.yaml')}")
    return figures


if __name__ == "__main__":
    main()
