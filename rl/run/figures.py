"""The run's figures for humans: the timed reference stream and the end-of-run summary.

`TimedStreamedReference` is the streamed KL reference (trainer/ref_stream.py) that also times each
forward; its `figures()` go into every metrics line (a tracker probe). `run_summary` reads the run's
files (metrics.jsonl, phases.jsonl, the warm-up's record) into summary.json's flat numbers:

- the reward: first, final (mean of the last tenth of the iterations, at least 3), and with a
  warm-up the reward before and after it, what each part gained and the warm-up's share;
- the mechanisms: prefix-cache hit tokens and hit fraction, host KV pool bytes (its size, the most
  parked partial rollouts held), trajectories carried over (summed over iterations, at most, and
  the iterations that carried any), optimizer bytes spilled to NVMe (on
  disk at most, written and read in all) and the reference stream's seconds and bytes.
Only the figures a run logged appear (a run without a prefix cache has no hit figures).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from rl.run.tracking import read_jsonl
from trainer.losses import lookup
from trainer.ref_stream import StreamedReference


class TimedStreamedReference(StreamedReference):
    """A StreamedReference whose `logprobs` calls are counted and timed (wall seconds: the stream's
    copies and the forward together; `stats.load_wait_s` is the part the copies were not hidden)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0
        self.last_seconds = 0.0
        self._reported = 0

    def logprobs(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = super().logprobs(*args, **kwargs)
        self.last_seconds, self.calls = time.perf_counter() - t0, self.calls + 1
        return out

    def figures(self) -> dict[str, float]:
        """The last call's figures, once (an iteration that trained nothing streamed nothing: {})."""
        if self.calls == self._reported:
            return {}
        self._reported = self.calls
        return {"ref_stream_s": self.last_seconds, "ref_stream_wait_s": self.stats.load_wait_s,
                "ref_stream_bytes": float(self.stats.bytes_loaded)}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def reward_figures(records: list[dict], warmup: dict | None) -> dict[str, float]:
    """Reward figures of the RL iterations `records` (metrics.jsonl) and the warm-up's record."""
    rewards = [r["reward_mean"] for r in records]
    tail = records[-max(3, len(records) // 10):]
    out = {"iterations": float(len(records)), "reward_first": rewards[0],
           "reward_last3_mean": _mean(rewards[-3:]), "reward_final": _mean([r["reward_mean"] for r in tail]),
           "correct_first": records[0].get("reward_correct_frac", float("nan")),
           "correct_last3_mean": _mean([r.get("reward_correct_frac", 0.0) for r in records[-3:]]),
           "correct_final": _mean([r.get("reward_correct_frac", 0.0) for r in tail]),
           "rollout_tok_s_mean": _mean([r.get("rollout_tok_s", 0.0) for r in records])}
    if warmup is not None:
        before, after, final = warmup["reward_before"], warmup["reward_after"], out["reward_final"]
        gain = final - before
        out.update(warmup_steps=float(len(warmup["steps"])), reward_before_warmup=before,
                   reward_after_warmup=after, warmup_gain=after - before, rl_gain=final - after,
                   warmup_share_of_gain=(after - before) / gain if gain > 0 else float("nan"),
                   warmup_seconds=warmup["seconds"])
    return out


def mechanism_figures(records: list[dict], phases: list[dict]) -> dict[str, float]:
    """The memory mechanisms' figures from metrics.jsonl `records` and phases.jsonl `phases`."""
    out: dict[str, float] = {}
    sums = ("prefix_hit_tokens", "prefix_stale_hit_tokens", "host_pages_written_back", "host_pages_prefetched",
            "host_pages_prefetched_ahead", "host_hit_tokens", "reprefilled_tokens", "trajectories_carried", "ref_stream_s", "ref_stream_wait_s", "ref_stream_bytes")
    for key in sums:
        values = [r[key] for r in records if key in r]
        if values:
            out[f"{key}_total"] = float(sum(values))
    carried = [r["trajectories_carried"] for r in records if "trajectories_carried" in r]
    if carried:
        out["iterations_with_carry_over"] = float(sum(c > 0 for c in carried))
        out["trajectories_carried_max"] = float(max(carried))
    for key in ("prefix_hit_frac", "stale_token_frac", "ref_stream_s", "prefetch_hidden_fraction"):
        values = [r[key] for r in records if key in r]
        if values:
            out[f"{key}_mean"] = _mean(values)

    def peak(memory_key: str) -> float:
        return float(max((p["memory"].get(memory_key, 0) for p in phases), default=0))

    out.update(host_pool_bytes=peak("host_pool"), host_parked_bytes_max=peak("host_parked"),
               host_reference_bytes=peak("host_reference"), spilled_bytes_max=peak("disk_spilled"))
    for phase, key in (("offload", "spill_written_bytes"), ("restore", "spill_read_bytes"),
                       ("host_out", "host_pool_spilled_bytes"), ("host_in", "host_pool_restored_bytes")):
        moved = [p["bytes_moved"] for p in phases if p["phase"] == phase]
        if moved:
            out[key] = float(sum(moved))
            out[f"seconds_{phase}_total"] = float(sum(p["seconds"] for p in phases if p["phase"] == phase))
    return out


def run_summary(run_dir: str | Path, warmup: dict | None = None, ceiling: float | None = None) -> dict[str, float]:
    """summary.json's figures (see the module docstring; `ceiling`: the task's best constant-answer
    reward, as `constant_answer_ceiling`); {} before any iteration logged a reward."""
    run_dir = Path(run_dir)
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("reward_mean") == r.get("reward_mean")]
    if not records:
        return {}
    out = reward_figures(records, warmup)
    if ceiling is not None:
        out["constant_answer_ceiling"] = ceiling
    return {**out, **mechanism_figures(records, read_jsonl(run_dir / "phases.jsonl"))}


ROLLOUT_STATISTICS = ("response_length/mean", "response_length/max", "response_length/clip_frac", "prompt_length/mean",
                      "reward/std", "groups_zero_std_frac", "advantage/mean", "advantage/std")
"""`rollout_statistics`' keys: computed from every rank's trajectories after the merge (global already)."""


def rollout_statistics(groups: list[tuple[int, list[tuple[float, int, int, int]]]], max_new_tokens: int,
                       advantage: str) -> dict[str, float]:
    """What RL users read first about an iteration's finished trajectories, from each group's members as
    (reward, response tokens, first-prompt tokens, longest turn's tokens), over all ranks:
    `response_length/mean|max`, `response_length/clip_frac` (a turn stopped at max_new_tokens),
    `prompt_length/mean`, `reward/std`, `groups_zero_std_frac` (groups whose members all scored alike: no
    signal for a group advantage), `advantage/mean|std` (the run's estimator). {} without trajectories."""
    members = [m for _, ms in groups for m in ms]
    if not members:
        return {}
    rewards = torch.tensor([m[0] for m in members], dtype=torch.float64, device="cpu")  # host figures
    response = torch.tensor([m[1] for m in members], dtype=torch.float64, device="cpu")
    estimator = lookup("advantage", advantage)
    out = {}
    if getattr(estimator, "level", "outcome") == "outcome":  # token-level ones: the train phase reports them
        advs = torch.cat([estimator(torch.tensor([m[0] for m in ms], dtype=torch.float32, device="cpu"), len(ms))
                          for _, ms in groups])
        out = {"advantage/mean": advs.double().mean().item(), "advantage/std": advs.double().std(unbiased=False).item()}
    return out | {"response_length/mean": response.mean().item(), "response_length/max": response.max().item(),
            "response_length/clip_frac": sum(m[3] >= max_new_tokens for m in members) / len(members),
            "prompt_length/mean": sum(m[2] for m in members) / len(members),
            "reward/std": rewards.std(unbiased=False).item(),
            "groups_zero_std_frac": sum(len({m[0] for m in ms}) == 1 for _, ms in groups) / len(groups)}


def trajectory_lengths(traj) -> tuple[int, int, int]:
    """(response tokens, first-prompt tokens, longest turn's tokens) of a trajectory: its policy tokens, the
    tokens before the first of them, the longest run of them."""
    longest = run = 0
    for sampled in traj.policy:
        run = run + 1 if sampled else 0
        longest = max(longest, run)
    first = next((i for i, sampled in enumerate(traj.policy) if sampled), len(traj.policy))
    return sum(traj.policy), first, longest
