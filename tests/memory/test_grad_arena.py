"""Grad arena loans: all slots lent only between steps, no acquire during a loan, zeroed after it."""
import pytest
import torch

from memory.grad_arena import ArenaBusy, GradArena


def test_lend_hands_out_the_slots_themselves_and_blocks_acquire():
    arena = GradArena(slot_numel=6, num_slots=2)
    with arena.lend("reference") as slots:
        assert len(slots) == 2 and all(s.numel() == 6 and s.dtype == torch.float32 for s in slots)
        assert slots[0].data_ptr() != slots[1].data_ptr()
        assert arena.lent_to == "reference"
        arena.check_integrity()
        with pytest.raises(ArenaBusy, match="lent to 'reference'; chunk 0 cannot acquire"):
            arena.acquire(0)
        with pytest.raises(ArenaBusy, match="already lent to 'reference'"):
            with arena.lend("other"):
                pass
        for s in slots:
            s.fill_(7.0)  # the borrower's bytes
    assert arena.lent_to is None and arena.num_loans == 1 and arena.num_held == 0
    grad = arena.acquire(3)
    assert grad.abs().sum() == 0, "a slot comes back zeroed after a loan"
    assert grad.data_ptr() in {s.data_ptr() for s in slots}  # the same storage, nothing allocated
    arena.check_integrity()


def test_no_loan_while_a_chunk_holds_a_slot():
    arena = GradArena(slot_numel=4, num_slots=2)
    arena.acquire(1)
    with pytest.raises(ArenaBusy, match=r"chunks \[1\] hold slots"):
        with arena.lend("reference"):
            pass
    assert arena.lent_to is None and arena.num_loans == 0
    arena.release(1)
    with arena.lend("reference"):
        pass
    with pytest.raises(ValueError, match="borrower"):
        with arena.lend(""):
            pass


def test_loan_ends_when_the_borrower_raises():
    arena = GradArena(slot_numel=4)
    with pytest.raises(KeyError):
        with arena.lend("reference"):
            raise KeyError("boom")
    assert arena.lent_to is None
    arena.acquire(0)
    arena.check_integrity()
