"""Entry point of an RL run: `python -m rl.train [group=option ...] [key=value ...] [resume=true]`.

Composes `configs/config.yaml` (default `experiment=cpu_demo`; `--help` lists the groups) into the
run config (rl/config/: every check runs there), builds the rank's parts (rl/run/build.py), takes the
warm-up of a new run, then runs the loop (rl/run/loop.py) and writes the plots and the summary. A run
directory holds one run: starting again in a used one without `resume=true` is refused, so nothing
is overwritten by accident.

Under `torchrun --nproc_per_node N -m rl.train ...` every rank runs this same entry point: its own
engine on its share of the prompt groups, one data-parallel trainer over all ranks (rl/run/ranks.py,
rl/run/loop.py); rank 0 alone writes metrics, plots, wandb and the console.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from rl.config import RunConfig
from rl.config.compose import compose_run_config, register_configs, to_run_config
from rl.config.checks import task_params_overrides
from rl.config.resume import check_checkpoint_dtypes, check_config_drift
from rl.envs.tasks.base import make_task
from rl.run.build import build, start_from_warmup
from rl.run.checkpoint import check_world_size, checkpoint_info, load_iteration, published, resumable
from rl.run.figures import TimedStreamedReference, run_summary
from rl.run.loop import final_eval, run_loop
from rl.run.ranks import RankLost, Ranks, collective_failure, init_ranks, shutdown
from rl.run.run_lock import lock_run_dir, unlock_run_dir
from rl.run.threads import machine_threads

register_configs()


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
    threads, why = cfg.experiment.num_threads, "experiment.num_threads"
    if threads is None:
        threads, why = machine_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    writer = int(os.environ.get("RANK", "0")) == 0
    if writer:  # one run per run_dir, taken before anything is written (rl/run/run_lock.py)
        lock_run_dir(cfg.run_dir)
    try:
        return _ranked_run(cfg, f"{torch.get_num_threads()} CPU threads per rank ({why})")
    finally:
        if writer:
            unlock_run_dir(cfg.run_dir)


def _ranked_run(cfg: RunConfig, threads: str) -> list[dict[str, float]]:
    # "cuda": GPU LOCAL_RANK, NCCL; "cpu": gloo
    ranks = init_ranks(cfg.experiment.device_type, cfg.experiment.collective_timeout_s, cfg.parallel.expert,
                       cfg.parallel.context)
    try:
        return _run(cfg, ranks, threads=threads)
    except Exception as err:
        if ranks.world > 1 and collective_failure(err):
            raise RankLost(f"rank {ranks.rank}: a collective with the other ranks failed ({type(err).__name__}: "
                           f"{str(err).splitlines()[0] if str(err) else ''}): a peer rank died, or stalled longer "
                           f"than experiment.collective_timeout_s={cfg.experiment.collective_timeout_s:g}; restart "
                           f"every rank with resume=true to continue from the last checkpoint") from err
        raise
    finally:
        shutdown(ranks)


def _run(cfg: RunConfig, ranks: Ranks, threads: str = "") -> list[dict[str, float]]:
    run_dir = Path(cfg.run_dir)
    checkpoints = run_dir / "checkpoints"
    # every rank must see the same run_dir (a shared filesystem across nodes)
    marker = ranks.check_same(f"run_dir {str(run_dir)!r}'s last checkpoint", published(checkpoints))
    if marker is not None and not cfg.resume:
        raise FileExistsError(f"run_dir {str(run_dir)!r} already holds a run (last checkpoint {marker!r}); "
                              f"pass resume=true to continue it or choose another run_dir")
    # the newest checkpoint that verifies against its manifest (older ones when the newest is damaged)
    resume_path = (resumable(checkpoints, ranks, accept_unverified=cfg.checkpoint.accept_unverified)
                   if cfg.resume and marker is not None else None)
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
                                f"{ranks.world} rank{'s' if ranks.world > 1 else ''}, {threads}")
    start = 0
    if resume_path is not None:
        start = load_iteration(parts, resume_path) + 1
        parts.tracker.console.print(f"resuming {run_dir} after iteration {start - 1}"
                                    + (f" on {ranks.world} ranks" if ranks.world > 1 else ""))
    warmup = start_from_warmup(cfg, parts, resume=resume_path is not None)
    if isinstance(parts.ref_model, TimedStreamedReference):
        parts.tracker.add_probe(parts.ref_model.figures)  # the stream's seconds and bytes in each metrics line
    parts.tracker.run_started(start, cfg.experiment.iterations)
    history = run_loop(parts, start, cfg.experiment.iterations, max_drop_fraction=cfg.rollout.max_drop_fraction,
                       max_idle_iterations=cfg.experiment.max_idle_iterations, fault=_fault_from_env())
    if history:  # the weights after the last update, evaluated when the run evaluates at all
        parts.final_val = final_eval(parts, start + len(history))
    if ranks.is_writer:
        # the best a constant answer scores, where the task states it: the bar a rising reward must clear
        ceiling = getattr(make_task(cfg.task.name, **cfg.task.params), "constant_answer_ceiling", None)
        final_val = {f"final_{k}": v for k, v in parts.final_val.items()}  # the weights after the last update
        if final_val:
            final_val["final_val/iteration"] = float(start + len(history))  # the updates the weights had
        parts.tracker.finish(run_summary(run_dir, warmup, ceiling) | final_val, warmup=warmup, ceiling=ceiling)
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


def precheck(argv: list[str]) -> str | None:
    """Compose and validate the run config of `argv` before Hydra's main writes anything (its .hydra/
    record and train.log in run_dir): a bad value exits with its error and leaves no directory behind.
    Returns the composed run_dir (None for sweeps and Hydra's own flags, checked by main job by job)."""
    if any(a.startswith("-") for a in argv):
        return None
    try:
        return compose_run_config([a for a in argv if not a.lstrip("+~").startswith(("hydra.", "hydra/"))]).run_dir
    except Exception as err:  # every config error, whatever its type: shown without a traceback
        sys.exit(f"error: {type(err).__name__}: {err}")


def hold_run_dir(argv: list[str], run_dir: str | None) -> None:
    """Lock a run_dir named on the command line (rank 0) before Hydra writes into it, for the process's
    life (`run` takes it again, re-entrant): a second run on it exits naming the holder, leaving the
    first run's files as they were."""
    if run_dir is None or not any(a.startswith("run_dir=") for a in argv) or int(os.environ.get("RANK", "0")) > 0:
        return
    try:
        lock_run_dir(run_dir)
    except Exception as err:  # noqa: BLE001 - one line, no traceback
        sys.exit(f"error: {type(err).__name__}: {err}")


if __name__ == "__main__":
    sys.argv[1:] = task_params_overrides(sys.argv[1:])
    hold_run_dir(sys.argv[1:], precheck(sys.argv[1:]))
    if int(os.environ.get("RANK", "0")) > 0:
        # Hydra's own files (.hydra/, train.log in run_dir) come from rank 0 only.
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled"]
    main()
