"""The training corpus: the running interpreter's standard-library sources, split by file and packed into batches.

Corpus (decisions recorded in docs/DESIGN_NOTES.md, "Data, tokenizer, training"):
  * every `*.py` file under `sysconfig.get_paths()["stdlib"]`, test directories included (they are ordinary
    Python and hold ~60 % of the text);
  * skipped: anything under `site-packages` or `__pycache__`, files that are not valid UTF-8 (a few deliberately
    mis-encoded test fixtures), and files larger than `MAX_FILE_BYTES` (only the generated `pydoc_data/topics.py`).

Split: a file's split is a pure function of its POSIX path relative to the stdlib root, through SHA-256, so it
is the same on every machine and every Python patch release (file *contents* may still differ between
releases). Default fractions are train/val/test = 90/5/5. Nothing here ever reads a test file for training:
`load_split_tokens("train", ...)` only sees train files.

Packing: `PackedLoader` shuffles the documents of one epoch with a seed-derived permutation, concatenates them
with an end-of-text token after each, and cuts the stream into non-overlapping [B, S] batches. A batch is a pure
function of (seed, step), so training resumes exactly at any step.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

SPLITS = ("train", "val", "test")
DEFAULT_FRACTIONS = (0.90, 0.05, 0.05)
MAX_FILE_BYTES = 512 * 1024
_SKIP_PARTS = ("site-packages", "__pycache__")


def stdlib_root() -> Path:
    """The running interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def _check_fractions(fractions: Sequence[float]) -> tuple[float, float, float]:
    if len(fractions) != 3 or any(f < 0 for f in fractions) or abs(sum(fractions) - 1.0) > 1e-9:
        raise ValueError(f"split fractions {tuple(fractions)!r} are invalid; accepted: three non-negative "
                         f"numbers (train, val, test) summing to 1")
    return tuple(float(f) for f in fractions)  # type: ignore[return-value]


def split_of(relpath: str, fractions: Sequence[float] = DEFAULT_FRACTIONS) -> str:
    """The split ('train', 'val' or 'test') of a file, from the SHA-256 of its POSIX relative path."""
    ftr, fva, _ = _check_fractions(fractions)
    h = hashlib.sha256(relpath.encode("utf-8")).digest()
    u = int.from_bytes(h[:8], "big") / 2.0 ** 64
    if u < ftr:
        return "train"
    if u < ftr + fva:
        return "val"
    return "test"


def list_corpus_files(root: str | Path | None = None) -> list[str]:
    """Sorted POSIX paths (relative to `root`, default the stdlib) of the corpus files, after the exclusions in
    the module docstring."""
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise ValueError(f"corpus root {str(root)!r} is not a directory; accepted: an existing directory")
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root).as_posix()
        if any(part in _SKIP_PARTS for part in rel.split("/")) or not p.is_file():
            continue
        if p.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            p.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        out.append(rel)
    return sorted(out)


def split_files(split: str, root: str | Path | None = None,
                fractions: Sequence[float] = DEFAULT_FRACTIONS) -> list[str]:
    """The sorted relative paths of one split."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is invalid; accepted: {SPLITS}")
    return [r for r in list_corpus_files(root) if split_of(r, fractions) == split]


def read_document(relpath: str, root: str | Path | None = None) -> str:
    """The UTF-8 text of one corpus file."""
    root = Path(root) if root is not None else stdlib_root()
    return (root / relpath).read_bytes().decode("utf-8")


def iter_documents(split: str, root: str | Path | None = None, max_files: int | None = None,
                   fractions: Sequence[float] = DEFAULT_FRACTIONS) -> Iterator[tuple[str, str]]:
    """(relpath, text) for the files of a split, in sorted path order (the first `max_files` if given)."""
    files = split_files(split, root, fractions)
    if max_files is not None:
        if max_files < 1:
            raise ValueError(f"max_files={max_files!r} is invalid; accepted: an integer >= 1 or None")
        files = files[:max_files]
    for rel in files:
        yield rel, read_document(rel, root)


# -- tokenized splits --------------------------------------------------------------------------------------------
class TokenizedSplit:
    """The documents of one split as token ids: a flat `tokens` array (each document followed by `eos_id`) and
    `offsets` [n_docs + 1] so that document i is tokens[offsets[i]:offsets[i+1]] (its EOS included)."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, files: list[str] | None = None):
        tokens = np.asarray(tokens)
        offsets = np.asarray(offsets, dtype=np.int64)
        if tokens.ndim != 1 or offsets.ndim != 1 or len(offsets) < 2 or offsets[0] != 0 \
                or offsets[-1] != len(tokens) or np.any(np.diff(offsets) <= 0):
            raise ValueError(f"TokenizedSplit offsets are invalid (tokens {tokens.shape}, offsets "
                             f"{offsets[:4]}...{offsets[-2:]}); accepted: strictly increasing from 0 to len(tokens)")
        self.tokens, self.offsets, self.files = tokens, offsets, files

    @property
    def n_docs(self) -> int:
        """Documents (files) in the split."""
        return len(self.offsets) - 1

    def __len__(self) -> int:
        return len(self.tokens)

    def doc(self, i: int) -> np.ndarray:
        """The tokens of document i (EOS included)."""
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]

    def save(self, path: str | Path) -> None:
        """Writes `<path>.npz` (tokens, offsets) and `<path>.files.json`."""
        path = Path(path)
        np.savez(path.with_suffix(".npz"), tokens=self.tokens, offsets=self.offsets)
        path.with_suffix(".files.json").write_text(json.dumps(self.files or []))

    @classmethod
    def load(cls, path: str | Path) -> "TokenizedSplit":
        """Reads what `save` wrote."""
        path = Path(path)
        npz = path.with_suffix(".npz")
        if not npz.is_file():
            raise FileNotFoundError(f"tokenized split {str(npz)!r} does not exist; run prepare_data first")
        with np.load(npz) as z:
            tokens, offsets = z["tokens"], z["offsets"]
        fj = path.with_suffix(".files.json")
        files = json.loads(fj.read_text()) if fj.is_file() else None
        return cls(tokens, offsets, files or None)


def tokenize_split(tokenizer, split: str, root: str | Path | None = None, max_files: int | None = None,
                   fractions: Sequence[float] = DEFAULT_FRACTIONS) -> TokenizedSplit:
    """Encodes the files of a split with `tokenizer` (an `ssv_jax.tokenizer.Tokenizer`), EOS after each."""
    docs = list(iter_documents(split, root, max_files, fractions))
    if not docs:
        raise ValueError(f"split {split!r} of root {str(root or stdlib_root())!r} has no files")
    ids = tokenizer.encode_batch([t for _, t in docs])
    eos = tokenizer.eos_id
    dtype = np.uint16 if tokenizer.vocab_size <= 65535 else np.uint32
    lens = np.array([len(x) + 1 for x in ids], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lens)])
    tokens = np.empty(int(offsets[-1]), dtype=dtype)
    for i, x in enumerate(ids):
        tokens[offsets[i]:offsets[i + 1] - 1] = x
        tokens[offsets[i + 1] - 1] = eos
    return TokenizedSplit(tokens, offsets, [r for r, _ in docs])


# -- batches -----------------------------------------------------------------------------------------------------
class PackedLoader:
    """Packs documents into [batch, seq_len] int32 batches, deterministic in (seed, step).

    Epoch e concatenates all documents in the order `permutation(seed, e)` and cuts the stream into
    `steps_per_epoch` batches of batch*seq_len consecutive tokens (the tail that does not fill a batch is
    dropped; a different order next epoch drops different tokens). Sequences cross document boundaries; the EOS
    token separates documents.
    """

    def __init__(self, data: TokenizedSplit, batch: int, seq_len: int, seed: int = 0, shuffle: bool = True):
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch={batch!r} is invalid; accepted: an integer >= 1")
        if not isinstance(seq_len, int) or seq_len < 2:
            raise ValueError(f"seq_len={seq_len!r} is invalid; accepted: an integer >= 2")
        per = batch * seq_len
        if len(data) < per:
            raise ValueError(f"batch*seq_len={per} exceeds the {len(data)} tokens of the split; accepted: "
                             f"batch*seq_len <= {len(data)}")
        self.data, self.batch, self.seq_len, self.seed, self.shuffle = data, batch, seq_len, seed, shuffle
        self.steps_per_epoch = len(data) // per
        self._epoch, self._stream = -1, None

    def _epoch_stream(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(self.data.n_docs)
                self._stream = np.concatenate([self.data.doc(i) for i in order])
            else:
                self._stream = self.data.tokens
            self._epoch = epoch
        return self._stream

    def batch_at(self, step: int) -> np.ndarray:
        """The [batch, seq_len] int32 batch of global step `step` (>= 0)."""
        if step < 0:
            raise ValueError(f"step={step!r} is invalid; accepted: an integer >= 0")
        epoch, i = divmod(int(step), self.steps_per_epoch)
        per = self.batch * self.seq_len
        s = self._epoch_stream(epoch)[i * per:(i + 1) * per]
        return s.reshape(self.batch, self.seq_len).astype(np.int32)

    def __iter__(self) -> Iterator[np.ndarray]:
        step = 0
        while True:
            yield self.batch_at(step)
            step += 1


def eval_batches(data: TokenizedSplit, batch: int, seq_len: int, max_batches: int | None = None) -> list[np.ndarray]:
    """Non-overlapping [batch, seq_len] windows over the split in file order (no shuffle), the first
    `max_batches` of them (all full batches if None). The tail that does not fill a batch is dropped."""
    loader = PackedLoader(data, batch, seq_len, shuffle=False)
    n = loader.steps_per_epoch if max_batches is None else min(max_batches, loader.steps_per_epoch)
    return [loader.batch_at(i) for i in range(n)]


def evenly_spaced_windows(data: TokenizedSplit, seq_len: int, windows: int) -> tuple[list[int], int]:
    """Starts of `windows` (0 = all) evenly spaced, non-overlapping `seq_len` windows over the split's stream in
    file order (so a partial evaluation is not just the first files), and how many windows exist."""
    n_all = len(data) // seq_len
    if n_all == 0:
        raise ValueError(f"seq_len={seq_len} exceeds the split's {len(data)} tokens; accepted: a shorter one")
    if not (isinstance(windows, int) and windows >= 0):
        raise ValueError(f"windows={windows!r} is invalid; accepted: an integer >= 0 (0 = all {n_all})")
    n = n_all if windows == 0 else min(windows, n_all)
    return [int(i) * seq_len for i in np.linspace(0, n_all - 1, n).round().astype(int)], n_all


# -- one-shot preparation ----------------------------------------------------------------------------------------
def prepare_data(out_dir: str | Path, vocab_size: int = 8192, root: str | Path | None = None,
                 max_files: int | None = None, force: bool = False, show_progress: bool = True,
                 tokenizer=None) -> dict:
    """Trains the tokenizer on the train split (or takes `tokenizer`, e.g. a bundle's, to continue training a
    model) and tokenizes all three splits into `out_dir`: `tokenizer.json`, `{train,val,test}.npz` (+
    `.files.json`) and `meta.json`. Reuses an existing directory whose meta matches (same vocab, max_files and
    fractions; the root too when given; with `tokenizer`, the same tokenizer) unless `force`. Returns the meta
    dict."""
    import platform

    from ssv_jax.tokenizer import train_tokenizer

    out = Path(out_dir)
    explicit_root = root is not None
    root = Path(root) if root is not None else stdlib_root()
    if tokenizer is not None and tokenizer.vocab_size != vocab_size:
        raise ValueError(f"tokenizer vocab {tokenizer.vocab_size} != vocab_size={vocab_size}; accepted: equal")
    want = {"vocab_size": vocab_size, "root": str(root), "max_files": max_files,
            "fractions": list(DEFAULT_FRACTIONS)}
    meta_path = out / "meta.json"
    tok_path = out / "tokenizer.json"
    if meta_path.is_file() and not force:
        # A prepared directory carried to another machine is reused as it is, whatever that machine's stdlib
        # path is, unless the caller names a root explicitly.
        meta = json.loads(meta_path.read_text())
        same_tok = tokenizer is None or (tok_path.is_file() and
                                         tok_path.read_text(encoding="utf-8") == tokenizer.to_str())
        if same_tok and all(meta.get(k) == v for k, v in want.items() if k != "root" or explicit_root):
            return meta
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer if tokenizer is not None else train_tokenizer(
        [t for _, t in iter_documents("train", root, max_files)], vocab_size=vocab_size, show_progress=show_progress)
    tok.save(tok_path)
    meta = dict(want, python=platform.python_version(), splits={})
    for split in SPLITS:
        ts = tokenize_split(tok, split, root, max_files)
        ts.save(out / split)
        meta["splits"][split] = {"files": ts.n_docs, "tokens": len(ts),
                                 "bytes": sum((root / f).stat().st_size for f in ts.files)}
    meta_path.write_text(json.dumps(meta, indent=1))
    return meta


def load_prepared(data_dir: str | Path, split: str) -> TokenizedSplit:
    """One tokenized split written by `prepare_data`."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is invalid; accepted: {SPLITS}")
    return TokenizedSplit.load(Path(data_dir) / split)
