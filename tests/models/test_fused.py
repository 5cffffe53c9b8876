"""Fused inference projections (models/fused.py) against the separate modules they replace."""
import pytest
import torch

from models.config import load_model_config
from models.model import HybridLM

pytestmark = [pytest.mark.numerics]  # compares two computation orders: run under every CPU kernel path (make test-slow)


def tiny(seed: int = 0) -> HybridLM:
    return HybridLM(load_model_config("configs/model/tiny.yaml")).init_weights(seed=seed, std=0.1)


def test_fused_logits_match_the_training_path():
    model = tiny()
    ids = torch.randint(0, 256, (2, 23), generator=torch.Generator().manual_seed(1))
    plain = model(ids).detach()  # grad enabled: separate projections
    with torch.no_grad():
        fused = model(ids)  # fused projections
    assert model.model.layers[1].mlp.__dict__.get("_fused_weights"), "the fused MoE path did not run"
    assert model.model.layers[0].self_attn.__dict__.get("_fused_weights"), "the fused KDA path did not run"
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)


def test_fused_weights_follow_in_place_updates_and_loads():
    model, other = tiny(0), tiny(1)
    ids = torch.randint(0, 256, (1, 17), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        model(ids)  # builds the caches
    with torch.no_grad():
        for p in model.parameters():  # an optimizer-style in-place update
            p.mul_(0.9)
        after_update = model(ids)
    expected = model(ids).detach()
    torch.testing.assert_close(after_update, expected, rtol=1e-5, atol=1e-5)
    model.load_state_dict(other.state_dict())  # copy_ into the same storage
    with torch.no_grad():
        torch.testing.assert_close(model(ids), other(ids), rtol=1e-5, atol=1e-5)
