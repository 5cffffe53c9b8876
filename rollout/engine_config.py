"""The rollout engine's settings (rollout/engine.py): one dataclass, used as is by the RL run's
`engine` config group (rl/config/__init__.py: `engine.pool_mb=...`; the optional `prefix_cache` and
`kv_budget` nodes are Hydra groups of their own), so every knob has one name and one default. Each
pool has one size knob, in MiB (`pool_mb`, `host_pool_mb`); `EngineConfig.for_pages` gives the MiB of
an exact page count (tests). The requests' base seed is the Engine's `seed` argument (an RL run's is
its `seed`), the progress bar `generate(progress=True)`'s: neither is a knob here. `ContextTooLong` is
what `max_model_len` refuses."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kernels.impl import check_impl
from memory.layout import CacheLayout
from models.precision import parse_dtype
from rollout.kv import KVBudgetConfig, PrefixCacheConfig

if TYPE_CHECKING:
    from models.model import HybridLM

MIB = 1 << 20


class ContextTooLong(ValueError):
    """A request the engine can never run: its prompt leaves no room under `max_model_len` (which
    the pool is sized to hold, see `Engine.check_context`). Raised before anything changes; the
    figures are attributes so a caller (the RL driver) can log and count the drop."""

    def __init__(self, message: str, *, num_tokens: int, max_model_len: int, pages_needed: int,
                 pool_pages: int) -> None:
        super().__init__(message)
        self.num_tokens = num_tokens
        """Prompt tokens of the refused request."""
        self.max_model_len = max_model_len
        self.pages_needed = pages_needed
        """Pages one sequence of the prompt + 1 generated token needs."""
        self.pool_pages = pool_pages

SPECULATIVE = ("off", "ngram", "suffix", "draft")
"""Speculative decoding methods (`EngineConfig.speculative`)."""


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    max_model_len: int = 4096
    """Longest sequence (prompt + generated, every turn of a conversation) the engine accepts: a longer
    prompt is refused (`ContextTooLong`). The pool must hold one sequence of this length (or of the
    KV budget): 64k-128k contexts are this knob and pool_mb."""
    pool_mb: int | float = 64
    """Device page pool, MiB (per engine: each rank's engine has its own): as many pages as it holds
    (the remainder is unused). A fraction of a MiB is allowed (`for_pages`: an exact page count)."""
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
    check_every_step: bool = False
    """Run the pool/cache integrity checks after every step (tests, debugging)."""
    prefix_cache: PrefixCacheConfig | None = None
    """Hybrid prefix caching (rollout/kv/prefix_cache.py); None = off."""
    host_pool_mb: int | float | str = 0
    """Host KV pool, MiB (memory/host_pool.py): the prefix cache's second tier and where paused
    sequences wait out a sleep(); 0 = none. Leased from the engine's host ledger, if given.
    "auto": the pool starts with no page and is sized at each rollout from what the ledger has free
    (`CacheManager.restore_host`; the RL loop does it, with memory.spill_dir: the DRAM the spilled
    training states freed)."""
    kv_budget: KVBudgetConfig | None = None
    """Token eviction for the MLA layers (rollout/kv/kv_eviction.py: H2O or InfiniGen): at most
    `budget_tokens` MLA slots per sequence on the device; None = full KV (the default)."""
    kda_state_dtype: str = "fp32"
    """Element type of the KDA state pages ("fp32" | "bf16"), independent of the MLA cache, which
    takes the model's dtype: the recurrent state integrates every token, so FP32 by default."""
    speculative: str = "off"
    """Speculative decoding (rollout/speculative/speculation.py): "off", "ngram" (prompt lookup: proposals copied from
    earlier text, no extra model), "suffix" (a suffix tree per prompt over its group's and its earlier
    responses: rollout/speculative/suffix_tree.py) or "draft" (proposals sampled from `draft_model`), verified
    in one forward with the target's exact distribution and logprobs."""
    draft_model: str | None = None
    """With speculative=draft: a checkpoint directory of ours (`python -m rl.export` writes one; its
    vocabulary must be the target's), or a model config YAML (configs/model/*.yaml: randomly initialised,
    for tests). Its states live outside the page pool (rollout/speculative/draft.py)."""
    num_speculative_tokens: int = 4
    """Most tokens proposed per sequence and step (the verify chunk is this + 1; adapted per sequence)."""
    ngram_min: int = 1
    """Shortest suffix the n-gram proposer looks up in the sequence's earlier tokens."""
    ngram_max: int = 4
    """Longest suffix it looks up (the longest that matches wins)."""
    suffix_max_depth: int = 8
    """speculative=suffix: the longest substring the trees index (a match uses at most this - 1 tokens).
    Each generated token costs O(this) trie nodes: 1.6 us a token at 8 on copy-like text, 16 us at 16."""
    suffix_max_tokens: int = 1 << 16
    """speculative=suffix: tokens stored over every tree (each adds at most suffix_max_depth nodes); the
    oldest texts are evicted past it."""
    suffix_min_share: float = 0.3
    """speculative=suffix: a proposal stops at a continuation seen in fewer than this share of the cases."""
    speculative_row_cost: float | str = 0.016
    """What one more token row costs in a step, as a share of a decode step's fixed part: a sequence
    verifies the proposals whose chance of being kept pays for their row (rollout/speculative/speculation.py
    `Speculator.worth`). Measured on this project's CPU path with the tiny model: fixed part ~3 ms, a
    row ~50 us, so ~1/64. On a GPU, where decode is bound by reading the weights, a row costs far less:
    lower it (not measured on a GPU); 0 = rows are free: verify every proposal, up to num_speculative_tokens.
    "fitted": fitted to this engine's measured decode steps (rollout/speculative/cost_model.py; 0.016 the
    prior), which makes the choice depend on timing (the output stays exact; sampled runs not bit-reproducible)."""

    def __post_init__(self) -> None:
        self._check_speculation()
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
        if isinstance(self.pool_mb, (str, bool)) or not self.pool_mb > 0:
            raise ValueError(f"pool_mb={self.pool_mb!r}, expected a number of MiB > 0")
        if self.host_pool_mb != "auto" and (isinstance(self.host_pool_mb, (str, bool)) or self.host_pool_mb < 0):
            raise ValueError(f"host_pool_mb={self.host_pool_mb!r}, expected a number of MiB >= 0 (0 = no host KV "
                             f"pool) or 'auto'")
        if self.kernel_impl is not None:
            check_impl(self.kernel_impl)

    def _check_speculation(self) -> None:
        if self.speculative not in SPECULATIVE:
            raise ValueError(f"speculative={self.speculative!r}, expected one of {', '.join(SPECULATIVE)}")
        if isinstance(self.num_speculative_tokens, bool) or not isinstance(self.num_speculative_tokens, int) \
                or self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens!r}, expected an integer >= 1")
        for name, least in (("suffix_max_depth", 2), ("suffix_max_tokens", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name}={value!r}, expected an integer >= {least}")
        if isinstance(self.suffix_min_share, bool) or not isinstance(self.suffix_min_share, (int, float)) \
                or not 0 <= self.suffix_min_share <= 1:
            raise ValueError(f"suffix_min_share={self.suffix_min_share!r}, expected a number in [0, 1]")
        if self.speculative_row_cost != "fitted" and (
                isinstance(self.speculative_row_cost, bool) or not isinstance(self.speculative_row_cost, (int, float))
                or self.speculative_row_cost < 0):
            raise ValueError(f"speculative_row_cost={self.speculative_row_cost!r}, expected a number >= 0 or 'fitted'")
        sizes = (self.ngram_min, self.ngram_max)
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in sizes) or not 1 <= sizes[0] <= sizes[1]:
            raise ValueError(f"ngram_min={self.ngram_min!r}, ngram_max={self.ngram_max!r}: expected integers with "
                             f"1 <= ngram_min <= ngram_max")
        if self.draft_model is not None and self.speculative != "draft":
            raise ValueError(f"draft_model={self.draft_model!r} with speculative={self.speculative!r}: a draft model "
                             f"proposes only with speculative=draft")
        if self.speculative != "off" and self.kv_budget is not None:
            raise ValueError(f"speculative={self.speculative!r} with a KV budget (kv_budget): token eviction "
                             f"and speculation do not run together; turn one off (engine.speculative=off)")

    @property
    def pool_bytes(self) -> int:
        """The device pool's size in bytes (pool_mb MiB); it holds pool_bytes // page_bytes pages."""
        return int(self.pool_mb * MIB)

    @property
    def host_pool_bytes(self) -> int | None:
        """The host pool's size in bytes (host_pool_mb MiB; 0 = none); None for "auto" (sized at each
        rollout from what the ledger has free)."""
        return None if self.host_pool_mb == "auto" else int(self.host_pool_mb * MIB)

    def layout_for(self, model: HybridLM) -> CacheLayout:
        """The page geometry an Engine of this config builds for `model`: MLA latents in the model's
        dtype (its output weight's), KDA states in kda_state_dtype, block_tokens a multiple of the
        prefix cache's hash block when there is one."""
        return CacheLayout.for_model(model.config, group_layers=self.group_layers,
                                     cache_dtype=model.output_weight.dtype,
                                     state_dtype=parse_dtype(self.kda_state_dtype), block_tokens=self.block_tokens,
                                     hash_block=self.prefix_cache.hash_block if self.prefix_cache else None)

    @classmethod
    def for_pages(cls, model: HybridLM, num_pages: int, host_pages: int = 0, **knobs) -> EngineConfig:
        """The config (`knobs` as given) whose pools hold exactly `num_pages` device pages and
        `host_pages` host pages of `model`'s layout: pool_mb and host_pool_mb are those page counts'
        bytes in MiB (a fraction of a MiB, exact: bytes / 2^20 is a float without rounding)."""
        config = cls(**knobs)
        page_bytes = config.layout_for(model).page_bytes
        sizes = {"pool_mb": num_pages * page_bytes / MIB} | ({"host_pool_mb": host_pages * page_bytes / MIB}
                                                              if host_pages else {})
        return replace(config, **sizes)

    @property
    def longest_kv_tokens(self) -> int:
        """Tokens of KV one sequence holds on the device at most: max_model_len, capped by the KV budget."""
        return self.max_model_len if self.kv_budget is None else min(self.max_model_len, self.kv_budget.budget_tokens)
