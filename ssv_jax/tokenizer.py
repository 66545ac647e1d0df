"""Byte-level BPE tokenizer (HF `tokenizers`) for the stdlib corpus.

Byte-level with no normaliser, so `decode(encode(s)) == s` for every string. Special tokens come first:
id 0 is `<|endoftext|>` (the document separator and EOS), id 1 is `<|pad|>`. The whole tokenizer is one JSON
string (`to_str` / `from_str`), stored as `tokenizer.json` inside a checkpoint bundle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN)
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)


class Tokenizer:
    """A thin wrapper over an HF `tokenizers.Tokenizer` with the ids this project relies on."""

    def __init__(self, hf: _HFTokenizer):
        self.hf = hf
        eos = hf.token_to_id(EOS_TOKEN)
        if eos is None:
            raise ValueError(f"tokenizer has no {EOS_TOKEN!r} token; accepted: one built by train_tokenizer")
        self.eos_id = int(eos)
        pad = hf.token_to_id(PAD_TOKEN)
        self.pad_id = int(pad) if pad is not None else self.eos_id

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no EOS appended)."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of several texts, encoded in parallel."""
        return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; special tokens are kept as text unless `skip_special_tokens`."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are out of range; accepted: [0, {self.vocab_size})")
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def to_str(self) -> str:
        """The tokenizer as a JSON string."""
        return self.hf.to_str()

    @classmethod
    def from_str(cls, s: str) -> "Tokenizer":
        """Inverse of `to_str`."""
        return cls(_HFTokenizer.from_str(s))

    def save(self, path: str | Path) -> None:
        """Writes the tokenizer JSON to `path`."""
        Path(path).write_text(self.to_str(), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> "Tokenizer":
        """Reads a tokenizer JSON written by `save`."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist")
        return cls.from_str(path.read_text(encoding="utf-8"))


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2,
                    show_progress: bool = True) -> Tokenizer:
    """Trains a byte-level BPE of `vocab_size` ids (specials included) on `texts`."""
    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size={vocab_size!r} is invalid; accepted: an integer >= {MIN_VOCAB} "
                         f"(256 byte symbols + {len(SPECIAL_TOKENS)} special tokens)")
    if not isinstance(min_frequency, int) or min_frequency < 1:
        raise ValueError(f"min_frequency={min_frequency!r} is invalid; accepted: an integer >= 1")
    hf = _HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS), show_progress=show_progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(hf)
