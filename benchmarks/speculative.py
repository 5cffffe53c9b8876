"""Speculative decoding where it pays: suffix-tree proposals (engine.speculative=suffix, the step cost
fitted to this engine's measured steps) vs plain decoding, side by side in one run, on two workloads.

    OMP_NUM_THREADS=1 python -m benchmarks.speculative [--quick]

Workloads, each with the tiny model (configs/model/tiny.yaml) after `--warmup-steps` AdamW steps on the
task's whole demonstrations (a stand-in for an RL policy some way in, which answers in the task's format;
the warmed weights are kept in `--cache-dir` and reused by the next run), then rollouts of the RL driver
with its environments (inline, so that every engine runs the same steps):
- agentic (tool_arith: "37*8=" -> "[py:37*8]" -> "=296;" -> "296"): short answers, many sequences. At
  each concurrency c of `--concurrencies` (at most c sequences running: engine.max_num_seqs; max(c,
  `--min-trajectories`) trajectories in groups of up to 16), tokens per second of engine time, plain vs
  suffix; `min_spec_vs_plain` is the smallest ratio (target >= 0.98: past the
  break-even the speculator asks nobody and decodes plainly).
- long tail (restate: read a file with a tool, restate it with its first identifier renamed; files of
  10-400 characters, log-uniform): `--groups` x `--group-size` trajectories. Plain, suffix, n-gram (both
  fitted) and suffix with a divided rollout (rollout.stagger_lead=`--stagger-lead`); each step timed with
  its running sequences: `tail_spec_vs_plain` (tokens/s over the steps with <= 8 running, target >= 1.5),
  `rollout_phase_time_vs_plain` (the whole rollout's wall time, target <= 0.8), `stagger_phase_vs_suffix`.
Runs interleaved `--repeats` times, the best of each kept. Greedy (temperature 0) on both workloads: the
suffix engine's trajectories must be plain decoding's token for token with the same logprobs. The fitted
cost model of the agentic run at the largest concurrency gives the break-even batch size at acceptances
0.5 / 0.8 / 0.95. The mechanism's ceiling: 1, 16 and 64 sequences whose proposals are always right. The
distribution test draws `--draws` two-token continuations through the acceptance rule against a 5-token
bigram target (chi-square at the 99.99% quantile).
Final line (ratios first): min_spec_vs_plain tail_spec_vs_plain rollout_phase_time_vs_plain
stagger_phase_vs_suffix suffix_acceptance ngram_acceptance same_greedy_tokens logprob_max_abs_err
distribution_test_pass break_even_{50,80,95} right_proposals_{1,16,64}seq_vs_plain spec_vs_plain_{c}
tail_plain_tok_s tail_spec_tok_s
"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from benchmarks import parse_args
from models.config import load_model_config
from models.model import HybridLM
from models.tokenizer import ByteTokenizer
from rl.envs.tasks.base import make_task
from rl.episodes.driver import DriverConfig, RolloutDriver, mix_seed
from rl.episodes.env_runner import EnvConfig
from rl.envs.tools.python_exec import close_sandboxes
from rl.run.warmup import demo_tokens
from rollout.engine import Engine, EngineConfig
from rollout.kv import PrefixCacheConfig
from rollout.request import SeqStatus
from rollout.speculative import Proposer, accept
from rollout.sampling import SamplingParams

WORKLOADS = {"agentic": ("tool_arith", 12), "long_tail": ("restate", 410)}
"""Workload -> (task, max_new_tokens per turn: the task's answer length)."""
TAIL = 8
"""A step with at most this many running sequences is in the rollout's tail."""


def warmed_model(task: str, stages: list[tuple[int, int, dict]], seed: int, lr: float = 2e-3) -> HybridLM:
    """The tiny model after AdamW steps (`lr`) on whole demonstrated episodes (the mean NLL of the answer
    tokens), stage by stage: (steps, episodes per step, the task's params), e.g. short files first."""
    torch.manual_seed(seed)
    model = HybridLM(load_model_config("configs/model/tiny.yaml")).init_weights(seed=seed)
    tokenizer = ByteTokenizer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99))
    model.train()
    done = 0
    for steps, per_step, params in stages:
        env = make_task(task, **params)
        for _ in range(steps):
            episodes = [demo_tokens(env, tokenizer, mix_seed(seed, done, j), value=True) for j in range(per_step)]
            done += 1
            total = sum(sum(policy[1:]) for _, policy in episodes)
            width = max(len(tokens) for tokens, _ in episodes) - 1
            inputs, targets, mask = (torch.zeros(per_step, width, dtype=dtype)
                                     for dtype in (torch.long, torch.long, torch.float32))
            for row, (tokens, policy) in enumerate(episodes):  # right-padded; the forward packs them
                n = len(tokens) - 1
                inputs[row, :n], targets[row, :n] = torch.tensor(tokens[:-1]), torch.tensor(tokens[1:])
                mask[row, :n] = torch.tensor(policy[1:], dtype=torch.float32)
            picked = model.token_logprobs(inputs, targets, [len(tokens) - 1 for tokens, _ in episodes])
            loss = -(picked * mask).sum() / total
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model.eval()


def cached_model(task: str, args) -> HybridLM:
    """`warmed_model(task, ...)`, from `args.cache_dir` when a run with the same settings saved it. The
    long-tail policy learns to copy on files of at most 40 characters first (`--tail-short-steps`, 32
    episodes a step: copying emerges there), then on the whole range (`--tail-warmup-steps`, 16)."""
    if task == "restate":
        stages, lr = [(args.tail_short_steps, 32, {"max_chars": 40}), (args.tail_warmup_steps, 16, {})], args.tail_warmup_lr
    else:
        stages, lr = [(args.warmup_steps, 16, {})], 2e-3
    name = "_".join(f"{steps}x{n}" for steps, n, _ in stages)
    path = Path(args.cache_dir or ".") / f"{task}_steps{name}_lr{lr:g}_seed0.pt"
    if args.cache_dir and path.exists():
        model = HybridLM(load_model_config("configs/model/tiny.yaml"))
        model.load_state_dict(torch.load(path, weights_only=True))
        return model.eval()
    t0 = time.perf_counter()
    model = warmed_model(task, stages, seed=0, lr=lr)
    print(f"{task}: warm-up of {name} steps x episodes in {time.perf_counter() - t0:.0f} s"
          + (f" (kept in {path})" if args.cache_dir else ""), flush=True)
    if args.cache_dir:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), path)
    return model


def rollout(model: HybridLM, workload: str, groups: int, group_size: int, speculative: str, *, greedy: bool = False,
            stagger: int = 0, row_cost: float | str = "fitted", pool_mb: int = 64, max_seqs: int = 128) -> dict:
    """One rollout iteration on a fresh engine (prefix cache with hash blocks of 4): its figures, each step's
    (running sequences, tokens emitted, seconds), the trajectories as (id, tokens, logprobs), the speculator."""
    task, max_new = WORKLOADS[workload]
    engine = Engine(model, EngineConfig(pool_mb=pool_mb, max_model_len=1024 if workload == "long_tail" else 64,
                                        max_num_batched_tokens=2048, max_num_seqs=max_seqs,
                                        prefix_cache=PrefixCacheConfig(hash_block=4),
                                        speculative=speculative, speculative_row_cost=row_cost))
    config = DriverConfig(groups_per_iteration=groups, max_new_tokens=max_new, stagger_lead=stagger,
                          max_concurrency=groups * group_size)  # every trajectory in flight: the concurrency
    driver = RolloutDriver(engine, ByteTokenizer(), task, {}, config, group_size=group_size, seed=3,
                           env=EnvConfig(workers=0, timeout_s=10.0))  # inline: the same steps in every engine
    if greedy:
        driver.sampling["temperature"] = 0.0
    engine.load_weights(model.state_dict(), version=1)
    steps: list[tuple[int, int, float]] = []
    inner = engine.step

    def timed_step():
        running = sum(1 for seq in engine.sequences() if seq.status is SeqStatus.RUNNING)
        generated, t0 = engine.num_generated, time.perf_counter()
        out = inner()
        steps.append((running, engine.num_generated - generated, time.perf_counter() - t0))
        return out

    engine.step = timed_step
    t0 = time.perf_counter()
    result = driver.rollout()
    wall = time.perf_counter() - t0
    if driver.runner is not None:
        driver.runner.close()
    m = result.metrics
    trajs = sorted((t.traj_id, tuple(t.tokens), tuple(t.logprobs)) for g in result.groups for t in g)
    reward = sum(t.reward for g in result.groups for t in g) / max(1, len(trajs))
    tail = [(n, s) for running, n, s in steps if 0 < running <= TAIL]
    buckets = {name: [(n, s) for running, n, s in steps if lo <= running <= hi]
               for name, (lo, hi) in {"1-8": (1, 8), "9-32": (9, 32), "33+": (33, 1 << 30)}.items()}
    return {"buckets": {name: (sum(n for n, _ in b), sum(s for _, s in b)) for name, b in buckets.items()}, "tokens": m["rollout_tokens"], "engine_s": m["engine_step_seconds"], "wall_s": wall, "reward": reward,
            "tail_tokens": sum(n for n, _ in tail), "tail_s": sum(s for _, s in tail), "steps": len(steps),
            "trajs": trajs, "spec": engine.speculator}


def best(runs: list[dict], key: str = "engine_s") -> dict:
    """The least disturbed of interleaved runs: the smallest `key` per token."""
    return min(runs, key=lambda r: r[key] / max(1, r["tokens"]))


def greedy_check(model: HybridLM, workload: str, groups: int, group_size: int) -> tuple[int, float]:
    """(the suffix engine's greedy trajectories are plain decoding's, token for token; the largest
    logprob difference)."""
    plain = rollout(model, workload, groups, group_size, "off", greedy=True)["trajs"]
    spec = rollout(model, workload, groups, group_size, "suffix", greedy=True)["trajs"]
    same = int([t[:2] for t in plain] == [t[:2] for t in spec])
    err = max((abs(a - b) for p, q in zip(plain, spec) for a, b in zip(p[2], q[2])), default=0.0)
    return same, err


def agentic_sweep(model: HybridLM, args) -> tuple[dict[int, float], object]:
    """Tokens/s of engine time, suffix over plain, at each concurrency c: the engine runs at most c
    sequences at once (max_num_seqs), over max(c, 32) trajectories in groups of min(c, 16), so that
    small concurrencies run long enough to time; and the speculator of the largest concurrency's best
    run (its fitted cost model)."""
    ratios, last = {}, None
    for c in args.concurrencies:
        size = min(16, c)
        groups = max(c, args.min_trajectories) // size
        runs = {"off": [], "suffix": []}
        for _ in range(args.repeats):
            for name in runs:
                runs[name].append(rollout(model, "agentic", groups, size, name, pool_mb=16, max_seqs=c))
        plain, spec = best(runs["off"]), best(runs["suffix"])
        ratios[c] = (spec["tokens"] / spec["engine_s"]) / (plain["tokens"] / plain["engine_s"])
        last = spec["spec"]
        print(f"agentic, {c} running at most ({groups} x {size} trajectories): plain "
              f"{plain['tokens'] / plain['engine_s']:.0f} tok/s, suffix {spec['tokens'] / spec['engine_s']:.0f} tok/s "
              f"({spec['spec'].num_verifications} verifications, {spec['spec'].num_gated_steps} of {spec['steps']} "
              f"steps past the break-even, acceptance {spec['spec'].acceptance_rate:.2f}): {ratios[c]:.3f}x", flush=True)
    return ratios, last


def long_tail(model: HybridLM, args) -> dict[str, float]:
    """Plain, suffix, n-gram and staggered suffix on the long-tail workload (module docstring)."""
    kinds = {"off": ("off", 0), "suffix": ("suffix", 0), "ngram": ("ngram", 0), "stagger": ("suffix", args.stagger_lead)}
    runs: dict[str, list[dict]] = {name: [] for name in kinds}
    for _ in range(args.repeats):
        for name, (speculative, stagger) in kinds.items():
            runs[name].append(rollout(model, "long_tail", args.groups, args.group_size, speculative, stagger=stagger))
    top = {name: best(done, "wall_s") for name, done in runs.items()}
    for name, r in top.items():
        spec = r["spec"]
        print(f"long tail, {name}: {r['wall_s']:.2f} s for {r['tokens']} tokens ({r['steps']} steps; tail "
              f"{r['tail_tokens']} tokens at {r['tail_tokens'] / max(r['tail_s'], 1e-9):.0f} tok/s), reward "
              f"{r['reward']:.3f}" + ("" if spec is None else f", acceptance {spec.acceptance_rate:.2f} "
                                      f"({spec.num_verifications} verifications)")
              + "; by running sequences: " + ", ".join(f"{b} {n:.0f} tokens in {t:.2f} s" for b, (n, t) in r["buckets"].items()),
              flush=True)
    tail_rate = {name: r["tail_tokens"] / max(r["tail_s"], 1e-9) for name, r in top.items()}
    return {"tail_spec_vs_plain": tail_rate["suffix"] / tail_rate["off"],
            "rollout_phase_time_vs_plain": top["suffix"]["wall_s"] / top["off"]["wall_s"],
            "stagger_phase_vs_suffix": top["stagger"]["wall_s"] / top["suffix"]["wall_s"],
            "suffix_acceptance": top["suffix"]["spec"].acceptance_rate,
            "ngram_acceptance": top["ngram"]["spec"].acceptance_rate,
            "ngram_phase_time_vs_plain": top["ngram"]["wall_s"] / top["off"]["wall_s"],
            "tail_plain_tok_s": tail_rate["off"], "tail_spec_tok_s": tail_rate["suffix"],
            "plain_reward": top["off"]["reward"]}


def right_proposals(batch: int, repeats: int) -> float:
    """The mechanism's ceiling here: `batch` sequences of 40 greedy tokens (the tiny model at its seed-0
    weights, random prompts), proposals always right (what plain decoding emits), k = 4, every proposal
    verified: tokens per second vs plain decoding."""
    model = HybridLM(load_model_config("configs/model/tiny.yaml")).init_weights(seed=0)
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(15)] for _ in range(batch)]

    class Right(Proposer):
        def propose(self, seq, k):
            out = expected[tuple(seq.tokens[:15])]
            return out[seq.num_tokens - 15:seq.num_tokens - 15 + k]

    def timed(speculative: str) -> float:
        engine = Engine(model, EngineConfig(pool_mb=64, max_model_len=64, max_num_batched_tokens=4096,
                                            speculative=speculative, speculative_row_cost=0.0))
        if speculative != "off":
            engine.speculator.proposer = Right()
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        if speculative == "off":
            expected.update({tuple(p): o.samples[0].tokens for p, o in zip(prompts, outs)})
        return time.perf_counter() - start

    expected: dict[tuple[int, ...], list[int]] = {}
    plain = min(timed("off") for _ in range(repeats))
    spec = min(timed("ngram") for _ in range(repeats))
    return plain / spec


def distribution_test(draws: int) -> tuple[bool, float]:
    """Two tokens after token 0 through the acceptance rule, random proposals of 1-3 tokens, on a bigram
    target: chi-square of the 25 outcomes against p(t1) p(t2 | t1), below its 99.99% quantile (55.9)."""
    gen = torch.Generator().manual_seed(0)
    bigram = torch.randn(5, 5, generator=gen)
    params = SamplingParams(temperature=1.0)
    rng, generator = random.Random(1), torch.Generator().manual_seed(2)
    counts = torch.zeros(5, 5)
    for _ in range(draws):
        out, prev = [], 0
        while len(out) < 2:
            proposal = [rng.randrange(5) for _ in range(rng.randint(1, 3))]
            logits = torch.stack([bigram[t] for t in [prev, *proposal]])
            out += accept(logits, proposal, params, generator).tokens
            prev = out[-1]
        counts[out[0], out[1]] += 1
    p = torch.softmax(bigram, dim=-1)
    want = p[0][:, None] * p * draws
    chi2 = float(((counts - want) ** 2 / want).sum())
    return chi2 < 55.9, chi2


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrencies", type=int, nargs="+", default=[1, 4, 16, 64, 128])
    p.add_argument("--min-trajectories", type=int, default=128, help="agentic trajectories per concurrency at least")
    p.add_argument("--groups", type=int, default=8, help="long-tail groups")
    p.add_argument("--group-size", type=int, default=8, help="long-tail trajectories per group")
    p.add_argument("--stagger-lead", type=int, default=2, help="members of a group that start first (divided rollout)")
    p.add_argument("--warmup-steps", type=int, default=200, help="the agentic policy's warm-up (lr 2e-3)")
    p.add_argument("--tail-short-steps", type=int, default=250, help="the long-tail policy's warm-up on short files")
    p.add_argument("--tail-warmup-steps", type=int, default=60, help="then on files of every length")
    p.add_argument("--tail-warmup-lr", type=float, default=3e-3)
    p.add_argument("--cache-dir", default="runs/benchmark_cache", help="where the warmed weights are kept (\"\": nowhere)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--draws", type=int, default=6000)
    args = parse_args(p, argv, {"concurrencies": [1, 16], "min_trajectories": 4, "groups": 2, "group_size": 4, "warmup_steps": 4,
                                "tail_short_steps": 2, "tail_warmup_steps": 1, "cache_dir": "", "repeats": 1, "draws": 600})
    agentic = cached_model("tool_arith", args)
    ratios, spec = agentic_sweep(agentic, args)
    cost = spec.cost
    cost.fit()
    even = {a: cost.break_even(a, spec.max_k) for a in (0.5, 0.8, 0.95)}
    print(f"fitted step cost (agentic, {args.concurrencies[-1]} trajectories): fixed {cost.fixed * 1e3:.2f} ms, decode "
          f"row {cost.decode_row * 1e6:.0f} us, verification row {cost.verify_row * 1e6:.0f} us; break-even batch "
          + ", ".join(f"{n} sequences at acceptance {a}" for a, n in even.items()), flush=True)
    tail_model = cached_model("restate", args)
    tail = long_tail(tail_model, args)
    same_a, err_a = greedy_check(agentic, "agentic", 2, 8)
    same_t, err_t = greedy_check(tail_model, "long_tail", 2, 4)
    print(f"greedy: same tokens {same_a} (agentic), {same_t} (long tail); logprob err {max(err_a, err_t):.1e}")
    ceiling = {b: right_proposals(b, args.repeats) for b in (1, 16, 64)}
    print("proposals always right, k = 4: " + ", ".join(f"{b} sequences {r:.2f}x" for b, r in ceiling.items()))
    close_sandboxes()
    passed, chi2 = distribution_test(args.draws)
    print(f"distribution test: chi-square {chi2:.1f} over 25 outcomes ({args.draws} draws; bound 55.9)")
    out = {"min_spec_vs_plain": min(ratios.values()), "tail_spec_vs_plain": tail["tail_spec_vs_plain"],
           "rollout_phase_time_vs_plain": tail["rollout_phase_time_vs_plain"],
           "stagger_phase_vs_suffix": tail["stagger_phase_vs_suffix"],
           "ngram_phase_time_vs_plain": tail["ngram_phase_time_vs_plain"],
           "suffix_acceptance": tail["suffix_acceptance"], "ngram_acceptance": tail["ngram_acceptance"],
           "same_greedy_tokens": int(same_a and same_t), "logprob_max_abs_err": max(err_a, err_t),
           "distribution_test_pass": int(passed),
           **{f"break_even_{round(a * 100)}": n for a, n in even.items()},
           **{f"right_proposals_{b}seq_vs_plain": r for b, r in ceiling.items()},
           **{f"spec_vs_plain_{c}": r for c, r in ratios.items()},
           "tail_plain_tok_s": tail["tail_plain_tok_s"], "tail_spec_tok_s": tail["tail_spec_tok_s"],
           "long_tail_plain_reward": tail["plain_reward"]}
    print(" ".join(f"{key}={value:.4g}" for key, value in out.items()))
    return out


if __name__ == "__main__":
    main()
