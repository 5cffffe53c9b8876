"""Pages at real geometry: with a prefix cache, block_tokens is the multiple of the hash block next to
KDA state bytes / MLA bytes per token (below or above) whose page wastes the smaller fraction.

Expected figures are computed here by hand from the model's dimensions, never by the layout code.
48B (configs/model/kimi_linear_48b_a3b.yaml): groups of 7 layers, 32 KDA heads of dk = dv = 128, conv
kernel 4, MLA latent 512 + 64 = 576, so per group
  KDA state = 32 heads * 7 layers * (128*128 + 3*3*128 = 17,536) = 3,928,064 elements,
  MLA token = 7 layers * 576 = 4,032 elements.
"""
import random

import pytest
import torch

from memory.layout import CacheLayout
from models.config import load_model_config
from models.model import HybridLM
from rollout.engine import Engine, EngineConfig
from rollout.kv import PrefixCacheConfig
from rollout.sampling import SamplingParams

BIG = load_model_config("configs/model/kimi_linear_48b_a3b.yaml")
TINY = load_model_config("configs/model/tiny.yaml")


def test_the_48b_dimensions_behind_the_hand_figures():
    assert (BIG.linear_num_heads, BIG.linear_head_dim, BIG.linear_conv_kernel_dim) == (32, 128, 4)
    assert (len(BIG.kda_layers), len(BIG.mla_layers), BIG.mla_latent_dim) == (20, 7, 576)


@pytest.mark.parametrize("cache_dtype, state_dtype, block_tokens, page_bytes, kda_bytes", [
    # bf16 cache, bf16 state: ratio 7,856,128 / 8,064 = 974.2; 512 tokens would leave
    # 7,856,128 - 512 * 8,064 = 3,727,360 B (47.4%) of each MLA page unused, 1,024 tokens leave
    # 8,257,536 - 7,856,128 = 401,408 B (4.9%) of each KDA page: 1,024.
    (torch.bfloat16, torch.bfloat16, 1024, 1024 * 8064, 3_928_064 * 2),
    # bf16 cache, FP32 state: ratio 15,712,256 / 8,064 = 1,948.4; 1,536 -> 21.2% MLA padding,
    # 2,048 -> 16,515,072 B pages, 4.9% KDA padding: 2,048.
    (torch.bfloat16, torch.float32, 2048, 2048 * 8064, 3_928_064 * 4),
    # fp8 cache, FP32 state: ratio 15,712,256 / 4,032 = 3,896.9; 3,584 -> 8.0% MLA padding,
    # 4,096 -> 16,515,072 B pages, 4.9% KDA padding: 4,096.
    (torch.float8_e4m3fn, torch.float32, 4096, 4096 * 4032, 3_928_064 * 4),
])
def test_48b_pages_are_whole_hash_blocks_with_the_padding_by_hand(cache_dtype, state_dtype, block_tokens, page_bytes,
                                                                    kda_bytes):
    layout = CacheLayout.for_model(BIG, cache_dtype=cache_dtype, state_dtype=state_dtype, hash_block=512)
    assert layout.block_tokens == block_tokens and layout.block_tokens % 512 == 0
    assert 1024 <= layout.block_tokens <= 6144
    assert layout.page_bytes == page_bytes and page_bytes % 256 == 0
    # every page above takes exactly block_tokens MLA tokens: the KDA pages carry the padding
    assert layout.mla_padding_fraction == 0.0
    assert layout.kda_padding_fraction == pytest.approx((page_bytes - kda_bytes) / page_bytes, abs=1e-12)
    assert layout.kda_padding_fraction == pytest.approx(401_408 / 8_257_536, abs=1e-12)  # 4.86%, the same each time
    assert layout.padding_fraction == layout.kda_padding_fraction


def test_the_less_wasteful_neighbour_wins_below_or_above():
    bf16 = dict(cache_dtype=torch.bfloat16, state_dtype=torch.bfloat16)
    # hash block 64: 960 tokens (7,741,440 B of a 7,856,128 B page: 114,688 B = 1.46% MLA padding)
    # beats 1,024 (4.86% KDA padding) -> below wins.
    below = CacheLayout.for_model(BIG, hash_block=64, **bf16)
    assert (below.block_tokens, below.page_bytes) == (960, 7_856_128)
    assert below.kda_padding_fraction == 0.0
    assert below.mla_padding_fraction == pytest.approx(114_688 / 7_856_128, abs=1e-12)
    # hash block 512: 512 tokens (47.4% MLA padding) loses to 1,024 (4.86% KDA padding) -> above wins.
    above = CacheLayout.for_model(BIG, hash_block=512, **bf16)
    assert above.block_tokens == 1024
    assert above.padding_fraction == pytest.approx(401_408 / 8_257_536, abs=1e-12)
    assert above.padding_fraction < 3_727_360 / 7_856_128
    # tiny fp32 (KDA 20,992 B, MLA 320 B per token, ratio 65.6): hash block 48 -> 48 (5,632 B = 26.8%
    # MLA padding) beats 96 (30,720 B pages, 31.7% KDA padding); hash block 24 -> 72 (23,040 B pages,
    # 2,048 B = 8.9% KDA padding) beats 48.
    assert CacheLayout.for_model(TINY, hash_block=48).block_tokens == 48
    tiny_above = CacheLayout.for_model(TINY, hash_block=24)
    assert (tiny_above.block_tokens, tiny_above.page_bytes) == (72, 23_040)
    assert tiny_above.kda_padding_fraction == pytest.approx(2048 / 23_040, abs=1e-12)


def test_an_explicit_block_tokens_must_be_a_multiple_of_the_hash_block():
    with pytest.raises(ValueError, match=r"block_tokens=960 .*hash_block=512"):
        CacheLayout.for_model(BIG, cache_dtype=torch.bfloat16, block_tokens=960, hash_block=512)
    with pytest.raises(ValueError, match="hash_block=0"):
        CacheLayout.for_model(BIG, hash_block=0)
    explicit = CacheLayout.for_model(BIG, cache_dtype=torch.bfloat16, block_tokens=1536, hash_block=512)
    assert explicit.block_tokens == 1536 and explicit.page_bytes == 3_928_064 * 4  # FP32 state: 15,712,256 B
    # an engine with an explicit block_tokens the hash block does not divide is refused when built
    with pytest.raises(ValueError, match=r"block_tokens=64 .*hash_block=48"):
        Engine(HybridLM(TINY), EngineConfig(block_tokens=64,
                                            prefix_cache=PrefixCacheConfig(hash_block=48)))


def test_tiny_engine_with_the_default_hash_block_takes_512_token_pages_87_percent_kda_padding():
    """Tiny fp32: one 512-token hash block per MLA page, 512 * 320 = 163,840 B pages, so each KDA page
    (20,992 B of state) is 87.2% padding: acceptable on the test model, whose ratio is 65.6 tokens."""
    hash_block = PrefixCacheConfig().hash_block
    assert hash_block == 512
    engine = Engine(HybridLM(TINY), EngineConfig(prefix_cache=PrefixCacheConfig()))
    assert (engine.layout.block_tokens, engine.layout.page_bytes) == (512, 163_840)
    assert engine.layout.kda_padding_fraction == pytest.approx((163_840 - 20_992) / 163_840, abs=1e-12)
    engine.check_integrity()


def test_a_hash_block_that_does_not_divide_the_old_page_builds_and_hits():
    """Hash block 48 does not divide the 64 tokens derived without a prefix cache (which the prefix
    cache used to refuse); the engine now takes 48-token pages and a repeated prompt hits."""
    assert CacheLayout.for_model(TINY).block_tokens % 48 != 0
    model = HybridLM(TINY).init_weights(seed=7, std=0.15).eval()
    engine = Engine(model, EngineConfig.for_pages(model, 40, max_model_len=400, check_every_step=True,
                                                  prefix_cache=PrefixCacheConfig(hash_block=48, model_id="tiny")))
    assert engine.layout.block_tokens == 48
    rng = random.Random(0)
    prompt = [rng.randrange(256) for _ in range(150)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    first = engine.generate([prompt], greedy)[0].samples[0].tokens
    assert engine.cache.prefix.hit_tokens == 0
    again = engine.generate([prompt], greedy)[0].samples[0].tokens
    assert engine.cache.prefix.hit_tokens == 3 * 48  # every whole hash block of the 150-token prompt
    assert again == first
    engine.check_integrity()
