"""The two layouts of per-token tensors (padded [B, T], packed [N] with `Segments`) and the reductions over
valid tokens (registry kind "aggregation": DAPO, arXiv:2503.14476 §3.3, and verl's `loss_agg_mode`)."""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from trainer.losses.registry import register


class Segments(NamedTuple):
    """The packed layout's sequences: row i of an [N] tensor belongs to sequence `ids[i]`."""

    ids: Tensor
    """[N] int64, on the rows' device: each row's sequence, in [0, count)."""
    count: int
    """Number of sequences (some may own no valid row)."""
    whole_tokens: Tensor | None = None
    """[count] valid tokens of each *whole* sequence when these rows are only part of it (context
    parallelism: a sequence's rows are split over ranks); None = the rows hold whole sequences. The
    aggregations divide by these counts, so the ranks' partial losses sum to the whole one."""

    def tokens(self, mask: Tensor) -> Tensor:
        """[count] each sequence's valid-token count: `whole_tokens`, or counted from `mask` [N]."""
        if self.whole_tokens is not None:
            return self.whole_tokens.to(torch.float32)
        return per_sequence(mask.to(torch.float32), self)

    @staticmethod
    def of_rows(shape: torch.Size, device: torch.device) -> "Segments":
        """The padded layout [B, T] seen as packed: row-major, row b of the padding is sequence b."""
        return Segments(torch.arange(shape[0], device=device).repeat_interleave(shape[1]), shape[0])


def packed(values: Tensor, mask: Tensor, segments: Segments | None) -> tuple[Tensor, Tensor, Segments]:
    """(values [N], mask [N], segments) from either layout (a padded one is flattened: a view)."""
    if segments is None:
        segments = Segments.of_rows(values.shape, values.device)
        return values.reshape(-1), mask.reshape(-1), segments
    return values, mask, segments


def per_sequence(x: Tensor, segments: Segments) -> Tensor:
    """[count]: the sum of each sequence's rows of x [N]."""
    return torch.zeros(segments.count, dtype=x.dtype, device=x.device).index_add_(0, segments.ids, x)



@register("aggregation", "token-mean")
def token_mean(values: Tensor, mask: Tensor, segments: Segments | None = None) -> Tensor:
    """Sum over valid tokens / number of valid tokens in the batch: every token weighs the same (DAPO's
    token-level loss), so long responses are not down-weighted. Either layout -> scalar.

    The count is this call's (its whole sequences' under context parallelism); a batch split into
    micro-batches must rescale by its share of tokens.
    """
    if segments is not None and segments.whole_tokens is not None:
        return torch.where(mask, values, 0.0).sum() / segments.whole_tokens.sum().clamp_min(1)
    return torch.where(mask, values, 0.0).sum() / mask.sum()


@register("aggregation", "seq-mean-token-mean")
def seq_mean_token_mean(values: Tensor, mask: Tensor, segments: Segments | None = None) -> Tensor:
    """Mean over sequences of each sequence's token mean (the original GRPO objective): every sequence
    weighs the same. Sequences without a valid token are left out of the mean. Either layout -> scalar."""
    values, mask, segments = packed(values, mask, segments)
    num_tokens = segments.tokens(mask).to(values.dtype)  # [S]
    has_tokens = num_tokens > 0  # [S]
    per_seq = per_sequence(torch.where(mask, values, 0.0), segments) / num_tokens.clamp_min(1)  # [S]
    return torch.where(has_tokens, per_seq, 0.0).sum() / has_tokens.sum()  # no boolean indexing: no sync


@register("aggregation", "seq-mean-token-sum")
def seq_mean_token_sum(values: Tensor, mask: Tensor, segments: Segments | None = None) -> Tensor:
    """Mean over sequences of each sequence's token sum. Sequences without a valid token are left out
    of the mean. Either layout -> scalar."""
    values, mask, segments = packed(values, mask, segments)
    has_tokens = segments.tokens(mask) > 0  # [S]
    return torch.where(has_tokens, per_sequence(torch.where(mask, values, 0.0), segments), 0.0).sum() / has_tokens.sum()


@register("aggregation", "seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(values: Tensor, mask: Tensor, segments: Segments | None = None, *,
                            norm_tokens: int | None = None) -> Tensor:
    """Dr. GRPO's aggregation (arXiv:2503.20783 §3.1; verl's "seq-mean-token-sum-norm"): the sum over
    valid tokens / (sequences with a valid token x `norm_tokens`), a constant normaliser (the generation
    budget) in place of each response's length, so no length bias. `norm_tokens` None = the longest
    sequence's rows in this call (verl's default, mask.shape[-1]). Either layout -> scalar."""
    values, mask, segments = packed(values, mask, segments)
    has_tokens = segments.tokens(mask) > 0  # [S]
    if norm_tokens is None:
        norm_tokens = int(torch.bincount(segments.ids, minlength=segments.count).max()) if segments.count else 1
    return torch.where(mask, values, 0.0).sum() / (has_tokens.sum() * norm_tokens)
