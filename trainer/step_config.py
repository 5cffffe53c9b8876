"""What a training step is asked to do: `TrainerConfig` (the `trainer` config group) and the
micro-batch split of a batch (`micro_batches`)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from trainer.chunks import CHUNK_SPLITS
from trainer.host_adam import OptimizerConfig


def micro_batches(seq_lens: Sequence[int], budget: int | None) -> list[list[int]]:
    """Sequence indices per micro-batch: packed greedily in order under `budget` tokens; a sequence
    longer than the budget runs alone. None = everything in one micro-batch."""
    if budget is None:
        return [list(range(len(seq_lens)))]
    if budget < 1:
        raise ValueError(f"micro_batch_tokens={budget}, expected >= 1 or None")
    plan, current, used = [], [], 0
    for i, n in enumerate(seq_lens):
        if current and used + n > budget:
            plan.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    plan.append(current)
    return plan


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    num_chunks: int = 4
    """VPP chunks the model is split into (at most its layers; layers + 2 with chunk_split="params")."""
    chunk_split: str = "layers"
    """How (trainer/chunks.py CHUNK_SPLITS): "layers" (equal layer counts) or "params" (smallest
    largest chunk, the embedding and the head as units of their own, so the smallest gradient slots)."""
    num_grad_slots: int = 2
    """FP32 gradient buffers resident at once."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Host AdamW settings."""
    max_bad_steps: int = 3
    """Consecutive steps with a non-finite loss or gradient norm that are skipped before training
    stops with an error."""
    max_grad_norm: float | None = None
    """Clip the global gradient norm (FP32, over every rank's shards) to this, torch's
    `clip_grad_norm_` rule; None = no clipping (a non-finite norm still skips the step)."""
    micro_batch_tokens: int | None = None
    """Token budget of one micro-batch (`micro_batches`): what the RL loop passes to every
    `train_step(..., micro_batch_tokens)`; None = the whole batch at once."""

    def __post_init__(self) -> None:
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={self.max_grad_norm}, expected > 0 or None (no clipping)")
        if self.num_chunks < 1:
            raise ValueError(f"num_chunks={self.num_chunks}, expected >= 1")
        if self.chunk_split not in CHUNK_SPLITS:
            raise ValueError(f"chunk_split={self.chunk_split!r}, expected one of {CHUNK_SPLITS}")
        if self.num_grad_slots < 1:
            raise ValueError(f"num_grad_slots={self.num_grad_slots}, expected >= 1")
        if self.max_bad_steps < 0:
            raise ValueError(f"max_bad_steps={self.max_bad_steps}, expected >= 0")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens={self.micro_batch_tokens}, expected >= 1 or None (whole batch)")
