"""Worker of the context-parallel model tests (spawned over gloo; must stay importable as a module).

Each rank runs its zig-zag share of a packed batch of uneven sequences through the model with
`ContextParallelMixer`, takes a masked weighted sum of its logprobs as the loss (whole-batch weights
given before the split, so the ranks' losses sum to the one-rank loss) and saves its logprobs and
gradients; the test compares them with the one-rank `PackedMixer` run (`whole`)."""
import os

import torch
import torch.distributed as dist

LAYOUTS = {"hybrid": ["kda", "mla", "kda", "mla"], "kda": ["kda"] * 3, "mla": ["mla"] * 3}


def model_and_batch(layout: str, seq_lens: list[int], routed: bool = False, seed: int = 0):
    """The tiny config with `layout`'s mixers (dense MLPs, or MoE after the first layer when
    `routed`), seeded; packed tokens, targets (shifted on each whole sequence), per-token loss weights
    and a loss mask (the first quarter of every sequence is a prompt: no loss)."""
    from pathlib import Path

    from models.config import load_model_config
    from models.model import HybridLM

    root = Path(__file__).resolve().parents[2]
    mixers = LAYOUTS[layout]
    mlps = ["dense"] + ["moe" if routed else "dense"] * (len(mixers) - 1)
    config = load_model_config(root / "configs/model/tiny.yaml", [
        f"num_hidden_layers={len(mixers)}", f"layer_types=[{','.join(mixers)}]", f"mlp_layer_types=[{','.join(mlps)}]"])
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, 256, (n + 1,), generator=gen) for n in seq_lens]
    tokens = torch.cat([s[:-1] for s in seqs])
    targets = torch.cat([s[1:] for s in seqs])
    mask = torch.cat([torch.arange(n) >= n // 4 for n in seq_lens])
    weights = torch.rand(tokens.shape[0], generator=gen) * mask / mask.sum()
    model = HybridLM(config).init_weights(seed=1)
    return config, model, tokens, targets, weights


def whole(layout: str, seq_lens: list[int], routed: bool = False):
    """One rank, no split: (logprobs [N], loss, {name: grad})."""
    from models.model import PackedMixer
    from models.state import SegmentBatch

    _, model, tokens, targets, weights = model_and_batch(layout, seq_lens, routed)
    mixer = PackedMixer(SegmentBatch(new_lens=seq_lens, starts=[0] * len(seq_lens)))
    logp = model.packed_logprobs(model.run_layers(tokens, mixer), targets)
    loss = (logp * weights).sum()
    loss.backward()
    return logp.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def run(rank: int, world: int, init_file: str, out_dir: str, layout: str, seq_lens: list[int], routed: bool) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from models.context_parallel import ContextParallel, ContextParallelMixer, ZigZagSplit
        from models.state import SegmentBatch

        config, model, tokens, targets, weights = model_and_batch(layout, seq_lens, routed)
        cp = ContextParallel(dist.group.WORLD, rank, world)
        split = ZigZagSplit(seq_lens, world, config.linear_conv_kernel_dim - 1)
        mixer = ContextParallelMixer(SegmentBatch(new_lens=split.local_lens, starts=[0] * len(seq_lens)), cp)
        hidden = model.run_layers(split.shard(tokens, rank), mixer)
        logp = model.packed_logprobs(hidden, split.shard(targets, rank))
        loss = (logp * split.shard(weights, rank)).sum()
        loss.backward()
        torch.save({"logp": logp.detach(), "loss": loss.detach(), "sent_bytes": cp.sent_bytes,
                    "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
