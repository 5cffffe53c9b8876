"""Every benchmark still runs: `python -m benchmarks.<name> --quick` in a subprocess exits 0 and ends
with its final `key=value` line, carrying the keys the benchmark is documented to print
(docs/benchmarks.md, the modules' docstrings). Figures are not checked: timing never goes into tests."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CUDA = torch.cuda.is_available()

KERNELS = ["kda_decode_speedup", *([] if CUDA else ["kda_decode_cpu_speedup"]), "mla_decode_speedup",
           "mla_weights_speedup", "kda_chunk_speedup", "kda_chunk_bwd_speedup", "max_rel_err"]
KERNEL_ANCHORS = {"kda_decode_vs_fla", "mla_decode_vs_flashinfer", "kda_chunk_vs_fla", "kda_chunk_bwd_vs_fla"}
"""On CUDA, when fla / FlashInfer import (the `[gpu]` extra, never in the test environment)."""

LONG_CONTEXT = ["train_peak_ratio_32k_vs_8k", "train_tok_s_32k_vs_2k", "prefill_peak_ratio_64k_vs_16k",
                "reprefill_vs_new_tokens",
                *(f"train_peak_mib_{k}k" for k in (2, 8, 32)), *(f"train_tok_s_{k}k" for k in (2, 8, 32)),
                *(f"rollout_{f}_{c}k" for c in (16, 64) for f in ("peak_bytes", "prefill_tok_s", "decode_tok_s")),
                *(f"scenario_{k}" for k in ("prefilled", "new", "host_bytes_stored", "host_bytes_loaded"))]

ALGORITHMS = [*(f"{p}_{k}" for p in ("grpo", "rloo", "ppo", "reinforce_pp", "reinforce_pp_baseline", "dr_grpo", "dapo",
                                    "gspo", "cispo") for k in ("final_reward", "iters_to_0.8", "s_per_iter_vs_grpo")),
              "mismatch_k3", "grpo_s_per_iter"]

KEYS = {
    "algorithms": ALGORITHMS,
    "context_parallel": ["cp2_peak_vs_cp1", "cp4_peak_vs_cp1", "cp4_max_tokens_vs_cp1", "cp2_step_time_vs_cp1",
                         "cp_comm_bytes_vs_model", "cp_logprob_rel_err", "cp_grad_rel_err", "plan_48b_1m_tokens_fits",
                         "plan_48b_1m_seconds", "cp2_kda_gather_vs_handoff_time", "cp4_kda_gather_vs_handoff_time",
                         "kda_handoff_rel_err", "mla_ring_vs_latent_bytes_48b", "mla_ring_vs_latent_bytes_tiny",
                         "cp4_step_time_vs_cp1", "cp4_long_peak_vs_short", "cp1_peak_mib",
                         "length", "long_length"],
    "agentic": ["async_vs_serial_time", "same_trajectories", "tool_timeouts", "engine_busy_fraction", "serial_s",
                "async_s", "env_calls"],
    "expert_parallel": ["ep_logits_max_abs_err", "ep_greedy_tokens_equal", "ep2_device_weight_bytes_vs_ep1",
                        "grad_reductions_per_chunk_per_step", "startup_host_peak_vs_shard",
                        "plan_48b_ep8_gpu_weights_gib", "plan_48b_ep8_largest_pool_gib", "plan_48b_seconds",
                        "planner_max_rel_err", "startup_one_rank_peak_vs_model", "expert_share"],
    "host_tier": ["tier_vs_unlimited_pool", "tier_vs_recompute", "prefetch_hidden_fraction", "prefetched_pages",
                  "same_tokens", "reprefilled_tokens_tier", "reprefilled_tokens_recompute", "host_hit_tokens",
                  "pool_pages", "peak_pages"],
    "kernels": KERNELS,
    "kv_eviction": ["h2o_kv_bytes_vs_full", "h2o_token_agree", "infinigen_kv_bytes_vs_full", "infinigen_token_agree",
                    "h2o_kl", "infinigen_kl", "full_tok_s", "h2o_tok_s", "infinigen_tok_s"],
    "kv_pool": ["host_pool_bytes_vs_budget_minus_states", "kv_kept_across_iterations_hit", "wb_copy_bytes_vs_wt",
                "reprefill_tokens_wb_vs_none", "hit_vs_oracle_wb", "hit_vs_oracle_wt", "hit_vs_oracle_none",
                "hit_vs_oracle_large", "wb_bytes_stored", "wt_bytes_stored", "device_pages", "kv_kept_bytes",
                "host_pool_bytes_multiplexed", "train_state_bytes"],
    "long_context": LONG_CONTEXT,
    "moe": ["moe_grouped_vs_loop", "moe_padded_vs_loop", "moe_dense_vs_loop", "grouped_backend", "max_rel_err"],
    "nvme": ["write_vs_disk", "read_vs_disk", "backend", "write_gib_s", "read_gib_s", "disk_write_gib_s",
             "disk_read_gib_s"],
    "prefix_cache": ["hit_vs_oracle", "baseline_hit_vs_oracle", "prefill_tokens_vs_nocache", "hash_block",
                     "block_tokens", "small_pool_hit_vs_oracle_turn_aware", "small_pool_hit_vs_oracle_lru"],
    "ref_stream": ["time_ratio", "extra_device_bytes", "resident_device_bytes", "streamed_s", "resident_s"],
    "rollout_throughput": ["ratio", "engine_tok_s", "hf_tok_s", "block_tokens", "same_sequences"],
    "sandbox": ["sandbox_call_ratio", "back_to_back_ratio", "concurrent_ratio", "endless_loop_vs_wall_limit",
                "hanging_tests_vs_test_limits", "sandbox_call_ms", "process_call_ms", "back_to_back_ms",
                "concurrent_calls_s", "cold_start_ms", "endless_loop_s", "hanging_tests_s"],
    "scale": ["device_bytes_bf16_vs_fp32", "engine_extra_weight_bytes", "host_syncs_per_decode_step",
              "moe_grouped_vs_loop", "planner_max_rel_err", "bf16_tokens_same_as_fp32", "weights_bf16_vs_fp32",
              *(f"{k}_{d}" for d in ("fp32", "bf16") for k in ("device_bytes", "engine_s", "train_s")), "model"],
    "speculative": ["min_spec_vs_plain", "tail_spec_vs_plain", "rollout_phase_time_vs_plain", "stagger_phase_vs_suffix",
                    "ngram_phase_time_vs_plain", "suffix_acceptance", "ngram_acceptance", "same_greedy_tokens",
                    "logprob_max_abs_err", "distribution_test_pass", "break_even_50", "break_even_80",
                    "break_even_95", "right_proposals_1seq_vs_plain", "right_proposals_16seq_vs_plain",
                    "right_proposals_64seq_vs_plain", "spec_vs_plain_1", "spec_vs_plain_16", "tail_plain_tok_s",
                    "tail_spec_tok_s", "long_tail_plain_reward"],
    "swap_preemption": ["extra_tokens_swap_vs_recompute", "tok_s_swap_vs_recompute"],
    "throttle": ["auto_vs_best_fixed", "auto_vs_worst_fixed", "preemptions_auto", "preemptions_best_fixed"],
    "train_step": ["peak_bytes_ratio", "tok_s_ratio", "chunks", "dp", "loss_rel_diff"],
}
HELPERS = {"__init__": "parse_args (--quick)", "baselines": "kernels' optional anchors (CUDA only)",
           "kv_multiplex": "kv_pool's multiplexed case (run by kv_pool's test)"}
"""Modules of benchmarks/ that are not benchmarks themselves."""

ENV = {"agentic": {"OMP_NUM_THREADS": "1"}, "host_tier": {"OMP_NUM_THREADS": "1"}}  # as their docs run them
if not CUDA:
    ENV["kernels"] = {"TRITON_INTERPRET": "1"}  # `--small` under the interpreter checks the Triton side on CPU
TOKEN = re.compile(r"[\w/@.\-]+=\S+")


def run_quick(name: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "OMP_NUM_THREADS")}
    env.update(WANDB_MODE="disabled", **ENV.get(name, {}))
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))  # make's JIT-op cache
    return subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--quick"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_every_module_is_a_benchmark_or_a_helper():
    modules = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    assert modules == set(KEYS) | set(HELPERS), "a new benchmark needs its keys here (and a --quick mode)"


def test_the_helpers_import():
    from benchmarks.baselines import availability
    from benchmarks.kv_multiplex import multiplex_arguments, multiplexed  # noqa: F401

    assert set(availability()) == {"fla", "flashinfer"}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(KEYS))
def test_quick_run_ends_with_its_key_value_line(name: str):
    out = run_quick(name)
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert lines, f"no output\n{out.stderr[-3000:]}"
    tokens = lines[-1].split()
    assert tokens and all(TOKEN.fullmatch(t) for t in tokens), f"not a key=value line: {lines[-1]!r}"
    keys = [t.split("=", 1)[0] for t in tokens]
    expected = KEYS[name]
    if name == "kernels":  # the anchors' keys (CUDA, where fla / FlashInfer import) come on top
        keys = [k for k in keys if k not in KERNEL_ANCHORS]
    if name == "context_parallel":  # then one plan_<cluster>_c<C>_ep<E>_fits per planned 1M layout
        layouts = keys[len(expected):]
        assert layouts and all(re.fullmatch(r"plan_\w+_c\d+_ep\d+_fits", k) for k in layouts), f"{lines[-1]!r}"
        keys = keys[:len(expected)]
    assert keys == expected, f"{lines[-1]!r}"
