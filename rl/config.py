"""The run's configuration: dataclass schemas registered with Hydra's ConfigStore.

`configs/config.yaml` composes one option per group (`configs/{model,task,algo,rollout,memory,
trainer,experiment}`) onto `RunConfig`; because every group is a typed schema, a misspelt key
(`rollout.max_new_tokns=8`) or a wrong type (`trainer.num_chunks=two`) fails at composition with
Hydra's message naming the key, and value checks (a negative budget, an unknown loss) fail in the
schemas' `__post_init__` when `to_run_config` builds the objects, naming the value and what was
expected. `experiment=cpu_demo` (the default) is a `# @package _global_` file overriding groups.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from memory.layout import CacheLayout
from models.config import ModelConfig
from models.precision import check_dtype_supported, parse_dtype
from rl.tracking import TrackingConfig
from rollout.kv_eviction import KVBudgetConfig, lookup_policy
from rollout.sampling import SamplingParams
from trainer.chunks import CHUNK_SPLITS
from trainer.losses import LossConfig
from trainer.optimizer import OptimizerConfig


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    name: str = "majority_digit"
    """Registered task (rl/tasks)."""
    params: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the task's constructor."""
    tokenizer: str = "byte"
    """"byte" (the tiny models' tokenizer) or a local Hugging Face tokenizer directory."""


@dataclass(frozen=True, kw_only=True)
class AlgoConfig:
    advantage: str = "grpo"
    """Registered advantage estimator ("grpo", "rloo")."""
    group_size: int = 8
    """Samples per prompt (GRPO group), generated with parallel sampling."""
    loss: LossConfig = field(default_factory=LossConfig)

    def __post_init__(self) -> None:
        from trainer.losses import lookup

        lookup("advantage", self.advantage)
        if self.group_size < 2:
            raise ValueError(f"algo.group_size={self.group_size}, expected >= 2 (group advantages need peers)")


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    groups_per_iteration: int = 16
    """New prompt groups started each iteration (each of algo.group_size trajectories), over all ranks
    together: rank r generates the groups g with g % world == r."""
    max_new_tokens: int = 4
    """Tokens per policy turn at most."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_concurrency: Any = "auto"
    """Requests in flight per rank (each rank's engine): "auto" (the dispatcher's auto-throttling) or a
    positive integer."""
    budget_tokens: int | None = None
    """Partial rollouts: generated tokens per iteration, over all ranks (each rank stops at its share,
    ceil(budget_tokens / world)), after which unfinished trajectories are paused and carried over;
    None = no token budget."""
    budget_seconds: float | None = None
    """Partial rollouts: rollout seconds per iteration (wall clock, the same on every rank); None = no
    time budget."""
    env_timeout_s: float | None = 60.0
    """Seconds each environment call (reset, step, reward) may take before its trajectory is
    dropped (reason "timeout"); null = no limit."""
    max_drop_fraction: float = 0.5
    """Circuit breaker: the run stops with an error when more than this share of an iteration's
    trajectories were dropped (over-length, tokenizer or environment errors, timeouts)."""
    partial_resume: str = "recompute"
    """How a carried-over trajectory continues: "recompute" (its prefix is recomputed under the new
    weights) or "kv" (the kept, stale KV; parked in the host KV pool over the train phase, so it
    needs memory.host_pool_mb > 0 or memory.release_pool_in_train=false)."""
    max_model_len: int = 256
    """Longest sequence the engine runs, prompt + generated (every turn of a conversation counts): a
    longer prompt is refused and its trajectory dropped (counted as rollout_dropped_too_long).
    memory.pool_mb must hold one sequence of this length (checked at composition; `python -m rl.plan`
    prints the longest context a pool holds). 64k-128k contexts are this knob and memory.pool_mb."""
    max_num_batched_tokens: int = 1024
    """Tokens one engine step computes (decode tokens + prefill chunks): a longer prompt is prefilled
    in chunks of at most this many tokens over several steps, so it may be below max_model_len."""
    kernel_impl: str | None = None
    prefix_hash_block: int | None = None
    """Prefix cache: tokens per hash block (must divide the pool's page of block_tokens tokens);
    null = no prefix cache. Reuse holds within an iteration (new weights never hit old prefixes):
    later turns of a conversation and prompts shared across groups."""
    kv_budget_tokens: int | None = None
    """Token eviction for the MLA layers (rollout/kv_eviction.py): MLA cache slots per sequence on the
    device (4 sink + 32 recent tokens always kept, so > 36); null = full KV."""
    kda_state_dtype: str = "fp32"
    """Element type of the engine's KDA state pages, "fp32" or "bf16" (the MLA cache takes
    experiment.dtype): the recurrent state integrates every token, hence FP32 by default."""
    kv_policy: str = "h2o"
    """With kv_budget_tokens: "h2o" (evicted tokens are dropped) or "infinigen" (offloaded to host
    memory and fetched back when the partial-key predictor says attention returns)."""

    def __post_init__(self) -> None:
        if self.groups_per_iteration < 1 or self.max_new_tokens < 1:
            raise ValueError(f"rollout.groups_per_iteration={self.groups_per_iteration} and rollout.max_new_tokens="
                             f"{self.max_new_tokens} must be >= 1")
        if self.max_model_len < 2:
            raise ValueError(f"rollout.max_model_len={self.max_model_len}, expected >= 2 (one prompt token and one "
                             f"generated token)")
        if self.max_new_tokens >= self.max_model_len:
            raise ValueError(f"rollout.max_new_tokens={self.max_new_tokens} leaves no room for a prompt under "
                             f"rollout.max_model_len={self.max_model_len}; expected max_new_tokens < max_model_len")
        if self.env_timeout_s is not None and not self.env_timeout_s > 0:
            raise ValueError(f"rollout.env_timeout_s={self.env_timeout_s}, expected > 0 or null (no limit)")
        if not 0 <= self.max_drop_fraction <= 1:
            raise ValueError(f"rollout.max_drop_fraction={self.max_drop_fraction}, expected in [0, 1]")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"rollout.max_num_batched_tokens={self.max_num_batched_tokens}, expected >= 1 (tokens "
                             f"per engine step; a longer prompt is prefilled in chunks of this size)")
        if not (self.max_concurrency == "auto" or (isinstance(self.max_concurrency, int)
                                                   and not isinstance(self.max_concurrency, bool)
                                                   and self.max_concurrency >= 1)):
            raise ValueError(f"rollout.max_concurrency={self.max_concurrency!r}, expected 'auto' or an integer >= 1")
        if self.budget_tokens is not None and self.budget_tokens < 1:
            raise ValueError(f"rollout.budget_tokens={self.budget_tokens}, expected >= 1 or null (no budget)")
        if self.budget_seconds is not None and not self.budget_seconds > 0:
            raise ValueError(f"rollout.budget_seconds={self.budget_seconds}, expected > 0 or null (no budget)")
        try:  # the sampler's own checks, at composition rather than at the first request
            SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                           top_k=self.top_k)
        except ValueError as err:
            raise ValueError(f"rollout.{err}") from None
        if self.temperature != 1.0:
            # The engine's behaviour logprobs are log softmax(logits / T); the trainer scores at T = 1.
            raise ValueError(f"rollout.temperature={self.temperature}: only 1.0 is supported for training for now "
                             f"(the trainer's logprobs are not temperature-scaled yet)")
        if self.prefix_hash_block is not None and self.prefix_hash_block < 1:
            raise ValueError(f"rollout.prefix_hash_block={self.prefix_hash_block}, expected >= 1 or null (no cache)")
        try:
            parse_dtype(self.kda_state_dtype)
        except ValueError as err:
            raise ValueError(f"rollout.kda_state_{err}") from None
        if self.partial_resume not in ("recompute", "kv"):
            raise ValueError(f"rollout.partial_resume={self.partial_resume!r}, expected 'recompute' or 'kv'")
        try:  # the eviction config's own checks, at composition
            lookup_policy(self.kv_policy)
            self.kv_budget()
        except ValueError as err:
            raise ValueError(f"rollout.{str(err).removeprefix('kv_budget.')}") from None

    def kv_budget(self) -> KVBudgetConfig | None:
        """The engine's token-eviction config, or None (full KV)."""
        if self.kv_budget_tokens is None:
            return None
        return KVBudgetConfig(budget_tokens=self.kv_budget_tokens, policy=self.kv_policy)

    @property
    def concurrency(self) -> int | None:
        return None if self.max_concurrency == "auto" else int(self.max_concurrency)

    @property
    def longest_kv_tokens(self) -> int:
        """Tokens of KV one sequence holds at most: max_model_len, capped by kv_budget_tokens."""
        return min(self.max_model_len, self.kv_budget_tokens or self.max_model_len)


@dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    pool_mb: int = 16
    """Device page pool of the rollout engine, MiB, per rank (each rank's engine has its own)."""
    release_pool_in_train: bool = True
    """Release the engine's pool while training (colocated: training gets the memory back)."""
    reference: str = "stream"
    """Where the KL reference model's weights live: "stream" (host, copied chunk by chunk into the
    trainer's idle gradient slots for its forward: trainer/ref_stream.py) or "resident" (a whole
    second model on the device)."""
    host_pool_mb: int = 0
    """Host KV pool, MiB (leased from the host-DRAM ledger): the prefix cache's second tier, and
    where paused partial rollouts wait while the device pool is released; per rank; 0 = none."""
    host_budget_mb: int | None = None
    """Host-DRAM ledger budget of one node, MiB, split evenly among the node's ranks; null = MemAvailable
    less a 10% reserve."""
    spill_dir: str | None = None
    """NVMe directory the optimizer's host states are spilled to after each iteration (restored before
    the next update; memory/nvme_store.py); relative = under run_dir; null = they stay in host DRAM."""

    def __post_init__(self) -> None:
        if self.spill_dir is not None and not self.spill_dir.strip():
            raise ValueError("memory.spill_dir is empty; give a directory or null (no spill)")
        if self.pool_mb < 1:
            raise ValueError(f"memory.pool_mb={self.pool_mb}, expected >= 1")
        if self.host_pool_mb < 0:
            raise ValueError(f"memory.host_pool_mb={self.host_pool_mb}, expected >= 0 (0 = no host KV pool)")
        if self.host_budget_mb is not None and self.host_budget_mb < 1:
            raise ValueError(f"memory.host_budget_mb={self.host_budget_mb}, expected >= 1 or null (MemAvailable)")
        if self.reference not in ("stream", "resident"):
            raise ValueError(f"memory.reference={self.reference!r}, expected 'stream' or 'resident'")


@dataclass(frozen=True, kw_only=True)
class TrainSchema:
    num_chunks: int = 2
    chunk_split: str = "layers"
    """How the model is cut into chunks (trainer/chunks.py CHUNK_SPLITS): "layers" (equal layer
    counts; num_chunks <= layers) or "params" (the smallest largest chunk, the embedding and the head
    as units of their own; num_chunks <= layers + 2): the gradient slots are sized for the largest."""
    num_grad_slots: int = 2
    max_bad_steps: int = 3
    micro_batch_tokens: int | None = None
    """Token budget of one micro-batch; None = the whole batch at once."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm (FP32, over every rank's shards) to this; null = no clipping. A
    step whose norm is not finite is skipped whatever this is (counted against max_bad_steps)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)

    def __post_init__(self) -> None:
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"trainer.max_grad_norm={self.max_grad_norm}, expected > 0 or null (no clipping)")
        if self.num_chunks < 1:
            raise ValueError(f"trainer.num_chunks={self.num_chunks}, expected >= 1")
        if self.chunk_split not in CHUNK_SPLITS:
            raise ValueError(f"trainer.chunk_split={self.chunk_split!r}, expected one of {CHUNK_SPLITS}")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ValueError(f"trainer.micro_batch_tokens={self.micro_batch_tokens}, expected >= 1 or null")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """When the RL loop checkpoints and what it keeps (rl/checkpoint.py)."""
    every: int = 1
    """Checkpoint every this many iterations (and always after the last)."""
    keep_last: int = 2
    """Complete checkpoints kept, newest first: a resume falls back to an older one when the newest
    does not verify (a power loss while it was written)."""
    keep_every: int | None = None
    """Also keep every checkpoint whose iteration is a multiple of this (never deleted); null = none."""

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"checkpoint.every={self.every}, expected >= 1")
        if self.keep_last < 1:
            raise ValueError(f"checkpoint.keep_last={self.keep_last}, expected >= 1")
        if self.keep_every is not None and self.keep_every < 1:
            raise ValueError(f"checkpoint.keep_every={self.keep_every}, expected >= 1 or null")


@dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
    name: str = "cpu_demo"
    iterations: int = 10
    """RL iterations (rollout + train each)."""
    init_std: float = 0.1
    """Random init of the policy when no checkpoint is given."""
    checkpoint: str | None = None
    """A Hugging Face checkpoint directory to start from instead of a random init."""
    device: str = "cpu"
    """Where the models, batches and collectives of each rank live: "cpu" (gloo between ranks),
    "cuda" (one GPU per rank, the GPU of LOCAL_RANK under torchrun; NCCL) or "auto" (cuda when
    torch.cuda.is_available(), else cpu). The resolved device is the run's `Ranks.device`, printed at
    start. Default cpu until a GPU has run the loop (rl/README.md)."""

    max_idle_iterations: int = 3
    """Circuit breaker: the run stops with an error after this many iterations in a row that trained
    on nothing (every trajectory dropped or failed)."""
    collective_timeout_s: float = 600.0
    """Timeout of every collective between ranks (a dead rank makes the others fail with a clear
    error within it instead of hanging)."""
    dtype: str = "fp32"
    """Parameter dtype on the device: "fp32" or "bf16" (Megatron's recipe: bf16 weights, FP32 gradient
    slots, FP32 masters and AdamW moments on the host; models/precision.py). A checkpoint to start
    from or resume must have been written in the same dtype."""

    def __post_init__(self) -> None:
        try:
            parse_dtype(self.dtype)
        except ValueError as err:
            raise ValueError(f"experiment.{err}") from None
        if self.iterations < 1:
            raise ValueError(f"experiment.iterations={self.iterations}, expected >= 1")
        if self.max_idle_iterations < 1:
            raise ValueError(f"experiment.max_idle_iterations={self.max_idle_iterations}, expected >= 1")
        if not self.collective_timeout_s > 0:
            raise ValueError(f"experiment.collective_timeout_s={self.collective_timeout_s}, expected > 0")
        if not self.init_std > 0:
            raise ValueError(f"experiment.init_std={self.init_std}, expected > 0")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"experiment.device={self.device!r}, expected 'auto', 'cpu' or 'cuda'")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"experiment.device='cuda' but CUDA is not available here (torch.cuda.is_available() "
                             f"is False; torch {torch.__version__}, CUDA build {torch.version.cuda}); run where a GPU "
                             f"is visible, or use experiment.device=cpu (or auto: cuda only when available)")
        if self.device in ("auto", "cpu", "cuda"):
            try:
                check_dtype_supported(parse_dtype(self.dtype), self.device_type)
            except ValueError as err:
                raise ValueError(f"experiment.{err}") from None

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def device_type(self) -> str:
        """"cuda" or "cpu": `device` with "auto" resolved on this machine."""
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    model: ModelConfig = MISSING
    task: TaskConfig = field(default_factory=TaskConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    trainer: TrainSchema = field(default_factory=TrainSchema)
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    seed: int = 0
    run_dir: str = "runs/cpu_demo"
    """Where checkpoints, metrics, plots and wandb files go (also Hydra's run dir)."""
    resume: Any = False
    """false: a new run (a run_dir holding one is refused); true: continue from the newest checkpoint
    that verifies, or start a new run when there is none (said on stderr); "must": continue, and refuse
    when there is no checkpoint. A resume may change only rl/train.py's RESUME_MAY_CHANGE keys."""

    def __post_init__(self) -> None:
        if self.resume not in (False, True, "must"):
            raise ValueError(f"resume={self.resume!r}, expected false, true or must")
        if (self.rollout.partial_resume == "kv" and self.memory.release_pool_in_train
                and self.memory.host_pool_mb == 0):
            raise ValueError("rollout.partial_resume='kv' keeps carried-over trajectories' KV, but "
                             "memory.release_pool_in_train=true frees the device pool for training and there is no "
                             "host KV pool to park it in; set memory.host_pool_mb > 0 or release_pool_in_train=false")
        layers, t = self.model.num_hidden_layers, self.trainer
        most = layers + 2 if t.chunk_split == "params" else layers
        if t.num_chunks > most:
            raise ValueError(f"trainer.num_chunks={t.num_chunks}, expected at most {most} for a model of {layers} layers "
                             f"with trainer.chunk_split={t.chunk_split!r}"
                             + ("" if t.chunk_split == "params" else " ('params' allows layers + 2)"))
        layout, r = self.cache_layout, self.rollout
        pool_pages = (self.memory.pool_mb << 20) // layout.page_bytes  # PagePool.from_bytes
        needed = layout.sequence_pages(r.longest_kv_tokens)  # the engine's "cannot hold one sequence" check
        if needed > pool_pages:
            raise ValueError(
                f"memory.pool_mb={self.memory.pool_mb} holds {pool_pages} pages of {layout.page_bytes:,} bytes, but "
                f"one sequence of rollout.max_model_len={r.max_model_len} tokens"
                + (f" (rollout.kv_budget_tokens={r.kv_budget_tokens} on the device)" if r.kv_budget_tokens else "")
                + f" needs {needed} pages ({len(layout.kda_groups)} KDA state pages + {len(layout.mla_groups)} x "
                f"{layout.mla_pages_for(r.longest_kv_tokens)} MLA pages of {layout.block_tokens} tokens); set "
                f"memory.pool_mb >= {layout.pool_mb_for(needed)} or lower rollout.max_model_len")

    @property
    def cache_layout(self) -> CacheLayout:
        """The rollout engine's page geometry (rollout/engine.py builds the same): MLA latents in the
        run's dtype (the model's output weight, never kept FP32), KDA states in rollout.kda_state_dtype."""
        return CacheLayout.for_model(self.model, cache_dtype=self.experiment.torch_dtype,
                                     state_dtype=parse_dtype(self.rollout.kda_state_dtype))


def _writable(node: Any) -> None:
    """Clear the read-only flag frozen dataclasses put on their nodes (composition must write
    into them; the frozen objects are built afterwards by `to_run_config`)."""
    node._set_flag("readonly", None)
    if isinstance(node, DictConfig) and not node._is_missing():
        for key in node.keys():
            _writable(node._get_node(key))
    elif isinstance(node, ListConfig) and not node._is_missing():
        for i in range(len(node)):
            _writable(node._get_node(i))


def register_configs() -> None:
    """Put the schema in Hydra's ConfigStore as `base_config` (the first entry of configs/config.yaml)."""
    node = OmegaConf.structured(RunConfig)
    _writable(node)
    ConfigStore.instance().store(name="base_config", node=node)


def to_run_config(cfg: DictConfig) -> RunConfig:
    """The composed Hydra config as validated dataclasses (value errors name the key)."""
    return OmegaConf.to_object(cfg)
