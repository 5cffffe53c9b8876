"""Page counts shared by the device page pool (page_pool.py) and the host page pool (host_pool.py)."""
from __future__ import annotations


class PoolFigures:
    """num_pages, num_free, num_used and pool_bytes of a page pool, derived (never stored) from
    what the pool keeps: `_tags` (one entry per page, None when free), `_free` (the free page ids)
    and `page_bytes`."""

    _tags: list[tuple[str, int] | None]
    _free: list[int]
    page_bytes: int

    @property
    def num_pages(self) -> int:
        return len(self._tags)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    @property
    def pool_bytes(self) -> int:
        return self.num_pages * self.page_bytes
