"""Worker of the context-parallel update tests (spawned over gloo; must stay importable as a module):
megatron-core's groups for `context` x `expert` over the world, each data-parallel group's share of
the batch split zig-zag over its context ranks, one `policy_update`."""
import os

import torch
import torch.distributed as dist


def run(rank: int, world: int, init_file: str, out_dir: str, context: int, expert: int, aggregation: str,
        quiet_rank: int | None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from megatron.core import parallel_state

        from models.context_parallel import ZigZagSplit
        from models.model import HybridLM
        from rl.run.ranks import model_parallel_groups
        from rl.run.update import PackedBatch, policy_update
        from tests.rl.test_ppo_epochs import make_batch, make_model
        from trainer.host_adam import OptimizerConfig
        from trainer.losses import LossConfig
        from trainer.step import Trainer, TrainerConfig

        ep, expert_data, cp = model_parallel_groups(expert, context)
        whole = make_model()
        model = HybridLM(whole.config, ep, cp)
        model.load_state_dict({k: v for k, v in whole.state_dict().items()} if ep is None else _experts_of(whole, model))
        trainer = Trainer(model, TrainerConfig(num_chunks=2, optimizer=OptimizerConfig(lr=1e-3, eps=1e-4, backend="torch")),
                          group=parallel_state.get_data_parallel_group(with_context_parallel=True),
                          expert_group=expert_data)
        batch = make_batch(quiet=quiet_rank is not None)
        dp_rank, dp_world = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
        groups = [batch.trajectories[4 * g:4 * g + 4] for g in range(2) if g % dp_world == dp_rank]
        counts = (sum(sum(t.policy[1:]) for t in batch.trajectories), len(batch.trajectories))
        mine = PackedBatch(groups, "grpo")
        local = mine.shard(ZigZagSplit(mine.seq_lens, context, 3), cp.rank)
        if rank == quiet_rank:
            assert not local.mask.any()  # this rank's fragments are all prompt: no loss token of its own
        metrics = policy_update(trainer, local, LossConfig(aggregation=aggregation), 60, global_counts=counts)
        torch.save({"state": {k: v.clone() for k, v in model.state_dict().items()}, "metrics": metrics,
                    "first": [m.mlp.experts.first for m in model.model.layers if hasattr(m.mlp, "experts")][:1]},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _experts_of(whole, model) -> dict:
    """The whole model's state with each MoE layer's experts cut to the ones `model` holds."""
    state = {}
    mine = {n: p for n, p in model.state_dict().items()}
    for name, value in whole.state_dict().items():
        if ".experts.w" in name and value.shape != mine[name].shape:
            first = next(m.mlp.experts.first for i, m in enumerate(model.model.layers) if f"layers.{i}." in name)
            value = value[first:first + mine[name].shape[0]]
        state[name] = value
    return state
