"""Entry point of an RL run: `python -m rl.train [group=option ...] [key=value ...] [resume=true]`.

Composes `configs/config.yaml` (default `experiment=cpu_demo`; `--help` lists the groups), builds
the policy in the run's dtype (`experiment.dtype`), the rollout engine (on the policy's own
parameter tensors: one copy of the weights, a weight sync is a version bump), the trainer, the
rollout driver and the tracker, then runs rl/orchestrator.py's loop. A run directory
holds one run: starting again in a used one without `resume=true` is refused, so nothing is
overwritten by accident.

Under `torchrun --nproc_per_node N -m rl.train ...` every rank runs this same entry point: its own
engine on its share of the prompt groups, one data-parallel trainer over all ranks (rl/ranks.py,
rl/orchestrator.py); rank 0 alone writes metrics, plots, wandb and the console.

Placement (`experiment.device`, resolved into `Ranks.device`): the policy (which the engine runs
on; its page pool follows it), a resident reference and the trainer's gradient slots live on the rank's
device; the optimizer's FP32 masters and moments, a streamed reference's weights (pinned on CUDA)
and the host KV pool live in host memory. Initial weights are drawn on the CPU and moved, so a
CUDA run starts from the same weights as a CPU run.
"""
from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import asdict, replace
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from memory.host_ledger import HostLedger, mem_available_bytes
from memory.nvme_store import NvmeStore, owner_directory
from models.checkpoint import checkpoint_dtype, load_weights
from models.config import ModelConfig
from models.model import HybridLM
from models.precision import DTYPES, cast_parameters, dtype_name
from models.tokenizer import load_tokenizer
from rl.config import (NO_DEFAULT, RunConfig, compose_run_config, register_configs, schema_default, to_run_config,
                       upgrade_overrides, upgrade_stored_config)
from rl.checkpoint import RUN_CONFIG, check_world_size, checkpoint_info, load_iteration, published, resumable
from rl.orchestrator import LoopParts, run_loop
from rl.ranks import Ranks, init_ranks, shutdown
from rl.data import RowSampler, load_rows
from rl.rollout import RolloutDriver
from rl.figures import TimedStreamedReference, run_summary
from rl.tasks.base import make_task
from rl.tracking import Tracker
from rl.validation import evaluator
from rl.warmup import load_record, run_warmup
from rollout.engine import Engine
from trainer.ref_stream import StreamedReference
from trainer.step import Trainer

register_configs()


def initial_policy(cfg: RunConfig) -> HybridLM:
    """The starting weights on the CPU, in the run's dtype (experiment.dtype): the checkpoint's, or a
    seeded random init drawn in FP32 and then cast (so fp32 and bf16 runs start from the same draw)."""
    model = HybridLM(cfg.model)
    if cfg.experiment.checkpoint is not None:
        check_checkpoint_model(cfg)
        load_weights(model, cfg.experiment.checkpoint, assign=False)
    else:
        model.init_weights(seed=cfg.seed, std=cfg.experiment.init_std)
    return cast_parameters(model, cfg.experiment.torch_dtype)


RESUME_MAY_CHANGE = ("experiment.iterations", "experiment.collective_timeout_s", "experiment.max_idle_iterations",
                     "tracking.", "checkpoint.", "rollout.budget_tokens", "rollout.budget_seconds",
                     "rollout.max_drop_fraction", "env.timeout_s", "env.workers", "env.max_retries",
                     "env.backoff_s", "resume", "run_dir",
                     "experiment.checkpoint", "experiment.num_threads", "warmup.", "eval.")
"""Config keys (or prefixes, ending in ".") a resume may change: how long and how loudly the run goes
on, its checkpoints' cadence, its budgets and fault limits, its CPU threads (and experiment.checkpoint
and the warm-up, read only by a new run). Any other change is refused."""


def resolved_config(cfg: RunConfig) -> dict:
    """The run's config as plain JSON values (what the tracker logs and each checkpoint stores)."""
    return json.loads(json.dumps(asdict(cfg), default=str))


def _flatten(tree, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def check_checkpoint_model(cfg: RunConfig) -> None:
    """Refuse experiment.checkpoint when its config.json describes another model than the `model`
    group (every differing field named: a shape-preserving difference such as rms_norm_eps or the
    routing scale would otherwise load silently)."""
    path = Path(cfg.experiment.checkpoint)
    stored = path / "config.json"
    if not stored.exists():
        raise FileNotFoundError(f"experiment.checkpoint={str(path)!r} has no config.json (a Hugging Face checkpoint "
                                f"directory is expected)")
    theirs = asdict(ModelConfig.from_hf_dict(json.loads(stored.read_text())))
    ours = asdict(cfg.model)
    diff = [f"{k}: {theirs[k]!r} in the checkpoint, {ours.get(k)!r} in the model group"
            for k in sorted(theirs) if theirs[k] != ours.get(k)]
    if diff:
        raise ValueError(f"experiment.checkpoint={str(path)!r} is another model than the config's `model` group: "
                         + "; ".join(diff) + ". Choose the model group that matches it (or override those keys)")


def check_config_drift(cfg: RunConfig, resume_path: Path) -> None:
    """Refuse a resume whose config differs from the one the checkpoint was written with, outside
    RESUME_MAY_CHANGE, naming every differing key with both values. A checkpoint from before configs
    were stored is resumed with a warning. A config stored under the old key names (rl/config.py
    RENAMED_KEYS) is compared in today's names (`upgrade_stored_config`); a key it lacks (a knob added
    since) is compared at the schema's default, the behaviour the checkpoint ran with."""
    stored = resume_path / RUN_CONFIG
    if not stored.exists():
        print(f"WARNING: {resume_path} stores no run config (written before {RUN_CONFIG}); the resume cannot "
              f"check that the config is unchanged", file=sys.stderr)
        return
    before, now = _flatten(upgrade_stored_config(json.loads(stored.read_text()))), _flatten(resolved_config(cfg))
    for key in now.keys() - before.keys():  # a knob added since: the checkpoint ran with its default
        default = schema_default(key)
        if default is not NO_DEFAULT:
            before[key] = default
    changed = sorted(k for k in before.keys() | now.keys() if before.get(k, "<absent>") != now.get(k, "<absent>")
                     and not any(k == w or (w.endswith(".") and k.startswith(w)) for w in RESUME_MAY_CHANGE))
    if changed:
        diff = "; ".join(f"{k}: {before.get(k, '<absent>')!r} in the checkpoint, {now.get(k, '<absent>')!r} now"
                         for k in changed)
        raise ValueError(f"resume from {resume_path} with a changed config: {diff}. A resume may change only "
                         f"{', '.join(RESUME_MAY_CHANGE)}; start a new run_dir (experiment.checkpoint=<a "
                         f"checkpoint's dir> starts from its weights) to change anything else")


def check_checkpoint_dtypes(cfg: RunConfig, resume_path: Path | None) -> None:
    """Refuse, before anything is built or written, a start checkpoint (experiment.checkpoint) or a run
    checkpoint to resume whose weights' dtype is not experiment.dtype."""
    want = cfg.experiment.torch_dtype
    if cfg.experiment.checkpoint is not None:
        have = checkpoint_dtype(cfg.experiment.checkpoint)
        if have is not None and have != want:
            raise ValueError(f"experiment.checkpoint={cfg.experiment.checkpoint!r} holds {have} weights but "
                             f"experiment.dtype={cfg.experiment.dtype!r} ({want}); set experiment.dtype to the "
                             f"checkpoint's ({dtype_name(have) if have in DTYPES.values() else have}) or convert it")
    if resume_path is not None:
        meta = json.loads((resume_path / "trainer.json").read_text())
        saved = meta.get("dtype", "fp32")  # written before the dtype knob existed: fp32
        if saved != cfg.experiment.dtype:
            raise ValueError(f"run_dir {str(cfg.run_dir)!r} was trained with experiment.dtype={saved!r}; resuming it "
                             f"with experiment.dtype={cfg.experiment.dtype!r} is refused (its optimizer state and "
                             f"weights are those of a {saved} run): pass experiment.dtype={saved}")


def host_budget_bytes(cfg: RunConfig, ranks: Ranks) -> int:
    """This rank's host-DRAM ledger budget: memory.host_budget_mb (or MemAvailable less 10%) is the
    node's, split evenly among the ranks on the node."""
    node = (cfg.memory.host_budget_mb << 20 if cfg.memory.host_budget_mb is not None
            else int(mem_available_bytes() * 0.9))
    return node // ranks.local_world


def build(cfg: RunConfig, resume_from: int | None, ranks: Ranks = Ranks(), engine_copy: bool = False) -> LoopParts:
    """The loop's parts for this rank, on `ranks.device` (see the module docstring). `engine_copy`
    gives the engine a second copy of the weights, refreshed by a state-dict copy at every sync (the
    layout before the engine shared the policy's tensors; tests compare the two)."""
    device = ranks.device
    torch.manual_seed(cfg.seed)
    policy = initial_policy(cfg).to(device)  # the same weights on every rank: the seed is the run's
    if engine_copy:
        with torch.device(device):  # built where it runs (its random init is overwritten at once)
            engine_model = cast_parameters(HybridLM(cfg.model), cfg.experiment.torch_dtype)
        engine_model.load_state_dict(policy.state_dict())
    else:
        engine_model = policy  # one copy of the weights: the engine runs on the trainer's parameters
    ledger = HostLedger(host_budget_bytes(cfg, ranks))
    # The configs go through as composed; the engine's seed is the run's, and its progress bar is
    # off (the tracker shows the rollout's).
    prefix = cfg.engine.prefix_cache  # rollout.reuse_stale_prefix: its entries outlive a weight update
    prefix = replace(prefix, reuse_stale=True) if prefix is not None and cfg.rollout.reuse_stale_prefix else prefix
    tokenizer = load_tokenizer(cfg.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"tokenizer.path={cfg.tokenizer.path!r} has {tokenizer.vocab_size} tokens but the model's "
                         f"vocab_size is {cfg.model.vocab_size}: ids past it have no embedding; expected a tokenizer "
                         f"of at most {cfg.model.vocab_size} tokens (or a model config that matches it)")
    engine = Engine(engine_model, replace(cfg.engine, seed=cfg.seed, show_progress=False, prefix_cache=prefix),
                    ledger=ledger, detokenize=tokenizer.decode)  # decode: tokenizer.stop_strings end answers
    if cfg.memory.spill_dir is not None and engine.host is not None:
        engine.host.suspend()  # time-multiplexed: leased at each rollout, once the training states left (orchestrator)
    t = cfg.trainer
    # the lr schedule's horizon: every optimizer step the run will take (ppo_epochs x mini_batches each)
    trainer = Trainer(policy, t, group=ranks.group, ledger=ledger, total_steps=cfg.optimizer_steps)
    if ranks.world > 1 and cfg.algo.mini_batches > 1:
        raise ValueError(f"algo.mini_batches={cfg.algo.mini_batches} with {ranks.world} ranks: each mini-batch is "
                         f"normalised by its own counts, which needs one rank for now; expected algo.mini_batches=1 "
                         f"(algo.ppo_epochs works on several ranks)")
    rows = None
    if cfg.data.enabled:
        def encode(prompt):  # exactly what the driver sends
            return tokenizer.render(prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}])
        rows, loaded = RowSampler.from_config(cfg.data, encode)
        if ranks.is_writer and loaded.num_dropped_too_long:
            print(f"data: dropped {loaded.num_dropped_too_long} rows longer than data.max_prompt_tokens="
                  f"{cfg.data.max_prompt_tokens}; {len(rows)} kept", file=sys.stderr)
    driver = RolloutDriver(engine, tokenizer, cfg.task.name, cfg.task.params, cfg.rollout,
                           group_size=cfg.algo.group_size, seed=cfg.seed, rank=ranks.rank, world=ranks.world,
                           sum_over_ranks=lambda n: int(ranks.sum([n])[0]), rows=rows, env=cfg.env)
    run_dir = Path(cfg.run_dir)
    val_rows = None
    if cfg.data.val_files:  # the held-out rows, in file order (never shuffled)
        val_rows = load_rows(cfg.data.val_files, cfg.data, lambda p: tokenizer.render(
            p if isinstance(p, list) else [{"role": "user", "content": p}])).rows
    evaluate = evaluator(engine, tokenizer, cfg.task.name, cfg.task.params, cfg.eval, seed=cfg.seed, out_dir=run_dir,
                         rank=ranks.rank, world=ranks.world, rollout_max_new_tokens=cfg.rollout.max_new_tokens,
                         env_timeout_s=cfg.env.timeout_s, rows=val_rows, runner=driver.runner)
    # Optimizer host states go here between iterations (orchestrator "offload" / "restore" phases).
    # Each run its own subdirectory of memory.spill_dir (a shared /nvme root is safe), each rank its
    # own store in it: every store locks its directory (memory/nvme_store.py).
    store = (NvmeStore(owner_directory(run_dir / cfg.memory.spill_dir, run_dir) / f"rank{ranks.rank}",
                       owner=f"run {run_dir.resolve()} rank {ranks.rank}")
             if cfg.memory.spill_dir is not None else None)
    tracker = Tracker(run_dir, cfg.tracking, resolved_config(cfg),
                      resume_from_iteration=resume_from, writer=ranks.is_writer)
    # after a warm-up the reference is its result, built once it is known (`start_from_warmup`)
    ref = None if warm_started(cfg, resume_from) else reference(cfg, initial_policy(cfg), trainer, ledger)
    return LoopParts(policy=policy, engine=engine, trainer=trainer, driver=driver, tracker=tracker,
                     loss=cfg.algo.loss, advantage=cfg.algo.advantage, num_chunks=t.num_chunks,
                     micro_batch_tokens=t.micro_batch_tokens, release_pool=cfg.memory.release_pool_in_train,
                     ref_model=ref, checkpoint_dir=run_dir / "checkpoints", ledger=ledger, store=store,
                     ranks=ranks, checkpoint=cfg.checkpoint, max_staleness=cfg.rollout.max_staleness,
                     ppo_epochs=cfg.algo.ppo_epochs, mini_batches=cfg.algo.mini_batches,
                     evaluate=evaluate, eval_every=cfg.eval.every, eval_before_train=cfg.eval.before_train,
                     run_config=resolved_config(cfg))


def reference(cfg: RunConfig, model: HybridLM, trainer: Trainer, ledger: HostLedger) -> HybridLM | StreamedReference | None:
    """The KL reference (None without algo.loss.kl_coef) from `model`'s weights (a CPU model in the
    run's dtype; not kept): streamed (memory.reference=stream: host copies per VPP chunk, streamed
    through the trainer's idle gradient slots, timed for the run's figures) or resident on the
    trainer's device."""
    if cfg.algo.loss.kl_coef == 0:
        return None
    model = model.eval()
    if cfg.memory.reference == "stream":
        t = cfg.trainer
        return TimedStreamedReference(model, trainer.arena, t.num_chunks, ledger=ledger, split=t.chunk_split)
    return model.to(trainer.arena.device)


def warm_started(cfg: RunConfig, resume_from: int | None) -> bool:
    """Whether the run starts RL from a supervised warm-up: a new run with warmup.steps > 0, a
    resumed one when it took one (its record is in run_dir; the warmup group's knobs may change on
    a resume, it never runs again)."""
    return load_record(cfg.run_dir) is not None if resume_from is not None else cfg.warmup.steps > 0


def start_from_warmup(cfg: RunConfig, parts: LoopParts, resume: bool) -> dict | None:
    """A new run with warmup.steps > 0 takes its supervised warm-up now (rl/warmup.py); a resume of
    one reads its record (the checkpoint holds the policy after it). Either way the KL reference is
    the policy right after the warm-up. Returns the record (None: the run has no warm-up)."""
    if not warm_started(cfg, 0 if resume else None):
        return None
    p = parts
    if not resume:
        record = run_warmup(cfg.warmup, trainer=p.trainer, engine=p.engine, tokenizer=p.driver.tokenizer,
                            task_name=cfg.task.name, task_params=cfg.task.params, rollout=cfg.rollout,
                            group_size=cfg.algo.group_size, seed=cfg.seed, run_dir=Path(cfg.run_dir), ranks=p.ranks,
                            micro_batch_tokens=cfg.trainer.micro_batch_tokens, console=p.tracker.console)
    else:
        record = load_record(cfg.run_dir)
    weights = cast_parameters(HybridLM(cfg.model), cfg.experiment.torch_dtype)  # on the CPU, as initial_policy
    if resume:
        load_weights(weights, Path(cfg.run_dir) / "warmup", assign=False)
    else:
        weights.load_state_dict({k: v.detach().cpu() for k, v in p.policy.state_dict().items()})
    p.ref_model = reference(cfg, weights, p.trainer, p.ledger)
    return record


def _fault_from_env():
    """A test's crash: HYBRIDRL_FAULT="<phase>:<iteration>" kills this process with SIGKILL as that
    phase starts, honoured only with HYBRIDRL_TEST_FAULTS=1 as well (a stray variable in a
    production environment is ignored, with a warning). None when no fault is armed."""
    spec = os.environ.get("HYBRIDRL_FAULT")
    if not spec:
        return None
    if os.environ.get("HYBRIDRL_TEST_FAULTS") != "1":
        print(f"HYBRIDRL_FAULT={spec!r} is ignored: fault injection is a test hook, armed only with "
              f"HYBRIDRL_TEST_FAULTS=1", file=sys.stderr)
        return None
    phase_name, at = spec.split(":")

    def fault(iteration: int, phase: str) -> None:
        if phase == phase_name and iteration == int(at):
            os.kill(os.getpid(), signal.SIGKILL)

    return fault


def run(cfg: RunConfig) -> list[dict[str, float]]:
    """One run (or its continuation with cfg.resume); returns the metrics of the iterations run
    (global over ranks, on every rank). Under torchrun the process group lives for this call."""
    if cfg.experiment.num_threads is not None:
        torch.set_num_threads(cfg.experiment.num_threads)
    # "cuda": GPU LOCAL_RANK, NCCL; "cpu": gloo
    ranks = init_ranks(cfg.experiment.device_type, cfg.experiment.collective_timeout_s)
    try:
        return _run(cfg, ranks)
    except Exception as err:
        if ranks.world > 1 and _collective_failure(err):
            raise RankLost(f"rank {ranks.rank}: a collective with the other ranks failed ({type(err).__name__}: "
                           f"{str(err).splitlines()[0] if str(err) else ''}): a peer rank died, or stalled longer "
                           f"than experiment.collective_timeout_s={cfg.experiment.collective_timeout_s:g}; restart "
                           f"every rank with resume=true to continue from the last checkpoint") from err
        raise
    finally:
        shutdown(ranks)


class RankLost(RuntimeError):
    """A collective failed because a peer rank died or timed out (the run resumes from its checkpoint)."""


def _collective_failure(err: BaseException) -> bool:
    """Whether `err` (or what it was raised from) is torch.distributed's report of a lost peer."""
    while err is not None:
        text = str(err)
        if isinstance(err, torch.distributed.DistError) or any(
                s in text for s in ("Connection closed by peer", "Connection reset by peer", "Timed out",
                                    "timed out", "gloo", "NCCL", "Broken pipe")):
            return True
        err = err.__cause__ or err.__context__
    return False


def _run(cfg: RunConfig, ranks: Ranks) -> list[dict[str, float]]:
    run_dir = Path(cfg.run_dir)
    checkpoints = run_dir / "checkpoints"
    # every rank must see the same run_dir (a shared filesystem across nodes)
    marker = ranks.check_same(f"run_dir {str(run_dir)!r}'s last checkpoint", published(checkpoints))
    if marker is not None and not cfg.resume:
        raise FileExistsError(f"run_dir {str(run_dir)!r} already holds a run (last checkpoint {marker!r}); "
                              f"pass resume=true to continue it or choose another run_dir")
    # the newest checkpoint that verifies against its manifest (older ones when the newest is damaged)
    resume_path = resumable(checkpoints, ranks) if cfg.resume and marker is not None else None
    last = None
    if resume_path is not None:
        info = checkpoint_info(resume_path)
        check_world_size(info, ranks.world, checkpoints)
        last = info["iteration"]
    if cfg.resume is True and marker is None:
        print(f"resume=true: run_dir {str(run_dir)!r} holds no checkpoint yet, starting a new run "
              f"(resume=must refuses instead)", file=sys.stderr)
    if cfg.resume == "must" and resume_path is None:
        raise FileNotFoundError(f"resume=must but run_dir {str(run_dir)!r} holds no checkpoint to resume "
                                f"({checkpoints} has none); use resume=true to start fresh when there is none")
    check_checkpoint_dtypes(cfg, resume_path)  # first: its message says exactly what to set
    if resume_path is not None:
        check_config_drift(cfg, resume_path)
    parts = build(cfg, resume_from=last, ranks=ranks)
    parts.tracker.console.print(f"device {ranks.device} (experiment.device={cfg.experiment.device}), "
                                f"{ranks.world} rank{'s' if ranks.world > 1 else ''}")
    start = 0
    if resume_path is not None:
        start = load_iteration(parts, resume_path) + 1
        parts.tracker.console.print(f"resuming {run_dir} after iteration {start - 1}"
                                    + (f" on {ranks.world} ranks" if ranks.world > 1 else ""))
    warmup = start_from_warmup(cfg, parts, resume=resume_path is not None)
    if isinstance(parts.ref_model, TimedStreamedReference):
        parts.tracker.add_probe(parts.ref_model.figures)  # the stream's seconds and bytes in each metrics line
    history = run_loop(parts, start, cfg.experiment.iterations, max_drop_fraction=cfg.rollout.max_drop_fraction,
                       max_idle_iterations=cfg.experiment.max_idle_iterations, fault=_fault_from_env())
    if ranks.is_writer:
        # the best a constant answer scores, where the task states it: the bar a rising reward must clear
        ceiling = getattr(make_task(cfg.task.name, **cfg.task.params), "constant_answer_ceiling", None)
        parts.tracker.finish(run_summary(run_dir, warmup, ceiling), warmup=warmup, ceiling=ceiling)
    ranks.barrier()  # rank 0's files are complete when any rank returns
    return history


@hydra.main(version_base="1.3", config_path="../configs", config_name="config")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    run(to_run_config(_sweep_run_dir(cfg), HydraConfig.get().overrides.task))


def _sweep_run_dir(cfg: DictConfig) -> DictConfig:
    """Under `-m` (a Hydra sweep) each job gets its own run_dir: the configured one plus `-job<N>`. Under
    torchrun every rank must name the same run_dir, so the default (timestamped per process) must be
    replaced by an explicit `run_dir=...`."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        cfg.run_dir = f"{cfg.run_dir}-job{hydra_cfg.job.num}"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not any(o.startswith("run_dir=")
                                                               for o in hydra_cfg.overrides.task):
        raise ValueError("under torchrun pass run_dir=<dir> explicitly: the default run_dir carries each "
                         "process's start time, and every rank must name the same directory")
    return cfg


def precheck(argv: list[str]) -> None:
    """Compose and validate the run config of `argv` before Hydra's main writes anything (its .hydra/
    record and train.log in run_dir): a bad value exits with its error and leaves no directory behind.
    Sweeps (-m) and Hydra's own flags are checked by main, job by job."""
    if any(a.startswith("-") for a in argv):
        return
    try:
        compose_run_config([a for a in argv if not a.lstrip("+~").startswith(("hydra.", "hydra/"))])
    except Exception as err:  # every config error, whatever its type: shown without a traceback
        sys.exit(f"error: {type(err).__name__}: {err}")


if __name__ == "__main__":
    sys.argv[1:] = upgrade_overrides(sys.argv[1:])  # renamed keys still work for one release, with a warning
    precheck(sys.argv[1:])
    if int(os.environ.get("RANK", "0")) > 0:
        # Hydra's own files (.hydra/, train.log in run_dir) come from rank 0 only.
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled"]
    main()
