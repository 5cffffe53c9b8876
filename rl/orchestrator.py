"""The phase orchestrator: the one RL loop, explicit calls in order (SPEC §5.4).

Per iteration:
    wake engine -> load policy weights into it (version = iteration + 1) -> ROLLOUT -> engine sleep
    -> [restore training state, if spilled] -> TRAIN (reference logprobs, policy update) -> offload
    training state (NVMe spill with memory.spill_dir) -> checkpoint -> log.
Every transition goes through `Phases.run`, which records seconds, bytes moved and the memory
held by each tier (engine pool on device, host pool, training state on device / host / disk) in
the tracker's memory timeline. With `memory.spill_dir`, `_offload_train_state` spills the
optimizer's host states to NVMe (`train_disk` in the timeline) and "restore" reads them back.
A checkpoint is written atomically after each iteration; resume starts after the last one.

Several ranks (torchrun; rl/ranks.py): every rank runs this same loop on its own engine and its
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from memory.host_ledger import HostLedger
from memory.nvme_store import NvmeStore
from models.model import HybridLM
from rl.checkpoint import save_iteration
from rl.ranks import Ranks, merge_metrics, weights_checksum
from rl.rollout import RolloutDriver
from rl.tracking import Tracker
from rl.update import PackedBatch, policy_update, reference_logprobs
from rollout.engine import Engine
from trainer.losses import LossConfig
from trainer.ref_stream import StreamedReference
from trainer.step import Trainer


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Phases:
    """Runs one phase transition, timing it and logging the memory tiers afterwards."""

    def __init__(self, tracker: Tracker, engine: Engine, policy: HybridLM, trainer: Trainer) -> None:
        self.tracker, self.engine, self.policy, self.trainer = tracker, engine, policy, trainer
        self.seconds: dict[str, float] = {}

    def memory(self) -> dict[str, int]:
        pool = 0 if self.engine.pool.is_released else self.engine.pool.num_pages * self.engine.layout.page_bytes
        weights = _tensor_bytes(self.policy.parameters()) + _tensor_bytes(self.engine.model.parameters())
        host_pool = self.engine.host.pool_bytes if self.engine.host is not None else 0
        return {"device_pool": pool, "host_pool": host_pool, "train_device": weights,
                "train_host": self.trainer.optimizer.host_bytes(), "train_disk": self.trainer.optimizer.disk_bytes}

    def run(self, iteration: int, name: str, fn: Callable[[], object], bytes_moved: int = 0) -> object:
        t0 = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - t0
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.tracker.log_phase(iteration, name, seconds, bytes_moved, self.memory())
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

    @property
    def device(self) -> torch.device:
        """Where the policy lives, and with it the train phase's batches and losses."""
        return next(self.policy.parameters()).device


def run_loop(parts: LoopParts, start: int, iterations: int,
             fault: Callable[[int, str], None] = lambda iteration, phase: None) -> list[dict[str, float]]:
    """Iterations [start, iterations); returns each iteration's metrics (global over ranks).
    `fault(iteration, phase)` is called as each phase starts (tests inject a crash there)."""
    p, history = parts, []
    phases = Phases(p.tracker, p.engine, p.policy, p.trainer)
    weight_bytes = _tensor_bytes(p.policy.parameters())
    for it in range(start, iterations):
        if p.engine.pool.is_released:
            fault(it, "wake")
            phases.run(it, "wake", p.engine.wake)
        fault(it, "load_weights")
        checksum = phases.run(it, "load_weights", lambda: _sync_weights(p, version=it + 1), bytes_moved=weight_bytes)
        fault(it, "rollout")
        with p.tracker.rollout_progress(total=p.driver.groups_next_iteration * p.driver.group_size) as bar:
            rollout = phases.run(it, "rollout", lambda: p.driver.run_iteration(progress=bar))
        if p.release_pool:
            fault(it, "sleep")
            pool_bytes = p.engine.pool.num_pages * p.engine.layout.page_bytes
            phases.run(it, "sleep", p.engine.sleep, bytes_moved=pool_bytes)
        groups = p.driver.take_finished_groups()
        local = [len(groups), sum(sum(t.policy[1:]) for g in groups for t in g), sum(len(g) for g in groups)]
        if p.ranks.world > 1:  # the rollout -> train boundary: every rank has finished its rollout
            fault(it, "gather")
            counts = phases.run(it, "gather", lambda: p.ranks.sum(local))
        else:
            counts = local
        num_groups, num_tokens, num_seqs = (int(c) for c in counts)
        if p.trainer.states_spilled:
            fault(it, "restore")
            phases.run(it, "restore", p.trainer.restore_states, bytes_moved=p.trainer.optimizer.spilled_bytes)
        fault(it, "train")
        train = (phases.run(it, "train", lambda: _train(p, groups, num_tokens, num_seqs)) if num_groups
                 else {"train_skipped": 1.0})
        fault(it, "offload")
        phases.run(it, "offload", lambda: _offload_train_state(p),
                   bytes_moved=p.trainer.optimizer.spillable_bytes() if p.store is not None else 0)
        fault(it, "checkpoint")
        phases.run(it, "checkpoint", lambda: save_iteration(p, it))
        metrics, errors = _iteration_metrics(p, groups, rollout, train, phases.seconds)
        metrics["engine_checksum"] = checksum
        p.tracker.log(it, metrics)
        if p.tracker.config.progress and (it % max(1, iterations // 40) == 0 or it == iterations - 1):
            p.tracker.console.print(
                f"iter {it:>4}  reward {metrics['reward_mean']:.3f}  correct {metrics['reward_correct_frac']:.3f}  "
                f"{metrics['rollout_tok_s']:.0f} tok/s  loss {metrics.get('loss', float('nan')):.4g}  "
                f"rollout {metrics.get('seconds/rollout', 0):.2f}s train {metrics.get('seconds/train', 0):.2f}s")
        for error in errors:
            p.tracker.console.print(f"[yellow]dropped[/yellow] {error}")
        phases.seconds.clear()
        history.append(metrics)
    return history


def _sync_weights(p: LoopParts, version: int) -> int:
    """Load the policy's weights into this rank's engine; returns their checksum, the same on every
    rank (a RuntimeError naming the ranks otherwise: the trainer's all-gather must leave every
    replica identical)."""
    p.engine.load_weights(p.policy.state_dict(), version=version)
    checksum = weights_checksum(p.engine.model.state_dict())
    return p.ranks.check_same(f"the engine weights' checksum after loading version {version}", checksum)


def _iteration_metrics(p: LoopParts, groups, rollout: dict[str, float], train: dict[str, float],
                       seconds: dict[str, float]) -> tuple[dict[str, float], list[str]]:
    """This iteration's metrics over all ranks, and the dropped trajectories' errors (the driver's
    list is cleared). Rewards are summed in global group order, so one rank and N ranks that
    generated the same groups report the same reward_mean bit for bit."""
    local = {"metrics": {**rollout, **train, **{f"seconds/{k}": v for k, v in seconds.items()}},
             "rewards": [(g[0].group_id, [t.reward for t in g]) for g in groups],
             "errors": list(p.driver.errors)}
    p.driver.errors.clear()
    gathered = p.ranks.all_gather(local)
    metrics = merge_metrics([r["metrics"] for r in gathered]) if p.ranks.world > 1 else local["metrics"]
    rewards = [x for _, rs in sorted(g for r in gathered for g in r["rewards"]) for x in rs]
    errors = [(f"rank {rank}: " if p.ranks.world > 1 else "") + e for rank, r in enumerate(gathered) for e in r["errors"]]
    metrics.update(groups_trained=float(sum(len(r["rewards"]) for r in gathered)),
                   reward_mean=sum(rewards) / len(rewards) if rewards else float("nan"),
                   reward_correct_frac=sum(x >= 1.0 for x in rewards) / len(rewards) if rewards else float("nan"))
    return metrics, errors


def _train(p: LoopParts, groups, num_tokens: int, num_seqs: int) -> dict[str, float]:
    """One policy update on this rank's groups (maybe none), the loss normalised by the global
    counts of policy tokens and sequences (`num_tokens`, `num_seqs`, summed over ranks)."""
    batch = PackedBatch(groups, p.advantage, device=p.device)
    ref = (reference_logprobs(p.ref_model, batch, p.num_chunks)
           if p.ref_model is not None and batch.num_sequences else None)
    with p.tracker.train_progress(total_steps=1) as bar:
        metrics = policy_update(p.trainer, batch, p.loss, p.micro_batch_tokens, ref,
                                global_counts=(num_tokens, num_seqs))
        bar.advance(metrics["loss"])
    return metrics


def _offload_train_state(p: LoopParts) -> None:
    """Training state leaves its tier here: with a store, the optimizer's host states (FP32 masters +
    AdamW moments) are spilled to NVMe and their host bytes returned to the ledger; the next
    iteration's "restore" phase reads them back before training. The checkpoint that follows reads
    them from the store (Trainer.save). Without a store nothing moves (one CPU process: the
    optimizer already lives on the host)."""
    if p.store is not None:
        p.trainer.offload_states(p.store)
