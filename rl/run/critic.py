"""PPO's critic in the loop: the value model (models/value.py) and its own `Trainer`.

Per update, before the policy's: `values` (no graph, the trainer's chunk path) gives V(s_t) of every
packed row, which GAE turns into advantages and returns (rl/run/advantages.py); then `update` takes the
critic's optimizer steps (the policy's ppo_epochs x mini_batches, the same mini-batch split), the
clipped value loss against the returns, normalised by the same global token counts as the policy's, so
N data-parallel ranks take one rank's step. Its host states follow the policy's through every memory
phase: spilled to NVMe after the update (its own store directory), restored before the next, checkpointed
beside the policy's (`critic/` in each checkpoint).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from models.value import ValueModel
from rl.config.algo import CriticConfig
from trainer.losses import Segments, value_loss
from trainer.step import Trainer


@dataclass
class Critic:
    model: ValueModel
    trainer: Trainer
    config: CriticConfig
    peaks: dict[str, int] = field(default_factory=dict)
    """Its trainer's memory meter over the last `update` (activation and host-gradient peaks): the train
    phase's memory report reads it beside the policy's."""

    @torch.no_grad()
    def values(self, batch, micro_batch_tokens: int | None) -> torch.Tensor:
        """V(s_t) [N] float32 for every packed row of `batch` (rl/run/update.py PackedBatch)."""
        return self.trainer.forward_logprobs(batch.token_ids, batch.seq_lens, batch.targets, micro_batch_tokens)

    def update(self, batch, old_values: torch.Tensor, returns: torch.Tensor, micro_batch_tokens: int | None,
               global_tokens: int, splits: list[list[int]], epochs: int) -> dict[str, float]:
        """`epochs` passes over the mini-batches `splits` (sequence indices), one optimizer step each;
        returns `critic/*` metrics (the last step's trainer figures, the loss's token-weighted)."""
        policy_tokens = [sum(t.policy[1:]) for t in batch.trajectories]
        sums = {"vf_loss": 0.0, "vf_clip_frac": 0.0, "vpred_mean": 0.0}
        weight, metrics = 0.0, {}
        with self.trainer.memory_meter() as self.peaks:  # innermost: the policy's meter does not see these steps
            for _ in range(epochs):
                for seqs in splits:
                    total = max(1, global_tokens if len(splits) == 1 else sum(policy_tokens[i] for i in seqs))
                    parts = []
                    metrics = self._step(batch, seqs, old_values, returns, total, micro_batch_tokens, parts)
                    for tokens, m in parts:
                        weight += tokens
                        for key in sums:
                            sums[key] += tokens * m[key]
        out = {f"critic/{k}": v / weight if weight else 0.0 for k, v in sums.items()}
        out.update({f"critic/{k}": metrics[k] for k in ("grad_norm", "lr") if k in metrics})
        return out

    def _step(self, batch, seqs: list[int], old_values: torch.Tensor, returns: torch.Tensor, total: int,
              micro_batch_tokens: int | None, parts: list) -> dict[str, float]:
        first = seqs[0] if seqs else 0
        seq_lens = [batch.seq_lens[i] for i in seqs]
        row0 = sum(batch.seq_lens[:first])
        rows_end = row0 + sum(seq_lens)
        clip = self.config.value_clip

        def loss_fn(values: torch.Tensor, rows: torch.Tensor, local: list[int]) -> torch.Tensor:
            rows = rows + row0 if row0 else rows
            mine = [first + i for i in local]
            segments = Segments(batch.seq_of_row[rows] - mine[0], len(mine))
            mask = batch.mask[rows]
            loss, m = value_loss(values, old_values[rows], returns[rows], mask, clip, segments)
            valid = float(mask.sum())
            parts.append((valid, {k: float(v) for k, v in m.items()}))
            return loss * (valid / total)

        return self.trainer.train_step(batch.token_ids[row0:rows_end], seq_lens, batch.targets[row0:rows_end],
                                       loss_fn, micro_batch_tokens)
