"""The RL update under context parallelism (rl/run/update.py with models/context_parallel.py): every
data-parallel group's sequences split zig-zag over its context ranks take the one-rank step."""
import pytest
import torch
import torch.multiprocessing as mp

from rl.run.ranks import check_layout, merge_metrics
from rl.run.update import policy_update
from tests.bounds import norm_err
from tests.rl.cp_update_worker import run
from tests.rl.test_ppo_epochs import make_batch, make_trainer
from trainer.losses import LossConfig

pytestmark = [pytest.mark.numerics]  # compares two computation orders: run under every CPU kernel path (make test-slow)


def _spawn(tmp_path, world, context, expert=1, aggregation="token-mean", quiet_rank=None):
    mp.spawn(run, args=(world, str(tmp_path / "init"), str(tmp_path), context, expert, aggregation, quiet_rank),
             nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]


def _check_step(ranks, aggregation="token-mean", quiet=False, expert=1):
    one = make_trainer(eps=1e-4)
    before = {k: v.clone() for k, v in one.model.state_dict().items()}
    want = policy_update(one, make_batch(quiet=quiet), LossConfig(aggregation=aggregation), 60)
    for rank, out in enumerate(ranks):
        for name, w in one.model.state_dict().items():
            got = out["state"][name]
            if got.shape != w.shape:  # this rank's experts
                first = out["first"][0]
                w, base = w[first:first + got.shape[0]], before[name][first:first + got.shape[0]]
            else:
                base = before[name]
            # The step (w - before) against its own norm: the split sums states, key blocks and gradients
            # in other fp32 orders than one rank (measured up to 1e-4 of the step with Adam's eps=1e-4
            # amplifying tiny gradients); a dropped hand-off or halo moves it by > 0.5.
            assert norm_err(got - base, w - base) <= 1e-3, (rank, name)
    got = merge_metrics([out["metrics"] for out in ranks])
    assert got["train_tokens"] == want["train_tokens"]  # counted once over the group, pad rows excluded
    assert got["train_sequences"] == want["train_sequences"]
    # The loss summed over ranks and the token-weighted metrics: the one-rank values, to fp32 orders. A
    # sequence-mean loss/* metric is a token-weighted mean of micro-batch means, which depends on how the
    # micro-batches fall (halved local lengths pack differently), so only token-mean's is compared.
    keys = ["loss", "loss/num_tokens", "loss/ratio_mean"] + (["loss/loss", "loss/pg_loss"] if aggregation == "token-mean" else [])
    for key in keys:
        assert abs(got[key] - want[key]) <= 1e-5 * max(1.0, abs(want[key])), key


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_two_context_ranks_take_the_one_rank_step(tmp_path, aggregation):
    _check_step(_spawn(tmp_path, 2, 2, aggregation=aggregation), aggregation)


def test_a_context_rank_without_loss_tokens_joins_the_backward_and_the_step_is_unchanged(tmp_path):
    _check_step(_spawn(tmp_path, 2, 2, quiet_rank=1), quiet=True)  # a skipped backward would deadlock here


@pytest.mark.slow
def test_expert_by_context_parallel_on_four_ranks_takes_the_one_rank_step(tmp_path):
    _check_step(_spawn(tmp_path, 4, 2, expert=2), expert=2)


def test_a_layout_that_does_not_fit_the_world_is_refused_by_name():
    with pytest.raises(ValueError, match="parallel.context=3 does not divide the 4 rank"):
        check_layout(4, 1, 3)
    with pytest.raises(ValueError, match="parallel.expert=8 does not divide the 4 rank"):
        check_layout(4, 8, 2)
    check_layout(4, 2, 2)


def test_the_config_refuses_a_context_size_that_does_not_fit():
    from rl.config import ParallelConfig
    from rl.config.checks import check_world

    with pytest.raises(ValueError, match="parallel.context=0"):
        ParallelConfig(context=0)

    class Cfg:  # the two fields check_world reads
        parallel = ParallelConfig(context=3)

        class algo:
            mini_batches = 1

    with pytest.raises(ValueError, match="parallel.context=3 does not divide the 4 rank"):
        check_world(Cfg, 4)
