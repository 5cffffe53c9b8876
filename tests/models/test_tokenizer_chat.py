"""TokenizerConfig, chat-template rendering, stop ids and turn continuation, on tokenizer
directories built offline (tests/tokenizer_dirs.py)."""
import pytest

from models.tokenizer import ByteTokenizer, HFTokenizer, TokenizerConfig, load_tokenizer
from tests.tokenizer_dirs import (END_OF_TEXT, EOS, IM_END, IM_START, build_bpe_tokenizer,
                                  build_remote_code_dir)

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return build_bpe_tokenizer(tmp_path_factory.mktemp("chat") / "tok", generation_eos=[EOS, END_OF_TEXT])


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    return build_bpe_tokenizer(tmp_path_factory.mktemp("plain") / "tok", chat_template=None)


def turn(tok: HFTokenizer, role: str, content: str) -> list[int]:
    """A ChatML message built piece by piece: special tokens restart tokenization, so the ids of
    the text between them are the plain encodings."""
    return [IM_START, *tok.encode(f"{role}\n{content}", add_bos=False), IM_END, *tok.encode("\n", add_bos=False)]


def test_render_applies_the_chat_template(chat_dir):
    tok = load_tokenizer(TokenizerConfig(path=str(chat_dir)))
    assert tok.use_chat_template
    ids = tok.render([{"role": "user", "content": "get the key"}])
    opening = [IM_START, *tok.encode("assistant\n", add_bos=False)]
    assert ids == turn(tok, "user", "get the key") + opening
    assert tok.tokenizer.decode(ids) == "<|im_start|>user\nget the key<|im_end|>\n<|im_start|>assistant\n"
    no_opening = tok.render([{"role": "user", "content": "get the key"}], add_generation_prompt=False)
    assert no_opening == turn(tok, "user", "get the key")


def test_system_prompt_is_put_first_once(chat_dir):
    tok = load_tokenizer(TokenizerConfig(path=str(chat_dir), system_prompt="Be brief!"))
    ids = tok.render([{"role": "user", "content": "hello world"}])
    expected = turn(tok, "system", "Be brief!") + turn(tok, "user", "hello world")
    assert ids == expected + [IM_START, *tok.encode("assistant\n", add_bos=False)]
    assert tok.tokenizer.decode(ids).startswith("<|im_start|>system\nBe brief!<|im_end|>\n<|im_start|>user\n")
    own = tok.render([{"role": "system", "content": "Be long."}, {"role": "user", "content": "hello world"}])
    assert tok.tokenizer.decode(own).count("<|im_start|>system") == 1 and "Be brief!" not in tok.tokenizer.decode(own)


def test_stop_token_ids_are_eos_generation_config_and_end_of_turn(chat_dir, plain_dir):
    tok = load_tokenizer(TokenizerConfig(path=str(chat_dir), stop_strings=["\n\n"]))
    assert tok.end_of_turn_ids == (IM_END,)
    assert tok.stop_token_ids == (EOS, END_OF_TEXT, IM_END)  # eos once, though the file names it too
    assert tok.stop_strings == ("\n\n",)
    plain = load_tokenizer(str(plain_dir))  # no template, no generation_config.json
    assert not plain.use_chat_template and plain.end_of_turn_ids == () and plain.stop_token_ids == (EOS,)
    raw = load_tokenizer(TokenizerConfig(path=str(chat_dir), chat_template=False))
    assert raw.stop_token_ids == (EOS, END_OF_TEXT)


def test_continue_turn_extends_the_conversation_exactly(chat_dir):
    """prompt + answer + end-of-turn + continue_turn(observation) == the whole conversation rendered."""
    for system_prompt in (None, "Be brief!"):
        tok = load_tokenizer(TokenizerConfig(path=str(chat_dir), system_prompt=system_prompt))
        prompt, answer, obs = "get the key", "seven", "wrong, 42 ✓"
        ids = tok.render([{"role": "user", "content": prompt}]) + tok.encode(answer, add_bos=False) + [IM_END]
        ids += tok.continue_turn(obs)
        whole = tok.render([{"role": "user", "content": prompt}, {"role": "assistant", "content": answer},
                            {"role": "user", "content": obs}])
        assert ids == whole


def test_without_a_template_render_is_the_plain_format(chat_dir, plain_dir):
    for config in (TokenizerConfig(path=str(plain_dir)), TokenizerConfig(path=str(chat_dir), chat_template=False)):
        tok = load_tokenizer(config)
        assert not tok.use_chat_template
        assert tok.render([{"role": "user", "content": "hello world"}]) == tok.encode("hello world")
        assert tok.continue_turn("the key") == tok.encode("the key", add_bos=False)
    tok = load_tokenizer(TokenizerConfig(path=str(plain_dir), system_prompt="Be brief! "))
    assert tok.render([{"role": "user", "content": "hello"}]) == tok.encode("Be brief! hello")


def test_chat_template_required_but_missing_raises(plain_dir):
    with pytest.raises(ValueError, match=r"chat_template=true.*'.*tok'.*has no chat template"):
        load_tokenizer(TokenizerConfig(path=str(plain_dir), chat_template=True))
    with pytest.raises(ValueError, match="byte tokenizer has no chat template"):
        TokenizerConfig(path="byte", chat_template=True)


def test_remote_code_needs_the_opt_in(tmp_path):
    path = build_remote_code_dir(tmp_path / "kimi_like")
    with pytest.raises(ValueError, match=r"kimi_like.*auto_map.*tokenizer\.trust_remote_code=true"):
        load_tokenizer(TokenizerConfig(path=str(path)))
    unknown = build_bpe_tokenizer(tmp_path / "unknown_class")
    config_file = unknown / "tokenizer_config.json"
    config_file.write_text(config_file.read_text().replace('"TokenizersBackend"', '"MadeUpTokenizer"'))
    with pytest.raises(ValueError, match=r"unknown_class.*'MadeUpTokenizer' is not in transformers.*trust_remote_code=true"):
        load_tokenizer(str(unknown))
    try:
        import tiktoken  # noqa: F401
    except ImportError:  # opted in: the shipped module imports tiktoken, which is absent here
        with pytest.raises(ImportError, match=r"kimi_like.*needs tiktoken.*hybridrl\[tiktoken\]"):
            load_tokenizer(TokenizerConfig(path=str(path), trust_remote_code=True))


def test_bad_paths_and_values_name_what_was_expected(tmp_path, chat_dir):
    with pytest.raises(ValueError, match=r"'.*missing' does not exist: expected \"byte\" or an existing local"):
        TokenizerConfig(path=str(tmp_path / "missing"))
    (tmp_path / "file.json").write_text("{}")
    with pytest.raises(ValueError, match=r"file\.json' is not a directory"):
        TokenizerConfig(path=str(tmp_path / "file.json"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty' holds no tokenizer files: expected one of tokenizer\.json"):
        TokenizerConfig(path=str(tmp_path / "empty"))
    bad = [({"chat_template": "yes"}, "chat_template='yes'"), ({"trust_remote_code": "no"}, "trust_remote_code='no'"),
           ({"stop_strings": "\n"}, "stop_strings='\\\\n'"), ({"stop_strings": [""]}, r"stop_strings=\[''\]"),
           ({"system_prompt": 3}, "system_prompt=3")]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            TokenizerConfig(path=str(chat_dir), **kwargs)
    tok = load_tokenizer(str(chat_dir))
    with pytest.raises(ValueError, match="expected a dict with string 'role' and 'content'"):
        tok.render([{"role": "user"}])


def test_hf_encode_decode_round_trip(chat_dir):
    tok = load_tokenizer(TokenizerConfig(path=str(chat_dir)))
    text = "get the key value: système ✓ 42 = 6 * 7, unseen words too"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids + [IM_END, EOS]) == text
    answer = tok.render([{"role": "user", "content": "q"}]) + tok.encode("seven", add_bos=False) + [IM_END]
    assert tok.decode(answer[len(tok.render([{"role": "user", "content": "q"}])):]) == "seven"


def test_answer_text_is_cut_before_the_first_stop_string(chat_dir):
    for tok in (load_tokenizer(TokenizerConfig(path=str(chat_dir), stop_strings=["</answer>", "\n\n"])),
                load_tokenizer(TokenizerConfig(path="byte", stop_strings=["</answer>", "\n\n"]))):
        ids = tok.encode("<answer>42\n\n7</answer> more", add_bos=False)
        assert tok.answer_text(ids) == "<answer>42"
        assert tok.answer_text(tok.encode("no stop here", add_bos=False)) == "no stop here"


def test_byte_tokenizer_has_the_same_methods():
    tok = load_tokenizer(TokenizerConfig(path="byte", system_prompt="sys: ", stop_strings=["\n"]))
    assert tok == ByteTokenizer(system_prompt="sys: ", stop_strings=("\n",))
    assert not tok.use_chat_template and tok.stop_token_ids == (tok.eos_token_id,) and tok.stop_strings == ("\n",)
    assert tok.render([{"role": "user", "content": "get c"}]) == tok.encode("sys: get c")
    assert tok.continue_turn("obs") == tok.encode("obs", add_bos=False)
    assert ByteTokenizer().render([{"role": "user", "content": "é"}]) == ByteTokenizer().encode("é")


TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tools_reach_the_template_and_tool_replies_render_in_the_tool_turn(tmp_path):
    tok = load_tokenizer(TokenizerConfig(path=str(build_bpe_tokenizer(tmp_path / "tok", chat_template=TOOL_TEMPLATE))))
    schemas = [{"type": "function", "function": {"name": "py", "description": "run", "parameters": {
        "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}]
    prompt = tok.render([{"role": "user", "content": "37*8="}], tools=schemas)
    assert tok.tokenizer.decode(prompt).startswith("<|im_start|>system\ntools: py<|im_end|>\n<|im_start|>user\n37*8=")
    assert "tools:" not in tok.tokenizer.decode(tok.render([{"role": "user", "content": "37*8="}]))
    reply = tok.continue_turn("=296;", role="tool")  # appended after the answer's end of turn, tokenized alone
    assert tok.tokenizer.decode(reply) == "\n<|im_start|>tool\n=296;<|im_end|>\n<|im_start|>assistant\n"
