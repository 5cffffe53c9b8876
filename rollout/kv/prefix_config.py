"""`PrefixCacheConfig`: the prefix cache's options (rollout/kv/prefix_cache.py), validated on construction."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class PrefixCacheConfig:
    hash_block: int = 512
    """Tokens per hash block (the reuse granularity); the pool's block_tokens must be a multiple."""
    model_id: str = "policy"
    """Part of every hash's salt (with the policy version): "policy", the RL run's engine, by default."""
    eviction: str = "turn_aware"
    """"turn_aware": turn-boundary checkpoints and the MLA pages under them are evicted last;
    "lru": least recently used first, whatever they hold."""
    defer_copies: bool = True
    """Run page copies as one batch right before the forward pass (False: at once, one by one)."""
    pin_hits: bool = True
    """Rule 1: pin every hit page before allocating. Off only in tests that show why."""
    exclude_pending: bool = True
    """Rule 2: pages whose copies are pending never match. Off only in tests that show why."""
    atomic_checkpoints: bool = True
    """Rule 3: evicting a checkpoint page evicts its siblings in the other KDA groups. Off only in
    tests that show why."""
    reuse_stale: bool = False
    """KV across weight updates: keep the cache when a new policy version loads (prefixes computed by
    older versions may hit; the tokens sampled on them are tagged with the oldest version whose KV
    they read, so the trainer's truncated importance weights see them, and `prefix_stale_hit_tokens`
    counts them). Off: a new version empties the cache, and the version is part of every hash's salt."""
    host_mode: str = "write_back"
    """With a host tier: "write_back" copies a page to host memory only when the device pool evicts
    it; "write_through" (the baseline) copies every page when it is registered (again as its
    registered end advances), so eviction finds it there already."""

    def __post_init__(self) -> None:
        if self.host_mode not in ("write_back", "write_through"):
            raise ValueError(f"host_mode={self.host_mode!r}, expected 'write_back' or 'write_through'")
        if self.hash_block < 1:
            raise ValueError(f"hash_block={self.hash_block}, expected >= 1")
        if self.eviction not in ("turn_aware", "lru"):
            raise ValueError(f"eviction={self.eviction!r}, expected 'turn_aware' or 'lru'")
