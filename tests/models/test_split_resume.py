"""Split-and-resume: prefill [0, p), then continue from the returned state == one full pass.

This is the property prefix caching relies on: a state (KDA S + conv tails, MLA latent cache)
saved at any position p is an exact stand-in for recomputing the first p tokens.
"""
import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models.checkpoint import load_checkpoint
from models.config import load_model_config
from models.model import HybridLM
from models.state import SequenceState
from tests.models.conftest import rel_err

TOL = 1e-5


@pytest.fixture(scope="module")
def models(hf_checkpoint):
    """A transformers-made MoE model (NoPE, q-lora) and one of ours with RoPE + gated MLA."""
    path, _ = hf_checkpoint(True, 16, 8)
    nope = load_checkpoint(path)
    cfg = dataclasses.replace(load_model_config("configs/model/tiny.yaml"), mla_use_nope=False, mla_output_gate=True)
    rope = HybridLM(cfg).init_weights(seed=3, std=0.15).eval()
    return {"nope": nope, "rope-gated": rope}


def run_in_pieces(model, tokens: torch.Tensor, cuts: list[int]) -> tuple[torch.Tensor, SequenceState]:
    state, logits = None, []
    for a, b in zip([0] + cuts, cuts + [tokens.numel()]):
        out = model.forward_with_state([tokens[a:b]], [state])
        state = out.states[0]
        logits.append(out.logits[0])
    return torch.cat(logits), state


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
@pytest.mark.parametrize("which", ["nope", "rope-gated"])
def test_split_and_resume_equals_full_pass(models, which, data):
    model = models[which]
    seq_len = data.draw(st.integers(2, 150), label="seq_len")
    cuts = sorted(data.draw(st.sets(st.integers(1, seq_len - 1), min_size=1, max_size=4), label="cuts"))
    tokens = torch.randint(3, model.config.vocab_size, (seq_len,), generator=torch.Generator().manual_seed(seq_len))
    with torch.no_grad():
        full = model(tokens[None])[0]
        pieces, state = run_in_pieces(model, tokens, cuts)
    assert rel_err(pieces, full) <= TOL
    assert state.num_tokens == seq_len
    assert all(c.shape[0] == seq_len for c in state.mla.values())


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_checkpoints_plus_cache_prefix_resume_exactly(models, data):
    """Resume from a KDA checkpoint taken mid-prefill + the MLA cache truncated to the same position
    (what a prefix-cache hit restores), for a batch of sequences in one forward."""
    model = models["nope"]
    lens = data.draw(st.lists(st.integers(2, 140), min_size=1, max_size=3), label="lens")
    positions = [sorted(data.draw(st.sets(st.integers(0, n), min_size=1, max_size=3))) for n in lens]
    gen = torch.Generator().manual_seed(sum(lens))
    seqs = [torch.randint(3, model.config.vocab_size, (n,), generator=gen) for n in lens]
    with torch.no_grad():
        out = model.forward_with_state(seqs, state_positions=positions)
        for i, seq in enumerate(seqs):
            full_logits = out.logits[i]
            for ckpt in out.checkpoints[i]:
                p = ckpt.position
                assert sorted(ckpt.layers) == model.config.kda_layers
                prefix_state = SequenceState(p, kda=ckpt.layers,
                                             mla={j: c[:p] for j, c in out.states[i].mla.items()})
                if p == len(seq):
                    continue
                resumed = model.forward_with_state([seq[p:]], [None if p == 0 else prefix_state]).logits[0]
                assert rel_err(resumed, full_logits[p:]) <= TOL, f"sequence {i} resumed at {p}"


def test_token_by_token_decode_matches_prefill(models):
    """Decode (one token per step: recurrent KDA form, absorbed MLA) against one chunked prefill."""
    model = models["rope-gated"]
    tokens = torch.randint(3, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens[None])[0]
        stepped, _ = run_in_pieces(model, tokens, list(range(1, 40)))
    assert rel_err(stepped, full) <= TOL


def test_input_state_is_not_mutated(models):
    model = models["nope"]
    tokens = torch.randint(3, model.config.vocab_size, (30,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        state = model.forward_with_state([tokens[:20]]).states[0]
        before = state.clone()
        model.forward_with_state([tokens[20:]], [state])
    assert state.num_tokens == before.num_tokens
    for j in state.kda:
        assert torch.equal(state.kda[j].recurrent, before.kda[j].recurrent)
        assert torch.equal(state.kda[j].conv_tail, before.kda[j].conv_tail)
    for j in state.mla:
        assert torch.equal(state.mla[j], before.mla[j])


def test_state_positions_out_of_range_are_rejected(models):
    model = models["nope"]
    with pytest.raises(ValueError, match=r"state positions \[11\] of sequence 0 must lie in \[0, 10\]"):
        model.forward_with_state([torch.arange(3, 13)], state_positions=[[11]])
