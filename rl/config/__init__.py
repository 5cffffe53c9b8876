"""The run's configuration: `RunConfig`, whose groups are the components' own config dataclasses.

`configs/config.yaml` composes one option per group onto `RunConfig`: `rollout` is the driver's
`DriverConfig` (rl/episodes/driver.py), `engine` the rollout engine's `EngineConfig` (rollout/engine_config.py;
its optional `prefix_cache` and `kv_budget` nodes are null until the groups `prefix_cache=on` /
`kv_budget=h2o|infinigen` merge into them), `trainer` the `TrainerConfig` (trainer/step.py), and
`model`, `task`, `algo`, `memory`, `experiment`, `warmup`, `tracking`, `checkpoint` (here and beside
their code). Each knob has one name and one default, the dataclass's: the group files restate none, and
`experiment=cpu_demo` (the default, a `# @package _global_` file) holds the demo's choices. Because
every group is a typed schema, a misspelt key (`rollout.max_new_tokns=8`) or a wrong type
(`trainer.num_chunks=two`) fails at composition with Hydra's message naming the key; value checks
run in each dataclass's `__post_init__` when `to_run_config` builds it, the message prefixed with
the key's path (`engine.max_model_len=1, expected >= 2`), and `RunConfig` checks what spans groups.
rl/config/compose.py composes the YAML onto this schema (Hydra) and builds it; rl/config/checks.py holds
the checks that need more than the values (the command line's
overrides, the number of ranks, the loaded tokenizer); tests/rl/test_knobs.py keeps the YAML files
and the dataclasses to one name and one default per knob.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from omegaconf import MISSING

from memory.layout import CacheLayout
from models.config import ModelConfig
from models.precision import check_dtype_supported, parse_dtype
from models.tokenizer import TokenizerConfig
from rl.config.algo import AlgoConfig
from rl.config.checks import check_algo, check_inputs, task_reads_rows
from rl.envs.data import DataConfig, check_files
from rl.envs.tools.sandbox import SandboxSettings
from rl.episodes.env_runner import EnvConfig
from rl.episodes.driver import DriverConfig
from rl.run.tracking import TrackingConfig
from rl.episodes.validation import EvalConfig
from rl.run.warmup import WarmupConfig
from rollout.engine_config import EngineConfig
from trainer.step import TrainerConfig


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    name: str = MISSING
    """Registered task (rl/envs/tasks) or an import path "package.module:Class"; each configs/task
    file names its own (the default is the `task` group's selection in configs/config.yaml). A task
    named by import path (and a scored task's reward file) runs in the trainer's own process with its
    privileges: trusted code; only what a task hands to the sandbox is isolated (docs/sandbox.md)."""
    params: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the task's constructor (its own defaults for the others)."""

    def __post_init__(self) -> None:
        """The task resolves and builds with these params (a scored task loads its reward function)."""
        from rl.envs.tasks import resolve_task

        try:
            factory = resolve_task(self.name)
        except ValueError as err:
            raise ValueError(f"task.name={self.name!r}: {err}") from None
        try:
            factory(**self.params)
        except (TypeError, ValueError) as err:
            raise ValueError(f"task.name={self.name!r} with task.params={dict(self.params)!r}: {err}") from None

    @property
    def resolved_params(self) -> dict[str, Any]:
        """Every keyword of the task's constructor with the value it runs with: `params`, and the
        constructor's defaults for the others (what the run's stored config records)."""
        return task_params(self.name, self.params)


def task_params(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """`params` completed with the defaults of task `name`'s constructor keywords it does not set
    (keywords without a default, *args and **kwargs are left as given)."""
    from rl.envs.tasks import resolve_task

    try:
        signature = inspect.signature(resolve_task(name))
    except (TypeError, ValueError):  # no task of that name, or a factory without a signature
        return dict(params)
    defaults = {k: p.default for k, p in signature.parameters.items()
                if p.default is not inspect.Parameter.empty
                and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    return defaults | dict(params)


@dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    """The run's memory phases (rl/run/loop.py): what is released while training, where the
    reference and the optimizer's host states live. The engine's pools are `engine.pool_mb` and
    `engine.host_pool_mb`."""
    release_pool_in_train: bool = True
    """Release the engine's pool while training (colocated: training gets the memory back)."""
    reference: str = "stream"
    """Where the KL reference model's weights live: "stream" (host, copied chunk by chunk into the
    trainer's idle gradient slots for its forward: trainer/ref_stream.py) or "resident" (a whole
    second model on the device)."""
    host_budget_mb: int | None = None
    """Host-DRAM ledger budget of one node, MiB, split evenly among the node's ranks; null = MemAvailable
    less a 10% reserve."""
    spill_dir: str | None = None
    """NVMe directory the optimizer's host states are spilled to after each iteration (restored before
    the next update; memory/nvme_store.py); relative = under run_dir; null = they stay in host DRAM."""

    def __post_init__(self) -> None:
        if self.spill_dir is not None and not self.spill_dir.strip():
            raise ValueError("memory.spill_dir is empty; give a directory or null (no spill)")
        if self.host_budget_mb is not None and self.host_budget_mb < 1:
            raise ValueError(f"memory.host_budget_mb={self.host_budget_mb}, expected >= 1 or null (MemAvailable)")
        if self.reference not in ("stream", "resident"):
            raise ValueError(f"memory.reference={self.reference!r}, expected 'stream' or 'resident'")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """When the RL loop checkpoints and what it keeps (rl/run/checkpoint.py)."""
    every: int = 1
    """Checkpoint every this many iterations (and always after the last)."""
    keep_last: int = 2
    """Complete checkpoints kept, newest first: a resume falls back to an older one when the newest
    does not verify (a power loss while it was written)."""
    keep_every: int | None = None
    """Also keep every checkpoint whose iteration is a multiple of this (never deleted); null = none."""
    export_every: int | None = None
    """Also export every checkpoint whose iteration is a multiple of this for serving, bf16, to
    run_dir/export/iter_N (rl/export; never deleted); null = none."""
    accept_unverified: bool = False
    """Resume from a checkpoint without manifest.json (its files unverifiable) instead of skipping it."""

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"checkpoint.every={self.every}, expected >= 1")
        if self.keep_last < 1:
            raise ValueError(f"checkpoint.keep_last={self.keep_last}, expected >= 1")
        if self.keep_every is not None and self.keep_every < 1:
            raise ValueError(f"checkpoint.keep_every={self.keep_every}, expected >= 1 or null")
        if self.export_every is not None and self.export_every < 1:
            raise ValueError(f"checkpoint.export_every={self.export_every}, expected >= 1 or null")


@dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
    name: str | None = None
    """The preset's name (each configs/experiment file sets its own); null without one."""
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
    num_threads: int | None = None
    """CPU threads of each rank's torch ops (torch.set_num_threads); null = chosen from the machine
    (rl/run/threads.py: the usable cores shared among the node's ranks, at most the cores idle at
    start; OMP_NUM_THREADS when set), printed at start. Threads past the free cores spin-wait on each
    other: measured on 2 cores with one busy elsewhere, 2 threads made the tiny model's train phase 1.8x
    slower than 1."""

    def __post_init__(self) -> None:
        try:
            parse_dtype(self.dtype)
        except ValueError as err:
            raise ValueError(f"experiment.{err}") from None
        if self.iterations < 1:
            raise ValueError(f"experiment.iterations={self.iterations}, expected >= 1")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"experiment.num_threads={self.num_threads}, expected >= 1 or null (torch's default)")
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
class ParallelConfig:
    """How the run's ranks split the model (rl/run/ranks.py; groups from megatron-core's parallel_state)."""

    expert: int = 1
    """Expert parallelism: the routed experts of every MoE layer are split over groups of this many
    ranks (each holds num_experts / expert of them, in the trainer and the engine alike; tokens
    reach their experts by all-to-all); everything else stays whole on every rank. 1 = every rank
    holds every expert. Must divide the number of ranks and the model's expert count."""

    context: int = 1
    """Context parallelism: every training sequence is split over groups of this many ranks (each
    holds its zig-zag share of the tokens: 2 of 2 x context fragments; models/context_parallel.py),
    for the train step, the old-logprob pass and the reference alike; rollouts stay whole on each
    rank's engine and are dealt to their context group before the update. World = data-parallel
    ranks x context; the expert groups span both. 1 = whole sequences on every rank."""

    def __post_init__(self) -> None:
        if self.expert < 1:
            raise ValueError(f"parallel.expert={self.expert}, expected >= 1 (1 = no expert parallelism)")
        if self.context < 1:
            raise ValueError(f"parallel.context={self.context}, expected >= 1 (1 = no context parallelism)")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    model: ModelConfig = MISSING
    task: TaskConfig = MISSING
    """The `task` group's selection (configs/task)."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: DriverConfig = field(default_factory=DriverConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The rollout engine of each rank (its requests are seeded by the run's `seed`: rl/run/build.py)."""
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Expert parallelism (`parallel.expert`); data parallelism over the rest of the ranks."""
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    """Validation on held-out episodes (rl/episodes/validation.py): when (every, before_train), how (n, temperature, top_p,
    max_new_tokens), how many (num_prompts; data.val_files rows when given), the dump (run_dir/val/)."""
    sandbox: SandboxSettings = field(default_factory=SandboxSettings)
    """How tasks that run model-written code isolate it (`sandbox.backend`: bwrap, or none = no isolation)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts and labels from files (rl/envs/data.py); train_files=[] = the task generates its prompts."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """The tokenizer (`tokenizer.path`: "byte" or a local Hugging Face directory) and its chat template
    (models/tokenizer.py): prompts are rendered with it, its end-of-turn ids stop answers."""
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    """The supervised warm-up before RL (rl/run/warmup.py); steps=0 (the default) = none."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    seed: int = 0
    """The run's seed: the policy's random init, the engine's requests, the tasks' episodes."""
    run_dir: str = "runs/cpu_demo"
    """Where checkpoints, metrics, plots and wandb files go (also Hydra's run dir)."""
    resume: Any = False
    """false: a new run (a run_dir holding one is refused); true: continue from the newest checkpoint
    that verifies, or start a new run when there is none (said on stderr); "must": continue, and refuse
    when there is no checkpoint. A resume may change only rl/train.py's RESUME_MAY_CHANGE keys."""

    def __post_init__(self) -> None:
        """The checks that span groups (each group checked its own values when it was built)."""
        if self.resume not in (False, True, "must"):
            raise ValueError(f"resume={self.resume!r}, expected false, true or must")
        r, e = self.rollout, self.engine
        if r.partial_resume == "kv" and self.memory.release_pool_in_train and not self.has_host_pool:
            raise ValueError("rollout.partial_resume='kv' keeps carried-over trajectories' KV, but "
                             "memory.release_pool_in_train=true frees the device pool for training and there is no "
                             "host KV pool to park it in; set engine.host_pool_mb > 0 or release_pool_in_train=false")
        if e.host_pool_mb == "auto" and self.memory.spill_dir is None:
            raise ValueError("engine.host_pool_mb='auto' lends the host KV pool the DRAM the spilled training states "
                             "free during each rollout, but memory.spill_dir is null (nothing is spilled); set "
                             "memory.spill_dir or give engine.host_pool_mb in MiB")
        if self.data.train_files or self.data.val_files:
            check_files(self.data)
        o = self.trainer.optimizer
        if o.lr_schedule != "constant" and o.total_steps is None and o.warmup_steps > self.optimizer_steps:
            raise ValueError(f"trainer.optimizer.warmup_steps={o.warmup_steps}, but the run takes {self.optimizer_steps} "
                             f"optimizer steps (experiment.iterations={self.experiment.iterations} x algo.ppo_epochs="
                             f"{self.algo.ppo_epochs} x algo.mini_batches={self.algo.mini_batches}); expected at most "
                             f"{self.optimizer_steps}, or a trainer.optimizer.total_steps that holds the warm-up")
        if self.parallel.context > 1 and self.warmup.steps:
            raise ValueError(f"parallel.context={self.parallel.context} with warmup.steps={self.warmup.steps}: the "
                             f"supervised warm-up trains whole sequences on each rank; expected warmup.steps=0 "
                             f"under context parallelism")
        if self.parallel.expert > 1:
            if self.model.num_experts % self.parallel.expert:
                raise ValueError(f"parallel.expert={self.parallel.expert} does not divide the model's "
                                 f"num_experts={self.model.num_experts}; expected a divisor of it")
            if self.engine.kv_budget is not None:
                raise ValueError(f"parallel.expert={self.parallel.expert} with a KV budget (kv_budget=...): its key "
                                 f"predictor runs the model outside the engine's lock-step; expected kv_budget=null")
        if self.task.name == "scored" and self.data.enabled and self.data.label_key is None:
            raise ValueError("task.name=scored hands each row's label to compute_score as ground_truth, but "
                             "data.label_key=null; name the column of your labels")
        if self.eval.before_train is None:  # null: evaluate before training when there are validation rows
            object.__setattr__(self, "eval", replace(self.eval, before_train=bool(self.data.val_files)))
        if self.data.enabled and not task_reads_rows(self.task.name):
            raise ValueError(f"data.train_files={list(self.data.train_files)!r} is given, but task.name={self.task.name!r} "
                             f"generates its own prompts (its reset takes no row) and would ignore them; use "
                             f"task=scored (your reward on your rows) or a task whose reset(seed, row) reads rows")
        if self.task.name == "scored" and not self.data.enabled:
            raise ValueError("task.name=scored scores the rows of data.train_files, but data.train_files=[]; give "
                             "the files (jsonl) of your prompts and labels")
        answer = check_inputs(self)  # the tokenizer, every data row; null max_new_tokens: the task's
        if answer is not None:
            object.__setattr__(self, "rollout", replace(self.rollout, max_new_tokens=answer))
        if self.rollout.max_new_tokens >= e.max_model_len:
            raise ValueError(f"rollout.max_new_tokens={self.rollout.max_new_tokens} leaves no room for a prompt under "
                             f"engine.max_model_len={e.max_model_len}; expected max_new_tokens < max_model_len")
        layers, t = self.model.num_hidden_layers, self.trainer
        most = layers + 2 if t.chunk_split == "params" else layers
        if t.num_chunks > most:
            raise ValueError(f"trainer.num_chunks={t.num_chunks}, expected at most {most} for a model of {layers} layers "
                             f"with trainer.chunk_split={t.chunk_split!r}"
                             + ("" if t.chunk_split == "params" else " ('params' allows layers + 2)"))
        self._check_pool()
        check_algo(self)

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps of the whole run: the lr schedule's horizon unless trainer.optimizer.total_steps."""
        return self.experiment.iterations * self.algo.ppo_epochs * self.algo.mini_batches

    @property
    def has_host_pool(self) -> bool:
        """Whether the engine gets a host KV pool (engine.host_pool_mb: "auto" or > 0)."""
        return self.engine.host_pool_mb == "auto" or self.engine.host_pool_mb > 0

    def _check_pool(self) -> None:
        """The engine's "cannot hold one sequence" check, at composition (the same page formula)."""
        layout, e = self.cache_layout, self.engine
        pool_pages = e.pool_bytes // layout.page_bytes
        needed = layout.sequence_pages(e.longest_kv_tokens)
        if needed <= pool_pages:
            return
        raise ValueError(
            f"engine.pool_mb={e.pool_mb} holds {pool_pages} pages of {layout.page_bytes:,} bytes, but one sequence of engine.max_model_len={e.max_model_len} tokens"
            + (f" (engine.kv_budget.budget_tokens={e.kv_budget.budget_tokens} on the device)" if e.kv_budget else "")
            + f" needs {needed} pages ({len(layout.kda_groups)} KDA state pages + {len(layout.mla_groups)} x "
            f"{layout.mla_pages_for(e.longest_kv_tokens)} MLA pages of {layout.block_tokens} tokens); set "
            f"engine.pool_mb >= {layout.pool_mb_for(needed)} or lower engine.max_model_len")

    @property
    def cache_layout(self) -> CacheLayout:
        """The rollout engine's page geometry (rollout/engine.py builds the same): MLA latents in the
        run's dtype (the model's output weight, never kept FP32), KDA states in engine.kda_state_dtype,
        block_tokens a multiple of the prefix cache's hash block when there is one."""
        e = self.engine
        return CacheLayout.for_model(self.model, group_layers=e.group_layers, block_tokens=e.block_tokens,
                                     cache_dtype=self.experiment.torch_dtype, state_dtype=parse_dtype(e.kda_state_dtype),
                                     hash_block=e.prefix_cache.hash_block if e.prefix_cache else None)
