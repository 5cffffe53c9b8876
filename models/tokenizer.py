"""Byte-level tokenizer for the tiny CPU model: ids 0..255 are bytes, then bos, eos, pad.

Real checkpoints bring their own tokenizer (tiktoken-based for Kimi); this one needs no files and
round-trips any UTF-8 text exactly.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ByteTokenizer:
    bos_token_id: int = 256
    eos_token_id: int = 257
    pad_token_id: int = 258

    @property
    def vocab_size(self) -> int:
        return 259

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return ([self.bos_token_id] if add_bos else []) + list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Bytes to text; special ids are dropped and invalid UTF-8 becomes U+FFFD."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
