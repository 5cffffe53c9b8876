"""Composition of the run config: groups, typed schema errors, value errors."""
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from rl.config import RunConfig, register_configs, to_run_config

CONFIGS = str(Path(__file__).resolve().parents[2] / "configs")
register_configs()


def composed(*overrides: str) -> RunConfig:
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return to_run_config(compose("config", overrides=list(overrides)))


def test_default_is_cpu_demo_and_overrides_apply():
    cfg = composed()
    assert cfg.experiment.name == "cpu_demo" and cfg.model.hidden_size == 64
    assert cfg.task.name == "majority_digit" and cfg.rollout.max_concurrency == "auto"
    cfg = composed("task=key_lookup", "rollout.max_concurrency=12", "algo=rloo")
    assert cfg.task.name == "key_lookup" and cfg.rollout.concurrency == 12 and cfg.algo.advantage == "rloo"


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
    ("rollout.max_concurrency=lots", ["max_concurrency='lots'", "'auto'"]),
    ("algo.group_size=1", ["group_size=1", ">= 2"]),
    ("rollout.temperature=0.7", ["temperature=0.7", "1.0"]),
    ("rollout.top_p=1.5", ["rollout.top_p=1.5", "(0, 1]"]),
    ("tracking.wandb_mode=ofline", ["ofline", "offline"]),
    ("rollout.kv_budget_tokens=30", ["rollout.budget_tokens=30", "sink_tokens + recent_tokens"]),
    ("rollout.kv_policy=lru", ["unknown eviction policy 'lru'", "'infinigen'"]),
    ("trainer.chunk_split=bytes", ["trainer.chunk_split='bytes'", "'layers', 'params'"]),
    ("trainer.num_chunks=9", ["trainer.num_chunks=9", "at most 8 for a model of 8 layers", "'params' allows layers + 2"]),
])
def test_bad_values_fail_with_the_value_and_what_was_expected(override, words):
    with pytest.raises(Exception) as err:
        composed(override)
    message = str(err.value)
    assert all(w in message for w in words), message


def test_kv_resume_conflicts_with_releasing_the_pool():
    with pytest.raises(Exception, match="release_pool_in_train"):
        composed("rollout.partial_resume=kv")
    assert composed("rollout.partial_resume=kv", "memory.release_pool_in_train=false").rollout.partial_resume == "kv"
    assert composed("rollout.partial_resume=kv", "memory.host_pool_mb=4").memory.host_pool_mb == 4  # parked there
    with pytest.raises(Exception, match="host_pool_mb=-1"):
        composed("memory.host_pool_mb=-1")


def test_help_lists_the_groups():
    out = subprocess.run([sys.executable, "-m", "rl.train", "--help"], capture_output=True, text=True,
                         cwd=Path(CONFIGS).parent, timeout=120)
    assert out.returncode == 0, out.stderr
    for group in ("model", "task", "algo", "rollout", "memory", "trainer", "experiment"):
        assert f"{group}:" in out.stdout, out.stdout
