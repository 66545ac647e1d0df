"""The stdlib corpus: deterministic, disjoint file splits and the packing loader."""

import numpy as np
import pytest

from ssv_jax import data


def test_split_is_deterministic_and_by_path():
    files = data.list_corpus_files()
    assert len(files) > 500  # the stdlib has well over a thousand .py files
    assert files == sorted(files) == data.list_corpus_files()
    splits = [data.split_of(f) for f in files]
    assert splits == [data.split_of(f) for f in files]
    # A known path always lands in the same split on every machine (sha256 of the path).
    assert data.split_of("os.py") == data.split_of("os.py")
    counts = {s: splits.count(s) for s in data.SPLITS}
    n = len(files)
    assert 0.85 * n < counts["train"] < 0.95 * n
    assert counts["val"] > 0.02 * n and counts["test"] > 0.02 * n


def test_splits_are_disjoint_and_cover_the_corpus():
    tr, va, te = (set(data.split_files(s)) for s in data.SPLITS)
    assert not (tr & va) and not (tr & te) and not (va & te)
    assert tr | va | te == set(data.list_corpus_files())


def test_exclusions():
    files = data.list_corpus_files()
    assert not any("site-packages" in f or "__pycache__" in f for f in files)
    assert "pydoc_data/topics.py" not in files  # > MAX_FILE_BYTES
    assert all(f.endswith(".py") for f in files)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="split"):
        data.split_files("dev")
    with pytest.raises(ValueError, match="fractions"):
        data.split_of("os.py", (0.5, 0.5, 0.5))


class _CharTok:
    """A stand-in tokenizer: one id per byte, EOS = 0."""
    eos_id = 0
    vocab_size = 257

    def encode_batch(self, texts):
        return [[b + 1 for b in t.encode()] for t in texts]


def _toy_split():
    docs = [np.arange(1, n + 1) for n in (5, 9, 3, 14, 7)]
    toks, offs = [], [0]
    for d in docs:
        toks.extend(list(d) + [0])
        offs.append(offs[-1] + len(d) + 1)
    return data.TokenizedSplit(np.array(toks, np.uint16), np.array(offs))


def test_tokenize_split_appends_eos_per_document():
    ts = data.tokenize_split(_CharTok(), "val", max_files=3)
    assert ts.n_docs == 3 and len(ts.files) == 3
    for i in range(3):
        d = ts.doc(i)
        assert d[-1] == 0 and 0 not in d[:-1]
        text = data.read_document(ts.files[i])
        assert bytes(int(x) - 1 for x in d[:-1]).decode() == text


def test_packed_loader_covers_the_stream_and_is_deterministic():
    ts = _toy_split()  # 43 tokens
    ld = data.PackedLoader(ts, batch=2, seq_len=5, seed=3)
    assert ld.steps_per_epoch == 4
    b0 = ld.batch_at(0)
    assert b0.shape == (2, 5) and b0.dtype == np.int32
    # Same (seed, step) -> same batch, also from a fresh loader and out of order.
    ld2 = data.PackedLoader(ts, batch=2, seq_len=5, seed=3)
    assert np.array_equal(ld2.batch_at(5), ld.batch_at(5)) and np.array_equal(ld2.batch_at(0), b0)
    # One epoch is the concatenation of the permuted documents, cut into consecutive windows.
    order = np.random.default_rng([3, 0]).permutation(ts.n_docs)
    stream = np.concatenate([ts.doc(i) for i in order])
    got = np.concatenate([ld.batch_at(i).reshape(-1) for i in range(4)])
    assert np.array_equal(got, stream[:40])
    # Another epoch uses another order; another seed gives other batches.
    assert not np.array_equal(ld.batch_at(4), b0) or not np.array_equal(ld.batch_at(5), ld.batch_at(1))
    assert not all(np.array_equal(data.PackedLoader(ts, 2, 5, seed=4).batch_at(i), ld.batch_at(i)) for i in range(4))


def test_eval_batches_are_in_file_order():
    ts = _toy_split()
    ev = data.eval_batches(ts, batch=1, seq_len=8)
    assert len(ev) == 5
    assert np.array_equal(np.concatenate([b.reshape(-1) for b in ev]), ts.tokens[:40].astype(np.int32))
    with pytest.raises(ValueError, match="batch\\*seq_len"):
        data.PackedLoader(ts, batch=4, seq_len=16)
