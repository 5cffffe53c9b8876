"""`Loc`: where a cached page lives — its tier (device pool or host pool) and its page number there.

The prefix index (rollout/kv/prefix_index.py) maps hashes to locations; a bundle that moves between
tiers keeps its keys and changes only its locations (`PrefixIndex.relocate`). The tier is a field,
never encoded in the number: device page 3 and host page 3 are different locations.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Tier(enum.IntEnum):
    DEVICE = 0
    """The device page pool (memory/page_pool.py): what the forward pass reads."""
    HOST = 1
    """The host page pool (memory/host_pool.py): prefetched to the device before it is read."""


@dataclass(frozen=True, order=True, slots=True)
class Loc:
    tier: Tier
    page: int
    """Page number inside the tier's pool."""

    @classmethod
    def device(cls, page: int) -> Loc:
        return cls(Tier.DEVICE, page)

    @classmethod
    def host(cls, page: int) -> Loc:
        return cls(Tier.HOST, page)

    @property
    def on_device(self) -> bool:
        return self.tier is Tier.DEVICE
