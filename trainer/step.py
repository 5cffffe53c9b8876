"""One training step: VPP chunks + two-slot FP32 gradient arena + DP reduction + host AdamW.

    trainer = Trainer(model, TrainerConfig(num_chunks=4))
    metrics = trainer.train_step(token_ids, seq_lens, targets, loss_fn)

Per chunk, last to first: acquire an arena slot and make the chunk's parameter `.grad`s views of
it (autograd accumulates into them in place); backward; sum the slot over data-parallel ranks and
hand this rank's slice to the host optimizer; drop the views and release the slot. Then the
gradient guard (the global FP32 norm of the host shards: clip to `max_grad_norm`, skip the step
when it is not finite), and the host AdamW updates its FP32 shards and all-gathers them into the model.

bf16 parameters (Megatron's mixed-precision recipe, models/precision.py): the slot views become
each parameter's `main_grad`; a post-accumulate-grad hook adds every backward's bf16 `.grad` into
it in FP32 and drops the `.grad` at once, so reduction and AdamW see FP32 gradients and the
updated FP32 masters are cast into the bf16 parameters after the step.
Host syncs: one per step (the loss and its finiteness, fetched together), plus what the loss
function does (rl/run/update.py: one per micro-batch, its metrics and input checks in one copy).

Why our own arena and not megatron-core's DDP buffers: megatron's `_ParamAndGradBuffer` allocates
one grad buffer for every parameter of the model at construction (offload_grad_buffers frees or
restores all of them at once), so it cannot keep only two chunks' gradients resident; its
parallel_state process groups are what a multi-dimensional (TP/PP) run will use.
Reduction: a reduce-scatter of the slot (torch's reduce_scatter_single, gloo and NCCL alike): each
rank receives only the summed slice its host optimizer owns.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from memory.durable import temp_path
from memory.grad_arena import GradArena
from memory.host_ledger import HostLedger
from memory.nvme_store import NvmeStore
from models.checkpoint import load_weights as load_weights_into
from models.checkpoint import save_checkpoint, save_expert_shard
from models.model import HybridLM
from models.precision import dtype_name
from trainer.activation_meter import SavedTensorMeter
from trainer.chunks import ChunkedModel, MicroBatch
from trainer.optimizer import ShardedHostAdamW
from trainer.shards import expert_parameters, pieces_of
from trainer.step_config import TrainerConfig, micro_batches


LEDGER_CONSUMER = "train_states"


def _accumulate_main_grad(param: torch.Tensor) -> None:
    """Post-accumulate-grad hook of a low-precision parameter: add its `.grad` (this backward's
    gradient, in the parameter's dtype) into the FP32 `main_grad` view bound by the trainer."""
    main = getattr(param, "main_grad", None)
    if main is None:
        raise RuntimeError(f"a {param.dtype} parameter {tuple(param.shape)} received a gradient outside a trainer "
                           f"step (no FP32 main_grad slot bound)")
    main.add_(param.grad)
    param.grad = None


class Trainer:
    """Host states (FP32 master shards + AdamW moments) can be spilled to NVMe between iterations:
    `offload_states(store)` writes them and frees their host memory, `restore_states()` reads them
    back bit for bit. While spilled, `train_step` raises (restore first: the orchestrator's "restore"
    phase), `save` reads them back for the write and frees them again (the spill stays), `load`
    discards the spill. With a `ledger`, the resident state bytes are leased as "train_states"
    (synced after each step; released on offload, leased again before restore)."""

    def __init__(self, model: HybridLM, config: TrainerConfig, group: dist.ProcessGroup | None = None,
                 ledger: HostLedger | None = None, total_steps: int | None = None,
                 expert_group: dist.ProcessGroup | None = None) -> None:
        """total_steps: the lr schedule's decay horizon in optimizer steps when
        `config.optimizer.total_steps` is None (the RL run's: iterations x steps per iteration).
        expert_group: for a model whose experts are split over ranks (`model.expert_parallel`), the
        ranks holding the same experts (megatron-core's expert-data-parallel group): the experts'
        gradients are reduced and their states sharded over it, the rest over `group`."""
        self.model, self.config, self.group, self.ledger = model, config, group, ledger
        self.expert_parallel = model.expert_parallel
        self.expert_group = expert_group
        if self.expert_parallel is not None and dist.is_initialized() and expert_group is None:
            raise ValueError("Trainer of an expert-parallel model needs expert_group (the ranks that hold the same "
                             "experts: megatron-core's expert-data-parallel group)")
        self._leased_bytes = 0
        odd = sorted({str(p.dtype) for p in model.parameters() if p.dtype not in (torch.float32, torch.bfloat16)})
        if odd:
            raise ValueError(f"Trainer: parameters of dtype {odd}; expected float32 or bfloat16 (models/precision.py)")
        self.chunked = ChunkedModel(model, config.num_chunks, config.chunk_split)
        named = [self.chunked.chunk_parameters(c) for c in range(config.num_chunks)]
        self.chunk_params = [[p for _, p in chunk] for chunk in named]
        experts = expert_parameters(model)
        for params in self.chunk_params:
            for p in params:
                if p.dtype != torch.float32 and not getattr(p, "_main_grad_hooked", False):
                    # Megatron's main_grad: each backward's low-precision .grad is added into the
                    # FP32 slot view and dropped at once, so .grad never holds the real gradient.
                    p.register_post_accumulate_grad_hook(_accumulate_main_grad)
                    p._main_grad_hooked = True  # one hook per parameter, however many trainers see it
        self.optimizer = ShardedHostAdamW(
            self.chunk_params, config.optimizer, group, total_steps=total_steps,
            expert_params=[p for p, _ in experts.values()] if self.expert_parallel is not None else (),
            expert_group=expert_group if self.expert_parallel is not None else None,
            pieces={id(p): pieces_of(name, p, experts.get(id(p), (p, None))[1]) for chunk in named for name, p in chunk})
        device = next(model.parameters()).device
        slot_numel = max(self.optimizer.padded_numel(c) for c in range(config.num_chunks))
        self.arena = GradArena(slot_numel, config.num_grad_slots, device)
        self.step_count = 0
        self.bad_steps_in_a_row = 0
        self.num_grad_reductions = 0
        """Chunk gradients reduced into the host shards since the trainer was built (one per chunk per step)."""
        self.host_grads_peak = 0
        """The gradient shards' host bytes right before the optimizer steps, their peak since `memory_meter` began."""
        self._bound: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._sync_ledger()

    # ---- host states: ledger and NVMe spill -----------------------------------------------------------
    def _sync_ledger(self) -> None:
        """Make the ledger's "train_states" holding equal the optimizer's resident host bytes."""
        if self.ledger is None:
            return
        target = self.optimizer.host_bytes()
        if target > self._leased_bytes:
            self.ledger.lease(LEDGER_CONSUMER, target - self._leased_bytes)
        elif target < self._leased_bytes:
            self.ledger.release(LEDGER_CONSUMER, self._leased_bytes - target)
        self._leased_bytes = target

    @property
    def dtype(self) -> torch.dtype:
        """The run's parameter dtype: that of the embedding (a few parameters stay float32 in a bf16
        model, models/precision.py `KEEP_FP32`)."""
        return self.model.model.embed_tokens.weight.dtype

    @property
    def states_spilled(self) -> bool:
        return self.optimizer.is_spilled

    @property
    def device(self) -> torch.device:
        """Where the model, its gradient slots and the batches live."""
        return self.arena.device

    @property
    def world(self) -> int:
        """Data-parallel ranks the optimizer states are sharded over."""
        return self.optimizer.world

    def unscheduled(self, lr: float | None = None):
        """A context: its optimizer steps run at `lr` (None: unchanged) outside the lr schedule."""
        return self.optimizer.unscheduled(lr)

    def forward_logprobs(self, token_ids: torch.Tensor, seq_lens: Sequence[int], targets: torch.Tensor,
                         micro_batch_tokens: int | None = None) -> torch.Tensor:
        """Per-token log p(targets | prefix) [N] float32 through the training chunk path, no graph
        (old-policy logprobs; trainer/chunks.py `forward_logprobs`), `micro_batch_tokens` at a time
        (`micro_batches`; None = one pass). Under expert parallelism every rank of the group runs
        as many passes as the one with most (the missing ones join the exchanges with no rows)."""
        offsets = [0]
        for n in seq_lens:
            offsets.append(offsets[-1] + n)
        plan = micro_batches(seq_lens, micro_batch_tokens) if len(seq_lens) else []
        parts = [self.chunked.forward_logprobs(token_ids[offsets[s[0]]:offsets[s[-1] + 1]], [seq_lens[i] for i in s],
                                               targets[offsets[s[0]]:offsets[s[-1] + 1]]) for s in plan]
        ep = self.expert_parallel
        for _ in range(ep.max_count(len(plan)) - len(plan) if ep is not None else 0):
            self.chunked.forward_logprobs(token_ids[:0], [], targets[:0])
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float32, device=token_ids.device)

    @property
    def spillable_bytes(self) -> int:
        """Payload bytes `offload_states` would write now."""
        return self.optimizer.spillable_bytes()

    @property
    def spilled_bytes(self) -> int:
        """Payload bytes on NVMe until `restore_states` (0 when nothing is spilled)."""
        return self.optimizer.spilled_bytes

    @contextmanager
    def memory_meter(self) -> Iterator[dict[str, int]]:
        """Meter the train steps run inside. Yields a dict that holds, on exit: device_activation_peak
        (the peak of autograd's saved tensors, the model's parameters and buffers excluded:
        trainer/activation_meter.py), host_grads (the FP32 gradient shards' peak, sampled right
        before each optimizer step, when they peak) and, on CUDA, device_alloc_peak (the
        allocator's peak above the start: activations, temporaries, gradients in flight)."""
        peaks: dict[str, int] = {}
        meter = SavedTensorMeter(exclude=[*self.model.parameters(), *self.model.buffers()])
        device = self.arena.device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            start = torch.cuda.memory_allocated(device)
        self.host_grads_peak = 0
        with meter.hooks():
            yield peaks
        peaks.update(device_activation_peak=meter.peak, host_grads=self.host_grads_peak)
        if device.type == "cuda":
            peaks["device_alloc_peak"] = torch.cuda.max_memory_allocated(device) - start

    def memory(self, peaks: dict[str, int] | None = None) -> dict[str, int]:
        """Bytes the trainer holds by tier now: device_grad_slots (the FP32 gradient arena),
        host_masters, host_moments (AdamW state, step counters included), host_grads (the gradient
        shards; with `peaks` from `memory_meter`, their peak over the metered steps), disk_spilled
        (the optimizer states' spill files), train_host (every optimizer host byte), and the
        meter's device_activation_peak (0 without `peaks`) and device_alloc_peak (CUDA)."""
        peaks = peaks or {}
        kinds = self.optimizer.host_bytes_by_kind()
        return {"device_grad_slots": self.arena.total_bytes,
                "device_activation_peak": peaks.get("device_activation_peak", 0),
                "host_masters": kinds["masters"], "host_moments": kinds["moments"],
                "host_grads": max(kinds["grads"], peaks.get("host_grads", 0)),
                "disk_spilled": self.optimizer.disk_bytes, "train_host": self.optimizer.host_bytes(),
                **({"device_alloc_peak": peaks["device_alloc_peak"]} if "device_alloc_peak" in peaks else {})}

    def offload_states(self, store: NvmeStore) -> int:
        """Spill the optimizer's host states to `store` (group per VPP chunk) and free their memory
        (returned to the ledger). Returns the payload bytes written. Between steps only."""
        moved = self.optimizer.offload(store)
        self._sync_ledger()
        return moved

    def restore_states(self) -> int:
        """Read spilled states back (leased first: HostBudgetExceeded leaves them spilled); returns the
        payload bytes read, 0 when nothing was spilled."""
        if not self.states_spilled:
            return 0
        if self.ledger is not None:
            self.ledger.lease(LEDGER_CONSUMER, self.optimizer.spilled_bytes)
            self._leased_bytes += self.optimizer.spilled_bytes
        moved = self.optimizer.restore()
        self._sync_ledger()
        return moved

    def _bind(self, chunk: int) -> None:
        """Give chunk `chunk`'s parameters their FP32 gradient views in a fresh arena slot: an FP32
        parameter's `.grad` is the view (autograd accumulates into it in place); a bf16 parameter's
        `main_grad` is (its hook adds each backward's bf16 `.grad` into it, then drops the `.grad`)."""
        buffer = self.arena.acquire(chunk)  # [slot_numel] zeroed, float32
        views, start = [], 0
        for b in self.optimizer.chunk_buckets[chunk]:  # each bucket's parameters, then its padding
            bucket, offset = self.optimizer.buckets[b], start
            for p in bucket.params:
                view = buffer[offset:offset + p.numel()].view(p.shape)  # [*p.shape] float32
                if p.dtype == torch.float32:
                    p.grad = view
                else:
                    p.main_grad = view
                views.append((p, view))
                offset += p.numel()
            start += bucket.padded_numel
        self._bound[chunk] = (buffer, views)

    def _reduce_and_release(self, chunk: int) -> None:
        buffer, views = self._bound.pop(chunk)
        if any((p.grad is not v) if p.dtype == torch.float32 else (p.grad is not None or p.main_grad is not v)
               for p, v in views):
            raise RuntimeError(f"chunk {chunk}: autograd replaced a .grad instead of accumulating into the arena")
        start = 0
        for b in self.optimizer.chunk_buckets[chunk]:
            bucket = self.optimizer.buckets[b]
            flat = buffer[start:start + bucket.padded_numel]  # parameters, then zero padding
            start += bucket.padded_numel
            if bucket.world > 1:  # ZeRO-2: each rank receives only its slice of the summed gradient
                mine = flat.new_empty(bucket.shard_numel)
                dist.reduce_scatter_single(mine, flat, group=bucket.group)
            else:
                mine = flat
            self.optimizer.add_grad(b, mine)
        self.num_grad_reductions += 1
        for p, _ in views:
            p.grad = None
            if p.dtype != torch.float32:
                p.main_grad = None
        self.arena.release(chunk)

    def train_step(self, token_ids: torch.Tensor, seq_lens: Sequence[int], targets: torch.Tensor,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor, list[int]], torch.Tensor],
                   micro_batch_tokens: int | None = None) -> dict[str, float]:
        """Forward/backward this rank's packed sequences and apply one optimizer step.

        token_ids, targets: [N] packed, on the model's device; sequence i owns `seq_lens[i]`
        consecutive rows. With DP ranks a rank may pass no sequence at all (N = 0): it still joins
        every collective (zero gradients) and the same optimizer step.
        loss_fn(logprobs [n], rows [n], seqs) gets a micro-batch's per-token logprobs, their row
        indices in the packed batch (both on the model's device; to select advantages, masks, old
        logprobs...) and the micro-batch's sequences (host ints: indices into seq_lens, a run of
        consecutive ones); it must be scaled so that summing it over micro-batches and ranks gives
        the global loss (e.g. divide by the global token count): gradients are summed, not averaged.
        micro_batch_tokens: token budget of one micro-batch (sequences packed greedily in order; a
        longer sequence runs alone); None = one micro-batch. Gradients accumulate on the host.
        Gradient guard, after every chunk is reduced and before any update: the global gradient norm
        (FP32: each rank's squared shards summed, then one all-reduce) is `grad_norm` in the metrics
        (before clipping); with `max_grad_norm` every shard is scaled by
        min(1, max_grad_norm / (grad_norm + 1e-6)) (`grad_clip_coef`). A non-finite loss or gradient
        norm (on any rank) skips the update on every rank (weights, masters, AdamW moments and step
        counters untouched; `skipped` = 1, `nonfinite_grad` = 1 when the loss was finite but a
        gradient was not); more than `max_bad_steps` such steps in a row raise FloatingPointError.
        `lr` in the metrics: the step's learning rate under the schedule (a skipped step does not
        advance it).
        """
        self._check_batch(token_ids, seq_lens, targets)
        self.model.train()
        plan = micro_batches(seq_lens, micro_batch_tokens) if seq_lens else []
        loss = self._forward_backward(token_ids, seq_lens, targets, loss_fn, plan)
        return self._guarded_update(loss, num_micro_batches=len(plan))

    def _check_batch(self, token_ids: torch.Tensor, seq_lens: Sequence[int], targets: torch.Tensor) -> None:
        """train_step's preconditions: states resident, a packed batch that agrees with itself, on the
        model's device (raises naming what is wrong)."""
        if self.states_spilled:
            raise RuntimeError("train_step while the optimizer states are spilled to "
                               f"{self.optimizer.store.directory}; call restore_states() first")
        empty = len(seq_lens) == 0
        if (empty and self.optimizer.world == 1) or (not empty and token_ids.numel() == 0):
            raise ValueError("empty batch: train_step needs at least one sequence with one token")
        if token_ids.shape != targets.shape or sum(seq_lens) != token_ids.numel():
            raise ValueError(f"token_ids {tuple(token_ids.shape)}, targets {tuple(targets.shape)} and seq_lens "
                             f"(sum {sum(seq_lens)}) must describe the same packed tokens")
        comm = self.arena.device  # the model's; collectives run here too (NCCL needs CUDA tensors)
        if token_ids.device != comm or targets.device != comm:
            raise ValueError(f"token_ids on {token_ids.device}, targets on {targets.device}: the model and its "
                             f"gradients are on {comm}; build the batch there")

    def _forward_backward(self, token_ids: torch.Tensor, seq_lens: Sequence[int], targets: torch.Tensor,
                          loss_fn: Callable[[torch.Tensor, torch.Tensor, list[int]], torch.Tensor],
                          plan: list[list[int]]) -> torch.Tensor:
        """Every micro-batch of `plan` through the chunked model, chunk-major: each chunk's gradient
        accumulates over all the micro-batches in its slot, then is reduced into the host shards
        once (one reduce-scatter per chunk per step, on every rank: a rank without sequences
        reduces zeros). Returns the summed loss (a device scalar, not synced)."""
        comm = self.arena.device
        offsets = [0]
        for n in seq_lens:
            offsets.append(offsets[-1] + n)
        batches = []
        for seqs in plan:
            # A micro-batch is a run of consecutive sequences (micro_batches packs in order): its
            # rows are one slice, so no index tensor is built on the host and copied over.
            start, end = offsets[seqs[0]], offsets[seqs[-1] + 1]
            rows = torch.arange(start, end, device=comm)  # [n], made on the device
            batches.append(MicroBatch(token_ids[start:end], [seq_lens[i] for i in seqs], targets[start:end],
                                      lambda lp, rows=rows, seqs=seqs: loss_fn(lp, rows, seqs)))
        results = self.chunked.forward_backward_batches(batches, on_chunk_start=self._bind,
                                                        on_chunk_done=self._reduce_and_release)
        loss = torch.zeros((), device=comm)
        for part, _ in results:
            loss = loss + part
        self.arena.check_integrity()
        return loss

    def _guarded_update(self, loss: torch.Tensor, num_micro_batches: int) -> dict[str, float]:
        """The gradient guard and the optimizer step (see train_step); returns the step's metrics."""
        comm = self.arena.device
        # Every chunk's gradient is reduced into the host shards (the optimizer steps all chunks
        # together, below): one all-reduce carries the ranks' non-finite loss count and their squared
        # gradient shards, so every rank sees the same global norm and takes the same decision.
        stats = torch.stack([(~torch.isfinite(loss.detach())).float(),
                             self.optimizer.grad_square_sum().to(comm)])  # [2]
        if self.optimizer.world > 1:
            dist.all_reduce(stats, group=self.group)
        loss_value, bad_losses, grad_norm = torch.cat([loss.detach()[None], stats[:1], stats[1:].sqrt()]).tolist()
        # (the step's one host sync)
        metrics = {"loss": loss_value, "micro_batches": float(num_micro_batches),
                   "grad_slots_high_water": float(self.arena.high_water_slots), "grad_norm": grad_norm,
                   "lr": self.optimizer.lr}  # the lr of this step (the schedule's, trainer/lr_schedule.py)
        if bad_losses or not math.isfinite(grad_norm):
            self.optimizer.zero_grad()
            self.bad_steps_in_a_row += 1
            what = "loss" if bad_losses else "gradient norm"
            if self.bad_steps_in_a_row > self.config.max_bad_steps:
                raise FloatingPointError(f"non-finite {what} in {self.bad_steps_in_a_row} consecutive steps "
                                         f"(max_bad_steps={self.config.max_bad_steps}); last loss {loss_value}, "
                                         f"gradient norm {grad_norm}")
            return {**metrics, "grad_clip_coef": 0.0, "skipped": 1.0, "nonfinite_grad": float(not bad_losses)}
        self.bad_steps_in_a_row = 0
        coef = 1.0
        if self.config.max_grad_norm is not None:
            # torch.nn.utils.clip_grad_norm_: coef = max_norm / (total_norm + 1e-6), clamped to 1, in FP32
            # (on the host, where the gradient shards it scales live)
            clip = (self.config.max_grad_norm / (torch.tensor(grad_norm, dtype=torch.float32, device="cpu") + 1e-6)
                    ).clamp(max=1.0)
            if clip < 1:
                self.optimizer.scale_grads(clip)
            coef = clip.item()
        metrics.update(grad_clip_coef=coef, nonfinite_grad=0.0)
        self.host_grads_peak = max(self.host_grads_peak, self.optimizer.host_bytes_by_kind()["grads"])
        self.optimizer.step()
        self.step_count += 1
        self._sync_ledger()  # Adam's moments appear at the first step
        return {**metrics, "skipped": 0.0}

    # ---- checkpoints ----------------------------------------------------------------------------------
    @torch.no_grad()
    def check_weights_finite(self, what: str) -> None:
        """Raise FloatingPointError (`what`, then the first parameter, in model order, holding inf or
        NaN on any rank) unless every weight is finite: one reduction over the parameters (and one
        all-reduce over the ranks), one host sync."""
        named = list(self.model.named_parameters())
        finite = torch.stack([torch.isfinite(p).all() for _, p in named]).float()  # [num_params]
        if self.optimizer.world > 1:
            dist.all_reduce(finite, op=dist.ReduceOp.MIN, group=self.group)
        bad = [name for (name, _), ok in zip(named, finite.tolist()) if not ok]
        if bad:
            raise FloatingPointError(f"{what}: parameter {bad[0]!r} holds non-finite values (inf or NaN)"
                                     + (f", and {len(bad) - 1} more parameters" if len(bad) > 1 else ""))

    def save(self, path: str | Path) -> Path:
        """Weights (HF safetensors dir, written by rank 0), this rank's optimizer shard, step metadata.
        While the states are spilled they are read back for the write (leased meanwhile) and freed
        again; the spill files stay, so the trainer is still spilled after. Refused (FloatingPointError
        naming the first non-finite parameter, on every rank, before anything is written) when a
        weight is inf or NaN: a broken model never replaces a good checkpoint."""
        path = Path(path)
        self.check_weights_finite(f"refusing to save a checkpoint to {path}")
        path.mkdir(parents=True, exist_ok=True)
        rank, world = self.optimizer.rank, self.optimizer.world
        self._save_weights(path)
        tmp = temp_path(path / f"optimizer-rank{rank}.pt")
        transient = self.optimizer.spilled_bytes if self.ledger is not None else 0
        if transient:
            self.ledger.lease(LEDGER_CONSUMER, transient)
        try:
            with self.optimizer.resident():
                torch.save(self.optimizer.state_dict(), tmp)
        finally:
            if transient:
                self.ledger.release(LEDGER_CONSUMER, transient)
        os.replace(tmp, path / f"optimizer-rank{rank}.pt")
        if rank == 0:
            meta = {"step": self.step_count, "world_size": world, "num_chunks": self.config.num_chunks,
                    "chunk_split": self.config.chunk_split, "dtype": dtype_name(self.dtype),
                    "expert_parallel": self.expert_parallel.size if self.expert_parallel is not None else 1}
            (path / "trainer.json").write_text(json.dumps(meta, indent=2) + "\n")
        if world > 1:
            dist.barrier(group=self.group)
        return path

    def _save_weights(self, path: Path) -> None:
        """The weights as an HF checkpoint directory: by rank 0 alone, or under expert parallelism by
        the first rank of each expert-data-parallel group, each its experts (and rank 0 the rest)."""
        if self.expert_parallel is None:
            if self.optimizer.rank == 0:
                save_checkpoint(self.model, path)
        elif self.expert_group is None or dist.get_rank(self.expert_group) == 0:
            save_expert_shard(self.model, path)

    def save_weights(self, path: str | Path) -> Path:
        """The weights alone (an HF checkpoint directory, complete on every rank on return)."""
        path = Path(path)
        self._save_weights(path)
        if self.optimizer.world > 1:
            dist.barrier(group=self.group)
        return path

    def load(self, path: str | Path) -> None:
        """Restore weights, this rank's optimizer shard and the step counter written by `save`. A
        checkpoint of another expert-parallel size (same world) loads too: the weights by expert
        name, the optimizer states resharded from every rank's file (`load_resharded`)."""
        path = Path(path)
        meta = json.loads((path / "trainer.json").read_text())
        saved = meta.get("dtype", "fp32")  # checkpoints from before the dtype knob are fp32
        if saved != dtype_name(self.dtype):
            raise ValueError(f"checkpoint {path} was written by a dtype={saved!r} run; this trainer's parameters are "
                             f"dtype={dtype_name(self.dtype)!r}: resume with experiment.dtype={saved}")
        if (meta["world_size"], meta["num_chunks"]) != (self.optimizer.world, self.config.num_chunks):
            raise ValueError(f"checkpoint {path} was written with world_size={meta['world_size']}, "
                             f"num_chunks={meta['num_chunks']}; this trainer has world_size={self.optimizer.world}, "
                             f"num_chunks={self.config.num_chunks}")
        split = meta.get("chunk_split", "layers")  # checkpoints from before the knob split by layers
        if split != self.config.chunk_split:
            raise ValueError(f"checkpoint {path} was written with chunk_split={split!r} (its optimizer shards follow "
                             f"that split); this trainer has chunk_split={self.config.chunk_split!r}")
        load_weights_into(self.model, path, assign=False)  # keep the Parameter objects the optimizer holds
        # host states: saved from the host, loaded onto it whatever device the model is on
        shard = torch.load(path / f"optimizer-rank{self.optimizer.rank}.pt", map_location="cpu", weights_only=True)
        if self.optimizer.same_layout(shard):
            self.optimizer.load_state_dict(shard)
        else:  # another expert-parallel size: every rank's shard holds some of this rank's elements
            self.optimizer.load_resharded([torch.load(path / f"optimizer-rank{r}.pt", map_location="cpu",
                                                      weights_only=True, mmap=True) for r in range(meta["world_size"])])
        self.step_count = meta["step"]
        self._sync_ledger()
