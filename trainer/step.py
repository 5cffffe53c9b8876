"""One training step: VPP chunks + two-slot FP32 gradient arena + DP reduction + host AdamW.

    trainer = Trainer(model, TrainerConfig(num_chunks=4))
    metrics = trainer.train_step(token_ids, seq_lens, targets, loss_fn)

Per chunk, last to first: acquire an arena slot and make the chunk's parameter `.grad`s views of
it (autograd accumulates into them in place); backward; sum the slot over data-parallel ranks and
hand this rank's slice to the host optimizer; drop the views and release the slot. Then the host
AdamW updates its FP32 shards and all-gathers them into the model.

Why our own arena and not megatron-core's DDP buffers: megatron's `_ParamAndGradBuffer` allocates
one grad buffer for every parameter of the model at construction (offload_grad_buffers frees or
restores all of them at once), so it cannot keep only two chunks' gradients resident; its
parallel_state process groups are what a multi-dimensional (TP/PP) run will use.
Reduction: an all-reduce of the slot then the local slice (gloo on CPU implements it everywhere;
NCCL runs would use reduce_scatter_tensor to move half the bytes).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from memory.grad_arena import GradArena
from models.model import HybridLM
from trainer.chunks import ChunkedModel
from trainer.optimizer import OptimizerConfig, ShardedHostAdamW


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    num_chunks: int = 4
    """VPP chunks the model is split into."""
    num_grad_slots: int = 2
    """FP32 gradient buffers resident at once."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Host AdamW settings."""

    def __post_init__(self) -> None:
        if self.num_grad_slots < 1:
            raise ValueError(f"num_grad_slots={self.num_grad_slots}, expected >= 1")


class Trainer:
    def __init__(self, model: HybridLM, config: TrainerConfig, group: dist.ProcessGroup | None = None) -> None:
        self.model, self.config, self.group = model, config, group
        self.chunked = ChunkedModel(model, config.num_chunks)
        self.chunk_params = [[p for _, p in self.chunked.chunk_parameters(c)] for c in range(config.num_chunks)]
        self.optimizer = ShardedHostAdamW(self.chunk_params, config.optimizer, group)
        device = next(model.parameters()).device
        slot_numel = max(self.optimizer.padded_numel(c) for c in range(config.num_chunks))
        self.arena = GradArena(slot_numel, config.num_grad_slots, device)
        self.step_count = 0
        self._bound: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}

    def _bind(self, chunk: int) -> None:
        buffer = self.arena.acquire(chunk)  # [slot_numel] zeroed
        views, offset = [], 0
        for p in self.chunk_params[chunk]:
            p.grad = buffer[offset:offset + p.numel()].view_as(p)  # autograd accumulates in place
            views.append(p.grad)
            offset += p.numel()
        self._bound[chunk] = (buffer, views)

    def _reduce_and_release(self, chunk: int) -> None:
        buffer, views = self._bound.pop(chunk)
        params = self.chunk_params[chunk]
        if any(p.grad is not v for p, v in zip(params, views)):
            raise RuntimeError(f"chunk {chunk}: autograd replaced a .grad instead of accumulating into the arena")
        flat = buffer[:self.optimizer.padded_numel(chunk)]  # parameters, then zero padding
        if self.optimizer.world > 1:
            dist.all_reduce(flat, group=self.group)
        shard = self.optimizer.shard_numels[chunk]
        self.optimizer.set_grad(chunk, flat[self.optimizer.rank * shard:(self.optimizer.rank + 1) * shard])
        for p in params:
            p.grad = None
        self.arena.release(chunk)

    def train_step(self, token_ids: torch.Tensor, seq_lens: Sequence[int], targets: torch.Tensor,
                   loss_fn: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """Forward/backward this rank's packed sequences and apply one optimizer step.

        loss_fn must already be scaled so that summing it over ranks gives the global loss
        (e.g. divide by the global token count): gradients are summed, not averaged.
        """
        self.model.train()
        loss, _ = self.chunked.forward_backward(token_ids, seq_lens, targets, loss_fn,
                                                on_chunk_start=self._bind, on_chunk_done=self._reduce_and_release)
        self.arena.check_integrity()
        self.optimizer.step()
        self.step_count += 1
        return {"loss": loss.item(), "grad_slots_high_water": self.arena.high_water_slots}
