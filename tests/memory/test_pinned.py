"""memory/pinned.py: host tensors of exactly the requested bytes (page-locked on CUDA)."""
import pytest
import torch

from memory.pinned import pinned_bytes_rounded, pinned_empty


def test_a_pinned_tensor_holds_exactly_its_bytes_and_starts_zeroed():
    t = pinned_empty((3, 1000), torch.float32)
    assert t.untyped_storage().nbytes() == 3 * 1000 * 4 and t.device.type == "cpu"
    assert t.abs().sum() == 0
    if torch.cuda.is_available():
        assert t.is_pinned()


def test_the_caching_allocator_would_round_up_to_a_power_of_two():
    assert pinned_bytes_rounded(int(91.5 * 2**30)) == 128 * 2**30
    assert pinned_bytes_rounded(4096) == 4096 and pinned_bytes_rounded(4097) == 8192 and pinned_bytes_rounded(0) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_non_blocking_copy_into_it_lands():
    t = pinned_empty((1 << 20,), torch.float32)
    src = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    t.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(t, src.cpu())
