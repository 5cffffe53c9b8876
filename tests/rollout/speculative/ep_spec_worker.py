"""Worker of the expert-parallel speculation test (spawned over gloo; must stay importable as a module)."""
import os

import torch
import torch.distributed as dist

PROMPTS = [[5, 6, 7] * 7, [9, 4] * 15, [5, 6, 7] * 7 + [11, 12], [40, 41, 42, 43] * 5, [3, 1] * 9, [7, 8] * 12]
"""Repeating prompts: the n-gram proposer has something to copy."""


def model(ep=None):
    """The tiny config with 8 experts, seeded (whole, or this rank's half of every MoE layer's experts)."""
    from pathlib import Path

    from models.config import load_model_config
    from models.model import HybridLM

    root = Path(__file__).resolve().parents[3]
    config = load_model_config(root / "configs/model/tiny.yaml", ["num_experts=8"])
    return HybridLM(config, ep).init_weights(seed=1, std=0.15).eval()


def generate(m, prompts, speculative: str):
    from rollout.engine import Engine, EngineConfig
    from rollout.sampling import SamplingParams

    engine = Engine(m, EngineConfig.for_pages(m, 64, max_model_len=160, check_every_step=True,
                                              speculative=speculative))
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True))
    verified = engine.speculator.num_verifications if engine.speculator is not None else 0
    return [o.samples[0].tokens for o in outs], [o.samples[0].logprobs for o in outs], verified


def run(rank: int, world: int, init_file: str, out_dir: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from models.expert_parallel import ExpertParallel

        m = model(ExpertParallel(dist.group.WORLD, rank, world))
        tokens, logprobs, verified = generate(m, [p for i, p in enumerate(PROMPTS) if i % world == rank], "ngram")
        torch.save({"tokens": tokens, "logprobs": logprobs, "verified": verified}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()
