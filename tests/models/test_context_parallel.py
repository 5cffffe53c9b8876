"""Context parallelism in the model (models/context_parallel.py): C processes over gloo, each holding
its zig-zag share of packed uneven sequences, against the unsplit batch in one process."""
import pytest
import torch
import torch.multiprocessing as mp

from models.context_parallel import ContextParallel, ZigZagSplit, comm_bytes
from tests.bounds import norm_err, scaled_err
from tests.models.cp_worker import model_and_batch, run, whole

pytestmark = [pytest.mark.numerics]  # compares two computation orders: run under every CPU kernel path (make test-slow)


def _spawn(tmp_path, world: int, layout: str, seq_lens: list[int], routed: bool = False):
    mp.spawn(run, args=(world, str(tmp_path / "init"), str(tmp_path), layout, seq_lens, routed), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def _check(ranks, layout: str, seq_lens: list[int], routed: bool = False) -> None:
    logp, loss, grads = whole(layout, seq_lens, routed)
    split = ZigZagSplit(seq_lens, len(ranks), 3)
    # The split sums KDA states as M S0 + S_local and attention as merged key blocks: other fp32 orders
    # than one rank's (measured up to 2e-7 of the logprobs' scale); a dropped hand-off, halo or key block
    # moves them by > 1e-2 of it.
    assert scaled_err(split.unshard([r["logp"] for r in ranks]), logp) <= 1e-5
    assert abs(sum(r["loss"] for r in ranks).item() - loss.item()) <= 1e-5 * abs(loss.item())
    for name, g in grads.items():
        # each gradient against its own norm (measured up to 2e-6; the mutations above: > 0.6)
        assert norm_err(sum(r["grads"][name] for r in ranks if name in r["grads"]), g) <= 1e-4, name


@pytest.mark.parametrize("layout", ["hybrid", "kda", "mla"])
@pytest.mark.parametrize("world", [2, 4])
def test_split_sequences_give_the_one_rank_logprobs_loss_and_gradients(tmp_path, layout, world):
    seq_lens = [37, 100, 9]  # uneven, none divisible by 2C, one shorter than 2C x the conv halo
    _check(_spawn(tmp_path, world, layout, seq_lens), layout, seq_lens)


def test_a_routed_model_split_over_four_ranks_equals_one_rank(tmp_path):
    seq_lens = [300, 41]
    _check(_spawn(tmp_path, 4, "hybrid", seq_lens, routed=True), "hybrid", seq_lens, routed=True)


@pytest.mark.slow
def test_sixteen_thousand_tokens_split_over_two_ranks_equal_one_rank(tmp_path):
    seq_lens = [12000, 4001]
    _check(_spawn(tmp_path, 2, "hybrid", seq_lens), "hybrid", seq_lens)


def test_the_bytes_sent_are_the_analytic_count(tmp_path):
    seq_lens = [37, 100, 9]
    ranks = _spawn(tmp_path, 2, "hybrid", seq_lens)
    config = model_and_batch("hybrid", seq_lens)[0]
    want = comm_bytes(config, seq_lens, 2, dtype_bytes=4)
    assert [r["sent_bytes"] for r in ranks] == [want, want]


def test_the_split_pads_each_sequence_at_its_end_and_never_truncates():
    split = ZigZagSplit([5, 9, 1], size=2, min_fragment_len=3)
    assert split.fragment_lens == [3, 3, 3]  # ceil(n / 4) raised to the conv halo
    assert split.padded_lens == [12, 12, 12] and split.local_lens == [6, 6, 6]
    rows = [split.source_rows(r) for r in range(2)]
    real = sorted(x for r in rows for x in r if x >= 0)
    assert real == list(range(15))  # every token on exactly one rank
    # rank 0 holds fragments 0 and 3, rank 1 fragments 1 and 2, of every sequence
    assert rows[0][:6] == [0, 1, 2, -1, -1, -1] and rows[1][:6] == [3, 4, -1, -1, -1, -1]
    assert split.positions(1)[:6] == [3, 4, 5, 6, 7, 8]
    values = torch.arange(15.0)
    shards = [split.shard(values, r, fill=-1.0) for r in range(2)]
    assert torch.equal(split.unshard(shards), values)  # a copy: exact
    assert (shards[0][3:6] == -1).all()


def test_targets_shifted_before_the_split_are_right_at_every_fragment_boundary():
    tokens = torch.arange(1, 18)  # a sequence of 17: inputs 0..15, targets 1..16
    split = ZigZagSplit([16], size=2)
    inputs, targets = split.shard(tokens[:-1], 0), split.shard(tokens[1:], 0)
    assert torch.equal(targets, inputs + 1)  # each local row's target is its own next token, boundary rows too


def test_bad_splits_are_refused_by_name():
    with pytest.raises(ValueError, match="size 0"):
        ZigZagSplit([4], size=0)
    with pytest.raises(ValueError, match=r"\[0\]"):
        ZigZagSplit([3, 0], size=2)
    with pytest.raises(ValueError, match="rank 2 of size 2"):
        ContextParallel(None, 2, 2)
