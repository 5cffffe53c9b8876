"""The export's tokenizer: the run tokenizer's special ids for config.json / generation_config.json, and
files `transformers.AutoTokenizer` loads for the byte tokenizer too.

The byte tokenizer (models/tokenizer.py) is written as a `tokenizers` byte-level tokenizer.json: ids 0..255
are the UTF-8 bytes (GPT-2's byte-to-character alphabet, no merges), 256 `<|bos|>` (prepended, as
`ByteTokenizer.encode` does), 257 `<|eos|>`, 258 `<|pad|>`, with a chat template that renders a
conversation as the run did (bos, then the messages' contents).
"""
from __future__ import annotations

from pathlib import Path

from models.tokenizer import ByteTokenizer, load_tokenizer

BYTE_CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (the byte-level alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def write_byte_tokenizer(out: Path) -> list[str]:
    """The byte tokenizer as Hugging Face files in `out`; the names written."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    byte = ByteTokenizer()
    vocab = {char: b for b, char in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|bos|>", "<|eos|>", "<|pad|>"]
    tok.add_special_tokens(specials)
    assert [tok.token_to_id(s) for s in specials] == [byte.bos_token_id, byte.eos_token_id, byte.pad_token_id]
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A $B",
                                                       special_tokens=[("<|bos|>", byte.bos_token_id)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>", chat_template=BYTE_CHAT_TEMPLATE)
    before = set(out.iterdir())
    fast.save_pretrained(str(out))
    return sorted(p.name for p in set(out.iterdir()) - before)


def special_ids(tokenizer: str | None) -> dict[str, object]:
    """bos/eos/pad ids of the run's tokenizer ("byte", a directory, or None: the byte tokenizer) for the
    export's configs: `eos_token_id` lists every id that ends a turn (eos and the chat template's
    end-of-turn tokens) when there are several, as transformers' generate accepts; pad falls back to eos."""
    tok = load_tokenizer(tokenizer or "byte")
    stops = list(dict.fromkeys(i for i in tok.stop_token_ids if i is not None))
    eos = tok.eos_token_id if tok.eos_token_id is not None else (stops[0] if stops else None)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    return {"bos_token_id": tok.bos_token_id, "eos_token_id": eos, "pad_token_id": pad,
            "stop_token_ids": stops or ([eos] if eos is not None else [])}
