"""Optimizer host states spilled to the NVMe tensor store and restored, bit for bit."""
import dataclasses

import pytest
import torch

from memory.host_ledger import HostBudgetExceeded, HostLedger
from memory.nvme_store import NvmeStore, NvmeStoreConfig
from tests.trainer.test_step import OPT, make_batch, make_model
from trainer.step import Trainer, TrainerConfig

STORE = NvmeStoreConfig(backend="buffered", chunk_bytes=256 << 10, fsync=False)


def step(trainer: Trainer, seed: int) -> dict[str, float]:
    lens, tokens, targets, weights = make_batch(seed)
    return trainer.train_step(tokens, lens, targets, lambda lp, rows, seqs: -(lp * weights[rows]).sum() / weights.numel())


def states(trainer: Trainer) -> list[torch.Tensor]:
    """Every host state tensor of the optimizer, cloned, in a fixed order."""
    out = [m.detach().clone() for m in trainer.optimizer.masters]
    for m in trainer.optimizer.masters:
        st = trainer.optimizer.adam.state[m]
        out += [st[k].clone() for k in sorted(st) if torch.is_tensor(st[k])]
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("backend", ["torch", pytest.param("deepspeed", marks=pytest.mark.slow)])
def test_spill_restore_is_bit_identical_and_training_after_it_equals_training_without(tmp_path, backend):
    opt = dataclasses.replace(OPT, backend=backend)
    spilled, plain = (Trainer(make_model(), TrainerConfig(num_chunks=3, optimizer=opt)) for _ in range(2))
    store = NvmeStore(tmp_path / "spill", STORE)
    for t in (spilled, plain):
        step(t, 0)
    before, resident = states(spilled), spilled.optimizer.host_bytes()
    moved = spilled.offload_states(store)
    assert spilled.states_spilled and moved == resident - (12 if backend == "torch" else 0)  # 0-dim `step`s stay
    assert spilled.optimizer.host_bytes() <= 3 * 4  # only torch's scalar step counters remain
    assert spilled.optimizer.disk_bytes >= moved and sorted(store.names()) == [
        f"train_states.rank0.chunk{c}" for c in range(3)]
    with pytest.raises(RuntimeError, match="spilled.*restore_states"):
        step(spilled, 1)
    assert spilled.restore_states() == moved and not spilled.states_spilled
    assert same(states(spilled), before) and spilled.optimizer.host_bytes() == resident
    assert store.names() == [] and spilled.optimizer.disk_bytes == 0  # restore drops the files
    assert spilled.restore_states() == 0  # nothing spilled: a no-op
    for t in (spilled, plain):
        step(t, 1)
    assert same(states(spilled), states(plain))
    assert all(torch.equal(p, q) for p, q in zip(spilled.model.parameters(), plain.model.parameters()))


def test_offload_before_the_first_step_spills_the_masters_only(tmp_path):
    trainer = Trainer(make_model(), TrainerConfig(num_chunks=2, optimizer=OPT))
    masters = [m.detach().clone() for m in trainer.optimizer.masters]
    assert trainer.offload_states(NvmeStore(tmp_path, STORE)) == sum(m.numel() * 4 for m in masters)
    assert trainer.optimizer.host_bytes() == 0
    trainer.restore_states()
    assert all(torch.equal(m, n) for m, n in zip(trainer.optimizer.masters, masters))


def test_save_while_spilled_writes_the_states_and_leaves_them_spilled(tmp_path):
    trainer = Trainer(make_model(), TrainerConfig(num_chunks=2, optimizer=OPT))
    step(trainer, 0)
    trainer.save(tmp_path / "resident")
    trainer.offload_states(NvmeStore(tmp_path / "spill", STORE))
    trainer.save(tmp_path / "spilled")
    assert trainer.states_spilled and trainer.optimizer.host_bytes() <= 2 * 4
    a = torch.load(tmp_path / "resident" / "optimizer-rank0.pt")
    b = torch.load(tmp_path / "spilled" / "optimizer-rank0.pt")
    assert same(a["masters"], b["masters"])
    sa, sb = a["adam"]["state"], b["adam"]["state"]
    assert sa.keys() == sb.keys() and all(same([sa[i][k] for k in sorted(sa[i])], [sb[i][k] for k in sorted(sb[i])])
                                          for i in sa)
    # load over a spilled trainer discards the spill and continues like the saved one
    other = Trainer(make_model(), TrainerConfig(num_chunks=2, optimizer=OPT))
    other.offload_states(NvmeStore(tmp_path / "spill2", STORE))
    other.load(tmp_path / "spilled")
    assert not other.states_spilled and other.optimizer.store is None
    trainer.restore_states()
    assert same(states(other), states(trainer))
    step(trainer, 1), step(other, 1)
    assert same(states(trainer), states(other))


def test_resident_state_bytes_are_leased_and_returned_to_the_ledger(tmp_path):
    ledger = HostLedger(budget_bytes=1 << 30)
    trainer = Trainer(make_model(), TrainerConfig(num_chunks=2, optimizer=OPT), ledger=ledger)
    masters_bytes = trainer.optimizer.host_bytes()
    assert ledger.held("train_states") == masters_bytes
    step(trainer, 0)
    full = trainer.optimizer.host_bytes()
    assert full > 2 * masters_bytes and ledger.held("train_states") == full  # moments leased after the first step
    moved = trainer.offload_states(NvmeStore(tmp_path, STORE))
    assert ledger.held("train_states") == full - moved
    ledger.lease("kv_pool", ledger.free - moved + 1)  # someone else took the freed bytes
    with pytest.raises(HostBudgetExceeded):
        trainer.restore_states()
    assert trainer.states_spilled and ledger.held("train_states") == full - moved  # refused: nothing changed
    ledger.release("kv_pool", ledger.held("kv_pool"))
    trainer.restore_states()
    assert ledger.held("train_states") == full
    ledger.check_integrity()
