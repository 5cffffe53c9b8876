"""rl/plan/cli.py: the memory planner against measured runs, its verdicts, and the command line.

The planner's figures must be what a run logs in phases.jsonl (rl/run/loop.py `Phases.memory`),
consumer by consumer and phase by phase: bytes of the weights, pools, slots, optimizer states,
reference and spill files exactly; the activation peak (autograd's saved tensors, probed on the meta
device) within 5% (the probe's loss is a plain sum, the run's the GRPO loss: a few [B, T] tensors)."""
import dataclasses
import io
import json
from unittest import mock

import pytest
import torch
from rich.console import Console

from models.config import load_model_config
from models.expert_parallel import ExpertParallel
from models.model import HybridLM
from models.precision import cast_parameters
from models.tokenizer import load_tokenizer
from rl.plan.cli import compose_plan_inputs, main, make_plan, phase_records, plan_summary, world_size
from rl.plan.activation import SavedTensorMeter, activation_peak_bytes
from rl.plan.cluster import GIB, ClusterConfig, PlanOptions
from rl.plan.model import chunk_input_stash_bytes, moe_grouped_mm, plan_sizes
from rl.plan.shards import ShardGroup, gather_peak_bytes
from rl.train import run
from rollout.engine import Engine, EngineConfig
from tests.rl.test_config import CONFIGS, composed
from tests.rl.test_train_run import SMALL, records
from trainer.chunks import ChunkedModel, MicroBatch
from trainer.step import micro_batches

CPU = ClusterConfig()  # configs/cluster/cpu.yaml's shape: one rank
APPROX = ("device_activation_peak", "device_total")  # the activation peak and the total that holds it


def plan_vs_run(run_dir, overrides: list[str], seq_len: int) -> tuple[dict, dict]:
    """(planned, measured) memory by (iteration, phase) for a 2-iteration run with `overrides`."""
    cfg = composed(f"run_dir={run_dir}", "experiment.iterations=2", *SMALL, *overrides)
    history = run(cfg)
    # Every answer ran to max_new_tokens (no early EOS), so every trajectory has seq_len tokens.
    assert all(h["train_tokens"] == h["train_sequences"] * cfg.rollout.max_new_tokens for h in history)
    plan = make_plan(cfg, CPU, PlanOptions(seq_len=seq_len))
    planned = {(p.iteration, p.phase): p.memory for p in plan.phases}
    measured = {(r["iteration"], r["phase"]): r["memory"] for r in records(run_dir / "phases.jsonl")}
    return planned, measured


def prompt_len() -> int:
    """majority_digit's prompt ("384=" with length=3) in the byte tokenizer, bos included."""
    return len(load_tokenizer("byte").encode("384="))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_planned_bytes_match_the_measured_run_in_every_phase(tmp_path, dtype):
    overrides = [f"experiment.dtype={dtype}", "memory.spill_dir=nvme", "algo.loss.kl_coef=0.05",
                 "memory.reference=stream"]
    planned, measured = plan_vs_run(tmp_path, overrides, seq_len=prompt_len() + 3)
    assert list(planned) == list(measured), "the planner's phases are the loop's, in order"
    for key, plan in planned.items():
        got = measured[key]
        assert plan.keys() <= got.keys()
        exact = {k: (v, got[k]) for k, v in plan.items() if k not in APPROX and v != got[k]}
        assert not exact, f"{key}: planned != measured {exact}"
        for k in APPROX:
            assert got[k] == 0 if plan[k] == 0 else abs(plan[k] / got[k] - 1) < 0.05, (key, k, plan[k], got[k])
    steady = measured[(1, "train")]
    # the run exercised every tier: spill files, streamed reference, activations, host gradients
    assert measured[(1, "rollout")]["disk_spilled"] > 0 and steady["host_reference"] > 0
    assert steady["device_activation_peak"] > 0 and steady["host_grads"] == steady["host_masters"] > 0
    weight_bytes = 4 if dtype == "fp32" else 2
    assert steady["device_weights"] < weight_bytes * steady["host_masters"] / 4 * 1.01  # one copy, in dtype


def test_resident_reference_host_pool_and_parked_rollouts(tmp_path):
    """A resident reference is a second model on the device; the host pool is its pages; paused
    partial rollouts parked over the train phase stay within the planned bound (inside the pool)."""
    overrides = ["algo.loss.kl_coef=0.05", "memory.reference=resident", "rollout.max_new_tokens=6",
                 "rollout.budget_tokens=40", "rollout.partial_resume=kv", "engine.host_pool_mb=4"]
    cfg = composed(f"run_dir={tmp_path}", "experiment.iterations=2", *SMALL, *overrides)
    run(cfg)
    plan = make_plan(cfg, CPU, PlanOptions(seq_len=prompt_len() + 6))
    planned = {(p.iteration, p.phase): p.memory for p in plan.phases}
    measured = records(tmp_path / "phases.jsonl")
    assert any(r["memory"]["host_parked"] > 0 for r in measured), "the budget should leave work parked"
    for r in measured:  # an iteration without finished groups skips train: compare the phases it ran
        want, got = planned[(min(r["iteration"], 1), r["phase"])], r["memory"]
        for k in ("device_weights", "device_pool", "device_grad_slots", "device_reference", "host_masters",
                  "host_pool", "host_reference", "disk_spilled"):
            assert want[k] == got[k], (r["iteration"], r["phase"], k, want[k], got[k])
        assert got["host_parked"] <= want["host_parked"] <= want["host_pool"]
    assert plan.phases[0].memory["device_reference"] == plan.phases[0].memory["device_weights"] > 0


def test_activation_probe_equals_the_saved_tensor_meter_of_a_real_step():
    """Uneven lengths (buckets, padding) and micro-batches: the meta probe and the meter on a real
    CPU step of the same model and batch agree to the byte."""
    config = load_model_config(f"{CONFIGS}/model/tiny.yaml")
    lens = [7, 13, 5, 20, 3]
    plan = [[lens[i] for i in mb] for mb in micro_batches(lens, 25)]
    chunked = ChunkedModel(HybridLM(config).init_weights(seed=0, std=0.1), 3)
    gen = torch.Generator().manual_seed(0)
    meter = SavedTensorMeter(exclude=[*chunked.model.parameters(), *chunked.model.buffers()])
    with meter.hooks():
        for mb in plan:
            tokens = torch.randint(0, 256, (sum(mb),), generator=gen)  # [N]
            chunked.forward_backward(tokens, mb, torch.roll(tokens, -1), lambda lp: -lp.sum())
    assert meter.peak > 0
    assert activation_peak_bytes(config, plan, 3) == meter.peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_probe_follows_the_moe_form_the_device_runs(dtype):
    """Routed experts (32 experts, top-2: not the dense path): the probe, told the form this CPU
    takes (torch._grouped_mm or the padded blocks, models/mlp.py), equals the real step's meter;
    the other form saves a different amount (the choice matters, so it is the device's to make).
    In fp32 the meta device has no _grouped_mm kernel: the probe's stand-in must save what the CPU
    op saves. The split is by parameters, embedding and head chunks of their own."""
    config = dataclasses.replace(load_model_config(f"{CONFIGS}/model/tiny.yaml"), num_experts=32, num_expert_group=1)
    lens = [40, 30, 50]
    model = cast_parameters(HybridLM(config).init_weights(seed=0, std=0.1), dtype)
    tokens = torch.randint(0, 256, (sum(lens),), generator=torch.Generator().manual_seed(0))  # [N]
    meter = SavedTensorMeter(exclude=[*model.parameters(), *model.buffers()])
    with meter.hooks():
        ChunkedModel(model, 6, "params").forward_backward(tokens, lens, torch.roll(tokens, -1), lambda lp: -lp.sum())
    grouped = moe_grouped_mm(model, ClusterConfig(device_is_host=True))
    assert activation_peak_bytes(config, [lens], 6, dtype, grouped_mm=grouped, split="params") == meter.peak
    assert activation_peak_bytes(config, [lens], 6, dtype, grouped_mm=not grouped, split="params") != meter.peak


def test_the_largest_pool_fits_and_one_more_mib_does_not():
    small = ClusterConfig(name="small", gpu_memory_gib=0.1)
    workload = ["engine.max_model_len=64", "rollout.groups_per_iteration=2", "algo.group_size=2"]
    best = make_plan(composed(*workload), small).max_pool_mb
    assert 16 < best < 100
    fitting = make_plan(composed(*workload, f"engine.pool_mb={best}"), small)
    assert fitting.fits and fitting.max_pool_mb == best
    over = make_plan(composed(*workload, f"engine.pool_mb={best + 1}"), small)
    assert [(v.tier, v.phase) for v in over.verdicts if not v.fits] == [("device", "load_weights")]


def test_the_longest_context_is_the_one_the_engine_accepts():
    cfg = composed("engine.pool_mb=1")
    plan = make_plan(cfg, CPU)
    longest = plan.longest_context(plan.sizes.pool_pages)
    model = HybridLM(cfg.model)
    engine = Engine(model, EngineConfig(max_model_len=longest, pool_mb=1))
    assert engine.pool.num_pages == plan.sizes.pool_pages and engine.layout == plan.sizes.layout
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        Engine(model, EngineConfig(max_model_len=longest + 1, pool_mb=1))


def printed(argv: list[str]) -> tuple[int, str]:
    """(exit status, printed text) of `python -m rl.plan *argv`, run in this process."""
    console = Console(record=True, width=200, file=io.StringIO())
    status = main(argv, console)
    return status, console.export_text()


SIZE_48B = ["cluster=h200x8", "model=kimi_linear_48b_a3b", "engine.max_model_len=512", "trainer.micro_batch_tokens=512",
            "rollout.groups_per_iteration=8", "algo.group_size=2"]


def test_command_line_plans_the_48b_model_on_one_h200_node(tmp_path):
    status, text = printed([*SIZE_48B, "experiment.dtype=bf16", "trainer.num_chunks=27", "engine.pool_mb=4096",
                            f"plan.png={tmp_path / 'memory.png'}"])
    assert status == 0, text
    for line in ("device (per GPU): fits", "host (per node): fits", "largest engine.pool_mb that fits",
                 "longest context in this pool", "x 8 ranks (node)", "activation_peak"):
        assert line in text
    assert (tmp_path / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_command_line_names_the_tier_that_does_not_fit(tmp_path):
    # fp32 weights of 48B parameters alone are ~183 GiB: more than an H200
    status, text = printed([*SIZE_48B, "trainer.num_chunks=27", "engine.pool_mb=4096"])
    assert status == 1
    assert "device (per GPU): does not fit" in text and "short" in text


@pytest.mark.parametrize("argv, message", [(["cluster=h100"], "presets: cpu, h200x8, h200x8x2"),
                                           (["cluster.gpus=8"], "gpus"),
                                           (["trainer.num_chunks=0"], "trainer.num_chunks=0")])
def test_command_line_refuses_a_bad_config_naming_it(tmp_path, argv, message):
    status, text = printed(argv)
    assert status == 2 and "bad config" in text and message in text


def test_phase_records_are_what_the_memory_plot_reads(tmp_path):
    from rl.run.tracking import plot_memory

    plan = make_plan(composed(), CPU)
    recs = phase_records(plan)
    assert [(r["iteration"], r["phase"]) for r in recs] == [(p.iteration, p.phase) for p in plan.phases]
    json.dumps(recs)  # the phases.jsonl format: plain numbers
    plot_memory(recs, tmp_path / "memory.png")
    assert (tmp_path / "memory.png").stat().st_size > 0


# ---- expert parallelism and the figures beside the logged keys ------------------------------------------
def plan_of(argv: list[str]):
    return make_plan(*compose_plan_inputs(argv))


def test_expert_parallelism_splits_the_routed_experts_only():
    """parallel.expert=8: a rank holds every replicated parameter and 1/8 of the routed experts,
    byte for byte what the expert-parallel model itself holds (models/expert_parallel.py); the host
    shards stay ~1/world of everything (experts sharded over world / 8 ranks, 1/8 of them each)."""
    one, eight = (plan_of([*SIZE_48B, "experiment.dtype=bf16", "engine.pool_mb=4096", f"parallel.expert={n}"]).sizes
                  for n in (1, 8))
    with torch.device("meta"):
        rank = cast_parameters(HybridLM(one_config(), ExpertParallel(group=None, rank=3, size=8)), torch.bfloat16)
    assert eight.weights == sum(p.numel() * p.element_size() for p in rank.parameters())
    assert eight.weights == one.weights_replicated + one.weights_routed // 8 and one.weights_routed == 8 * eight.weights_routed
    assert eight.weights < 16 * GIB < 91 * GIB < one.weights
    assert eight.grad_slots < one.grad_slots
    assert abs(eight.masters - one.masters) <= 4 * 8 * 2 * 27  # padding only: each bucket pads to its ranks
    assert eight.startup_host_peak == eight.weights + eight.masters


def one_config():
    return load_model_config(f"{CONFIGS}/model/kimi_linear_48b_a3b.yaml")


@pytest.mark.parametrize("argv, message", [
    (["cluster=h200x8", "parallel.expert=3"], "parallel.expert=3"),
    (["cluster=h200x8", "parallel.expert=16"], "parallel.expert=16"),
    (["cluster=cpu", "parallel.expert=2"], "parallel.expert=2"),
    (["cluster=h200x8", "parallel.expert=0"], "parallel.expert=0")])
def test_a_bad_expert_parallel_size_is_refused_naming_it(argv, message):
    """It must divide the planned world (8 ranks on h200x8, 1 on cpu) and the expert count."""
    status, text = printed([*argv, "engine.pool_mb=64"])
    assert status == 2 and "bad config" in text and message in text and "expected" in text


def test_plan_sizes_checks_the_expert_parallel_size_against_the_cluster():
    with world_size(8):
        cfg = composed("parallel.expert=8", "model.num_experts=8")
    with pytest.raises(ValueError, match=r"parallel.expert=8: expected a divisor of the world size \(1 ranks"):
        plan_sizes(cfg, CPU)


def test_the_optimizer_gather_temporaries_follow_the_step_order():
    """ShardedHostAdamW.step per bucket: the shard on the device, world pieces, their concatenation,
    with the previous bucket's tensors bound until their names are rebound; a one-rank bucket is not
    gathered, only cast parameter by parameter."""
    s, w = 1000, 8
    bucket = ShardGroup(name="chunk0", numel=s * w, ranks=w, largest_param_bytes=100, cast_needed=False)
    assert gather_peak_bytes([bucket]) == 4 * (s + 2 * w * s)
    assert gather_peak_bytes([bucket, bucket]) == 4 * (s + 3 * w * s)  # old pieces and flat meet new ones
    cast = dataclasses.replace(bucket, cast_needed=True)
    assert gather_peak_bytes([cast]) == 4 * (s + 2 * w * s) + 100
    alone = ShardGroup(name="chunk0.experts", numel=s, ranks=1, largest_param_bytes=10**6, cast_needed=True)
    # after it the gathered `flat` is rebound to the host master; `mine` and `pieces` stay bound
    assert gather_peak_bytes([alone]) == 10**6 and gather_peak_bytes([bucket, alone]) == 4 * (s + w * s) + 10**6


def test_the_chunk_input_stash_is_what_the_trainer_keeps():
    """The chunk inputs `forward_backward_batches` holds between the graph-free forward and the
    backward, read off the trainer's own staging (distinct storages: a chunk without layers hands its
    input on), equal the planned bytes; an embedding-only first chunk shares its output."""
    config = load_model_config(f"{CONFIGS}/model/tiny.yaml")
    model = cast_parameters(HybridLM(config).init_weights(seed=0, std=0.1), torch.bfloat16)
    lens = [[9, 4], [6]]
    for chunks, split in ((3, "layers"), (10, "params")):
        chunked = ChunkedModel(model, chunks, split)
        kept: list[torch.Tensor] = []
        staged = ChunkedModel._staged_forward

        def spy(self, batch):
            inputs, mixer = staged(self, batch)
            kept.extend(inputs)
            return inputs, mixer

        tokens = torch.randint(0, 256, (sum(map(sum, lens)),), generator=torch.Generator().manual_seed(0))
        batches, start = [], 0
        for b in lens:
            ids = tokens[start:start + sum(b)]
            batches.append(MicroBatch(ids, b, torch.roll(ids, -1), lambda lp: -lp.sum()))
            start += sum(b)
        with mock.patch.object(ChunkedModel, "_staged_forward", spy):
            chunked.forward_backward_batches(batches)
        held = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in kept}
        assert sum(held.values()) == chunk_input_stash_bytes(chunked, sum(map(sum, lens))), (chunks, split)


def test_pinned_and_start_up_host_bytes():
    """On a CUDA cluster the host KV pool, the streamed reference's vectors and the optimizer's
    gradient staging buffers (one FP32 shard per bucket) are page-locked, at their exact sizes; on
    the CPU nothing is; the start-up peak is the rank's weights plus its master shards."""
    gpu = plan_of([*SIZE_48B, "experiment.dtype=bf16", "engine.pool_mb=4096", "engine.host_pool_mb=1000",
                   "parallel.expert=8"]).sizes
    assert gpu.host_pool > 0 and gpu.reference_host > 0
    assert gpu.grad_staging == gpu.masters
    assert gpu.host_pinned == gpu.host_pool + gpu.reference_host + gpu.grad_staging
    assert gpu.host_pool_locked >= gpu.host_pool and gpu.host_pool_locked & (gpu.host_pool_locked - 1) == 0
    cpu = make_plan(composed(), ClusterConfig(device_is_host=True)).sizes
    assert cpu.host_pinned == cpu.grad_staging == 0 and cpu.startup_host_peak == cpu.weights + cpu.masters


@pytest.mark.parametrize("cluster", ["h200x8", "h200x8x2"])
def test_the_48b_at_expert_parallel_8_fits_its_targets(cluster):
    """docs/plan-48b.md's headline: weights <= 16 GiB per GPU, a KV pool of >= 90 GiB, and the
    train phase (activations + stash, or the optimizer's gathers) inside the GPU."""
    summary = plan_summary("kimi_linear_48b_a3b", cluster, expert=8)
    assert summary["fits"] and summary["gpu_weights_gib"] <= 16 and summary["largest_pool_gib"] >= 90
    assert summary["train_device_gib"] < 139 and summary["seconds"] > 0


def test_the_command_line_prints_the_new_figures_and_its_time():
    status, text = printed([*SIZE_48B, "experiment.dtype=bf16", "engine.pool_mb=4096", "parallel.expert=8"])
    assert status == 0, text
    for line in ("parallel.expert=8", "chunk-input stash", "optimizer all-gather temporaries",
                 "train phase device peak", "host pinned", "host at start-up", "startup (host per node",
                 "planned in"):
        assert line in text, line


def test_ppo_critic_is_planned_as_a_second_trained_model(tmp_path):
    """PPO's critic in every phase: its weights and grad slots on the device, its masters, moments and
    gradients on the host, its spill files on NVMe, as the run measures them (KL in the reward builds
    the streamed reference too)."""
    overrides = ["algo=ppo", "memory.spill_dir=nvme", "algo.kl_in_reward.coef=0.05", "memory.reference=stream"]
    planned, measured = plan_vs_run(tmp_path, overrides, seq_len=prompt_len() + 3)
    assert list(planned) == list(measured)
    for key, plan in planned.items():
        got = measured[key]
        exact = {k: (v, got[k]) for k, v in plan.items() if k not in APPROX and v != got[k]}
        assert not exact, f"{key}: planned != measured {exact}"
        for k in APPROX:
            assert got[k] == 0 if plan[k] == 0 else abs(plan[k] / got[k] - 1) < 0.05, (key, k, plan[k], got[k])
    cfg = composed(f"run_dir={tmp_path}", *SMALL, *overrides)
    with_critic = make_plan(cfg, CPU, PlanOptions(seq_len=prompt_len() + 3)).sizes
    alone = make_plan(composed(f"run_dir={tmp_path}", *SMALL, *overrides, "algo.advantage=grpo",
                               "algo.critic.enable=false"), CPU, PlanOptions(seq_len=prompt_len() + 3)).sizes
    critic = with_critic.critic
    assert alone.critic is None and critic is not None and with_critic.masters == alone.masters
    # the value model is the policy's trunk with a [1, D] head in place of the policy's own [V, D] head
    # (none when the policy ties it to the embedding); one rank: a shard is the whole vector
    d, v = cfg.model.hidden_size, cfg.model.vocab_size
    assert critic.masters == alone.masters - (0 if cfg.model.tie_word_embeddings else 4 * v * d) + 4 * d
    assert measured[(1, "train")]["host_grads"] == measured[(1, "train")]["host_masters"] > alone.masters
