"""The four registries of RL pieces (advantage, policy_loss, kl_estimator, aggregation): pure functions
registered by name; `LossConfig` names the ones `rl_loss` combines, so a new variant is a new registered
function, not a new flag."""
from __future__ import annotations

from collections.abc import Callable
from torch import Tensor

ADVANTAGES: dict[str, Callable[..., Tensor]] = {}
"""name -> an estimator. Outcome-level ones (`level` "outcome": grpo, rloo): fn(rewards [G * n] or [G, n],
group_size, **options) -> advantages, same shape. Token-level ones (`level` "token": reinforce_plus_plus,
reinforce_plus_plus_baseline, gae; trainer/losses/returns.py): fn(TokenRewards, **options) -> (advantages [N],
returns [N])."""
POLICY_LOSSES: dict[str, Callable[..., tuple]] = {}
"""name -> fn(logp, old_logp, advantages, config, *, mask, segments) -> PolicyLossOutput (trainer/losses/policy.py);
tensors [B, T] or packed [N] with `segments` (a sequence-level loss reads mask and segments; token ones ignore them)."""
KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {}
"""name -> fn(logp, ref_logp) -> per-token estimate of KL(pi || ref), all [B, T]."""
AGGREGATIONS: dict[str, Callable[..., Tensor]] = {}
"""name -> fn(values, mask bool, segments=None) -> scalar; values, mask [B, T] (segments None) or
packed [N] with `segments`."""

_REGISTRIES: dict[str, dict[str, Callable]] = {
    "advantage": ADVANTAGES, "policy_loss": POLICY_LOSSES,
    "kl_estimator": KL_ESTIMATORS, "aggregation": AGGREGATIONS,
}


def register(kind: str, name: str) -> Callable[[Callable], Callable]:
    """Decorator adding a function to the `kind` registry under `name` (a name is registered once)."""
    registry = _registry(kind)
    if name in registry:
        raise ValueError(f"{kind} {name!r} is already registered (by {registry[name].__qualname__})")

    def deco(fn: Callable) -> Callable:
        registry[name] = fn
        return fn
    return deco


def lookup(kind: str, name: str) -> Callable:
    """The function registered as `name` in the `kind` registry; ValueError lists the known names."""
    registry = _registry(kind)
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}, expected one of {sorted(registry)}")
    return registry[name]


def _registry(kind: str) -> dict[str, Callable]:
    if kind not in _REGISTRIES:
        raise ValueError(f"unknown registry kind {kind!r}, expected one of {sorted(_REGISTRIES)}")
    return _REGISTRIES[kind]
