"""Expert parallelism: a MoE layer's routed experts split over a group of ranks, every token sent to
its experts' ranks and back by all-to-all; everything else (embeddings, KDA, MLA, dense and shared
MLPs, routers) stays whole on every rank.

Rank r of an expert-parallel group of size P holds experts [r * E/P, (r + 1) * E/P) of every MoE
layer (`Experts.first`, `Experts.num_global`). A MoE layer under `ExpertParallel` (models/mlp.py
`MoE.forward`): route locally; sort the (token, slot) rows by expert (stably, as the one-rank
grouped path does, so rows reach their rank in the same order); exchange the per-rank row counts
(one all-to-all of P integers, read on the host: the split sizes); send the rows and their local
expert ids; run the local experts on what arrives; send the results back; weight and sum them into
their tokens in the one-rank order. Backward runs the two data all-to-alls the other way
(`all_to_all`, differentiable). So a token's output is the sum the one-rank layer forms, in the
same order: logits agree to fp32 rounding of the expert matmuls' batch shapes.

Lock-step: every rank of the group must enter every MoE layer's exchange, in the same order. A rank
without tokens joins with zero rows (`HybridLM.join_experts`: the MoE layers alone, chained so that
their backward runs in the layers' reverse order too). Who has work in an engine step is agreed by
`ExpertParallel.round` (one all-reduce of two counters): the engine runs a real or an empty step
while any rank of the group is busy, and a rank that is done waits in `round` until all are.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ExpertParallel:
    """This rank's place in its expert-parallel group: `rank` of `size`, over `group`."""

    group: dist.ProcessGroup | None
    rank: int
    size: int

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"expert-parallel rank {self.rank} of size {self.size}: expected 0 <= rank < size")

    @property
    def active(self) -> bool:
        """Whether the experts are split at all (size > 1)."""
        return self.size > 1

    def experts_of(self, num_experts: int) -> range:
        """The global expert indices this rank holds."""
        if num_experts % self.size:
            raise ValueError(f"{num_experts} experts cannot be split over {self.size} expert-parallel ranks: "
                             f"expected parallel.expert to divide the expert count")
        per = num_experts // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def max_count(self, count: int) -> int:
        """The largest `count` over the group (how many passes every rank must join)."""
        if not self.active:
            return count
        t = torch.tensor([count], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def round(self, busy: bool, unfinished: bool) -> tuple[bool, bool]:
        """One agreement step of the engine's lock-step: (some rank has a step to run, some rank
        has work left). Every rank calls it once per engine step, busy or not."""
        if not self.active:
            return busy, unfinished
        t = torch.tensor([int(busy), int(unfinished or busy)], dtype=torch.int64)
        dist.all_reduce(t, group=self.group)
        return bool(t[0]), bool(t[1])


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows (dim 0) with uneven splits; backward sends the gradient back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup | None
                ) -> torch.Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        return _exchange(x, recv, send, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.send, ctx.recv, ctx.group), None, None, None


def _exchange(x: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    out = x.new_empty(sum(recv), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


def all_to_all(x: torch.Tensor, recv: list[int], send: list[int], ep: ExpertParallel) -> torch.Tensor:
    """Rows of x [sum(send), ...] (send[r] of them to rank r, in rank order) -> the rows every rank
    sent here [sum(recv), ...]; differentiable in x."""
    return _AllToAll.apply(x, recv, send, ep.group)


def exchange_counts(send: torch.Tensor, ep: ExpertParallel) -> tuple[list[int], list[int]]:
    """Per-rank row counts to send [size] (int64) -> (rows to receive, rows to send) as host lists:
    the split sizes of the layer's data all-to-alls (one small all-to-all and one host read)."""
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send.contiguous(), group=ep.group)
    both = torch.stack([recv, send]).tolist()
    return both[0], both[1]
