"""Reference model streamed through the trainer's gradient slots == a resident reference, bit for bit."""
import dataclasses
import threading

import pytest
import torch

from memory.grad_arena import ArenaBusy, GradArena
from memory.host_ledger import HostBudgetExceeded, HostLedger
from models.config import load_model_config
from models.model import HybridLM
from trainer.chunks import ChunkedModel
from trainer.host_adam import OptimizerConfig
from trainer.ref_stream import StreamedReference
from trainer.step import Trainer, TrainerConfig

TINY = load_model_config("configs/model/tiny.yaml")
OPT = OptimizerConfig(lr=1e-3, backend="torch")
LENS = [37, 5, 80, 1, 64, 12]  # uneven, one single-token sequence


def make_model(config=TINY, seed: int = 3) -> HybridLM:
    return HybridLM(config).init_weights(seed=seed, std=0.1)


def make_batch(lens=LENS, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    n = sum(lens)
    return torch.randint(0, 259, (n,), generator=gen), list(lens), torch.randint(0, 259, (n,), generator=gen)


def policy_trainer(num_chunks: int, num_grad_slots: int = 2, split: str = "layers") -> Trainer:
    return Trainer(make_model(seed=11), TrainerConfig(num_chunks=num_chunks, num_grad_slots=num_grad_slots,
                                                      chunk_split=split, optimizer=OPT))


@pytest.mark.parametrize("num_chunks, num_grad_slots, split", [(2, 2, "layers"), (3, 2, "layers"), (3, 1, "layers"),
                                                               (8, 2, "layers"), (10, 2, "params")])
def test_streamed_equals_resident_bit_for_bit(num_chunks, num_grad_slots, split):
    resident = make_model().eval()
    trainer = policy_trainer(num_chunks, num_grad_slots, split)
    streamed = StreamedReference(resident, trainer.arena, num_chunks, split=split)
    tokens, lens, targets = make_batch()
    expected = ChunkedModel(resident, num_chunks, split).forward_logprobs(tokens, lens, targets)
    got = streamed.logprobs(tokens, lens, targets)
    assert got.dtype == torch.float32 and got.shape == (sum(lens),)
    assert torch.equal(got, expected)
    assert torch.equal(streamed.logprobs(tokens, lens, targets), expected)  # and again, slots reused
    stats = streamed.stats
    assert stats.chunks_loaded == num_chunks and stats.weights_outside_arena_bytes == 0
    assert stats.bytes_loaded == 4 * sum(p.numel() for p in resident.parameters())
    assert streamed.bound_parameters() == [], "no parameter may keep a view of the arena after the forward"
    assert not any("_fused_weights" in m.__dict__ for m in streamed.module.modules()), "fused copies outlived the call"
    assert stats.derived_weight_bytes == 0  # the forward runs unfused: no weight copy outside the slots
    assert trainer.arena.lent_to is None and trainer.arena.num_loans == 2


def test_tied_head_is_carried_by_the_last_chunk_too():
    config = dataclasses.replace(TINY, tie_word_embeddings=True)
    resident = make_model(config).eval()
    chunked = ChunkedModel(resident, 3)
    embed = resident.model.embed_tokens.weight.numel()
    arena = GradArena(max(chunked.chunk_numel(c) + (embed if c == 2 else 0) for c in range(3)))
    streamed = StreamedReference(resident, arena, 3)
    assert [e.name for e in streamed.layout[2]][-1] == "model.embed_tokens.weight"
    tokens, lens, targets = make_batch()
    assert torch.equal(streamed.logprobs(tokens, lens, targets), chunked.forward_logprobs(tokens, lens, targets))


def test_parameters_alias_the_slots_during_the_forward_double_buffered():
    num_chunks = 4
    trainer = policy_trainer(num_chunks)
    streamed = StreamedReference(make_model(), trainer.arena, num_chunks)
    slots = trainer.arena._slots
    ranges = [(s.data_ptr(), s.data_ptr() + s.numel() * 4) for s in slots]
    chunk_of_layer = {i: c for c, spec in enumerate(streamed.specs) for i in spec.layers}
    seen = []
    run_layer = streamed.module.run_layer

    def checked_run_layer(index, hidden, mixer):
        bound = streamed.bound_parameters()
        chunk = chunk_of_layer[index]
        names = {e.name for e in streamed.layout[chunk]}
        assert {n for n, _ in bound} == names, "exactly the running chunk's parameters are materialised"
        used = set()
        for name, p in bound:
            inside = [k for k, (lo, hi) in enumerate(ranges) if lo <= p.data_ptr() and
                      p.data_ptr() + p.numel() * p.element_size() <= hi]
            assert len(inside) == 1, f"{name} is not inside a gradient slot"
            used.add(inside[0])
        seen.append((chunk, used))
        cached = {i for i, layer in enumerate(streamed.module.model.layers)
                  if any("_fused_weights" in m.__dict__ for m in layer.modules())}
        assert cached <= set(streamed.specs[chunk].layers), "fused copies of an earlier chunk are still alive"
        return run_layer(index, hidden, mixer)

    streamed.module.run_layer = checked_run_layer
    streamed.logprobs(*make_batch())
    slot_of_chunk = {c: used for c, used in seen}
    assert slot_of_chunk == {c: {c % 2} for c in range(num_chunks)}, "chunk n computes from slot n % 2"


def test_the_arena_works_for_training_after_a_loan():
    tokens, lens, targets = make_batch()
    weights = torch.randn(sum(lens), generator=torch.Generator().manual_seed(5))

    def loss_fn(lp, rows, seqs):
        return -(lp * weights[rows]).sum() / weights.numel()

    plain, borrowed = policy_trainer(2), policy_trainer(2)
    streamed = StreamedReference(make_model(), borrowed.arena, 2)
    streamed.logprobs(tokens, lens, targets)  # leaves reference weights in both slots
    assert all(s.abs().sum() > 0 for s in borrowed.arena._slots)
    a = plain.train_step(tokens, lens, targets, loss_fn)
    b = borrowed.train_step(tokens, lens, targets, loss_fn)
    assert a["loss"] == b["loss"]
    for p, q in zip(plain.model.parameters(), borrowed.model.parameters()):
        assert torch.equal(p, q), "gradients must start from zeroed slots, not the reference's weights"
    borrowed.arena.check_integrity()


def test_no_loan_while_the_trainer_holds_a_slot():
    trainer = policy_trainer(2)
    streamed = StreamedReference(make_model(), trainer.arena, 2)
    trainer.arena.acquire(1)
    with pytest.raises(ArenaBusy, match="between training steps"):
        streamed.logprobs(*make_batch())


def test_a_chunk_larger_than_a_slot_is_an_error_at_construction():
    trainer = policy_trainer(4)
    with pytest.raises(ValueError, match=r"chunk 0 has \d+ B of weights but a gradient slot holds \d+ B"):
        StreamedReference(make_model(), trainer.arena, 2)  # the trainer's slots are sized for 4 chunks
    tied = make_model(dataclasses.replace(TINY, tie_word_embeddings=True))
    tied_trainer = Trainer(make_model(dataclasses.replace(TINY, tie_word_embeddings=True)),
                           TrainerConfig(num_chunks=2, optimizer=OPT))
    with pytest.raises(ValueError, match="chunk 1 has"):  # the tied head's copy does not fit
        StreamedReference(tied, tied_trainer.arena, 2)


def test_a_failing_loader_raises_in_the_caller_and_returns_the_loan():
    trainer = policy_trainer(3)
    streamed = StreamedReference(make_model(), trainer.arena, 3)
    load = streamed._load

    def failing_load(chunk, slot):
        if chunk == 1:
            raise OSError("host vector unreadable")
        load(chunk, slot)

    streamed._load = failing_load
    outcome = []

    def call():
        try:
            streamed.logprobs(*make_batch())
        except Exception as err:  # noqa: BLE001 - the test inspects it
            outcome.append(err)

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive(), "the forward hung on a failed load"
    assert len(outcome) == 1 and isinstance(outcome[0], OSError) and "unreadable" in str(outcome[0])
    assert trainer.arena.lent_to is None and streamed.bound_parameters() == []
    trainer.arena.acquire(0)
    trainer.arena.check_integrity()


def test_host_vectors_are_leased_from_the_ledger():
    trainer = policy_trainer(2)
    model = make_model()
    weight_bytes = 4 * sum(p.numel() for p in model.parameters())
    small = HostLedger(budget_bytes=weight_bytes - 1)
    with pytest.raises(HostBudgetExceeded, match="'reference' asked"):
        StreamedReference(model, trainer.arena, 2, ledger=small)
    assert small.held() == 0
    ledger = HostLedger(budget_bytes=weight_bytes)
    streamed = StreamedReference(model, trainer.arena, 2, ledger=ledger)
    assert ledger.holdings() == {"reference": weight_bytes} == {"reference": streamed.host_bytes}
    streamed.close()
    assert ledger.held() == 0
    with pytest.raises(RuntimeError, match="after close"):
        streamed.logprobs(*make_batch())
    ledger.check_integrity()
