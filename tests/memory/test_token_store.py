"""The host token store: rows in, the same rows out, all-or-nothing when full, leased bytes."""
import pytest
import torch

from memory.host_ledger import HostBudgetExceeded, HostLedger
from memory.token_store import HostStoreFull, HostTokenStore


def test_rows_round_trip_and_ids_are_recycled():
    store = HostTokenStore((2, 5), capacity=6)
    rows = torch.randn(4, 2, 5)
    ids = store.store(rows)
    assert ids.tolist() == [0, 1, 2, 3] and store.num_used == 4
    assert torch.equal(store.load(ids[[2, 0]]), rows[[2, 0]])
    store.free(ids[:2])
    more = torch.randn(3, 2, 5)
    ids2 = store.store(more)
    assert sorted(ids2.tolist()) == [0, 1, 4]  # freed rows come back into use
    assert torch.equal(store.load(ids[2:]), rows[2:]) and torch.equal(store.load(ids2), more)
    assert store.rows_stored == 7 and store.rows_loaded == 7
    store.check_integrity()


def test_full_store_changes_nothing():
    store = HostTokenStore((3,), capacity=2)
    store.store(torch.ones(1, 3))
    with pytest.raises(HostStoreFull, match="3 rows asked, 1 of 2 free"):
        store.store(torch.zeros(3, 3))
    assert store.num_used == 1
    store.check_integrity()


def test_bad_ids_and_shapes_raise():
    store = HostTokenStore((3,), capacity=4)
    ids = store.store(torch.ones(2, 3))
    with pytest.raises(ValueError, match="not in use"):
        store.load(torch.tensor([3]))
    store.free(ids[:1])
    with pytest.raises(ValueError, match="not in use"):
        store.free(ids[:1])  # freed twice
    with pytest.raises(ValueError, match=r"rows of shape \(4,\), expected \(3,\)"):
        store.store(torch.ones(1, 4))
    with pytest.raises(ValueError, match="capacity=0"):
        HostTokenStore((3,), capacity=0)


def test_bytes_are_leased_and_returned():
    ledger = HostLedger(budget_bytes=1000)
    store = HostTokenStore((10,), capacity=20, ledger=ledger)  # 800 bytes of fp32
    assert ledger.held("kv_tokens") == 800
    with pytest.raises(HostBudgetExceeded):
        HostTokenStore((10,), capacity=20, ledger=ledger)
    assert ledger.held("kv_tokens") == 800  # the refused store leased nothing
    store.close()
    assert ledger.held("kv_tokens") == 0


def test_the_lease_comes_before_the_slab(monkeypatch):
    """A refused lease allocates nothing (the slab could be GiBs of pinned memory); a failed
    allocation gives its lease back."""
    import memory.token_store as ts

    made = []
    real_empty = torch.empty

    def empty(*shape, **kw):
        if len(shape) > 1:  # the slab; torch.empty(0, dtype=...) only sizes an element
            made.append(shape)
        return real_empty(*shape, **kw)

    monkeypatch.setattr(ts.torch, "empty", empty)
    ledger = HostLedger(budget_bytes=100)
    with pytest.raises(HostBudgetExceeded):
        HostTokenStore((10,), capacity=20, ledger=ledger)
    assert made == [] and ledger.held("kv_tokens") == 0

    def no_memory(*shape, **kw):
        raise RuntimeError("out of pinned memory")

    monkeypatch.setattr(ts.torch, "empty", lambda *s, **kw: real_empty(*s, **kw) if len(s) == 1 else no_memory())
    ledger = HostLedger(budget_bytes=1000)
    with pytest.raises(RuntimeError, match="out of pinned memory"):
        HostTokenStore((10,), capacity=20, ledger=ledger)
    assert ledger.held("kv_tokens") == 0
