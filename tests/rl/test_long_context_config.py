"""Long contexts are configuration: engine.max_model_len and engine.pool_mb are checked against each
other at composition (the engine's page math); a too-long trajectory is dropped, logged and counted,
and the run goes on."""
import math
from dataclasses import dataclass

import pytest

from models.model import HybridLM
from models.precision import cast_parameters
from models.tokenizer import ByteTokenizer
from rl.plan.model import cache_layout
from rl.episodes.driver import DriverConfig, RolloutDriver, mix_seed
from rl.envs.tasks.base import TASKS, StepResult, register_task
from rl.train import run
from rollout import ContextTooLong
from rollout.engine import Engine, EngineConfig
from tests.rl.test_config import composed
from tests.rl.test_train_run import SMALL


@dataclass
class OneLongPrompt:
    """Majority-digit-like, single turn: `length` digits, `long_len` for the episode seeded `long_seed`."""
    long_seed: int = -1
    long_len: int = 40
    length: int = 7
    max_turns: int = 1

    def reset(self, seed: int) -> str:
        return "1" * (self.long_len if seed == self.long_seed else self.length) + "="

    def step(self, answer: str) -> StepResult:
        return StepResult("", float(answer[:1] == "1"), True)


@dataclass
class LongSecondTurn:
    """Two turns; the tool's observation is `long_len` characters for the episode seeded `long_seed`."""
    long_seed: int = -1
    long_len: int = 60
    max_turns: int = 2
    seed: int = 0
    turn: int = 0

    def reset(self, seed: int) -> str:
        self.seed, self.turn = seed, 0
        return "q?"

    def step(self, answer: str) -> StepResult:
        self.turn += 1
        observation = "x" * (self.long_len if self.seed == self.long_seed else 2) + ":"
        return StepResult(observation, 0.5, self.turn >= 2)


for name, task in (("test_one_long_prompt", OneLongPrompt), ("test_long_second_turn", LongSecondTurn)):
    if name not in TASKS:
        register_task(name)(task)


def test_a_128k_context_is_configuration_with_a_pool_to_match():
    cfg = composed()
    layout = cfg.cache_layout
    needed = len(layout.kda_groups) + len(layout.mla_groups) * math.ceil(131072 / layout.block_tokens)
    mb = math.ceil(needed * layout.page_bytes / (1 << 20))
    with pytest.raises(ValueError) as err:
        composed("engine.max_model_len=131072")
    message = str(err.value)
    for words in (f"engine.pool_mb={cfg.engine.pool_mb} holds {cfg.engine.pool_bytes // layout.page_bytes} pages",
                  "engine.max_model_len=131072", f"needs {needed} pages", f"engine.pool_mb >= {mb}"):
        assert words in message, message
    with pytest.raises(ValueError, match=f"needs {needed} pages"):
        composed("engine.max_model_len=131072", f"engine.pool_mb={mb - 1}")
    big = composed("engine.max_model_len=131072", f"engine.pool_mb={mb}")
    # a KV budget caps what one sequence holds on the device: the default pool is enough
    composed("engine.max_model_len=131072", "kv_budget=h2o", "engine.kv_budget.budget_tokens=4096")

    # The engine rl/train.py builds from that config accepts it and admits up to max_model_len - 1 tokens.
    model = HybridLM(big.model)
    engine = Engine(model, EngineConfig(max_model_len=big.engine.max_model_len, pool_mb=big.engine.pool_mb))
    assert engine.layout == big.cache_layout and engine.pool.num_pages >= needed
    engine.check_context(131071)
    with pytest.raises(ContextTooLong, match="prompt of 131072 tokens does not fit max_model_len=131072"):
        engine.check_context(131072)
    with pytest.raises(ValueError, match="cannot hold one sequence of 131072 tokens"):
        Engine(model, EngineConfig(max_model_len=131072, pool_mb=mb - 1))


@pytest.mark.parametrize("overrides, build_engine", [
    ([], True), (["engine.kda_state_dtype=bf16"], True), (["experiment.dtype=bf16"], True),
    (["model=kimi_linear_mid", "engine.pool_mb=64"], False),  # the planner's figures only: a 0.43B model
    (["prefix_cache=on", "engine.prefix_cache.hash_block=48"], True),  # 48-token pages: 64 is no multiple of 48
])
def test_the_configs_page_math_is_the_engines_and_the_planners(overrides, build_engine):
    cfg = composed(*overrides)
    layout = cfg.cache_layout
    assert layout == cache_layout(cfg)
    lengths = [1, 63, 64, 65, 127, 4096, 131072]
    by_hand = [len(layout.kda_groups) + len(layout.mla_groups) * -(-n // layout.block_tokens) for n in lengths]
    assert [layout.sequence_pages(n) for n in lengths] == by_hand
    if build_engine:
        model = cast_parameters(HybridLM(cfg.model), cfg.experiment.torch_dtype)
        engine = Engine(model, EngineConfig(kda_state_dtype=cfg.engine.kda_state_dtype,
                                            pool_mb=cfg.engine.pool_mb, prefix_cache=cfg.engine.prefix_cache))
        assert engine.layout == layout
        assert [engine.cache.pages_for_tokens(n) for n in lengths] == by_hand


@pytest.mark.parametrize("override, words", [
    ("engine.max_num_batched_tokens=0", ["engine.max_num_batched_tokens=0", ">= 1"]),
    ("engine.max_model_len=1", ["engine.max_model_len=1", ">= 2"]),
    ("rollout.max_new_tokens=256", ["rollout.max_new_tokens=256", "engine.max_model_len=256",
                                    "max_new_tokens < max_model_len"]),
    ("model=kimi_linear_mid", ["engine.pool_mb=16 holds 3 pages", "needs 4 pages", "engine.pool_mb >= 19"]),
])
def test_rollout_limits_fail_at_composition_with_the_numbers(override, words):
    with pytest.raises(ValueError) as err:
        composed(override)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_a_step_budget_below_max_model_len_is_allowed():
    cfg = composed("engine.max_model_len=1024", "engine.max_num_batched_tokens=64")
    assert cfg.engine.max_num_batched_tokens < cfg.engine.max_model_len  # chunked prefill covers the rest


def test_a_run_drops_the_group_whose_prompt_is_too_long_and_trains_the_others(tmp_path, capsys):
    long_group = 1
    cfg = composed(f"run_dir={tmp_path}", "experiment.iterations=1", *SMALL, "engine.max_model_len=32",
                   "task.name=test_one_long_prompt", f"+task.params.long_seed={mix_seed(0, long_group)}")
    history = run(cfg)
    assert history[0]["rollout_dropped_too_long"] == 4  # the group's 4 trajectories
    assert history[0]["groups_trained"] == 3 and history[0]["train_sequences"] == 12
    assert history[0]["env_errors"] == 0
    printed = capsys.readouterr().out
    # "<BOS>" + 40 digits + "=": 42 tokens; the line names the group, the tokens and the limit
    assert f"dropped group {long_group} (4 trajectories): ContextTooLong: prompt of 42 tokens does not fit " \
           f"max_model_len=32" in " ".join(printed.split()), printed


def test_a_later_turn_that_outgrows_max_model_len_drops_that_trajectory_and_skips_an_empty_group():
    model = HybridLM(composed().model).init_weights(seed=0, std=0.1)
    engine = Engine(model, EngineConfig.for_pages(model, 64, max_model_len=48, check_every_step=True))
    long_group = 2
    driver = RolloutDriver(engine, ByteTokenizer(), "test_long_second_turn", {"long_seed": mix_seed(1, long_group)},
                           DriverConfig(groups_per_iteration=4, max_new_tokens=4), group_size=3, seed=1)
    metrics = driver.run_iteration()
    groups = driver.take_finished_groups()
    assert metrics["rollout_dropped_too_long"] == 3 and metrics["env_errors"] == 0
    assert [g[0].group_id for g in groups] == [0, 1, 3] and all(len(g) == 3 for g in groups)
    assert all(len(t.answers) == 2 for g in groups for t in g)
    assert not driver.group_sizes and not driver.waiting and not driver.carry  # the dropped group is forgotten
    assert len(driver.errors) == 3
    for member, line in enumerate(driver.errors):  # bos + "q?" + answer + 60 x "x" + ":" >= 64 tokens > 48
        assert line.startswith(f"trajectory {long_group}/{member} (group {long_group}, turn 2): ContextTooLong: "
                               f"prompt of "), line
        assert "does not fit max_model_len=48" in line
    assert engine.pool.num_free == engine.pool.num_pages and not engine.requests
