"""Worker of the expert-parallel trainer/engine tests (spawned over gloo; importable as a module):
one train step on this rank's share of a batch, then greedy generation of this rank's prompts
(prefix cache on, twice: the second pass hits it), with megatron-core's expert-parallel groups."""
import os

import torch
import torch.distributed as dist

MICRO_BATCH_TOKENS = 45
PROMPTS = [[5, 6, 7] * 7, [9] * 30, [5, 6, 7] * 7 + [11, 12], [40, 41] * 9, [3] * 17]


def shares(world: int, idle_rank: int | None, lens) -> list[list[int]]:
    """Sequence indices per rank: round robin, none for `idle_rank`."""
    ranks = [r for r in range(world) if r != idle_rank]
    out = [[] for _ in range(world)]
    for i in range(len(lens)):
        out[ranks[i % len(ranks)]].append(i)
    return out


def engine_for(model):
    from rollout.engine import Engine, EngineConfig
    from rollout.kv import PrefixCacheConfig

    return Engine(model, EngineConfig.for_pages(model, 48, max_model_len=160, check_every_step=True,
                                                prefix_cache=PrefixCacheConfig(hash_block=16, model_id="tiny")))


def greedy(engine, prompts) -> list[list[int]]:
    from rollout.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    first = [o.samples[0].tokens for o in engine.generate(prompts, params)]
    again = [o.samples[0].tokens for o in engine.generate(prompts, params)]  # prefix hits
    return [first, again]


def run(rank: int, world: int, init_file: str, out_dir: str, expert: int, idle_rank: int | None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from megatron.core import parallel_state

    try:
        from models.config import load_model_config
        from models.model import HybridLM
        from rl.run.ranks import expert_groups
        from tests.trainer.test_step import OPT, make_batch
        from trainer.step import Trainer, TrainerConfig

        ep, expert_data = expert_groups(expert)  # as a run's ranks start them (rl/run/ranks.py)
        model = HybridLM(load_model_config("configs/model/tiny.yaml"), ep).init_weights(seed=3, std=0.1)
        trainer = Trainer(model, TrainerConfig(num_chunks=4, optimizer=OPT),
                          group=parallel_state.get_data_parallel_group(), expert_group=expert_data)
        lens, tokens, targets, weights = make_batch()
        mine = shares(world, idle_rank, lens)[rank]
        offsets = [sum(lens[:i]) for i in range(len(lens) + 1)]
        rows = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in mine]) if mine else torch.zeros(0, dtype=torch.long)
        w, total = weights[rows], weights.numel()
        metrics = trainer.train_step(tokens[rows], [lens[i] for i in mine], targets[rows],
                                     lambda lp, rows, seqs: -(lp * w[rows]).sum() / total,
                                     micro_batch_tokens=MICRO_BATCH_TOKENS)
        prompts = [PROMPTS[i] for i in shares(world, idle_rank, PROMPTS)[rank]]
        tokens_out = greedy(engine_for(model), prompts)
        torch.save({"state": model.state_dict(), "metrics": metrics, "expert_rank": ep.rank, "tokens": tokens_out,
                    "reductions": trainer.num_grad_reductions},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
