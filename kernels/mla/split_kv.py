"""Split-KV for paged MLA decode: how to cut each sequence's tokens into splits, the launch grids,
and the combine that merges the splits' partial results.

Decode has one query token per sequence, so a batch of a few long sequences gives few programs:
with one program per (sequence, head tile) most SMs would idle. Split-KV (flash-decoding,
Dao et al. 2023; FlashMLA's `get_mla_metadata`) cuts each sequence into `num_splits` contiguous
token ranges of `split_len` tokens; each (sequence, split, head tile) program writes its
normalised partial output and log-sum-exp, and a combine merges the splits exactly as one softmax
over their union (`merge_attention`'s formula, applied split after split).

Words: *tile* - the BLOCK_N = 64 tokens one loop step of the decode kernel reads; *granule* -
lcm(BLOCK_N, block_tokens) tokens, so a split starts on a tile and on a page boundary; a split
past a sequence's end holds no token: its partial is o = 0, lse = -inf (weight 0 in the merge).

Everything here that decides a launch is a pure function of host integers (`plan_splits`,
`decode_grid`, `combine_grid`): the engine's decode step must not wait for the device, so the plan
comes from `max_seq_len` (or the block table's capacity), never from `seq_lens`.
"""

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.mla.weights import merge_attention

# CUDA grid limits: x < 2^31, y and z <= 65535. Every grid here is one-dimensional (x).
MAX_GRID_X = 2**31 - 1
MAX_GRID_YZ = 65535
BLOCK_N = 64  # tokens per tile: one page when block_tokens == 64 (FlashMLA's block size)
MAX_BLOCK_H = 64  # heads per program: one program reads a sequence's latent rows for 64 heads
# FlashMLA's scheduler charges each split a fixed overhead of 5 blocks of 64 tokens (prologue,
# partial write and its share of the combine); we use the same figure in the cost model below.
SPLIT_OVERHEAD_TOKENS = 5 * 64
DEFAULT_NUM_SMS = 132  # H100 / H200 SXM; the launcher passes the device's own count on CUDA


@dataclass(frozen=True)
class SplitPlan:
    """How one decode launch is cut. Splits are [s * split_len, (s + 1) * split_len) except the
    last, which runs to the sequence's end (so a too-small max_seq_len costs time, not tokens)."""

    batch: int  # sequences
    num_heads: int  # query heads
    num_splits: int  # token ranges per sequence (>= 1)
    split_len: int  # tokens per split, a multiple of the granule
    block_h: int  # heads per program (power of two in [16, 64])

    @property
    def num_head_tiles(self) -> int:
        return -(-self.num_heads // self.block_h)

    @property
    def num_programs(self) -> int:
        return self.batch * self.num_splits * self.num_head_tiles


def head_tile(num_heads: int) -> int:
    """Heads per program: 64, or max(16, next power of two) for fewer heads (tl.dot needs >= 16)."""
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")
    return min(MAX_BLOCK_H, max(16, triton.next_power_of_2(num_heads)))


def granule(block_tokens: int) -> int:
    """Split boundaries are multiples of this: whole tiles and whole pages."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    return math.lcm(BLOCK_N, block_tokens)


@lru_cache(maxsize=1024)
def plan_splits(batch: int, num_heads: int, max_seq_len: int, block_tokens: int, *,
                num_sms: int = DEFAULT_NUM_SMS, max_splits: int = 256, num_splits: int | None = None) -> SplitPlan:
    """Chooses num_splits and split_len for a decode of `batch` sequences of <= max_seq_len tokens.

    Cost model (host integers only, no device read): every sequence is taken as max_seq_len long
    and one program runs per SM at a time (a 64-head tile of 512-wide latents fills an SM's shared
    memory); time ~ waves * (split_len + SPLIT_OVERHEAD_TOKENS), waves = ceil(programs / num_sms).
    The smallest cost over 1..max_splits splits wins (ties: fewer splits). num_splits forces the
    count (tests): split_len is then the granule multiple that covers max_seq_len in that many
    splits, and trailing splits may hold no token at all. Cached: the engine calls it per layer.
    """
    for name, value, low in (("batch", batch, 1), ("num_heads", num_heads, 1), ("max_seq_len", max_seq_len, 1),
                             ("num_sms", num_sms, 1), ("max_splits", max_splits, 1)):
        if value < low:
            raise ValueError(f"plan_splits: {name} must be >= {low}, got {value}")
    step = granule(block_tokens)
    num_granules = -(-max_seq_len // step)
    block_h = head_tile(num_heads)
    if num_splits is not None:
        if num_splits < 1:
            raise ValueError(f"plan_splits: num_splits must be >= 1, got {num_splits}")
        return SplitPlan(batch, num_heads, num_splits, step * -(-num_granules // num_splits), block_h)
    base = batch * -(-num_heads // block_h)  # programs per split
    best = None
    for splits in range(1, min(max_splits, num_granules) + 1):
        split_len = step * -(-num_granules // splits)
        used = -(-max_seq_len // split_len)  # splits that hold tokens at this length
        if used != splits:
            continue  # the same cut as a smaller count
        cost = -(-base * splits // num_sms) * (split_len + SPLIT_OVERHEAD_TOKENS)
        if best is None or cost < best[0]:
            best = (cost, splits, split_len)
    _, splits, split_len = best
    return SplitPlan(batch, num_heads, splits, split_len, block_h)


def decode_grid(plan: SplitPlan) -> tuple[int]:
    """One axis over (sequence, split, head tile), head tile fastest (the programs that share a
    sequence's rows run side by side, so the second head tile finds them in L2)."""
    programs = plan.num_programs
    if programs > MAX_GRID_X:
        raise ValueError(f"decode grid of {programs} programs (batch {plan.batch} x splits {plan.num_splits} x "
                         f"head tiles {plan.num_head_tiles}) exceeds CUDA's grid x limit {MAX_GRID_X}")
    return (programs,)


def combine_grid(batch: int, num_heads: int) -> tuple[int]:
    """One program per (sequence, head) row."""
    if batch * num_heads > MAX_GRID_X:
        raise ValueError(f"combine grid of {batch} x {num_heads} rows exceeds CUDA's grid x limit {MAX_GRID_X}")
    return (batch * num_heads,)


@triton.jit
def _merge(o_a, lse_a, o_b, lse_b):
    """merge_attention's formula on one row: o_* [BLOCK_DC], lse_* scalars (lse_b finite)."""
    lse = tl.maximum(lse_a, lse_b)
    lse += tl.log(tl.exp(lse_a - lse) + tl.exp(lse_b - lse))  # logaddexp
    return o_a * tl.exp(lse_a - lse) + o_b * tl.exp(lse_b - lse), lse


@triton.jit
def combine_kernel(
    part_o_ptr,  # [B, S, H, DC] fp32 contiguous: each split's normalised output
    part_lse_ptr,  # [B, S, H] fp32 contiguous; -inf for a split with no token
    seq_lens_ptr,  # [B]
    o_ptr,  # [B, H, DC] contiguous, the output dtype
    lse_ptr,  # [B, H] fp32
    H,
    num_splits,
    split_len,
    DC: tl.constexpr,
    BLOCK_DC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # b * H + h
    b = row // H
    dc = tl.arange(0, BLOCK_DC)
    dc_mask = dc < DC
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
    # Splits at or past the end hold nothing (lse -inf, weight 0): they are not even read.
    num_used = tl.minimum((seq_len + split_len - 1) // split_len, num_splits)
    first = b * num_splits * H + row % H  # partial row of split 0, which always holds token 0
    o = tl.load(part_o_ptr + first * DC + dc, mask=dc_mask, other=0.0)  # [BLOCK_DC]
    lse = tl.load(part_lse_ptr + first)
    for s in range(1, num_used):
        part = first + s * H
        o_s = tl.load(part_o_ptr + part * DC + dc, mask=dc_mask, other=0.0)
        o, lse = _merge(o, lse, o_s, tl.load(part_lse_ptr + part))
    tl.store(o_ptr + row * DC + dc, o.to(o_ptr.dtype.element_ty), mask=dc_mask)
    tl.store(lse_ptr + row, lse)


def combine_splits_triton(part_o: Tensor, part_lse: Tensor, seq_lens: Tensor, split_len: int, out: Tensor,
                          lse: Tensor) -> None:
    """Merges part_o [B, S, H, Dc] fp32 / part_lse [B, S, H] into out [B, H, Dc] (its dtype) and
    lse [B, H] fp32, in place. Reads only the splits that hold tokens of each sequence."""
    B, S, H, Dc = part_o.shape
    combine_kernel[combine_grid(B, H)](
        part_o, part_lse, seq_lens, out, lse, H, S, split_len,
        DC=Dc, BLOCK_DC=max(16, triton.next_power_of_2(Dc)), num_warps=4,
    )


def combine_splits_naive(part_o: Tensor, part_lse: Tensor) -> tuple[Tensor, Tensor]:
    """The combine's torch twin: merge_attention folded over the splits (empty ones weigh 0).
    part_o [B, S, H, Dc], part_lse [B, S, H] -> (o [B, H, Dc] fp32, lse [B, H])."""
    o, lse = part_o[:, 0].float(), part_lse[:, 0]
    for s in range(1, part_o.shape[1]):
        o, lse = merge_attention(o, lse, part_o[:, s], part_lse[:, s])
    return o, lse


def device_sms(device: torch.device) -> int:
    """SMs of a CUDA device (host-side property, no sync); DEFAULT_NUM_SMS elsewhere."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS
