"""Tokenizers behind one interface: `encode(text, add_bos=True)`, `decode(ids)`, `bos_token_id`,
`eos_token_id`, `pad_token_id`, `vocab_size`.

`ByteTokenizer` serves the tiny CPU model: ids 0..255 are bytes, then bos, eos, pad; it needs no
files and round-trips any UTF-8 text exactly. Real checkpoints bring their own tokenizer (tiktoken-
based for Kimi): `load_tokenizer(directory)` wraps a Hugging Face tokenizer saved there in
`HFTokenizer`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


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


@dataclass(frozen=True)
class HFTokenizer:
    """Adapter giving a Hugging Face tokenizer the ByteTokenizer interface.

    Special ids are the wrapped tokenizer's (None where it defines no such token); `vocab_size`
    counts added tokens too, so every id `encode` can return is below it.
    """

    tokenizer: Any
    """A `transformers` PreTrainedTokenizerBase."""

    @property
    def bos_token_id(self) -> int | None:
        return self.tokenizer.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self.tokenizer.pad_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Text to ids without the tokenizer's own special-token template; bos first if asked."""
        if add_bos and self.bos_token_id is None:
            raise ValueError(f"{type(self.tokenizer).__name__} defines no bos token, pass add_bos=False")
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ([self.bos_token_id] if add_bos else []) + list(ids)

    def decode(self, ids: list[int]) -> str:
        """Ids to text; special ids are dropped."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def load_tokenizer(name_or_path: str) -> ByteTokenizer | HFTokenizer:
    """"byte" -> ByteTokenizer(); a local directory -> the Hugging Face tokenizer saved there.

    Loading never touches the network (`local_files_only=True`). transformers is only a dev
    dependency, so it is imported here, when a directory is actually loaded.
    """
    if name_or_path == "byte":
        return ByteTokenizer()
    if not os.path.isdir(name_or_path):
        raise ValueError(f"tokenizer {name_or_path!r}, expected \"byte\" or an existing local directory")
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"loading the tokenizer in {name_or_path!r} needs transformers: "
                          "pip install transformers (or the project's dev extra)") from e
    return HFTokenizer(transformers.AutoTokenizer.from_pretrained(name_or_path, local_files_only=True))
