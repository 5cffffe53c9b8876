"""RL losses: group advantages, per-token policy losses, KL estimators, aggregation, one entry point.

One file per kind: `registry.py` (register, lookup), `advantages.py` (outcome-level: grpo, rloo), `returns.py`
(token-level: REINFORCE++, its group-baseline form, GAE; whitening), `policy.py` (ppo, pg, gspo, cispo), `kl.py`,
`aggregation.py` (with the layouts), `correction.py` (rollout correction: truncated or masked IS), `value.py`
(the critic's clipped value loss), `config.py` (LossConfig), `loss.py` (rl_loss), `checks.py` (its inputs').

Every algorithm is a pure function registered by name in one of four registries (`register`,
`lookup`); `LossConfig` names the ones `rl_loss` uses, so a new variant is a new registered function,
not a new flag.

Layouts: per-token tensors are either padded, [B, T] (row b is sequence b), or packed, [N] with
`Segments` naming each row's sequence (the trainer's layout: no padding). `rl_loss` and the
aggregations compute on the packed layout; a padded input is flattened into it (views, no copy),
so both give the same loss. The per-token functions (policy losses, KL estimators) are elementwise.

Three log-probability tensors of the sampled tokens, all [B, T] (or [N]), and which is which:
- `behaviour_logp`: recorded by the rollout engine when the token was sampled (rollout/sampling.py's
  convention). With partial rollouts a sequence's tokens may come from several *older* weight
  versions, and the inference kernels differ numerically from the trainer's.
- `old_logp`: recomputed by the trainer with the weights at the start of this training step, before
  any update (PPO's pi_old, the proximal policy). No gradient.
- `logp`: the policy being optimised, recomputed for each minibatch. The only input (with `entropy`)
  gradients flow through.
The PPO ratio is exp(logp - old_logp) (arXiv:1707.06347); the truncated importance-sampling (TIS)
weight min(exp(old_logp - behaviour_logp), tis_cap) corrects for pi_old not being the distribution the
tokens were drawn from (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy
RL training"; verl's `tis_imp_ratio_cap`).

Words: a *valid* token is a response token with mask 1; padding and prompt tokens are masked out and
may hold any value, NaN included (they are replaced by 0 before any arithmetic).
"""
from trainer.losses.registry import ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES, lookup, register
from trainer.losses.aggregation import (Segments, seq_mean_token_mean, seq_mean_token_sum, seq_mean_token_sum_norm,
                                       token_mean)
from trainer.losses.advantages import grpo_advantages, rloo_advantages
from trainer.losses.returns import (TokenRewards, discounted_returns, gae, gae_advantages, reinforce_plus_plus,
                                    reinforce_plus_plus_baseline, sequence_returns, token_level_rewards, whiten)
from trainer.losses.kl import kl_k1, kl_k2, kl_k3
from trainer.losses.config import LossConfig
from trainer.losses.policy import PolicyLossOutput, cispo_loss, gspo_loss, importance_weighted_pg_loss, ppo_clip_loss
from trainer.losses.correction import rollout_weights
from trainer.losses.value import value_loss
from trainer.losses.loss import rl_loss

__all__ = ["ADVANTAGES", "AGGREGATIONS", "KL_ESTIMATORS", "POLICY_LOSSES", "LossConfig", "PolicyLossOutput", "Segments",
           "TokenRewards", "cispo_loss", "discounted_returns", "gae", "gae_advantages", "grpo_advantages", "gspo_loss",
           "importance_weighted_pg_loss", "kl_k1", "kl_k2", "kl_k3", "lookup", "ppo_clip_loss", "register",
           "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rl_loss", "rloo_advantages", "rollout_weights",
           "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm", "sequence_returns", "token_level_rewards",
           "token_mean", "value_loss", "whiten"]
