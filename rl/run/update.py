"""The train phase's data: finished trajectory groups -> one packed batch -> one policy update.

Per group, advantages come from the registered estimator over the members' rewards (GRPO /
RLOO; a group shrunk by dropped trajectories uses its actual size). Each trajectory becomes one
packed sequence (inputs tokens[:-1], targets tokens[1:]); only policy tokens are trained on.
Logprobs: `behaviour` = what the engine sampled with (per token, with its policy version);
`old` = the policy at the start of this update (with one optimizer step per iteration, the
default, the step's own logprobs detached; with `ppo_epochs` x `mini_batches` steps, one no-grad
forward before the first); the truncated IS weight exp(old - behaviour) (capped) corrects tokens
sampled by older versions (carried-over partial rollouts, stale KV) and rollout/train numerics.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from models.context_parallel import ZigZagSplit
from models.model import HybridLM
from rl.config.algo import AlgoConfig
from rl.episodes.driver import Trajectory
from rl.run.advantages import shaped_rewards
from rl.run.mismatch_metrics import mismatch_metrics
from trainer.chunks import ChunkedModel
from trainer.losses import LossConfig, Segments, lookup, rl_loss
from trainer.ref_stream import StreamedReference
from trainer.step import Trainer


class PackedBatch:
    """The groups' trajectories as packed rows [N] (sequence i owns `seq_lens[i]` consecutive rows),
    every tensor on `device` (the policy's: rl/run/loop.py passes `LoopParts.device`).

    `advantage` names an outcome estimator (advantages computed here, from the raw rewards), or is the
    run's `AlgoConfig`: then `rewards` are the shaped ones (rl/run/advantages.py) and the advantages
    are set by `advantages.estimate` (which may need the reference's logprobs or the critic's values)."""

    def __init__(self, groups: Sequence[Sequence[Trajectory]], advantage: "str | AlgoConfig",
                 device: torch.device | str = "cpu", max_new_tokens: int | None = None) -> None:
        trajs = [t for g in groups for t in g]
        self.trajectories = trajs
        self.group_sizes = [len(g) for g in groups]
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
        self.returns: torch.Tensor | None = None
        """[N] the critic's targets (token-level estimators), None otherwise."""
        if isinstance(advantage, str):
            self.rewards = packed([t.reward for t in trajs], torch.float32)  # [S]
            estimator = lookup("advantage", advantage)
            advs = (torch.cat([estimator(self.rewards[s:s + n], n) for s, n in zip(_starts(self.group_sizes),
                                                                                  self.group_sizes)])
                    if groups else torch.zeros(0, device=device))
            self.advantages = advs[self.seq_of_row] if trajs else torch.zeros(0, device=device)
        else:
            self.rewards = packed(shaped_rewards(groups, advantage, max_new_tokens or 0), torch.float32)
            self.advantages = torch.zeros(len(self.token_ids), device=device)  # set by advantages.estimate

    def rows_of(self, keep: Sequence[int]) -> torch.Tensor:
        """[rows] the packed row indices of sequences `keep` (indices, in order), for any per-row tensor."""
        offsets = _starts(self.seq_lens)
        return torch.tensor([r for i in keep for r in range(offsets[i], offsets[i] + self.seq_lens[i])],
                            dtype=torch.long, device=self.token_ids.device)

    def select(self, keep: Sequence[int]) -> "PackedBatch":
        """The batch of sequences `keep` (indices, in order): rows, advantages and returns gathered."""
        out = object.__new__(PackedBatch)
        rows = self.rows_of(keep)
        out.trajectories = [self.trajectories[i] for i in keep]
        out.seq_lens = [self.seq_lens[i] for i in keep]
        out.group_sizes = [len(keep)]  # groups are not read after selection
        out.rewards = self.rewards[torch.tensor(list(keep), dtype=torch.long, device=rows.device)]
        for name in ("token_ids", "targets", "mask", "behaviour", "versions", "advantages"):
            out.__dict__[name] = getattr(self, name)[rows]
        out.returns = None if self.returns is None else self.returns[rows]
        lens = torch.tensor(out.seq_lens, dtype=torch.long, device=rows.device)
        out.seq_of_row = torch.repeat_interleave(torch.arange(len(keep), device=rows.device), lens)
        return out

    split: ZigZagSplit | None = None
    """Set on a context-parallel share (`shard`): how the whole sequences were cut; None = whole rows."""

    @property
    def num_sequences(self) -> int:
        return len(self.trajectories)

    def shard(self, split: ZigZagSplit, rank: int) -> "PackedBatch":
        """This context-parallel rank's rows of the batch (its zig-zag share of every sequence, pad
        rows masked out): the same trajectories, `seq_lens` the local ones, every row tensor
        sharded. Targets were shifted on the whole sequences, before the split."""
        if split.seq_lens != self.seq_lens:
            raise ValueError(f"split of lengths {split.seq_lens[:4]}... does not match the batch's {self.seq_lens[:4]}...")
        out = object.__new__(PackedBatch)
        out.trajectories, out.seq_lens, out.split = self.trajectories, split.local_lens, split
        out.group_sizes, out.rewards, out.returns = self.group_sizes, self.rewards, None
        for name, fill in (("token_ids", 0), ("targets", 0), ("mask", False), ("behaviour", 0.0), ("versions", 0),
                           ("seq_of_row", 0), ("advantages", 0.0)):
            out.__dict__[name] = split.shard(getattr(self, name), rank, fill)
        # pad rows belong to their sequence (they are masked out): each row's sequence from the lengths
        lens = torch.tensor(split.local_lens, dtype=torch.long, device=self.token_ids.device)
        out.seq_of_row = torch.repeat_interleave(torch.arange(len(split.local_lens), device=lens.device), lens)
        return out


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
                  ref_logp: torch.Tensor | None = None, global_counts: tuple[int, int] | None = None, *,
                  ppo_epochs: int = 1, mini_batches: int = 1) -> dict[str, float]:
    """`ppo_epochs` passes over the batch, each split into `mini_batches` mini-batches of whole
    sequences (a fixed order: consecutive runs of sequences, sizes differing by at most one, the same
    split every epoch; fewer when the batch has fewer sequences), one optimizer step per
    mini-batch. Returns the trainer's and the loss's metrics (this rank's).

    old_logp (PPO's pi_old, the ratio's denominator) is the policy at the start of this update: with
    one step (the defaults) the step's own logprobs detached, as always; with more, one no-grad
    forward over the batch before the first step (`old_logprobs`), so from the second step on the
    ratio moves and the clip binds. The truncated IS weight keeps correcting pi_old against the
    engine's behaviour logprobs (stale tokens, rollout numerics), whatever the number of steps.

    global_counts: (policy tokens, sequences) of the whole step's batch over all data-parallel
    ranks; None = this batch's own (one rank). Each micro-batch's loss is weighted by its share of
    these, and the trainer sums gradients over micro-batches and ranks, so N ranks that split the
    groups between them take the same step as one rank with all of them (up to fp32 summation
    order). A rank's batch may be empty (no groups this step): it still joins the step's collectives.
    A mini-batch is normalised by its own counts; mini_batches > 1 needs one rank (the global counts of
    each rank's mini-batch would need a collective per update).

    Metrics besides the trainer's (averaged over steps; `lr` the last step's, `skipped` and
    `micro_batches` summed) and `loss/*` (token-weighted over every micro-batch of every step):
    `optimizer_steps` (steps taken, skipped ones not counted), `clip_frac` (PPO clip binding, per
    step over its valid tokens) and `approx_kl` (k3 estimate of KL(pi_old || pi) on the valid tokens,
    which pi_old sampled: (r - 1) - log r, r = pi / pi_old; 0 for a one-step update).
    """
    if ppo_epochs < 1 or mini_batches < 1:
        raise ValueError(f"ppo_epochs={ppo_epochs}, mini_batches={mini_batches}, expected both >= 1")
    if mini_batches > 1 and trainer.world > 1:
        raise ValueError(f"mini_batches={mini_batches} with {trainer.world} data-parallel ranks: "
                         f"mini-batches need one rank (algo.mini_batches=1 under DP)")
    policy_tokens = [sum(t.policy[1:]) for t in batch.trajectories]  # per sequence, from the host lists
    splits = mini_batch_split(batch.num_sequences, mini_batches)
    one_step = ppo_epochs == 1 and len(splits) == 1
    # (an expert-parallel rank without sequences still joins its peers' passes)
    old = (None if one_step or not (batch.num_sequences or trainer.expert_parallel is not None)
           else old_logprobs(trainer, batch, micro_batch_tokens))
    steps: list[tuple[dict[str, float], list[tuple[float, dict[str, float]]], torch.Tensor | None]] = []
    # the trainer's logprobs at the update's start, for the mismatch metrics: pi_old, or the first
    # epoch's own (detached) logprobs as each micro-batch computes them
    seen = old if old is not None else torch.zeros_like(batch.behaviour)
    for epoch in range(ppo_epochs):
        for seqs in splits:
            if len(splits) == 1:
                counts = global_counts if global_counts is not None else (sum(policy_tokens), batch.num_sequences)
            else:
                counts = (sum(policy_tokens[i] for i in seqs), len(seqs))
            steps.append(_step(trainer, batch, seqs, counts, policy_tokens, loss_config, micro_batch_tokens,
                               ref_logp, old, record=seen if old is None and epoch == 0 else None))
    versions = [v for t in batch.trajectories for v, p in zip(t.versions[1:], t.policy[1:]) if p]  # host lists
    newest = max(versions, default=0)
    # counted once over the ranks: a context-parallel share counts its own tokens, and its group's
    # sequences on the group's first rank only
    own_tokens = float(sum(policy_tokens)) if batch.split is None else float(batch.mask.sum())
    counts_sequences = batch.split is None or trainer.model.context_parallel.rank == 0
    return {**_update_metrics(steps, ppo_epochs), **mismatch_metrics(batch, seen, loss_config),
            "train_tokens": own_tokens, "train_sequences": float(batch.num_sequences) if counts_sequences else 0.0,
            "stale_token_frac": sum(v < newest for v in versions) / len(versions) if versions else 0.0}


def _starts(sizes: Sequence[int]) -> list[int]:
    out, total = [], 0
    for n in sizes:
        out.append(total)
        total += n
    return out


def mini_batch_split(num_sequences: int, mini_batches: int) -> list[list[int]]:
    """Sequence indices per mini-batch: consecutive runs, sizes differing by at most one, at most
    `mini_batches` of them and none empty (one empty mini-batch for an empty batch: a data-parallel
    rank without sequences still takes the step)."""
    count = max(1, min(mini_batches, num_sequences))
    size, extra = divmod(num_sequences, count)
    bounds = [0]
    for k in range(count):
        bounds.append(bounds[-1] + size + (k < extra))
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


@torch.no_grad()
def old_logprobs(trainer: Trainer, batch: PackedBatch, micro_batch_tokens: int | None) -> torch.Tensor:
    """log pi_old(target) [N] float32 for every packed row: the policy as it is now, through the
    trainer's chunk path, micro-batched by the same token budget as training."""
    return trainer.forward_logprobs(batch.token_ids, batch.seq_lens, batch.targets, micro_batch_tokens)


def _step(trainer: Trainer, batch: PackedBatch, seqs: list[int], counts: tuple[int, int], policy_tokens: list[int],
          loss_config: LossConfig, micro_batch_tokens: int | None, ref_logp: torch.Tensor | None,
          old: torch.Tensor | None, record: torch.Tensor | None = None
          ) -> tuple[dict[str, float], list[tuple[float, dict[str, float]]], torch.Tensor | None]:
    """One optimizer step on the consecutive sequences `seqs` of the batch (maybe none), the loss
    normalised by `counts` (policy tokens, sequences). `old`: pi_old per packed row, None = the
    step's own logprobs detached. Returns (trainer metrics, (policy tokens, rl_loss metrics) per
    micro-batch, [2] device tensor of the k3 sum and token count vs `old`, None without `old`)."""
    total_valid, total_seqs = max(1, counts[0]), counts[1]
    token_level = loss_config.aggregation == "token-mean"
    first = seqs[0] if seqs else 0
    seq_lens = [batch.seq_lens[i] for i in seqs]
    row0 = sum(batch.seq_lens[:first])
    rows_end = row0 + sum(seq_lens)
    parts: list[tuple[float, dict[str, float]]] = []  # (policy tokens, rl_loss metrics) per micro-batch
    kl = None if old is None else torch.zeros(2, device=batch.token_ids.device)  # [k3 sum, valid tokens]
    # The trainer calls loss_fn once per micro-batch with its sequences (indices into `seq_lens`, a
    # run of consecutive ones), whose packed rows rl_loss takes as they are (no padding), with each
    # row's sequence within the micro-batch computed on the device (no host sync, no copy).

    def loss_fn(logp: torch.Tensor, rows: torch.Tensor, local: list[int]) -> torch.Tensor:
        nonlocal kl
        mine = [first + i for i in local]  # the mini-batch's sequences -> the batch's
        rows = rows + row0 if row0 else rows  # the trainer's rows are the mini-batch's; the batch's here
        whole = (None if batch.split is None  # a context-parallel share: divide by the whole sequences' counts
                 else torch.tensor([policy_tokens[i] for i in mine], dtype=torch.float32, device=logp.device))
        segments = Segments(batch.seq_of_row[rows] - mine[0], len(mine), whole)  # [n]: 0 .. len(mine) - 1
        old_logp = logp.detach() if old is None else old[rows]
        if record is not None:
            record[rows] = old_logp
        mask = batch.mask[rows]
        loss, metrics = rl_loss(logp, old_logp, batch.advantages[rows], mask, loss_config,
                                behaviour_logp=batch.behaviour[rows],
                                ref_logp=None if ref_logp is None else ref_logp[rows], segments=segments)
        if kl is not None:
            k3 = lookup("kl_estimator", "k3")(old_logp, logp.detach())  # (r - 1) - log r, [n]
            kl = kl + torch.stack([torch.where(mask, k3, 0.0).sum(), mask.sum().float()])
        # Gradients are summed over micro-batches: weight this one by its share of the aggregate.
        valid = sum(policy_tokens[i] for i in mine)
        share = (valid / total_valid) if token_level else len(mine) / max(1, total_seqs)
        # metrics are weighted by the tokens they were taken over (a context-parallel share: its own)
        parts.append((float(valid) if batch.split is None else metrics["num_tokens"], metrics))
        return loss * share

    metrics = trainer.train_step(batch.token_ids[row0:rows_end], seq_lens, batch.targets[row0:rows_end], loss_fn,
                                 micro_batch_tokens)
    return metrics, parts, kl


_SUMMED_OVER_STEPS = ("skipped", "nonfinite_grad", "micro_batches")


def _update_metrics(steps: Sequence[tuple[dict[str, float], list, torch.Tensor | None]],
                    ppo_epochs: int) -> dict[str, float]:
    """An update's metrics from its steps' (trainer metrics, micro-batch parts, k3 sums): see
    `policy_update`. One step's pass through unchanged (besides the three added)."""
    trainer_metrics = [m for m, _, _ in steps]
    out: dict[str, float] = {}
    for key in trainer_metrics[0]:
        values = [m[key] for m in trainer_metrics]
        if key in _SUMMED_OVER_STEPS:
            out[key] = sum(values)
        elif key == "lr":
            out[key] = values[-1]
        elif key == "grad_slots_high_water":
            out[key] = max(values)
        else:
            out[key] = values[0] if len(values) == 1 else sum(values) / len(values)
    loss_metrics = combine_micro_batches([part for _, parts, _ in steps for part in parts])
    if "num_tokens" in loss_metrics:
        loss_metrics["num_tokens"] /= ppo_epochs  # each epoch sees every token once
    clip = [combine_micro_batches(parts).get("clip_frac", 0.0) for _, parts, _ in steps]
    if steps[0][2] is None:
        approx_kl = 0.0
    else:
        sums = torch.stack([kl for _, _, kl in steps]).tolist()  # [steps, 2]: the update's one extra sync
        per_step = [s / n for s, n in sums if n]
        approx_kl = sum(per_step) / len(per_step) if per_step else 0.0
    return {**{f"loss/{k}": v for k, v in loss_metrics.items()}, **out,
            "optimizer_steps": float(sum(1 for m in trainer_metrics if not m.get("skipped"))),
            "clip_frac": sum(clip) / len(clip), "approx_kl": approx_kl}


def combine_micro_batches(parts: Sequence[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """One rank's loss metrics from its micro-batches' (policy tokens, metrics): `*_max` the max,
    `num_tokens` the sum, anything else the token-weighted mean (as rl/run/ranks.py merges ranks)."""
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
