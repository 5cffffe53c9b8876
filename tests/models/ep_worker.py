"""Worker of the expert-parallel model tests (spawned over gloo; must stay importable as a module)."""
import os

import torch
import torch.distributed as dist


def model_and_batch(num_experts: int = 8):
    """The tiny config with `num_experts` experts, whole, seeded; a packed 3-sequence batch."""
    from pathlib import Path

    from models.config import load_model_config
    from models.model import HybridLM

    root = Path(__file__).resolve().parents[2]
    config = load_model_config(root / "configs/model/tiny.yaml", [f"num_experts={num_experts}"])
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (3, 12), generator=gen)
    return config, HybridLM(config).init_weights(seed=1), tokens


def run(rank: int, world: int, init_file: str, out_dir: str, num_experts: int, idle_rank: int | None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from models.expert_parallel import ExpertParallel
        from models.model import HybridLM

        config, _, tokens = model_and_batch(num_experts)
        ep = ExpertParallel(dist.group.WORLD, rank, world)
        model = HybridLM(config, ep).init_weights(seed=1)
        out = {}
        if rank == idle_rank:  # no tokens: joins every exchange, forward and backward
            model.join_experts()
            with torch.enable_grad():
                model.join_experts().sum().backward()
        else:
            with torch.no_grad():
                out["logits"] = model(tokens)
            logits = model(tokens)
            (logits.float().square().mean()).backward()
        out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out["first"] = model.model.layers[1].mlp.experts.first
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
