"""A tool latency model: how long an agentic environment's tool call takes, drawn per call.

Real tools (code execution, search, a remote API) take seconds, and their latencies are right-skewed:
most calls are fast, a few take many times the median (a cold container, a slow page, a retry inside
the service). A log-normal distribution fits that shape with two knobs: `median_s`, the typical call,
and `sigma`, the spread in log space. The q-quantile is `median_s * exp(sigma * z_q)`, so with
median 0.3 s and sigma 1.0 half the calls take under 0.3 s, the 90th percentile is ~1.1 s and the 99th
~3.1 s; sigma 0 is a fixed latency. `max_s` caps the tail (a tool's own timeout).

A draw depends only on (`seed`, the episode seed, the trajectory's member index, the turn), through a
`random.Random` seeded with a string (hashed by SHA-512, so it is the same in every process and under any
PYTHONHASHSEED): never on the order calls are made in, so a run's latencies are the same however its
calls interleave. The rollout applies it in rl/episodes/env_calls.py: a step's result reaches the driver
`draw(...)` seconds after the step returned (rl/episodes/env_runner.py holds it meanwhile).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from statistics import NormalDist


def _number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


@dataclass(frozen=True, kw_only=True)
class ToolLatency:
    """A log-normal tool latency (module docstring); `median_s = 0` is no latency."""
    median_s: float = 0.0
    """The median latency of a call in seconds; 0 = none (every draw is 0)."""
    sigma: float = 1.0
    """The standard deviation of the latency's logarithm: 0 = always median_s; 1 = the 99th percentile near 10x it."""
    max_s: float | None = None
    """A cap on each draw in seconds; None = uncapped."""
    seed: int = 0
    """Mixed into every draw: two seeds give independent latencies for the same episodes."""

    def __post_init__(self) -> None:
        if not _number(self.median_s) or self.median_s < 0:
            raise ValueError(f"median_s={self.median_s!r}, expected a finite number of seconds >= 0 (0 = no latency)")
        if not _number(self.sigma) or self.sigma < 0:
            raise ValueError(f"sigma={self.sigma!r}, expected a finite number >= 0 (the log-space standard "
                             f"deviation; 0 = a fixed latency)")
        if self.max_s is not None and (not _number(self.max_s) or self.max_s <= 0):
            raise ValueError(f"max_s={self.max_s!r}, expected a finite number of seconds > 0, or None (no cap)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r}, expected an integer")

    @property
    def enabled(self) -> bool:
        """Calls are delayed at all (median_s > 0)."""
        return self.median_s > 0

    @property
    def mean_s(self) -> float:
        """The uncapped distribution's mean, median_s * exp(sigma^2 / 2); `max_s` is not accounted for
        (a cap makes the true mean lower)."""
        return self.median_s * math.exp(self.sigma ** 2 / 2)

    def quantile(self, q: float) -> float:
        """The latency below which a fraction `q` (0 < q < 1) of the draws fall, the cap applied."""
        if not 0 < q < 1:
            raise ValueError(f"q={q!r}, expected 0 < q < 1")
        return self._capped(self.median_s * math.exp(self.sigma * NormalDist().inv_cdf(q)))

    def draw(self, episode_seed: int, turn: int, member: int = 0) -> float:
        """The latency in seconds of the tool call that ends turn `turn` of member `member` of the episode
        seeded `episode_seed`: a function of (seed, episode_seed, member, turn) alone."""
        if not self.enabled:
            return 0.0
        rng = random.Random(f"tool-latency/{self.seed}/{episode_seed}/{member}/{turn}")
        return self._capped(self.median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0)))

    def _capped(self, seconds: float) -> float:
        return seconds if self.max_s is None else min(seconds, self.max_s)
