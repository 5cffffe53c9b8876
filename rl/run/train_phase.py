"""The loop's train phase: one iteration's groups -> the packed batch -> advantages (with the reference's
logprobs and the critic's values where the estimator reads them) -> the critic's steps -> the policy's."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from models.context_parallel import ContextParallel, ZigZagSplit
from rl.run.advantages import estimate
from rl.run.update import PackedBatch, mini_batch_split, policy_update, reference_logprobs


def train_phase(p, groups, num_tokens: int, num_seqs: int) -> dict[str, float]:
    """One policy update on this rank's groups (maybe none), the loss normalised by the global
    counts of policy tokens and sequences (`num_tokens`, `num_seqs`, summed over ranks): the batch's
    advantages first (rl/run/advantages.py; the reference's logprobs and the critic's values when the
    estimator reads them), the critic's steps, then the policy's."""
    algo, t = p.cfg.algo, p.cfg.trainer
    cp = p.ranks.context_parallel
    if cp is not None:  # the context group's groups, every rank's in rank order: split over the group
        groups = [g for rank_groups in _gather_in_group(groups, cp) for g in rank_groups]
    batch = PackedBatch(groups, algo, device=p.device, max_new_tokens=p.cfg.rollout.max_new_tokens)
    moments = _moments(p)
    joins = bool(batch.num_sequences) or p.policy.expert_parallel is not None
    beta = p.kl_ctl.beta if p.kl_ctl is not None else 0.0
    shaping: dict[str, float] = {}
    if cp is not None:  # outcome estimators only (rl/config/checks.py): advantages on the whole sequences
        shaping = estimate(batch, algo, batch.rewards, moments=moments)
        batch = batch.shard(ZigZagSplit(batch.seq_lens, cp.size, p.cfg.model.linear_conv_kernel_dim - 1), cp.rank)
    ref = (reference_logprobs(p.ref_model, batch, t.num_chunks, t.chunk_split)
           if p.ref_model is not None and joins else None)
    values = p.critic.values(batch, t.micro_batch_tokens) if p.critic is not None else None
    if cp is None:
        shaping = estimate(batch, algo, batch.rewards, ref_logp=ref, values=values, beta=beta, moments=moments)
    if algo.mask_truncated:
        kept = [i for i, traj in enumerate(batch.trajectories) if not traj.truncated]
        shaping["truncated_masked_frac"] = 1 - len(kept) / max(1, batch.num_sequences)
        batch, values, ref = _kept(batch, kept, values, ref)
    metrics = dict(shaping)
    if algo.token_level and batch.num_sequences:  # per token (the outcome ones are per sequence: figures.py)
        adv = batch.advantages[batch.mask].double()
        metrics.update({"advantage/mean": float(adv.mean()), "advantage/std": float(adv.std(unbiased=False))})
    if p.critic is not None:
        metrics.update(p.critic.update(batch, values, batch.returns, t.micro_batch_tokens, num_tokens,
                                       mini_batch_split(batch.num_sequences, algo.mini_batches), algo.ppo_epochs))
    with p.tracker.train_progress(total_steps=1) as bar:
        metrics.update(policy_update(p.trainer, batch, algo.loss, t.micro_batch_tokens,
                                     ref if algo.loss.kl_coef > 0 else None, global_counts=(num_tokens, num_seqs), ppo_epochs=algo.ppo_epochs,
                                     mini_batches=algo.mini_batches))
        bar.advance(metrics["loss"])
    if p.kl_ctl is not None and "kl_in_reward/kl" in metrics:
        kl = p.ranks.sum([metrics["kl_in_reward/kl"] * batch.num_sequences, float(batch.num_sequences)])
        p.kl_ctl.update(kl[0] / max(1.0, kl[1]), int(kl[1]))
    return metrics


def _kept(batch: PackedBatch, kept: list[int], values, ref):
    """The batch of the sequences `kept`, with the rows of the critic's values and the reference's logprobs."""
    if len(kept) == batch.num_sequences:
        return batch, values, ref
    rows = batch.rows_of(kept)
    return batch.select(kept), None if values is None else values[rows], None if ref is None else ref[rows]


def _moments(p) -> Callable[[torch.Tensor], torch.Tensor]:
    """Sums a small float64 tensor over the data-parallel ranks (batch statistics of the advantages);
    under context parallelism every rank of a context group holds the group's whole batch, counted once."""
    if p.ranks.world == 1:
        return lambda x: x
    copies = p.ranks.context_parallel.size if p.ranks.context_parallel is not None else 1

    def total(x: torch.Tensor) -> torch.Tensor:
        return torch.tensor(p.ranks.sum(x.tolist()), dtype=torch.float64, device=x.device) / copies
    return total


def _gather_in_group(groups: list, cp: ContextParallel) -> list[list]:
    """Every context rank's finished groups (picklable trajectories), in the group's rank order."""
    out: list = [None] * cp.size
    dist.all_gather_object(out, groups, group=cp.group)
    return out
