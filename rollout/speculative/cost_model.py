"""What a step of this engine costs, fitted to its own measured steps: when speculation pays.

A step of n decoding sequences, S of which verify proposals in V rows, takes about
    seconds = fixed + decode_row * n + verify_row * V + verify_seq * S
(the fixed part: launching every layer, reading the weights, the engine's Python; a row: its share of
the matmuls and attention; a verifying sequence: its proposals looked up, position pages, the acceptance
rule, the rollback). `StepCostModel.observe` records each step's (n, V, S, seconds); `fit` solves
the least squares over the last `window` steps, pulled toward the prior (the configured constant
`speculative_row_cost`: decode_row = verify_row = prior x fixed, verify_seq = VERIFY_ROWS x that) by a
ridge of `prior_weight` steps, so
that a run of plain steps alone (V = 0) leaves verify_row at the prior instead of undetermined; and
verify_row is at least VERIFY_FLOOR x decode_row (a verification row computes what a decode row does).

A kept proposal saves a decode row and its share of the fixed part, decode_row + fixed / n; a verified
proposal costs verify_row, and the verification verify_seq (`overhead_rows`: in verification rows).
`saved_per_kept(n)` is their ratio, what `Speculator.worth` weighs against each proposal's chance of
being kept: with one batch size the other way round, the break-even batch
size (`break_even`) is where an acceptance a stops paying for one proposal.
"""
from __future__ import annotations

from collections import deque

import torch

VERIFY_ROWS = 2.0
"""The prior of what verifying a sequence costs besides its rows, in verification rows (planning,
acceptance, position pages: ~0.1 ms of Python on CPU, about two rows of the tiny model); fitted as
verify_seq once steps are measured."""

FIRST_FITS_EVERY = 16
"""Steps between fits until `refit_every` steps are in the window."""
VERIFY_FLOOR = 1.0
"""The fitted verification row is at least this share of the fitted decode row: a verification row does
what a decode row does (its layers, its logits and the sampler's softmax) and more (the KDA state of its
position written to a position page, the acceptance rule)."""


class StepCostModel:
    """The fitted step cost (module docstring). `prior_row_cost`: a row's cost as a share of the fixed part
    before any step is measured."""

    def __init__(self, prior_row_cost: float, window: int = 512, prior_weight: float = 8.0, refit_every: int = 128):
        self.prior_row_cost, self.window, self.prior_weight, self.refit_every = prior_row_cost, window, prior_weight, refit_every
        self.steps: deque[tuple[int, int, int, float]] = deque(maxlen=window)
        self.fixed, self.decode_row, self.verify_row = 1.0, prior_row_cost, prior_row_cost  # units of `fixed` until fitted
        self.verify_seq = VERIFY_ROWS * prior_row_cost
        self._since_fit = 0

    @property
    def overhead_rows(self) -> float:
        """A verification's cost besides its rows, in verification rows."""
        return self.verify_seq / self.verify_row

    def observe(self, decode_rows: int, verify_rows: int, seconds: float, verifying: int = 0) -> None:
        """One step: its decoding sequences (their one row each), its verification rows, its wall seconds,
        and how many sequences verified in it."""
        if decode_rows + verify_rows <= 0 or not seconds > 0:
            return
        self.steps.append((decode_rows, verify_rows, verifying, seconds))
        self._since_fit += 1
        if self._since_fit >= (self.refit_every if len(self.steps) >= self.refit_every else FIRST_FITS_EVERY):
            self.fit()  # every FIRST_FITS_EVERY steps at first, then every refit_every (a fit costs ~1 ms)

    def fit(self) -> tuple[float, float, float]:
        """(fixed, decode_row, verify_row) in seconds by ridge least squares (module docstring); verify_seq
        is fitted with them."""
        self._since_fit = 0
        if not self.steps:
            return self.fixed, self.decode_row, self.verify_row
        data = torch.tensor(self.steps, dtype=torch.float64)
        x = torch.cat([torch.ones(len(data), 1, dtype=torch.float64), data[:, :3]], dim=1)
        y = data[:, 3]
        # The prior in seconds: the fixed part is what the smallest measured steps take
        fixed0 = float(y.min()) / (1.0 + self.prior_row_cost * float(data[:, 0].min()))
        row0 = self.prior_row_cost * fixed0
        prior = torch.tensor([fixed0, row0, row0, VERIFY_ROWS * row0], dtype=torch.float64)
        scale = x.abs().mean(dim=0).clamp_min(1.0)  # the ridge in each column's own units
        ridge = torch.diag(self.prior_weight * scale.square())
        theta = torch.linalg.solve(x.T @ x + ridge, x.T @ y + ridge @ prior)
        fixed = max(float(theta[0]), 1e-9)
        decode_row = max(float(theta[1]), 0.0)
        # below VERIFY_FLOOR of a decode row the fit is noise (a few verification steps among many), and
        # a cheap verification row would make every batch size pay
        self.fixed, self.decode_row = fixed, decode_row
        self.verify_row = max(float(theta[2]), VERIFY_FLOOR * decode_row, 1e-12)
        self.verify_seq = max(float(theta[3]), 0.0)
        return self.fixed, self.decode_row, self.verify_row

    def saved_per_kept(self, num_seqs: int) -> float:
        """A kept proposal's saving, in verification rows: (decode_row + fixed / n) / verify_row."""
        return (self.decode_row + self.fixed / max(num_seqs, 1)) / self.verify_row

    def worth(self, acceptance: float, num_seqs: int, max_k: int) -> int:
        """The k in [0, max_k] with the largest expected saving sum_j a^j saved_per_kept - k - overhead_rows
        (0 when none is positive)."""
        saved = self.saved_per_kept(num_seqs)
        best_k, best, total, chance = 0, 0.0, -self.overhead_rows, 1.0
        for k in range(1, max_k + 1):
            chance *= acceptance
            total += chance * saved - 1.0
            if total > best:
                best_k, best = k, total
        return best_k

    def break_even(self, acceptance: float, max_k: int, largest: int = 4096) -> int:
        """The largest batch size at which proposals of this acceptance still pay (0: not even one sequence)."""
        n = 0
        while n < largest and self.worth(acceptance, n + 1, max_k) > 0:
            n += 1
        return n
