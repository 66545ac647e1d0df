"""Byte-level BPE: training on the train split, exact round trips on held-out text, save/load."""

import pytest

from ssv_jax import data
from ssv_jax.tokenizer import EOS_TOKEN, Tokenizer, train_tokenizer


@pytest.fixture(scope="module")
def tok():
    texts = [t for _, t in data.iter_documents("train", max_files=60)]
    return train_tokenizer(texts, vocab_size=1024, show_progress=False)


def test_vocab_and_specials(tok):
    assert tok.vocab_size == 1024
    assert tok.eos_id == 0 and tok.hf.id_to_token(0) == EOS_TOKEN
    assert tok.pad_id == 1


def test_round_trip_on_held_out_files(tok):
    n_chars = n_tokens = 0
    for _, text in data.iter_documents("test", max_files=10):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        n_chars += len(text)
        n_tokens += len(ids)
    assert n_tokens < n_chars / 2  # BPE merges actually compress code


def test_round_trip_unicode_and_whitespace(tok):
    s = "def f(x):\n\t\treturn 'héllo ☃ \\u00e9'  \r\n\n    # 中文\x00\x7f"
    assert tok.decode(tok.encode(s)) == s
    assert tok.decode(tok.encode(s) + [tok.eos_id]) == s + EOS_TOKEN
    assert tok.decode(tok.encode(s) + [tok.eos_id], skip_special_tokens=True) == s


def test_save_load_and_str(tok, tmp_path):
    tok.save(tmp_path / "t.json")
    t2 = Tokenizer.load(tmp_path / "t.json")
    t3 = Tokenizer.from_str(tok.to_str())
    s = "import os\nprint(os.getcwd())\n"
    assert t2.encode(s) == t3.encode(s) == tok.encode(s)
    assert tok.encode_batch([s, s[:5]]) == [tok.encode(s), tok.encode(s[:5])]


def test_bad_values_raise(tok):
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["abc"], vocab_size=100)
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([5000])
    with pytest.raises(FileNotFoundError):
        Tokenizer.load("/nonexistent/tokenizer.json")
