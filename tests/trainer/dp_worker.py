"""Worker of the 2-process data-parallel test (spawned; must stay importable as a module)."""
import os

import torch
import torch.distributed as dist


def run(rank: int, world: int, init_file: str, out_dir: str, micro_batch_tokens: int | None = None,
        dtype: str = "fp32") -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from megatron.core import parallel_state

        from models.precision import cast_parameters, parse_dtype
        from tests.trainer.test_step import OPT, make_batch, make_model
        from trainer.step import Trainer, TrainerConfig

        lens, tokens, targets, weights = make_batch()
        # split the batch by sequences: rank 0 gets the first half, rank 1 the rest
        half = len(lens) // 2
        mine = range(0, half) if rank == 0 else range(half, len(lens))
        offsets = [sum(lens[:i]) for i in range(len(lens) + 1)]
        rows = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in mine])
        total = weights.numel()  # the global token count: rank losses sum to the global loss
        # Process groups come from megatron-core (DP = 2 here; TP/PP = 1), as in a real run.
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        trainer = Trainer(cast_parameters(make_model(), parse_dtype(dtype)), TrainerConfig(num_chunks=4, optimizer=OPT),
                          group=parallel_state.get_data_parallel_group())
        w = weights[rows]
        metrics = trainer.train_step(tokens[rows], [lens[i] for i in mine], targets[rows],
                                     lambda lp, rows, seqs: -(lp * w[rows]).sum() / total,
                                     micro_batch_tokens=micro_batch_tokens)
        torch.save({"state": trainer.model.state_dict(), "metrics": metrics,
                    "masters": [m.detach().clone() for m in trainer.optimizer.masters]},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
