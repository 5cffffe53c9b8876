"""The prefix cache index: chained hashes, two-stage lookup, the concurrency rules' bookkeeping."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.kv.prefix_index import PrefixIndex, cache_salt, chain_hashes

SALT = cache_salt("tiny", 1)


def tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(259) for _ in range(n)]


def register(index, toks, salt=SALT, page_base=0, kda_every=None):
    """Register a request's MLA pages (one MLA group, page ids page_base + block) and KDA checkpoints
    (every group) at boundaries that are multiples of kda_every hash blocks (default: the last one)."""
    hashes = chain_hashes(toks, index.hash_block, salt)
    num_blocks = -(-len(toks) // index.block_tokens)
    index.register_mla(hashes, 0, [(page_base + j,) for j in range(num_blocks)])
    wanted = range(1, len(hashes) + 1) if kda_every else [len(hashes)] if hashes else []
    for i in wanted:
        if kda_every and i % kda_every:
            continue
        for g in range(index.num_kda_groups):
            index.register_kda(hashes[i - 1], g, 10_000 + page_base * 100 + i * index.num_kda_groups + g)
    return hashes


def test_chained_hashes_certify_the_whole_prefix():
    a = tokens(2000, 0)
    b = list(a)
    b[700] += 1  # inside hash block 1 (512..1023)
    ha, hb = chain_hashes(a, 512, SALT), chain_hashes(b, 512, SALT)
    assert len(ha) == 3 and ha[0] == hb[0] and ha[1] != hb[1] and ha[2] != hb[2]
    assert chain_hashes(a, 512, cache_salt("tiny", 2))[0] != ha[0], "a new policy version must not hit"
    assert chain_hashes(a[1024:], 512, SALT, start=ha[1], first_block=2) == ha[2:]


def test_the_seed_example_hits_at_2560():
    # 2,800 matching tokens, hash block 512, physical block 6,144 -> hit at 2,560.
    index = PrefixIndex(hash_block=512, block_tokens=6144, num_kda_groups=3)
    first = tokens(2800, 1)
    register(index, first)  # its forward pass checkpointed the last hash-aligned position, 2,560
    second = first + tokens(500, 2)
    match = index.match(chain_hashes(second, 512, SALT), len(second))
    assert match.tokens == 2560 and match.mla_tokens == 2560
    assert match.mla_pages == [(0,)] and len(match.kda_pages) == 3
    index.check_integrity()


def test_kda_stage_needs_every_group_and_one_token_is_always_computed():
    index = PrefixIndex(hash_block=4, block_tokens=8, num_kda_groups=2)
    toks = tokens(24, 3)
    hashes = register(index, toks, kda_every=1)
    assert index.match(hashes, len(toks)).tokens == 20  # all 24 cached, but the last token is recomputed
    index.forget_page(index.kda[hashes[4]][1])  # boundary 20 loses group 1 -> group 0 goes with it
    assert hashes[4] not in index.kda
    assert index.match(hashes, len(toks)).tokens == 16
    index.check_integrity()


def test_evicting_a_checkpoint_returns_its_siblings():
    index = PrefixIndex(hash_block=4, block_tokens=8, num_kda_groups=3)
    hashes = register(index, tokens(8, 4))
    slot = dict(index.kda[hashes[-1]])
    assert sorted(index.forget_page(slot[0])) == sorted([slot[1], slot[2]])
    assert index.match(hashes, 9).tokens == 0


def test_excluded_pages_do_not_match():
    index = PrefixIndex(hash_block=4, block_tokens=8, num_kda_groups=1)
    toks = tokens(20, 5)
    hashes = register(index, toks, kda_every=1)
    assert index.match(hashes, 21).tokens == 20
    assert index.match(hashes, 21, excluded=[1]).tokens == 8  # physical block 1 is being written
    checkpoint = index.kda[hashes[1]][0]
    assert index.match(hashes, 21, excluded=[1, checkpoint]).tokens == 4


def test_evicted_mla_page_cuts_the_match_at_its_block():
    index = PrefixIndex(hash_block=4, block_tokens=8, num_kda_groups=1)
    toks = tokens(32, 6)
    hashes = register(index, toks, kda_every=1)
    index.forget_page(2)  # tokens 16..23
    assert index.match(hashes, 33).tokens == 16
    index.check_integrity()


def test_a_partial_page_is_reachable_at_each_complete_hash_block():
    index = PrefixIndex(hash_block=4, block_tokens=16, num_kda_groups=1)
    first = tokens(14, 7)  # one page, 3 complete hash blocks
    register(index, first, kda_every=1)
    for shared in (4, 8, 12):  # another request diverging inside the page hits at every boundary
        other = first[:shared] + [t + 1 for t in first[shared:shared + 6]]
        assert index.match(chain_hashes(other, 4, SALT), len(other)).tokens == shared


@settings(max_examples=60, deadline=None)
@given(shared=st.integers(0, 60), extra_a=st.integers(0, 20), extra_b=st.integers(1, 20),
       hash_block=st.sampled_from([2, 4]), per_page=st.sampled_from([1, 3]), kda_groups=st.integers(0, 2),
       seed=st.integers(0, 1000))
def test_hit_equals_the_oracle(shared, extra_a, extra_b, hash_block, per_page, kda_groups, seed):
    index = PrefixIndex(hash_block=hash_block, block_tokens=hash_block * per_page, num_kda_groups=kda_groups)
    a = tokens(shared + extra_a, seed)
    b = a[:shared] + [(t + 1) % 259 for t in tokens(extra_b, seed + 1)]
    register(index, a, kda_every=1)
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    oracle = min(common, len(a), len(b) - 1) // hash_block * hash_block
    assert index.match(chain_hashes(b, hash_block, SALT), len(b)).tokens == oracle
    index.check_integrity()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="multiple of hash_block"):
        PrefixIndex(hash_block=512, block_tokens=700, num_kda_groups=1)
    index = PrefixIndex(hash_block=4, block_tokens=8, num_kda_groups=1)
    with pytest.raises(ValueError, match="KDA group 3"):
        index.register_kda(b"x", 3, 1)
    index.register_kda(b"x", 0, 1)
    with pytest.raises(ValueError, match="fresh pages"):
        index.register_kda(b"x", 0, 2)
