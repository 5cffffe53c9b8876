"""A trajectory of the rollout: one conversation of an episode, token by token (rl/episodes/driver.py builds it)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Trajectory:
    traj_id: str
    group_id: int
    member: int
    tokens: list[int]
    """The whole conversation: prompt, answers, observations (and a partial answer while paused)."""
    policy: list[bool]
    """Per token: sampled by the policy (trained on) or given (prompt, observation)."""
    logprobs: list[float]
    """Per token: behaviour logprob of policy tokens, 0.0 elsewhere."""
    versions: list[int]
    """Per token: policy version that sampled it, -1 elsewhere."""
    turn_start: int
    """Index in `tokens` where the current turn's answer begins."""
    answers: list[str] = field(default_factory=list)
    """Texts of the finished turns' answers (replayed into a fresh environment on resume)."""
    turn_boundaries: list[int] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    request_id: str | None = None
    """The paused engine request holding this trajectory's KV (partial_resume="kv")."""
    row_index: int | None = None
    """The group's data row (its global index in the RowSampler's order); None without data."""
    components: dict[str, float] = field(default_factory=dict)
    """Named reward parts (StepResult.components) summed over the turns."""
    is_correct: bool | None = None
    """The last turn's StepResult.is_correct: None when the environment did not say."""

    @property
    def num_generated_in_turn(self) -> int:
        return len(self.tokens) - self.turn_start
