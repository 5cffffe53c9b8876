"""The KV tiers behind one façade (README.md): the engine core and rl/ reach them only through these names."""
from rollout.kv.cache_manager import CacheManager
from rollout.kv.kv_eviction import KVBudgetConfig
from rollout.kv.prefix_config import PrefixCacheConfig

__all__ = ["CacheManager", "KVBudgetConfig", "PrefixCacheConfig"]
