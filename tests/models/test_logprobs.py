"""Chunked per-token logprobs equal log_softmax over full logits, values and gradients."""
import pytest
import torch

from models.config import load_model_config
from models.model import HybridLM
from tests.models.conftest import rel_err


@pytest.fixture(scope="module")
def model():
    return HybridLM(load_model_config("configs/model/tiny.yaml")).init_weights(seed=0, std=0.1)


def reference_logprobs(model, ids, targets, lengths):
    logp = torch.log_softmax(model(ids, lengths=lengths).float(), dim=-1)
    out = logp.gather(-1, targets[..., None])[..., 0]
    for b, n in enumerate(lengths):
        out[b, n:] = 0
    return out


def test_chunked_logprobs_equal_full_log_softmax(model):
    torch.manual_seed(0)
    lengths = [50, 23, 1]
    ids = torch.randint(0, 259, (3, 50))
    targets = torch.randint(0, 259, (3, 50))
    with torch.no_grad():
        expected = reference_logprobs(model, ids, targets, lengths)
        for chunk_len in (1, 7, 64, 4096):
            actual = model.token_logprobs(ids, targets, lengths=lengths, chunk_len=chunk_len)
            assert actual.dtype == torch.float32 and actual.shape == (3, 50)
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert (expected[0] < 0).all() and (expected[2, 1:] == 0).all()


def test_chunked_logprobs_gradients_match(model):
    torch.manual_seed(1)
    ids, targets = torch.randint(0, 259, (2, 33)), torch.randint(0, 259, (2, 33))
    lengths = [33, 20]
    weights = torch.randn(2, 33)  # an arbitrary downstream loss
    params = [p for p in model.parameters()]

    def grads(fn):
        model.zero_grad()
        (fn() * weights).sum().backward()
        return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]

    expected = grads(lambda: reference_logprobs(model, ids, targets, lengths))
    actual = grads(lambda: model.token_logprobs(ids, targets, lengths=lengths, chunk_len=8))
    assert any(g.abs().sum() > 0 for g in expected)
    for name, e, a in zip([n for n, _ in model.named_parameters()], expected, actual):
        if e.abs().sum() > 0:  # e.g. unrouted experts get no gradient on either path
            assert rel_err(a, e) <= 1e-5, name
        else:
            assert a.abs().sum() == 0, name


def test_bad_inputs_are_named(model):
    ids = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"targets shape \(2, 4\)"):
        model.token_logprobs(ids, ids[:, :4])
    with pytest.raises(ValueError, match=r"lengths \[5, 6\] must hold 2 values in \[1, 5\]"):
        model.token_logprobs(ids, ids, lengths=[5, 6])
    with pytest.raises(ValueError, match="chunk_len=0"):
        model.token_logprobs(ids, ids, chunk_len=0)
