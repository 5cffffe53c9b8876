"""The rollout driver with a chat-template tokenizer: prompts are the template's rendering, tool
replies continue the conversation in the template, and requests stop on the tokenizer's stop ids."""
from dataclasses import dataclass

import pytest
import torch

from models.config import load_model_config
from models.model import HybridLM
from models.tokenizer import TokenizerConfig, load_tokenizer
from rl.episodes.driver import DriverConfig, RolloutDriver
from rl.envs.tasks.base import TASKS, StepResult, register_task
from rollout.engine import Engine, EngineConfig
from tests.tokenizer_dirs import BOS, END_OF_TEXT, EOS, IM_END, PAD, build_bpe_tokenizer

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

PROMPT, REPLY = "get the key", "the key is seven"


@dataclass
class ChatTwoTurns:
    """Always two turns with fixed texts."""
    max_turns: int = 2
    turn: int = 0

    def reset(self, seed: int) -> str:
        self.turn = 0
        return PROMPT

    def step(self, answer: str) -> StepResult:
        self.turn += 1
        return StepResult(REPLY, 0.0, self.turn >= 2)


if "test_chat_two_turns" not in TASKS:
    register_task("test_chat_two_turns")(ChatTwoTurns)


def test_driver_renders_prompts_continues_turns_and_stops_on_stop_ids(tmp_path):
    path = build_bpe_tokenizer(tmp_path / "tok", generation_eos=[EOS, END_OF_TEXT])
    tok = load_tokenizer(TokenizerConfig(path=str(path), system_prompt="Be brief!"))
    overrides = [f"vocab_size={tok.vocab_size}", f"bos_token_id={BOS}", f"eos_token_id={EOS}", f"pad_token_id={PAD}"]
    model = HybridLM(load_model_config("configs/model/tiny.yaml", overrides)).init_weights(seed=0, std=0.1)
    with torch.no_grad():  # logits are +-1000 * h0 on two stop ids that are not the model's eos, 0 elsewhere:
        model.model.norm.weight.zero_()  # every first sampled token is one of them (whichever sign h0 has)
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[IM_END, 0], model.lm_head.weight[END_OF_TEXT, 0] = 1000.0, -1000.0
    engine = Engine(model, EngineConfig.for_pages(model, 64, max_model_len=256, check_every_step=True))
    stop_ids_seen = set()
    add = engine.add_request

    def recording_add(prompt, params=None, request_id=None, turn_boundaries=()):
        stop_ids_seen.add(params.stop_token_ids)
        return add(prompt, params, request_id, turn_boundaries)

    engine.add_request = recording_add
    driver = RolloutDriver(engine, tok, "test_chat_two_turns", {},
                           DriverConfig(groups_per_iteration=2, max_new_tokens=4), group_size=3, seed=1)
    engine.load_weights(model.state_dict(), version=1)
    driver.run_iteration()
    trajs = [t for g in driver.take_finished_groups() for t in g]
    assert len(trajs) == 6 and all(len(t.answers) == 2 for t in trajs)
    assert stop_ids_seen == {(EOS, END_OF_TEXT, IM_END)}
    prompt = tok.render([{"role": "user", "content": PROMPT}])
    reply = tok.continue_turn(REPLY)
    for t in trajs:
        assert t.tokens[:len(prompt)] == prompt and t.policy.index(True) == len(prompt)
        boundary = t.turn_boundaries[0]
        first_answer_end = max(i for i in range(boundary) if t.policy[i]) + 1
        assert t.tokens[first_answer_end:boundary] == reply and not any(t.policy[first_answer_end:boundary])
        for turn in (t.tokens[len(prompt):first_answer_end], t.tokens[boundary:]):
            assert len(turn) == 1 and turn[0] in (IM_END, END_OF_TEXT)  # the stop id ended the turn at once
