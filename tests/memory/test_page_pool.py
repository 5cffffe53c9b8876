"""Unified page pool: block_tokens derivation, head-major layout, disjoint views, refcount invariants."""
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from memory.page_pool import CacheLayout, OutOfPages, PagePool
from models.config import ModelConfig, load_model_config
from models.state import KDALayerState

TINY = load_model_config("configs/model/tiny.yaml")
BIG = load_model_config("configs/model/kimi_linear_48b_a3b.yaml")


def tiny_pool(num_pages: int = 4, **kwargs) -> PagePool:
    return PagePool(CacheLayout.for_model(TINY, **kwargs), num_pages)


def numbered_state(layout: CacheLayout, base: float) -> KDALayerState:
    """A state whose every element is distinct (base + running index), in models/state.py's layout."""
    h, dk, k = layout.num_heads, layout.head_dim, layout.conv_kernel
    n_s, n_c = h * dk * dk, (k - 1) * 3 * h * dk
    return KDALayerState(recurrent=base + torch.arange(n_s, dtype=torch.float32).view(h, dk, dk),
                         conv_tail=base + n_s + torch.arange(n_c, dtype=torch.float32).view(k - 1, 3 * h * dk))


def view_mask(pool: PagePool, page: int, fill_view) -> torch.Tensor:
    """[page_bytes] bool: the bytes of `page` that `fill_view(page)` writes (page set to 0xFF, view zeroed)."""
    pool.page_bytes_view(page).fill_(0xFF)
    fill_view(page)
    return pool.page_bytes_view(page) == 0


# ---- layout figures ---------------------------------------------------------------------------------
def test_tiny_layout_derives_block_tokens_and_page_bytes():
    lay = CacheLayout.for_model(TINY)
    assert lay.group_layers == 2  # = number of MLA layers
    assert lay.kda_groups == ((0, 1), (2, 4), (5, 6)) and lay.mla_groups == ((3, 7),)
    assert lay.kda_unit_elems == 32 * 32 + 3 * 3 * 32 == 1312
    assert lay.kda_state_bytes_per_group == 2 * 2 * 1312 * 4 == 20992
    assert lay.mla_token_bytes_per_group == 2 * 40 * 4 == 320
    assert lay.block_tokens == 64  # floor(20992 / 320) = 65 -> multiple of 16
    assert lay.page_bytes == 20992 and lay.kda_padding_bytes == 0 and lay.mla_padding_bytes == 512
    assert lay.group_of(4) == ("kda", 1, 1) and lay.group_of(7) == ("mla", 0, 1) and lay.group_of(0) == ("kda", 0, 0)
    assert "block_tokens=64" in lay.describe() and "page_bytes=20,992" in lay.describe()
    assert lay.mla_pages_for(64) == 1 and lay.mla_pages_for(65) == 2
    with pytest.raises(ValueError, match="layer 8"):
        lay.group_of(8)
    bf16 = CacheLayout.for_model(TINY, state_dtype=torch.bfloat16, cache_dtype=torch.bfloat16)
    assert (bf16.block_tokens, bf16.page_bytes) == (64, 10496)


def test_kimi_linear_48b_block_tokens():
    bf16 = CacheLayout.for_model(BIG, state_dtype=torch.bfloat16, cache_dtype=torch.bfloat16)
    assert [len(g) for g in bf16.kda_groups] == [7, 7, 6] and bf16.mla_groups == ((3, 7, 11, 15, 19, 23, 26),)
    assert bf16.kda_unit_elems == 128 * 128 + 3 * 3 * 128
    assert bf16.kda_state_bytes_per_group == 32 * 7 * 17536 * 2 == 7_856_128
    assert bf16.mla_token_bytes_per_group == 7 * 576 * 2 == 8064
    # 7,856,128 / 8,064 = 974.2 -> 960: just under the target 1,024-6,144 tokens a page (docs/memory.md)
    assert (bf16.block_tokens, bf16.page_bytes) == (960, 7_856_128)
    # the models' native fp32 state with a bf16 (or fp8) cache lands inside that range
    fp32_state = CacheLayout.for_model(BIG, cache_dtype=torch.bfloat16)
    fp8_cache = CacheLayout.for_model(BIG, cache_dtype=torch.float8_e4m3fn)
    assert (fp32_state.block_tokens, fp32_state.page_bytes) == (1936, 15_712_256)
    assert 1024 <= fp32_state.block_tokens <= fp8_cache.block_tokens == 3888 <= 6144
    for lay in (bf16, fp32_state, fp8_cache):
        assert lay.page_bytes % 256 == 0 and 0 <= lay.mla_padding_bytes < 17 * lay.mla_token_bytes_per_group + 256


def test_layouts_without_one_kind_and_bad_arguments():
    kda_only = ModelConfig(**{**TINY.to_dict(), "layer_types": ["kda"] * 8})
    lay = CacheLayout.for_model(kda_only)
    assert lay.group_layers == 8 and lay.kda_groups == (tuple(range(8)),) and lay.mla_groups == ()
    assert lay.page_bytes == 2 * 8 * 1312 * 4
    mla_only = ModelConfig(**{**TINY.to_dict(), "layer_types": ["mla"] * 8})
    lay = CacheLayout.for_model(mla_only)
    assert (lay.group_layers, lay.block_tokens, lay.kda_groups) == (8, 16, ())
    assert lay.page_bytes == 8 * 16 * 40 * 4
    assert CacheLayout.for_model(mla_only, block_tokens=100).page_bytes == 8 * 100 * 40 * 4
    lay = CacheLayout.for_model(TINY, group_layers=4)  # 6 KDA layers -> groups of 4 and 2; MLA one short group
    assert lay.kda_groups == ((0, 1, 2, 4), (5, 6)) and lay.mla_groups == ((3, 7),)
    for bad in (0, 7, -1):
        with pytest.raises(ValueError, match=f"group_layers={bad}"):
            CacheLayout.for_model(TINY, group_layers=bad)
    with pytest.raises(ValueError, match="page_bytes=1024 < kda_state_bytes_per_group=20992"):
        CacheLayout(**{**CacheLayout.for_model(TINY).__dict__, "page_bytes": 1024})
    with pytest.raises(ValueError, match="layer 3"):
        CacheLayout(**{**CacheLayout.for_model(TINY).__dict__, "kda_groups": ((0, 3),)})


# ---- views ------------------------------------------------------------------------------------------
def test_head_major_layout_one_head_range_holds_that_heads_units_of_every_layer():
    pool = tiny_pool()
    lay = pool.layout
    page = pool.allocate(1, ("kda", 1))[0]  # layers 2 and 4
    pool.zero_pages([page])
    states = {layer: numbered_state(lay, 1000.0 * (slot + 1)) for slot, layer in enumerate(lay.kda_groups[1])}
    for layer, state in states.items():
        pool.write_kda_state(page, layer, state)
    raw = pool.page_bytes_view(page).view(torch.float32)
    h_all, dk, k = lay.num_heads, lay.head_dim, lay.conv_kernel
    for head in range(h_all):
        start, end = pool.head_byte_range(head)
        assert end - start == lay.kda_head_bytes == lay.group_layers * 1312 * 4
        block = raw[start // 4:end // 4].view(lay.group_layers, lay.kda_unit_elems)  # [slot, unit]
        for slot, layer in enumerate(lay.kda_groups[1]):
            s = states[layer]
            assert torch.equal(block[slot, :dk * dk], s.recurrent[head].flatten())
            # conv tail unit order [which, time, d] <- models/state.py channel which*(H*dk) + h*dk + d
            tail = s.conv_tail.view(k - 1, 3, h_all, dk)[:, :, head].permute(1, 0, 2)
            assert torch.equal(block[slot, dk * dk:], tail.flatten())
    # changing only head 1 of one layer's state changes bytes in head 1's range and nowhere else
    before = pool.page_bytes_view(page).clone()
    changed = states[4].clone()
    changed.recurrent[1] += 1
    changed.conv_tail.view(k - 1, 3, h_all, dk)[:, :, 1] += 1
    pool.write_kda_state(page, 4, changed)
    diff = (pool.page_bytes_view(page) != before).nonzero().flatten()
    start, end = pool.head_byte_range(1)
    assert diff.numel() > 0 and start <= diff.min() and diff.max() < end
    # round trip back to the models/state.py layout
    got = pool.read_kda_state(page, 4)
    assert torch.equal(got.recurrent, changed.recurrent) and torch.equal(got.conv_tail, changed.conv_tail)
    with pytest.raises(ValueError, match="head=2"):
        pool.head_byte_range(2)


def test_views_write_through_to_page_bytes():
    pool = tiny_pool()
    kda_page, mla_page = pool.allocate(1, ("kda", 0))[0], pool.allocate(1, ("mla", 0))[0]
    pool.zero_pages([kda_page, mla_page])
    mla = pool.mla_view(7)
    assert mla.shape == (4, 64, 40) and mla.dtype == torch.float32
    mla[mla_page, 5, 3] = 2.5
    offset = (1 * 64 * 40 + 5 * 40 + 3) * 4  # slot 1, token 5, channel 3
    assert pool.page_bytes_view(mla_page)[offset:offset + 4].view(torch.float32).item() == 2.5
    state, conv = pool.kda_views(1)
    assert state.shape == (4, 2, 32, 32) and conv.shape == (4, 2, 3, 3, 32)
    conv[kda_page, 1, 2, 0, 7] = -4.0  # head 1, v, oldest token, d=7, slot 1
    offset = ((1 * 2 + 1) * 1312 + 32 * 32 + (2 * 3 + 0) * 32 + 7) * 4
    assert pool.page_bytes_view(kda_page)[offset:offset + 4].view(torch.float32).item() == -4.0
    assert torch.count_nonzero(pool.page_bytes_view(kda_page)) == 2  # -4.0 = 0xC0800000: two nonzero bytes
    with pytest.raises(ValueError, match="kda layer"):
        pool.mla_view(0)
    with pytest.raises(ValueError, match="mla layer"):
        pool.kda_views(3)


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float16)])
def test_views_of_layers_in_one_group_are_disjoint_and_stay_in_their_page(dtypes):
    pool = tiny_pool(num_pages=3, state_dtype=dtypes[0], cache_dtype=dtypes[1])
    lay = pool.layout
    pages = [pool.allocate(1, group)[0] for group in (("kda", 2), ("mla", 0))]
    other = pool.allocate(1, ("kda", 0))[0]
    pool.page_bytes_view(other).fill_(0x5A)
    for page, kind, groups in ((pages[0], "kda", lay.kda_groups), (pages[1], "mla", lay.mla_groups)):
        layers = groups[-1]
        if kind == "kda":
            masks = [view_mask(pool, page, lambda p, l=l: [v[p].zero_() for v in pool.kda_views(l)]) for l in layers]
            expected = lay.num_heads * lay.kda_unit_elems * dtypes[0].itemsize
        else:
            masks = [view_mask(pool, page, lambda p, l=l: pool.mla_view(l)[p].zero_()) for l in layers]
            expected = lay.block_tokens * lay.latent_dim * dtypes[1].itemsize
        for i, mask in enumerate(masks):
            assert int(mask.sum()) == expected
            for j in range(i):
                assert not (mask & masks[j]).any(), f"{kind} layers {layers[i]} and {layers[j]} overlap"
        # distinct values per layer survive writes to the other layers
        for value, layer in enumerate(layers, start=1):
            views = pool.kda_views(layer) if kind == "kda" else (pool.mla_view(layer),)
            for v in views:
                v[page].fill_(value)
        for value, layer in enumerate(layers, start=1):
            views = pool.kda_views(layer) if kind == "kda" else (pool.mla_view(layer),)
            assert all(bool((v[page] == value).all()) for v in views)
    assert bool((pool.page_bytes_view(other) == 0x5A).all()), "writes leaked into another page"


# ---- allocation, refcounts, copies ----------------------------------------------------------------
def test_allocate_is_all_or_nothing_and_low_ids_first():
    pool = tiny_pool(num_pages=4)
    assert pool.allocate(3, ("kda", 0)) == [0, 1, 2]
    with pytest.raises(OutOfPages, match="requested 2 pages, 1 free"):
        pool.allocate(2, ("mla", 0))
    assert pool.num_free == 1 and pool.group_of_page(3) is None and pool.refcount(3) == 0
    assert pool.decref([1]) == [1]
    assert pool.allocate(2, ("mla", 0)) == [1, 3] and pool.utilization == 1.0
    pool.check_integrity()
    with pytest.raises(ValueError, match="unknown cache group"):
        pool.allocate(0, ("kda", 3))


def test_refcounts_share_and_free_and_reject_overdraw_without_change():
    pool = tiny_pool(num_pages=4)
    a, b = pool.allocate(2, ("kda", 1))
    pool.incref([a, a])
    assert pool.refcount(a) == 3 and pool.group_of_page(a) == ("kda", 1)
    with pytest.raises(ValueError, match=f"decref page {b} 2 times, but its refcount is 1"):
        pool.decref([a, b, b])
    assert pool.refcount(a) == 3 and pool.refcount(b) == 1  # nothing changed
    assert pool.decref([a, a, b]) == [b]
    assert pool.decref([a]) == [a] and pool.num_used == 0
    with pytest.raises(ValueError, match="free page"):
        pool.incref([a])
    with pytest.raises(ValueError, match="out of range"):
        pool.refcount(4)
    pool.check_integrity()


def test_copy_pages_copies_exactly_one_pages_bytes():
    pool = tiny_pool(num_pages=5)
    pages = pool.allocate(4, ("kda", 0))
    mla = pool.allocate(1, ("mla", 0))
    gen = torch.Generator().manual_seed(0)
    for p in range(5):
        pool.page_bytes_view(p).copy_(torch.randint(0, 256, (pool.layout.page_bytes,), generator=gen,
                                                    dtype=torch.uint8))
    before = [pool.page_bytes_view(p).clone() for p in range(5)]
    pool.copy_pages([pages[1]], [pages[3]])
    for p in range(5):
        assert torch.equal(pool.page_bytes_view(p), before[1] if p == pages[3] else before[p])
    with pytest.raises(ValueError, match="src group"):
        pool.copy_pages([pages[0]], mla)
    pool.decref([pages[2]])
    with pytest.raises(ValueError, match="free page 2"):
        pool.copy_pages([pages[0]], [pages[2]])
    assert pool.refcount(pages[3]) == 1


def test_check_integrity_catches_corruption():
    pool = tiny_pool(num_pages=3)
    pool.allocate(1, ("kda", 0))
    pool._refcounts[1] = 1  # a free page with a reference
    with pytest.raises(RuntimeError, match="free page 1 has refcount 1"):
        pool.check_integrity()
    pool._refcounts[1] = 0
    pool._free.append(1)
    with pytest.raises(RuntimeError, match=r"duplicates \[1\]"):
        pool.check_integrity()


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / incref / decref / copy sequences against a plain-dict model of the refcounts."""

    def __init__(self):
        super().__init__()
        self.pool = tiny_pool(num_pages=6)
        self.refs: dict[int, int] = {}
        self.tags: dict[int, tuple[str, int]] = {}

    @rule(num=st.integers(0, 4), group=st.sampled_from(CacheLayout.for_model(TINY).groups))
    def allocate(self, num, group):
        free = sorted(set(range(6)) - set(self.refs))
        if num > len(free):
            with pytest.raises(OutOfPages):
                self.pool.allocate(num, group)
            return
        pages = self.pool.allocate(num, group)
        assert pages == free[:num]
        for p in pages:
            self.refs[p], self.tags[p] = 1, group

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def incref(self, data):
        pages = data.draw(st.lists(st.sampled_from(sorted(self.refs)), min_size=1, max_size=3))
        self.pool.incref(pages)
        for p in pages:
            self.refs[p] += 1

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def decref(self, data):
        pages = data.draw(st.lists(st.sampled_from(sorted(self.refs)), min_size=1, max_size=3))
        overdraw = any(pages.count(p) > self.refs[p] for p in pages)
        if overdraw:
            with pytest.raises(ValueError):
                self.pool.decref(pages)
            return
        freed = self.pool.decref(pages)
        for p in pages:
            self.refs[p] -= 1
        expected = sorted(p for p in set(pages) if self.refs[p] == 0)
        assert freed == expected
        for p in expected:
            del self.refs[p], self.tags[p]

    @precondition(lambda self: len(self.refs) >= 2)
    @rule(data=st.data())
    def copy(self, data):
        src, dst = data.draw(st.permutations(sorted(self.refs)))[:2]
        if self.tags[src] != self.tags[dst]:
            with pytest.raises(ValueError):
                self.pool.copy_pages([src], [dst])
            return
        self.pool.page_bytes_view(src).fill_(src)
        self.pool.copy_pages([src], [dst])
        assert bool((self.pool.page_bytes_view(dst) == src).all())

    @invariant()
    def matches_model(self):
        self.pool.check_integrity()
        assert self.pool.num_used == len(self.refs) and self.pool.num_free == 6 - len(self.refs)
        for p in range(6):
            assert self.pool.refcount(p) == self.refs.get(p, 0)
            assert self.pool.group_of_page(p) == self.tags.get(p)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=25, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])


# ---- sizing, sleep / wake -------------------------------------------------------------------------
def test_from_bytes_sizes_the_pool():
    lay = CacheLayout.for_model(TINY)
    assert PagePool.from_bytes(lay, 5 * lay.page_bytes + lay.page_bytes - 1).num_pages == 5
    assert PagePool.from_bytes(lay, 5 * lay.page_bytes).pool_bytes == 5 * lay.page_bytes
    with pytest.raises(ValueError, match="pool_bytes=20,991 holds no page of page_bytes=20,992"):
        PagePool.from_bytes(lay, lay.page_bytes - 1)


def test_release_refuses_pages_in_use_and_reacquire_gives_a_usable_pool():
    pool = tiny_pool(num_pages=4)
    mla = pool.mla_view(3)  # kept across sleep / wake, as an engine would
    pages = pool.allocate(2, ("mla", 0))
    with pytest.raises(RuntimeError, match="2 pages are still in use"):
        pool.release()
    assert not pool.is_released
    pool.decref(pages)
    pool.release()
    assert pool.is_released and pool._buffer.untyped_storage().nbytes() == 0
    pool.check_integrity()
    for call in (lambda: pool.allocate(1, ("kda", 0)), lambda: pool.mla_view(3), pool.release):
        with pytest.raises(RuntimeError, match="released"):
            call()
    pool.reacquire()
    assert not pool.is_released and pool.num_free == 4
    pool.check_integrity()
    page = pool.allocate(1, ("mla", 0))[0]
    mla[page].fill_(7.0)  # a view taken before release writes to the new memory
    assert bool((pool.mla_view(3)[page] == 7.0).all())
    assert pool.page_bytes_view(page)[:4].view(torch.float32).item() == 7.0
    with pytest.raises(RuntimeError, match="not released"):
        pool.reacquire()
