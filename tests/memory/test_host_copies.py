"""Host <-> device page copies with tickets (memory/host_copies.py): the same bytes as the plain
synchronous reference, and no reader ahead of the wait on its copy. On CPU the copies run
synchronously, so the tests check the order of waits (tickets record them); the CUDA test runs the
copy stream for real when a GPU is present."""
import pytest
import torch

from memory.host_copies import UnwaitedCopy, slot_runs
from memory.host_pool import HostPagePool
from memory.layout import CacheLayout
from memory.page_pool import PagePool
from models.config import load_model_config

GROUP = ("kda", 0)


@pytest.fixture(scope="module")
def layout():
    return CacheLayout.for_model(load_model_config("configs/model/tiny.yaml"))


def filled_pool(layout, device="cpu", num=6, seed=0):
    pool = PagePool(layout, 12, torch.device(device))
    pages = pool.allocate(num, GROUP)
    gen = torch.Generator().manual_seed(seed)
    pool.write_pages(pages, torch.randint(0, 256, (num, layout.page_bytes), dtype=torch.uint8, generator=gen))
    return pool, pages


def test_slot_runs_cover_each_slot_once_in_order():
    assert slot_runs([4, 5, 6, 1, 2, 9]) == [(0, 4, 3), (3, 1, 2), (5, 9, 1)]
    assert slot_runs([]) == []
    assert slot_runs([3, 2]) == [(0, 3, 1), (1, 2, 1)]


def round_trip(layout, sync: bool, device="cpu"):
    pool, pages = filled_pool(layout, device)
    host = HostPagePool(layout.page_bytes, 10, pin_memory=device == "cuda")
    host.sync_copies = sync
    slots = host.allocate(6, GROUP)
    slots = [slots[i] for i in (5, 0, 1, 2, 4, 3)]  # runs of consecutive slots and strays, out of order
    host.store(slots, pool, pages).wait()
    back = pool.allocate(6, GROUP)
    host.load(slots, pool, back).wait()
    return pool.read_pages(pages).cpu(), torch.stack([host.page_bytes_view(s) for s in slots]), \
        pool.read_pages(back).cpu()


def test_ticketed_copies_write_the_bytes_the_synchronous_reference_writes(layout):
    original, stored, loaded = round_trip(layout, sync=False)
    ref_original, ref_stored, ref_loaded = round_trip(layout, sync=True)
    assert torch.equal(original, ref_original)
    assert torch.equal(stored, ref_stored) and torch.equal(stored, original)
    assert torch.equal(loaded, ref_loaded) and torch.equal(loaded, original)


def test_host_readers_wait_on_the_copies_into_their_slots(layout):
    pool, pages = filled_pool(layout)
    host = HostPagePool(layout.page_bytes, 8)
    slots = host.allocate(3, GROUP)
    ticket = host.store(slots, pool, pages[:3])
    assert ticket.done and not ticket.waited  # CPU: the copy ran, but nobody waited on it yet
    with pytest.raises(UnwaitedCopy, match=f"host slot {slots[0]}"):
        host.copier.check_waited(slots)
    view = host.page_bytes_view(slots[0])  # a host-side reader waits first
    assert ticket.waited and torch.equal(view, pool.read_pages([pages[0]])[0])
    host.copier.check_waited(slots)
    rows = host.buffer_rows(slots[0], slots[0] + 3)  # the NVMe spill's reader too
    assert torch.equal(rows, pool.read_pages(pages[:3]))
    later = host.store(slots[1:2], pool, pages[3:4])
    host.suspend()  # freeing the buffer waits on every copy in flight
    assert later.waited and not host.copier.pending


def test_device_readers_settle_loads_and_stores_before_the_next_kernels(layout):
    pool, pages = filled_pool(layout)
    host = HostPagePool(layout.page_bytes, 8)
    slots = host.allocate(2, GROUP)
    store = host.store(slots, pool, pages[:2])
    dst = pool.allocate(2, GROUP)
    load = host.load(slots, pool, dst)
    assert host.copier.unsettled_loads() == set(dst)
    host.copier.settle_device()
    assert store.device_waited and load.device_waited and not host.copier.unsettled_loads()
    assert torch.equal(pool.read_pages(dst), pool.read_pages(pages[:2]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_copies_on_the_copy_stream_match_the_reference(layout):
    original, stored, loaded = round_trip(layout, sync=False, device="cuda")
    _, ref_stored, ref_loaded = round_trip(layout, sync=True, device="cuda")
    assert torch.equal(stored, ref_stored) and torch.equal(stored, original)
    assert torch.equal(loaded, ref_loaded) and torch.equal(loaded, original)
