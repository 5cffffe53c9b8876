"""Tokenizers behind one interface: `encode(text, add_bos=True)`, `decode(ids)`, `render(messages)`,
`continue_turn(text)`, `bos_token_id`, `eos_token_id`, `pad_token_id`, `stop_token_ids`,
`stop_strings`, `use_chat_template`, `vocab_size`.

`ByteTokenizer` serves the tiny CPU model: ids 0..255 are bytes, then bos, eos, pad; it needs no
files and round-trips any UTF-8 text exactly. Real checkpoints bring their own tokenizer (tiktoken-
based for Kimi): `load_tokenizer(TokenizerConfig(path=directory))` wraps a Hugging Face tokenizer
saved there in `HFTokenizer`, and renders conversations with its chat template when it has one.

Without a chat template (always for ByteTokenizer; `chat_template=False`; a directory with none)
a conversation is rendered in the *plain format*: the system prompt (if configured) and the
messages' contents concatenated with no separator, bos first when the tokenizer has one. A single
user message without a system prompt therefore renders exactly as `encode(content)`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model",
                   "vocab.json", "vocab.txt")
"""A directory holding none of these is not a tokenizer directory (tiktoken.model: Kimi's)."""

_USER_SENTINEL, _ASSISTANT_SENTINEL = "Q7sentinelUSER", "Q7sentinelASSISTANT"
"""Contents of the fixed conversation the chat template is probed with (end-of-turn tokens, turn
continuations); plain letters, so no template rewrites them."""


@dataclass(frozen=True, kw_only=True)
class TokenizerConfig:
    """The tokenizer a run uses and how it renders conversations (validated on construction)."""

    path: str = "byte"
    """"byte" (the tiny models' byte tokenizer) or a local Hugging Face tokenizer directory."""
    trust_remote_code: bool = False
    """Run tokenizer code the directory ships (tokenizer_config.json `auto_map`, e.g. Kimi's tiktoken one)."""
    chat_template: bool | None = None
    """None: use the tokenizer's chat template when it has one; True: require one; False: plain format."""
    system_prompt: str | None = None
    """A system message put before every conversation that does not start with one."""
    stop_strings: list[str] = field(default_factory=list)
    """Texts that end an answer, besides the stop token ids: generation stops once one is decoded, and the
    environment gets the answer cut before it (the tokens stay: the trainer scores what was sampled)."""

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"tokenizer.path={self.path!r}, expected \"byte\" or a local directory")
        if not isinstance(self.trust_remote_code, bool):
            raise ValueError(f"tokenizer.trust_remote_code={self.trust_remote_code!r}, expected true or false")
        if self.chat_template is not None and not isinstance(self.chat_template, bool):
            raise ValueError(f"tokenizer.chat_template={self.chat_template!r}, expected true, false or null")
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise ValueError(f"tokenizer.system_prompt={self.system_prompt!r}, expected a string or null")
        if isinstance(self.stop_strings, str) or not all(isinstance(s, str) and s for s in self.stop_strings):
            raise ValueError(f"tokenizer.stop_strings={self.stop_strings!r}, expected a list of non-empty strings")
        if self.path == "byte":
            if self.chat_template is True:
                raise ValueError("tokenizer.chat_template=true, but the byte tokenizer has no chat template: "
                                 "expected a tokenizer directory with one, or chat_template false or null")
        else:
            _check_directory(self.path)
            reason = None if self.trust_remote_code else _remote_code_reason(self.path, None)
            if reason is not None:
                raise ValueError(f"tokenizer.path={self.path!r} needs code shipped with it ({reason}), which runs "
                                 f"only when asked: set tokenizer.trust_remote_code=true if you trust that directory")


def _check_directory(path: str) -> None:
    """ValueError unless `path` is an existing directory holding at least one of TOKENIZER_FILES."""
    if not os.path.exists(path):
        raise ValueError(f"tokenizer.path={path!r} does not exist: expected \"byte\" or an existing local "
                         f"directory (hub names are not downloaded)")
    if not os.path.isdir(path):
        raise ValueError(f"tokenizer.path={path!r} is not a directory: expected \"byte\" or an existing local "
                         f"directory a tokenizer was saved to")
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise ValueError(f"tokenizer.path={path!r} holds no tokenizer files: expected one of "
                         f"{', '.join(TOKENIZER_FILES)} (what save_pretrained writes)")


def _with_system(messages: list[dict], system_prompt: str | None) -> list[dict]:
    """`messages` checked ({"role": str, "content": str} each), the system prompt put first when
    configured and the conversation does not already start with a system message."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages={messages!r}, expected a non-empty list of {{'role', 'content'}} dicts")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"message {m!r}, expected a dict with string 'role' and 'content'")
    if system_prompt is not None and messages[0]["role"] != "system":
        return [{"role": "system", "content": system_prompt}, *messages]
    return list(messages)


class AnswerText:
    """`answer_text`, shared by the tokenizers (each defines `decode` and `stop_strings`)."""

    def answer_text(self, ids: list[int]) -> str:
        """The text of a generated answer as the environment sees it: decoded, cut before the first stop
        string (vLLM's default; the tokens, stop string included, stay what the trainer scores)."""
        text = self.decode(ids)
        cuts = [i for i in (text.find(s) for s in self.stop_strings) if i >= 0]
        return text[:min(cuts)] if cuts else text


@dataclass(frozen=True)
class ByteTokenizer(AnswerText):
    bos_token_id: int = 256
    eos_token_id: int = 257
    pad_token_id: int = 258
    system_prompt: str | None = None
    """Prepended (plain format) by `render`."""
    stop_strings: tuple[str, ...] = ()
    """Texts that end an answer: generation stops once one is decoded (`SamplingParams.stop_strings`)
    and `answer_text` cuts before it."""

    @property
    def vocab_size(self) -> int:
        return 259

    @property
    def use_chat_template(self) -> bool:
        return False

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self.eos_token_id,)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return ([self.bos_token_id] if add_bos else []) + list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Bytes to text; special ids are dropped and invalid UTF-8 becomes U+FFFD."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
               ) -> list[int]:
        """The conversation in the plain format: bos, then the contents concatenated (system prompt
        first when configured); `add_generation_prompt` and `tools` add nothing here (the task's own
        prompt says how to call its tools)."""
        return self.encode("".join(m["content"] for m in _with_system(messages, self.system_prompt)))

    def continue_turn(self, text: str, role: str = "user") -> list[int]:
        """Ids appended to a conversation after an answer: the plain format adds the text alone."""
        return self.encode(text, add_bos=False)


@dataclass(frozen=True)
class HFTokenizer(AnswerText):
    """Adapter giving a Hugging Face tokenizer the ByteTokenizer interface.

    Special ids are the wrapped tokenizer's (None where it defines no such token); `vocab_size`
    counts added tokens too, so every id `encode` can return is below it.
    """

    tokenizer: Any
    """A `transformers` PreTrainedTokenizerBase."""
    use_chat_template: bool = False
    """`render` applies the tokenizer's chat template (else the plain format)."""
    system_prompt: str | None = None
    """Put first by `render` when a conversation does not start with a system message."""
    stop_strings: tuple[str, ...] = ()
    """Texts that end an answer: generation stops once one is decoded (`SamplingParams.stop_strings`)
    and `answer_text` cuts before it."""
    generation_eos_ids: tuple[int, ...] = ()
    """The directory's generation_config.json `eos_token_id` (int or list), () without one."""

    def __post_init__(self) -> None:
        if self.use_chat_template and not self.tokenizer.chat_template:
            raise ValueError(f"use_chat_template=True, but {type(self.tokenizer).__name__} has no chat template")

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

    # ---- conversations ---------------------------------------------------------------------------------
    def _template_text(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  tools=tools)

    def _template_ids(self, text: str) -> list[int]:
        """Rendered template text to ids: special-token texts in it become their ids and no bos is
        added (a template that wants bos writes it), as `apply_chat_template(tokenize=True)` does."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
               ) -> list[int]:
        """The prompt ids of a conversation ([{"role": ..., "content": ...}, ...]; the system prompt
        first when configured): the chat template's rendering, with the assistant turn's opening
        when `add_generation_prompt` and the `tools` (OpenAI-style function schemas, what
        `ToolRegistry.schemas()` gives) handed to the template; without a template the plain format
        (module docstring)."""
        messages = _with_system(messages, self.system_prompt)
        if not self.use_chat_template:
            text = "".join(m["content"] for m in messages)
            return self.encode(text, add_bos=self.bos_token_id is not None)
        return self._template_ids(self._template_text(messages, add_generation_prompt, tools))

    @cached_property
    def _special_ids(self) -> frozenset[int]:
        decoder = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        return frozenset(self.tokenizer.all_special_ids) | {i for i, t in decoder.items() if t.special}

    @cached_property
    def _turn_end(self) -> tuple[str, tuple[int, ...]]:
        """(the probe conversation [system?, user, assistant] rendered up to and including the end of
        the assistant turn, the end-of-turn ids). The end-of-turn ids are the special tokens the
        template writes directly after an assistant message's content (ChatML's <|im_end|>, Llama 3's
        <|eot_id|>); () without a chat template or when the template writes none there."""
        if not self.use_chat_template:
            return "", ()
        probe = _with_system([{"role": "user", "content": _USER_SENTINEL},
                              {"role": "assistant", "content": _ASSISTANT_SENTINEL}], self.system_prompt)
        text = self._template_text(probe, add_generation_prompt=False)
        cut = text.find(_ASSISTANT_SENTINEL)
        if cut < 0:
            return "", ()
        cut += len(_ASSISTANT_SENTINEL)
        ids = []
        for i in self._template_ids(text[cut:]):
            if i not in self._special_ids:
                break
            ids.append(i)
        end_text = "".join(self.tokenizer.convert_ids_to_tokens(ids))
        if not text[cut:].startswith(end_text):  # a token whose text is not its content: claim none
            return "", ()
        return text[:cut + len(end_text)], tuple(ids)

    @property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        """The special tokens the chat template ends an assistant turn with (see `_turn_end`)."""
        return self._turn_end[1]

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end an answer, each once, in this order: eos, the generation_config.json eos ids,
        the chat template's end-of-turn ids."""
        ids = [self.eos_token_id, *self.generation_eos_ids, *self.end_of_turn_ids]
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    def continue_turn(self, text: str, role: str = "user") -> list[int]:
        """Ids appended to a conversation whose last answer ended with the template's end-of-turn
        token: a `role` message holding `text`, then the next assistant turn's opening. Without a
        chat template, `encode(text, add_bos=False)`.

        Rendered as the difference between a fixed probe conversation with and without the new
        message (verl renders tool responses the same way: BASE_CHAT_HISTORY in
        verl/workers/rollout/schemas.py); special tokens restart tokenization, so the ids continue
        the conversation exactly. Raises ValueError when the template writes no end-of-turn token or
        renders earlier turns differently once a message follows."""
        if not self.use_chat_template:
            return self.encode(text, add_bos=False)
        prefix, end_ids = self._turn_end
        if not end_ids:
            raise ValueError("the chat template writes no special token after an assistant message, so a "
                             "turn cannot be continued after the answer's stop token")
        probe = _with_system([{"role": "user", "content": _USER_SENTINEL},
                              {"role": "assistant", "content": _ASSISTANT_SENTINEL},
                              {"role": role, "content": text}], self.system_prompt)
        full = self._template_text(probe, add_generation_prompt=True)
        if not full.startswith(prefix):
            raise ValueError(f"the chat template renders the earlier turns differently once a {role!r} message "
                             f"follows, so the turn cannot be continued incrementally")
        return self._template_ids(full[len(prefix):])


# ---- loading -------------------------------------------------------------------------------------------
def _import_transformers(path: str):
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"loading the tokenizer in {path!r} needs transformers: "
                          "pip install transformers (or the project's dev extra)") from e
    return transformers


def _remote_code_reason(path: str, transformers) -> str | None:
    """Why the tokenizer in `path` needs code shipped with it, or None: tokenizer_config.json maps
    AutoTokenizer to a module of its own (`auto_map`), or names a `tokenizer_class` transformers lacks
    (checked only when the `transformers` module is given: composition does not import it)."""
    config_file = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(config_file):
        return None
    with open(config_file) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{config_file!r} is not valid JSON ({err}): expected a tokenizer config") from err
    auto_map = config.get("auto_map")
    if isinstance(auto_map, (list, tuple)) or (isinstance(auto_map, dict) and "AutoTokenizer" in auto_map):
        entry = auto_map["AutoTokenizer"] if isinstance(auto_map, dict) else auto_map
        return f"tokenizer_config.json auto_map names AutoTokenizer {entry!r}"
    name = config.get("tokenizer_class")
    if transformers is None:
        return None
    known = isinstance(name, str) and (hasattr(transformers, name) or hasattr(transformers, name.removesuffix("Fast")))
    if isinstance(name, str) and not known:
        return f"tokenizer_config.json tokenizer_class {name!r} is not in transformers"
    return None


def _generation_eos_ids(path: str) -> tuple[int, ...]:
    """generation_config.json's `eos_token_id` (an int or a list of ints) in `path`; () without one."""
    config_file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(config_file):
        return ()
    with open(config_file) as f:
        try:
            eos = json.load(f).get("eos_token_id")
        except json.JSONDecodeError as err:
            raise ValueError(f"{config_file!r} is not valid JSON ({err}): expected a generation config") from err
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{config_file!r}: eos_token_id={eos!r}, expected a token id or a list of them")
    return tuple(ids)


def load_tokenizer(config_or_name: TokenizerConfig | str) -> ByteTokenizer | HFTokenizer:
    """A TokenizerConfig (or its `path` alone) -> ByteTokenizer for "byte", else the Hugging Face
    tokenizer saved in the directory, as HFTokenizer.

    Loading never touches the network (`local_files_only=True`). transformers is only a dev
    dependency, so it is imported here, when a directory is actually loaded. A tokenizer whose code
    ships with the directory (`auto_map`) loads only with `trust_remote_code=True`.
    """
    if isinstance(config_or_name, str):
        if config_or_name != "byte" and os.path.isdir(config_or_name):
            _import_transformers(config_or_name)  # say what is missing before judging the files
        config = TokenizerConfig(path=config_or_name)
    elif isinstance(config_or_name, TokenizerConfig):
        config = config_or_name
    else:
        raise TypeError(f"load_tokenizer({config_or_name!r}), expected a TokenizerConfig or a path string")
    stop_strings = tuple(config.stop_strings)
    if config.path == "byte":
        return ByteTokenizer(system_prompt=config.system_prompt, stop_strings=stop_strings)
    path = config.path
    transformers = _import_transformers(path)
    reason = _remote_code_reason(path, transformers)
    if reason is not None and not config.trust_remote_code:
        raise ValueError(f"the tokenizer in {path!r} needs code shipped with it ({reason}); it runs only when "
                         f"asked: set tokenizer.trust_remote_code=true if you trust that directory")
    try:
        hf = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True,
                                                        trust_remote_code=config.trust_remote_code)
    except ImportError as err:
        if "tiktoken" in str(err):
            raise ImportError(f"the tokenizer in {path!r} needs tiktoken: pip install 'hybridrl[tiktoken]' "
                              f"({err})") from err
        raise
    has_template = bool(getattr(hf, "chat_template", None))
    if config.chat_template is True and not has_template:
        raise ValueError(f"tokenizer.chat_template=true, but the tokenizer in {path!r} has no chat template "
                         f"(no chat_template.jinja, no chat_template in tokenizer_config.json): expected one, "
                         f"or set tokenizer.chat_template=false (plain format) or null")
    return HFTokenizer(hf, use_chat_template=has_template if config.chat_template is None else config.chat_template,
                       system_prompt=config.system_prompt, stop_strings=stop_strings,
                       generation_eos_ids=_generation_eos_ids(path))
