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

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from memory.grad_arena import GradArena
from models.checkpoint import load_weights as load_weights_into
from models.checkpoint import save_checkpoint
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
    max_bad_steps: int = 3
    """Consecutive steps with a non-finite loss that are skipped before training stops with an error."""

    def __post_init__(self) -> None:
        if self.num_grad_slots < 1:
            raise ValueError(f"num_grad_slots={self.num_grad_slots}, expected >= 1")
        if self.max_bad_steps < 0:
            raise ValueError(f"max_bad_steps={self.max_bad_steps}, expected >= 0")


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
        self.bad_steps_in_a_row = 0
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
        A non-finite loss (on any rank) skips the update (weights and optimizer untouched, logged in
        the metrics); more than `max_bad_steps` in a row raise FloatingPointError.
        """
        if len(seq_lens) == 0 or token_ids.numel() == 0:
            raise ValueError("empty batch: train_step needs at least one sequence with one token")
        self.model.train()
        loss, _ = self.chunked.forward_backward(token_ids, seq_lens, targets, loss_fn,
                                                on_chunk_start=self._bind, on_chunk_done=self._reduce_and_release)
        self.arena.check_integrity()
        finite = torch.tensor([float(torch.isfinite(loss))])
        if self.optimizer.world > 1:
            dist.all_reduce(finite, op=dist.ReduceOp.MIN, group=self.group)
        if not finite.item():
            self.optimizer.zero_grad()
            self.bad_steps_in_a_row += 1
            if self.bad_steps_in_a_row > self.config.max_bad_steps:
                raise FloatingPointError(f"non-finite loss in {self.bad_steps_in_a_row} consecutive steps "
                                         f"(max_bad_steps={self.config.max_bad_steps}); last loss {loss.item()}")
            return {"loss": loss.item(), "skipped": 1.0, "grad_slots_high_water": self.arena.high_water_slots}
        self.bad_steps_in_a_row = 0
        self.optimizer.step()
        self.step_count += 1
        return {"loss": loss.item(), "skipped": 0.0, "grad_slots_high_water": self.arena.high_water_slots}

    # ---- checkpoints ----------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Weights (HF safetensors dir, written by rank 0), this rank's optimizer shard, step metadata."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        rank, world = self.optimizer.rank, self.optimizer.world
        if rank == 0:
            save_checkpoint(self.model, path)
        tmp = path / f"optimizer-rank{rank}.pt.tmp"
        torch.save(self.optimizer.state_dict(), tmp)
        os.replace(tmp, path / f"optimizer-rank{rank}.pt")
        if rank == 0:
            meta = {"step": self.step_count, "world_size": world, "num_chunks": self.config.num_chunks}
            (path / "trainer.json").write_text(json.dumps(meta, indent=2) + "\n")
        if world > 1:
            dist.barrier(group=self.group)
        return path

    def load(self, path: str | Path) -> None:
        """Restore weights, this rank's optimizer shard and the step counter written by `save`."""
        path = Path(path)
        meta = json.loads((path / "trainer.json").read_text())
        if (meta["world_size"], meta["num_chunks"]) != (self.optimizer.world, self.config.num_chunks):
            raise ValueError(f"checkpoint {path} was written with world_size={meta['world_size']}, "
                             f"num_chunks={meta['num_chunks']}; this trainer has world_size={self.optimizer.world}, "
                             f"num_chunks={self.config.num_chunks}")
        load_weights_into(self.model, path, assign=False)  # keep the Parameter objects the optimizer holds
        self.optimizer.load_state_dict(torch.load(path / f"optimizer-rank{self.optimizer.rank}.pt"))
        self.step_count = meta["step"]
