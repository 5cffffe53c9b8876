"""The phase orchestrator: the one RL loop, explicit calls in order.

Per iteration:
    [host_in] -> wake engine -> load policy weights into it (version = iteration + 1) -> [eval, when
    due: held-out episodes on these weights, rl/episodes/validation.py; its val/ metrics join the iteration's] -> ROLLOUT
    -> engine sleep -> [host_out] -> [restore training state, if spilled] -> TRAIN (reference
    logprobs, policy update) -> log -> checkpoint -> offload training state (NVMe spill with
    memory.spill_dir).
Host DRAM is time-multiplexed when the run spills and the engine has a host KV pool:
"host_out" writes the pool's live contents (parked partial rollouts, turn-boundary prefix entries
worth keeping) to NVMe and returns its lease before "restore" brings the training states back;
"host_in" leases it again once they left ("offload"; before the first rollout too) and reads the
contents back (rollout/kv/host_spill.py). With engine.host_pool_mb="auto" it leases every byte the
ledger has free then, so the ledger never holds both consumers at full size.
The checkpoint comes before the offload: it reads the optimizer states while they are still in
host memory, so a spilled run writes each state once (offload) and reads it once (restore) per
iteration; phases.jsonl's bytes_moved shows both.
Every phase is one `with phases(iteration, name):` block around a call to its owner (the engine's
memory phases, the trainer's update and spill, the driver's rollout, the checkpoint), which
records seconds, bytes moved and the memory held by each tier (memory/tiers.py: the engine's
`memory()` and the trainer's `memory()` reports) in the tracker's memory timeline. With
`memory.spill_dir`, "offload" spills the optimizer's host states to NVMe (`train_disk` in the
timeline) and "restore" reads them back.
A checkpoint is written atomically after each iteration; resume starts after the last one.

Circuit breaker: a fault inside an iteration costs the trajectories it hits (rl/episodes/driver.py drops
them, by reason), never the run, unless faults are the norm: the run stops with `RunBroken` after an
iteration that dropped more than `max_drop_fraction` of the trajectories it ended (dropped +
finished, over all ranks), or after `max_idle_iterations` iterations in a row that trained no group
and carried nothing over (a rollout budget's carry-over is progress, not idleness). The iteration's
metrics and drop lines are logged first, so the error comes with the evidence.

Several ranks (torchrun; rl/run/ranks.py): every rank runs this same loop on its own engine and its
share of the groups. The collectives sit at the phase boundaries, so no rank is in one phase while
another is in the next: before the rollout the unfinished groups are summed (max_groups_in_flight
caps the global count; never a collective inside the rollout), "load_weights" all-gathers the engine weights' checksum (an error names
the ranks that differ), "gather" (after rollout and sleep) sums the finished groups, tokens and
sequences over ranks (the global normalisers; train runs on every rank or on none), the trainer's
step reduce-scatters gradients and all-gathers the updated weights, the checkpoint has barriers,
and each iteration's metrics are all-gathered and merged so that rank 0 logs global figures.
A rank without work this iteration still takes part in every one of them.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.markup import escape

from memory.host_ledger import HostLedger
from memory.nvme_store import NvmeStore
from memory.tiers import with_totals
from models.model import HybridLM
from rl.config import RunConfig
from rl.config.resume import resolved_config
from rl.episodes.driver import RolloutDriver, RolloutResult
from rl.episodes.env_runner import DROP_REASONS
from rl.run.checkpoint import save_iteration
from rl.run.figures import rollout_statistics, trajectory_lengths
from rl.run.ranks import CHECKSUM_BITS, Ranks, merge_metrics, require_same, weights_checksum
from rl.run.tracking import Tracker
from rl.run.advantages import KLController
from rl.run.critic import Critic
from rl.run.dynamic_sampling import Sampled, dynamic_sampling
from rl.run.train_phase import train_phase
from rollout.engine import Engine
from trainer.ref_stream import StreamedReference
from trainer.step import Trainer


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _storage_bytes(tensors, seen: set[int] | None = None) -> int:
    """Bytes of the distinct storages under `tensors` not in `seen` (updated): a storage shared by
    two models (or two views) is counted once."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


class RunBroken(RuntimeError):
    """The circuit breaker: too many of an iteration's trajectories were dropped, or too many
    iterations in a row trained nothing."""


@dataclass
class LoopParts:
    """Everything the loop touches, built by rl/run/build.py: the components and the run's config
    (every knob is read from `cfg`, under its own name)."""

    cfg: RunConfig
    policy: HybridLM
    engine: Engine
    trainer: Trainer
    driver: RolloutDriver
    tracker: Tracker
    ref_model: "HybridLM | StreamedReference | None" = None
    ledger: HostLedger | None = None
    """Host-DRAM ledger every host consumer leases from (KV pool, reference, training states)."""
    store: NvmeStore | None = None
    """Where the optimizer's host states are spilled between iterations (memory.spill_dir); None = no spill."""
    ranks: Ranks = field(default_factory=Ranks)
    """This process's place among the data-parallel ranks (one process: rank 0 of 1)."""
    evaluate: Callable[[int], dict[str, float]] | None = None
    """Validation (rl/episodes/validation.py `evaluator`): called with the iteration when eval.every /
    eval.before_train make it due, plays this rank's share of the held-out episodes on the freshly
    loaded weights and returns `val/...` metrics; None = never."""
    final_val: dict[str, float] = field(default_factory=dict)
    """The validation of the weights after the run's last update (`run_loop`), over all ranks; {} = none."""
    critic: Critic | None = None
    """PPO's value model and its trainer (algo.critic.enable); None = no critic."""
    critic_store: NvmeStore | None = None
    """Where the critic's optimizer states are spilled between iterations (beside the policy's); None = no spill."""
    kl_ctl: KLController | None = None
    """The KL-in-reward coefficient (algo.kl_in_reward.coef > 0), checkpointed; None = no KL in the reward."""

    @property
    def device(self) -> torch.device:
        """Where the policy lives, and with it the train phase's batches and losses."""
        return next(self.policy.parameters()).device

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.cfg.run_dir) / "checkpoints"

    @property
    def run_config(self) -> dict:
        """The run's resolved config (JSON-able), stored in each checkpoint for the resume's drift check."""
        return resolved_config(self.cfg)


@dataclass
class Phase:
    """One running phase: its owner's call sets `moved` (bytes it moved) when known only after."""
    moved: int = 0


class Phases:
    """`with phases(iteration, name, moved=...) as phase:` times one phase transition and logs the
    memory tiers afterwards (`memory`); the train phase runs under the trainer's memory meter.
    `fault(iteration, phase)`, when given, is called as each phase starts (tests inject a crash
    there; rl/train.py passes one only under HYBRIDRL_TEST_FAULTS=1)."""

    def __init__(self, parts: LoopParts, fault: Callable[[int, str], None] | None = None) -> None:
        self.parts, self.fault = parts, fault
        self.seconds: dict[str, float] = {}

    def memory(self, peaks: dict[str, int] | None = None) -> dict[str, int]:
        """Bytes each consumer holds, by tier (memory/tiers.py; rl/plan/model.py predicts the same
        keys from the config; docs/plan-48b.md), at the end of the phase just run: the engine's and
        the trainer's reports, the weights (distinct storages of the policy's and the engine's
        parameters) and the reference (resident: device_reference; streamed: host_reference). Plus,
        outside the tier totals: train_host (every optimizer host byte), engine_weight_copies (the
        CPU path's fused projections while it generates, models/fused.py; 0 on CUDA) and, on CUDA's
        train phase, device_alloc_peak. `peaks`: the trainer's memory meter of the train phase."""
        p = self.parts
        engine, trainer, ref = p.engine.memory(), p.trainer.memory(peaks), p.ref_model
        seen: set[int] = set()
        weights = _storage_bytes(p.policy.parameters(), seen) + _storage_bytes(p.engine.model.parameters(), seen)
        out = with_totals({
            "device_weights": weights, "device_pool": engine["device_pool"],
            "device_grad_slots": trainer["device_grad_slots"],
            "device_activation_peak": trainer["device_activation_peak"],
            "device_reference": _storage_bytes(ref.parameters(), seen) if isinstance(ref, HybridLM) else 0,
            "host_masters": trainer["host_masters"], "host_moments": trainer["host_moments"],
            "host_grads": trainer["host_grads"], "host_pool": engine["host_pool"], "host_parked": engine["host_parked"],
            "host_reference": ref.host_bytes if isinstance(ref, StreamedReference) and ref.host is not None else 0,
            "disk_spilled": trainer["disk_spilled"], "disk_kv_pool": engine["disk_kv_pool"]})
        if p.critic is not None:  # the second trained model: its weights, slots and host states
            critic = p.critic.trainer.memory(p.critic.peaks if peaks is not None else None)
            out["device_weights"] += _storage_bytes(p.critic.model.parameters(), seen)
            for key in ("device_grad_slots", "host_masters", "host_moments", "host_grads", "disk_spilled"):
                out[key] += critic[key]
            # it trains after the policy: the phase's activation peak is the larger of the two
            out["device_activation_peak"] = max(out["device_activation_peak"], critic["device_activation_peak"])
            out = with_totals({k: v for k, v in out.items() if not k.endswith("_total")})
            trainer = {**trainer, "train_host": trainer["train_host"] + critic["train_host"]}
        out.update(train_host=trainer["train_host"], engine_weight_copies=engine["engine_weight_copies"])
        if "device_alloc_peak" in trainer:
            out["device_alloc_peak"] = trainer["device_alloc_peak"]
        return out

    @contextmanager
    def __call__(self, iteration: int, name: str, moved: int = 0) -> Iterator[Phase]:
        if self.fault is not None:
            self.fault(iteration, name)
        phase, t0 = Phase(moved), time.perf_counter()
        with self.parts.trainer.memory_meter() if name == "train" else nullcontext(None) as peaks:
            yield phase
        seconds = time.perf_counter() - t0
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.parts.tracker.log_phase(iteration, name, seconds, phase.moved, self.memory(peaks))


def run_loop(parts: LoopParts, start: int, iterations: int, *, max_drop_fraction: float, max_idle_iterations: int,
             fault: Callable[[int, str], None] | None = None) -> list[dict[str, float]]:
    """Iterations [start, iterations); returns each iteration's metrics (global over ranks). Raises
    RunBroken (on every rank) when the circuit breaker trips (`_check_breaker`, module docstring).
    `fault(iteration, phase)` is called as each phase starts (`Phases`)."""
    p, cfg, history, idle = parts, parts.cfg, [], 0
    phases = Phases(p, fault=fault)
    for it in range(start, iterations):
        _host_in(p, phases, it)
        if p.engine.is_asleep:
            with phases(it, "wake"):
                p.engine.wake()
        with phases(it, "load_weights", moved=0 if p.engine.model is p.policy else _tensor_bytes(p.policy.parameters())):
            checksum = _sync_weights(p, version=it + 1)
        val = {}
        if p.evaluate is not None and cfg.eval.is_due(it):
            with phases(it, "eval"):  # on the weights just loaded, before the rollout touches the engine
                val = p.evaluate(it)
        in_flight = _groups_in_flight(p)  # over all ranks, at the phase boundary (never inside the rollout)
        with p.tracker.rollout_progress(total=p.driver.groups_next_iteration * p.driver.group_size) as bar, \
                phases(it, "rollout"):
            sampled = _rollout(p, bar, in_flight)
        rollout = sampled.result
        _release_engine(p, phases, it, rollout)
        num_groups, num_tokens, num_seqs = _global_counts(p, phases, it, rollout.groups)
        _restore_train_states(p, phases, it)
        train = {"train_skipped": 1.0}
        if num_groups:
            with phases(it, "train"):
                train = train_phase(p, rollout.groups, num_tokens, num_seqs)
        train = {**train, **sampled.metrics}
        metrics, errors = _iteration_metrics(p, rollout, val, train, phases.seconds, checksum, scored=sampled.scored)
        p.tracker.log(it, metrics)  # before the checkpoint publishes `latest` (a crash between re-runs it)
        exhausted = p.driver.data_exhausted and not p.ranks.sum([p.driver.unfinished_groups])[0]
        with phases(it, "checkpoint"):
            save_iteration(p, it, cfg.checkpoint, final=it == iterations - 1 or exhausted, fault=phases.fault)
        with phases(it, "offload", moved=sum(tr.spillable_bytes for tr, _ in _trainers(p)) if p.store is not None else 0):
            _offload_train_state(p)
        _print_iteration(p, it, iterations, metrics, train, errors, exhausted)
        phases.seconds.clear()
        history.append(metrics)
        idle = _check_breaker(it, metrics, idle, max_drop_fraction, max_idle_iterations)
        if exhausted:
            break
    return history


def _rollout(p: LoopParts, bar, in_flight: int | None) -> Sampled:
    """The iteration's rollout, and with dynamic sampling its further rounds (rl/run/dynamic_sampling.py);
    without, `scored` is None (the trained groups are the scored ones) and there are no extra metrics."""
    rollout = p.driver.rollout(progress=bar, groups_in_flight=in_flight)
    return dynamic_sampling(p, rollout) if p.cfg.algo.filter_groups.enable else Sampled(rollout, None, {})


def _restore_train_states(p: LoopParts, phases: Phases, it: int) -> None:
    """The trained models' optimizer states back from NVMe before the update (when they were spilled)."""
    if p.trainer.states_spilled:
        with phases(it, "restore", moved=sum(tr.spilled_bytes for tr, _ in _trainers(p))):
            for trainer, _ in _trainers(p):
                trainer.restore_states()


def final_eval(p: LoopParts, it: int) -> dict[str, float]:
    """Validation of the weights after the last update (`it` = the updates made, as every evaluation's
    iteration counts them), when the run evaluates at all: the engine woken and loaded with them, the
    held-out episodes played, the figures merged over the ranks, printed and sent to wandb (metrics.jsonl
    keeps one line per iteration); {} when it does not."""
    if p.evaluate is None:
        return {}
    phases = Phases(p)
    _host_in(p, phases, it)
    if p.engine.is_asleep:
        with phases(it, "wake"):
            p.engine.wake()
    with phases(it, "load_weights", moved=0 if p.engine.model is p.policy else _tensor_bytes(p.policy.parameters())):
        _sync_weights(p, version=it + 1)
    with phases(it, "eval"):
        val = p.evaluate(it)
    val = merge_metrics(p.ranks.all_gather(val)) if p.ranks.world > 1 else val
    phases.seconds.clear()
    shown = "  ".join(f"{k[4:]} {v:.3f}" for k, v in val.items() if k in ("val/reward_mean", "val/correct_frac")
                      or k.startswith("val/pass@"))
    p.tracker.console.print(f"validation after the last update (iteration {it}): {shown}")
    p.tracker.log_wandb(it, val)
    return val


def _groups_in_flight(p: LoopParts) -> int | None:
    """The unfinished groups over all ranks, which rollout.max_groups_in_flight caps (a sum over the
    ranks, before the rollout); None with one rank or no cap (the driver counts its own)."""
    if p.ranks.world == 1 or p.cfg.rollout.max_groups_in_flight is None:
        return None
    return int(p.ranks.sum([p.driver.unfinished_groups])[0])


def _host_in(p: LoopParts, phases: Phases, it: int) -> None:
    """Before the rollout, when host DRAM is multiplexed (memory.spill_dir and a host KV pool): the
    training states leave for NVMe first if they are still in DRAM (the first iteration, or a
    resume's), then the host KV pool leases the DRAM again and reads its kept contents back."""
    if p.store is None or p.engine.host is None:
        return
    if not p.trainer.states_spilled:
        with phases(it, "offload", moved=sum(tr.spillable_bytes for tr, _ in _trainers(p))):
            for trainer, store in _trainers(p):
                trainer.offload_states(store)
    with phases(it, "host_in") as phase:
        phase.moved = p.engine.restore_host(p.store)


def _release_engine(p: LoopParts, phases: Phases, it: int, rollout: RolloutResult) -> None:
    """After the rollout: the engine sleeps (memory.release_pool_in_train: its device pool freed,
    its weight copies dropped; the sleep's host write-back counted in this iteration's rollout
    figures) or only drops its weight copies; when host DRAM is multiplexed, the host KV pool's
    contents then go to NVMe and its DRAM back to the ledger, before the training states return."""
    if p.cfg.memory.release_pool_in_train:
        with phases(it, "sleep", moved=p.engine.memory()["device_pool"]):
            written = p.engine.sleep()
        if "host_pages_written_back" in rollout.metrics:
            rollout.metrics["host_pages_written_back"] += written
    else:
        p.engine.drop_weight_copies()  # the engine holds no weight bytes of its own while training
    if p.store is not None and p.engine.host is not None:
        with phases(it, "host_out") as phase:
            phase.moved = p.engine.spill_host(p.store, next_version=it + 2, max_staleness=p.cfg.rollout.max_staleness)


def _global_counts(p: LoopParts, phases: Phases, it: int, groups) -> tuple[int, int, int]:
    """Finished groups, policy tokens and sequences over all ranks (the loss's global normalisers):
    the "gather" phase, at the rollout -> train boundary, when there are several ranks."""
    masked = p.cfg.algo.mask_truncated  # truncated completions train no token: not in the normalisers
    trained = [t for g in groups for t in g if not (masked and t.truncated)]
    local = [len(groups), sum(sum(t.policy[1:]) for t in trained), len(trained)]
    if p.ranks.world == 1:
        return tuple(local)
    with phases(it, "gather"):
        counts = p.ranks.sum(local)
    return tuple(int(c) for c in counts)


def _print_iteration(p: LoopParts, it: int, iterations: int, metrics: dict[str, float], train: dict[str, float],
                     errors: list[str], exhausted: bool) -> None:
    """The console's lines for iteration `it`: a skipped update, the progress line (tracking.progress,
    about 40 per run), each dropped trajectory's error, the end of the data."""
    console = p.tracker.console
    if train.get("skipped"):
        console.print(f"[yellow]iteration {it}: update skipped[/yellow] (non-finite loss or gradient "
                      f"norm {train.get('grad_norm', float('nan')):.3g}; weights and optimizer unchanged)")
    if p.tracker.config.progress and (it % max(1, iterations // 40) == 0 or it == iterations - 1):
        console.print(f"iter {it:>4}  {p.tracker.run_progress(it)}  reward {metrics['reward_mean']:.3f}  "
                      f"correct {metrics['reward_correct_frac']:.3f}  "
                      f"len {metrics.get('response_length/mean', float('nan')):.1f}  "
                      f"entropy {metrics.get('entropy', float('nan')):.2f}  "
                      f"{metrics['rollout_tok_s']:.0f} tok/s  loss {metrics.get('loss', float('nan')):.4g}  "
                      f"rollout {metrics.get('seconds/rollout', 0):.2f}s train {metrics.get('seconds/train', 0):.2f}s"
                      + (f"  val reward {metrics['val/reward_mean']:.3f}" if "val/reward_mean" in metrics else ""))
    for error in errors:
        console.print(f"[yellow]dropped[/yellow] {escape(error)}")  # "[c]" is an answer, not markup
    if exhausted:
        console.print(f"data exhausted after iteration {it} (data.epochs): every group trained")


def _check_breaker(it: int, metrics: dict[str, float], idle: int, max_drop_fraction: float,
                   max_idle_iterations: int) -> int:
    """RunBroken when iteration `it` (global `metrics`) dropped more than `max_drop_fraction` of the
    trajectories it ended, or is the `max_idle_iterations`-th idle one in a row (`idle` counts the
    idle ones before it; an iteration that trained a group or carried one over is not idle).
    Returns the idle count including this iteration."""
    idle = 0 if metrics["groups_trained"] or metrics["trajectories_carried"] else idle + 1
    dropped, finished = int(metrics["trajectories_dropped"]), int(metrics["trajectories_finished"])
    reasons = ", ".join(f"{r} {int(metrics[f'dropped/{r}'])}" for r in DROP_REASONS if metrics[f"dropped/{r}"])
    reasons = f" ({reasons})" if reasons else ""
    ended = dropped + finished
    if dropped > max_drop_fraction * ended:
        raise RunBroken(f"iteration {it}: {dropped} of the {ended} trajectories it ended were dropped{reasons}, "
                        f"a fraction of {dropped / ended:.3g} > rollout.max_drop_fraction={max_drop_fraction:g}; "
                        f"the run stops (each drop's reason is printed above; raise rollout.max_drop_fraction "
                        f"to tolerate more)")
    if idle >= max_idle_iterations:
        raise RunBroken(f"iteration {it}: {idle} iterations in a row trained no group and carried nothing over "
                        f"(experiment.max_idle_iterations={max_idle_iterations}); this one dropped "
                        f"{dropped} trajectories{reasons} and finished {finished}; the run stops (raise "
                        f"experiment.max_idle_iterations to wait longer)")
    return idle


def _sync_weights(p: LoopParts, version: int) -> int:
    """Give this rank's engine the policy's current weights as `version`: a version bump when the
    engine runs on the policy's own tensors (the default: nothing is copied), a state-dict copy when
    it holds its own; returns their checksum, the same on every rank (a RuntimeError naming the
    ranks otherwise: the trainer's all-gather must leave every replica identical)."""
    if p.engine.model is p.policy:
        p.engine.weights_updated(version)
    else:
        p.engine.load_weights(p.policy.state_dict(), version=version)
    checksum = weights_checksum(p.engine.model.state_dict())
    what = f"the engine weights' checksum after loading version {version}"
    if p.ranks.expert_parallel is None:
        return p.ranks.check_same(what, checksum)
    # expert parallelism: the ranks holding the same experts agree; the run's checksum chains the shares
    held: dict[int, list[int]] = {}
    for expert_rank, value in p.ranks.all_gather((p.ranks.expert_rank, checksum)):
        held.setdefault(expert_rank, []).append(value)
    combined = 0
    for expert_rank in sorted(held):
        combined = (combined * 1_000_003 + require_same(f"{what} (expert-parallel rank {expert_rank})",
                                                        held[expert_rank])) & ((1 << CHECKSUM_BITS) - 1)
    return combined


def _iteration_metrics(p: LoopParts, rollout: RolloutResult, val: dict[str, float], train: dict[str, float],
                       seconds: dict[str, float], checksum: int, scored: list | None = None
                       ) -> tuple[dict[str, float], list[str]]:
    """This iteration's metrics over all ranks, and the dropped trajectories' errors (prefixed by
    their rank when there are several). Rewards are summed in global group order, so one rank and N
    ranks that generated the same groups report the same reward_mean bit for bit. `scored`: the groups
    the reward figures are over when not only the trained ones (dynamic sampling's every round)."""
    groups = rollout.groups if scored is None else scored
    local = {"metrics": {**rollout.metrics, **val, **train, **{f"seconds/{k}": v for k, v in seconds.items()}},
             # (group, rewards, correct): correct is the environment's is_correct, else reward >= 1
             "rewards": [(g[0].group_id, [t.reward for t in g],
                          [t.reward >= 1.0 if t.is_correct is None else t.is_correct for t in g]) for g in groups],
             "members": [(g[0].group_id, [(t.reward, *trajectory_lengths(t)) for t in g]) for g in groups],
             "errors": list(rollout.errors)}
    gathered = p.ranks.all_gather(local)
    metrics = merge_metrics([r["metrics"] for r in gathered]) if p.ranks.world > 1 else local["metrics"]
    ordered = sorted((g for r in gathered for g in r["rewards"]), key=lambda g: g[0])
    rewards = [x for _, rs, _ in ordered for x in rs]
    correct = [c for _, _, cs in ordered for c in cs]
    errors = [(f"rank {rank}: " if p.ranks.world > 1 else "") + e for rank, r in enumerate(gathered) for e in r["errors"]]
    members = sorted((g for r in gathered for g in r["members"]), key=lambda g: g[0])
    metrics.update(rollout_statistics(members, p.cfg.rollout.max_new_tokens, p.cfg.algo.advantage))
    trained = sum(p.ranks.sum([len(rollout.groups)])) if scored is not None else sum(len(r["rewards"]) for r in gathered)
    metrics.update(groups_trained=float(trained),
                   reward_mean=sum(rewards) / len(rewards) if rewards else float("nan"),
                   reward_correct_frac=sum(correct) / len(correct) if correct else float("nan"),
                   engine_checksum=checksum)
    return metrics, errors


def _offload_train_state(p: LoopParts) -> None:
    """Training state leaves its tier here: with a store, the optimizer's host states (FP32 masters +
    AdamW moments) are spilled to NVMe and their host bytes returned to the ledger; the next
    iteration's "restore" phase reads them back before training. The iteration's checkpoint was
    written before, from host memory. Without a store nothing moves (one CPU process: the
    optimizer already lives on the host)."""
    if p.store is not None:
        for trainer, store in _trainers(p):
            trainer.offload_states(store)


def _trainers(p: LoopParts) -> list[tuple[Trainer, NvmeStore | None]]:
    """The trained models' trainers and their spill stores: the policy's, and the critic's when there is one."""
    return [(p.trainer, p.store)] + ([(p.critic.trainer, p.critic_store)] if p.critic is not None else [])
