import builtins

import pytest

from models.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer


def test_byte_tokenizer_round_trips_utf8_and_drops_specials():
    tok = ByteTokenizer()
    text = "get c:[c]=7; é✓"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and all(0 <= i < 256 for i in ids[1:])
    assert tok.decode(ids + [tok.eos_token_id, tok.pad_token_id]) == text
    assert tok.encode(text, add_bos=False) == ids[1:]
    assert tok.vocab_size == 259


def test_load_byte():
    assert load_tokenizer("byte") == ByteTokenizer()


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    """A WordLevel tokenizer over a handful of words, built and saved entirely offline."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = ["<s>", "</s>", "<pad>", "<unk>", "get", "the", "key", "value", "is", "seven"]
    model = tokenizers.models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>")
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>",
                                                eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    path = tmp_path_factory.mktemp("tiny_tokenizer")
    fast.save_pretrained(path)
    return path


def test_load_directory_round_trips_and_reports_special_ids(tiny_hf_dir):
    tok = load_tokenizer(str(tiny_hf_dir))
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert tok.vocab_size == 10
    text = "get the key value is seven"
    ids = tok.encode(text)
    assert ids == [0, 4, 5, 6, 7, 8, 9]  # bos, then one id per word, no template tokens
    assert tok.encode(text, add_bos=False) == ids[1:]
    assert tok.decode(ids + [tok.eos_token_id, tok.pad_token_id]) == text


def test_missing_path_raises_with_the_path(tmp_path):
    missing = str(tmp_path / "no_such_tokenizer")
    expected = "no_such_tokenizer.*expected \"byte\" or an existing local directory"
    with pytest.raises(ValueError, match=expected):
        load_tokenizer(missing)
    with pytest.raises(ValueError, match="'gpt2'"):
        load_tokenizer("gpt2")  # a hub name is not loaded: local files only


def test_directory_without_transformers_says_to_install_it(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_transformers(name, *args, **kwargs):
        if name == "transformers":
            raise ImportError("No module named 'transformers'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_transformers)
    with pytest.raises(ImportError, match="install transformers"):
        load_tokenizer(str(tmp_path))
