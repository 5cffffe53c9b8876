"""The run's parts for one rank: the policy in the run's dtype, the rollout engine (on the policy's
own parameter tensors: one copy of the weights, a weight sync is a version bump), the trainer, the
rollout driver, validation, the NVMe store, the tracker and the KL reference.

Placement (`experiment.device`, resolved into `Ranks.device`): the policy (which the engine runs
on; its page pool follows it), a resident reference and the trainer's gradient slots live on the rank's
device; the optimizer's FP32 masters and moments, a streamed reference's weights (pinned on CUDA)
and the host KV pool live in host memory. Initial weights are drawn on the CPU and moved, so a
CUDA run starts from the same weights as a CPU run.
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch

from memory.host_ledger import HostLedger, mem_available_bytes
from memory.nvme_store import NvmeStore, owner_directory
from models.checkpoint import load_weights
from models.expert_parallel import ExpertParallel
from models.model import HybridLM
from models.precision import cast_parameters
from models.value import ValueModel
from models.tokenizer import load_tokenizer
from rl.config import RunConfig
from rl.config.checks import check_tokenizer, check_world
from rl.config.resume import check_checkpoint_model, resolved_config
from rl.envs.data import RowSampler, load_rows
from rl.episodes.driver import RolloutDriver
from rl.episodes.runner import render_prompt
from rl.episodes.validation import evaluator
from rl.run.figures import TimedStreamedReference
from rl.run.advantages import KLController
from rl.run.critic import Critic
from rl.run.loop import LoopParts
from rl.run.ranks import Ranks
from rl.run.tracking import Tracker
from rl.run.warmup import load_record, run_warmup
from rollout.engine import Engine
from trainer.ref_stream import StreamedReference
from trainer.step import Trainer


def initial_policy(cfg: RunConfig, expert_parallel: ExpertParallel | None = None) -> HybridLM:
    """The starting weights on the CPU, in the run's dtype (experiment.dtype): the checkpoint's, or a
    seeded random init drawn in FP32 and then cast (so fp32 and bf16 runs start from the same draw).
    Under expert parallelism only this rank's share: built on the meta device and materialised
    here, its experts read from the checkpoint's files alone (or drawn whole one tensor at a time
    and sliced: the same weights as one rank's), so no rank holds the whole model."""
    if expert_parallel is not None:
        with torch.device("meta"):
            model = HybridLM(cfg.model, expert_parallel)
        model = model.to_empty(device="cpu")
    else:
        model = HybridLM(cfg.model)
    if cfg.experiment.checkpoint is not None:
        check_checkpoint_model(cfg)
        load_weights(model, cfg.experiment.checkpoint, assign=False)
    else:
        model.init_weights(seed=cfg.seed, std=cfg.experiment.init_std)
    return cast_parameters(model, cfg.experiment.torch_dtype)


def host_budget_bytes(cfg: RunConfig, ranks: Ranks) -> int:
    """This rank's host-DRAM ledger budget: memory.host_budget_mb (or MemAvailable less 10%) is the
    node's, split evenly among the ranks on the node."""
    node = (cfg.memory.host_budget_mb << 20 if cfg.memory.host_budget_mb is not None
            else int(mem_available_bytes() * 0.9))
    return node // ranks.local_world


def build(cfg: RunConfig, resume_from: int | None, ranks: Ranks = Ranks(), engine_copy: bool = False) -> LoopParts:
    """The loop's parts for this rank, on `ranks.device` (see the module docstring). `engine_copy`
    gives the engine a second copy of the weights, refreshed by a state-dict copy at every sync (the
    layout before the engine shared the policy's tensors; tests compare the two)."""
    device = ranks.device
    torch.manual_seed(cfg.seed)
    # the same weights on every rank (the seed is the run's); under expert parallelism its experts only
    policy = initial_policy(cfg, ranks.expert_parallel).to(device)
    # training forwards split each sequence over the context group; the engine's forwards never do
    policy.context_parallel = ranks.context_parallel
    if engine_copy:
        with torch.device(device):  # built where it runs (its random init is overwritten at once)
            engine_model = cast_parameters(HybridLM(cfg.model, ranks.expert_parallel), cfg.experiment.torch_dtype)
        engine_model.load_state_dict(policy.state_dict())
    else:
        engine_model = policy  # one copy of the weights: the engine runs on the trainer's parameters
    ledger = HostLedger(host_budget_bytes(cfg, ranks))
    # The configs go through as composed; the engine's requests are seeded by the run's seed.
    tokenizer = load_tokenizer(cfg.tokenizer)
    check_tokenizer(cfg, tokenizer)
    engine = Engine(engine_model, cfg.engine, ledger=ledger, detokenize=tokenizer.decode,  # decode: stop_strings
                    seed=cfg.seed)
    if cfg.memory.spill_dir is not None and engine.host is not None:
        engine.suspend_host()  # time-multiplexed: leased at each rollout, once the training states left (orchestrator)
    t = cfg.trainer
    # the lr schedule's horizon: every optimizer step the run will take (ppo_epochs x mini_batches each)
    trainer = Trainer(policy, t, group=ranks.group, ledger=ledger, total_steps=cfg.optimizer_steps,
                      expert_group=ranks.expert_data_group)
    check_world(cfg, ranks.world)  # the run's ranks (composition checked WORLD_SIZE)
    rows = None
    if cfg.data.enabled:
        rows, loaded = RowSampler.from_config(cfg.data, lambda prompt: render_prompt(tokenizer, prompt))
        if ranks.is_writer and loaded.num_dropped_too_long:
            print(f"data: dropped {loaded.num_dropped_too_long} rows longer than data.max_prompt_tokens="
                  f"{cfg.data.max_prompt_tokens}; {len(rows)} kept", file=sys.stderr)
    driver = RolloutDriver(engine, tokenizer, cfg.task.name, cfg.task.params, cfg.rollout,
                           group_size=cfg.algo.group_size, seed=cfg.seed, rank=ranks.rank, world=ranks.world,
                           rows=rows, env=cfg.env)
    run_dir = Path(cfg.run_dir)
    val_rows = None
    if cfg.data.val_files:  # the held-out rows, in file order (never shuffled)
        val_rows = load_rows(cfg.data.val_files, cfg.data, lambda prompt: render_prompt(tokenizer, prompt)).rows
    evaluate = evaluator(engine, tokenizer, cfg.task.name, cfg.task.params, cfg.eval, seed=cfg.seed, out_dir=run_dir,
                         rank=ranks.rank, world=ranks.world, rollout_max_new_tokens=cfg.rollout.max_new_tokens,
                         env_timeout_s=cfg.env.timeout_s, rows=val_rows, runner=driver.runner)
    # Optimizer host states go here between iterations (orchestrator "offload" / "restore" phases).
    # Each run its own subdirectory of memory.spill_dir (a shared /nvme root is safe), each rank its
    # own store in it: every store locks its directory (memory/nvme_store.py).
    store = (NvmeStore(owner_directory(run_dir / cfg.memory.spill_dir, run_dir) / f"rank{ranks.rank}",
                       owner=f"run {run_dir.resolve()} rank {ranks.rank}")
             if cfg.memory.spill_dir is not None else None)
    tracker = Tracker(run_dir, cfg.tracking, resolved_config(cfg),
                      resume_from_iteration=resume_from, writer=ranks.is_writer)
    # after a warm-up the reference is its result, built once it is known (`start_from_warmup`)
    ref = (None if warm_started(cfg, resume_from)
           else reference(cfg, _split_like(initial_policy(cfg, ranks.expert_parallel), ranks), trainer, ledger))
    # after a new run's warm-up the critic starts from the warmed-up policy: built then (`start_from_warmup`)
    critic, critic_store = ((None, None) if resume_from is None and warm_started(cfg, resume_from)
                            else build_critic(cfg, policy, ranks, ledger, store))
    return LoopParts(cfg=cfg, policy=policy, engine=engine, trainer=trainer, driver=driver, tracker=tracker,
                     ref_model=ref, ledger=ledger, store=store, ranks=ranks, evaluate=evaluate, critic=critic,
                     critic_store=critic_store,
                     kl_ctl=KLController(cfg.algo.kl_in_reward) if cfg.algo.kl_in_reward.coef > 0 else None)


def build_critic(cfg: RunConfig, policy: HybridLM, ranks: Ranks, ledger: HostLedger,
                 store: NvmeStore | None) -> tuple[Critic | None, NvmeStore | None]:
    """PPO's critic (algo.critic.enable): the value model in the run's dtype on the policy's device, from
    the policy's weights (critic.init=policy) or a seeded draw, its own Trainer (the run's chunks and
    micro-batches, critic.optimizer) on the same ledger, and its spill store beside the policy's."""
    c = cfg.algo.critic
    if not c.enable:
        return None, None
    value = ValueModel(cfg.model).init_weights(seed=cfg.seed + 1, std=cfg.experiment.init_std)
    if c.init == "policy":
        value.start_from(policy)
    value = cast_parameters(value, cfg.experiment.torch_dtype).to(ranks.device)
    trainer = Trainer(value, replace(cfg.trainer, optimizer=c.optimizer), group=ranks.group, ledger=ledger,
                      total_steps=cfg.optimizer_steps)
    critic_store = (None if store is None else
                    NvmeStore(store.directory.parent / f"critic-rank{ranks.rank}",
                              owner=f"run {Path(cfg.run_dir).resolve()} critic rank {ranks.rank}"))
    return Critic(value, trainer, c), critic_store


def _split_like(model: HybridLM, ranks: Ranks) -> HybridLM:
    """`model` with the run's context-parallel group: its whole-sequence forwards take this rank's share."""
    model.context_parallel = ranks.context_parallel
    return model


def reference(cfg: RunConfig, model: HybridLM, trainer: Trainer, ledger: HostLedger) -> HybridLM | StreamedReference | None:
    """The KL reference (None without algo.loss.kl_coef or algo.kl_in_reward.coef) from `model`'s weights (a CPU model in the
    run's dtype; not kept): streamed (memory.reference=stream: host copies per VPP chunk, streamed
    through the trainer's idle gradient slots, timed for the run's figures) or resident on the
    trainer's device."""
    if cfg.algo.loss.kl_coef == 0 and cfg.algo.kl_in_reward.coef == 0:
        return None
    model = model.eval()
    if cfg.memory.reference == "stream":
        t = cfg.trainer
        return TimedStreamedReference(model, trainer.arena, t.num_chunks, ledger=ledger, split=t.chunk_split)
    return model.to(trainer.device)


def warm_started(cfg: RunConfig, resume_from: int | None) -> bool:
    """Whether the run starts RL from a supervised warm-up: a new run with warmup.steps > 0, a
    resumed one when it took one (its record is in run_dir; the warmup group's knobs may change on
    a resume, it never runs again)."""
    return load_record(cfg.run_dir) is not None if resume_from is not None else cfg.warmup.steps > 0


def start_from_warmup(cfg: RunConfig, parts: LoopParts, resume: bool) -> dict | None:
    """A new run with warmup.steps > 0 takes its supervised warm-up now (rl/run/warmup.py); a resume of
    one reads its record (the checkpoint holds the policy after it). Either way the KL reference is
    the policy right after the warm-up. Returns the record (None: the run has no warm-up)."""
    if not warm_started(cfg, 0 if resume else None):
        return None
    p = parts
    if not resume:
        record = run_warmup(cfg.warmup, trainer=p.trainer, engine=p.engine, tokenizer=p.driver.tokenizer,
                            task_name=cfg.task.name, task_params=cfg.task.params, rollout=cfg.rollout,
                            group_size=cfg.algo.group_size, seed=cfg.seed, run_dir=Path(cfg.run_dir), ranks=p.ranks,
                            micro_batch_tokens=cfg.trainer.micro_batch_tokens, console=p.tracker.console)
    else:
        record = load_record(cfg.run_dir)
    weights = cast_parameters(HybridLM(cfg.model, p.ranks.expert_parallel), cfg.experiment.torch_dtype)  # CPU
    if resume:
        load_weights(weights, Path(cfg.run_dir) / "warmup", assign=False)
    else:
        weights.load_state_dict({k: v.detach().cpu() for k, v in p.policy.state_dict().items()})
    p.ref_model = reference(cfg, _split_like(weights, p.ranks), p.trainer, p.ledger)
    if not resume:  # the critic's trunk is the warmed-up policy's (a resume loads its checkpointed one)
        p.critic, p.critic_store = build_critic(cfg, p.policy, p.ranks, p.ledger, p.store)
    return record
