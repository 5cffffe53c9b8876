"""A trajectory of the rollout: one conversation of an episode, token by token (rl/episodes/driver.py builds it)."""
from __future__ import annotations

from dataclasses import dataclass, field

from rl.episodes.runner import TurnOutcome
from rollout.request import SampleOutput


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
    truncated: bool = False
    """The last answer ended at its token limit (finish_reason "length": rollout.max_new_tokens or the
    engine's max_model_len), not at a stop token."""

    @property
    def num_generated_in_turn(self) -> int:
        return len(self.tokens) - self.turn_start

    def append_sample(self, sample: SampleOutput) -> int:
        """This turn's tokens from the engine (sampled by the policy: trained on, with their behaviour
        logprobs and versions). Returns how many."""
        self.tokens += sample.tokens
        self.policy += [True] * len(sample.tokens)
        self.logprobs += sample.logprobs
        self.versions += sample.versions
        self.truncated = sample.finish_reason == "length"
        return len(sample.tokens)

    def end_turn(self, answer: str, turn: TurnOutcome) -> bool:
        """The finished turn's `answer` and its outcome: the reward and its components summed, the verdict
        kept; unless the episode ends there, the observation appended (given tokens: not trained on) and
        the next turn begun at a turn boundary. True when another turn follows."""
        self.answers.append(answer)
        self.reward += turn.reward
        for name, value in turn.components.items():
            self.components[name] = self.components.get(name, 0.0) + float(value)
        if turn.is_correct is not None:
            self.is_correct = bool(turn.is_correct)
        if turn.last:
            return False
        self.tokens += turn.observation
        self.policy += [False] * len(turn.observation)
        self.logprobs += [0.0] * len(turn.observation)
        self.versions += [-1] * len(turn.observation)
        self.turn_boundaries.append(len(self.tokens))
        self.turn_start = len(self.tokens)
        return True
