"""Split-KV planning and combine for paged MLA decode: the plans cover every token with
page- and tile-aligned splits, every grid stays within CUDA's limits up to (and past) 4M-token
contexts, and the Triton combine equals its torch twin (merge_attention folded over splits)
while reading no split past a sequence's end."""

import math

import pytest
import torch

from kernels.mla.split_kv import (BLOCK_N, MAX_GRID_X, combine_grid, combine_splits_naive,
                                  combine_splits_triton, decode_grid, granule, head_tile, plan_splits)
from tests.kernels.test_mla_paged import rel_err

pytestmark = [pytest.mark.numerics]  # compares two computation orders: run under every CPU kernel path (make test-slow)

FOUR_M = 4 * 1024 * 1024 + 17  # past 4M tokens, not a multiple of anything


@pytest.mark.parametrize("num_heads, block_h, tiles", [(1, 16, 1), (3, 16, 1), (17, 32, 1), (20, 32, 1),
                                                       (64, 64, 1), (70, 64, 2), (128, 64, 2), (129, 64, 3)])
def test_head_tile(num_heads, block_h, tiles):
    assert head_tile(num_heads) == block_h
    assert plan_splits(1, num_heads, 100, 16).num_head_tiles == tiles


@pytest.mark.parametrize("batch", [1, 3, 64, 4096])
@pytest.mark.parametrize("max_seq_len", [1, 63, 200, 8192, 131072, FOUR_M])
@pytest.mark.parametrize("block_tokens", [5, 16, 64, 128])
@pytest.mark.parametrize("num_heads", [3, 64, 70])
def test_plans_cover_every_token_on_aligned_splits(batch, max_seq_len, block_tokens, num_heads):
    plan = plan_splits(batch, num_heads, max_seq_len, block_tokens)
    step = math.lcm(BLOCK_N, block_tokens)
    assert plan.split_len % step == 0 and plan.split_len % block_tokens == 0 and plan.split_len % BLOCK_N == 0
    assert plan.num_splits * plan.split_len >= max_seq_len  # every token has a split
    assert (plan.num_splits - 1) * plan.split_len < max_seq_len  # no split empty at max_seq_len
    assert 1 <= plan.num_splits <= 256
    (programs,) = decode_grid(plan)
    assert programs == batch * plan.num_splits * plan.num_head_tiles <= MAX_GRID_X
    assert combine_grid(batch, num_heads)[0] <= MAX_GRID_X


def test_plan_fills_the_machine_at_long_context_and_not_at_large_batch():
    # One 4M-token sequence: 132 splits of ~32k tokens, one per SM (instead of one busy SM).
    long = plan_splits(1, 64, FOUR_M, 64, num_sms=132)
    assert long.num_splits == 132 and long.split_len == 64 * -(-FOUR_M // (64 * 132))
    # 64 sequences x 8k (the bandwidth target's shape): 2 splits -> 128 programs on 132 SMs.
    mid = plan_splits(64, 64, 8192, 64, num_sms=132)
    assert (mid.num_splits, mid.split_len, mid.num_programs) == (2, 4096, 128)
    # Enough sequences to fill every SM already: no split, no combine pass.
    assert plan_splits(512, 64, 8192, 64, num_sms=132).num_splits == 1
    # A single short sequence: split down to single tiles (each split's overhead is fixed).
    assert plan_splits(1, 16, 200, 16).num_splits == 4


def test_forced_splits_and_bad_arguments():
    plan = plan_splits(5, 3, 200, 16, num_splits=5)  # 4 tiles of 64 cover 200: split 4 holds nothing
    assert (plan.num_splits, plan.split_len) == (5, 64)
    assert plan_splits(5, 3, 200, 5, num_splits=2).split_len == 320  # granule lcm(64, 5)
    assert granule(16) == 64 and granule(128) == 128 and granule(48) == 192
    with pytest.raises(ValueError, match="num_splits must be >= 1, got 0"):
        plan_splits(1, 3, 10, 16, num_splits=0)
    with pytest.raises(ValueError, match="max_seq_len must be >= 1, got 0"):
        plan_splits(1, 3, 0, 16)
    with pytest.raises(ValueError, match="block_tokens must be >= 1, got 0"):
        plan_splits(1, 3, 10, 0)
    with pytest.raises(ValueError, match="num_heads must be >= 1, got 0"):
        head_tile(0)


def test_grids_refuse_what_cuda_cannot_launch():
    huge = plan_splits(2**20, 128, 64, 64, num_splits=2**10)  # 2^20 x 2^10 x 2 programs = 2^31
    with pytest.raises(ValueError, match=r"decode grid of 2147483648 programs .* exceeds CUDA's grid x limit"):
        decode_grid(huge)
    with pytest.raises(ValueError, match="combine grid of 65536 x 32768 rows exceeds"):
        combine_grid(2**16, 2**15)


@pytest.mark.triton
@pytest.mark.parametrize("Dc", [16, 24])
def test_triton_combine_matches_merge_attention_fold(Dc):
    gen = torch.Generator().manual_seed(0)
    seq_lens, split_len, S, H = [1, 17, 63, 65, 200], 64, 5, 3
    B = len(seq_lens)
    part_o = torch.randn(B, S, H, Dc, generator=gen)  # [B, S, H, Dc]
    part_lse = torch.randn(B, S, H, generator=gen) * 4  # [B, S, H]
    used = torch.tensor([-(-n // split_len) for n in seq_lens])  # [B] splits that hold tokens
    empty = torch.arange(S)[None, :] >= used[:, None]  # [B, S]
    part_o[empty], part_lse[empty] = 0.0, float("-inf")  # what the decode kernel writes there
    o_ref, lse_ref = combine_splits_naive(part_o, part_lse)
    poisoned_o, poisoned_lse = part_o.clone(), part_lse.clone()
    poisoned_o[empty], poisoned_lse[empty] = float("nan"), float("nan")  # the combine must not read them
    o, lse = torch.empty(B, H, Dc), torch.empty(B, H)
    combine_splits_triton(poisoned_o, poisoned_lse, torch.tensor(seq_lens, dtype=torch.int32), split_len, o, lse)
    err_o, err_lse = rel_err(o, o_ref), rel_err(lse, lse_ref)
    print(f"combine Dc={Dc}: rel err o {err_o:.2e}, lse {err_lse:.2e}")
    assert err_o <= 1e-6 and err_lse <= 1e-6
    assert torch.equal(o[0], part_o[0, 0]) and torch.equal(lse[0], part_lse[0, 0])  # one split: itself
