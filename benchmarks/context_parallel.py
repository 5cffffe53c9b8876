"""Context parallelism over gloo processes (each holding its zig-zag share of one long sequence)
against one process holding it whole, in the same run, plus the planner's 1M-token plan of the 48B.

    python -m benchmarks.context_parallel [--quick] [--length 16384] [--long-length 131072]

On the tiny model (8 layers, 3 KDA : 1 MLA, MoE): one trainer step (`Trainer.train_step`, 2 VPP
chunks) of one sequence of `--length` tokens at C = 1, 2 and 4, each rank's activation peak taken
by the trainer's meter (`Trainer.memory_meter`: autograd's saved tensors, the weights excluded) and
its step seconds (C ranks share the host's 2 cores: one intra-op thread per rank at C >= 2, two at
C = 1). The longest trainable length under one per-rank cap (C = 1's peak at `--length`): C = 4 is
measured at `--long-length` and its peak scaled linearly to the cap (peaks are linear in length:
the planner's model and the two C = 4 points printed say so). Bytes: what each rank handed to the
context group's collectives (`ContextParallel.sent_bytes`) vs the analytic count
(`models.context_parallel.comm_bytes`: one forward and backward of every layer, plus the graph-free
forward the step runs for every chunk but the last). Accuracy: per-token logprobs and every parameter's gradient
of a `--check-length` batch of uneven sequences at C = 2 vs one rank (relative to their scale).
The sequential state hand-off (LASP-1) against the gather, at C = 2 and 4 on `--length` tokens: one
KDA layer's forward (no graph) over the same sharded input, timed both ways (best of
`HANDOFF_REPEATS`) and compared: with the hand-off, fragment j starts only once fragment j-1's end
state and conv tail have reached its owner (2C dependent steps, one send each); with the gather
every rank runs its two fragments at once (K extra value columns carry M) and chains the gathered
[S_local | M]. Forward only: the backward's reverse hand-off has the same shape. Nothing here ran on
a GPU.

Last line: cp2_peak_vs_cp1= cp4_peak_vs_cp1= cp4_max_tokens_vs_cp1= cp2_step_time_vs_cp1=
cp_comm_bytes_vs_model= (targets <= 0.6, <= 0.35, >= 3.5, <= 0.75 reported, 0.9-1.1) cp_logprob_rel_err=
cp_grad_rel_err= plan_48b_1m_tokens_fits= plan_48b_1m_seconds=, cp2_kda_gather_vs_handoff_time=
cp4_kda_gather_vs_handoff_time= kda_handoff_rel_err= mla_ring_vs_latent_bytes_48b=
mla_ring_vs_latent_bytes_tiny= (analytic), then the measured figures.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks import parse_args

ROOT = Path(__file__).resolve().parents[1]
CHECK_LENS_FRACTIONS = (0.55, 0.3, 0.15)
"""The accuracy batch: three uneven sequences sharing `--check-length` tokens."""
HANDOFF_REPEATS = 3
"""Timed forwards of each KDA path (the best one counts: the ranks share the host's cores)."""


def _config():
    from models.config import load_model_config

    return load_model_config(ROOT / "configs/model/tiny.yaml")


def _sequence(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (length + 1,), generator=torch.Generator().manual_seed(seed))


def _worker(rank: int, world: int, init_file: str, out_dir: str, length: int, check_lens: list[int],
            handoff: bool) -> None:
    torch.set_num_threads(max(1, 2 // world))
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        out = _measure(rank, world, length, check_lens)
        if handoff:
            out.update(_kda_paths(rank, world, length))
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        if world > 1:
            dist.destroy_process_group()


def _measure(rank: int, world: int, length: int, check_lens: list[int]) -> dict:
    from models.context_parallel import ContextParallel, ZigZagSplit, comm_bytes
    from models.model import HybridLM
    from trainer.chunks import chunk_specs
    from trainer.host_adam import OptimizerConfig
    from trainer.step import Trainer, TrainerConfig

    config = _config()
    cp = ContextParallel(dist.group.WORLD if world > 1 else None, rank, world)
    model = HybridLM(config, context_parallel=cp).init_weights(seed=1)
    trainer = Trainer(model, TrainerConfig(num_chunks=2, optimizer=OptimizerConfig(lr=1e-4, backend="torch")),
                      group=dist.group.WORLD if world > 1 else None)
    seq = _sequence(length)
    split = ZigZagSplit([length], world, config.linear_conv_kernel_dim - 1)
    tokens, targets = split.shard(seq[:-1], rank), split.shard(seq[1:], rank)
    weights = split.shard(torch.full((length,), 1.0 / length), rank)  # token mean over the whole sequence

    def loss_fn(logp, rows, seqs):
        return (logp * weights[rows]).sum()

    out: dict = {}
    cp.sent_bytes = 0
    with trainer.memory_meter() as peaks:
        start = time.perf_counter()
        trainer.train_step(tokens, split.local_lens, targets, loss_fn)
        out["step_s"] = time.perf_counter() - start
    out["peak"] = peaks["device_activation_peak"]
    # the step runs every chunk but the last once more without a graph (trainer/chunks.py): its layers' gathers twice
    no_grad = [config.layer_types[i] for spec in chunk_specs(model, 2, "layers")[:-1] for i in spec.layers]
    out["sent_bytes"] = cp.sent_bytes
    out["analytic_bytes"] = (comm_bytes(config, [length], world, 4)
                             + comm_bytes(config, [length], world, 4, backward=False, layer_types=no_grad))
    if check_lens:
        out.update(_accuracy(config, cp, rank, world, check_lens))
    return out


def _accuracy(config, cp, rank: int, world: int, seq_lens: list[int]) -> dict:
    """Logprobs (this rank's rows, unsplit by the caller) and gradients of a weighted logprob sum."""
    from models.context_parallel import ZigZagSplit
    from models.model import HybridLM, PackedMixer
    from models.state import SegmentBatch

    model = HybridLM(config, context_parallel=cp).init_weights(seed=1)
    seqs = [_sequence(n, seed=i + 1) for i, n in enumerate(seq_lens)]
    tokens, targets = torch.cat([s[:-1] for s in seqs]), torch.cat([s[1:] for s in seqs])
    weights = torch.rand(tokens.shape[0], generator=torch.Generator().manual_seed(5)) / tokens.shape[0]
    split = ZigZagSplit(seq_lens, world, config.linear_conv_kernel_dim - 1)
    if world > 1:
        mixer = model.whole_sequence_mixer(split.local_lens)
        tokens, targets, weights = (split.shard(x, rank) for x in (tokens, targets, weights))
    else:
        mixer = PackedMixer(SegmentBatch(new_lens=seq_lens, starts=[0] * len(seq_lens)))
    logp = model.packed_logprobs(model.run_layers(tokens, mixer), targets)
    (logp * weights).sum().backward()
    return {"logp": logp.detach(), "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None}}


def _sequential_kda(layer, x: torch.Tensor, fragment_len: int, cp) -> torch.Tensor:
    """One KDA layer over this rank's two fragments by the sequential hand-off (LASP-1): fragment j
    runs from fragment j-1's end state and conv tail, received from its owner (none for j = 0)."""
    from kernels.kda.chunk import chunk_kda

    mixed, g, beta, gate = layer.project(x)
    halo_len, heads, dk = layer.kernel - 1, layer.num_heads, layer.head_dim
    state, tail = torch.zeros(heads, dk, dk), torch.zeros(halo_len, mixed.shape[-1], dtype=mixed.dtype)
    outs = {}
    for j in range(2 * cp.size):
        owner, slot = cp.fragment_owner(j)
        previous = cp.fragment_owner(j - 1)[0] if j else owner
        if owner != cp.rank:
            if previous == cp.rank:  # this rank ran fragment j - 1 last: hand its end off
                dist.send(state, owner)
                dist.send(tail, owner)
            continue
        if previous != cp.rank:
            dist.recv(state, previous)
            dist.recv(tail, previous)
        rows = slice(slot * fragment_len, (slot + 1) * fragment_len)
        q, k, v, _ = layer.short_conv(mixed[rows][None], tail[None])
        o, final, _ = chunk_kda(q, k, v, g[rows][None], beta[rows][None], initial_state=state[None],
                                chunk_len=min(64, fragment_len), impl="naive")
        outs[slot], state, tail = o[0], final[0].contiguous(), mixed[rows][-halo_len:].contiguous()
    return layer.output(torch.cat([outs[0], outs[1]]), gate)


@torch.no_grad()
def _kda_paths(rank: int, world: int, length: int) -> dict:
    """Seconds of one KDA layer's forward by the gather and by the hand-off, and their outputs."""
    from models.context_parallel import ContextParallel, ZigZagSplit
    from models.model import HybridLM

    config = _config()
    cp = ContextParallel(dist.group.WORLD, rank, world)
    model = HybridLM(config, context_parallel=cp).init_weights(seed=1)
    index = config.layer_types.index("kda")
    layer = model.model.layers[index].self_attn
    split = ZigZagSplit([length], world, config.linear_conv_kernel_dim - 1)
    x = split.shard(torch.randn(length, config.hidden_size, generator=torch.Generator().manual_seed(3)), rank)
    mixer = model.whole_sequence_mixer(split.local_lens)
    paths = {"gather": lambda: mixer.kda(index, layer, x),
             "handoff": lambda: _sequential_kda(layer, x, split.local_lens[0] // 2, cp)}
    out: dict = {}
    for name, run in paths.items():
        best = float("inf")
        for _ in range(HANDOFF_REPEATS):
            dist.barrier()
            start = time.perf_counter()
            y = run()
            dist.barrier()  # a path's time is its slowest rank's
            best = min(best, time.perf_counter() - start)
        out[f"kda_{name}_s"], out[f"kda_{name}_out"] = best, y
    return out


def _run(world: int, length: int, check_lens: list[int], handoff: bool = False) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), tmp, length, check_lens, handoff), nprocs=world,
                 join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def _errors(one: dict, ranks: list[dict], seq_lens: list[int], size: int) -> tuple[float, float]:
    from models.context_parallel import ZigZagSplit

    split = ZigZagSplit(seq_lens, size, _config().linear_conv_kernel_dim - 1)
    got = split.unshard([r["logp"] for r in ranks]).double()
    want = one["logp"].double()
    logp_err = ((got - want).abs().max() / want.abs().max()).item()
    grad_err = max(((sum(r["grads"][n] for r in ranks).double() - g.double()).norm() / g.double().norm()).item()
                   for n, g in one["grads"].items() if g.norm() > 0)
    return logp_err, grad_err


def _ring_vs_latent_bytes(config) -> float:
    """Bytes a rank sends per local token and MLA layer by a ring of up-projected K/V blocks over
    those of the latent gather (analytic; no ring is built here). Both hand every local token to the
    C-1 other ranks, forward and backward (the ring's dK/dV travel back as the gather's latent
    gradients do), so the ratio is per token: H x (d_nope + d_v) + d_rope (the RoPE key is shared by
    the heads, counted once) over d_c + d_rope."""
    ring = config.num_attention_heads * (config.qk_nope_head_dim + config.v_head_dim) + config.qk_rope_head_dim
    return ring / config.mla_latent_dim


def _plan_1m() -> tuple[int, float, str]:
    """The planner's 1M-token layouts of the 48B: (some layout fits, the best fitting one's seconds, rows)."""
    from rl.plan.long_context import plan_1m

    rows = plan_1m()
    fitting = [r for r in rows if r.fits]
    best = min(fitting, key=lambda r: r.seconds) if fitting else None
    shown = " ".join(f"plan_{r.cluster}_c{r.context}_ep{r.expert}_fits={int(r.fits)}" for r in rows)
    return int(bool(fitting)), (best.seconds if best else float("nan")), shown


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=16384, help="tokens of the sequence the peaks and times are taken at")
    p.add_argument("--long-length", type=int, default=131072, help="tokens of C = 4's longest measured step")
    p.add_argument("--check-length", type=int, default=4096, help="tokens of the accuracy batch")
    args = parse_args(p, argv, {"length": 1024, "long_length": 4096, "check_length": 512})
    check_lens = [max(8, int(args.check_length * f)) for f in CHECK_LENS_FRACTIONS]
    runs = {}
    for world, length, check in ((1, args.length, check_lens), (2, args.length, check_lens), (4, args.length, []),
                                 (4, args.long_length, [])):
        start = time.perf_counter()
        runs[(world, length)] = _run(world, length, check, handoff=world > 1 and length == args.length)
        r = runs[(world, length)]
        print(f"C={world} length={length}: peak per rank {max(x['peak'] for x in r) / 2**20:.1f} MiB, step "
              f"{max(x['step_s'] for x in r):.2f} s (run {time.perf_counter() - start:.0f} s)", flush=True)
    one, two, four = runs[(1, args.length)], runs[(2, args.length)], runs[(4, args.length)]
    long4 = runs[(4, args.long_length)]
    peak = {c: max(x["peak"] for x in r) for c, r in ((1, one), (2, two), (4, four))}
    peak_long4 = max(x["peak"] for x in long4)
    max_tokens4 = args.long_length * peak[1] / peak_long4  # linear in length, scaled to C = 1's peak
    sent = sum(x["sent_bytes"] for r in (two, four, long4) for x in r)
    analytic = sum(x["analytic_bytes"] for r in (two, four, long4) for x in r)
    logp_err, grad_err = _errors(one[0], two, check_lens, 2)
    fits, seconds, shown = _plan_1m()
    from models.config import load_model_config

    ring_48b = _ring_vs_latent_bytes(load_model_config(ROOT / "configs/model/kimi_linear_48b_a3b.yaml"))
    step = {c: max(x["step_s"] for x in r) for c, r in ((1, one), (2, two), (4, four))}
    handoff = {c: r[0]["kda_gather_s"] / r[0]["kda_handoff_s"] for c, r in ((2, two), (4, four))}
    handoff_err = max((x["kda_gather_out"].double() - x["kda_handoff_out"].double()).abs().max().item()
                      / max(y["kda_handoff_out"].double().abs().max().item() for y in r)
                      for r in (two, four) for x in r)
    for c, r in ((2, two), (4, four)):
        print(f"C={c} one KDA layer forward at {args.length} tokens: gather {r[0]['kda_gather_s']:.3f} s, "
              f"sequential hand-off {r[0]['kda_handoff_s']:.3f} s", flush=True)
    print(f"cp2_peak_vs_cp1={peak[2] / peak[1]:.3f} cp4_peak_vs_cp1={peak[4] / peak[1]:.3f} "
          f"cp4_max_tokens_vs_cp1={max_tokens4 / args.length:.2f} cp2_step_time_vs_cp1={step[2] / step[1]:.3f} "
          f"cp_comm_bytes_vs_model={sent / analytic:.4f} cp_logprob_rel_err={logp_err:.2e} "
          f"cp_grad_rel_err={grad_err:.2e} plan_48b_1m_tokens_fits={fits} plan_48b_1m_seconds={seconds:.1f} "
          f"cp2_kda_gather_vs_handoff_time={handoff[2]:.3f} cp4_kda_gather_vs_handoff_time={handoff[4]:.3f} "
          f"kda_handoff_rel_err={handoff_err:.2e} mla_ring_vs_latent_bytes_48b={ring_48b:.1f} "
          f"mla_ring_vs_latent_bytes_tiny={_ring_vs_latent_bytes(_config()):.1f} "
          f"cp4_step_time_vs_cp1={step[4] / step[1]:.3f} cp4_long_peak_vs_short={peak_long4 / peak[4]:.3f} "
          f"cp1_peak_mib={peak[1] / 2**20:.1f} length={args.length} long_length={args.long_length} {shown}")


if __name__ == "__main__":
    main()
