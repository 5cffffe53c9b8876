"""policy_update with ppo_epochs x mini_batches: the defaults are the one-step update bit for bit;
more steps clip against the policy at the start of the update and lower its surrogate loss; epochs
under data parallelism equal one rank, mini-batches there are refused."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from models.config import load_model_config
from models.model import HybridLM
from rl.config import AlgoConfig
from rl.episodes.driver import Trajectory
from rl.run.update import PackedBatch, mini_batch_split, old_logprobs, policy_update
from trainer.chunks import ChunkedModel
from trainer.losses import LossConfig, Segments, rl_loss
from trainer.host_adam import OptimizerConfig
from trainer.step import Trainer, TrainerConfig, micro_batches

LENS = [34, 10, 51, 18, 27, 9, 40, 22]


def make_model() -> HybridLM:
    return HybridLM(load_model_config("configs/model/tiny.yaml")).init_weights(seed=3, std=0.1)


def make_trainer(lr: float = 1e-3, eps: float = 1e-8) -> Trainer:
    return Trainer(make_model(), TrainerConfig(num_chunks=2, optimizer=OptimizerConfig(lr=lr, eps=eps, backend="torch")))


def make_batch(quiet: bool = False) -> PackedBatch:
    """Two groups of four; behaviour logprobs are the model's own (+ noise on a few tokens: stale
    ones), so the truncated IS weight is near 1 as in a run. quiet: policy tokens only in the first
    and last quarter fragments of each sequence (as two context-parallel ranks cut it, fragments of
    at least 3 tokens), so the second rank's share holds no loss token."""
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 259, (n,), generator=gen).tolist() for n in LENS]
    policy = [[t >= n // 3 for t in range(n)] for n in LENS]
    if quiet:
        frags = [max(-(-(n - 1) // 4), 3) for n in LENS]
        policy = [[t >= 1 and (t - 1 < f or t - 1 >= 3 * f) for t in range(n)] for n, f in zip(LENS, frags)]
    seq_lens = [n - 1 for n in LENS]
    flat = torch.tensor([x for t in tokens for x in t[:-1]]), torch.tensor([x for t in tokens for x in t[1:]])
    with torch.no_grad():
        logp = ChunkedModel(make_model(), 2).forward_logprobs(flat[0], seq_lens, flat[1])  # [N]
    logp = logp + 0.05 * torch.randn(logp.shape, generator=gen)
    trajs, offset = [], 0
    for k, (tok, pol) in enumerate(zip(tokens, policy)):
        lp = [0.0] + [v if p else 0.0 for v, p in zip(logp[offset:offset + len(tok) - 1].tolist(), pol[1:])]
        offset += len(tok) - 1
        trajs.append(Trajectory(f"t{k}", k // 4, k % 4, tok, pol, lp, [1 if p else -1 for p in pol], len(tok) // 3,
                                reward=float((k * 5) % 3 == 0)))
    return PackedBatch([trajs[:4], trajs[4:]], "grpo")


def previous_update(trainer: Trainer, batch: PackedBatch, loss_config: LossConfig, micro_batch_tokens,
                    global_counts=None) -> dict[str, float]:
    """The one-step update as policy_update did it before mini-batches and epochs (the twin the
    defaults must equal bit for bit): old_logp = the step's own logprobs, detached."""
    policy_tokens = [sum(t.policy[1:]) for t in batch.trajectories]
    total_valid, total_seqs = global_counts or (sum(policy_tokens), batch.num_sequences)

    def loss_fn(logp, rows, seqs):
        segments = Segments(batch.seq_of_row[rows] - seqs[0], len(seqs))
        loss, _ = rl_loss(logp, logp.detach(), batch.advantages[rows], batch.mask[rows], loss_config,
                          behaviour_logp=batch.behaviour[rows], segments=segments)
        valid = sum(policy_tokens[i] for i in seqs)
        share = valid / max(1, total_valid) if loss_config.aggregation == "token-mean" else len(seqs) / total_seqs
        return loss * share

    return trainer.train_step(batch.token_ids, batch.seq_lens, batch.targets, loss_fn, micro_batch_tokens)


@pytest.mark.parametrize("micro_batch_tokens,aggregation", [(None, "token-mean"), (60, "token-mean"),
                                                            (60, "seq-mean-token-mean")])
def test_the_defaults_are_the_previous_one_step_update_bit_for_bit(micro_batch_tokens, aggregation):
    batch, loss = make_batch(), LossConfig(aggregation=aggregation)
    ours, theirs = make_trainer(), make_trainer()
    metrics = policy_update(ours, batch, loss, micro_batch_tokens, global_counts=(999, 11))
    expected = previous_update(theirs, batch, loss, micro_batch_tokens, global_counts=(999, 11))
    for (name, p), q in zip(ours.model.named_parameters(), theirs.model.parameters()):
        assert torch.equal(p, q), name
    for key, value in expected.items():
        assert metrics[key] == value, key
    assert metrics["optimizer_steps"] == 1 and metrics["approx_kl"] == 0.0
    assert metrics["clip_frac"] == metrics["loss/clip_frac"] == 0.0  # ratio exactly 1: nothing to clip


def test_two_epochs_of_two_mini_batches_take_four_steps_clip_and_lower_the_surrogate():
    batch, loss = make_batch(), LossConfig()
    trainer = make_trainer(lr=1e-2)
    old = old_logprobs(trainer, batch, None)  # pi_old: the policy at the start of the update

    def surrogate() -> float:
        new = old_logprobs(trainer, batch, None)
        value, _ = rl_loss(new, old, batch.advantages, batch.mask, loss, behaviour_logp=batch.behaviour,
                           segments=Segments(batch.seq_of_row, batch.num_sequences))
        return value.item()

    before = surrogate()
    metrics = policy_update(trainer, batch, loss, 60, ppo_epochs=2, mini_batches=2)
    assert metrics["optimizer_steps"] == 4 and trainer.step_count == 4 and trainer.optimizer.schedule_step == 4
    assert metrics["micro_batches"] >= 4 and metrics["skipped"] == 0
    assert metrics["clip_frac"] > 0 and metrics["loss/clip_frac"] > 0  # the later steps moved past the clip
    assert metrics["approx_kl"] > 0
    assert metrics["loss/num_tokens"] == sum(sum(t.policy[1:]) for t in batch.trajectories)
    assert surrogate() < before


def test_old_logprobs_are_the_policys_own_whatever_the_micro_batches():
    batch, trainer = make_batch(), make_trainer()
    whole = old_logprobs(trainer, batch, None)  # [N]
    assert whole.shape == batch.token_ids.shape
    assert torch.allclose(old_logprobs(trainer, batch, 60), whole, atol=1e-5)
    metrics = policy_update(trainer, batch, LossConfig(), 60, ppo_epochs=3)
    assert metrics["optimizer_steps"] == 3 and trainer.step_count == 3


def test_mini_batches_are_consecutive_sequences_sizes_within_one():
    assert mini_batch_split(8, 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert mini_batch_split(8, 1) == [list(range(8))]
    assert mini_batch_split(2, 4) == [[0], [1]]  # no empty mini-batch: fewer steps
    assert mini_batch_split(0, 4) == [[]]  # a data-parallel rank without sequences still steps


def test_a_batch_with_fewer_sequences_than_mini_batches_takes_one_step_per_sequence():
    batch = make_batch()
    small = PackedBatch([batch.trajectories[:4]], "grpo")
    metrics = policy_update(make_trainer(), small, LossConfig(), None, mini_batches=6)
    assert metrics["optimizer_steps"] == 4


@pytest.mark.parametrize("kwargs,message", [(dict(ppo_epochs=0), "ppo_epochs=0, mini_batches=1, expected both >= 1"),
                                            (dict(mini_batches=0), "ppo_epochs=1, mini_batches=0, expected both")])
def test_bad_counts_are_refused_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        policy_update(make_trainer(), make_batch(), LossConfig(), None, **kwargs)
    with pytest.raises(ValueError, match="algo." + message.replace(", mini_batches", ", algo.mini_batches")):
        AlgoConfig(**kwargs)


def dp_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Rank r trains on group r of the batch, normalised by the global counts (as the orchestrator)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        batch = make_batch()
        trajs = batch.trajectories
        mine = PackedBatch([trajs[4 * rank:4 * rank + 4]], "grpo")
        counts = (sum(sum(t.policy[1:]) for t in trajs), len(trajs))
        trainer = make_trainer(eps=1e-4)
        try:
            policy_update(trainer, mine, LossConfig(), 60, global_counts=counts, mini_batches=2)
            refused = ""
        except ValueError as err:
            refused = str(err)
        metrics = policy_update(trainer, mine, LossConfig(), 60, global_counts=counts, ppo_epochs=2)
        torch.save({"state": trainer.model.state_dict(), "metrics": metrics, "refused": refused},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_epochs_under_two_ranks_equal_one_rank_and_mini_batches_there_are_refused(tmp_path):
    mp.spawn(dp_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    one = make_trainer(eps=1e-4)
    expected = policy_update(one, make_batch(), LossConfig(), 60, ppo_epochs=2)
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert "mini_batches=2 with 2 data-parallel ranks" in out["refused"]
        assert out["metrics"]["optimizer_steps"] == expected["optimizer_steps"] == 2
        for name, q in one.model.state_dict().items():
            p = out["state"][name]
            assert (p - q).norm() <= 1e-6 * max(q.norm(), 1e-12), name
