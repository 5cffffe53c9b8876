"""`DriverConfig`: the rollout driver's settings (rl/episodes/driver.py), the RL run's `rollout` config group."""
from __future__ import annotations

from dataclasses import dataclass

from rollout.sampling import SamplingParams


@dataclass(frozen=True, kw_only=True)
class DriverConfig:
    """The rollout driver's settings: the RL run's `rollout` config group (the engine's own are the
    `engine` group, rollout/engine_config.py)."""
    groups_per_iteration: int = 16
    """New prompt groups started each iteration (each of algo.group_size trajectories), over all ranks
    together: rank r generates the groups g with g % world == r."""
    max_new_tokens: int | None = 4
    """Tokens per policy turn at most (each turn of a multi-turn episode gets this many); null = the
    task's answer length (its `answer_tokens`; the scored task's from its labels: rl/envs/tasks/scored.py),
    resolved when the run config is composed."""
    temperature: float = 1.0
    """Sampling temperature; only 1.0 trains for now (the trainer scores at T = 1)."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = 0
    """Sample among the k most likely tokens; 0 = all."""
    max_concurrency: int | None = None
    """Requests in flight per rank (each rank's engine): None = the dispatcher's auto-throttle, or a
    positive integer that pins the limit."""
    budget_tokens: int | None = None
    """Partial rollouts: generated tokens per iteration, over all ranks (each rank stops at its share,
    ceil(budget_tokens / world)), after which unfinished trajectories are paused and carried over;
    None = no token budget."""
    budget_seconds: float | None = None
    """Partial rollouts: rollout seconds per iteration (wall clock, the same on every rank); None = no
    time budget."""
    max_drop_fraction: float = 0.5
    """Circuit breaker (rl/run/loop.py): the run stops with an error when more than this share of
    an iteration's trajectories were dropped (over-length, tokenizer or environment errors, timeouts)."""
    partial_resume: str = "recompute"
    """How a carried-over trajectory continues: "recompute" (its prefix is recomputed under the new
    weights) or "kv" (the kept, stale KV; parked in the host KV pool over the train phase, so an RL
    run needs engine.host_pool_mb > 0 or memory.release_pool_in_train=false)."""

    max_groups_in_flight: int | None = None
    """Partial rollouts: new groups start only while fewer than this many groups (over all ranks) are
    unfinished, carried over or new; None = groups_per_iteration new groups every iteration (then a
    budget below what an iteration samples lets the carry-over grow without bound)."""
    max_staleness: int | None = None
    """KV older than this many policy versions at the next rollout is not kept across iterations:
    prefix entries are dropped and parked partial rollouts recomputed (rollout/kv/host_spill.py, when
    the host pool goes to NVMe between rollouts); None = no limit."""

    stagger_lead: int = 0
    """Divided rollout: this many members of each group start first, the others when the leaders' first
    request ends (their first turn), so that the leaders have generated text the later members' suffix
    proposals can copy (engine.speculative=suffix); 0 = every member starts together."""

    def __post_init__(self) -> None:
        if isinstance(self.stagger_lead, bool) or not isinstance(self.stagger_lead, int) or self.stagger_lead < 0:
            raise ValueError(f"stagger_lead={self.stagger_lead!r}, expected an integer >= 0 (0: no stagger)")
        if self.max_groups_in_flight is not None and (isinstance(self.max_groups_in_flight, bool)
                                                      or self.max_groups_in_flight < 1):
            raise ValueError(f"max_groups_in_flight={self.max_groups_in_flight!r}, expected an integer >= 1 or null")
        if self.max_staleness is not None and (isinstance(self.max_staleness, bool) or self.max_staleness < 1):
            raise ValueError(f"max_staleness={self.max_staleness!r}, expected an integer >= 1 (KV reused in the next "
                             f"iteration is one version old) or null (no limit)")
        if self.groups_per_iteration < 1 or (self.max_new_tokens is not None and self.max_new_tokens < 1):
            raise ValueError(f"groups_per_iteration={self.groups_per_iteration} and max_new_tokens="
                             f"{self.max_new_tokens} must be >= 1")
        if not 0 <= self.max_drop_fraction <= 1:
            raise ValueError(f"max_drop_fraction={self.max_drop_fraction}, expected in [0, 1]")
        if self.max_concurrency is not None and (isinstance(self.max_concurrency, bool) or self.max_concurrency < 1):
            raise ValueError(f"max_concurrency={self.max_concurrency!r}, expected an integer >= 1 or null "
                             f"(the dispatcher's auto-throttle)")
        if self.budget_tokens is not None and self.budget_tokens < 1:
            raise ValueError(f"budget_tokens={self.budget_tokens}, expected >= 1 or null (no budget)")
        if self.budget_seconds is not None and not self.budget_seconds > 0:
            raise ValueError(f"budget_seconds={self.budget_seconds}, expected > 0 or null (no budget)")
        # the sampler's own checks, at construction rather than at the first request
        SamplingParams(max_new_tokens=self.max_new_tokens or 1, temperature=self.temperature, top_p=self.top_p,
                       top_k=self.top_k)
        if self.temperature != 1.0:
            # The engine's behaviour logprobs are log softmax(logits / T); the trainer scores at T = 1.
            raise ValueError(f"temperature={self.temperature}: only 1.0 is supported for training for now "
                             f"(the trainer's logprobs are not temperature-scaled yet)")
        if self.partial_resume not in ("recompute", "kv"):
            raise ValueError(f"partial_resume={self.partial_resume!r}, expected 'recompute' or 'kv'")
