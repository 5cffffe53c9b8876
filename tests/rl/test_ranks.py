"""rl/run/ranks.py without torchrun: the group shares, the metric merge rules, the weight checksum, the
disagreement error; and the data-parallel rollout's invariant (two ranks' drivers generate, between
them, exactly the one-rank driver's trajectories)."""
import math
import os

import pytest
import torch
import torch.multiprocessing as mp

from models.config import load_model_config
from models.model import HybridLM
from models.tokenizer import ByteTokenizer
from rl.run.figures import ROLLOUT_STATISTICS
from rl.run.ranks import Ranks, merge_metrics, require_same, weights_checksum
from rl.episodes.driver import DriverConfig, RolloutDriver
from rl.train import run
from rollout.engine import Engine, EngineConfig
from tests.rl.test_config import composed

pytestmark = [pytest.mark.numerics]  # compares two computation orders: run under every CPU kernel path (make test-slow)


def test_one_process_ranks_are_plain_calls():
    ranks = Ranks()
    assert ranks.is_writer and ranks.all_gather({"a": 1}) == [{"a": 1}] and ranks.sum([1.5, 2]) == [1.5, 2]
    assert ranks.check_same("x", 7) == 7 and all(ranks.owns(g) for g in range(5))
    ranks.barrier()
    shares = [[g for g in range(10) if Ranks(rank=r, world=3).owns(g)] for r in range(3)]
    assert shares == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]


def test_disagreement_names_the_ranks():
    assert require_same("w", [3, 3, 3]) == 3
    with pytest.raises(RuntimeError, match=r"ranks disagree on w: rank 0 has 3, rank 2 has 4, rank 3 has 5"):
        require_same("w", [3, 3, 4, 5])


def test_weights_checksum_sees_one_bit_and_a_swap():
    model = HybridLM(load_model_config("configs/model/tiny.yaml")).init_weights(seed=0, std=0.1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    base = weights_checksum(state)
    assert base == weights_checksum({k: v.clone() for k, v in reversed(list(state.items()))}) < 2**52
    assert weights_checksum(state, slice_numel=1000) == base  # slicing does not change it
    name = next(k for k, v in state.items() if v.dtype == torch.float32 and v.numel() > 1)
    flipped = dict(state)
    flipped[name] = state[name].clone()
    flipped[name].view(-1).view(torch.int32)[0] ^= 1  # the lowest mantissa bit
    swapped = dict(state)
    swapped[name] = state[name].clone().reshape(-1)[[1, 0, *range(2, state[name].numel())]].reshape(state[name].shape)
    assert weights_checksum(flipped) != base and weights_checksum(swapped) != base


def test_merge_metrics_rules():
    ranks = [{"rollout_seconds": 2.0, "rollout_tokens": 30.0, "rollout_tok_s": 15.0, "loss": 0.25,
              "train_tokens": 30.0, "loss/pg_loss": 1.0, "loss/ratio_max": 1.5, "seconds/train": 1.0,
              "micro_batches": 2.0, "stale_token_frac": 0.0},
             {"rollout_seconds": 4.0, "rollout_tokens": 10.0, "rollout_tok_s": 2.5, "loss": 0.5,
              "train_tokens": 10.0, "loss/pg_loss": 3.0, "loss/ratio_max": 1.25, "seconds/train": 3.0,
              "micro_batches": 1.0, "stale_token_frac": 1.0}]
    out = merge_metrics(ranks)
    assert out == {"rollout_seconds": 4.0, "rollout_tokens": 40.0, "rollout_tok_s": 10.0, "loss": 0.75,
                   "train_tokens": 40.0, "loss/pg_loss": 1.5, "loss/ratio_max": 1.5, "seconds/train": 3.0,
                   "micro_batches": 2.0, "stale_token_frac": 0.25}
    # a rank without work has no loss/* metrics and weighs nothing
    empty = {"rollout_seconds": 0.0, "rollout_tokens": 0.0, "rollout_tok_s": 0.0, "loss": 0.0, "train_tokens": 0.0}
    assert merge_metrics([ranks[0], empty])["loss/pg_loss"] == 1.0
    assert math.isnan(merge_metrics([empty | {"stale_token_frac": 0.0}])["stale_token_frac"])
    # entropy per sampled token: weighted by the rollout tokens (30 at 1.0 nat, 10 at 3.0)
    assert merge_metrics([ranks[0] | {"entropy": 1.0}, ranks[1] | {"entropy": 3.0}])["entropy"] == 1.5
    with pytest.raises(KeyError, match="no rule merges metric 'mystery'"):
        merge_metrics([{"mystery": 1.0}])


def test_the_kv_cache_metrics_merge_over_ranks():
    a = {"prefix_hit_tokens": 30.0, "kv_computed_tokens": 70.0, "prefix_hit_frac": 0.3, "host_pool_bytes": 4.0,
         "ref_stream_s": 1.0}
    b = {"prefix_hit_tokens": 10.0, "kv_computed_tokens": 90.0, "prefix_hit_frac": 0.1, "host_pool_bytes": 4.0,
         "ref_stream_s": 2.0}
    out = merge_metrics([a, b])
    assert out["prefix_hit_frac"] == 40.0 / 200.0 and out["host_pool_bytes"] == 8.0 and out["ref_stream_s"] == 2.0


def test_the_speculation_metrics_merge_over_ranks():
    """Acceptance over all ranks is kept / proposed tokens summed, not the mean of the ranks' rates."""
    a = {"spec_proposed": 100.0, "spec_accepted": 80.0, "spec_verifications": 30.0, "spec_acceptance": 0.8}
    b = {"spec_proposed": 10.0, "spec_accepted": 0.0, "spec_verifications": 10.0, "spec_acceptance": 0.0}
    out = merge_metrics([a, b])
    assert out["spec_acceptance"] == 80.0 / 110.0 and out["spec_verifications"] == 40.0 and out["spec_proposed"] == 110.0


def test_every_metric_a_run_with_every_mechanism_logs_has_a_merge_rule(tmp_path):
    """The default experiment's mechanisms (prefix cache, host pool, spill, streamed reference,
    partial rollouts, and speculative decoding): a metric without a rule would stop every multi-rank run
    at its first merge."""
    history = run(composed(f"run_dir={tmp_path}", "experiment=cpu_demo", "experiment.iterations=3",
                           "engine.speculative=ngram", "warmup.steps=0", "tracking.wandb_mode=disabled",
                           "tracking.progress=false", "tracking.plots=false"))
    after_merge = {"groups_trained", "reward_mean", "reward_correct_frac", "engine_checksum",
                   *ROLLOUT_STATISTICS}  # global already
    for metrics in history:
        merged = {k: v for k, v in metrics.items() if k not in after_merge}
        assert merge_metrics([merged, merged]).keys() == merged.keys()
    assert any("prefix_hit_tokens" in m and "loss" in m for m in history)
    assert all("spec_acceptance" in m for m in history)


def _driver(rank: int, world: int) -> RolloutDriver:
    model = HybridLM(load_model_config("configs/model/tiny.yaml")).init_weights(seed=0, std=0.1)
    engine = Engine(model, EngineConfig.for_pages(model, 64, max_model_len=128))
    return RolloutDriver(engine, ByteTokenizer(), "majority_digit", {},
                         DriverConfig(groups_per_iteration=5, max_new_tokens=3, temperature=1.0, top_p=1.0, top_k=0),
                         group_size=4, seed=11, rank=rank, world=world)


def test_two_ranks_generate_exactly_the_one_rank_trajectories():
    """Seeds derive from the run seed and the global group index, and the engine's per-request
    generators make a request's tokens independent of what shares its batch: the split changes no
    token; behaviour logprobs differ only by the rounding of another batch composition (~2e-6 seen)."""
    def trajectories(drivers):
        out = {}
        for _ in range(2):  # two iterations: group indices go on across them
            for d in drivers:
                assert d.groups_next_iteration == sum(d.rank == g % d.world for g in range(d.next_group, d.next_group + 5))
                d.run_iteration()
                out.update({t.traj_id: t for g in d.take_finished_groups() for t in g})
        return out

    one = trajectories([_driver(0, 1)])
    split = trajectories([_driver(0, 2), _driver(1, 2)])
    assert sorted(one) == sorted(split) and len(one) == 2 * 5 * 4
    for key, t in one.items():
        u = split[key]
        assert (t.tokens, t.versions, t.reward) == (u.tokens, u.versions, u.reward), key
        assert t.logprobs == pytest.approx(u.logprobs, abs=1e-5), key
    with pytest.raises(ValueError, match="expected 0 <= rank < world"):
        _driver(2, 2)


def _gloo_worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        ranks = Ranks(rank=rank, world=2)
        gathered = ranks.all_gather({"rank": rank})
        total = ranks.sum([1.0, rank])
        ranks.check_same("a value every rank agrees on", 42)
        try:
            ranks.check_same("the engine weights' checksum", 100 + rank)
            error = ""
        except RuntimeError as err:
            error = str(err)
        torch.save({"gathered": gathered, "total": total, "error": error}, os.path.join(out_dir, f"r{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_collectives_over_gloo_and_the_checksum_error_on_every_rank(tmp_path):
    mp.spawn(_gloo_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        out = torch.load(tmp_path / f"r{rank}.pt")
        assert out["gathered"] == [{"rank": 0}, {"rank": 1}] and out["total"] == [2.0, 1.0]
        assert out["error"] == "ranks disagree on the engine weights' checksum: rank 0 has 100, rank 1 has 101"


def test_micro_batch_metrics_are_combined_not_the_last_one():
    from rl.run.update import combine_micro_batches

    parts = [(30.0, {"pg_loss": 1.0, "ratio_max": 1.5, "num_tokens": 30.0, "kl": 0.2}),
             (10.0, {"pg_loss": 3.0, "ratio_max": 1.25, "num_tokens": 10.0, "kl": 0.6}),
             (0.0, {"pg_loss": float("nan"), "ratio_max": 1.0, "num_tokens": 0.0, "kl": float("nan")})]
    out = combine_micro_batches(parts)
    assert out == {"pg_loss": 1.5, "ratio_max": 1.5, "num_tokens": 40.0, "kl": pytest.approx(0.3)}
    assert combine_micro_batches([]) == {}
