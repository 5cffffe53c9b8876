import pytest
import torch

from tests.models.hf_reference import hf_config, random_hf_model


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative error ||actual - expected|| / ||expected|| (Frobenius), the tolerance unit of the issues."""
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """Factory: (moe, q_lora_rank) -> (directory saved by transformers' save_pretrained, HF model)."""
    made = {}

    def make(moe: bool = True, q_lora_rank: int | None = None, num_layers: int = 4):
        key = (moe, q_lora_rank, num_layers)
        if key not in made:
            model = random_hf_model(hf_config(moe=moe, q_lora_rank=q_lora_rank, num_layers=num_layers))
            path = tmp_path_factory.mktemp("hf_kimi")
            model.save_pretrained(path)
            made[key] = (path, model)
        return made[key]

    return make
