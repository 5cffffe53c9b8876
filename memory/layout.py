"""Geometry of the unified page pool: which layers share a page, block_tokens, page_bytes.

See memory/page_pool.py for the words (cache group, slot, head-major KDA unit, MLA page).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from models.config import ModelConfig


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _chunk(layers: list[int], size: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(layers[i:i + size]) for i in range(0, len(layers), size))


@dataclass(frozen=True, kw_only=True)
class CacheLayout:
    """How one model's caches map onto equal-size pages (pure geometry; owns no memory)."""

    kda_groups: tuple[tuple[int, ...], ...]
    """Layer indices of each KDA cache group, in layer order."""
    mla_groups: tuple[tuple[int, ...], ...]
    """Layer indices of each MLA cache group, in layer order."""
    group_layers: int
    """Slots per page: layers per cache group (the last group of a kind may be shorter)."""
    num_heads: int
    """KDA heads H in one page: the model's heads / tp_size (a TP rank holds only its share)."""
    head_dim: int
    """KDA key and value head dimension (dk = dv)."""
    conv_kernel: int
    """KDA short-convolution kernel; a conv tail keeps kernel-1 tokens."""
    latent_dim: int
    """MLA numbers per token and layer: kv_lora_rank + qk_rope_head_dim."""
    block_tokens: int
    """Tokens per MLA page."""
    page_bytes: int
    """Bytes of every page, KDA or MLA."""
    state_dtype: torch.dtype = torch.float32
    """Element type of KDA pages (S and conv tails)."""
    cache_dtype: torch.dtype = torch.float32
    """Element type of MLA pages."""
    tp_size: int = 1
    """Tensor-parallel degree this layout is one rank's share of (see `shard`); 1 = the whole model."""

    def __post_init__(self) -> None:
        for name in ("group_layers", "num_heads", "head_dim", "conv_kernel", "latent_dim", "block_tokens",
                     "page_bytes", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"cache layout: {name}={value!r}, expected a positive integer")
        object.__setattr__(self, "kda_groups", tuple(tuple(int(i) for i in g) for g in self.kda_groups))
        object.__setattr__(self, "mla_groups", tuple(tuple(int(i) for i in g) for g in self.mla_groups))
        if not self.kda_groups and not self.mla_groups:
            raise ValueError("cache layout: no cache groups (kda_groups and mla_groups are both empty)")
        seen: set[int] = set()
        for kind, groups in (("kda", self.kda_groups), ("mla", self.mla_groups)):
            for g, layers in enumerate(groups):
                if not 0 < len(layers) <= self.group_layers:
                    raise ValueError(f"cache layout: {kind} group {g} has {len(layers)} layers {list(layers)}, "
                                     f"expected 1..group_layers={self.group_layers}")
                for layer in layers:
                    if layer < 0 or layer in seen:
                        raise ValueError(f"cache layout: layer {layer} in {kind} group {g} is negative or already "
                                         f"in another group; expected each layer index >= 0 in one group")
                    seen.add(layer)
        for name, dtype in (("state_dtype", self.state_dtype), ("cache_dtype", self.cache_dtype)):
            if self.page_bytes % _itemsize(dtype):
                raise ValueError(f"cache layout: page_bytes={self.page_bytes} is not a multiple of {name}={dtype}'s "
                                 f"{_itemsize(dtype)} bytes")
        if self.page_bytes < self.kda_state_bytes_per_group * bool(self.kda_groups):
            raise ValueError(f"cache layout: page_bytes={self.page_bytes} < kda_state_bytes_per_group="
                             f"{self.kda_state_bytes_per_group}")
        if self.page_bytes < self.mla_block_bytes * bool(self.mla_groups):
            raise ValueError(f"cache layout: page_bytes={self.page_bytes} < block_tokens * mla_token_bytes_per_group"
                             f"={self.block_tokens} * {self.mla_token_bytes_per_group}")

    @classmethod
    def for_model(cls, config: ModelConfig, *, group_layers: int | None = None,
                  state_dtype: torch.dtype = torch.float32, cache_dtype: torch.dtype = torch.float32,
                  block_tokens_multiple: int = 16, page_align_bytes: int = 256,
                  block_tokens: int | None = None, hash_block: int | None = None,
                  tp_size: int = 1) -> "CacheLayout":
        """Derive the layout of `config`'s caches.

        group_layers: defaults to the number of MLA layers (3:1 model -> 3 KDA groups + 1 MLA group);
          a model without MLA layers defaults to all its KDA layers in one group (one page = one
          sequence's whole state).
        block_tokens: None derives it, floor(kda_state_bytes_per_group / mla_token_bytes_per_group)
          rounded down to a multiple of block_tokens_multiple (at least block_tokens_multiple); a model
          without KDA layers has nothing to match and uses block_tokens_multiple (vLLM's default 16).
          An explicit value overrides the derivation; page_bytes still fits both page kinds.
        hash_block: the prefix cache's tokens per hash block, or None (no prefix cache). Given, an
          explicit block_tokens must be a multiple of it (ValueError otherwise), and a derived one is
          the multiple of hash_block next to KDA state bytes / MLA bytes per token, below or above
          (at least one hash block), whose page wastes the smaller fraction: the one with the smaller
          `padding_fraction` (the smaller kind's unused share of the page; below on a tie). Below
          pads the MLA pages, above pads the KDA pages: the 48B model in bf16 (ratio 974.2, hash
          block 512) takes 1,024 tokens, KDA pages 4.9% padding, rather than 512 at 47.4% MLA padding.
        page_bytes = max(KDA state bytes, MLA block bytes), rounded up to page_align_bytes.
        tp_size: the layout of one tensor-parallel rank, `for_model(config).shard(tp_size)`: block_tokens
          and page_bytes are those of the whole model (TP 1) at every degree.
        """
        kda, mla = config.kda_layers, config.mla_layers
        if group_layers is None:
            group_layers = len(mla) or len(kda)
        if not isinstance(group_layers, int) or not 0 < group_layers <= max(len(kda), len(mla)):
            raise ValueError(f"cache layout: group_layers={group_layers!r}, expected 1..{max(len(kda), len(mla))} "
                             f"(the model has {len(kda)} KDA and {len(mla)} MLA layers)")
        for name, value in (("block_tokens_multiple", block_tokens_multiple), ("page_align_bytes", page_align_bytes)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"cache layout: {name}={value!r}, expected a positive integer")
        for name, value in (("block_tokens", block_tokens), ("hash_block", hash_block)):
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"cache layout: {name}={value!r}, expected None or a positive integer")
        if block_tokens is not None and hash_block is not None and block_tokens % hash_block:
            raise ValueError(f"cache layout: block_tokens={block_tokens} is not a multiple of the prefix cache's "
                             f"hash_block={hash_block}; expected a multiple of {hash_block} (or block_tokens=None "
                             f"to derive one)")
        dk, kernel = config.linear_head_dim, config.linear_conv_kernel_dim
        unit_elems = dk * dk + 3 * (kernel - 1) * dk
        # a model without KDA layers has no state to match
        state_bytes = config.linear_num_heads * group_layers * unit_elems * _itemsize(state_dtype) if kda else 0
        mla_token_bytes = group_layers * config.mla_latent_dim * _itemsize(cache_dtype)

        def build(tokens: int) -> CacheLayout:
            needed = max(state_bytes, tokens * mla_token_bytes if mla else 0)
            return cls(kda_groups=_chunk(kda, group_layers), mla_groups=_chunk(mla, group_layers),
                       group_layers=group_layers, num_heads=config.linear_num_heads, head_dim=dk,
                       conv_kernel=kernel, latent_dim=config.mla_latent_dim, block_tokens=tokens,
                       page_bytes=_round_up(needed, page_align_bytes), state_dtype=state_dtype,
                       cache_dtype=cache_dtype)

        if block_tokens is not None:
            layout = build(block_tokens)
        elif hash_block is not None:
            below = max(state_bytes // (mla_token_bytes * hash_block), 1) * hash_block
            above = max(-(-state_bytes // (mla_token_bytes * hash_block)), 1) * hash_block
            layout = min(build(below), build(above), key=lambda candidate: candidate.padding_fraction)
        else:
            multiple = block_tokens_multiple
            layout = build(max(state_bytes // mla_token_bytes // multiple * multiple, multiple))
        return layout.shard(tp_size)

    def shard(self, tp_size: int) -> "CacheLayout":
        """The layout of one rank of a tensor-parallel degree `tp_size` (of the same model, whatever
        this layout's own degree): KDA heads split evenly, rank r holding heads [r*H/t, (r+1)*H/t) in
        the same head-major order, so its KDA page is a byte range of the TP-1 page. MLA pages are
        replicated (every query head reads the whole latent), so they are the same at every degree.

        block_tokens and page_bytes do not change with tp_size: an MLA page keeps its tokens (block
        tables, hash-block boundaries and partial tails are TP-independent, so a transfer re-slices
        bytes inside each page and never re-blocks tokens) and a page is page_bytes at every degree
        (one host pool serves all). The price: a TP-t rank's KDA page uses 1/t of the page.
        """
        full_heads = self.num_heads * self.tp_size
        if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size <= 0 or full_heads % tp_size:
            raise ValueError(f"cache layout: tp_size={tp_size!r} does not split num_heads={full_heads} KDA heads "
                             f"evenly; expected a positive divisor of {full_heads}")
        return dataclasses.replace(self, num_heads=full_heads // tp_size, tp_size=tp_size)

    # ---- derived figures -------------------------------------------------------------------------
    @property
    def full_num_heads(self) -> int:
        """The model's KDA heads (all TP ranks together)."""
        return self.num_heads * self.tp_size

    def rank_heads(self, tp_rank: int) -> range:
        """The model's KDA heads that TP rank `tp_rank` holds, in page order."""
        if not isinstance(tp_rank, int) or not 0 <= tp_rank < self.tp_size:
            raise ValueError(f"cache layout: tp_rank={tp_rank!r}, expected 0..{self.tp_size - 1} "
                             f"(tp_size={self.tp_size})")
        return range(tp_rank * self.num_heads, (tp_rank + 1) * self.num_heads)

    @property
    def kda_unit_elems(self) -> int:
        """Elements of one head of one layer: S [dk, dv] + conv tails [3, kernel-1, dk]."""
        return self.head_dim * self.head_dim + 3 * (self.conv_kernel - 1) * self.head_dim

    @property
    def kda_head_bytes(self) -> int:
        """Bytes of one head's block in a KDA page (its unit in every slot of the group)."""
        return self.group_layers * self.kda_unit_elems * _itemsize(self.state_dtype)

    @property
    def kda_state_bytes_per_group(self) -> int:
        return self.num_heads * self.kda_head_bytes

    @property
    def mla_token_bytes_per_group(self) -> int:
        return self.group_layers * self.latent_dim * _itemsize(self.cache_dtype)

    @property
    def mla_block_bytes(self) -> int:
        """Bytes an MLA page uses: block_tokens tokens of every slot."""
        return self.block_tokens * self.mla_token_bytes_per_group

    @property
    def kda_padding_bytes(self) -> int:
        """Unused bytes at the end of every KDA page."""
        return self.page_bytes - self.kda_state_bytes_per_group

    @property
    def mla_padding_bytes(self) -> int:
        """Unused bytes at the end of every MLA page."""
        return self.page_bytes - self.mla_block_bytes

    @property
    def kda_padding_fraction(self) -> float:
        """kda_padding_bytes / page_bytes: the share of every KDA page left unused (0 without KDA groups)."""
        return self.kda_padding_bytes / self.page_bytes if self.kda_groups else 0.0

    @property
    def mla_padding_fraction(self) -> float:
        """mla_padding_bytes / page_bytes: the share of every MLA page left unused (0 without MLA groups)."""
        return self.mla_padding_bytes / self.page_bytes if self.mla_groups else 0.0

    @property
    def padding_fraction(self) -> float:
        """The larger of kda_padding_fraction and mla_padding_fraction: the unused share of a page of
        the smaller kind (the other kind is padded only up to page_align_bytes). `for_model` picks the
        block_tokens with the smaller value when block_tokens must be a multiple of a hash block."""
        return max(self.kda_padding_fraction, self.mla_padding_fraction)

    @property
    def groups(self) -> list[tuple[str, int]]:
        """Every cache group's tag, KDA groups first."""
        return [("kda", g) for g in range(len(self.kda_groups))] + [("mla", g) for g in range(len(self.mla_groups))]

    def group_of(self, layer: int) -> tuple[str, int, int]:
        """(kind "kda"|"mla", group index, slot in the group) of a layer."""
        for kind, groups in (("kda", self.kda_groups), ("mla", self.mla_groups)):
            for g, layers in enumerate(groups):
                if layer in layers:
                    return kind, g, layers.index(layer)
        raise ValueError(f"cache layout: layer {layer!r} is in no cache group (KDA groups {list(self.kda_groups)}, "
                         f"MLA groups {list(self.mla_groups)})")

    def head_byte_range(self, head: int) -> tuple[int, int]:
        """[start, end) bytes of KDA head `head`'s block in a KDA page: S and conv tails of every slot."""
        if not 0 <= head < self.num_heads:
            raise ValueError(f"cache layout: head={head!r}, expected 0..{self.num_heads - 1}")
        return head * self.kda_head_bytes, (head + 1) * self.kda_head_bytes

    def mla_pages_for(self, num_tokens: int) -> int:
        """MLA pages (per MLA group) that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_tokens)

    def sequence_pages(self, num_tokens: int) -> int:
        """Pages one private sequence of `num_tokens` tokens holds with full KV: one state page per
        KDA cache group and ceil(num_tokens / block_tokens) pages per MLA cache group (the one
        formula: the engine's cache manager, the run config's pool check and the planner use it)."""
        return len(self.kda_groups) + len(self.mla_groups) * self.mla_pages_for(num_tokens)

    def pool_mb_for(self, num_pages: int) -> int:
        """The smallest pool, in MiB, that holds `num_pages` pages (`PagePool.from_bytes`'s rounding)."""
        return -(-num_pages * self.page_bytes // (1 << 20))

    def describe(self) -> str:
        """One-line summary for logs."""
        return (f"page_bytes={self.page_bytes:,} block_tokens={self.block_tokens:,} group_layers={self.group_layers} "
                f"kda_groups={[list(g) for g in self.kda_groups]} ({self.kda_state_bytes_per_group:,} B, "
                f"{str(self.state_dtype).removeprefix('torch.')}, pad {self.kda_padding_bytes:,}) "
                f"mla_groups={[list(g) for g in self.mla_groups]} ({self.mla_block_bytes:,} B, "
                f"{str(self.cache_dtype).removeprefix('torch.')}, pad {self.mla_padding_bytes:,})"
                + (f" tp_size={self.tp_size} ({self.num_heads} of {self.full_num_heads} KDA heads)"
                   if self.tp_size > 1 else ""))
