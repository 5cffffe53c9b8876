"""Host rows for single tokens' KV: where InfiniGen-style eviction offloads what it does not drop.

`HostTokenStore` is a fixed-capacity slab in host memory, [capacity, *row_shape] of one dtype
(pinned when the device is a GPU, so fetches can run asynchronously), plus a free list. One row
is one token's cache entry for every MLA layer ([num_mla_layers, latent_dim]). Token eviction
(rollout/kv/kv_eviction.py) decides what goes out and what comes back; this class only moves rows:
`store(rows) -> ids` (device -> host), `load(ids) -> rows` (host -> device), `free(ids)`.
Its bytes are leased from the host-DRAM ledger before the slab is allocated (memory/host_ledger.py).

Counters `rows_stored` / `rows_loaded`. Invariant (`check_integrity`): free + used == capacity,
no duplicate in the free list.
"""
from __future__ import annotations

import torch

from memory.host_ledger import HostLedger


class HostStoreFull(RuntimeError):
    def __init__(self, asked: int, free: int, capacity: int) -> None:
        super().__init__(f"host token store: {asked} rows asked, {free} of {capacity} free "
                         f"(raise kv_budget.host_tokens or lower the number of long sequences)")
        self.asked, self.free_rows = asked, free


class HostTokenStore:
    def __init__(self, row_shape: tuple[int, ...], capacity: int, dtype: torch.dtype = torch.float32,
                 ledger: HostLedger | None = None, consumer: str = "kv_tokens", pin_memory: bool = False) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"host token store: capacity={capacity!r}, expected a positive integer")
        if not row_shape or any(not isinstance(d, int) or d < 1 for d in row_shape):
            raise ValueError(f"host token store: row_shape={row_shape!r}, expected positive integers")
        self.row_shape, self.dtype, self.ledger, self.consumer = tuple(row_shape), dtype, ledger, consumer
        nbytes = capacity * torch.Size(row_shape).numel() * torch.empty(0, dtype=dtype).element_size()
        if ledger is not None:
            ledger.lease(consumer, nbytes)  # first: a refusal allocates nothing
        try:
            self._slab = torch.empty(capacity, *row_shape, dtype=dtype, pin_memory=pin_memory)  # [C, *row]
        except BaseException:
            if ledger is not None:
                ledger.release(consumer, nbytes)
            raise
        self.nbytes = nbytes
        self._used = torch.zeros(capacity, dtype=torch.bool)
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out low ids first
        self.rows_stored = 0
        self.rows_loaded = 0

    @property
    def capacity(self) -> int:
        return self._slab.shape[0]

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - self.num_free

    def store(self, rows: torch.Tensor) -> torch.Tensor:
        """Copy rows [n, *row_shape] to free host rows; returns their ids [n] (int64).
        All or nothing: HostStoreFull (nothing changed) when fewer than n rows are free."""
        if tuple(rows.shape[1:]) != self.row_shape:
            raise ValueError(f"host token store: rows of shape {tuple(rows.shape[1:])}, expected {self.row_shape}")
        n = rows.shape[0]
        if n > len(self._free):
            raise HostStoreFull(n, len(self._free), self.capacity)
        ids = torch.tensor([self._free.pop() for _ in range(n)], dtype=torch.long)
        self._slab.index_copy_(0, ids, rows.to(device="cpu", dtype=self.dtype))
        self._used[ids] = True
        self.rows_stored += n
        return ids

    def load(self, ids: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
        """Rows [n, *row_shape] of `ids` (a new tensor on `device`)."""
        self._check_used(ids)
        self.rows_loaded += ids.numel()
        rows = self._slab.index_select(0, ids.cpu())
        return rows.to(device, non_blocking=rows.is_pinned())

    def free(self, ids: torch.Tensor) -> None:
        self._check_used(ids)
        if ids.numel() != ids.unique().numel():
            raise ValueError(f"host token store: ids {ids.tolist()[:8]} repeat an id")
        self._used[ids] = False
        self._free.extend(ids.tolist())

    def close(self) -> None:
        """Return the slab's bytes to the ledger (the store is unusable afterwards)."""
        if self.ledger is not None and self.nbytes:
            self.ledger.release(self.consumer, self.nbytes)
        self.nbytes = 0
        self._slab = self._slab[:0]

    def check_integrity(self) -> None:
        if len(set(self._free)) != len(self._free):
            raise AssertionError("host token store: a row is free twice")
        if int(self._used.sum()) + len(self._free) != self.capacity:
            raise AssertionError(f"host token store: {int(self._used.sum())} used + {len(self._free)} free "
                                 f"!= capacity {self.capacity}")
        if self._free and bool(self._used[torch.tensor(self._free)].any()):
            raise AssertionError("host token store: a free row is marked used")

    def _check_used(self, ids: torch.Tensor) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.capacity or not bool(self._used[ids].all())):
            raise ValueError(f"host token store: ids {ids.tolist()[:8]} include a row that is not in use "
                             f"(capacity {self.capacity})")
