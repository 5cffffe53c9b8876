"""The rollout engine's settings (rollout/engine.py): one dataclass, used as is by the RL run's
`engine` config group (rl/config/__init__.py: `engine.pool_mb=...`; the optional `prefix_cache` and
`kv_budget` nodes are Hydra groups of their own), so every knob has one name and one default."""
from __future__ import annotations

from dataclasses import dataclass

from kernels.impl import check_impl
from models.precision import parse_dtype
from rollout.kv_eviction import KVBudgetConfig
from rollout.prefix_config import PrefixCacheConfig


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    max_model_len: int = 4096
    """Longest sequence (prompt + generated, every turn of a conversation) the engine accepts: a longer
    prompt is refused (`ContextTooLong`). The pool must hold one sequence of this length (or of the
    KV budget): 64k-128k contexts are this knob and pool_mb."""
    num_pages: int | None = None
    """Pages in the device pool (exact); None = as many as pool_mb holds."""
    pool_mb: int = 64
    """Device page pool, MiB, when num_pages is None (per engine: each rank's engine has its own)."""
    group_layers: int | None = None
    """Layers per cache group (default: the number of MLA layers)."""
    block_tokens: int | None = None
    """Tokens per MLA page (default: derived so an MLA page is the size of a KDA state page)."""
    max_num_batched_tokens: int = 512
    """Tokens one engine step computes (decode tokens + prefill chunks): a longer prompt is prefilled
    in chunks of at most this many tokens over several steps, so it may be below max_model_len."""
    max_num_seqs: int = 128
    """Sequences running at once."""
    kernel_impl: str | None = None
    """"naive" (torch) or "triton"; None = triton on CUDA, naive on CPU."""
    seed: int = 0
    """Seeds requests that give no seed of their own."""
    check_every_step: bool = False
    """Run the pool/cache integrity checks after every step (tests, debugging)."""
    show_progress: bool = True
    """Progress bar in generate()."""
    prefix_cache: PrefixCacheConfig | None = None
    """Hybrid prefix caching (rollout/prefix_cache.py); None = off."""
    host_pool_mb: int | str = 0
    """Host KV pool, MiB (memory/host_pool.py): the prefix cache's second tier and where paused
    sequences wait out a sleep(); 0 = none. Leased from the engine's host ledger, if given.
    "auto": the pool starts with no page and is sized at each rollout from what the ledger has free
    (`CacheManager.restore_host`; the RL loop does it, with memory.spill_dir: the DRAM the spilled
    training states freed)."""
    host_num_pages: int | None = None
    """Pages in the host KV pool (exact); None = as many as host_pool_mb holds."""
    kv_budget: KVBudgetConfig | None = None
    """Token eviction for the MLA layers (rollout/kv_eviction.py: H2O or InfiniGen): at most
    `budget_tokens` MLA slots per sequence on the device; None = full KV (the default)."""
    kda_state_dtype: str = "fp32"
    """Element type of the KDA state pages ("fp32" | "bf16"), independent of the MLA cache, which
    takes the model's dtype: the recurrent state integrates every token, so FP32 by default."""

    def __post_init__(self) -> None:
        try:
            parse_dtype(self.kda_state_dtype)
        except ValueError as err:
            raise ValueError(f"kda_state_{err}") from None
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len}, expected >= 2 (one prompt token and one "
                             f"generated token)")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens}, expected >= 1 (tokens per "
                             f"engine step; a longer prompt is prefilled in chunks of this size)")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages={self.num_pages}, expected >= 1 or None")
        if self.pool_mb < 1:
            raise ValueError(f"pool_mb={self.pool_mb}, expected >= 1")
        if self.host_pool_mb != "auto" and (isinstance(self.host_pool_mb, (str, bool)) or self.host_pool_mb < 0):
            raise ValueError(f"host_pool_mb={self.host_pool_mb!r}, expected an integer >= 0 (0 = no host KV pool) "
                             f"or 'auto'")
        if self.host_num_pages is not None and self.host_num_pages < 0:
            raise ValueError(f"host_num_pages={self.host_num_pages}, expected >= 0 or None")
        if self.kernel_impl is not None:
            check_impl(self.kernel_impl)

    @property
    def longest_kv_tokens(self) -> int:
        """Tokens of KV one sequence holds on the device at most: max_model_len, capped by the KV budget."""
        return self.max_model_len if self.kv_budget is None else min(self.max_model_len, self.kv_budget.budget_tokens)
