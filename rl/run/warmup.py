"""The supervised warm-up a run may start with: the policy imitates the task's demonstrations.

Real RL starts from a pretrained (and usually supervised-tuned) model; the tiny demo model starts
from a random init, so a run may first take `warmup.steps` supervised steps on demonstrations the
task produces (`demonstration(seed)`: the answers of a good episode, turn by turn). Each step packs
`episodes_per_step` demonstrated conversations exactly as the rollout driver builds a trajectory
(prompt with bos, then per turn the answer's tokens + eos and the environment's observation) and
takes one step of the run's own trainer (its host AdamW, gradient guard and data-parallel reduce)
on the mean negative log-likelihood of the answer tokens, at `warmup.lr` (the trainer's learning
rate is restored afterwards, so the checkpoints hold the RL one).

The reward of the sampling policy is measured before and after (`eval_groups` groups through the
engine, on episodes of their own), so a run can state which share of its gain the warm-up made
and which RL added. `run_warmup` runs it once, at a new run's start, and writes `run_dir/warmup/`:
the weights after it (the KL reference of the RL that follows) and `record.json` (per-step losses
and the two rewards), the record last, as the mark that the warm-up is complete. A resume never
repeats it: the iteration checkpoints hold the policy and optimizer after it, and `load_record`
reads what the run's plots and summary need. Several ranks: each takes its share of the
demonstrations (k % world == rank), the loss normalised by all of them.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from memory.durable import write_durable
from rl.run.ranks import Ranks
from rl.episodes.driver import DriverConfig, RolloutDriver, mix_seed
from rl.envs.tasks.base import make_task
from rollout.engine import Engine
from trainer.step import Trainer

DEMO_STREAM = 0x5741524D
"""Mixed into the demonstrations' episode seeds ("WARM"): RL episodes never draw the same ones."""
EVAL_STREAM = 0x4556414C
"""Mixed into the evaluation driver's seed ("EVAL")."""
RECORD = "record.json"


@dataclass(frozen=True, kw_only=True)
class WarmupConfig:
    """The supervised warm-up before RL (the run's `warmup` group)."""
    steps: int = 0
    """Supervised steps on demonstrations before the first RL iteration; 0 = none."""
    episodes_per_step: int = 64
    """Demonstrated episodes in one step (over all ranks)."""
    lr: float | None = None
    """Learning rate of the warm-up steps; null = the trainer's (trainer.optimizer.lr)."""
    value: bool = True
    """Whether the demonstrations answer the task completely; false asks the task for partial ones
    (key_lookup: the right call, then a random digit), leaving RL the rest to learn."""
    eval_groups: int = 8
    """Groups (of algo.group_size samples) whose mean reward is measured before and after."""

    def __post_init__(self) -> None:
        if self.steps < 0 or self.episodes_per_step < 1 or self.eval_groups < 1:
            raise ValueError(f"steps={self.steps}, episodes_per_step={self.episodes_per_step}, eval_groups="
                             f"{self.eval_groups}: expected steps >= 0 and the others >= 1")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"lr={self.lr}, expected > 0 or null (the trainer's)")


def demo_tokens(env, tokenizer, seed: int, value: bool) -> tuple[list[int], list[bool]]:
    """One demonstrated episode as the rollout driver builds a trajectory: (tokens, policy mask),
    the mask True on each answer's tokens and its closing eos. Raises ValueError for a task without
    demonstrations."""
    if not hasattr(env, "demonstration"):
        raise ValueError(f"warmup.steps > 0 but task {type(env).__name__} has no demonstration(seed); "
                         f"set warmup.steps=0")
    answers = env.demonstration(seed) if value else env.demonstration(seed, value=False)
    prompt = env.reset(seed)
    tokens = tokenizer.encode(prompt)
    policy = [False] * len(tokens)
    eos = tokenizer.eos_token_id
    for answer in answers:
        ids = tokenizer.encode(answer, add_bos=False) + [eos]
        tokens, policy = tokens + ids, policy + [True] * len(ids)
        result = env.step(answer)
        if result.done:
            break
        obs = tokenizer.encode(result.observation, add_bos=False)
        tokens, policy = tokens + obs, policy + [False] * len(obs)
    return tokens, policy


def warmup_step(trainer: Trainer, episodes: list[tuple[list[int], list[bool]]], ranks: Ranks,
                micro_batch_tokens: int | None = None) -> dict[str, float]:
    """One trainer step on the mean NLL of the answer tokens of `episodes` (all ranks' list; this
    rank trains on its share k % world == rank). Returns the trainer's metrics and `loss` (global)."""
    mine = [e for k, e in enumerate(episodes) if k % ranks.world == ranks.rank]
    total = max(1, sum(sum(policy[1:]) for _, policy in episodes))
    device = next(trainer.model.parameters()).device

    def packed(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)  # [N]

    token_ids = packed([x for tokens, _ in mine for x in tokens[:-1]], torch.long)
    targets = packed([x for tokens, _ in mine for x in tokens[1:]], torch.long)
    mask = packed([x for _, policy in mine for x in policy[1:]], torch.float32)
    nll = [0.0]

    def loss_fn(logp: torch.Tensor, rows: torch.Tensor, seqs: list[int]) -> torch.Tensor:
        loss = -(logp * mask[rows]).sum() / total
        nll[0] += float(loss.detach())
        return loss

    metrics = trainer.train_step(token_ids, [len(tokens) - 1 for tokens, _ in mine], targets, loss_fn,
                                 micro_batch_tokens)
    loss = ranks.sum([nll[0]])[0] if ranks.world > 1 else nll[0]
    return {**metrics, "loss": float(loss)}


def evaluate(engine: Engine, tokenizer, task_name: str, task_params: dict, rollout: DriverConfig, *,
             groups: int, group_size: int, seed: int, ranks: Ranks) -> float:
    """Mean reward of `groups` x `group_size` episodes sampled by the engine's current weights, on
    episode seeds of their own (`EVAL_STREAM`), without a budget; global over ranks."""
    config = replace(rollout, groups_per_iteration=groups, budget_tokens=None, budget_seconds=None,
                     partial_resume="recompute")
    driver = RolloutDriver(engine, tokenizer, task_name, task_params, config, group_size=group_size,
                           seed=mix_seed(seed, EVAL_STREAM), rank=ranks.rank, world=ranks.world)
    result = driver.rollout(groups_in_flight=0)  # a fresh driver: no group is unfinished on any rank
    rewards = [t.reward for g in result.groups for t in g]
    if ranks.world > 1:
        rewards = [x for r in ranks.all_gather(rewards) for x in r]
    return sum(rewards) / max(1, len(rewards))


def run_warmup(config: WarmupConfig, *, trainer: Trainer, engine: Engine, tokenizer, task_name: str,
               task_params: dict, rollout: DriverConfig, group_size: int, seed: int, run_dir: Path,
               ranks: Ranks, micro_batch_tokens: int | None = None, console=None) -> dict:
    """The warm-up of a new run (see the module docstring): reward before, `config.steps` steps,
    reward after (the engine tagged with version 1: the weights RL iteration 0 samples with), then
    `run_dir/warmup/` written by rank 0. Returns the record. The engine must be awake."""
    t0 = time.perf_counter()
    kw = dict(groups=config.eval_groups, group_size=group_size, seed=seed, ranks=ranks)
    before = evaluate(engine, tokenizer, task_name, task_params, rollout, **kw)
    env = make_task(task_name, **task_params)
    steps = []
    with trainer.unscheduled(config.lr):  # the warm-up's lr, outside the RL schedule
        for step in range(config.steps):
            episodes = [demo_tokens(env, tokenizer, mix_seed(seed, DEMO_STREAM, step, k), config.value)
                        for k in range(config.episodes_per_step)]
            metrics = warmup_step(trainer, episodes, ranks, micro_batch_tokens)
            steps.append({"step": step, "loss": metrics["loss"], "grad_norm": metrics.get("grad_norm", float("nan"))})
            if console is not None and (step % max(1, config.steps // 5) == 0 or step == config.steps - 1):
                console.print(f"warm-up step {step:>3}  demonstration NLL {metrics['loss']:.4f}")
    engine.weights_updated(1)  # RL iteration 0 samples these weights as version 1: cached prefixes stay valid
    after = evaluate(engine, tokenizer, task_name, task_params, rollout, **kw)
    record = {"steps": steps, "reward_before": before, "reward_after": after, "value": config.value,
              "seconds": time.perf_counter() - t0}
    out = Path(run_dir) / "warmup"
    trainer.save_weights(out)  # every rank's part written (expert parallelism: each its experts) on return
    if ranks.is_writer:
        write_durable(out / RECORD, (json.dumps(record, indent=1) + "\n").encode())  # the mark of a complete warm-up, last
    ranks.barrier()
    if console is not None:
        console.print(f"warm-up: {config.steps} steps in {record['seconds']:.1f}s, reward {before:.3f} -> {after:.3f}")
    return record


def load_record(run_dir: Path) -> dict | None:
    """The record of the run's warm-up (`run_dir/warmup/record.json`), or None when it had none."""
    path = Path(run_dir) / "warmup" / RECORD
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None
