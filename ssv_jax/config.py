"""Model configuration: Llama dimensions plus the NSA parameters (DESIGN.md, "Notation").

`ModelConfig` is a frozen, hashable dataclass, so it can be a static argument of `jax.jit`. Every field is
validated on construction; a bad value raises `ValueError` naming the field and the accepted range.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass


def check_known_fields(cls, d: dict) -> None:
    """Raise `ValueError` naming the keys of `d` that are not fields of the dataclass `cls` (a `from_dict` guard)."""
    if not isinstance(d, dict):
        raise ValueError(f"{cls.__name__} fields given as a {type(d).__name__}; accepted: a dict of field values")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known, key=str)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields {unknown}; accepted: {sorted(known)}")


def is_int(value) -> bool:
    """Whether `value` is an integer (Python `int` or `np.integer`) and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_finite_real(value) -> bool:
    """Whether `value` is a finite real number (int, float, `np.integer`, `np.floating`) and not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


class _Checker:
    """Validates and normalises the fields of a frozen dataclass in its `__post_init__`: a failed check raises
    `ValueError("Cls.field=value is invalid; accepted: ...")`; NumPy scalars are stored as Python ones, so that
    the config stays hashable and JSON-able."""

    def __init__(self, obj):
        self.obj = obj

    def need(self, ok: bool, name: str, accepted: str) -> None:
        """Raise, naming field `name`, its value and `accepted`, unless `ok`."""
        if not ok:
            value = getattr(self.obj, name)
            raise ValueError(f"{type(self.obj).__name__}.{name}={value!r} is invalid; accepted: {accepted}")

    def set(self, name: str, value) -> None:
        """Store a normalised value in the frozen instance."""
        object.__setattr__(self.obj, name, value)

    def integer(self, name: str, minimum: int, accepted: str | None = None) -> int:
        """An integer field >= minimum, stored as a Python int."""
        v = getattr(self.obj, name)
        self.need(is_int(v) and v >= minimum, name, accepted or f"an integer >= {minimum}")
        self.set(name, int(v))
        return int(v)

    def positive(self, name: str) -> float:
        """A finite real field > 0, stored as a Python float."""
        v = getattr(self.obj, name)
        self.need(is_finite_real(v) and v > 0, name, "a finite number > 0")
        self.set(name, float(v))
        return float(v)


@dataclass(frozen=True)
class RopeScaling:
    """llama3-style RoPE frequency scaling (the Llama-3.1 `rope_scaling` block).

    Wavelengths above `original_max_position / low_freq_factor` are divided by `factor`, those below
    `original_max_position / high_freq_factor` are kept, and the band between is interpolated (`model.rope_inv_freq`),
    so `high_freq_factor > low_freq_factor > 0`."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self):
        c = _Checker(self)
        c.positive("factor")
        low = c.positive("low_freq_factor")
        c.need(is_finite_real(self.high_freq_factor) and self.high_freq_factor > low, "high_freq_factor",
               f"a finite number > low_freq_factor={low} (the llama3 formula divides by their difference)")
        c.set("high_freq_factor", float(self.high_freq_factor))
        c.integer("original_max_position", 1)

    @classmethod
    def from_dict(cls, d: dict) -> "RopeScaling":
        """The scaling of `dataclasses.asdict` output; raises ValueError naming unknown fields."""
        check_known_fields(cls, d)
        return cls(**d)


@dataclass(frozen=True)
class ModelConfig:
    """A Llama decoder whose attention is Native Sparse Attention.

    NSA fields (DESIGN.md notation): `cmp_len` = l, `cmp_stride` = d, `slc_block` = l', `n_slc` = n,
    `window` = w. `feature_layers` are the layers whose *inputs* feed the EAGLE-3 head (default 2, L/2, L-3).
    `max_seq_len` bounds the cache; it is rounded by the cache to a multiple of `slc_block`.
    """

    vocab_size: int = 256
    hidden: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 128
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    # NSA
    cmp_len: int = 16
    cmp_stride: int = 8
    slc_block: int = 32
    n_slc: int = 4
    window: int = 64
    compression: str = "mean"
    # EAGLE-3 feature taps; None means (2, L//2, L-3) clipped into range.
    feature_layers: tuple[int, ...] | None = None
    max_seq_len: int = 2048
    name: str = "custom"

    def __post_init__(self):
        c = _Checker(self)
        for f in ("vocab_size", "hidden", "n_layers", "n_heads", "n_kv_heads", "ffn", "cmp_len", "cmp_stride",
                  "slc_block", "window", "max_seq_len"):
            c.integer(f, 1)
        c.integer("head_dim", 16, "an integer >= 16 (Pallas-Triton dots with contraction < 16 are wrong)")
        c.integer("n_slc", 3, "an integer >= 3 (block 0, the current and the previous block are forced)")
        c.need(self.n_heads % self.n_kv_heads == 0, "n_heads", f"a multiple of n_kv_heads={self.n_kv_heads}")
        c.need(self.cmp_len >= self.cmp_stride, "cmp_len", f">= cmp_stride={self.cmp_stride}")
        c.need(self.slc_block % self.cmp_stride == 0, "slc_block", f"a multiple of cmp_stride={self.cmp_stride}")
        c.need(self.window >= self.slc_block, "window", f">= slc_block={self.slc_block}")
        c.need(isinstance(self.compression, str) and self.compression in ("mean", "mlp"), "compression",
               "'mean' or 'mlp'")
        c.positive("rope_theta")
        c.positive("norm_eps")
        c.need(isinstance(self.tie_embeddings, bool), "tie_embeddings", "True or False")
        c.need(isinstance(self.name, str), "name", "a string")
        rs = self.rope_scaling
        if isinstance(rs, dict):  # e.g. from JSON
            c.set("rope_scaling", RopeScaling.from_dict(rs))
        else:
            c.need(rs is None or isinstance(rs, RopeScaling), "rope_scaling",
                   "None, a RopeScaling or a dict of its fields")
        fl = self.feature_layers
        if fl is not None:
            # Repeated taps are allowed: the default (2, L//2, L-3), clipped, repeats layers when L < 6, and
            # published EAGLE-3 heads may name a layer twice.
            c.need(isinstance(fl, (tuple, list)) and len(fl) >= 1 and all(is_int(i) and 0 <= i < self.n_layers
                                                                          for i in fl),
                   "feature_layers", f"None or a non-empty tuple of integer layer indices in [0, {self.n_layers})")
            c.set("feature_layers", tuple(int(i) for i in fl))

    # -- derived -------------------------------------------------------------------------------------------------
    @property
    def features(self) -> tuple[int, ...]:
        """The layers whose inputs are tapped for the EAGLE-3 head."""
        if self.feature_layers is not None:
            return tuple(self.feature_layers)
        L = self.n_layers
        return tuple(min(max(i, 0), L - 1) for i in (2, L // 2, L - 3))

    @property
    def group(self) -> int:
        """G = Hq / Hkv, query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    def replace(self, **kw) -> "ModelConfig":
        """A copy with the given fields changed (validated again); unknown fields raise `ValueError`."""
        check_known_fields(type(self), kw)
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict:
        """JSON-ready fields (the bundle's `config.json` "model" entry); `from_dict` reads it back."""
        d = dataclasses.asdict(self)
        d["feature_layers"] = list(self.features)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """The config of `to_dict`'s output; raises ValueError naming unknown fields."""
        check_known_fields(cls, d)
        return cls(**d)  # __post_init__ turns a rope_scaling dict and a feature_layers list into their types

    def param_count(self) -> int:
        """Parameter count of the target model (matches `model.init_params`)."""
        H, D, L = self.hidden, self.head_dim, self.n_layers
        attn = H * (self.n_heads * D) * 2 + H * (self.n_kv_heads * D) * 2 + H * self.n_heads * 3
        if self.compression == "mlp":
            attn += 2 * self.n_kv_heads * (self.cmp_len * D * D + self.cmp_len * D)
        per_layer = attn + 3 * H * self.ffn + 2 * H
        emb = self.vocab_size * H * (1 if self.tie_embeddings else 2)
        return L * per_layer + emb + H


PRESETS: dict[str, ModelConfig] = {
    # Tests: small, with ratios that exercise compression, forced blocks, window and selection below 1K tokens.
    "tiny": ModelConfig(name="tiny"),
    # The model trained in #6: ~25M parameters, paper NSA settings.
    "small": ModelConfig(
        name="small", vocab_size=8192, hidden=512, n_layers=8, n_heads=8, n_kv_heads=2, head_dim=64, ffn=1408,
        rope_theta=10000.0, cmp_len=32, cmp_stride=16, slc_block=64, n_slc=16, window=512, max_seq_len=16384,
        tie_embeddings=True,
    ),
    # Benchmark shapes (DESIGN.md).
    "llama31-8b-nsa": ModelConfig(
        name="llama31-8b-nsa", vocab_size=128256, hidden=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
        ffn=14336, rope_theta=500000.0, rope_scaling=RopeScaling(), norm_eps=1e-5, cmp_len=32, cmp_stride=16,
        slc_block=64, n_slc=16, window=512, max_seq_len=131072 + 1024,
    ),
}


def get_config(name: str, **overrides) -> ModelConfig:
    """A preset by name (`tiny`, `small`, `llama31-8b-nsa`), with optional field overrides (unknown fields raise
    `ValueError`)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; accepted: {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
