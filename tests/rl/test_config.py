"""Composition of the run config: groups, typed schema errors, value errors."""
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from rl.config import RunConfig
from rl.config.compose import CONFIGS, compose_run_config
from rl.config.checks import check_optional_groups, check_tokenizer
from rl.config.resume import resolved_config


def default_run(*overrides: str) -> RunConfig:
    """The config `python -m rl.train *overrides` runs."""
    return compose_run_config(overrides)


def composed(*overrides: str) -> RunConfig:
    """The loop tests' base: `python -m rl.train experiment=single_turn *overrides` (the single-turn
    preset: no warm-up, spill, prefix cache or budget unless a test asks), or the experiment the
    overrides select."""
    chosen = any(o.startswith("experiment=") for o in overrides)
    return compose_run_config(overrides if chosen else ("experiment=single_turn", *overrides))


def test_default_is_the_multi_turn_demo_and_overrides_apply():
    cfg = default_run()
    assert cfg.experiment.name == "cpu_demo" and cfg.model.hidden_size == 64
    assert cfg.task.name == "key_lookup" and cfg.rollout.max_concurrency is None  # the auto-throttle
    cfg = default_run("task=majority_digit", "rollout.max_concurrency=12", "algo=rloo")
    assert cfg.task.name == "majority_digit" and cfg.rollout.max_concurrency == 12 and cfg.algo.advantage == "rloo"
    assert composed().experiment.name == "single_turn" and composed().task.name == "majority_digit"


def test_the_default_run_has_every_mechanism_on():
    """`make run` shows the system: a two-turn tool task with a warm-up, the prefix cache, a host KV
    pool, the NVMe spill, a streamed KL reference and partial rollouts that keep their KV."""
    cfg = default_run()
    assert cfg.task.name == "key_lookup" and cfg.warmup.steps > 0 and not cfg.warmup.value
    assert cfg.engine.prefix_cache is not None and cfg.engine.prefix_cache.hash_block <= 16
    assert cfg.has_host_pool and cfg.memory.spill_dir is not None
    assert cfg.algo.loss.kl_coef > 0 and cfg.memory.reference == "stream"
    assert cfg.rollout.budget_tokens is not None and cfg.rollout.partial_resume == "kv"
    assert cfg.experiment.num_threads == 1


def test_unknown_key_names_it():
    with pytest.raises(ConfigCompositionException) as err:
        composed("rollout.max_new_tokns=3")
    assert "max_new_tokns" in str(err.value.__cause__ or err.value)


def test_wrong_type_names_key_and_value():
    with pytest.raises(ConfigCompositionException) as err:
        composed("trainer.num_chunks=two")
    message = str(err.value.__cause__ or err.value)
    assert "num_chunks" in message and "two" in message


@pytest.mark.parametrize("override, words", [
    ("rollout.budget_tokens=-5", ["budget_tokens=-5", ">= 1"]),
    ("rollout.budget_seconds=-1.0", ["budget_seconds=-1.0", "> 0"]),
    ("rollout.max_concurrency=lots", ["rollout.max_concurrency", "'lots'", "Integer"]),
    ("rollout.max_concurrency=0", ["rollout.max_concurrency=0", "integer >= 1 or null"]),
    ("algo.group_size=1", ["group_size=1", ">= 2"]),
    ("rollout.temperature=0.7", ["temperature=0.7", "1.0"]),
    ("rollout.top_p=1.5", ["rollout.top_p=1.5", "(0, 1]"]),
    ("tracking.wandb_mode=ofline", ["ofline", "offline"]),
    ("kv_budget=h2o engine.kv_budget.budget_tokens=30", ["engine.kv_budget.budget_tokens=30",
                                                          "sink_tokens + recent_tokens"]),
    ("kv_budget=h2o engine.kv_budget.budget_tokens=64 engine.kv_budget.policy=lru",
     ["unknown eviction policy 'lru'", "'infinigen'"]),
    ("engine.prefix_cache.hash_block=16", ["engine.prefix_cache.hash_block=16", "prefix_cache=on"]),
    ("experiment.num_threads=0", ["experiment.num_threads=0", ">= 1 or null"]),
    ("warmup.steps=-1", ["warmup", "steps=-1", "expected steps >= 0"]),
    ("trainer.chunk_split=bytes", ["trainer.chunk_split='bytes'", "'layers', 'params'"]),
    ("trainer.num_chunks=9", ["trainer.num_chunks=9", "at most 8 for a model of 8 layers", "'params' allows layers + 2"]),
])
def test_bad_values_fail_with_the_value_and_what_was_expected(override, words):
    with pytest.raises(Exception) as err:
        composed(*override.split())
    message = f"{err.value} {err.value.__cause__ or ''}"  # a wrong type: Hydra's error, OmegaConf's cause
    assert all(w in message for w in words), message


def test_kv_resume_conflicts_with_releasing_the_pool():
    with pytest.raises(Exception, match="release_pool_in_train"):
        composed("rollout.partial_resume=kv")
    assert composed("rollout.partial_resume=kv", "memory.release_pool_in_train=false").rollout.partial_resume == "kv"
    assert composed("rollout.partial_resume=kv", "engine.host_pool_mb=4").engine.host_pool_mb == 4  # parked there
    with pytest.raises(Exception, match="host_pool_mb=-1"):
        composed("engine.host_pool_mb=-1")


def test_help_lists_the_groups():
    out = subprocess.run([sys.executable, "-m", "rl.train", "--help"], capture_output=True, text=True,
                         cwd=Path(CONFIGS).parent, timeout=120)
    assert out.returncode == 0, out.stderr
    for group in ("model", "task", "algo", "rollout", "engine", "prefix_cache", "kv_budget", "memory", "trainer",
                  "experiment"):
        assert f"{group}:" in out.stdout, out.stdout


# What the single-turn demo (`experiment=single_turn`, the default run `experiment=cpu_demo` until the
# multi-turn demo took its place) ran with before the groups became the components' own configs (then:
# rollout.max_model_len=256, memory.pool_mb=16, trainer.num_chunks=2, ...): the preset must keep
# resolving to exactly these values. (Since then the aliases engine.seed, engine.show_progress and
# rollout.reuse_stale_prefix and the page-count sizes engine.num_pages / host_num_pages are gone, and
# the stored task params list every constructor keyword.)
DEFAULT_RUN = {
    "rollout": {"groups_per_iteration": 8, "max_new_tokens": 1, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                "max_concurrency": None, "budget_tokens": None, "budget_seconds": None,
                "max_drop_fraction": 0.5, "partial_resume": "recompute",
                "max_staleness": None,  # KV across iterations: off
                "max_groups_in_flight": None, "stagger_lead": 0},
    "engine": {"max_model_len": 256, "pool_mb": 16, "group_layers": None, "block_tokens": None,
               "max_num_batched_tokens": 1024, "max_num_seqs": 128, "kernel_impl": None,
               "check_every_step": False, "prefix_cache": None, "host_pool_mb": 0,
               "kv_budget": None, "kda_state_dtype": "fp32", "speculative": "off", "num_speculative_tokens": 4,
               "ngram_min": 1, "ngram_max": 4, "suffix_max_depth": 8, "suffix_max_tokens": 65536,
               "suffix_min_share": 0.3, "speculative_row_cost": 0.016, "draft_model": None},
    "trainer": {"num_chunks": 2, "chunk_split": "layers", "num_grad_slots": 2, "max_bad_steps": 3,
                "max_grad_norm": 1.0, "micro_batch_tokens": None,
                "optimizer": {"lr": 5e-4, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.0, "backend": "auto",
                              "lr_schedule": "constant", "warmup_steps": 0, "min_lr_ratio": 0.0, "total_steps": None}},
    "memory": {"release_pool_in_train": True, "reference": "stream", "host_budget_mb": None, "spill_dir": None},
    "algo": {"advantage": "grpo", "group_size": 16, "ppo_epochs": 1, "mini_batches": 1},
    "experiment": {"name": "single_turn", "iterations": 400, "dtype": "fp32", "device": "cpu"},
    "task": {"name": "majority_digit", "params": {"length": 3, "format_reward": 0.1, "max_turns": 1}},
    "warmup": {"steps": 0},
    "env": {"workers": 0, "timeout_s": 60.0, "max_retries": 0, "on_failure": "drop",  # inline calls, as before
            "tool_latency_median_s": 0.0, "tool_latency_sigma": 1.0, "tool_latency_max_s": None},  # no tool latency
}


def test_the_single_turn_preset_resolves_to_the_pinned_values():
    resolved = resolved_config(compose_run_config(["experiment=single_turn"]))
    for group, values in DEFAULT_RUN.items():
        assert {k: resolved[group][k] for k in values} == values, group
    assert set(resolved["engine"]) == set(DEFAULT_RUN["engine"]) and set(resolved["rollout"]) == set(DEFAULT_RUN["rollout"])


def test_the_optional_engine_nodes_are_groups():
    cfg = composed("prefix_cache=on", "engine.prefix_cache.hash_block=32")
    assert cfg.engine.prefix_cache.hash_block == 32 and cfg.engine.prefix_cache.model_id == "policy"
    assert composed().engine.prefix_cache is None and composed().engine.kv_budget is None
    cfg = composed("kv_budget=infinigen", "engine.kv_budget.budget_tokens=64")
    assert cfg.engine.kv_budget.budget_tokens == 64 and cfg.engine.kv_budget.policy == "infinigen"
    assert cfg.engine.longest_kv_tokens == 64
    with pytest.raises(Exception, match="budget_tokens"):  # a budget needs its size
        composed("kv_budget=h2o")


@pytest.mark.parametrize("overrides, words", [
    (["engine.prefix_cache.hash_block=16"], "select it first: prefix_cache=on engine.prefix_cache.hash_block=16"),
    (["+engine.kv_budget.budget_tokens=64"], "select it first: kv_budget=h2o|infinigen"),
])
def test_an_optional_group_key_without_its_group_names_the_selection(overrides, words):
    with pytest.raises(ValueError, match=words.replace("|", r"\|")):
        check_optional_groups(overrides)
    with pytest.raises(ValueError, match="is off"):
        composed(*overrides)
    check_optional_groups(["kv_budget=h2o", "engine.kv_budget.budget_tokens=64", "prefix_cache=on",
                           "engine.prefix_cache.hash_block=16"])


def test_mini_batches_with_several_ranks_are_refused_at_composition(monkeypatch):
    assert composed("algo.mini_batches=2").algo.mini_batches == 2  # one rank
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="algo.mini_batches=2 with 2 ranks"):
        composed("algo.mini_batches=2")
    assert composed("algo.ppo_epochs=2").algo.ppo_epochs == 2


def test_a_tokenizer_larger_than_the_vocabulary_is_refused():
    class Tokenizer:
        vocab_size = 300

    cfg = composed()
    with pytest.raises(ValueError, match="has 300 tokens but the model's vocab_size is 259"):
        check_tokenizer(cfg, Tokenizer())
    Tokenizer.vocab_size = 259
    check_tokenizer(cfg, Tokenizer())
