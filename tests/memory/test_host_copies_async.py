"""The CPU side stream of the host copier (memory/host_copies.py, `cpu_async_loads`): loads on one
worker thread write the bytes the synchronous reference writes, in issue order with the copier's
other copies; a copy's error reaches the thread that waits; the figures say how much of the copy
time was hidden behind the caller's own compute; `close()` joins the worker."""
import gc
import random
import threading
import time

import pytest
import torch

from memory import host_copies
from memory.host_copies import load_sync
from memory.host_pool import HostPagePool
from memory.layout import CacheLayout
from memory.page_pool import PagePool
from models.config import load_model_config

GROUP = ("kda", 0)
WORKER = "host-copier-loads"


@pytest.fixture(scope="module")
def layout():
    return CacheLayout.for_model(load_model_config("configs/model/tiny.yaml"))


def stored_host(layout, num: int, seed: int = 0, pool_pages: int = 0, **kw):
    """A device pool of `pool_pages` (or 3 * num) pages, `num` of them random; a host pool holding
    them in shuffled slots. Returns (pool, host, slots, bytes of slot i's page [num, page_bytes])."""
    pool = PagePool(layout, pool_pages or 3 * num, torch.device("cpu"))
    host = HostPagePool(layout.page_bytes, num + 2, **kw)
    pages = pool.allocate(num, GROUP)
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (num, layout.page_bytes), dtype=torch.uint8, generator=gen)
    pool.write_pages(pages, data)
    slots = host.allocate(num, GROUP)
    random.Random(seed).shuffle(slots)
    host.store(slots, pool, pages).wait()
    return pool, host, slots, data


def workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == WORKER]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_async_loads_write_what_the_synchronous_reference_writes(layout, seed):
    pool, host, slots, data = stored_host(layout, 9, seed, pool_pages=9 * 7, cpu_async_loads=True)
    rng = random.Random(seed)
    issued = []
    for _ in range(6):  # random subsets, runs of consecutive slots and strays, several loads queued at once
        rows = rng.sample(range(len(slots)), rng.randint(1, len(slots)))
        dst = pool.allocate(len(rows), GROUP)
        issued.append((rows, dst, host.load([slots[r] for r in rows], pool, dst)))
    assert host.copier.loads_async == 6
    assert host.copier.unsettled_loads() == {p for _, dst, _ in issued for p in dst}
    host.copier.settle_device()  # the CPU "device stream" (this thread) waits for every load
    assert not host.copier.unsettled_loads() and all(t.done and t.device_waited for *_, t in issued)
    reference = PagePool(layout, pool.num_pages, torch.device("cpu"))
    buffer = host.buffer_rows(0, host.num_pages)
    for rows, dst, _ in issued:
        ref_dst = reference.allocate(len(rows), GROUP)
        load_sync(buffer, [slots[r] for r in rows], reference, ref_dst)
        assert torch.equal(pool.read_pages(dst), reference.read_pages(ref_dst))
        assert torch.equal(pool.read_pages(dst), data[rows])
    host.close()
    assert not workers()


def gated_loads(monkeypatch) -> threading.Event:
    """Every async load waits for the returned gate before it reads the host buffer."""
    gate, copy = threading.Event(), host_copies._load_cpu

    def gated(*args, **kw):
        assert gate.wait(10)
        copy(*args, **kw)
    monkeypatch.setattr(host_copies, "_load_cpu", gated)
    return gate


def test_a_store_issued_after_a_load_from_its_slot_waits_for_the_load(layout, monkeypatch):
    pool, host, slots, data = stored_host(layout, 3, cpu_async_loads=True)
    gate = gated_loads(monkeypatch)
    dst = pool.allocate(1, GROUP)
    load = host.load(slots[:1], pool, dst)
    assert not load.done  # still queued behind the gate
    newer = pool.allocate(1, GROUP)
    pool.write_pages(newer, data[2:3] ^ 0xFF)
    threading.Timer(0.05, gate.set).start()  # the store below drains the queue: it blocks until then
    host.store(slots[:1], pool, newer).wait()
    assert load.done
    host.copier.settle_device()
    assert torch.equal(pool.read_pages(dst), data[:1])  # the load read the slot before the store wrote it
    assert torch.equal(host.page_bytes_view(slots[0]), data[2] ^ 0xFF)
    host.close()


def test_host_readers_and_suspend_drain_the_loads_in_flight(layout, monkeypatch):
    pool, host, slots, data = stored_host(layout, 3, cpu_async_loads=True)
    gate = gated_loads(monkeypatch)
    dst = pool.allocate(2, GROUP)
    load = host.load(slots[1:], pool, dst)
    threading.Timer(0.05, gate.set).start()
    host.page_bytes_view(slots[0])  # another slot: still drains (the simple rule)
    assert load.done and not load.device_waited  # done, but the device stream has not waited yet
    gate.clear()
    second = host.load(slots[:1], pool, pool.allocate(1, GROUP))
    threading.Timer(0.05, gate.set).start()
    host.suspend()  # the buffer goes: no load may still read it
    assert second.done and second.waited
    assert torch.equal(pool.read_pages(dst), data[1:])
    host.close()


def test_a_worker_error_is_raised_by_the_waiter_and_never_lost(layout, monkeypatch):
    pool, host, slots, data = stored_host(layout, 3, cpu_async_loads=True)
    copy = host_copies._load_cpu

    def failing(*args, **kw):
        raise RuntimeError("copy failed on the worker")
    monkeypatch.setattr(host_copies, "_load_cpu", failing)
    ticket = host.load(slots[:1], pool, pool.allocate(1, GROUP))
    with pytest.raises(RuntimeError, match="copy failed on the worker"):
        ticket.wait_device()
    with pytest.raises(RuntimeError, match="copy failed on the worker"):
        ticket.wait()  # every wait on the failed copy says so
    host.copier.settle_device()  # already raised to a waiter: not again
    unwaited = host.load(slots[1:2], pool, pool.allocate(1, GROUP))
    with pytest.raises(RuntimeError, match="copy failed on the worker"):
        host.copier.settle_device()  # nobody waited on it: the next copier-wide wait raises it, once
    assert unwaited.done
    host.copier.settle_device()
    monkeypatch.setattr(host_copies, "_load_cpu", copy)
    dst = pool.allocate(1, GROUP)
    host.load(slots[2:], pool, dst).wait_device()  # the worker outlived the errors
    assert torch.equal(pool.read_pages(dst), data[2:])
    host.close()
    assert not workers()


def test_synchronous_loads_are_fully_exposed(layout):
    for kw in ({}, {"sync": True}):
        pool, host, slots, _ = stored_host(layout, 4)
        host.sync_copies = kw.get("sync", False)
        assert host.copier.hidden_fraction == 1.0  # nothing loaded yet
        host.load(slots, pool, pool.allocate(4, GROUP)).wait_device()
        copier = host.copier
        assert copier.load_seconds > 0 and copier.load_wait_seconds == copier.load_seconds
        assert copier.hidden_fraction == 0.0 and copier.loads_async == 0
        copier.reset_figures()
        assert copier.load_seconds == copier.load_wait_seconds == 0.0
        host.close()


def busy(seconds: float) -> None:
    """Compute for `seconds` on this thread, touching no page or slot."""
    a = torch.randn(96, 96)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def test_a_load_overlapped_with_compute_is_mostly_hidden(layout):
    num = (8 << 20) // layout.page_bytes  # a copy of ~8 MB
    pool, host, slots, data = stored_host(layout, num)
    row_of = {slot: row for row, slot in enumerate(slots)}
    slots = sorted(slots[: num // 2]) + slots[num // 2:]  # half in runs, half strays
    expected = data[[row_of[s] for s in slots]]
    copier = host.copier
    best = 0.0
    for _ in range(3):  # the host may be shared: the best of three tries
        copier.cpu_async_loads = False
        dst = pool.allocate(num, GROUP)
        host.load(slots, pool, dst).wait_device()  # warm, then measured: the copy time on this machine
        pool.decref(dst)
        copier.reset_figures()
        dst = pool.allocate(num, GROUP)
        host.load(slots, pool, dst).wait_device()
        copy_s = copier.load_seconds
        pool.decref(dst)
        copier.cpu_async_loads = True
        copier.reset_figures()
        dst = pool.allocate(num, GROUP)
        ticket = host.load(slots, pool, dst)
        busy(5 * copy_s)  # independent compute, ~5x the copy
        ticket.wait_device()
        assert copier.loads_async == 1 and torch.equal(pool.read_pages(dst), expected)
        best = max(best, copier.hidden_fraction)
        pool.decref(dst)
    assert best > 0.5, f"hidden fraction {best:.2f}"
    host.close()


def test_close_joins_the_worker_and_pools_leak_no_thread(layout):
    baseline = threading.active_count()
    for seed in range(12):
        pool, host, slots, _ = stored_host(layout, 2, seed, cpu_async_loads=True)
        host.load(slots, pool, pool.allocate(2, GROUP))
        assert len(workers()) == 1
        host.close()
        assert not workers()
    assert threading.active_count() <= baseline
    pool, host, slots, _ = stored_host(layout, 2, cpu_async_loads=True)  # never closed: collected
    host.load(slots, pool, pool.allocate(2, GROUP)).wait_device()
    del host
    gc.collect()
    deadline = time.perf_counter() + 10
    while workers() and time.perf_counter() < deadline:
        time.sleep(0.01)
    assert not workers() and threading.active_count() <= baseline


def test_unleased_pools_take_the_switch(layout):
    host = HostPagePool.unleased(layout.page_bytes, cpu_async_loads=True)
    assert host.copier.cpu_async_loads and host.is_suspended
    host.close()
