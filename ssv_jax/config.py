"""Model configuration: Llama dimensions plus the NSA parameters (DESIGN.md, "Notation").

`ModelConfig` is a frozen, hashable dataclass, so it can be a static argument of `jax.jit`. Every field is
validated on construction; a bad value raises `ValueError` naming the field and the accepted range.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


def check_known_fields(cls, d: dict) -> None:
    """Raise `ValueError` naming the keys of `d` that are not fields of the dataclass `cls` (a `from_dict` guard)."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields {unknown}; accepted: {sorted(known)}")


@dataclass(frozen=True)
class RopeScaling:
    """llama3-style RoPE frequency scaling (the Llama-3.1 `rope_scaling` block)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


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
        def need(ok: bool, name: str, value, accepted: str):
            if not ok:
                raise ValueError(f"ModelConfig.{name}={value!r} is invalid; accepted: {accepted}")

        for f in ("vocab_size", "hidden", "n_layers", "n_heads", "n_kv_heads", "ffn", "cmp_len", "cmp_stride",
                  "slc_block", "window", "max_seq_len"):
            v = getattr(self, f)
            need(isinstance(v, int) and v >= 1, f, v, "an integer >= 1")
        need(isinstance(self.head_dim, int) and self.head_dim >= 16, "head_dim", self.head_dim,
             "an integer >= 16 (Pallas-Triton dots with contraction < 16 are wrong)")
        need(self.n_heads % self.n_kv_heads == 0, "n_heads", self.n_heads,
             f"a multiple of n_kv_heads={self.n_kv_heads}")
        need(self.cmp_len >= self.cmp_stride, "cmp_len", self.cmp_len, f">= cmp_stride={self.cmp_stride}")
        need(self.slc_block % self.cmp_stride == 0, "slc_block", self.slc_block,
             f"a multiple of cmp_stride={self.cmp_stride}")
        need(isinstance(self.n_slc, int) and self.n_slc >= 3, "n_slc", self.n_slc,
             "an integer >= 3 (block 0, the current and the previous block are forced)")
        need(self.window >= self.slc_block, "window", self.window, f">= slc_block={self.slc_block}")
        need(self.compression in ("mean", "mlp"), "compression", self.compression, "'mean' or 'mlp'")
        need(self.rope_theta > 0, "rope_theta", self.rope_theta, "> 0")
        need(self.norm_eps > 0, "norm_eps", self.norm_eps, "> 0")
        fl = self.features
        need(len(fl) >= 1 and all(0 <= i < self.n_layers for i in fl), "feature_layers", self.feature_layers,
             f"layer indices in [0, {self.n_layers})")

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
        """A copy with the given fields changed (validated again)."""
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict:
        """JSON-ready fields (the bundle's `config.json` "model" entry); `from_dict` reads it back."""
        d = dataclasses.asdict(self)
        d["feature_layers"] = list(self.features)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """The config of `to_dict`'s output; raises ValueError naming unknown fields."""
        d = dict(d)
        check_known_fields(cls, d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        if d.get("feature_layers") is not None:
            d["feature_layers"] = tuple(d["feature_layers"])
        return cls(**d)

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
    """A preset by name (`tiny`, `small`, `llama31-8b-nsa`), with optional field overrides."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; accepted: {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
