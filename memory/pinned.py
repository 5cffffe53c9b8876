"""Page-locked host tensors of exactly the bytes asked for.

`torch.empty(..., pin_memory=True)` goes through CUDA's caching host allocator, which rounds every
block up to a power of two (a 91.5 GiB reference copy takes 128 GiB of locked memory, and the
ledger would count 91.5). `pinned_empty` instead allocates a plain host tensor and page-locks
that very range with cudaHostRegister (released when the tensor's storage is freed), so the
locked bytes are the tensor's bytes and the ledger's count is exact. Without CUDA (or with
`pin=False`) it is a plain host tensor. The CUDA path has not run on a GPU yet (no GPU so far):
it is checked only against the API; `pinned_bytes_rounded` states what the caching allocator
would have taken.
"""
from __future__ import annotations

import weakref

import torch


def pinned_empty(shape, dtype: torch.dtype, pin: bool = True) -> torch.Tensor:
    """A host tensor of `shape`/`dtype` (zero-filled), page-locked at its exact size when `pin`
    and CUDA is available."""
    out = torch.zeros(shape, dtype=dtype, device="cpu")
    if not (pin and torch.cuda.is_available()) or out.numel() == 0:
        return out
    cudart = torch.cuda.cudart()
    ptr, nbytes = out.data_ptr(), out.untyped_storage().nbytes()
    err = cudart.cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} B failed (error {int(err)}): page-locked memory limit "
                           f"(ulimit -l) or no CUDA driver")
    weakref.finalize(out, cudart.cudaHostUnregister, ptr)  # keep this tensor alive while its views are in use
    return out


def pinned_bytes_rounded(nbytes: int) -> int:
    """What CUDA's caching host allocator locks for an `nbytes` request: the next power of two."""
    return 1 << max(0, (nbytes - 1).bit_length()) if nbytes > 0 else 0
