"""Page transfer between TP layouts: byte-range plans, bit-identical round trips, attention on the
re-sliced pages equal to TP 1, and the send/recv path between two processes over gloo."""
import dataclasses
from itertools import product

import pytest
import torch
import torch.nn.functional as F

from kernels.kda.decode import kda_decode_step
from kernels.mla.paged import paged_mla_decode
from memory.layout import CacheLayout
from memory.page_pool import PagePool
from memory.tp_reshard import ByteCopy, plan, reshard_pages, reshard_pool_pages
from models.config import load_model_config
from models.kda import l2norm
from models.model import HybridLM
from tests.bounds import scaled_err

pytestmark = [pytest.mark.numerics]  # compares two computation orders: run under every CPU kernel path (make test-slow)

TINY = load_model_config("configs/model/tiny.yaml")  # 2 KDA heads, 4 MLA query heads
TINY4 = dataclasses.replace(TINY, linear_num_heads=4)  # 4 KDA heads: splits over TP 1, 2 and 4
SENTINEL = 0xAB  # bytes a transfer must not touch (dst padding, decoy pages)


def _logical_groups(layout: CacheLayout) -> dict[str, list[tuple[str, int]]]:
    """The logical pages the tests move: one KDA state page per KDA group, two MLA pages."""
    return {"kda": [("kda", g) for g in range(len(layout.kda_groups))], "mla": [("mla", 0)] * 2}


def _allocate(pool: PagePool, num_decoys: int) -> dict[str, list[int]]:
    pool.allocate(num_decoys, ("mla", 0))  # so page ids differ between ranks
    return {kind: [pool.allocate(1, tag)[0] for tag in tags] for kind, tags in _logical_groups(pool.layout).items()}


def filled_pool(layout: CacheLayout, seed: int) -> tuple[PagePool, dict[str, list[int]]]:
    """A pool whose logical pages hold random bytes (every byte, padding included)."""
    pool = PagePool(layout, 8)
    ids = _allocate(pool, num_decoys=0)
    gen = torch.Generator().manual_seed(seed)
    for page in ids["kda"] + ids["mla"]:
        pool.page_bytes_view(page).copy_(torch.randint(0, 256, (layout.page_bytes,), generator=gen, dtype=torch.uint8))
    return pool, ids


def sentinel_pool(layout: CacheLayout, num_decoys: int) -> tuple[PagePool, dict[str, list[int]]]:
    """A pool with every byte SENTINEL and the logical pages allocated after `num_decoys` others."""
    pool = PagePool(layout, 10)
    ids = _allocate(pool, num_decoys)
    for page in range(pool.num_pages):
        pool.page_bytes_view(page).fill_(SENTINEL)
    return pool, ids


def used_bytes(layout: CacheLayout, kind: str) -> int:
    return layout.kda_state_bytes_per_group if kind == "kda" else layout.mla_block_bytes


def layouts(config=TINY4, degrees=(1, 2, 4)) -> dict[int, CacheLayout]:
    return {t: CacheLayout.for_model(config, tp_size=t) for t in degrees}


# ---- layout and plans -------------------------------------------------------------------------------
def test_shard_layout_splits_kda_heads_and_keeps_page_geometry():
    full = CacheLayout.for_model(TINY4)
    half = full.shard(2)
    assert (half.num_heads, half.tp_size, half.full_num_heads) == (2, 2, 4)
    assert (half.block_tokens, half.page_bytes, half.mla_block_bytes) == (128, 41984, 40960) == \
        (full.block_tokens, full.page_bytes, full.mla_block_bytes)
    assert half.kda_state_bytes_per_group * 2 == full.kda_state_bytes_per_group == 41984
    assert half.kda_padding_bytes == 20992 and full.kda_padding_bytes == 0
    assert half.shard(1) == full and half.shard(4) == full.shard(4) == CacheLayout.for_model(TINY4, tp_size=4)
    assert list(half.rank_heads(1)) == [2, 3] and "tp_size=2 (2 of 4 KDA heads)" in half.describe()
    state, conv = PagePool(half, 2).kda_views(0)  # a rank's pool views only its heads
    assert tuple(state.shape) == (2, 2, 32, 32) and tuple(conv.shape) == (2, 2, 3, 3, 32)
    with pytest.raises(ValueError, match="tp_size=3 does not split num_heads=4 KDA heads evenly"):
        full.shard(3)
    with pytest.raises(ValueError, match="tp_size=4 does not split num_heads=2"):
        CacheLayout.for_model(TINY, tp_size=4)
    with pytest.raises(ValueError, match="tp_rank=2, expected 0..1"):
        half.rank_heads(2)


def test_kda_plans_are_one_range_per_overlapping_rank_pair():
    lay, hb = layouts(), CacheLayout.for_model(TINY4).kda_head_bytes
    assert plan("kda", lay[1], lay[2]) == [ByteCopy(0, 0, 0, 0, 2 * hb), ByteCopy(0, 2 * hb, 1, 0, 2 * hb)]
    assert plan("kda", lay[4], lay[2]) == [ByteCopy(0, 0, 0, 0, hb), ByteCopy(1, 0, 0, hb, hb),
                                           ByteCopy(2, 0, 1, 0, hb), ByteCopy(3, 0, 1, hb, hb)]
    assert plan("kda", lay[2], lay[2]) == [ByteCopy(0, 0, 0, 0, 2 * hb), ByteCopy(1, 0, 1, 0, 2 * hb)]
    assert plan("kda", lay[4], lay[1]) == [ByteCopy(s, 0, 0, s * hb, hb) for s in range(4)]


@pytest.mark.parametrize("num_heads, degrees", [(4, (1, 2, 4)), (6, (1, 2, 3, 6))])
def test_every_destination_head_comes_from_its_source_exactly_once(num_heads, degrees):
    """Replay each plan on head labels: destination rank d must end with exactly its heads, in order
    (degrees 2 <-> 3 overlap unevenly: one destination rank reads from two sources)."""
    lay = layouts(dataclasses.replace(TINY4, linear_num_heads=num_heads), degrees)
    hb = lay[1].kda_head_bytes
    for a, b in product(degrees, repeat=2):
        dst = [[None] * lay[b].num_heads for _ in range(b)]
        for c in plan("kda", lay[a], lay[b]):
            assert c.src_start % hb == c.dst_start % hb == c.num_bytes % hb == 0
            for j in range(c.num_bytes // hb):
                assert dst[c.dst_rank][c.dst_start // hb + j] is None, (a, b, c)  # written once
                dst[c.dst_rank][c.dst_start // hb + j] = lay[a].rank_heads(c.src_rank)[c.src_start // hb + j]
        assert dst == [list(lay[b].rank_heads(d)) for d in range(b)], (a, b)


def test_mla_plans_replicate_the_used_bytes_from_one_source_each():
    lay = layouts()
    mb = lay[1].mla_block_bytes
    assert plan("mla", lay[1], lay[4]) == [ByteCopy(0, 0, d, 0, mb) for d in range(4)]
    assert plan("mla", lay[2], lay[4]) == [ByteCopy(d % 2, 0, d, 0, mb) for d in range(4)]
    assert plan("mla", lay[4], lay[1]) == [ByteCopy(0, 0, 0, 0, mb)]


# ---- in-process round trip --------------------------------------------------------------------------
def test_round_trip_tp_1_2_4_1_is_bit_identical():
    lay = layouts()
    tp1, ids1 = filled_pool(lay[1], seed=0)
    hops, current, current_ids = [], [tp1], [ids1]
    tensors = {kind: [tp1.read_pages(ids1[kind])] for kind in ("kda", "mla")}  # the tensor path, alongside
    for a, b in ((1, 2), (2, 4), (4, 1)):
        pools_ids = [sentinel_pool(lay[b], num_decoys=r + 1) for r in range(b)]
        pools, ids = [p for p, _ in pools_ids], [i for _, i in pools_ids]
        for kind in ("kda", "mla"):
            reshard_pool_pages(kind, current, [i[kind] for i in current_ids], pools, [i[kind] for i in ids])
            tensors[kind] = reshard_pages(kind, tensors[kind], lay[a], lay[b])
        hops.append((pools, ids))
        current, current_ids = pools, ids
        for pool in pools:
            pool.check_integrity()

    original = {kind: tp1.read_pages(ids1[kind]) for kind in ("kda", "mla")}
    back, back_ids = hops[-1][0][0], hops[-1][1][0]
    for kind in ("kda", "mla"):
        used = used_bytes(lay[1], kind)
        final = back.read_pages(back_ids[kind])
        assert torch.equal(final[:, :used], original[kind][:, :used]), kind
        assert bool((final[:, used:] == SENTINEL).all()), kind  # padding is never copied
        assert torch.equal(tensors[kind][0][:, :used], original[kind][:, :used]), kind
    # at TP 4, rank r's KDA page is head r's byte range of the TP-1 page, followed by untouched padding
    (pools4, ids4), hb = hops[1], lay[1].kda_head_bytes
    for r, (pool, ids) in enumerate(zip(pools4, ids4)):
        shard = pool.read_pages(ids["kda"])
        assert torch.equal(shard[:, :hb], original["kda"][:, r * hb:(r + 1) * hb])
        assert bool((shard[:, hb:] == SENTINEL).all())
        assert torch.equal(pool.read_pages(ids["mla"])[:, :lay[1].mla_block_bytes],
                           original["mla"][:, :lay[1].mla_block_bytes])
    for pools, _ in hops:
        for r, pool in enumerate(pools):  # rank r's pool has decoy pages 0..r, never written
            assert bool((pool.read_pages(list(range(r + 1))) == SENTINEL).all())


def test_a_rank_reads_its_heads_of_the_states_written_at_tp_1():
    """The shard layout means what a TP-sharded KDA layer means: rank r's S and conv tails are heads
    rank_heads(r) of the full state (conv channels which*H*dk + h*dk + d, models/state.py)."""
    lay = layouts()
    tp1, ids1 = filled_pool(lay[1], seed=1)
    gen = torch.Generator().manual_seed(2)
    layer = lay[1].kda_groups[1][1]
    state = tp1.read_kda_state(ids1["kda"][1], layer)
    state.recurrent.copy_(torch.randn(state.recurrent.shape, generator=gen))
    state.conv_tail.copy_(torch.randn(state.conv_tail.shape, generator=gen))
    tp1.write_kda_state(ids1["kda"][1], layer, state)
    pools_ids = [sentinel_pool(lay[4], num_decoys=0) for _ in range(4)]
    reshard_pool_pages("kda", [tp1], [ids1["kda"]], [p for p, _ in pools_ids], [i["kda"] for _, i in pools_ids])
    tail = state.conv_tail.view(3, 3, 4, 32)  # [K-1, (q, k, v), H, dk]
    for r, (pool, ids) in enumerate(pools_ids):
        mine = pool.read_kda_state(ids["kda"][1], layer)
        assert torch.equal(mine.recurrent, state.recurrent[r:r + 1])
        assert torch.equal(mine.conv_tail, tail[:, :, r:r + 1].reshape(3, -1))


# ---- attention on re-sliced pages ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def prefilled():
    """The tiny model (4 KDA heads) after a 150-token prefill, its states written to a TP-1 pool."""
    model = HybridLM(TINY4).init_weights(seed=5, std=0.15).eval()
    num_tokens = 150  # two MLA pages of 128 tokens, the second partial
    tokens = torch.randint(0, 256, (num_tokens,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        state = model.forward_with_state([tokens]).states[0]
    layout = CacheLayout.for_model(TINY4)
    pool = PagePool(layout, 8)
    ids = {"kda": [pool.allocate(1, ("kda", g))[0] for g in range(len(layout.kda_groups))],
           "mla": pool.allocate(layout.mla_pages_for(num_tokens), ("mla", 0))}
    for g, layers in enumerate(layout.kda_groups):
        for layer in layers:
            pool.write_kda_state(ids["kda"][g], layer, state.kda[layer])
    for layer in layout.mla_groups[0]:
        view, latent = pool.mla_view(layer), state.mla[layer]  # [P, bt, latent], [T, latent]
        for i, page in enumerate(ids["mla"]):
            chunk = latent[i * layout.block_tokens:(i + 1) * layout.block_tokens]
            view[page, :chunk.shape[0]] = chunk
    return model, pool, ids, num_tokens


def _reshard(pool, ids, layout_b):
    pools_ids = [sentinel_pool(layout_b, num_decoys=r) for r in range(layout_b.tp_size)]
    for kind in ("kda", "mla"):
        reshard_pool_pages(kind, [pool], [ids[kind]], [p for p, _ in pools_ids], [i[kind] for _, i in pools_ids])
    return pools_ids


def _kda_rank_decode(layer, pool, page, index, mixed, g, beta, heads):
    """One decode step of KDA layer `index` with only `heads` (a TP rank's column-parallel share of
    q|k|v, conv filters, g and beta), on the rank's state page; mutates it. Returns [1, h, dv]."""
    h_all, dk, kernel = layer.num_heads, layer.head_dim, layer.kernel
    state, conv = pool.kda_views(index)
    pages = torch.tensor([page])
    new = mixed.view(1, 3, h_all, 1, dk).transpose(1, 2)[:, heads]  # [1, h, 3, 1, dk]
    ext = torch.cat([conv.index_select(0, pages), new], dim=3)  # [1, h, 3, K, dk]
    taps = layer.conv_weight.view(3, h_all, dk, kernel).permute(1, 0, 3, 2)[heads]  # [h, 3, K, dk]
    qkv = F.silu((ext * taps).sum(dim=3)).float()  # [1, h, 3, dk]
    q, k = l2norm(qkv[:, :, :2]).unbind(2)
    out = kda_decode_step(q, k, qkv[:, :, 2], g[:, heads], beta[:, heads], state, pages)
    conv.index_copy_(0, pages, ext[:, :, :, 1:])
    return out


@pytest.mark.parametrize("tp", [2, 4])
@torch.no_grad()
def test_attention_on_resharded_pages_equals_tp_1(prefilled, tp):
    """KDA: each rank's decode step with its heads' q/k/v/g/beta on its state page; MLA: absorbed
    decode of the rank's query heads on its replicated latent. Concatenated per-head outputs equal
    TP 1's, and the updated KDA pages gathered back to TP 1 equal TP 1's updated pages."""
    model, pool1, ids1, num_tokens = prefilled
    layout1 = pool1.layout
    ref_pool, ref_ids = filled_pool(layout1, seed=0)  # a scratch TP-1 copy: the fixture's pool stays as prefilled
    reshard_pool_pages("kda", [pool1], [ids1["kda"]], [ref_pool], [ref_ids["kda"]])
    ranks = _reshard(pool1, ids1, layout1.shard(tp))
    gen = torch.Generator().manual_seed(tp)
    for g, layers in enumerate(layout1.kda_groups):
        for index in layers:
            layer = model.model.layers[index].self_attn
            mixed, decay, beta, _ = layer.project(torch.randn(1, TINY4.hidden_size, generator=gen))
            # TP 1 through the engine's own path (models/paged.py): decode_conv, then the paged step
            state, conv = ref_pool.kda_views(index)
            page = torch.tensor([ref_ids["kda"][g]])
            q, k, v, tails = layer.decode_conv(mixed, conv.index_select(0, page))
            reference = kda_decode_step(q, k, v, decay, beta, state, page)
            conv.index_copy_(0, page, tails)
            outputs = [_kda_rank_decode(layer, pool, ids["kda"][g], index, mixed, decay, beta,
                                        slice(pool.layout.rank_heads(r).start, pool.layout.rank_heads(r).stop))
                       for r, (pool, ids) in enumerate(ranks)]
            # each rank's heads run as a smaller batch of the same recurrence (other SIMD blocking): 1e-5 of scale
            assert scaled_err(torch.cat(outputs, dim=1), reference) <= 1e-5, (tp, index)
    gathered, gathered_ids = sentinel_pool(layout1, num_decoys=3)
    reshard_pool_pages("kda", [p for p, _ in ranks], [i["kda"] for _, i in ranks], [gathered], [gathered_ids["kda"]])
    for g, layers in enumerate(layout1.kda_groups):
        for index in layers:
            mine = gathered.read_kda_state(gathered_ids["kda"][g], index)
            ref = ref_pool.read_kda_state(ref_ids["kda"][g], index)
            # the conv tails are copies (equal by construction); the states went through the rank steps above
            assert scaled_err(mine.recurrent, ref.recurrent) <= 1e-5 and torch.equal(mine.conv_tail, ref.conv_tail)

    heads_per_rank = TINY4.num_attention_heads // tp
    for index in layout1.mla_groups[0]:
        layer = model.model.layers[index].self_attn
        q_nope, q_rope = layer.queries(torch.randn(1, TINY4.hidden_size, generator=gen), torch.tensor([num_tokens - 1]))
        w_uk, w_uv = layer.up_projections()

        def attend(pool, ids, heads):
            q_lat = torch.einsum("bhn,hnc->bhc", q_nope[:, heads].float(), w_uk[heads].float())  # [1, h, d_c]
            o_lat = paged_mla_decode(q_lat, q_rope[:, heads].float(), pool.mla_view(index),
                                     torch.tensor([ids["mla"]]), torch.tensor([num_tokens]), scale=layer.scale)
            return torch.einsum("bhc,hvc->bhv", o_lat, w_uv[heads].float())  # [1, h, v]

        reference = attend(pool1, ids1, slice(None))
        outputs = [attend(pool, ids, slice(r * heads_per_rank, (r + 1) * heads_per_rank))
                   for r, (pool, ids) in enumerate(ranks)]
        assert scaled_err(torch.cat(outputs, dim=1), reference) <= 1e-5, (tp, index)  # per-head sums, batched otherwise


# ---- bad input ------------------------------------------------------------------------------------------
def test_bad_input_raises_naming_the_value_and_what_was_expected():
    lay = layouts()
    bf16 = CacheLayout.for_model(TINY4, state_dtype=torch.bfloat16, cache_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="kind='kv', expected one of"):
        plan("kv", lay[1], lay[2])
    with pytest.raises(ValueError, match="page_bytes=41984, dst layout page_bytes=20992"):
        plan("kda", lay[1], bf16.shard(2))
    with pytest.raises(ValueError, match="state_dtype=torch.float32, dst layout state_dtype=torch.bfloat16.*"
                                         "does not convert"):
        plan("kda", lay[1], dataclasses.replace(bf16, page_bytes=lay[1].page_bytes))
    with pytest.raises(ValueError, match="block_tokens=128, dst layout block_tokens=64"):
        plan("mla", lay[1], CacheLayout.for_model(TINY4, block_tokens=64))
    src, src_ids = filled_pool(lay[1], seed=0)
    dst = [sentinel_pool(lay[2], num_decoys=0) for _ in range(2)]
    dst_pools, dst_ids = [p for p, _ in dst], [i for _, i in dst]
    with pytest.raises(ValueError, match=r"src rank 0 page \d+ is tagged \('mla', 0\), expected .* 'kda'"):
        reshard_pool_pages("kda", [src], [src_ids["mla"]], dst_pools, [i["kda"][:2] for i in dst_ids])
    with pytest.raises(ValueError, match="dst rank 1 lists 2 pages, expected 3"):
        reshard_pool_pages("kda", [src], [src_ids["kda"]], dst_pools, [dst_ids[0]["kda"], dst_ids[1]["kda"][:2]])
    with pytest.raises(ValueError, match=r"logical page 0 is in group \('kda', 2\) on dst rank 0, expected "
                                         r"\('kda', 0\)"):
        reshard_pool_pages("kda", [src], [src_ids["kda"]], dst_pools, [i["kda"][::-1] for i in dst_ids])
    with pytest.raises(ValueError, match="1 dst pools and 2 page lists"):
        reshard_pool_pages("kda", [src], [src_ids["kda"]], dst_pools[:1], [i["kda"] for i in dst_ids])
    with pytest.raises(ValueError, match="pages of 2 source ranks, expected src tp_size=1"):
        reshard_pages("kda", [src.read_pages(src_ids["kda"])] * 2, lay[1], lay[2])
    with pytest.raises(ValueError, match=r"read_byte_range bytes \[10, 41985\), expected 0 <= start <= end <= "
                                         "page_bytes=41984"):
        src.read_byte_range(src_ids["kda"], 10, 41985)
    with pytest.raises(ValueError, match=r"write_byte_range got torch.float32 \(3, 4\), expected uint8 "
                                         r"\[3, num_bytes\]"):
        src.write_byte_range(src_ids["kda"], 0, torch.zeros(3, 4))
    unchanged = [pool.read_pages(ids["kda"]) for pool, ids in dst]
    assert all(torch.equal(u, pool.read_pages(ids["kda"])) for u, (pool, ids) in zip(unchanged, dst))


# ---- two processes over gloo ----------------------------------------------------------------------------
def test_send_recv_between_two_processes_over_gloo(tmp_path):
    """TP-1 pages on process 0 -> TP-2 on processes 0 and 1 -> TP-1 on process 1: bit-identical, and
    each process sends only the byte ranges the other needs (no MLA bytes from the second source)."""
    import os

    import torch.multiprocessing as mp

    from tests.memory.tp_reshard_worker import run

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.environ["PYTHONPATH"] = root + os.pathsep + os.environ.get("PYTHONPATH", "")
    mp.spawn(run, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    out = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    full = CacheLayout.for_model(TINY)
    num_kda, num_mla = len(full.kda_groups), 2
    half_state, block = full.kda_state_bytes_per_group // 2, full.mla_block_bytes
    original, round_trip = out[0]["original"], out[1]["round_trip"]
    for rows, used in ((slice(0, num_kda), full.kda_state_bytes_per_group), (slice(num_kda, None), block)):
        assert torch.equal(round_trip[rows, :used], original[rows, :used])
        assert bool((round_trip[rows, used:] == SENTINEL).all())
    for r in range(2):
        shard = out[r]["shard"]
        assert torch.equal(shard[:num_kda, :half_state], original[:num_kda, r * half_state:(r + 1) * half_state])
        assert torch.equal(shard[num_kda:, :block], original[num_kda:, :block])
    assert out[0]["forward_kda"] == {"bytes_sent": num_kda * half_state, "bytes_received": 0,
                                     "bytes_copied": num_kda * half_state}
    assert out[1]["forward_mla"] == {"bytes_sent": 0, "bytes_received": num_mla * block, "bytes_copied": 0}
    assert out[0]["back_kda"] == {"bytes_sent": num_kda * half_state, "bytes_received": 0, "bytes_copied": 0}
    assert out[1]["back_kda"] == {"bytes_sent": 0, "bytes_received": num_kda * half_state,
                                  "bytes_copied": num_kda * half_state}
    assert out[0]["back_mla"]["bytes_sent"] == num_mla * block and out[1]["back_mla"]["bytes_sent"] == 0
