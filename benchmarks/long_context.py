"""Long contexts on CPU, tiny model: memory linear in the length, and a long-prefix
multi-turn scenario.

    python -m benchmarks.long_context [--quick]        # --quick: lengths / 16, a smoke run

(a) Train: one `Trainer.train_step` on one sequence of L = 2k, 8k, 32k tokens (fp32, 2 VPP chunks,
    host AdamW). Peak bytes as benchmarks/train_step.py counts them: tensors saved for backward,
    each chunk's kept input and the attention outputs kept for the recompute (one live set), plus
    the gradient arena; tokens/s of the step, the best of two steps at each length (a 512-token
    step runs first, untimed: one-time costs).
(b) Rollout: one prompt of 16k and of 64k tokens prefilled (chunked, 2048-token budget) then 64
    greedy decode tokens. Peak bytes: the pool pages the sequence holds at its longest plus the peak
    of every other tensor alive during the run (a dispatch mode that counts each op output's storage
    from its creation until it is freed: score tiles, gathered KV, logits); tokens/s of prefill and
    decode separately.
(c) The long-prefix agentic scenario, scaled down: a 64k-token conversation continued by four 1k-token user
    turns. Prefix cache (turn-boundary checkpoints, reuse across weight versions) and a host KV pool
    on; the device pool holds one conversation but not two, so every turn's prefix comes back from the
    host. Each turn is paused half-way through its answer, the engine sleeps (paused KV parked in
    the host pool, the prefix cache written back), the weight version is bumped, the engine wakes and
    the turn resumes from its KV (the RL loop's `partial_resume=kv`). Per turn: prompt tokens the
    engine prefilled vs the tokens that are new to it (the user turn + the previous answer).
Final line: train_peak_ratio_32k_vs_8k= prefill_peak_ratio_64k_vs_16k= reprefill_vs_new_tokens=
train_tok_s_32k_vs_2k= (targets <= 4.6, <= 4.6, <= 1.1, >= 0.5), then raw figures.
"""
from __future__ import annotations

import argparse
import gc
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from benchmarks.train_step import SavedTensorMeter
from models.config import load_model_config
from models.model import HybridLM
from rollout.engine import Engine, EngineConfig
from rollout.kv import PrefixCacheConfig
from rollout.sampling import SamplingParams
from trainer.host_adam import OptimizerConfig
from trainer.step import Trainer, TrainerConfig

TINY = "configs/model/tiny.yaml"
VOCAB = 256  # byte ids: valid in the tiny model


class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensors created inside the mode and still alive (each storage counted once,
    from the op that made it until it is freed). Tensors that existed before (weights, the pool)
    are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self._seen and storage.nbytes():
                    self._seen[key] = storage.nbytes()
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.live -= self._seen.pop(key, 0)


def tiny_model() -> HybridLM:
    return HybridLM(load_model_config(TINY)).init_weights(seed=0, std=0.1).eval()


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- (a) train ------------------------------------------------------------------------------------
def train_step(length: int) -> tuple[int, float]:
    """One train step on one `length`-token sequence -> (peak bytes, tokens/s)."""
    trainer = Trainer(tiny_model().train(), TrainerConfig(num_chunks=2, optimizer=OptimizerConfig(lr=1e-4, backend="torch")))
    gen = torch.Generator().manual_seed(length)
    tokens = torch.randint(0, VOCAB, (length,), generator=gen)
    targets = torch.randint(0, VOCAB, (length,), generator=gen)
    weights = torch.randn(length, generator=gen)
    meter = SavedTensorMeter()
    handles = meter.track_chunk_inputs(trainer)
    t0 = time.perf_counter()
    try:
        with meter.hooks():
            trainer.train_step(tokens, [length], targets, lambda lp, rows, seqs: -(lp * weights[rows]).sum() / length)
    finally:
        for handle in handles:
            handle.remove()
    seconds = time.perf_counter() - t0
    return meter.peak + trainer.arena.total_bytes, length / seconds


# ---- (b) rollout ----------------------------------------------------------------------------------
def pages_for(model: HybridLM, tokens: int) -> int:
    """Pool pages one sequence of `tokens` tokens holds (the engine's own page math)."""
    return Engine(model, EngineConfig.for_pages(model, 64, max_model_len=64)).cache.pages_for_tokens(tokens)


def engine_for(model: HybridLM, max_model_len: int, pages: int | None = None, pool_tokens: int | None = None,
               prefix: PrefixCacheConfig | None = None, host_pages: int = 0) -> Engine:
    if pages is None:  # room for one sequence of pool_tokens, and a little more
        pages = pages_for(model, pool_tokens) + 4
    return Engine(model, EngineConfig.for_pages(model, pages, host_pages=host_pages, max_model_len=max_model_len,
                                                max_num_batched_tokens=2048, prefix_cache=prefix))


def rollout(model: HybridLM, context: int, new_tokens: int) -> dict[str, float]:
    """Prefill one `context`-token prompt, then `new_tokens` greedy tokens."""
    engine = engine_for(model, context + new_tokens + 1, pool_tokens=context + new_tokens + 1)
    page_bytes = engine.layout.page_bytes
    engine.add_request(random_tokens(context, context), SamplingParams(temperature=0.0, max_new_tokens=new_tokens,
                                                                       ignore_eos=True))
    meter = LiveBytes()
    prefill_s = decode_s = 0.0
    with meter:
        while engine.has_unfinished:
            before = engine.num_computed_tokens
            t0 = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t0
            if engine.num_computed_tokens - before > 1:
                prefill_s += dt
            else:
                decode_s += dt
    pool = engine.peak_pages_used * page_bytes
    return {"peak_bytes": pool + meter.peak, "pool_bytes": pool, "temp_bytes": meter.peak,
            "prefill_tok_s": context / prefill_s, "decode_tok_s": new_tokens / max(decode_s, 1e-9)}


# ---- (c) the long-prefix scenario ----------------------------------------------------------------
def scenario(model: HybridLM, context: int, turns: int, turn_tokens: int, answer_tokens: int) -> dict[str, float]:
    """(c) above -> per-turn prefilled and new tokens, summed over the continued turns."""
    longest = context + turns * (turn_tokens + answer_tokens) + answer_tokens + 1
    prefix = PrefixCacheConfig(hash_block=64, model_id="tiny", reuse_stale=True)
    one = pages_for(model, longest)
    # the device pool holds one conversation (and a turn's growth), not two: prefixes live on the host
    engine = engine_for(model, longest, pages=one + one // 2, prefix=prefix, host_pages=4 * one)
    params = SamplingParams(temperature=0.0, max_new_tokens=answer_tokens, ignore_eos=True)
    history = random_tokens(context, 1)
    boundaries = [context]
    prefilled = new = 0
    rows = []
    for turn in range(turns + 1):
        if turn:
            history += random_tokens(turn_tokens, 100 + turn)
            boundaries.append(len(history))
        fresh = len(history) - (0 if turn == 0 else previous)  # tokens this engine has never computed
        computed_before = engine.num_computed_tokens
        rid = engine.add_request(history, params, turn_boundaries=boundaries)
        while len(engine.output(rid).samples[0].tokens) < answer_tokens // 2:
            engine.step()
        engine.pause(rid)
        engine.sleep()  # paused KV -> host pool, prefix cache written back, device pool released
        engine.weights_updated(engine.policy_version + 1)
        engine.wake()
        engine.resume(rid)
        finished = []
        while not finished:
            finished = [out for out in engine.step() if out.request_id == rid]
        answer = finished[0].samples[0].tokens
        computed = engine.num_computed_tokens - computed_before - (len(answer) - 1)  # minus decode steps
        rows.append((turn, len(history), fresh, computed))
        if turn:
            prefilled += computed
            new += fresh
        previous = len(history)
        history += answer
        boundaries.append(len(history))
        print(f"  turn {turn}: context {len(history):,} tokens, new {fresh:,}, prefilled {computed:,}", flush=True)
    return {"prefilled": prefilled, "new": new, "reprefill_vs_new": prefilled / new,
            "host_bytes_stored": engine.host.bytes_stored, "host_bytes_loaded": engine.host.bytes_loaded}


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="every length / 16: a smoke run")
    p.add_argument("--skip", default="", help="comma list of parts to skip: train,rollout,scenario")
    args = p.parse_args(argv)
    div = 16 if args.quick else 1
    skip = set(filter(None, args.skip.split(",")))
    torch.manual_seed(0)
    figures: dict[str, float] = {}
    raw: dict[str, float] = {}
    if "train" not in skip:
        train_step(512 // div)  # one-time costs
        train = {}
        for length in (2048, 8192, 32768):
            repeats = 2  # best of two at every length: a noisy host, the same chance for each
            runs = []
            for _ in range(repeats):
                runs.append(train_step(length // div))
                gc.collect()
            train[length] = (max(r[0] for r in runs), max(r[1] for r in runs))
            print(f"train {length // div:,} tokens: peak {train[length][0] / 2**20:.1f} MiB, "
                  f"{train[length][1]:.0f} tok/s", flush=True)
        figures["train_peak_ratio_32k_vs_8k"] = train[32768][0] / train[8192][0]
        figures["train_tok_s_32k_vs_2k"] = train[32768][1] / train[2048][1]
        raw.update({f"train_peak_mib_{k // 1024}k": v[0] / 2**20 for k, v in train.items()})
        raw.update({f"train_tok_s_{k // 1024}k": v[1] for k, v in train.items()})
    model = tiny_model()
    if "rollout" not in skip:
        ro = {}
        for context in (16384, 65536):
            ro[context] = rollout(model, context // div, 64)
            gc.collect()
            r = ro[context]
            print(f"rollout {context // div:,} context: peak {r['peak_bytes'] / 2**20:.1f} MiB (pool pages "
                  f"{r['pool_bytes'] / 2**20:.1f}, other tensors {r['temp_bytes'] / 2**20:.1f}), prefill "
                  f"{r['prefill_tok_s']:.0f} tok/s, decode {r['decode_tok_s']:.1f} tok/s", flush=True)
        figures["prefill_peak_ratio_64k_vs_16k"] = ro[65536]["peak_bytes"] / ro[16384]["peak_bytes"]
        raw.update({f"rollout_{k}_{c // 1024}k": v for c, r in ro.items() for k, v in r.items()
                    if k in ("peak_bytes", "prefill_tok_s", "decode_tok_s")})
    if "scenario" not in skip:
        sc = scenario(model, 65536 // div, 4, 1024 // div, 32)
        figures["reprefill_vs_new_tokens"] = sc["reprefill_vs_new"]
        raw.update({f"scenario_{k}": v for k, v in sc.items() if k != "reprefill_vs_new"})
    print(" ".join(f"{k}={v:.3g}" for k, v in {**figures, **raw}.items()))
    return figures


if __name__ == "__main__":
    main()
