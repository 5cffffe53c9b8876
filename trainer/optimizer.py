"""AdamW on FP32 master shards in host memory (ZeRO-2 style, with optimizer offload).

Each VPP chunk's parameters are one flat vector (model order; under expert parallelism its experts
a second one, sharded over the expert-data-parallel group: trainer/shards.py `Bucket`), padded to a
multiple of its group's size; rank r owns the r-th slice and keeps on the host only its slices'
FP32 masters and AdamW moments. A step updates them and all-gathers them into the parameters:
AdamW elementwise, so AdamW on the whole model (given zeros, not None, for unreached parameters).
The AdamW itself, its config and its backends (DeepSpeed's CPU Adam or torch's) are trainer/host_adam.py.
The lr follows `OptimizerConfig.lr_schedule` (trainer/lr_schedule.py: warm-up, then constant,
linear or cosine decay); its position is part of the optimizer's state, so a resume continues it.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from memory.nvme_store import NvmeStore
from memory.pinned import pinned_empty
from trainer.shards import Bucket, reshard
from trainer.host_adam import OptimizerConfig, adam_steps, check_horizon, make_host_adam, replay_deepspeed_steps
from trainer.lr_schedule import lr_factor


class ShardedHostAdamW:
    """total_steps: the schedule's decay horizon when `config.total_steps` is None (the run's:
    iterations x optimizer steps per iteration); `config.total_steps` wins when both are given.

    Learning rate: Adam's param groups hold the base lr (`config.lr`, or what a caller sets for a
    block); each `step` runs at base x `lr_factor(schedule_step)` (the factor is exactly 1 for a
    constant schedule past its warm-up, so the update is unchanged) and puts the base back, for the
    torch and the DeepSpeed backend alike (both read `group["lr"]` at every step). `schedule_step`
    counts the steps taken (a skipped step takes none) and is saved in `state_dict`."""

    def __init__(self, chunk_params: list[list[nn.Parameter]], config: OptimizerConfig,
                 group: dist.ProcessGroup | None = None, total_steps: int | None = None, *,
                 expert_params: Sequence[nn.Parameter] = (), expert_group: dist.ProcessGroup | None = None,
                 pieces: dict[int, list[tuple[str, int]]] | None = None) -> None:
        """expert_params, expert_group: under expert parallelism, the routed experts' parameters
        and the group that holds the same experts (megatron-core's expert-data-parallel group):
        each chunk's experts form a bucket of their own, sharded over that group, the rest of the
        chunk one sharded over `group`. pieces: id(parameter) -> its (key, numel) pieces in flat
        order (one per expert of a stacked expert tensor, by global index), saved with the state so
        that a checkpoint loads into another sharding (`load_resharded`)."""
        self.config = config
        self.total_steps = config.total_steps if config.total_steps is not None else total_steps
        """The resolved decay horizon (None: constant schedule without one)."""
        check_horizon(config, self.total_steps)
        self.schedule_step = 0
        """Optimizer steps taken under the schedule: the position of the next step."""
        self._scheduled = True
        self.group = group
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.chunk_params = chunk_params
        experts = {id(p) for p in expert_params}
        self.buckets: list[Bucket] = []
        """The flat vectors the states are sharded by: per chunk its parameters, or under expert
        parallelism its other parameters, then its experts (`Bucket.name` "chunk{c}[.experts]")."""
        for c, params in enumerate(chunk_params):
            dense = [p for p in params if id(p) not in experts]
            routed = [p for p in params if id(p) in experts]
            if expert_group is None or not routed:
                self.buckets.append(Bucket(c, f"chunk{c}", params, group))
                continue
            if dense:
                self.buckets.append(Bucket(c, f"chunk{c}", dense, group))
            self.buckets.append(Bucket(c, f"chunk{c}.experts", routed, expert_group))
        self.chunk_buckets = [[b for b, bucket in enumerate(self.buckets) if bucket.chunk == c]
                              for c in range(len(chunk_params))]
        self._pieces = pieces
        self.numels = [b.numel for b in self.buckets]
        self.shard_numels = [b.shard_numel for b in self.buckets]
        self.masters: list[nn.Parameter] = []
        """Per bucket: this rank's FP32 master shard."""
        for bucket in self.buckets:
            flat = self._padded_flat(bucket.params, bucket.padded_numel)
            self.masters.append(nn.Parameter(
                flat[bucket.rank * bucket.shard_numel:(bucket.rank + 1) * bucket.shard_numel].clone().cpu()))
        self.adam, self.backend = make_host_adam(self.masters, config)
        self.store: NvmeStore | None = None
        """Where the states are spilled while `is_spilled` (set by `offload`)."""
        self.spilled_bytes = 0
        """Payload bytes of the spilled states (0 when resident)."""
        self.disk_bytes = 0
        """Bytes of the spill files on disk (0 when resident: restore drops them)."""
        self._layout: list[dict[str, tuple[torch.Size, torch.dtype]]] = []
        """Per bucket: name -> (shape, dtype) of the spilled states."""
        self._staging: dict[int, torch.Tensor] = {}
        """CUDA: per bucket, the page-locked buffer its gradient shard is copied into."""
        self._in_flight: dict[int, torch.cuda.Event] = {}
        """CUDA: buckets whose shard copy has not landed in the host gradient yet."""

    @staticmethod
    def _padded_flat(params: list[nn.Parameter], numel: int) -> torch.Tensor:
        flat = torch.cat([p.detach().reshape(-1).float() for p in params])  # [n]
        return torch.cat([flat, flat.new_zeros(numel - flat.numel())])  # [world * shard]

    def padded_numel(self, chunk: int) -> int:
        """FP32 elements of chunk `chunk`'s gradient slot: its buckets' padded vectors back to back."""
        return sum(self.buckets[b].padded_numel for b in self.chunk_buckets[chunk])

    def add_grad(self, bucket: int, summed_grad_shard: torch.Tensor) -> None:
        """Accumulate this rank's slice of bucket `bucket`'s gradient (already summed over its group)
        on the host (with one bucket per chunk, the bucket is the chunk)."""
        if summed_grad_shard.numel() != self.shard_numels[bucket]:
            raise ValueError(f"bucket {bucket}: gradient shard has {summed_grad_shard.numel()} elements, expected "
                             f"{self.shard_numels[bucket]}")
        shard = summed_grad_shard.detach().float()
        if shard.device.type == "cuda":  # into a page-locked buffer without a host sync: an event, waited on first use
            self._copy_async(bucket, shard)
            return
        master = self.masters[bucket]
        shard = shard.cpu()
        master.grad = shard.clone() if master.grad is None else master.grad.add_(shard)

    def _copy_async(self, bucket: int, shard: torch.Tensor) -> None:
        """CUDA: copy the shard into this bucket's exact-size page-locked buffer (non-blocking, after
        the reduction on the current stream) and record an event; `_land` adds it into the host
        gradient when the host first needs it. One buffer per bucket: a second shard of the same
        bucket in a step (never, with one reduction per chunk per step) lands the first one before.
        Not yet run on a GPU (none so far)."""
        if bucket in self._in_flight:
            self._land(bucket)
        buf = self._staging.get(bucket)
        if buf is None:
            buf = self._staging[bucket] = pinned_empty(shard.numel(), torch.float32)
        buf.copy_(shard, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._in_flight[bucket] = event

    def _land(self, bucket: int | None = None) -> None:
        """Wait for the in-flight shard copies (one bucket's, or all) and add them into the host gradients."""
        for b in [bucket] if bucket is not None else list(self._in_flight):
            self._in_flight.pop(b).synchronize()
            master, shard = self.masters[b], self._staging[b]
            master.grad = shard.clone() if master.grad is None else master.grad.add_(shard)

    def grad_square_sum(self) -> torch.Tensor:
        """Sum of squares of this rank's gradient shards over every chunk: a 0-dim FP32 tensor on the
        host (inf/NaN when any gradient element is). Summed over ranks it is the squared global norm
        (the shards partition each chunk's flat gradient; padding is zero). Between the last
        `add_grad` of a step and `step`."""
        self._land()
        missing = [c for c, m in enumerate(self.masters) if m.grad is None]
        if missing:
            raise RuntimeError(f"gradient norm without gradients for chunks {missing}")
        return torch.stack([torch.linalg.vector_norm(m.grad).square() for m in self.masters]).sum()

    @torch.no_grad()
    def scale_grads(self, factor: torch.Tensor) -> None:
        """Multiply every gradient shard by `factor` (a 0-dim FP32 tensor: the clip coefficient)."""
        for master in self.masters:
            master.grad.mul_(factor)

    @torch.no_grad()
    def step(self) -> None:
        """Update every master shard, then all-gather the shards into the model's parameters."""
        self._require_resident("step")
        self._land()
        missing = [c for c, m in enumerate(self.masters) if m.grad is None]
        if missing:
            raise RuntimeError(f"optimizer step without gradients for chunks {missing}")
        if self._scheduled:
            bases = [g["lr"] for g in self.adam.param_groups]
            factor = self.lr_factor()
            for g in self.adam.param_groups:
                g["lr"] = g["lr"] * factor
            try:
                self.adam.step()
            finally:
                for g, base in zip(self.adam.param_groups, bases):
                    g["lr"] = base
            self.schedule_step += 1
        else:
            self.adam.step()
        for bucket, master in zip(self.buckets, self.masters):
            params = bucket.params
            if bucket.world > 1:  # gathered on the parameters' device (NCCL cannot gather host tensors)
                mine = master.data.to(params[0].device)
                pieces = [torch.empty_like(mine) for _ in range(bucket.world)]
                dist.all_gather(pieces, mine, group=bucket.group)
                flat = torch.cat(pieces)
            else:
                flat = master.data
            offset = 0
            for p in params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p).to(device=p.device, dtype=p.dtype))
                offset += p.numel()
            master.grad = None

    # ---- learning-rate schedule ---------------------------------------------------------------------
    def lr_factor(self) -> float:
        """The schedule's factor for the next step (1 inside `unscheduled`)."""
        if not self._scheduled:
            return 1.0
        c = self.config
        return lr_factor(c.lr_schedule, self.schedule_step, warmup_steps=c.warmup_steps,
                         min_lr_ratio=c.min_lr_ratio, total_steps=self.total_steps)

    @property
    def lr(self) -> float:
        """The learning rate the next step runs at (the first param group's base x the factor)."""
        return self.adam.param_groups[0]["lr"] * self.lr_factor()

    @contextmanager
    def unscheduled(self, lr: float | None = None) -> Iterator[None]:
        """Inside: steps run at `lr` (None: the param groups' lr as it stands) and do not advance the
        schedule (a supervised warm-up with its own lr before the RL schedule starts); the groups'
        own lr is restored after."""
        saved, self._scheduled = self._scheduled, False
        lrs = [g["lr"] for g in self.adam.param_groups]
        if lr is not None:
            for g in self.adam.param_groups:
                g["lr"] = lr
        try:
            yield
        finally:
            self._scheduled = saved
            for g, value in zip(self.adam.param_groups, lrs):
                g["lr"] = value

    def host_bytes(self) -> int:
        """Bytes of host memory this rank's optimizer holds now: FP32 master shards, their gradients and
        Adam's moments (storages, so spilled states count 0)."""
        tensors = [m for m in self.masters] + [m.grad for m in self.masters if m.grad is not None]
        tensors += [v for st in self.adam.state.values() for v in st.values() if torch.is_tensor(v)]
        return sum(t.untyped_storage().nbytes() for t in tensors)

    # ---- NVMe spill (host DRAM is time-multiplexed) -----------------------------------------------
    @property
    def is_spilled(self) -> bool:
        return self.store is not None

    def group_name(self, bucket: int) -> str:
        return f"train_states.rank{self.rank}.{self.buckets[bucket].name}"

    def _chunk_states(self, chunk: int) -> dict[str, torch.Tensor]:
        """Chunk `chunk`'s host state tensors by name: the master shard and every non-scalar Adam
        state (moments; torch's 0-dim `step` stays resident). Before the first step: the master only."""
        master = self.masters[chunk]
        states = {"master": master.data}
        for key, v in self.adam.state.get(master, {}).items():
            if torch.is_tensor(v) and v.dim() > 0:
                states[key] = v
        return states

    def _require_resident(self, what: str) -> None:
        if self.is_spilled:
            raise RuntimeError(f"optimizer {what} while its states are spilled to {self.store.directory}; "
                               "call restore() (Trainer.restore_states) first")

    def spillable_bytes(self) -> int:
        """Payload bytes `offload` would write now (0 while spilled)."""
        if self.is_spilled:
            return 0
        return sum(t.numel() * t.element_size() for c in range(len(self.masters))
                   for t in self._chunk_states(c).values())

    def _install(self, chunk: int, states: dict[str, torch.Tensor]) -> None:
        """Make `states` chunk `chunk`'s master data / Adam states (same Parameter and state-dict
        objects; DeepSpeed's CPU Adam reads `p.data` and the state tensors at every step, nothing
        caches their pointers)."""
        master = self.masters[chunk]
        for key, t in states.items():
            if key == "master":
                master.data = t
            else:
                self.adam.state[master][key] = t

    def offload(self, store: NvmeStore) -> int:
        """Spill every chunk's states to `store` (one group per chunk), then free their host memory
        (each replaced by an empty tensor of its dtype). Returns the payload bytes spilled. Only
        between steps (no pending gradients)."""
        self._require_resident("offload")
        pending = [c for c, m in enumerate(self.masters) if m.grad is not None]
        if pending:
            raise RuntimeError(f"optimizer offload with pending gradients for chunks {pending}; offload between steps")
        groups = [self._chunk_states(c) for c in range(len(self.masters))]
        records = [store.spill(self.group_name(c), g) for c, g in enumerate(groups)]  # all written before any free
        self._layout = [{k: (t.shape, t.dtype) for k, t in g.items()} for g in groups]
        self.store = store
        self._free()
        self.spilled_bytes = sum(r.payload_bytes for r in records)
        self.disk_bytes = sum(r.file_bytes for r in records)
        return self.spilled_bytes

    def _read_back(self) -> None:
        for c in range(len(self.masters)):
            self._install(c, self.store.restore(self.group_name(c)))  # new tensors, checksums verified

    def _free(self) -> None:
        for c, layout in enumerate(self._layout):
            self._install(c, {k: torch.empty(0, dtype=dtype, device="cpu") for k, (_, dtype) in layout.items()})

    def restore(self) -> int:
        """Read the spilled states back (into new tensors, installed where the old ones were), drop
        the spill files; returns the payload bytes read. No-op (0) when resident."""
        if not self.is_spilled:
            return 0
        self._read_back()
        for c in range(len(self.masters)):
            self.store.drop(self.group_name(c))
        moved, self.store, self.spilled_bytes, self.disk_bytes = self.spilled_bytes, None, 0, 0
        return moved

    def discard_spill(self) -> None:
        """Allocate the states again without reading them (contents undefined) and drop the files:
        for a caller about to overwrite every state (load_state_dict). No-op when resident."""
        if not self.is_spilled:
            return
        for c, layout in enumerate(self._layout):
            self._install(c, {k: torch.empty(shape, dtype=dtype, device="cpu") for k, (shape, dtype) in layout.items()})
            self.store.drop(self.group_name(c))
        self.store, self.spilled_bytes, self.disk_bytes = None, 0, 0

    @contextmanager
    def resident(self) -> Iterator[None]:
        """Inside: the states are in host memory. When spilled, they are read back for the block and
        freed again after it; the files stay as they were (the block must not change the states)."""
        if not self.is_spilled:
            yield
            return
        self._read_back()
        store, self.store = self.store, None  # resident for the block: state_dict() etc. work
        try:
            yield
        finally:
            self.store = store
            self._free()

    def zero_grad(self) -> None:
        self._land()
        for master in self.masters:
            master.grad = None

    def state_dict(self) -> dict:
        self._require_resident("state_dict")
        state = {"adam": self.adam.state_dict(), "masters": [m.detach().clone() for m in self.masters],
                 "rank": self.rank, "world": self.world, "schedule_step": self.schedule_step}
        if self._pieces is not None:  # what each element of the flat vectors is: loadable into any sharding
            state["layout"] = [{"rank": b.rank, "world": b.world, "shard": b.shard_numel,
                                "pieces": [piece for p in b.params for piece in self._pieces[id(p)]]}
                               for b in self.buckets]
        return state

    def same_layout(self, state: dict) -> bool:
        """Whether `state` (a `state_dict`) was written by a rank sharded as this one is."""
        return ((state["rank"], state["world"]) == (self.rank, self.world) and len(state["masters"]) == len(self.masters)
                and all(m.shape == s.shape for m, s in zip(self.masters, state["masters"]))
                and ("layout" not in state or self._pieces is None or [b["pieces"] for b in state["layout"]] ==
                     [[piece for p in b.params for piece in self._pieces[id(p)]] for b in self.buckets]))

    @torch.no_grad()
    def load_resharded(self, states: list[dict]) -> None:
        """Load the `state_dict`s of every rank of a run sharded otherwise (another expert-parallel
        size): each element is found by its piece key in the saved layouts, so masters and moments
        are the saved ones exactly, whatever the sharding (trainer/shards.py `reshard`). Needs
        `pieces` here and a layout in every state (ValueError naming what is missing)."""
        if self._pieces is None or any("layout" not in st for st in states):
            raise ValueError("optimizer states without a piece layout cannot be loaded into another sharding")
        masters, adam_state, schedule_step = reshard(states, self.buckets, self._pieces)
        self.discard_spill()
        for master, saved in zip(self.masters, masters):
            master.copy_(saved)
        group = {**states[0]["adam"]["param_groups"][0], "params": list(range(len(self.masters)))}
        self.adam.load_state_dict({"state": adam_state, "param_groups": [group]})
        self.schedule_step = schedule_step
        if self.backend == "deepspeed":
            replay_deepspeed_steps(self.adam)

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if (state["rank"], state["world"]) != (self.rank, self.world):
            raise ValueError(f"optimizer shard of rank {state['rank']}/{state['world']} loaded into rank "
                             f"{self.rank}/{self.world}")
        if len(state["masters"]) != len(self.masters):
            raise ValueError(f"optimizer shard of {len(state['masters'])} buckets loaded into {len(self.masters)} "
                             f"(another expert-parallel size: load_resharded)")
        self.discard_spill()  # every state is overwritten below
        for master, saved in zip(self.masters, state["masters"]):
            if master.shape != saved.shape:
                raise ValueError(f"optimizer shard shape {tuple(saved.shape)} != expected {tuple(master.shape)}")
            master.copy_(saved)
        self.adam.load_state_dict(state["adam"])
        # Shards written before the lr schedule existed: every step they took was a scheduled one.
        self.schedule_step = int(state["schedule_step"]) if "schedule_step" in state else adam_steps(self.adam)
        if self.backend == "deepspeed":
            replay_deepspeed_steps(self.adam)


    def host_bytes_by_kind(self) -> dict[str, int]:
        """`host_bytes()` split by what the bytes are: "masters" (FP32 master shards), "grads" (their
        gradient shards, present from the first `add_grad` of a step until `step`) and "moments"
        (every Adam state tensor: exp_avg, exp_avg_sq and the scalar step counters; none before the
        first step). Storages, so spilled states count 0; the three sum to `host_bytes()`."""
        def nbytes(tensors) -> int:
            return sum(t.untyped_storage().nbytes() for t in tensors)

        return {"masters": nbytes(self.masters),
                "grads": nbytes(m.grad for m in self.masters if m.grad is not None),
                "moments": nbytes(v for st in self.adam.state.values() for v in st.values() if torch.is_tensor(v))}
