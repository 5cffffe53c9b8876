"""The prefix cache's index: chained hash blocks inside physical pages.

Granularities are decoupled: a *hash block* (default 512 tokens) is the unit of reuse, a physical
page holds `block_tokens` tokens (a multiple of the hash block; 6,144 at real size). Hashes are
chained, h_i = H(h_{i-1}, tokens of hash block i, salt), so an index hit on h_i certifies the whole
prefix [0, i * hash_block). The salt carries the model identity and the policy version: new weights
never hit prefixes computed by old ones.

MLA side: every hash-block end inside a registered page is a key (a partially filled page stays
reachable at each of its complete hash blocks, and its registered end advances as it fills):
h_i -> the pages (one per MLA cache group) holding physical block (i - 1) // per_page.
KDA side: sparse checkpoints, h_i -> {KDA group: page holding the state after token i * hash_block};
a boundary counts only when every KDA group has its checkpoint (rule 3 keeps siblings together).

Lookup (`match`): the MLA stage walks h_1, h_2, ... while entries exist (whole pages certified by
their last hash, then the in-page fallback at the first page that is not complete); the KDA stage
takes the longest boundary inside that with a complete checkpoint set; the hit always leaves at
least one token to compute. Pages, refcounts, pinning and eviction belong to the pool and the cache
manager; this module is pure bookkeeping (no tensors) so it can be tested exhaustively. Locations
are opaque hashable values (the prefix cache uses `rollout.kv.page_loc.Loc`, tier + page).
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


def chain_hashes(tokens: Sequence[int], hash_block: int, salt: bytes, *, start: bytes = b"",
                 first_block: int = 0) -> list[bytes]:
    """Chained hashes of the complete hash blocks of `tokens` (a trailing partial block has none).

    `start`/`first_block` continue a chain: `start` is h_{first_block} (b"" for the empty prefix)
    and `tokens` begins at token first_block * hash_block. Returns [h_{first_block+1}, ...].
    """
    if hash_block < 1:
        raise ValueError(f"hash_block={hash_block}, expected >= 1")
    hashes, prev = [], start
    for b in range(len(tokens) // hash_block):
        block = tokens[b * hash_block:(b + 1) * hash_block]
        h = hashlib.blake2b(digest_size=16)
        h.update(prev)
        h.update(len(salt).to_bytes(4, "little") + salt)
        h.update(b"".join(int(t).to_bytes(4, "little", signed=False) for t in block))
        prev = h.digest()
        hashes.append(prev)
    return hashes


def cache_salt(model_id: str, policy_version: int) -> bytes:
    """Extra key of every hash: the model identity and the policy version that computed the cache."""
    return f"{model_id}|v{policy_version}".encode()


@dataclass(frozen=True)
class Match:
    """Result of a lookup: reuse the first `tokens` tokens of the request."""

    tokens: int
    """Hit length, a multiple of the hash block (0 = miss)."""
    mla_pages: list[tuple[int, ...]]
    """Per physical block covering [0, tokens): the pages (one per MLA group) to read it from."""
    kda_pages: tuple[int, ...]
    """The checkpoint's page per KDA group (empty on a miss or a model without KDA)."""
    mla_tokens: int
    """How far the MLA stage alone matched (>= tokens)."""


@dataclass
class PrefixIndex:
    hash_block: int
    block_tokens: int
    num_kda_groups: int
    mla: dict[bytes, tuple[int, ...]] = field(default_factory=dict)
    """h_i -> pages (per MLA group) of physical block (i - 1) // per_page."""
    kda: dict[bytes, dict[int, int]] = field(default_factory=dict)
    """h_i -> {KDA group: checkpoint page}; complete when it has every group."""
    _keys_of_page: dict[int, set[bytes]] = field(default_factory=dict)
    _kda_key_of_page: dict[int, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.hash_block < 1 or self.block_tokens % self.hash_block:
            raise ValueError(f"block_tokens={self.block_tokens} must be a positive multiple of "
                             f"hash_block={self.hash_block}")

    @property
    def per_page(self) -> int:
        """Hash blocks per physical page."""
        return self.block_tokens // self.hash_block

    # ---- registration ---------------------------------------------------------------------------------
    def register_mla(self, hashes: Sequence[bytes], first: int, pages_by_block: Sequence[tuple[int, ...]]) -> set[int]:
        """Register hash-block ends first+1 .. first+len(hashes) (1-based, h_i certifies [0, i*hash_block))
        of a sequence whose physical block j lives in `pages_by_block[j]`. Already-registered keys
        keep their pages (the first registrant stays; both hold the same bytes). Returns the pages
        the index did not reference before."""
        new_pages = set()
        for offset, h in enumerate(hashes):
            i = first + offset + 1
            block = (i - 1) // self.per_page
            if h in self.mla:
                continue
            pages = tuple(pages_by_block[block])
            self.mla[h] = pages
            for page in pages:
                if page not in self._keys_of_page and page not in self._kda_key_of_page:
                    new_pages.add(page)
                self._keys_of_page.setdefault(page, set()).add(h)
        return new_pages

    def register_kda(self, h: bytes, group: int, page: int) -> None:
        """A checkpoint page of KDA group `group` at the boundary certified by `h` (read-only from now)."""
        if not 0 <= group < self.num_kda_groups:
            raise ValueError(f"KDA group {group} out of range [0, {self.num_kda_groups})")
        slot = self.kda.setdefault(h, {})
        if group in slot:
            raise ValueError(f"a checkpoint for this boundary is already registered in KDA group {group} "
                             f"(page {slot[group]}); register new states in fresh pages only")
        slot[group] = page
        self._kda_key_of_page[page] = h

    # ---- lookup ---------------------------------------------------------------------------------------
    def match(self, hashes: Sequence[bytes], num_tokens: int, has_mla: bool = True,
              excluded: Iterable[int] = ()) -> Match:
        """Longest reusable prefix of a request with chained hashes `hashes` and `num_tokens` tokens.
        Pages in `excluded` (allocated or registered in the current step, bytes not yet copied) do
        not match (concurrency rule 2)."""
        excluded = set(excluded)
        limit = min(len(hashes), (num_tokens - 1) // self.hash_block)  # always compute >= 1 token
        mla_blocks = limit
        if has_mla:
            mla_blocks = 0
            while mla_blocks < limit:
                pages = self.mla.get(hashes[mla_blocks])
                if pages is None or excluded.intersection(pages):
                    break
                mla_blocks += 1
        best = 0
        for i in range(mla_blocks, 0, -1):
            if self.num_kda_groups == 0:
                best = i
                break
            slot = self.kda.get(hashes[i - 1])
            if slot is not None and len(slot) == self.num_kda_groups and not excluded.intersection(slot.values()):
                best = i
                break
        pages_by_block = []
        if has_mla and best:
            last_block = (best - 1) // self.per_page
            for j in range(last_block):
                pages_by_block.append(self.mla[hashes[(j + 1) * self.per_page - 1]])
            pages_by_block.append(self.mla[hashes[best - 1]])
        kda_pages = tuple(self.kda[hashes[best - 1]][g] for g in range(self.num_kda_groups)) if best else ()
        return Match(best * self.hash_block, pages_by_block, kda_pages, mla_blocks * self.hash_block)

    # ---- queries ----------------------------------------------------------------------------------------
    def keys_of(self, page) -> frozenset[bytes]:
        """The MLA keys that read `page` (empty if none)."""
        return frozenset(self._keys_of_page.get(page, ()))

    def checkpoint_of(self, page) -> bytes | None:
        """The boundary whose KDA checkpoint `page` holds; None if it holds none."""
        return self._kda_key_of_page.get(page)

    def bundle(self, page) -> list:
        """The pages that move between tiers (or go) together with the indexed `page`: an MLA page
        tuple (one page per MLA group, one physical block) and every complete or partial KDA
        checkpoint at a boundary inside it. A checkpoint thus always sits on the tier of the MLA
        pages of its last block; a checkpoint without MLA keys goes alone, with its siblings."""
        h = self._kda_key_of_page.get(page)
        if h is not None:
            pages = self.mla.get(h)
            if pages is None:
                return list(self.kda[h].values())
        else:
            pages = self.mla[next(iter(self._keys_of_page[page]))]
        out = list(pages)
        for key in self._keys_of_page.get(pages[0], ()):
            out += [p for p in self.kda.get(key, {}).values() if p not in out]
        return out

    # ---- eviction ---------------------------------------------------------------------------------------
    def forget_page(self, page: int) -> list[int]:
        """Drop every key that reads `page` (it is being evicted). For a KDA checkpoint page, the
        sibling checkpoints of the same boundary go too (rule 3): returns those sibling pages,
        which the caller frees with it."""
        self._forget_mla_keys(page)
        h = self._kda_key_of_page.pop(page, None)
        if h is None:
            return []
        siblings = [p for p in self.kda.pop(h, {}).values() if p != page]
        for p in siblings:
            self._kda_key_of_page.pop(p, None)
        return siblings

    def relocate(self, old: int, new: int) -> None:
        """Every key that reads location `old` reads `new` instead (the bytes moved between tiers)."""
        if new in self._keys_of_page or new in self._kda_key_of_page:
            raise ValueError(f"relocate {old} -> {new}: location {new} is already indexed")
        keys = self._keys_of_page.pop(old, None)
        if keys is not None:
            for h in keys:
                self.mla[h] = tuple(new if p == old else p for p in self.mla[h])
            self._keys_of_page[new] = keys
        h = self._kda_key_of_page.pop(old, None)
        if h is not None:
            slot = self.kda[h]
            slot[next(g for g, p in slot.items() if p == old)] = new
            self._kda_key_of_page[new] = h

    def forget_page_alone(self, page: int) -> None:
        """forget_page without rule 3 (debug only): a checkpoint page leaves its boundary's slot in
        its own group, and the siblings stay registered."""
        self._forget_mla_keys(page)
        h = self._kda_key_of_page.pop(page, None)
        if h is not None:
            slot = self.kda[h]
            del slot[next(g for g, p in slot.items() if p == page)]
            if not slot:
                del self.kda[h]

    def _forget_mla_keys(self, page: int) -> None:
        """Drop every MLA key that reads `page` (from the other groups' pages of those keys too)."""
        for h in self._keys_of_page.pop(page, set()):
            for other in self.mla.pop(h, ()):
                if other != page:
                    self._keys_of_page.get(other, set()).discard(h)

    def pages(self) -> set[int]:
        """Every page the index references."""
        return set(self._keys_of_page) | set(self._kda_key_of_page)

    def check_integrity(self) -> None:
        """The reverse maps agree with the forward ones; KDA slots are keyed by their own pages."""
        for h, pages in self.mla.items():
            for page in pages:
                if h not in self._keys_of_page.get(page, ()):
                    raise AssertionError(f"MLA key for page {page} missing from its reverse map")
        for page, keys in self._keys_of_page.items():
            for h in keys:
                if page not in self.mla.get(h, ()):
                    raise AssertionError(f"page {page} lists a key that does not map to it")
        for h, slot in self.kda.items():
            for group, page in slot.items():
                if self._kda_key_of_page.get(page) != h:
                    raise AssertionError(f"KDA checkpoint page {page} (group {group}) not keyed by its boundary")
        if len(self._kda_key_of_page) != sum(len(s) for s in self.kda.values()):
            raise AssertionError("KDA reverse map holds pages no boundary lists")
