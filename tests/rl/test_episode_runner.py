"""The training rollout and validation play an episode through one EpisodeRunner (rl/episodes/runner.py):
for the same data rows, the prompts validation submits to the engine are the training rollout's, token
for token, on the first turn (the task's tool schemas in the chat template) and on the turn after a
tool's reply (rendered in the template's tool role)."""
import pytest

from models.config import load_model_config
from models.model import HybridLM
from models.tokenizer import TokenizerConfig, load_tokenizer
from rl.envs.data import RowSampler
from rl.envs.tasks.base import TASKS, register_task
from rl.envs.tasks.tool_arith import ToolArith
from rl.episodes.driver import DriverConfig, RolloutDriver
from rl.episodes.runner import EpisodeRunner, as_messages, render_prompt
from rl.episodes.validation import EvalConfig, evaluate
from rollout.engine import Engine, EngineConfig
from tests.tokenizer_dirs import BOS, EOS, PAD, build_bpe_tokenizer

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

TOOLS_AND_ROLES = (
    "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML that names the tools it is given in a system turn and writes every message's own role, so
a prompt rendered without the tools, or a tool reply rendered as a user turn, has other tokens."""


class RowToolArith(ToolArith):
    """tool_arith over data rows, its first turn an oracle's: row {"prompt": "<k>"} is tool_arith's
    episode k, and whatever the policy answers first, the right call runs in the sandbox, so every
    episode reaches the tool's reply (observation role "tool") and a second turn."""

    def reset(self, seed: int, row: dict | None = None) -> str:
        prompt = super().reset(int(row["prompt"]) if row is not None else seed)  # "37*8="
        self.call = f"[py:{prompt.removesuffix('=')}]"  # the right call (tool_arith's demonstration)
        return prompt

    def step(self, answer: str):
        call, self.call = self.call, None
        return super().step(call if call is not None else answer)


if "test_row_tool_arith" not in TASKS:
    register_task("test_row_tool_arith")(RowToolArith)

ROWS = [{"prompt": str(k), "label": ""} for k in range(3)]
GROUP_SIZE = 2


def recording_engine(tok):
    """A tiny engine whose `add_request` records every prompt it is given (in `engine.prompts`)."""
    overrides = [f"vocab_size={tok.vocab_size}", f"bos_token_id={BOS}", f"eos_token_id={EOS}", f"pad_token_id={PAD}"]
    model = HybridLM(load_model_config("configs/model/tiny.yaml", overrides)).init_weights(seed=0, std=0.1)
    engine = Engine(model, EngineConfig.for_pages(model, 64, max_model_len=256))
    engine.prompts, add = [], engine.add_request

    def add_request(prompt, params=None, request_id=None, turn_boundaries=()):
        engine.prompts.append(list(prompt))
        return add(prompt, params, request_id, turn_boundaries)

    engine.add_request = add_request
    engine.load_weights(model.state_dict(), version=1)
    return engine


def training_prompts(tok) -> list[list[int]]:
    engine = recording_engine(tok)
    d = RolloutDriver(engine, tok, "test_row_tool_arith", {"workers": 1},
                      DriverConfig(groups_per_iteration=len(ROWS), max_new_tokens=4), group_size=GROUP_SIZE, seed=3,
                      rows=RowSampler(ROWS, shuffle=False))
    d.sampling["temperature"] = 0.0  # greedy, as validation's default: both sample the same answers
    result = d.rollout()
    assert result.errors == [] and sum(len(g) for g in result.groups) == len(ROWS) * GROUP_SIZE
    assert all(len(t.answers) == 2 for g in result.groups for t in g)
    return engine.prompts


def validation_prompts(tok) -> list[list[int]]:
    engine = recording_engine(tok)
    metrics = evaluate(engine, tok, "test_row_tool_arith", {"workers": 1},
                       EvalConfig(num_prompts=len(ROWS), n=GROUP_SIZE, max_new_tokens=4), seed=5, iteration=0,
                       out_dir=None, rows=ROWS)
    assert metrics["val/errors"] == 0 and metrics["val/num_samples"] == len(ROWS) * GROUP_SIZE
    return engine.prompts


def by_turn(prompts: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """(first-turn prompts, later ones), each sorted: a later turn's prompt extends an earlier prompt."""
    later = [p for p in prompts if any(len(q) < len(p) and p[:len(q)] == q for q in prompts)]
    return sorted(p for p in prompts if p not in later), sorted(later)


def test_validation_submits_the_training_rollouts_prompts_first_turn_and_after_a_tool_reply(tmp_path):
    tok = load_tokenizer(TokenizerConfig(path=str(build_bpe_tokenizer(tmp_path / "tok", chat_template=TOOLS_AND_ROLES))))
    (train_first, train_next), (val_first, val_next) = by_turn(training_prompts(tok)), by_turn(validation_prompts(tok))
    text = tok.tokenizer.decode
    # the same prompts (decoded first, so a difference reads as text), token for token
    assert [text(p) for p in val_first] == [text(p) for p in train_first]
    assert val_first == train_first
    assert [text(p) for p in val_next] == [text(p) for p in train_next]
    assert val_next == train_next
    # what they are: the row's problem under the task's tools; after it, the tool's reply in the tool role
    env = RowToolArith(workers=1)
    assert train_first == sorted(render_prompt(tok, env.reset(0, row=row), env.tools.schemas()) for row in ROWS)
    assert all(text(p).startswith("<|im_start|>system\ntools: py<|im_end|>") for p in train_first)
    assert len(train_next) == len(ROWS) * GROUP_SIZE, "one second turn per trajectory"
    assert all("<|im_start|>tool\n=" in text(p) and text(p).endswith("<|im_start|>assistant\n") for p in train_next)


def test_the_runner_renders_the_first_prompt_with_the_tasks_tools_and_a_reply_in_its_role(tmp_path):
    tok = load_tokenizer(TokenizerConfig(path=str(build_bpe_tokenizer(tmp_path / "tok", chat_template=TOOLS_AND_ROLES))))
    runner = EpisodeRunner.for_task(recording_engine(tok), tok, RowToolArith(workers=1))
    assert as_messages("37*8=") == [{"role": "user", "content": "37*8="}]
    assert as_messages([{"role": "system", "content": "s"}]) == [{"role": "system", "content": "s"}]
    assert tok.tokenizer.decode(runner.first_prompt("37*8=")).startswith("<|im_start|>system\ntools: py<|im_end|>")
    env = RowToolArith(workers=1)
    env.reset(0, row=ROWS[1])
    outcome = runner.outcome(env.step("anything"), turn=1, max_turns=env.max_turns)
    assert not outcome.last and outcome.reward == 0.0
    assert tok.tokenizer.decode(outcome.observation).startswith("\n<|im_start|>tool\n=")
