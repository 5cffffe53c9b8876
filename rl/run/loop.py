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
contents back (rollout/host_spill.py). With engine.host_pool_mb="auto" it leases every byte the
ledger has free then, so the ledger never holds both consumers at full size.
The checkpoint comes before the offload: it reads the optimizer states while they are still in
host memory, so a spilled run writes each state once (offload) and reads it once (restore) per
iteration; phases.jsonl's bytes_moved shows both.
Every transition goes through `Phases.run`, which records seconds, bytes moved and the memory
held by each tier (engine pool on device, host pool, training state on device / host / disk) in
the tracker's memory timeline. With `memory.spill_dir`, `_offload_train_state` spills the
optimizer's host states to NVMe (`train_disk` in the timeline) and "restore" reads them back.
A checkpoint is written atomically after each iteration; resume starts after the last one.

Circuit breaker: a fault inside an iteration costs the trajectories it hits (rl/episodes/driver.py drops
them, by reason), never the run, unless faults are the norm: the run stops with `RunBroken` after an
iteration that dropped more than `max_drop_fraction` of the trajectories it ended (dropped +
finished, over all ranks), or after `max_idle_iterations` iterations in a row that trained no group
and carried nothing over (a rollout budget's carry-over is progress, not idleness). The iteration's
metrics and drop lines are logged first, so the error comes with the evidence.

Several ranks (torchrun; rl/run/ranks.py): every rank runs this same loop on its own engine and its
share of the groups. The collectives sit at the phase boundaries, so no rank is in one phase while
another is in the next: "load_weights" all-gathers the engine weights' checksum (an error names
the ranks that differ), "gather" (after rollout and sleep) sums the finished groups, tokens and
sequences over ranks (the global normalisers; train runs on every rank or on none), the trainer's
step reduce-scatters gradients and all-gathers the updated weights, the checkpoint has barriers,
and each iteration's metrics are all-gathered and merged so that rank 0 logs global figures.
A rank without work this iteration still takes part in every one of them.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.markup import escape

from memory.host_ledger import HostLedger
from memory.nvme_store import NvmeStore
from models.model import HybridLM
from rl.run.checkpoint import save_iteration
from rl.config import CheckpointConfig
from rl.plan.activation import SavedTensorMeter
from rl.plan.model import with_totals
from rl.run.ranks import Ranks, merge_metrics, weights_checksum
from rl.episodes.driver import DROP_REASONS, RolloutDriver
from rl.run.tracking import Tracker
from rl.run.update import PackedBatch, policy_update, reference_logprobs
from rl.episodes.validation import eval_due
from rollout.engine import Engine
from trainer.losses import LossConfig
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


class Phases:
    """Runs one phase transition, timing it and logging the memory tiers afterwards (`memory`).
    `fault(iteration, phase)`, when given, is called as each phase starts (tests inject a crash
    there; rl/train.py passes one only under HYBRIDRL_TEST_FAULTS=1)."""

    def __init__(self, tracker: Tracker, engine: Engine, policy: HybridLM, trainer: Trainer,
                 ref_model: "HybridLM | StreamedReference | None" = None,
                 fault: Callable[[int, str], None] | None = None) -> None:
        self.tracker, self.engine, self.policy, self.trainer = tracker, engine, policy, trainer
        self.ref_model, self.fault = ref_model, fault
        self.seconds: dict[str, float] = {}
        self._peaks: dict[str, int] = {}
        """The train phase's transient consumers (`_measure_train`), reported by the next `memory()`."""

    def memory(self) -> dict[str, int]:
        """Bytes each consumer holds, by tier, at the end of the phase just run (rl/plan/model.py
        predicts the same keys from the config; docs/plan-48b.md):

        device_weights (distinct storages of the policy's and the engine's parameters: a shared copy
        counts once), device_pool (the engine's page pool, 0 while released), device_grad_slots (the
        trainer's FP32 arena), device_activation_peak (train phase: the peak of autograd's saved
        tensors, rl/plan/activation.py; 0 elsewhere), device_reference (a resident reference model;
        a streamed one lives in the grad slots: 0); host_masters, host_moments (AdamW state incl.
        step counters), host_grads (train phase: the FP32 gradient shards right before the
        optimizer step, their peak; 0 elsewhere), host_pool (the host KV pool), host_parked (the
        part of host_pool holding paused rollouts' KV over a sleep: inside host_pool, not added to
        host_total; 0 while the pool's contents are on NVMe), host_reference (a streamed reference's
        host vectors); disk_spilled (spill files of the optimizer states), disk_kv_pool (the host KV
        pool's kept contents on NVMe between rollouts, payload bytes). device_total, host_total and
        disk_total sum each tier. Kept for
        older readers: train_device (= device_weights), train_host (the optimizer's host bytes at
        the end of the phase), train_disk (= disk_spilled)."""
        engine, optimizer, ref = self.engine, self.trainer.optimizer, self.ref_model
        seen: set[int] = set()
        weights = _storage_bytes(self.policy.parameters(), seen) + _storage_bytes(engine.model.parameters(), seen)
        resident_ref = _storage_bytes(ref.parameters(), seen) if isinstance(ref, HybridLM) else 0
        host = engine.host
        parked = engine.cache.num_parked_pages  # paused sequences' host pages over a sleep (forks share)
        kinds = optimizer.host_bytes_by_kind()
        out = with_totals({
            "device_weights": weights,
            "device_pool": 0 if engine.pool.is_released else engine.pool.num_pages * engine.layout.page_bytes,
            "device_grad_slots": self.trainer.arena.total_bytes,
            "device_activation_peak": self._peaks.get("device_activation_peak", 0),
            "device_reference": resident_ref,
            "host_masters": kinds["masters"], "host_moments": kinds["moments"],
            "host_grads": max(kinds["grads"], self._peaks.get("host_grads", 0)),
            "host_pool": host.pool_bytes if host is not None else 0,
            "host_parked": parked * host.page_bytes if host is not None and not host.is_suspended else 0,
            "host_reference": ref.host_bytes if isinstance(ref, StreamedReference) and ref.host is not None else 0,
            "disk_spilled": optimizer.disk_bytes, "disk_kv_pool": engine.cache.spilled_host_bytes})
        out["train_host"] = optimizer.host_bytes()  # as logged before the tiers were split (grads included)
        # Weight copies the engine holds besides the shared parameters: the CPU path's fused
        # projections while it generates (models/fused.py), dropped when the rollout phase ends; 0
        # on CUDA. Outside the tier totals (the planner models the GPU layout, which has none).
        out["engine_weight_copies"] = engine.derived_weight_bytes()
        if "device_alloc_peak" in self._peaks:
            out["device_alloc_peak"] = self._peaks["device_alloc_peak"]
        return out

    @contextmanager
    def _measure_train(self, name: str) -> Iterator[None]:
        """Around the train phase: meter autograd's saved tensors (their peak is the activation
        figure), sample the optimizer's gradient shards right before its step (when they peak) and,
        on CUDA, record the allocator's peak above the phase's start (everything: activations,
        temporaries, gradients in flight) as device_alloc_peak."""
        self._peaks = {}
        if name != "train":
            yield
            return
        models = [self.policy, self.engine.model] + ([self.ref_model] if isinstance(self.ref_model, HybridLM) else [])
        meter = SavedTensorMeter(exclude=[t for m in models for t in (*m.parameters(), *m.buffers())])
        optimizer = self.trainer.optimizer
        device = self.trainer.arena.device
        grads = [0]

        def step(*args, **kwargs):
            grads[0] = max(grads[0], optimizer.host_bytes_by_kind()["grads"])
            return type(optimizer).step(optimizer, *args, **kwargs)

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            start = torch.cuda.memory_allocated(device)
        optimizer.step = step  # an instance attribute over the method, for this phase only
        try:
            with meter.hooks():
                yield
        finally:
            del optimizer.step
        self._peaks = {"device_activation_peak": meter.peak, "host_grads": grads[0]}
        if device.type == "cuda":
            self._peaks["device_alloc_peak"] = torch.cuda.max_memory_allocated(device) - start

    def run(self, iteration: int, name: str, fn: Callable[[], object],
            bytes_moved: int | Callable[[object], int] = 0) -> object:
        """`fn()`, timed and logged; `bytes_moved` is a count, or a function of fn's result."""
        if self.fault is not None:
            self.fault(iteration, name)
        t0 = time.perf_counter()
        with self._measure_train(name):
            result = fn()
        seconds = time.perf_counter() - t0
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        moved = bytes_moved(result) if callable(bytes_moved) else bytes_moved
        self.tracker.log_phase(iteration, name, seconds, moved, self.memory())
        self._peaks = {}
        return result


@dataclass
class LoopParts:
    """Everything the loop touches, built by rl/train.py."""

    policy: HybridLM
    engine: Engine
    trainer: Trainer
    driver: RolloutDriver
    tracker: Tracker
    loss: LossConfig
    advantage: str
    num_chunks: int
    micro_batch_tokens: int | None
    release_pool: bool
    ref_model: "HybridLM | StreamedReference | None"
    checkpoint_dir: Path
    ledger: HostLedger | None = None
    """Host-DRAM ledger every host consumer leases from (KV pool, reference, training states)."""
    store: NvmeStore | None = None
    """Where the optimizer's host states are spilled between iterations (memory.spill_dir); None = no spill."""
    ranks: Ranks = field(default_factory=Ranks)
    """This process's place among the data-parallel ranks (one process: rank 0 of 1)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """When to checkpoint and what to keep (checkpoint.every / keep_last / keep_every)."""
    max_staleness: int | None = None
    """rollout.max_staleness: KV older than this many versions is not kept across iterations."""
    run_config: dict = field(default_factory=dict)
    """The run's resolved config (JSON-able), stored in each checkpoint for the resume's drift check."""
    ppo_epochs: int = 1
    """algo.ppo_epochs: passes over each iteration's batch."""
    mini_batches: int = 1
    """algo.mini_batches: optimizer steps per pass (mini-batches of whole sequences)."""
    evaluate: Callable[[int], dict[str, float]] | None = None
    """Validation (rl/episodes/validation.py `evaluator`): called with the iteration, plays this rank's share of
    the held-out episodes on the freshly loaded weights and returns `val/...` metrics; None = never."""
    eval_every: int | None = None
    """eval.every: evaluate at iterations N, 2N, ... (None = never)."""
    eval_before_train: bool = False
    """eval.before_train: evaluate at iteration 0, before any update."""

    @property
    def device(self) -> torch.device:
        """Where the policy lives, and with it the train phase's batches and losses."""
        return next(self.policy.parameters()).device


def run_loop(parts: LoopParts, start: int, iterations: int, *, max_drop_fraction: float, max_idle_iterations: int,
             fault: Callable[[int, str], None] | None = None) -> list[dict[str, float]]:
    """Iterations [start, iterations); returns each iteration's metrics (global over ranks). Raises
    RunBroken (on every rank) when the circuit breaker trips: `max_drop_fraction`
    (rollout.max_drop_fraction) and `max_idle_iterations` (experiment.max_idle_iterations), see the
    module docstring. `fault(iteration, phase)` is called as each phase starts (`Phases`)."""
    p, history, idle = parts, [], 0
    phases = Phases(p.tracker, p.engine, p.policy, p.trainer, p.ref_model, fault=fault)
    # bytes a weight sync copies: none when the engine runs on the policy's own tensors
    weight_bytes = 0 if p.engine.model is p.policy else _tensor_bytes(p.policy.parameters())
    multiplex = p.store is not None and p.engine.host is not None  # host DRAM: training states <-> KV pool
    for it in range(start, iterations):
        if multiplex:
            if not p.trainer.states_spilled:  # the first iteration (or a resume's): the states leave first
                phases.run(it, "offload", lambda: _offload_train_state(p),
                           bytes_moved=p.trainer.optimizer.spillable_bytes())
            phases.run(it, "host_in", lambda: p.engine.cache.restore_host(p.store, _sequences(p.engine),
                                                                          _host_pool_pages(p)), bytes_moved=lambda n: n)
        if p.engine.pool.is_released:
            phases.run(it, "wake", p.engine.wake)
        checksum = phases.run(it, "load_weights", lambda: _sync_weights(p, version=it + 1), bytes_moved=weight_bytes)
        val = (phases.run(it, "eval", lambda: p.evaluate(it)) if p.evaluate is not None
               and eval_due(it, p.eval_every, p.eval_before_train) else {})  # before the rollout touches the engine
        with p.tracker.rollout_progress(total=p.driver.groups_next_iteration * p.driver.group_size) as bar:
            rollout = phases.run(it, "rollout", lambda: p.driver.run_iteration(progress=bar))
        if p.release_pool:
            pool_bytes = p.engine.pool.num_pages * p.engine.layout.page_bytes
            host_tier = p.engine.cache.host_tier
            written = host_tier.pages_written_back if host_tier is not None else 0
            phases.run(it, "sleep", p.engine.sleep, bytes_moved=pool_bytes)  # drops the fused copies too
            if "host_pages_written_back" in rollout:  # the sleep's write-back belongs to this iteration too
                rollout["host_pages_written_back"] += host_tier.pages_written_back - written
        else:
            p.engine.drop_weight_copies()  # the engine holds no weight bytes of its own while training
        if multiplex:  # the KV pool's contents to NVMe, its DRAM back to the ledger, before the states return
            phases.run(it, "host_out", lambda: p.engine.cache.spill_host(
                p.store, _sequences(p.engine), next_version=it + 2, max_staleness=p.max_staleness),
                bytes_moved=lambda n: n)
        groups = p.driver.take_finished_groups()
        local = [len(groups), sum(sum(t.policy[1:]) for g in groups for t in g), sum(len(g) for g in groups)]
        if p.ranks.world > 1:  # the rollout -> train boundary: every rank has finished its rollout
            counts = phases.run(it, "gather", lambda: p.ranks.sum(local))
        else:
            counts = local
        num_groups, num_tokens, num_seqs = (int(c) for c in counts)
        if p.trainer.states_spilled:
            phases.run(it, "restore", p.trainer.restore_states, bytes_moved=p.trainer.optimizer.spilled_bytes)
        train = (phases.run(it, "train", lambda: _train(p, groups, num_tokens, num_seqs)) if num_groups
                 else {"train_skipped": 1.0})
        metrics, errors = _iteration_metrics(p, groups, {**rollout, **val}, train, phases.seconds)
        metrics["engine_checksum"] = checksum
        # Logged before the checkpoint publishes `latest`: a crash in between costs a re-run of this
        # iteration (whose metrics the resume then replaces), never a published iteration without
        # its metrics. (The checkpoint's own seconds are in phases.jsonl.)
        p.tracker.log(it, metrics)
        # data.epochs used up and every group trained: this iteration is the run's last (saved as such)
        # the flag is the same on every rank (one global row order); so is this sum
        exhausted = p.driver.data_exhausted and not p.ranks.sum([len(p.driver.carry) + len(p.driver.group_sizes)])[0]
        phases.run(it, "checkpoint", lambda: save_iteration(p, it, p.checkpoint, final=it == iterations - 1 or exhausted,
                                                            fault=phases.fault))
        phases.run(it, "offload", lambda: _offload_train_state(p),
                   bytes_moved=p.trainer.optimizer.spillable_bytes() if p.store is not None else 0)
        if train.get("skipped"):
            p.tracker.console.print(f"[yellow]iteration {it}: update skipped[/yellow] (non-finite loss or gradient "
                                    f"norm {train.get('grad_norm', float('nan')):.3g}; weights and optimizer unchanged)")
        if p.tracker.config.progress and (it % max(1, iterations // 40) == 0 or it == iterations - 1):
            p.tracker.console.print(
                f"iter {it:>4}  reward {metrics['reward_mean']:.3f}  correct {metrics['reward_correct_frac']:.3f}  "
                f"{metrics['rollout_tok_s']:.0f} tok/s  loss {metrics.get('loss', float('nan')):.4g}  "
                f"rollout {metrics.get('seconds/rollout', 0):.2f}s train {metrics.get('seconds/train', 0):.2f}s")
        for error in errors:
            p.tracker.console.print(f"[yellow]dropped[/yellow] {escape(error)}")  # "[c]" is an answer, not markup
        phases.seconds.clear()
        history.append(metrics)
        idle = 0 if metrics["groups_trained"] or metrics["trajectories_carried"] else idle + 1
        _check_breaker(it, metrics, idle, max_drop_fraction, max_idle_iterations)
        if exhausted:
            p.tracker.console.print(f"data exhausted after iteration {it} (data.epochs): every group trained")
            break
    return history


def _check_breaker(it: int, metrics: dict[str, float], idle: int, max_drop_fraction: float,
                   max_idle_iterations: int) -> None:
    """RunBroken when iteration `it` (global `metrics`) dropped more than `max_drop_fraction` of the
    trajectories it ended, or is the `max_idle_iterations`-th idle one in a row (`idle` counts them)."""
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
    return p.ranks.check_same(f"the engine weights' checksum after loading version {version}", checksum)


def _iteration_metrics(p: LoopParts, groups, rollout: dict[str, float], train: dict[str, float],
                       seconds: dict[str, float]) -> tuple[dict[str, float], list[str]]:
    """This iteration's metrics over all ranks, and the dropped trajectories' errors (the driver's
    list is cleared). Rewards are summed in global group order, so one rank and N ranks that
    generated the same groups report the same reward_mean bit for bit."""
    local = {"metrics": {**rollout, **train, **{f"seconds/{k}": v for k, v in seconds.items()}},
             # (group, rewards, correct): correct is the environment's is_correct, else reward >= 1
             "rewards": [(g[0].group_id, [t.reward for t in g],
                          [t.reward >= 1.0 if t.is_correct is None else t.is_correct for t in g]) for g in groups],
             "errors": list(p.driver.errors)}
    p.driver.errors.clear()
    gathered = p.ranks.all_gather(local)
    metrics = merge_metrics([r["metrics"] for r in gathered]) if p.ranks.world > 1 else local["metrics"]
    ordered = sorted((g for r in gathered for g in r["rewards"]), key=lambda g: g[0])
    rewards = [x for _, rs, _ in ordered for x in rs]
    correct = [c for _, _, cs in ordered for c in cs]
    errors = [(f"rank {rank}: " if p.ranks.world > 1 else "") + e for rank, r in enumerate(gathered) for e in r["errors"]]
    metrics.update(groups_trained=float(sum(len(r["rewards"]) for r in gathered)),
                   reward_mean=sum(rewards) / len(rewards) if rewards else float("nan"),
                   reward_correct_frac=sum(correct) / len(correct) if correct else float("nan"))
    return metrics, errors


def _train(p: LoopParts, groups, num_tokens: int, num_seqs: int) -> dict[str, float]:
    """One policy update on this rank's groups (maybe none), the loss normalised by the global
    counts of policy tokens and sequences (`num_tokens`, `num_seqs`, summed over ranks)."""
    batch = PackedBatch(groups, p.advantage, device=p.device)
    ref = (reference_logprobs(p.ref_model, batch, p.num_chunks, p.trainer.config.chunk_split)
           if p.ref_model is not None and batch.num_sequences else None)
    with p.tracker.train_progress(total_steps=1) as bar:
        metrics = policy_update(p.trainer, batch, p.loss, p.micro_batch_tokens, ref,
                                global_counts=(num_tokens, num_seqs), ppo_epochs=p.ppo_epochs,
                                mini_batches=p.mini_batches)
        bar.advance(metrics["loss"])
    return metrics


def _sequences(engine: Engine) -> list:
    """Every sequence the engine still knows (the paused ones park on the host, preempted ones may be
    swapped out there)."""
    return [s for request in engine.requests.values() for s in request.seqs]


def _host_pool_pages(p: LoopParts) -> int:
    """Pages the host KV pool leases for this rollout: engine.host_pool_mb's, or with
    host_pool_mb="auto" every byte the ledger has free now (the spilled states' DRAM)."""
    host_bytes, page_bytes = p.engine.config.host_pool_bytes, p.engine.layout.page_bytes
    if host_bytes is None:  # "auto"
        return p.ledger.free // page_bytes if p.ledger is not None else 0
    return host_bytes // page_bytes


def _offload_train_state(p: LoopParts) -> None:
    """Training state leaves its tier here: with a store, the optimizer's host states (FP32 masters +
    AdamW moments) are spilled to NVMe and their host bytes returned to the ledger; the next
    iteration's "restore" phase reads them back before training. The iteration's checkpoint was
    written before, from host memory. Without a store nothing moves (one CPU process: the
    optimizer already lives on the host)."""
    if p.store is not None:
        p.trainer.offload_states(p.store)
