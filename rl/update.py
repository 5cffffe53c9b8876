"""The train phase's data: finished trajectory groups -> one packed batch -> one policy update.

Per group, advantages come from the registered estimator over the members' rewards (GRPO /
RLOO; a group shrunk by dropped trajectories uses its actual size). Each trajectory becomes one
packed sequence (inputs tokens[:-1], targets tokens[1:]); only policy tokens are trained on.
Logprobs: `behaviour` = what the engine sampled with (per token, with its policy version);
`old` = the policy at the start of this update (one optimizer step per iteration, so the
current logprobs detached); the truncated IS weight exp(old - behaviour) (capped) corrects tokens
sampled by older versions (carried-over partial rollouts, stale KV) and rollout/train numerics.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from models.model import HybridLM
from rl.rollout import Trajectory
from trainer.chunks import ChunkedModel
from trainer.losses import LossConfig, Segments, lookup, rl_loss
from trainer.ref_stream import StreamedReference
from trainer.step import Trainer, micro_batches


class PackedBatch:
    """The groups' trajectories as packed rows [N] (sequence i owns `seq_lens[i]` consecutive rows),
    every tensor on `device` (the policy's: rl/orchestrator.py passes `LoopParts.device`)."""

    def __init__(self, groups: Sequence[Sequence[Trajectory]], advantage: str,
                 device: torch.device | str = "cpu") -> None:
        estimator = lookup("advantage", advantage)
        trajs = [t for g in groups for t in g]
        advs = torch.cat([estimator(torch.tensor([t.reward for t in g], dtype=torch.float32, device=device), len(g))
                          for g in groups]) if groups else torch.zeros(0, device=device)
        self.trajectories = trajs
        self.seq_lens = [len(t.tokens) - 1 for t in trajs]

        def packed(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)  # [N]

        self.token_ids = packed([x for t in trajs for x in t.tokens[:-1]], torch.long)
        self.targets = packed([x for t in trajs for x in t.tokens[1:]], torch.long)
        self.mask = packed([x for t in trajs for x in t.policy[1:]], torch.bool)
        self.behaviour = packed([x for t in trajs for x in t.logprobs[1:]], torch.float32)
        self.versions = packed([x for t in trajs for x in t.versions[1:]], torch.long)
        self.seq_of_row = torch.repeat_interleave(torch.arange(len(trajs), device=device),
                                                  torch.tensor(self.seq_lens, dtype=torch.long, device=device))
        self.advantages = advs[self.seq_of_row] if trajs else torch.zeros(0, device=device)

    @property
    def num_sequences(self) -> int:
        return len(self.trajectories)


def reference_logprobs(ref_model: HybridLM | StreamedReference, batch: PackedBatch,
                       num_chunks: int, split: str = "layers") -> torch.Tensor:
    """log p_ref(target) for every packed row (the frozen reference policy, for the KL term).

    A `StreamedReference` borrows the trainer's gradient slots, so call this between training
    steps (before `policy_update`); a resident `HybridLM` (memory.reference=resident) is its twin:
    the same chunk split and ops, equal logprobs bit for bit on CPU fp32."""
    if isinstance(ref_model, StreamedReference):
        if (ref_model.num_chunks, ref_model.split) != (num_chunks, split):
            raise ValueError(f"streamed reference split into {ref_model.num_chunks} chunks by {ref_model.split!r}, "
                             f"the trainer into {num_chunks} by {split!r}")
        return ref_model.logprobs(batch.token_ids, batch.seq_lens, batch.targets)
    return ChunkedModel(ref_model, num_chunks, split).forward_logprobs(batch.token_ids, batch.seq_lens, batch.targets)


def policy_update(trainer: Trainer, batch: PackedBatch, loss_config: LossConfig, micro_batch_tokens: int | None,
                  ref_logp: torch.Tensor | None = None,
                  global_counts: tuple[int, int] | None = None) -> dict[str, float]:
    """One optimizer step on the batch; returns the trainer's and the loss's metrics (this rank's).

    global_counts: (policy tokens, sequences) of the whole step's batch over all data-parallel
    ranks; None = this batch's own (one rank). Each micro-batch's loss is weighted by its share of
    these, and the trainer sums gradients over micro-batches and ranks, so N ranks that split the
    groups between them take the same step as one rank with all of them (up to fp32 summation
    order). A rank's batch may be empty (no groups this step): it still joins the step's collectives."""
    policy_tokens = [sum(t.policy[1:]) for t in batch.trajectories]  # per sequence, from the host lists
    total_valid, total_seqs = global_counts if global_counts is not None else (sum(policy_tokens),
                                                                               batch.num_sequences)
    total_valid = max(1, total_valid)
    token_level = loss_config.aggregation == "token-mean"
    parts: list[tuple[float, dict[str, float]]] = []  # (policy tokens, rl_loss metrics) per micro-batch
    # The trainer calls loss_fn once per micro-batch, in the order of `micro_batches`: a run of
    # consecutive sequences, whose packed rows rl_loss takes as they are (no padding), with each
    # row's sequence within the micro-batch computed on the device (no host sync, no copy).
    plan = iter(micro_batches(batch.seq_lens, micro_batch_tokens) if batch.num_sequences else [])

    def loss_fn(logp: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        seqs = next(plan)
        if sum(batch.seq_lens[i] for i in seqs) != rows.numel():
            raise RuntimeError(f"micro-batch of sequences {seqs} has {sum(batch.seq_lens[i] for i in seqs)} rows, "
                               f"the trainer passed {rows.numel()}: policy_update's plan and the trainer's disagree")
        segments = Segments(batch.seq_of_row[rows] - seqs[0], len(seqs))  # [n]: 0 .. len(seqs) - 1
        loss, metrics = rl_loss(logp, logp.detach(), batch.advantages[rows], batch.mask[rows], loss_config,
                                behaviour_logp=batch.behaviour[rows],
                                ref_logp=None if ref_logp is None else ref_logp[rows], segments=segments)
        # Gradients are summed over micro-batches: weight this one by its share of the aggregate.
        valid = sum(policy_tokens[i] for i in seqs)
        share = (valid / total_valid) if token_level else len(seqs) / max(1, total_seqs)
        parts.append((float(valid), metrics))
        return loss * share

    metrics = trainer.train_step(batch.token_ids, batch.seq_lens, batch.targets, loss_fn, micro_batch_tokens)
    loss_metrics = combine_micro_batches(parts)
    versions = [v for t in batch.trajectories for v, p in zip(t.versions[1:], t.policy[1:]) if p]  # host lists
    newest = max(versions, default=0)
    return {**{f"loss/{k}": v for k, v in loss_metrics.items()}, **metrics,
            "train_tokens": float(sum(policy_tokens)), "train_sequences": float(batch.num_sequences),
            "stale_token_frac": sum(v < newest for v in versions) / len(versions) if versions else 0.0}


def combine_micro_batches(parts: Sequence[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """One rank's loss metrics from its micro-batches' (policy tokens, metrics): `*_max` the max,
    `num_tokens` the sum, anything else the token-weighted mean (as rl/ranks.py merges ranks)."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for _, m in parts for k in m):
        have = [(w, m[key]) for w, m in parts if key in m]
        if key.endswith("_max"):
            out[key] = max(v for _, v in have)
        elif key == "num_tokens":
            out[key] = sum(v for _, v in have)
        else:
            total = sum(w for w, _ in have)
            out[key] = sum(w * v for w, v in have if w) / total if total else have[-1][1]
    return out
