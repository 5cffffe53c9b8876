"""The engine's hot path does not make the host wait for the device (tests/sync_audit.py's rules).

Budgets per engine step, counted by `SyncAudit` (syncs + host-to-device transfers, by site), none
of them while a decoder layer runs:
- the engine's own share (engine, model runner, paged mixer): ENGINE_SHARE, the step's one
  metadata copy; plus PAGE_COPY_COST per `PagePool.copy_pages` call (a fork's copies, the prefix
  cache's checkpoint copies: memory/page_pool.py moves their page indices in one copy);
- the sampler's share (rollout/sampling.py): SAMPLER_SHARE, the sampled tokens and logprobs back.
So a decode step without page copies makes at most DECODE_BUDGET, asserted for every case (greedy,
sampled with top-k/top-p, forks): the sampler's settings and draws are part of the step's one
metadata copy. Prefill steps are printed with their sites. A trainer micro-batch is measured and printed, bounded loosely only.
Token eviction (off by default) is not covered: its observer reads attention weights back per layer.
"""
import copy
import dataclasses
from dataclasses import dataclass

import pytest
import torch

from models.config import load_model_config
from models.model import HybridLM
from rollout.engine import Engine, EngineConfig
from rollout.kv import PrefixCacheConfig
from rollout.sampling import SamplingParams
from tests.sync_audit import SyncAudit, SyncCounts, audit_step

ENGINE_SHARE = 1
"""Syncs + transfers of the engine's own code per step: the step's metadata, in one copy."""
PAGE_COPY_COST = 1
"""Transfers per `PagePool.copy_pages` call (its source and destination page indices, one copy)."""
SAMPLER_SHARE = 1
"""The sampler's per step: its tokens and logprobs to the host in one copy (its rows' settings and
draws ride in the engine's metadata copy)."""
DECODE_BUDGET = ENGINE_SHARE + SAMPLER_SHARE
SAMPLER, PAGE_POOL = ("rollout/sampling.py",), ("memory/page_pool.py",)


HERE = "tests/rollout/test_sync_audit.py"


def test_the_audit_counts_each_rule_once_on_the_cpu():
    x, one = torch.arange(4.0), torch.tensor(1)
    counts: dict[str, tuple[int, int]] = {}  # what -> (syncs, transfers) it made
    with SyncAudit("cpu") as audit:
        for what, op in [
            ("item", lambda: x.sum().item()), ("bool", lambda: bool(x.any())), ("int", lambda: int(x[1])),
            ("tolist", lambda: x.tolist()), ("bool mask", lambda: x[x > 1]), ("nonzero", lambda: x.nonzero()),
            ("where", lambda: torch.where(x > 1)), ("unique", lambda: torch.unique(x)), ("cpu", lambda: x.cpu()),
            ("repeat_interleave", lambda: torch.repeat_interleave(x, x.long())),
            ("repeat_interleave output_size", lambda: torch.repeat_interleave(x, x.long(), output_size=6)),
            ("tensor of a list", lambda: torch.tensor([1, 2], device="cpu")),
            ("list index", lambda: x[[0, 2]]),
            ("staged then moved", lambda: torch.tensor([1, 2], device="cpu").to(audit.device, non_blocking=True)),
            ("computed then moved", lambda: (x + 1).to(audit.device, non_blocking=True)),
            ("free", lambda: (x[1:] * 2, x.to(torch.float64), x[one], torch.where(x > 1, x, 0.0))),
        ]:
            before = (audit.counts.total("sync"), audit.counts.total("transfer"))
            op()
            counts[what] = (audit.counts.total("sync") - before[0], audit.counts.total("transfer") - before[1])
    assert counts == {"item": (1, 0), "bool": (1, 0), "int": (1, 0), "tolist": (1, 0), "bool mask": (1, 0),
                      "nonzero": (1, 0), "where": (1, 0), "unique": (1, 0), "cpu": (1, 0), "repeat_interleave": (1, 0),
                      "repeat_interleave output_size": (0, 0), "tensor of a list": (0, 1), "list index": (0, 1),
                      "staged then moved": (0, 1), "computed then moved": (0, 1), "free": (0, 0)}
    assert all(site.startswith(HERE) for _, _, site in audit.counts.events)
    assert audit.counts.total(in_layer=True) == 0


def test_the_audit_rules_with_a_stand_in_accelerator():
    """'meta' plays the GPU: host tensors are free to read, only data reaching 'meta' counts."""
    host = torch.arange(3)
    with SyncAudit("meta") as audit:
        host.tolist(), bool(host.any()), host.nonzero()  # host bookkeeping: free
        torch.tensor([1, 2], device="meta")  # (a)
        torch.tensor([1, 2], device="cpu").to("meta", non_blocking=True)  # staged: (b) only
        torch.as_tensor(host, device="meta")  # (b)
    assert audit.counts.total("sync") == 0 and audit.counts.total("transfer") == 3


@dataclass
class AuditedStep:
    kind: str
    """"decode" (every scheduled sequence adds one token to a non-empty cache) or "prefill"."""
    page_copies: int
    """`PagePool.copy_pages` calls during the step."""
    counts: SyncCounts


def audited_generate(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[AuditedStep]:
    """Runs the prompts to completion, one audited step at a time (steps that ran the model)."""
    run, copy_pages = engine.runner.run, engine.pool.copy_pages
    seen: dict[str, object] = {}

    def recording_run(step, *args):
        seen["kind"] = "decode" if all(n == 1 and s.num_computed > 0
                                       for s, n in zip(step.seqs, step.num_new_tokens)) else "prefill"
        return run(step, *args)

    def counting_copy(src, dst):
        seen["copies"] = seen.get("copies", 0) + 1
        return copy_pages(src, dst)

    engine.runner.run, engine.pool.copy_pages = recording_run, counting_copy
    for prompt, p in zip(prompts, params):
        engine.add_request(prompt, p)
    steps = []
    while engine.has_unfinished:
        seen.clear()
        counts, _ = audit_step(engine)
        if "kind" in seen:
            steps.append(AuditedStep(seen["kind"], seen.get("copies", 0), counts))
    del engine.runner.run, engine.pool.copy_pages  # the instance attributes: back to the methods
    return steps


def many_experts(model: HybridLM) -> HybridLM:
    """The tiny model with 32 routed experts (top-2): the routed path sorts rows by expert instead
    of running every expert (models/mlp.py `runs_dense`)."""
    config = dataclasses.replace(model.config, num_experts=32, num_expert_group=4, topk_group=2)
    return HybridLM(config).init_weights(seed=7, std=0.15).eval()


def report(name: str, steps: list[AuditedStep]) -> dict[str, list[int]]:
    """Prints each kind's per-step totals and the sites of its worst step; returns kind -> totals."""
    totals: dict[str, list[int]] = {}
    for kind in ("decode", "prefill"):
        mine = [s for s in steps if s.kind == kind]
        totals[kind] = [s.counts.total() for s in mine]
        if mine:
            worst = max(mine, key=lambda s: s.counts.total())
            print(f"\n{name}: {len(mine)} {kind} steps, syncs + transfers per step {sorted(set(totals[kind]))}; "
                  f"worst ({worst.page_copies} page copy calls): {worst.counts.summary()}")
            for site, n in worst.counts.sites().items():
                print(f"    {site}: {n}")
    return totals


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_new_tokens=6, seed=2, ignore_eos=True)
FORKED = SamplingParams(temperature=1.0, max_new_tokens=5, n=2, seed=3, ignore_eos=True)


@pytest.mark.parametrize("case", ["greedy", "plain", "prefix cache + forks", "many experts"])
def test_engine_steps_stay_within_their_sync_budgets(tiny_model, case):
    model = many_experts(tiny_model) if case == "many experts" else copy.deepcopy(tiny_model)
    prefix = PrefixCacheConfig(hash_block=16, model_id="tiny") if case.startswith("prefix") else None
    engine = Engine(model, EngineConfig.for_pages(model, 64, max_model_len=128, max_num_batched_tokens=24,
                                                  prefix_cache=prefix))
    engine.generate([[2, 3]], GREEDY)  # one-time work (fused weights, kernel probes) is not per step
    shared = [(5 * i + 1) % 256 for i in range(34)]
    prompts = [shared + [3], [9, 8, 7], shared[:20] + [4, 4], [1] * 12]
    params = [GREEDY] * 4 if case == "greedy" else [FORKED if prefix else SAMPLED, GREEDY, SAMPLED, GREEDY]
    steps = audited_generate(engine, prompts, params)
    if prefix:  # a second wave that hits the prefix cache the first registered
        steps += audited_generate(engine, [shared + [6, 7], shared[:33]], [FORKED, GREEDY])
        assert engine.cache.prefix.hit_tokens >= 32
        assert any(s.kind == "decode" and s.page_copies for s in steps), "no checkpoint copy while decoding"
    totals = report(case, steps)
    assert len(totals["decode"]) >= 4 and totals["prefill"], "the run was meant to both prefill and decode"
    for step in steps:
        counts, where = step.counts, f"{step.kind} step: {step.counts.sites()}"
        assert counts.total(in_layer=True) == 0, f"a sync inside a layer, {where}"
        assert counts.total(exclude=SAMPLER + PAGE_POOL) <= ENGINE_SHARE, where
        assert counts.total(exclude=SAMPLER) <= ENGINE_SHARE + PAGE_COPY_COST * step.page_copies, where
    # With the sampler's share, a decode step without page copies stays within DECODE_BUDGET.
    for step in steps:
        assert step.counts.total() - step.counts.total(exclude=SAMPLER) <= SAMPLER_SHARE, step.counts.sites()
        if step.kind == "decode" and not step.page_copies:
            assert step.counts.total() <= DECODE_BUDGET, step.counts.sites()


def test_the_audit_catches_syncs_planted_in_an_engine_step(tiny_model):
    """An `.item()` inside a layer (one MLP) and a tensor of a Python list made on the device per
    step: the audit charges both to this file, the first to a layer, the second outside."""
    model = copy.deepcopy(tiny_model)
    mlp = model.model.layers[2].mlp
    forward = mlp.forward

    def planted_mlp(x):
        x.abs().max().item()
        return forward(x)

    mlp.forward = planted_mlp
    engine = Engine(model, EngineConfig.for_pages(model, 32, max_model_len=64))
    run = engine.runner.run

    def planted_run(step, *args):
        torch.tensor([len(step.seqs)], device=engine.pool.device)
        return run(step, *args)

    engine.runner.run = planted_run
    engine.add_request([5, 6, 7], GREEDY)
    counts, _ = audit_step(engine)
    planted = {(k, inside) for (k, inside, site), n in counts.events.items() if site.startswith(HERE)}
    assert planted == {("sync", True), ("transfer", False)}
    assert counts.total(in_layer=True) == 1


def test_a_train_step_syncs_once_per_micro_batch_outside_the_host_optimizer(capsys):
    """A GRPO policy update (rl/run/update.py `policy_update` -> `Trainer.train_step`) of 4 trajectories in
    3 micro-batches on the tiny model, counted and printed with its sites. Budget, besides the host
    optimizer (trainer/optimizer.py copies each chunk's gradient shard to the host and the updated
    masters back: ZeRO offload by design): per micro-batch one transfer of the packed mixer's
    indices, one of the loss's padding indices and one sync for the loss's metrics and input checks;
    per step one sync (the loss); nothing inside a layer."""
    from rl.episodes.driver import Trajectory
    from rl.run.update import PackedBatch, policy_update
    from trainer.losses import LossConfig
    from trainer.host_adam import OptimizerConfig
    from trainer.step import Trainer, TrainerConfig

    model = HybridLM(load_model_config("configs/model/tiny.yaml")).init_weights(seed=3, std=0.1)
    trainer = Trainer(model, TrainerConfig(num_chunks=4, optimizer=OptimizerConfig(lr=1e-3, backend="torch")))
    gen = torch.Generator().manual_seed(0)
    trajs = []
    for member, n in enumerate([34, 10, 51, 18]):
        tokens = torch.randint(0, 259, (n,), generator=gen).tolist()
        policy = [t >= n // 2 for t in range(n)]
        trajs.append(Trajectory(f"t{member}", 0, member, tokens, policy, [-1.0 if p else 0.0 for p in policy],
                                [1 if p else -1 for p in policy], n // 2, reward=float(member % 2)))
    batch = PackedBatch([trajs], "grpo")
    with SyncAudit("cpu") as audit:
        metrics = policy_update(trainer, batch, LossConfig(), micro_batch_tokens=60)
    counts = audit.counts
    with capsys.disabled():
        print(f"\ntrain step (tiny, {sum(batch.seq_lens)} tokens, {int(metrics['micro_batches'])} micro-batches): "
              f"{counts.summary()}")
        for site, n in counts.sites().items():
            print(f"    {site}: {n}")
    assert metrics["micro_batches"] == 3
    assert counts.total(in_layer=True) == 0, counts.sites()
    optimizer = ("trainer/optimizer.py",)
    # one per micro-batch (the loss), one per step, one per update (the mismatch metrics' single transfer)
    assert counts.total("sync", exclude=optimizer) <= 3 + 1 + 1, counts.sites()
    assert counts.total("transfer", exclude=optimizer) <= 2 * 3, counts.sites()
