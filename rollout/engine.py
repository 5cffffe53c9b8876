"""The rollout engine: requests in, tokens + logprobs + policy versions out.

    engine = Engine(model, EngineConfig(pool_mb=64), seed=0)
    outputs = engine.generate([prompt_ids, ...], SamplingParams(temperature=0.7, n=8))

`step()` is the whole pipeline, nano-vllm style, one method per stage: schedule -> prepare (who
samples, from which generators) -> run the model on pool pages -> sample (forking prompts) ->
postprocess (append, finish). Every KV tier is behind `self.cache` (rollout/kv/cache_manager.py).
Requests can be aborted, paused and resumed; `sleep()` hands the device pool back (nothing generated
is lost: running sequences are recomputed after `wake()`; with a host KV pool, paused sequences'
pages and the prefix cache's turn-boundary entries are written to host memory first and come back on
`wake()` / on their next hit); `load_weights` installs a new policy version (tokens record which
version sampled them, so partial rollouts that span versions stay attributable). Those calls of the
colocated cycle (sleep/wake, the host pool's lease and spill, weights) are rollout/engine_phases.py.
"""
from __future__ import annotations

import itertools
import time
import zlib
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from rich.progress import Progress

from kernels.impl import default_impl
from memory.host_ledger import HostLedger
from memory.host_pool import HostPagePool
from memory.page_pool import OutOfPages, PagePool
from models.model import HybridLM
from rollout.engine_config import ContextTooLong, EngineConfig
from rollout.engine_phases import EnginePhases
from rollout.kv import CacheManager
from rollout.lockstep import Lockstep
from rollout.model_runner import ModelRunner, sampling_indices
from rollout.request import Request, RequestOutput, SeqStatus, Sequence
from rollout.sampling import SamplingParams, SamplingRows, sample_rows
from rollout.scheduler import ScheduledStep, Scheduler, SchedulerConfig
from rollout.speculative import Sample, Speculator, Verification


def _select_runs(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows] for ascending host `rows`, as slices of consecutive runs (no index tensor to copy over)."""
    runs: list[list[int]] = []
    for r in rows:
        if runs and r == runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([r, r + 1])
    return torch.cat([x[a:b] for a, b in runs])


@dataclass
class _SamplePlan:
    """Who samples after the step's forward pass, known before it."""

    rows: list[tuple[Sequence, list[torch.Generator]]]
    """Per logits row: the sequence and its generators (one, or one per fork of a prompt)."""
    sampling: SamplingRows
    """The sampler's rows, one per generator, in order."""


class Engine(EnginePhases):
    def __init__(self, model: HybridLM, config: EngineConfig | None = None, ledger: HostLedger | None = None,
                 detokenize: Callable[[list[int]], str] | None = None, seed: int = 0,
                 draft: HybridLM | None = None) -> None:
        """`draft`: the draft model of speculative=draft (default: loaded from `config.draft_model`)."""
        self.config = config = config or EngineConfig()
        self.ledger = ledger
        """The host-DRAM ledger the host KV pool leases from (None: unaccounted)."""
        self.seed = seed
        """Seeds requests that give no seed of their own (an RL run's engine: the run's seed)."""
        self.detokenize = detokenize
        """Token ids -> text, for requests with `SamplingParams.stop_strings` (None: such requests are refused)."""
        self.model = model.eval()
        self.layout = config.layout_for(model)
        device = next(model.parameters()).device
        self.pool = PagePool.from_bytes(self.layout, config.pool_bytes, device)
        pin = device.type == "cuda"
        host_bytes = config.host_pool_bytes
        if host_bytes is None:  # "auto": leased at each rollout
            self.host = HostPagePool.unleased(self.layout.page_bytes, ledger=ledger, pin_memory=pin)
        else:
            self.host = (HostPagePool.from_bytes(self.layout.page_bytes, host_bytes, ledger=ledger, pin_memory=pin)
                         if host_bytes else None)
        self.cache = CacheManager.build(self.pool, self.host, config.prefix_cache, config.kv_budget, model, ledger)
        self.scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=config.max_num_batched_tokens,
                                                   max_num_seqs=config.max_num_seqs), self.cache)
        self.runner = ModelRunner(model, self.pool, self.cache, config.kernel_impl or default_impl())
        self.lockstep = Lockstep(model)  # expert parallelism: every step is the expert-parallel group's
        self.speculator = Speculator.build(self.cache, config, model, draft, seed)  # None: speculative=off
        longest = config.longest_kv_tokens
        max_pages = self.cache.pages_for_tokens(longest)  # a KV budget caps what one sequence holds
        if max_pages > self.pool.num_pages:
            raise ValueError(f"pool of {self.pool.num_pages} pages cannot hold one sequence of {longest} tokens "
                             f"({max_pages} pages; max_model_len={config.max_model_len}): lower max_model_len (or "
                             f"the KV budget) or grow the pool to >= {self.layout.pool_mb_for(max_pages)} MiB "
                             f"(engine.pool_mb)")
        self.policy_version = 0
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self.num_steps = 0
        self.num_computed_tokens = 0
        """Tokens run through the model since the engine was built (prefill chunks + decode)."""
        self.num_generated = 0
        """Tokens sampled since the engine was built (all requests)."""
        self.entropy_sum = 0.0  # of the sampling distributions (nats) over those tokens (rollout/sampling.py)
        self.peak_pages_used = 0

    # ---- requests ------------------------------------------------------------------------------------
    def add_request(self, prompt: Seq[int], params: SamplingParams | None = None, request_id: str | None = None,
                    turn_boundaries: Seq[int] = ()) -> str:
        """Queue a prompt. Invalid input raises ValueError here (a context the engine can never run:
        `ContextTooLong`, see `check_context`) and leaves the engine untouched: nothing allocated,
        queued, or counted (the next automatic request id is the same)."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        if not prompt:
            raise ValueError("empty prompt: a request needs at least one token")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if params.stop_strings and self.detokenize is None:
            raise ValueError(f"stop_strings={list(params.stop_strings)!r} need text: build the Engine with "
                             f"detokenize= (the tokenizer's decode)")
        self.check_context(len(prompt))
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} out of range [0, {vocab})")
        boundaries = tuple(sorted({int(b) for b in turn_boundaries}))
        if any(not 0 < b <= len(prompt) for b in boundaries):
            raise ValueError(f"turn_boundaries {list(turn_boundaries)} must lie in [1, {len(prompt)}] (the prompt)")
        if request_id is None:
            request_id = str(next(self._request_ids))  # only now: a refused request consumes no id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        base_seed = params.seed if params.seed is not None else zlib.crc32(f"{self.seed}:{request_id}".encode())

        def new_seq(fork: int, num_forks: int = 0) -> Sequence:
            gen = torch.Generator().manual_seed(base_seed + fork)
            return Sequence(next(self._seq_ids), request_id, list(prompt), len(prompt), params, gen, num_forks,
                            turn_boundaries=boundaries)

        seq = new_seq(0, num_forks=params.n if params.n > 1 else 0)
        self.requests[request_id] = Request(request_id, list(prompt), params, [seq], list(turn_boundaries))
        self.scheduler.add(seq)
        return request_id

    def expect_resume(self, tokens: Seq[int], at: float) -> None:
        """A conversation waiting on its tool will continue `tokens` at about `at` (time.monotonic()
        seconds, the tool's expected end): under a short pool its KV leaves the device after that of
        conversations resuming later, and comes back by prefetch once its request is queued."""
        self.cache.expect_resume([int(t) for t in tokens], float(at))

    def prefetch_prefix(self, tokens: Seq[int], at: float) -> int:
        """A request continuing `tokens` is about to come (queued outside the engine, resuming at about
        `at`): if its cached prefix sits on the host tier, its copy back starts now, keeping a page free
        per running sequence. Returns the pages queued (0 without a host tier)."""
        if self.cache.host_tier is None:
            return 0
        return self.cache.prefetch_tokens(list(tokens), float(at), reserve=len(self.scheduler.running))

    def check_context(self, prompt_len: int) -> None:
        """Raise `ContextTooLong` if a request of `prompt_len` prompt tokens can never run here: the
        prompt leaves no room for one generated token under `max_model_len`. Pure (the RL driver
        calls it to drop a too-long trajectory before submitting anything).

        That is also the pool's limit: the engine is only built when its pool holds one sequence of
        max_model_len tokens (KV-budget capped), and a sample never outgrows max_model_len (it
        finishes with "length" there, whatever max_new_tokens says), so every admitted request
        fits the pool on its own; the rest is waiting and preemption, never a refusal. The error
        gives the pages the prompt + 1 token needs and the pool's, for raising the limit."""
        cfg = self.config
        if prompt_len < cfg.max_model_len:
            return
        needed = self.cache.pages_for_tokens(prompt_len + 1)
        grow = (f" and the pool to >= {self.layout.pool_mb_for(needed)} MiB (engine.pool_mb)"
                if needed > self.pool.num_pages else "")
        raise ContextTooLong(
            f"prompt of {prompt_len} tokens does not fit max_model_len={cfg.max_model_len} (need room for at least "
            f"one generated token: {prompt_len + 1} tokens, {needed} pages; the pool has {self.pool.num_pages} pages "
            f"of {self.layout.page_bytes:,} bytes): shorten the prompt or raise max_model_len (engine.max_model_len) "
            f"to >= {prompt_len + 1}{grow}",
            num_tokens=prompt_len, max_model_len=cfg.max_model_len, pages_needed=needed,
            pool_pages=self.pool.num_pages)

    def abort(self, request_id: str) -> None:
        for seq in self._request(request_id).seqs:
            if seq.status is not SeqStatus.FINISHED:
                self.scheduler.finish(seq, "abort")
            seq.num_forks = 0
        del self.requests[request_id]

    def pause(self, request_id: str) -> None:
        """Stop scheduling the request; its cached pages stay (until pool pressure preempts it)."""
        for seq in self._request(request_id).seqs:
            self.scheduler.pause(seq)

    def resume(self, request_id: str) -> None:
        for seq in self._request(request_id).seqs:
            self.scheduler.resume(seq)

    def output(self, request_id: str) -> RequestOutput:
        """What the request has generated so far (finished=False while it runs or is paused)."""
        return RequestOutput.of(self._request(request_id))

    def _request(self, request_id: str) -> Request:
        if request_id not in self.requests:
            raise KeyError(f"unknown request id {request_id!r}")
        return self.requests[request_id]

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def stats(self) -> dict[str, float]:
        """Runtime signals (logging, the dispatcher's auto-throttle): queue sizes, pool use, preemptions
        (all of them; `swapped_out` + `recomputed` split them by kind, `swapped_in` counts returns).
        `pool_utilization` counts every used page, those only the prefix cache holds included
        (`cache.num_evictable_pages` counts those: a walk over the cache, not done every step; the
        dispatcher's `signals()` counts them free above its watermark and reserves each sequence's
        resume point, docs/rollout.md). Plus the cache's and the speculator's counters."""
        sched = self.scheduler
        return {"running": len(sched.running), "waiting": len(sched.waiting), "paused": len(sched.paused),
                "pool_pages": self.pool.num_pages, "pool_pages_used": self.pool.num_used,
                "pool_utilization": self.pool.num_used / self.pool.num_pages,
                "peak_pages_used": self.peak_pages_used,
                "preemptions": sched.num_preemptions, "swapped_out": sched.num_swapped_out,
                "swapped_in": sched.num_swapped_in, "recomputed": sched.num_recomputed,
                "steps": self.num_steps, "policy_version": self.policy_version,
                **self.cache.stats(), **(self.speculator.stats() if self.speculator is not None else {})}

    # ---- the step ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling step; returns the requests that finished during it."""
        if self.pool.is_released:
            raise RuntimeError("engine is asleep: call wake() before step()")
        scheduled = self._schedule()
        finished: list[RequestOutput] = []
        self.lockstep.before_step(bool(scheduled.seqs), self.has_unfinished)  # expert parallelism: the group's step
        if scheduled.seqs:
            t0 = time.perf_counter()
            decoding = all(n == 1 and s.num_computed == s.num_tokens - 1
                           for s, n in zip(scheduled.seqs, scheduled.num_new_tokens))  # before the plan extends them
            verify = self.speculator.plan(scheduled) if self.speculator is not None else None
            plan = self._prepare(scheduled)
            logits, settings, verified = self._run(scheduled, plan, verify)
            finished = self._postprocess(self._sample(plan, logits, settings) + verified)
            if self.speculator is not None and decoding:
                self.speculator.observe_step(len(scheduled.seqs), verify, time.perf_counter() - t0)
        self.num_steps += 1
        if not self.scheduler.has_work:
            self.cache.idle()
        if self.config.check_every_step:
            self.check_integrity()
        for out in finished:
            del self.requests[out.request_id]
        return finished

    # ---- expert parallelism: each step is the group's (rollout/lockstep.py) -------------------------
    @property
    def expert_parallel(self):
        """The model's expert-parallel group (None: it holds every expert)."""
        return self.model.expert_parallel

    def idle_step(self, unfinished: bool = True) -> bool:
        """Join the peers' step while this rank waits on something else (`Lockstep.idle_step`)."""
        return self.lockstep.idle_step(unfinished)

    def drain(self) -> int:
        """This rank's generation is over: join the peers' steps until none has work (`Lockstep.drain`)."""
        return self.lockstep.drain()

    def _schedule(self) -> ScheduledStep:
        """Pick the step's sequences and chunks; the cache runs the copies they wait on."""
        scheduled = self.scheduler.schedule()
        self.num_computed_tokens += scheduled.num_tokens
        if self.cache.host_tier is not None and self.scheduler.waiting:  # queued prefixes start back from the host
            self.cache.prefetch_waiting(self.scheduler.waiting, reserve=len(self.scheduler.running))
        self.cache.before_forward()  # this step's page copies, right before the forward pass
        return scheduled

    def _prepare(self, scheduled: ScheduledStep) -> _SamplePlan:
        """The sampler's rows, known before the forward: a sequence that reaches its last token
        samples once, a prompt with n forks once per fork (from the forks' own generators, made
        now). Their settings and draws ride in the step's metadata copy."""
        rows = [(scheduled.seqs[i], self._fork_generators(scheduled.seqs[i]) if scheduled.seqs[i].num_forks
                 else [scheduled.seqs[i].generator]) for i in sampling_indices(scheduled)]
        params = [seq.params for seq, gens in rows for _ in gens]
        return _SamplePlan(rows, SamplingRows.plan(params, [g for _, gens in rows for g in gens],
                                                   self.model.config.vocab_size))

    def _run(self, scheduled: ScheduledStep, plan: _SamplePlan, verify: Verification | None
             ) -> tuple[torch.Tensor, torch.Tensor | None, list[Sample]]:
        """The forward pass: returns the sampling rows' logits, the sampler's settings on the device, and
        the verifying sequences' samples (accepted and rolled back, rollout/speculative/speculation.py)."""
        _, logits, settings, verify_logits = self.runner.run(scheduled, plan.sampling, verify)  # draws in its copy
        self.peak_pages_used = max(self.peak_pages_used, self.pool.num_used)  # position pages included
        if verify is None:
            self.cache.after_forward(scheduled.seqs)  # index what this pass kept, before anything finishes
            return logits, settings, []
        verified, settled = self.speculator.settle(scheduled, verify, verify_logits)
        self.cache.after_forward(scheduled.seqs, settled.accepted, settled.checkpoints)
        self.pool.decref(settled.release)  # position pages not kept (a pending checkpoint copy holds its own)
        return logits, settings, verified

    def _sample(self, plan: _SamplePlan, logits: torch.Tensor, settings: torch.Tensor | None
                ) -> list[Sample]:
        """Fork the prompts that finished prefilling, then draw one token per sampling sequence:
        (sequence, token, logprob, entropy), in plan order."""
        seqs: list[Sequence] = []
        rows: list[int] = []  # row of logits each entry of seqs samples from (forks share one)
        kept: list[int] = []  # row of the sampler's plan each entry of seqs uses
        first = 0  # the plan row of the first generator of each entry of plan.rows
        for row, (seq, gens) in enumerate(plan.rows):
            children = self._fork(seq, gens) if seq.num_forks else [seq]
            if not children:  # the forks fell back to recompute: they sample later, from a fresh generator
                for gen in gens:
                    gen.manual_seed(gen.initial_seed())
            seqs += children
            rows += [row] * len(children)
            kept += list(range(first, first + len(children)))
            first += len(gens)
        if not seqs:
            return []
        rows_plan = plan.sampling
        if len(rows) != logits.shape[0]:
            # Forks repeat their parent's row (rows ascend): sliced, as an index tensor would be one
            # more host-to-device copy.
            logits = torch.cat([logits[r:r + 1].expand(len(list(run)), -1) for r, run in itertools.groupby(rows)])
        if len(kept) != first:  # some forks sample later: drop their rows
            settings = None if settings is None else _select_runs(settings, kept)
            rows_plan = rows_plan.select(kept)
        tokens, logprobs, entropies = sample_rows(logits, rows_plan, settings, with_entropy=True)
        return list(zip(seqs, tokens, logprobs, entropies))

    def _postprocess(self, samples: list[Sample]) -> list[RequestOutput]:
        """Append the sampled tokens (finishing sequences that stop); returns the finished requests."""
        for seq, token, logprob, entropy in samples:
            if seq.status is not SeqStatus.FINISHED:  # a verification's tokens past a stop are dropped
                self._append(seq, token, logprob)
                self.entropy_sum += entropy
        done = {seq.request_id for seq, *_ in samples if seq.status is SeqStatus.FINISHED}
        return [RequestOutput.of(self.requests[r]) for r in sorted(done) if self.requests[r].finished]

    @staticmethod
    def _fork_generators(parent: Sequence) -> list[torch.Generator]:
        """The CPU generators of a prompt's n samples: fork i is seeded with the request's seed + i."""
        return [torch.Generator().manual_seed(parent.generator.initial_seed() + i) for i in range(parent.num_forks)]

    def _fork(self, parent: Sequence, generators: list[torch.Generator]) -> list[Sequence]:
        """Split a prefilled prompt sequence into its n samples (pages shared, states copied), fork i
        drawing from `generators[i]`. Returns the samples that hold pages (all, or none when the pool
        cannot take their private copies: then they are queued to recompute the prompt)."""
        request = self.requests[parent.request_id]
        children = [Sequence(next(self._seq_ids), parent.request_id, list(parent.tokens), parent.prompt_len,
                             parent.params, generators[i]) for i in range(parent.num_forks)]
        try:
            self.cache.fork(parent, children)
        except OutOfPages:
            # Not enough pages for the private copies now: recompute the prompt per sample instead.
            self.cache.reset(parent)
            for child in children:
                child.num_computed = 0
        self.scheduler.fork(parent, children)
        request.seqs = children
        return [c for c in children if c.holds_pages]

    def _append(self, seq: Sequence, token: int, logprob: float) -> None:
        self.num_generated += 1
        seq.tokens.append(token)
        seq.logprobs.append(logprob)
        seq.versions.append(self.policy_version if seq.kv_version is None else min(self.policy_version, seq.kv_version))
        p, eos = seq.params, self.model.config.eos_token_id
        if token in p.stop_token_ids or (token == eos and not p.ignore_eos) or (p.stop_strings and self._hit_stop(seq)):
            self.scheduler.finish(seq, "stop")
        elif seq.num_generated >= p.max_new_tokens or seq.num_tokens >= self.config.max_model_len:
            self.scheduler.finish(seq, "length")

    def _hit_stop(self, seq: Sequence) -> bool:
        """Whether the newest token completed one of the request's stop strings: the last
        `stop_window` generated tokens' text holds one (an earlier completion already stopped it)."""
        start = max(seq.prompt_len, len(seq.tokens) - seq.params.stop_window)
        text = self.detokenize(seq.tokens[start:])
        return any(s in text for s in seq.params.stop_strings)

    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None,
                 progress: bool = False) -> list[RequestOutput]:
        """Run prompts to completion (with whatever else is queued); outputs in prompt order;
        `progress`: a (transient) progress bar."""
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        outputs: dict[str, RequestOutput] = {}
        with Progress(disable=not progress, transient=True) as bar:
            task = bar.add_task("generating", total=len(ids))
            while len(outputs) < len(ids):
                if not self.has_unfinished:
                    raise RuntimeError("engine has no work left but requests are unfinished (paused?)")
                for out in self.step():
                    outputs[out.request_id] = out
                    bar.advance(task)
        self.drain()  # expert parallelism: the peers' generation may still run
        return [outputs[i] for i in ids]

    @property
    def evictor(self):
        """The cache's token evictor (None without a KV budget): its counters, for tests and benchmarks."""
        return self.cache.evictor

    def check_integrity(self) -> None:
        seqs = self.sequences()
        self.cache.check_integrity(seqs)
        for s in seqs:
            if s.status in (SeqStatus.WAITING, SeqStatus.FINISHED) and s.holds_pages:
                raise AssertionError(f"sequence {s.seq_id} is {s.status.value} but holds pages")
