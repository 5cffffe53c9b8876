"""The train phase's rewards and advantages: what the environment scored, shaped (DAPO's overlong
punishment), turned into advantages by the configured estimator (outcome level per group, token level
over the packed rows), with KL in the reward and its controller.

Outcome estimators (grpo, rloo) score each group's members from their returns (the shaped reward,
minus coef * the summed KL when KL is in the reward); `scale_rewards=batch` divides by the std of
every return of the step's batch (over all data-parallel ranks). Token estimators (REINFORCE++, its
group baseline, GAE) read trainer/losses/returns.py's `TokenRewards`. The per-token KL of the reward is
kl(behaviour logprob, reference logprob): the engine's logprobs of the sampled tokens (no extra forward;
the mismatch metrics bound how far they are from the trainer's)."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from rl.config.algo import AlgoConfig, KLInRewardConfig
from rl.episodes.trajectory import Trajectory
from trainer.losses import Segments, TokenRewards, lookup

Moments = Callable[[torch.Tensor], torch.Tensor]


def answer_lengths(traj: Trajectory) -> list[int]:
    """Policy tokens of each turn's answer, in order (runs of consecutive policy tokens)."""
    runs, length = [], 0
    for flag in traj.policy:
        if flag:
            length += 1
        elif length:
            runs.append(length)
            length = 0
    return runs + ([length] if length else [])


def overlong_penalty(traj: Trajectory, algo: AlgoConfig, max_new_tokens: int) -> float:
    """DAPO's soft overlong punishment (eq. 13), summed over the turns: an answer of L tokens gets
    min(0, (max_new_tokens - buffer - L) / buffer) * penalty_factor; 0 when shaping is off."""
    o = algo.overlong
    if not o.enable:
        return 0.0
    expected = max_new_tokens - o.buffer_tokens
    return sum(min(0.0, (expected - n) / o.buffer_tokens) * o.penalty_factor for n in answer_lengths(traj))


def shaped_rewards(groups: Sequence[Sequence[Trajectory]], algo: AlgoConfig, max_new_tokens: int) -> list[float]:
    """Each trajectory's reward (group order) with the overlong penalty added."""
    return [t.reward + overlong_penalty(t, algo, max_new_tokens) for g in groups for t in g]


def outcome_advantages(returns: torch.Tensor, sizes: Sequence[int], algo: AlgoConfig,
                       moments: Moments) -> torch.Tensor:
    """[S] one advantage per sequence from its group's returns (`sizes`: members per group, in order)."""
    estimator = lookup("advantage", algo.advantage)
    options = {"normalize_std": algo.scale_rewards == "group"} if algo.advantage == "grpo" else {}
    parts, start = [], 0
    for n in sizes:
        parts.append(estimator(returns[start:start + n], n, **options))
        start += n
    adv = torch.cat(parts) if parts else returns[:0]
    if algo.scale_rewards == "batch":  # TRL's scale_rewards="batch": the std of the whole batch's rewards
        r = returns.to(torch.float64)
        n, s1 = moments(torch.stack([torch.tensor(float(len(r)), dtype=torch.float64, device=r.device), r.sum()]))
        s2 = moments((r - s1 / n.clamp_min(1)).square().sum()[None])[0]
        std = (s2 / (n - 1).clamp_min(1)).sqrt()
        adv = (adv.to(torch.float64) / (std + 1e-6)).to(torch.float32)
    return adv


def token_penalty(behaviour: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, beta: float,
                  config: KLInRewardConfig) -> torch.Tensor:
    """[N] beta * kl_t on the policy rows (0 elsewhere), kl by `config.estimator` of (behaviour, reference)."""
    kl = lookup("kl_estimator", config.estimator)(behaviour, ref_logp)
    return torch.where(mask, beta * kl, 0.0)


def estimate(batch, algo: AlgoConfig, returns_s: torch.Tensor, *, ref_logp: torch.Tensor | None = None,
             values: torch.Tensor | None = None, beta: float = 0.0, moments: Moments = lambda x: x) -> dict[str, float]:
    """Set `batch.advantages` [N] (and `batch.returns` [N], the critic's targets, for token estimators)
    from the sequences' shaped rewards `returns_s` [S]; returns the KL-in-reward metrics."""
    segments = Segments(batch.seq_of_row, batch.num_sequences)
    penalty = None
    metrics: dict[str, float] = {}
    if algo.kl_in_reward.coef > 0:
        if ref_logp is None:
            raise ValueError("algo.kl_in_reward.coef > 0 needs the reference's logprobs, got None")
        penalty = token_penalty(batch.behaviour, ref_logp, batch.mask, beta, algo.kl_in_reward)
        per_seq_kl = torch.zeros(batch.num_sequences, device=penalty.device).index_add_(
            0, batch.seq_of_row, penalty / beta if beta else penalty)
        tokens = torch.zeros_like(per_seq_kl).index_add_(0, batch.seq_of_row, batch.mask.float())
        metrics = {"kl_in_reward/beta": beta,
                   "kl_in_reward/kl": float((per_seq_kl / tokens.clamp_min(1)).mean()) if batch.num_sequences else 0.0}
    if not algo.token_level:
        if penalty is not None:
            returns_s = returns_s - torch.zeros_like(returns_s).index_add_(0, batch.seq_of_row, penalty)
        adv = outcome_advantages(returns_s, batch.group_sizes, algo, moments)
        batch.advantages = adv[batch.seq_of_row] if batch.num_sequences else adv
        batch.returns = None
        return metrics
    groups = torch.repeat_interleave(torch.arange(len(batch.group_sizes), device=returns_s.device),
                                     torch.tensor(batch.group_sizes, dtype=torch.long, device=returns_s.device))
    tr = TokenRewards(returns_s, batch.mask, segments, groups, penalty, values, moments)
    batch.advantages, batch.returns = lookup("advantage", algo.advantage)(tr, gamma=algo.gamma, lam=algo.lam)
    return metrics


class KLController:
    """The KL-in-reward coefficient: fixed, or adaptive (Ziegler et al. 2019 §2.2): after each update
    beta *= 1 + clip(kl / target - 1, -0.2, 0.2) * sequences / horizon. Its state is checkpointed."""

    def __init__(self, config: KLInRewardConfig) -> None:
        self.config, self.beta = config, float(config.coef)

    def update(self, kl: float, sequences: int) -> None:
        if self.config.controller != "adaptive" or not sequences:
            return
        error = min(max(kl / self.config.target_kl - 1.0, -0.2), 0.2)
        self.beta *= 1.0 + error * sequences / self.config.horizon

    def state_dict(self) -> dict:
        return {"beta": self.beta}

    def load_state_dict(self, state: dict) -> None:
        self.beta = float(state["beta"])
