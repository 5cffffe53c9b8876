"""DAPO's dynamic sampling (arXiv:2503.14476 §3.2) at the rollout phase: a group whose members all have
the same reward gives every member advantage 0 under a group baseline (no gradient, only a smaller
batch), so it is dropped and more groups are rolled out, until rollout.groups_per_iteration groups with a
spread are kept over all ranks, or algo.filter_groups.max_rounds rounds ran (then the update trains what
it kept, and says so). The surplus of the last round is dropped too, in rank order, so the batch keeps
its size. Every round's groups count in the iteration's reward figures (what the policy scored), only
the kept ones train. The rounds' counts are summed over ranks at the round boundaries (no collective
inside a rollout)."""
from __future__ import annotations

from dataclasses import dataclass, field

from rl.episodes.driver import RolloutResult


@dataclass
class Sampled:
    """A filtered rollout: the kept groups (`result.groups`), every group rolled out (`scored`), metrics."""
    result: RolloutResult
    scored: list | None = None
    """Every group rolled out, for the reward figures; None = the kept ones."""
    metrics: dict[str, float] = field(default_factory=dict)


def has_spread(group) -> bool:
    """Whether the group's rewards differ (a group of one member never does)."""
    return len({t.reward for t in group}) > 1


def dynamic_sampling(p, first: RolloutResult) -> Sampled:
    """Rounds of rollouts after `first` until enough groups with a spread (module docstring). `p` is the
    loop's parts (driver, ranks, cfg)."""
    cfg = p.cfg
    target, rounds = cfg.rollout.groups_per_iteration, 1
    scored = list(first.groups)
    kept = [g for g in first.groups if has_spread(g)]
    errors = list(first.errors)
    while rounds < cfg.algo.filter_groups.max_rounds and p.ranks.sum([len(kept)])[0] < target:
        more = p.driver.rollout()
        rounds += 1
        scored += more.groups
        kept += [g for g in more.groups if has_spread(g)]
        errors += more.errors
        for key in ("rollout_tokens", "trajectories_finished", "trajectories_dropped"):
            if key in first.metrics and key in more.metrics:
                first.metrics[key] += more.metrics[key]
    counts = p.ranks.all_gather(len(kept)) if p.ranks.world > 1 else [len(kept)]
    before = sum(counts[:p.ranks.rank])
    total_kept, total_scored = sum(counts), p.ranks.sum([len(scored)])[0]
    mine = kept[:max(0, min(len(kept), target - before))]
    metrics = {"dynamic_sampling/rounds": float(rounds),
               "dynamic_sampling/drop_rate": 1 - total_kept / total_scored if total_scored else 0.0,
               "dynamic_sampling/surplus": float(max(0, total_kept - target)),
               "dynamic_sampling/short": float(max(0, target - total_kept))}
    return Sampled(RolloutResult(mine, first.metrics, errors), scored, metrics)
