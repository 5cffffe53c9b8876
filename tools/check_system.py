"""System sections of the GPU check: the environment, Triton compile counts and per-kernel register /
spill / shared-memory figures, host syncs per engine step, pinned host memory rounding, and a
3-iteration RL run on CUDA whose metrics files are copied into the evidence folder.
"""
from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from importlib import metadata
from pathlib import Path

import torch
import torch.nn.functional as F

from tools.check_common import Ctx, Parts
from tools.check_kernels import kda_dims, kda_grads, kda_inputs, mla_inputs, mla_scale

ROOT = Path(__file__).resolve().parents[1]
KERNEL_MODULES = ("kernels.kda.chunk", "kernels.kda.decode", "kernels.mla.paged", "kernels.mla.weights",
                  "kernels.mla.prefill")
"""Modules whose Triton kernels the check counts (plus any other kernels.* module loaded by then)."""
T_SWEEP = (1, 17, 1000, 1024, 1025, 3000)
"""Sequence lengths of the compile-count sweep: odd, on and off the 64-token chunk grid."""
PROJECT_DISTS = ("torch", "triton", "hydra-core", "omegaconf", "deepspeed", "megatron-core", "transformers",
                 "wandb", "safetensors", "datasets", "pyarrow", "fla-core", "flashinfer-python")


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "missing"


def env(ctx: Ctx, figures) -> None:
    """Versions, the device, the Triton mode, the kernels found and which baselines import."""
    figures.update(ctx.describe())  # one flush below covers these
    figures["triton_interpret"] = os.environ.get("TRITON_INTERPRET", "")
    figures["packages"] = {d: _version(d) for d in PROJECT_DISTS}
    figures["kernels"] = sorted(loaded_kernels())
    from benchmarks.baselines import availability

    figures["anchors_importable_here"] = availability()  # expected not: they live in the baseline env


# ---- compile counts and resources -------------------------------------------------------------------
def triton_kernels(module) -> dict:
    """name -> kernel object: the module's TRITON_KERNELS dict if it has one, else every Triton kernel
    (@triton.jit, or one wrapped by autotune / heuristics) among its attributes."""
    declared = getattr(module, "TRITON_KERNELS", {})
    if declared:
        return dict(declared)
    return {name: obj for name, obj in vars(module).items() if _jit_of(obj) is not None}


def _jit_of(obj):
    """The JITFunction (or interpreter stand-in) under autotune / heuristics wrappers, or None."""
    from triton.runtime.jit import JITFunction

    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - moved in some Triton versions
        InterpretedFunction = ()  # noqa: N806
    for _ in range(4):
        if isinstance(obj, (JITFunction, InterpretedFunction)):
            return obj
        obj = getattr(obj, "fn", None)
        if obj is None:
            return None
    return None


def compiled_kernels(kernel) -> list:
    """The CompiledKernel binaries this process holds for `kernel` (all devices)."""
    caches = getattr(_jit_of(kernel), "device_caches", {})
    return [binary for entry in list(caches.values()) for binary in entry[0].values()]


def _resources(binary) -> dict:
    if getattr(binary, "n_regs", None) is None and hasattr(binary, "_init_handles"):
        binary._init_handles()  # registers and spills are read when the binary is loaded
    meta = binary.metadata
    return {"regs": getattr(binary, "n_regs", None), "spills": getattr(binary, "n_spills", None),
            "smem_bytes": getattr(meta, "shared", None), "warps": getattr(meta, "num_warps", None),
            "stages": getattr(meta, "num_stages", None)}


def loaded_kernels() -> dict[str, object]:
    """"<module>.<name>" -> kernel for every Triton kernel of the loaded kernels.* modules (after
    importing KERNEL_MODULES), each once: under the first module, in name order, that lists it."""
    for name in KERNEL_MODULES:
        importlib.import_module(name)
    out, seen = {}, set()
    for name in sorted(n for n in sys.modules if n.startswith("kernels.")):
        for kname, kernel in sorted(triton_kernels(sys.modules[name]).items()):
            if id(kernel) not in seen:
                seen.add(id(kernel))
                out[f"{name.removeprefix('kernels.')}.{kname}"] = kernel
    return out


def variant_figures(name: str, kernel) -> dict[str, int]:
    """variants_<name> (compiled binaries), specializations_<name> (variants less the extra autotune
    configs: each config compiles once per specialization) and, when autotuned, autotune_configs_ /
    autotune_keys_ (tuning runs); {} when nothing compiled."""
    from triton.runtime.autotuner import Autotuner

    variants = len(compiled_kernels(kernel))
    if not variants:
        return {}
    configs = len(kernel.configs) if isinstance(kernel, Autotuner) else 1
    out = {f"variants_{name}": variants, f"specializations_{name}": max(1, variants - (configs - 1))}
    if isinstance(kernel, Autotuner):
        out[f"autotune_configs_{name}"] = configs
        out[f"autotune_keys_{name}"] = len(getattr(kernel, "cache", {}))
    return out


def _t_sweep(ctx: Ctx, figures) -> None:
    """chunk_kda forward and backward (bf16) at every T of T_SWEEP, states at T // 2."""
    from kernels.kda.chunk import chunk_kda

    H, K, V = kda_dims(ctx)
    gen = ctx.generator(9)
    for T in T_SWEEP:
        leaves = tuple(x.detach().requires_grad_() for x in kda_inputs(ctx, gen, 1, T, torch.bfloat16))
        chunk_kda(*leaves[:5], initial_state=leaves[5], state_positions=(T // 2,), impl="triton")
        try:
            kda_grads(chunk_kda, leaves, ctx.randn(gen, 1, T, H, V), ctx.randn(gen, 1, H, K, V), impl="triton")
        except Exception as err:  # noqa: BLE001 - the backward may not be wired: count the forward alone
            figures["backward_error"] = f"{type(err).__name__}: {err}"[:300]
    torch.cuda.synchronize()


def _other_sweeps(ctx: Ctx) -> None:
    """KDA decode and MLA decode / weights / prefill at several batch sizes and lengths (bf16)."""
    from kernels.kda.decode import kda_decode_step
    from kernels.mla.paged import paged_mla_decode
    from kernels.mla.weights import paged_mla_weights

    H, K, V = kda_dims(ctx)
    gen, scale = ctx.generator(10), mla_scale(ctx)
    for B in (1, 7, 256):
        state = ctx.randn(gen, B, H, K, V)
        q, k = (F.normalize(ctx.randn(gen, B, H, K), dim=-1).to(torch.bfloat16) for _ in range(2))
        kda_decode_step(q, k, q.clone(), F.logsigmoid(ctx.randn(gen, B, H, K)),
                        torch.rand(B, H, device=ctx.device).to(torch.bfloat16), state,
                        torch.arange(B, device=ctx.device), impl="triton", check=False)
    for B, max_len in ((1, 1), (5, 100), (64, 8192), (3, 8193), (2, 30000)):
        args = mla_inputs(ctx, gen, B, max_len, False, torch.bfloat16)
        _, lse = paged_mla_decode(*args, scale=scale, impl="triton", check=False, return_lse=True)
        paged_mla_weights(*args, lse, scale=scale, width=max_len, impl="triton")
    torch.cuda.synchronize()


def compile_stats(ctx: Ctx, figures) -> None:
    """Compiled variants per Triton kernel after the T sweep, then registers / spills / shared memory."""
    figures["kernels"] = sorted(loaded_kernels())
    ctx.require_native("the interpreter compiles nothing (no variants, registers or spills to count)")
    t0 = time.perf_counter()
    _t_sweep(ctx, figures)
    figures["t_sweep_s"] = time.perf_counter() - t0
    for name, kernel in loaded_kernels().items():  # only the chunk kernels ran so far
        for key, value in variant_figures(name, kernel).items():
            figures[key] = value
    _other_sweeps(ctx)
    for name, kernel in loaded_kernels().items():
        binaries = compiled_kernels(kernel)
        if binaries:
            figures[f"compiled_{name}"] = len(binaries)
            figures[f"resources_{name}"] = sorted({json.dumps(_resources(b), sort_keys=True) for b in binaries})


# ---- host syncs, pinned memory --------------------------------------------------------------------------
def _count_syncs(step) -> tuple[int, list[str]]:
    """Synchronizing CUDA calls made by `step()` (torch.cuda.set_sync_debug_mode("warn")) and where."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    sites = Counter(f"{Path(w.filename).relative_to(ROOT) if w.filename.startswith(str(ROOT)) else w.filename}"
                    f":{w.lineno}" for w in syncs)
    return len(syncs), [f"{site} x{n}" for site, n in sites.most_common(10)]


def engine_syncs(ctx: Ctx, figures) -> None:
    """Host syncs in one engine prefill step and one decode step (tiny model, Triton kernels)."""
    ctx.require_native("host syncs exist only between a host and a GPU")
    parts = Parts(figures)
    for dt, tag in ctx.dtypes:
        parts.run(tag, lambda: _engine_syncs(ctx, figures, dt, tag))
    parts.done()


def _engine_syncs(ctx: Ctx, figures, dt: torch.dtype, tag: str) -> None:
    from models.config import load_model_config
    from models.model import HybridLM
    from models.precision import cast_parameters
    from rollout.engine import Engine
    from rollout.engine_config import EngineConfig
    from rollout.sampling import SamplingParams

    model = HybridLM(load_model_config(str(ROOT / "configs/model/tiny.yaml"))).init_weights(seed=7, std=0.15)
    model = cast_parameters(model, dt).to(ctx.device).eval()  # the run's recipe: some parameters stay fp32
    engine = Engine(model, EngineConfig.for_pages(model, 256, max_model_len=256, max_num_batched_tokens=2048,
                                                  kernel_impl="triton"))
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=16, ignore_eos=True)
    engine.generate([[5, 6, 7] * 10] * 4, params)  # compiles every kernel first
    for i in range(32):
        engine.add_request([5, 6, 7 + i % 5] * 10, params)
    figures[f"syncs_per_prefill_step_{tag}"], figures[f"prefill_sync_sites_{tag}"] = _count_syncs(engine.step)
    engine.step()
    figures[f"syncs_per_decode_step_{tag}"], figures[f"decode_sync_sites_{tag}"] = _count_syncs(engine.step)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(8):
        engine.step()
    torch.cuda.synchronize()
    figures[f"decode_step_ms_tiny_B32_{tag}"] = (time.perf_counter() - t0) / 8 * 1e3


def pinned_host(ctx: Ctx, figures) -> None:
    """Bytes CUDA's pinned host allocator reserves for a 3 GiB + 4 KiB request (the host ledger's rounding)."""
    ctx.require_native("pinned host memory needs the CUDA driver")
    x = torch.empty((3 << 30) + 4096, dtype=torch.uint8, pin_memory=True)
    stats = torch.cuda.host_memory_stats()
    for key in ("allocated_bytes.current", "reserved_bytes.current", "active_bytes.current"):
        if key in stats:
            figures[f"pinned_gib_{key.split('.')[0]}"] = round(stats[key] / 2**30, 3)
    figures["requested_gib"] = round(x.numel() / 2**30, 3)


# ---- the RL run -------------------------------------------------------------------------------------------
RL_OVERRIDES = ("experiment.iterations=3", "tracking.wandb_mode=disabled", "tracking.progress=false",
                "tracking.plots=false")
"""On top of the default experiment (cpu_demo: streamed KL reference, optimizer states spilled to
NVMe, prefix cache, host KV pool, partial rollouts, a short warm-up)."""
RL_FILES = {"metrics.jsonl": "rl_metrics.jsonl", "summary.json": "rl_summary.json", "phases.jsonl": "rl_phases.jsonl"}
"""Run files copied into the evidence folder, and their names there."""
RL_TIMEOUT_S = float(os.environ.get("GPU_CHECK_RL_TIMEOUT_S", "200"))


def rl_overrides(device: str, run_dir: Path) -> list[str]:
    """`python -m rl.train` overrides of the check's run: bf16 on CUDA (fp32 on CPU, whose matmuls
    have no working bf16), 3 iterations, no wandb / progress bars / plots."""
    dtype = "bf16" if device == "cuda" else "fp32"
    return [f"experiment.device={device}", f"experiment.dtype={dtype}", *RL_OVERRIDES, f"run_dir={run_dir}"]


def rl_run(ctx: Ctx, figures) -> None:
    """A 3-iteration RL run with experiment.device=cuda, bf16; copies its metrics files out."""
    from rl.config.compose import compose_run_config

    scratch = os.environ.get("GPU_CHECK_SCRATCH") or tempfile.mkdtemp(prefix="gpu_check_")
    run_dir = Path(scratch) / "rl_run"  # never under the evidence folder: only its copied files go there
    cfg = compose_run_config(rl_overrides("cpu", run_dir))  # every key checked, here too
    figures["config"] = {"reference": cfg.memory.reference, "spill_dir": cfg.memory.spill_dir,
                         "kl_coef": cfg.algo.loss.kl_coef, "iterations": cfg.experiment.iterations,
                         "warmup_steps": cfg.warmup.steps}
    ctx.require_native("experiment.device=cuda")
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "rl.train", *rl_overrides("cuda", run_dir)]
    figures["command"] = " ".join(cmd[1:])
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=RL_TIMEOUT_S)
        figures["rc"], log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        figures["rc"] = f"timed out after {RL_TIMEOUT_S:.0f} s"
        log = (err.stdout or b"").decode(errors="replace") + (err.stderr or b"").decode(errors="replace")
    figures["wall_s"] = time.perf_counter() - t0
    figures["log_tail"] = log.splitlines()[-25:]
    for src, dst in RL_FILES.items():
        if (run_dir / src).exists():
            shutil.copyfile(run_dir / src, ctx.out / dst)
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    records = [r for r in (json.loads(line) for line in lines if line.strip()) if "iteration" in r]
    keys = ("iteration", "loss", "reward_mean", "loss/kl", "grad_norm", "rollout_tok_s", "train_tokens",
            "seconds/rollout", "seconds/train")
    figures["iterations"] = [{k: r[k] for k in keys if k in r} for r in records]
    figures["iterations_completed"] = len(records)


SECTIONS = {"compile_stats": compile_stats, "engine_syncs": engine_syncs, "pinned_host": pinned_host,
            "rl_run": rl_run}
"""Name -> section, in run order."""
