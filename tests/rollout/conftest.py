import pytest
import torch

from models.config import load_model_config
from models.model import HybridLM


@pytest.fixture(scope="session")
def tiny_model():
    """The tiny config with weights wide enough that greedy choices are not near-ties."""
    return HybridLM(load_model_config("configs/model/tiny.yaml")).init_weights(seed=7, std=0.15).eval()


def greedy_reference(model: HybridLM, prompt: list[int], num_new: int) -> tuple[list[int], list[float]]:
    """Greedy decoding by repeated full forward passes of the plain model (no cache at all)."""
    tokens, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(num_new):
            logits = model(torch.tensor([tokens]))[0, -1].float()
            token = int(logits.argmax())
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            tokens.append(token)
    return tokens[len(prompt):], logprobs
