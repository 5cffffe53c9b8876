"""Tokenizer directories built offline for tests: a tiny byte-level BPE (trained with `tokenizers`
on a few sentences) wrapped in transformers' PreTrainedTokenizerFast and saved with
`save_pretrained`, optionally with a ChatML-style chat template, a generation_config.json, or a
tokenizer_config.json that asks for remote code (as Kimi's tiktoken tokenizer does)."""
from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ("<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>", "<|endoftext|>")
"""Ids 0..5 in this order: bos, eos, pad, start of turn, end of turn, the generation config's extra eos."""
BOS, EOS, PAD, IM_START, IM_END, END_OF_TEXT = range(len(SPECIAL_TOKENS))

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m.role) }}"
    "{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML: each message `<|im_start|>role\\ncontent<|im_end|>\\n`; the generation prompt opens an
assistant turn. Roles system, user and assistant only."""

CORPUS = ["get the key value: the key is seven.", "hello world, be brief!", "système ✓ 42 = 6 * 7"]


def build_bpe_tokenizer(path: Path, *, chat_template: str | None = CHAT_TEMPLATE,
                        generation_eos: list[int] | None = None) -> Path:
    """Save a tiny byte-level BPE tokenizer (SPECIAL_TOKENS first) to `path`, with `chat_template`
    (None: none) and, when `generation_eos` is given, a generation_config.json naming those eos ids."""
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS * 4, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>", additional_special_tokens=list(SPECIAL_TOKENS[3:]))
    if chat_template is not None:
        fast.chat_template = chat_template
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(path)
    if generation_eos is not None:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return path


def build_remote_code_dir(path: Path) -> Path:
    """A saved tokenizer whose tokenizer_config.json maps AutoTokenizer to a class of its own module,
    the way Kimi's tiktoken tokenizer ships (the module itself imports tiktoken)."""
    build_bpe_tokenizer(path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["auto_map"] = {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}
    config["tokenizer_class"] = "TikTokenTokenizer"
    config_file.write_text(json.dumps(config))
    (path / "tokenization_kimi.py").write_text(
        "import tiktoken\n"
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class TikTokenTokenizer(PreTrainedTokenizerFast):\n"
        "    pass\n")
    return path
