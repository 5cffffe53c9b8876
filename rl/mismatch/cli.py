"""`python -m rl.mismatch [num_seqs=4] [prompt_len=16] [max_new_tokens=32] [key=value ...]`

One-shot diagnosis of the rollout-vs-trainer logprob mismatch of a run config's model. Builds the
model as rl.train does (experiment.checkpoint, else a random init from `seed`, in experiment.dtype),
samples `num_seqs` random byte prompts of `prompt_len` tokens for `max_new_tokens` tokens each with
the run's rollout engine (T = 1, eos ignored, the training rollouts' temperature), then recomputes the
sampled tokens' logprobs with the trainer's old-logprob path (trainer/chunks.py `forward_logprobs`)
and reports, for d = trainer - engine: k3 = mean(exp(d) - d - 1), max |d| and the ratio exp(d)'s
p1 / p50 / p99. Then the same with one piece at a time computed the engine's way on the trainer's
side (KDA, MLA, the MLP's fused path), with the head in fp32 on both sides, and with every piece
matched (rl/mismatch/swaps.py). The last line holds the figures as key=value.

    num_seqs        sequences sampled (default 4)
    prompt_len      prompt tokens each (default 16)
    max_new_tokens  tokens sampled each (default 32); prompt_len + max_new_tokens <= engine.max_model_len
    key=value       any run config override, composed as rl.train does: model=kimi_linear_mid,
                    experiment.dtype=bf16, experiment.checkpoint=<dir>, seed=3, engine.kda_state_dtype=bf16

Speculative decoding, a KV budget and the host KV pool are turned off (the replay follows plain steps
over the device pool). Exit status 0, or 2 on a bad argument (one line on stderr).
"""
from __future__ import annotations

import sys
import time
from dataclasses import replace

import torch

from rl.config import RunConfig
from rl.config.compose import compose_run_config
from rl.export.cli import run_command
from rl.mismatch.record import Rollout, random_prompts, record_rollout
from rl.mismatch.replay import EngineMixer
from rl.mismatch.swaps import SWAPS, Figures, diagnose, head_logprobs, side_logprobs
from rl.run.build import initial_policy
from rl.run.threads import machine_threads
from rollout.engine import Engine
from rollout.sampling import SamplingParams
from trainer.chunks import ChunkedModel

OWN_ARGS = {"num_seqs": 4, "prompt_len": 16, "max_new_tokens": 32}
"""This command's own arguments and their defaults; every other key=value is a config override."""


class MismatchError(ValueError):
    """A bad argument (exit status 2)."""


def split_args(argv: list[str]) -> tuple[dict[str, int], list[str]]:
    """(this command's own arguments, the config overrides); MismatchError naming a malformed one."""
    own, overrides = dict(OWN_ARGS), []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or not key:
            raise MismatchError(f"argument {arg!r}, expected key=value")
        if key in OWN_ARGS:
            if not value.isdigit() or int(value) < 1:
                raise MismatchError(f"{arg!r}: expected a positive integer")
            own[key] = int(value)
        else:
            overrides.append(arg)
    return own, overrides


def sample(cfg: RunConfig, num_seqs: int, prompt_len: int, max_new_tokens: int) -> tuple[Engine, Rollout, str]:
    """The run's model in the run's engine, `num_seqs` sequences sampled and recorded, and the engine's
    kernel implementation."""
    if prompt_len + max_new_tokens > cfg.engine.max_model_len:
        raise MismatchError(f"prompt_len + max_new_tokens = {prompt_len + max_new_tokens} > engine.max_model_len="
                            f"{cfg.engine.max_model_len}: shorten them or raise engine.max_model_len")
    model = initial_policy(cfg).to(cfg.experiment.device_type)
    # The engine runs on the policy's own tensors, as in a run (rl/run/build.py).
    engine = Engine(model, replace(cfg.engine, speculative="off", kv_budget=None, host_pool_mb=0), seed=cfg.seed)
    prompts = random_prompts(num_seqs, prompt_len, cfg.model.vocab_size, cfg.seed)
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    rollout, impl = record_rollout(engine, prompts, params)
    return engine, rollout, impl


def run_diagnosis(overrides: list[str], num_seqs: int = 4, prompt_len: int = 16, max_new_tokens: int = 32,
                  say=print) -> dict[str, float]:
    """Sample, recompute, swap and report (module docstring); returns the final line's figures."""
    cfg = compose_run_config(overrides)
    threads = cfg.experiment.num_threads or machine_threads()[0]  # as rl.train chooses them
    if threads is not None:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    engine, rollout, impl = sample(cfg, num_seqs, prompt_len, max_new_tokens)
    model, sampled_s = engine.model, time.perf_counter() - started
    chunked = ChunkedModel(model, cfg.trainer.num_chunks, cfg.trainer.chunk_split)
    trainer = chunked.forward_logprobs(rollout.token_ids, rollout.seq_lens, rollout.targets)[rollout.policy_rows]
    replay = EngineMixer(model, engine.layout, rollout, impl)
    results = diagnose(model, rollout, replay, trainer)
    with torch.no_grad():
        twin = float((side_logprobs(model, rollout) - trainer).abs().max())
        captured = head_logprobs(rollout.engine_hidden, model.output_weight, rollout.targets[rollout.policy_rows],
                                 False)
        capture = float((captured - rollout.behaviour).abs().max())
    config = model.config
    say(f"rl.mismatch: {config.num_hidden_layers} layers ({len(config.kda_layers)} KDA, {len(config.mla_layers)} MLA), "
        f"dtype {cfg.experiment.dtype}, device {cfg.experiment.device_type}, engine kernels {impl}, "
        f"KDA state pages {cfg.engine.kda_state_dtype}; {num_seqs} sequences x ({prompt_len} prompt + "
        f"{max_new_tokens} sampled tokens, T=1): {rollout.num_tokens} tokens scored, mean -logp "
        f"{float(-rollout.behaviour.mean()):.3f}; {engine.num_steps} engine steps, {sampled_s:.1f} s sampling, "
        f"{time.perf_counter() - started - sampled_s:.1f} s recomputing")
    say(f"checks: the swap harness with no swap vs the trainer's forward_logprobs max|diff| {twin:.3g} (0: the same "
        f"ops); the engine's head on its recorded hidden rows vs its logprobs max|diff| {capture:.3g} (rounding only: "
        f"log_softmax over a step's rows vs gather - logsumexp over all)")
    say(render(results))
    figures = final_figures(results, rollout.num_tokens)
    say(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items()))
    return figures


def render(results: dict[str, tuple[Figures, bool]]) -> str:
    """The table: one row per swap, what it leaves of the mismatch."""
    texts = {"full": "full mismatch (trainer vs engine)", **{s.name: s.text for s in SWAPS}}
    full = results["full"][0].k3
    lines = [f"{'':<12}{'k3':>11}{'max|d|':>11}{'ratio p1':>11}{'p50':>11}{'p99':>11}  {'k3 removed':>10}  what"]
    for name, (fig, changed) in results.items():
        removed = f"{1 - fig.k3 / full:10.0%}" if full > 0 and name not in ("full", "head_fp32") else " " * 10
        note = "" if changed else ("  [no change: the head already runs in fp32]" if name == "head_fp32"
                                   else "  [no change: this piece is computed alike on both sides]")
        lines.append(f"{name:<12}{fig.k3:11.3g}{fig.max_abs:11.3g}{fig.ratio_p1:11.6f}{fig.ratio_p50:11.6f}"
                     f"{fig.ratio_p99:11.6f}  {removed}  {texts[name]}{note}")
    lines.append("head_fp32 compares a float32 head on both sides (the engine's from its recorded hidden rows); the head "
                 "itself has no engine twin: both sides form logits with F.linear(hidden, weight).float()")
    return "\n".join(lines)


def final_figures(results: dict[str, tuple[Figures, bool]], num_tokens: int) -> dict[str, float | int]:
    """The last line's figures: each row's k3 and max|d| (the full row as mismatch_*), and the tokens."""
    out: dict[str, float | int] = {}
    for name, (fig, _) in results.items():
        key = "mismatch" if name == "full" else name
        out[f"{key}_k3"], out[f"{key}_max_abs"] = fig.k3, fig.max_abs
    out["ratio_p1"], out["ratio_p50"], out["ratio_p99"] = (results["full"][0].ratio_p1, results["full"][0].ratio_p50,
                                                           results["full"][0].ratio_p99)
    out["tokens"] = num_tokens
    return out


def main(argv: list[str] | None = None) -> int:
    """The command; returns the exit status (0 diagnosed, 2 refused)."""
    return run_command("rl.mismatch", __doc__, argv, _diagnose, refused=(ValueError,), ours=(MismatchError,))


def _diagnose(argv: list[str], err_say) -> int:
    own, overrides = split_args(argv)
    run_diagnosis(overrides, **own)
    return 0


if __name__ == "__main__":
    sys.exit(main())
