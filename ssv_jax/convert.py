"""PyTorch -> JAX checkpoint conversion (key maps and caveats: docs/CONVERSION.md).

Supported formats (detected from config.json and the key names, or forced with `fmt=`):

* `fla-nsa`   fla's `NSAForCausalLM` (mean compression with l = d = l' = block_size);
* `zen-e-nsa` zen-E/NSA-1B's `LlamaNSAForCausalLM` (HF Llama names plus `self_attn.g_proj`);
* `llama`     plain HF `LlamaForCausalLM` (dense), mapped into the NSA layout with zero gate weights;
* `eagle3`    an EAGLE-3 draft head (the published Llama-3.1-8B layout, `midlayer.*` or `layers.0.*`).

Inputs are an HF-style directory (config.json plus *.safetensors, sharded with an index or not, or
pytorch_model.bin) or a single .safetensors/.bin/.pt file (its config.json is looked for beside it, or given).
Safetensors are read with `safetensors` (numpy, no torch); .bin/.pt need torch (the `convert` extra).

The conversion is planned first: every required key, every shape and the config are checked, and an unknown
format, a missing key or a bad shape raises `ConversionError` (a ValueError) before anything is read into the
output or written. Tensors are then read file by file (one shard in memory at a time besides the output arrays,
which are preallocated in the output dtype) and the bundle is written atomically by `checkpoint.save_bundle`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Callable, NamedTuple

import jax
import ml_dtypes
import numpy as np

from ssv_jax import checkpoint as ckpt
from ssv_jax import model as M
from ssv_jax.config import ModelConfig, RopeScaling, is_finite_real, is_int

FORMATS = ("fla-nsa", "zen-e-nsa", "llama", "eagle3")
TARGET_FORMATS = FORMATS[:3]
DTYPES = ("keep", "bfloat16", "float16", "float32")
# The paper's NSA settings, used for a dense Llama (which has none of its own).
NSA_DEFAULTS = dict(cmp_len=32, cmp_stride=16, slc_block=64, n_slc=16, window=512, compression="mean")
_ARCH = {"NSAForCausalLM": "fla-nsa", "LlamaNSAForCausalLM": "zen-e-nsa", "LlamaForCausalLM": "llama",
         "LlamaForCausalLMEagle3": "eagle3", "Eagle3LlamaForCausalLM": "eagle3"}
_MODEL_TYPE = {"nsa": "fla-nsa", "llama-nsa": "zen-e-nsa"}
_SRC_DTYPES = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64,
               "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


class ConversionError(ValueError):
    """A checkpoint that cannot be converted: unknown format, missing key, bad shape or unsupported config."""


def _read_json_dict(path: Path, what: str) -> dict:
    """The JSON object in `path`; ConversionError when it is not JSON or not an object."""
    try:
        obj = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"{what} {str(path)!r} is not JSON ({e}); accepted: a JSON object") from e
    if not isinstance(obj, dict):
        raise ConversionError(f"{what} {str(path)!r} holds a JSON {type(obj).__name__}; accepted: a JSON object")
    return obj


# -- reading -------------------------------------------------------------------------------------------------------
def _torch():
    try:
        import torch
    except ImportError as e:
        raise ConversionError("reading .bin/.pt checkpoints needs torch, which is not installed; install the "
                               "'convert' extra (pip install 'ssv-jax[convert]') or convert the checkpoint to "
                               "safetensors") from e
    return torch


def _torch_load(path: Path) -> dict:
    torch = _torch()
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # legacy (non-zip) files cannot be memory-mapped
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    for wrap in ("state_dict", "model", "module"):
        if isinstance(obj, dict) and isinstance(obj.get(wrap), dict):
            obj = obj[wrap]
    if not isinstance(obj, dict):
        raise ConversionError(f"{str(path)!r} holds a {type(obj).__name__}; accepted: a state dict of tensors")
    return {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}


def _torch_to_numpy(t) -> np.ndarray:
    torch = _torch()
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


class Checkpoint:
    """A PyTorch-side checkpoint on disk: `index` maps each tensor name to (file, shape, dtype name) without
    reading tensor data; `config` is the parsed HF config.json (empty when there is none)."""

    def __init__(self, path: str | Path, config: str | Path | None = None):
        path = Path(path)
        if path.is_dir():
            self.files = self._dir_files(path)
            cfg_path = Path(config) if config else path / "config.json"
        elif path.is_file():
            if path.suffix not in (".safetensors", ".bin", ".pt", ".pth"):
                raise ConversionError(f"checkpoint file {str(path)!r} has suffix {path.suffix!r}; accepted: "
                                      f".safetensors, .bin, .pt, .pth")
            self.files = [path]
            cfg_path = Path(config) if config else path.parent / "config.json"
        else:
            raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
        self.path = path
        if config and not cfg_path.is_file():
            raise FileNotFoundError(f"config file {str(cfg_path)!r} does not exist")
        self.config = _read_json_dict(cfg_path, "config file") if cfg_path.is_file() else {}
        self.index: dict[str, tuple[Path, tuple, str]] = {}
        for f in self.files:
            for k, shape, dt in self._list(f):
                if k in self.index:
                    raise ConversionError(f"tensor {k!r} appears in both {self.index[k][0].name!r} and {f.name!r}")
                self.index[k] = (f, tuple(int(s) for s in shape), dt)

    @staticmethod
    def _dir_files(d: Path) -> list[Path]:
        for idx in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            if (d / idx).is_file():
                wm = _read_json_dict(d / idx, "shard index").get("weight_map")
                if not isinstance(wm, dict) or not wm:
                    raise ConversionError(f"{str(d / idx)!r} has no 'weight_map'; accepted: an HF shard index")
                files = [d / f for f in sorted(set(wm.values()))]
                for f in files:
                    if not f.is_file():
                        raise ConversionError(f"shard {f.name!r} named by {idx} is missing from {str(d)!r}")
                return files
        for pattern in ("*.safetensors", "pytorch_model*.bin", "*.bin", "*.pt", "*.pth"):
            files = sorted(d.glob(pattern))
            if files:
                return files
        raise ConversionError(f"directory {str(d)!r} holds no checkpoint; accepted: *.safetensors (with or without "
                              f"model.safetensors.index.json), pytorch_model.bin(.index.json), *.pt")

    @staticmethod
    def _list(f: Path):
        if f.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(f), framework="np") as h:
                return [(k, h.get_slice(k).get_shape(), h.get_slice(k).get_dtype()) for k in h.keys()]
        return [(k, tuple(t.shape), str(t.dtype).replace("torch.", "")) for k, t in _torch_load(f).items()]

    def keys(self) -> list[str]:
        """All tensor names."""
        return list(self.index)

    def read(self, keys, progress: bool = False, desc: str = "read"):
        """Yields (name, numpy array) for `keys`, one file at a time (each file opened once)."""
        by_file: dict[Path, list[str]] = {}
        for k in keys:
            by_file.setdefault(self.index[k][0], []).append(k)
        files = [f for f in self.files if f in by_file]
        it = files
        if progress:
            from tqdm.auto import tqdm
            it = tqdm(files, desc=desc, unit="file")
        for f in it:
            if f.suffix == ".safetensors":
                from safetensors import safe_open

                with safe_open(str(f), framework="np") as h:
                    for k in by_file[f]:
                        yield k, h.get_tensor(k)
            else:
                sd = _torch_load(f)
                for k in by_file[f]:
                    yield k, _torch_to_numpy(sd[k])
                del sd


# -- planning ------------------------------------------------------------------------------------------------------
class Src(NamedTuple):
    """One source tensor feeding an output parameter: torch key, layer slot (None when unstacked), expected
    torch shape, and a short description of that shape for error messages."""
    key: str
    slot: int | None
    shape: tuple
    what: str


@dataclasses.dataclass
class Entry:
    """One output parameter: name ("layers/wq"), shape, op ("T" transpose a Linear weight, "id", "int32",
    "bool") and its sources (several for a layer-stacked parameter)."""
    name: str
    shape: tuple
    op: str
    srcs: list


@dataclasses.dataclass
class Plan:
    """A validated conversion of one checkpoint into one parameter group."""
    fmt: str
    ck: Checkpoint
    cfg: object
    entries: list
    synth: dict  # name -> array made by the converter (no source key)
    missing: list  # optional keys that were absent, with the reason
    unexpected: list  # keys present but not used
    notes: list


def _cfg_get(c: dict, *names, default=KeyError):
    for n in names:
        if c.get(n) is not None:
            return c[n]
    if default is KeyError:
        raise ConversionError(f"config.json lacks {' / '.join(map(repr, names))}; it is needed to convert this "
                              f"checkpoint (pass --config PATH when the checkpoint has no config.json beside it)")
    return default


def _cfg_number(c: dict, *names, default=KeyError, integer: bool = True, where: str = "config"):
    """`_cfg_get` for a positive size or count (`integer`: an int, or a float with an integral value) or a
    positive finite float; ConversionError naming the field otherwise."""
    v = _cfg_get(c, *names, default=default)
    name = next((n for n in names if c.get(n) is not None), names[0])
    if integer:
        if is_finite_real(v) and not is_int(v) and float(v).is_integer():
            v = int(v)
        if not (is_int(v) and v >= 1):
            raise ConversionError(f"{where} {name}={v!r} is invalid; accepted: an integer >= 1")
        return int(v)
    if not (is_finite_real(v) and v > 0):
        raise ConversionError(f"{where} {name}={v!r} is invalid; accepted: a finite number > 0")
    return float(v)


def _cfg_int(c: dict, *names, default=KeyError, where: str = "config") -> int:
    """A positive integer config field (see `_cfg_number`)."""
    return _cfg_number(c, *names, default=default, integer=True, where=where)


def _cfg_float(c: dict, *names, default=KeyError, where: str = "config") -> float:
    """A positive finite float config field (see `_cfg_number`)."""
    return _cfg_number(c, *names, default=default, integer=False, where=where)


def _cfg_bool(c: dict, name: str, default: bool = False) -> bool:
    """A boolean config field; ConversionError naming it when it is not true/false."""
    v = c.get(name, default)
    if not isinstance(v, bool):
        raise ConversionError(f"config {name}={v!r} is invalid; accepted: true or false")
    return v


def detect_format(ck: Checkpoint) -> str:
    """The format of `ck` from its key names, falling back to config.json's architectures/model_type."""
    keys = set(ck.index)
    has = lambda pat: any(re.fullmatch(pat, k) for k in keys)  # noqa: E731
    if "fc.weight" in keys and (has(r"midlayer\..+") or has(r"layers\.0\.self_attn\..+")):
        return "eagle3"
    if "model.embeddings.weight" in keys and has(r"model\.layers\.\d+\.attn\.g_proj\.weight"):
        return "fla-nsa"
    if has(r"model\.layers\.\d+\.self_attn\.g_proj\.weight"):
        return "zen-e-nsa"
    if "model.embed_tokens.weight" in keys and has(r"model\.layers\.\d+\.self_attn\.q_proj\.weight"):
        return "llama"
    archs = ck.config.get("architectures") or []
    for a in archs:
        if a in _ARCH:
            return _ARCH[a]
    if ck.config.get("model_type") in _MODEL_TYPE:
        return _MODEL_TYPE[ck.config["model_type"]]
    sample = sorted(keys)[:6]
    raise ConversionError(f"unknown checkpoint format at {str(ck.path)!r} (architectures={archs}, "
                          f"model_type={ck.config.get('model_type')!r}, keys {sample}...); accepted: "
                          f"{', '.join(FORMATS)} (see docs/CONVERSION.md), or force one with --format")


def _check_sources(ck: Checkpoint, fmt: str, entries: list) -> None:
    for e in entries:
        for s in e.srcs:
            if s.key not in ck.index:
                raise ConversionError(f"checkpoint {str(ck.path)!r} (format {fmt}) lacks required key {s.key!r}")
            _, got, src_dtype = ck.index[s.key]
            if got != tuple(s.shape):
                raise ConversionError(f"key {s.key!r} has shape {list(got)}; expected {list(s.shape)} ({s.what}) "
                                      f"for format {fmt}")
            if e.op in ("T", "id") and not _is_floating(_out_dtype("keep", src_dtype)):
                raise ConversionError(f"key {s.key!r} has dtype {src_dtype}; accepted: a floating dtype (bf16, fp16, "
                                      f"fp32, fp64) for a weight")


def _is_floating(dtype) -> bool:
    return dtype == np.dtype(ml_dtypes.bfloat16) or np.issubdtype(dtype, np.floating)


def _check_fits(cfg: ModelConfig, params: dict, fmt: str) -> None:
    """`model.check_params` as a ConversionError (params may be shapes: `jax.ShapeDtypeStruct` leaves)."""
    try:
        M.check_params(cfg, params)
    except ValueError as e:
        raise ConversionError(f"the converted {fmt} weights do not fit the converted config: {e}") from e


def _leftover(ck: Checkpoint, used: set, fmt: str) -> list:
    rest = sorted(set(ck.index) - used)
    biased = [k for k in rest if k.endswith(".bias")]
    if biased:
        raise ConversionError(f"key {biased[0]!r} is a bias, which the {fmt} conversion cannot represent (our "
                              f"layers have no biases); accepted: checkpoints without attention/MLP biases")
    return rest


def _rope_scaling(c: dict):
    rs = c.get("rope_scaling")
    if not rs:
        return None
    if not isinstance(rs, dict):
        raise ConversionError(f"config rope_scaling={rs!r} is invalid; accepted: null or an object with rope_type "
                              f"(and for 'llama3': factor, low_freq_factor, high_freq_factor, "
                              f"original_max_position_embeddings)")
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ConversionError(f"rope_scaling type {kind!r} is not supported; accepted: none, 'default' or "
                              f"'llama3'")
    w = "config rope_scaling"
    need = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in need if rs.get(k) is None]
    if missing:
        raise ConversionError(f"{w} (llama3) lacks {missing}; accepted: an object with {', '.join(need)}")
    try:
        return RopeScaling(factor=_cfg_float(rs, "factor", where=w),
                           low_freq_factor=_cfg_float(rs, "low_freq_factor", where=w),
                           high_freq_factor=_cfg_float(rs, "high_freq_factor", where=w),
                           original_max_position=_cfg_int(rs, "original_max_position_embeddings", where=w))
    except ConversionError:
        raise
    except ValueError as e:
        raise ConversionError(f"config rope_scaling={rs!r} is invalid: {e}") from e


def _keys(embed: str, attn: str, attn_norm: str, mlp_norm: str) -> dict:
    lay = "model.layers.{i}."
    return dict(embed=embed, attn_norm=lay + attn_norm + ".weight", mlp_norm=lay + mlp_norm + ".weight",
                **{n: f"{lay}{attn}.{t}_proj.weight" for n, t in (("wq", "q"), ("wk", "k"), ("wv", "v"),
                                                                   ("wo", "o"), ("wg", "g"))},
                **{n: f"{lay}mlp.{t}_proj.weight" for n, t in (("w_gate", "gate"), ("w_up", "up"), ("w_down", "down"))},
                norm="model.norm.weight", lm_head="lm_head.weight")


_LLAMA_KEYS = _keys("model.embed_tokens.weight", "self_attn", "input_layernorm", "post_attention_layernorm")
_FLA_KEYS = _keys("model.embeddings.weight", "attn", "attn_norm", "mlp_norm")
TARGET_KEYS = {"fla-nsa": _FLA_KEYS, "zen-e-nsa": _LLAMA_KEYS, "llama": _LLAMA_KEYS}


def plan_target(ck: Checkpoint, fmt: str, overrides: dict | None = None, name: str | None = None) -> Plan:
    """Validates `ck` as target format `fmt` and returns the conversion plan (ModelConfig included).
    `overrides` are ModelConfig fields applied last (e.g. the NSA settings of a dense Llama, max_seq_len)."""
    if fmt not in TARGET_FORMATS:
        raise ConversionError(f"target format {fmt!r} is invalid; accepted: {', '.join(TARGET_FORMATS)}")
    c, K, notes, missing = ck.config, TARGET_KEYS[fmt], [], []
    if not c:
        raise ConversionError(f"checkpoint {str(ck.path)!r} has no config.json; accepted: an HF directory with "
                              f"config.json, or pass --config PATH")
    if K["embed"] not in ck.index:
        raise ConversionError(f"checkpoint {str(ck.path)!r} (format {fmt}) lacks required key {K['embed']!r}")
    V, H = ck.index[K["embed"]][1]
    if _cfg_get(c, "hidden_act", default="silu") not in ("silu", "swish"):
        raise ConversionError(f"hidden_act={c['hidden_act']!r} is not supported; accepted: 'silu' / 'swish'")
    L = _cfg_int(c, "num_hidden_layers")
    if fmt == "fla-nsa":
        Hq = _cfg_int(c, "num_heads")
        Hkv = _cfg_int(c, "num_kv_heads", default=Hq)
        q0 = K["wq"].format(i=0)
        if q0 not in ck.index:
            raise ConversionError(f"checkpoint {str(ck.path)!r} (format {fmt}) lacks required key {q0!r}")
        D = ck.index[q0][1][0] // Hq  # fla's NSABlock does not pass config.head_dim to the layer: trust shapes
        if c.get("head_dim") not in (None, D):
            notes.append(f"config head_dim={c['head_dim']} is not what the layers use; head_dim={D} taken from "
                         f"q_proj (fla's NSABlock does not pass head_dim to NativeSparseAttention)")
        eps, tie = _cfg_float(c, "norm_eps", default=1e-6), _cfg_bool(c, "tie_word_embeddings")
        scaling = None
        if c.get("qkv_bias"):
            raise ConversionError("config qkv_bias=True is not supported; accepted: qkv_bias=False")
    else:
        Hq = _cfg_int(c, "num_attention_heads")
        Hkv = _cfg_int(c, "num_key_value_heads", default=Hq)
        D = _cfg_int(c, "head_dim", default=H // Hq)
        eps, tie = _cfg_float(c, "rms_norm_eps", default=1e-6), _cfg_bool(c, "tie_word_embeddings")
        scaling = _rope_scaling(c)
        for b in ("attention_bias", "mlp_bias"):
            if c.get(b):
                raise ConversionError(f"config {b}=True is not supported; accepted: {b}=False")
    gate0 = K["w_gate"].format(i=0)
    if c.get("intermediate_size") is None and gate0 not in ck.index:
        raise ConversionError(f"checkpoint {str(ck.path)!r} (format {fmt}) lacks required key {gate0!r}")
    F = _cfg_int(c, "intermediate_size", default=ck.index[gate0][1][0] if gate0 in ck.index else None)
    if fmt == "llama":
        nsa = dict(NSA_DEFAULTS)
        notes.append("dense Llama: NSA settings are the paper defaults (l=32, d=16, l'=64, n=16, w=512) unless "
                     "overridden; gate weights wg are zero (every gate 0.5). The weights were trained for dense "
                     "attention: use them with a dense attention path (dense-SD baseline), not as an NSA model")
    else:
        bs = _cfg_int(c, "block_size", default=64)
        win = _cfg_get(c, "window_size", default=512 if fmt == "fla-nsa" else None)
        if not win:
            raise ConversionError(f"window_size={win!r} is not supported; accepted: an integer >= block_size "
                                  f"(the model always runs the window branch)")
        win = _cfg_int(c, "window_size", default=win)  # fla-nsa's default 512 when absent
        bc = _cfg_get(c, "block_counts", default=16)
        if not is_int(bc):
            raise ConversionError(f"block_counts={bc!r} is not supported; accepted: one integer")
        nsa = dict(cmp_len=bs, cmp_stride=bs, slc_block=bs, n_slc=int(bc), window=win, compression="mean")
        if fmt == "zen-e-nsa":
            notes.append("zen-E/NSA-1B forces only the current selection block; our routing also forces block 0 "
                         "and the previous block (DESIGN.md). Outputs match while the forced blocks would be "
                         "selected anyway (e.g. t < n*block_size); see docs/CONVERSION.md")
    fields = dict(vocab_size=V, hidden=H, n_layers=L, n_heads=Hq, n_kv_heads=Hkv, head_dim=D, ffn=F,
                  rope_theta=_cfg_float(c, "rope_theta", default=10000.0), rope_scaling=scaling, norm_eps=eps,
                  tie_embeddings=tie, max_seq_len=_cfg_int(c, "max_position_embeddings", default=2048),
                  name=name or f"{fmt}:{ck.path.name}", **nsa)
    over = dict(overrides or {})
    if fmt != "llama" and set(over) & set(NSA_DEFAULTS):
        notes.append(f"NSA settings overridden ({sorted(set(over) & set(NSA_DEFAULTS))}): the converted model no "
                     f"longer computes what the source model computes")
    fields.update(over)
    try:
        cfg = ModelConfig(**fields)
    except (TypeError, ValueError) as e:
        raise ConversionError(f"the {fmt} config does not map onto ModelConfig: {e}") from e

    def stacked(n, op, tshape, what):
        return Entry(f"layers/{n}", (L,) + (tshape[::-1] if op == "T" else tshape), op,
                     [Src(K[n].format(i=i), i, tshape, what) for i in range(L)])

    entries = [Entry("embed", (V, H), "id", [Src(K["embed"], None, (V, H), "vocab_size, hidden")]),
               Entry("norm", (H,), "id", [Src(K["norm"], None, (H,), "hidden")]),
               stacked("attn_norm", "id", (H,), "hidden"), stacked("mlp_norm", "id", (H,), "hidden"),
               stacked("wq", "T", (Hq * D, H), "num_heads*head_dim, hidden"),
               stacked("wk", "T", (Hkv * D, H), "num_kv_heads*head_dim, hidden"),
               stacked("wv", "T", (Hkv * D, H), "num_kv_heads*head_dim, hidden"),
               stacked("wo", "T", (H, Hq * D), "hidden, num_heads*head_dim"),
               stacked("w_gate", "T", (F, H), "intermediate_size, hidden"),
               stacked("w_up", "T", (F, H), "intermediate_size, hidden"),
               stacked("w_down", "T", (H, F), "hidden, intermediate_size")]
    synth = {}
    if fmt == "llama":
        synth["layers/wg"] = (L, H, Hq * 3)
    else:
        entries.append(stacked("wg", "T", (Hq * 3, H), "num_heads*3 with rows h*3+j, j=(cmp,slc,win); hidden"))
    used = {s.key for e in entries for s in e.srcs}
    if tie:
        if K["lm_head"] in ck.index:
            used.add(K["lm_head"])
            notes.append("tied embeddings: lm_head.weight is present and ignored (the embedding is used)")
        else:
            missing.append(f"{K['lm_head']} (tied embeddings: the embedding is the output projection)")
    else:
        entries.append(Entry("lm_head", (H, V), "T", [Src(K["lm_head"], None, (V, H), "vocab_size, hidden")]))
        used.add(K["lm_head"])
    _check_sources(ck, fmt, entries)
    unexpected = _leftover(ck, used, fmt)
    beyond = sorted({int(m.group(1)) for k in unexpected if (m := re.match(r"model\.layers\.(\d+)\.", k))
                     and int(m.group(1)) >= L})
    if beyond:
        raise ConversionError(f"checkpoint {str(ck.path)!r} holds weights of layer {beyond[-1]} (at least "
                              f"{beyond[-1] + 1} layers) but num_hidden_layers={L}; accepted: num_hidden_layers "
                              f"equal to the checkpoint's layer count")
    shapes = {e.name: e.shape for e in entries} | synth  # checked before any tensor is read
    _check_fits(cfg, ckpt.unflatten_params({k: jax.ShapeDtypeStruct(v, np.float32) for k, v in shapes.items()}), fmt)
    return Plan(fmt, ck, cfg, entries, synth, missing, unexpected, notes)


def plan_eagle3(ck: Checkpoint, target_cfg: ModelConfig) -> Plan:
    """Validates `ck` as an EAGLE-3 head drafting for `target_cfg` and returns the plan (DraftConfig included)."""
    from ssv_jax.draft import DraftConfig, check_compatible

    keys, c, notes, missing = set(ck.index), ck.config, [], []
    pre = "midlayer" if any(k.startswith("midlayer.") for k in keys) else "layers.0"
    if not c:
        raise ConversionError(f"EAGLE-3 checkpoint {str(ck.path)!r} has no config.json; pass --draft-config PATH")
    if f"{pre}.self_attn.q_proj.weight" not in keys:
        raise ConversionError(f"checkpoint {str(ck.path)!r} (format eagle3) lacks required key "
                              f"'midlayer.self_attn.q_proj.weight' (or 'layers.0.self_attn.q_proj.weight')")
    H = _cfg_int(c, "hidden_size")
    if _cfg_get(c, "hidden_act", default="silu") not in ("silu", "swish"):
        raise ConversionError(f"hidden_act={c['hidden_act']!r} is not supported; accepted: 'silu' / 'swish'")
    if c.get("target_hidden_size") not in (None, H):
        raise ConversionError(f"target_hidden_size={c['target_hidden_size']} differs from hidden_size={H}; "
                              f"accepted: a head whose hidden size equals the target's")
    Hq = _cfg_int(c, "num_attention_heads")
    Hkv = _cfg_int(c, "num_key_value_heads", default=Hq)
    D = _cfg_int(c, "head_dim", default=H // Hq)
    F = _cfg_int(c, "intermediate_size")
    V = _cfg_int(c, "vocab_size", default=target_cfg.vocab_size)
    Vd = _cfg_int(c, "draft_vocab_size", default=ck.index.get("lm_head.weight", (0, (V,)))[1][0])
    rs = c.get("rope_scaling") or {}
    if not isinstance(rs, dict) or rs.get("rope_type", rs.get("type")) not in (None, "default"):
        raise ConversionError(f"EAGLE-3 rope_scaling={c.get('rope_scaling')!r} is not supported; accepted: none "
                              f"(the head uses plain RoPE)")
    theta = _cfg_float(c, "rope_theta", default=10000.0)
    if "rope_theta" not in c:
        notes.append("head config has no rope_theta: RoPE base 10000 (EAGLE's default)")
    has_embed = "embed_tokens.weight" in keys
    nf = len(target_cfg.features)
    try:
        dcfg = DraftConfig.for_target(target_cfg, draft_vocab=Vd, hidden=H, n_heads=Hq, n_kv_heads=Hkv,
                                      head_dim=D, ffn=F, rope_theta=theta,
                                      norm_eps=_cfg_float(c, "rms_norm_eps", default=1e-6),
                                      target_vocab=V, has_embed=has_embed)
        check_compatible(dcfg, target_cfg)
    except ValueError as e:
        raise ConversionError(f"the EAGLE-3 head does not fit the target: {e}") from e
    p = pre + "."

    def e(name, key, op, tshape, what):
        out = tshape[::-1] if op == "T" else tshape
        return Entry(name, out, op, [Src(key, None, tshape, what)])

    entries = [e("fc", "fc.weight", "T", (H, nf * H), f"hidden, {nf}*hidden"),
               e("hidden_norm", p + "hidden_norm.weight", "id", (H,), "hidden"),
               e("input_norm", p + "input_layernorm.weight", "id", (H,), "hidden"),
               e("post_norm", p + "post_attention_layernorm.weight", "id", (H,), "hidden"),
               e("wq", p + "self_attn.q_proj.weight", "T", (Hq * D, 2 * H), "num_heads*head_dim, 2*hidden"),
               e("wk", p + "self_attn.k_proj.weight", "T", (Hkv * D, 2 * H), "num_kv_heads*head_dim, 2*hidden"),
               e("wv", p + "self_attn.v_proj.weight", "T", (Hkv * D, 2 * H), "num_kv_heads*head_dim, 2*hidden"),
               e("wo", p + "self_attn.o_proj.weight", "T", (H, Hq * D), "hidden, num_heads*head_dim"),
               e("w_gate", p + "mlp.gate_proj.weight", "T", (F, H), "intermediate_size, hidden"),
               e("w_up", p + "mlp.up_proj.weight", "T", (F, H), "intermediate_size, hidden"),
               e("w_down", p + "mlp.down_proj.weight", "T", (H, F), "hidden, intermediate_size"),
               e("norm", "norm.weight", "id", (H,), "hidden"),
               e("lm_head", "lm_head.weight", "T", (Vd, H), "draft_vocab_size, hidden")]
    synth = {}
    if "d2t" in keys or "t2d" in keys or Vd != V:
        entries += [e("d2t", "d2t", "int32", (Vd,), "draft_vocab_size"), e("t2d", "t2d", "bool", (V,), "vocab_size")]
    else:
        synth["d2t"], synth["t2d"] = np.zeros((Vd,), np.int32), np.ones((V,), bool)
        missing.append("d2t, t2d (draft vocabulary = target vocabulary: identity map)")
    if has_embed:
        entries.append(e("embed", "embed_tokens.weight", "id", (V, H), "vocab_size, hidden"))
    else:
        missing.append("embed_tokens.weight (the target's embedding is used)")
    _check_sources(ck, "eagle3", entries)
    unexpected = _leftover(ck, {s.key for x in entries for s in x.srcs}, "eagle3")
    return Plan("eagle3", ck, dcfg, entries, synth, missing, unexpected, notes)


# -- materialising ---------------------------------------------------------------------------------------------------
def _out_dtype(dtype: str, src_dtype: str):
    if dtype != "keep":
        return np.dtype(ckpt._DTYPES[dtype])
    if src_dtype.upper() in _SRC_DTYPES:  # safetensors names
        return np.dtype(_SRC_DTYPES[src_dtype.upper()])
    if src_dtype == "bfloat16":  # torch names
        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(src_dtype)
    except TypeError as e:
        raise ConversionError(f"source dtype {src_dtype!r} is not supported; accepted: bf16, fp16, fp32, fp64, "
                              f"integers, bool") from e


def materialize(plan: Plan, dtype: str = "keep", progress: bool = False) -> dict:
    """Reads the planned tensors file by file into preallocated output arrays; returns the nested params dict.
    Floating parameters get `dtype` ("keep" keeps each parameter's source dtype)."""
    if dtype not in DTYPES:
        raise ConversionError(f"dtype={dtype!r} is invalid; accepted: {', '.join(DTYPES)}")
    arrays, where, filled = {}, {}, {}
    for e in plan.entries:
        for s in e.srcs:
            where[s.key] = (e, s)
    for k, (e, s) in where.items():
        if e.name not in arrays:
            dt = {"int32": np.dtype(np.int32), "bool": np.dtype(bool)}.get(e.op)
            arrays[e.name] = np.empty(e.shape, dt or _out_dtype(dtype, plan.ck.index[k][2]))
            filled[e.name] = 0
    for k, a in plan.ck.read(list(where), progress=progress, desc=f"{plan.fmt}"):
        e, s = where[k]
        if e.op == "T":
            a = a.T
        elif e.op == "int32":
            if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
                raise ConversionError(f"key {k!r} holds values outside int32")
            a = a.astype(np.int32)
        elif e.op == "bool":
            a = a.astype(bool)
        dst = arrays[e.name] if s.slot is None else arrays[e.name][s.slot]
        dst[...] = a
        filled[e.name] += 1
    for e in plan.entries:
        if filled[e.name] != len(e.srcs):  # every source is read exactly once
            raise ConversionError(f"{e.name}: read {filled[e.name]} of {len(e.srcs)} source tensors")
    fdt = next((a.dtype for a in arrays.values() if np.issubdtype(a.dtype, np.floating)
                or a.dtype == ml_dtypes.bfloat16), np.dtype(np.float32))
    for name, v in plan.synth.items():
        arrays[name] = v if isinstance(v, np.ndarray) else np.zeros(v, fdt)
    if "d2t" in arrays:
        V, Vd = arrays["t2d"].shape[0], arrays["d2t"].shape[0]
        tgt = np.arange(Vd) + arrays["d2t"]
        if tgt.min() < 0 or tgt.max() >= V:
            raise ConversionError(f"d2t maps draft ids to target ids outside [0, {V}) (range [{tgt.min()}, "
                                  f"{tgt.max()}]); accepted: draft id + d2t[draft id] inside the target vocabulary")
    return ckpt.unflatten_params(arrays)


# -- report --------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Report:
    """What a conversion did; `str(report)` is the printed report."""
    source: str
    output: str
    dtype: str
    groups: list = dataclasses.field(default_factory=list)  # (group, Plan, params)
    notes: list = dataclasses.field(default_factory=list)

    def param_count(self, group: str | None = None) -> int:
        """Number of parameters (all arrays, buffers included) in one group or in all."""
        return sum(int(a.size) for g, _, p in self.groups if group in (None, g)
                   for a in ckpt.flatten_params(p).values())

    def __str__(self) -> str:
        lines = ["ssv-jax conversion report", f"  source: {self.source}", f"  output: {self.output}",
                 f"  dtype:  {self.dtype}"]
        for g, plan, params in self.groups:
            cfg = plan.cfg
            lines.append(f"[{g}] format {plan.fmt} from {plan.ck.path} ({len(plan.ck.files)} file(s), "
                         f"{len(plan.ck.index)} tensors)")
            lines.append("  config: " + ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg).items()))
            flat = ckpt.flatten_params(params)
            src = {e.name: e for e in plan.entries}
            lines.append(f"  {'tensor':<18}{'shape':<22}{'dtype':<10}source")
            for name in sorted(flat):
                a, e = flat[name], src.get(name)
                if e is None:
                    origin = "(made by the converter)"
                elif len(e.srcs) == 1:
                    origin = e.srcs[0].key + (" (transposed)" if e.op == "T" else "")
                else:
                    origin = (re.sub(r"\.0\.", f".{{0..{len(e.srcs) - 1}}}.", e.srcs[0].key, count=1)
                              + (" (transposed)" if e.op == "T" else ""))
                lines.append(f"  {name:<18}{str(list(a.shape)):<22}{str(a.dtype):<10}{origin}")
            n = self.param_count(g)
            nbuf = sum(int(a.size) for a in flat.values() if not np.issubdtype(a.dtype, np.inexact)
                       and a.dtype != ml_dtypes.bfloat16)
            extra = f" (ModelConfig.param_count() = {cfg.param_count():,})" if hasattr(cfg, "param_count") else ""
            extra += f" including {nbuf:,} integer/bool buffer entries" if nbuf else ""
            lines.append(f"  tensors converted: {len(flat)}; parameters: {n:,}{extra}")
            lines.append(f"  missing keys (optional): {', '.join(plan.missing) or 'none'}")
            unx = plan.unexpected
            more = f" ... and {len(unx) - 12} more" if len(unx) > 12 else ""
            lines.append(f"  unexpected keys (ignored): {', '.join(unx[:12]) or 'none'}{more}")
            lines += [f"  note: {x}" for x in plan.notes]
        lines += [f"note: {x}" for x in self.notes]
        lines.append(f"total parameters converted: {self.param_count():,}")
        return "\n".join(lines)


def _head_taps(head: Checkpoint) -> tuple | None:
    """The target layers an EAGLE-3 head's config names (`eagle_config.eagle_aux_hidden_state_layer_ids`), or
    None."""
    ec = head.config.get("eagle_config") or {}
    if not isinstance(ec, dict):
        raise ConversionError(f"eagle_config={ec!r} is invalid; accepted: an object (or none)")
    taps = ec.get("eagle_aux_hidden_state_layer_ids")
    if taps is None:
        return None
    if not (isinstance(taps, list) and all(is_int(i) and i >= 0 for i in taps)):
        raise ConversionError(f"eagle_config.eagle_aux_hidden_state_layer_ids={taps!r} is invalid; accepted: a "
                              f"list of layer indices >= 0")
    return tuple(int(i) for i in taps)


def _load_target(path: Path) -> ckpt.Bundle:
    """The target (config, params in their stored dtypes, checked against the config, tokenizer) of an existing
    bundle; its draft, if any, is not read (it is being replaced)."""
    from ssv_jax.tokenizer import Tokenizer

    try:
        meta = ckpt.read_bundle_meta(path)
        tensors = meta.get("tensors")
        if not isinstance(tensors, dict) or "target" not in tensors or "model" not in meta or "sha256" not in meta:
            raise ValueError(f"bundle {str(path)!r} is corrupt: config.json lacks 'model', 'sha256' or "
                             f"'tensors/target'")
        cfg = ModelConfig.from_dict(meta["model"])
        params = ckpt._load_group(path, tensors["target"], meta["sha256"], None, True)
        M.check_params(cfg, params)
    except ConversionError:
        raise
    except ValueError as e:
        raise ConversionError(f"--target-bundle {str(path)!r} cannot be used: {e}") from e
    tok = Tokenizer.load(path / "tokenizer.json") if (path / "tokenizer.json").is_file() else None
    return ckpt.Bundle(cfg, params, None, {} if meta.get("draft") is not None else None, tok)


# -- entry point ---------------------------------------------------------------------------------------------------
def convert_checkpoint(src: str | Path, out: str | Path, *, fmt: str = "auto", config: str | Path | None = None,
                       draft: str | Path | None = None, draft_config: str | Path | None = None,
                       target_bundle: str | Path | None = None, dtype: str = "keep", force: bool = False,
                       overrides: dict | None = None, tokenizer: str | Path | None = None, name: str | None = None,
                       progress: bool = True, log: Callable[[str], None] | None = print) -> Report:
    """Converts a PyTorch checkpoint into an ssv-jax bundle at `out` and returns the report (also passed to `log`).

    `src` is a target checkpoint (fla-nsa, zen-e-nsa, llama) or an EAGLE-3 head; a head needs its target, either
    `target_bundle` (an existing bundle whose target is copied) or a target `src` with the head as `draft`.
    `fmt` is "auto" or one of FORMATS. `dtype` is "keep" or bfloat16/float16/float32. `overrides` are ModelConfig
    fields applied to the converted target config. `tokenizer` is a tokenizer.json for `ssv_jax.tokenizer`
    (by default the source's tokenizer.json is bundled when that class can load it). Everything is validated
    before anything is written; an existing `out` is replaced only with `force`.
    """
    from ssv_jax.tokenizer import Tokenizer

    out = Path(out)
    if out.exists() and not force:
        raise FileExistsError(f"output {str(out)!r} exists; pass force=True (--force) to replace it")
    if fmt != "auto" and fmt not in FORMATS:
        raise ConversionError(f"format {fmt!r} is unknown; accepted: auto, {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise ConversionError(f"dtype={dtype!r} is invalid; accepted: {', '.join(DTYPES)}")
    main = Checkpoint(src, config)
    fmt = detect_format(main) if fmt == "auto" else fmt
    report = Report(str(src), str(out), dtype)
    tok, base = None, None
    if fmt == "eagle3":
        if draft is not None:
            raise ConversionError("the main checkpoint is an EAGLE-3 head, so --draft has nothing to attach to; "
                                  "pass the target checkpoint as the source and the head as --draft")
        if target_bundle is None:
            raise ConversionError("an EAGLE-3 head needs its target: pass --target-bundle BUNDLE (an existing "
                                  "ssv-jax bundle) or convert the target with the head given as --draft")
        base = _load_target(Path(target_bundle))
        tcfg, head = base.cfg, main
        if overrides:
            raise ConversionError("--set overrides apply to a converted target; with --target-bundle the target "
                                  "config is taken as it is")
        tplan = None
    else:
        if target_bundle is not None:
            raise ConversionError(f"--target-bundle is for an EAGLE-3 head source; the source is {fmt}")
        head = Checkpoint(draft, draft_config) if draft is not None else None
        taps = _head_taps(head) if head is not None else None
        if taps and "feature_layers" not in (overrides or {}):  # vLLM/AngelSlim heads name the tapped layers
            overrides = {**(overrides or {}), "feature_layers": taps}
        tplan = plan_target(main, fmt, overrides, name)
        tcfg = tplan.cfg
    dplan = None
    if head is not None:
        hfmt = detect_format(head) if head is not main else "eagle3"
        if hfmt != "eagle3":
            raise ConversionError(f"the draft checkpoint {str(head.path)!r} is {hfmt}; accepted: eagle3")
        dplan = plan_eagle3(head, tcfg)
    if tokenizer is not None:
        try:
            tok = Tokenizer.load(tokenizer)
        except FileNotFoundError:
            raise
        except Exception as e:  # tokenizers raises its own exception types for foreign JSON
            raise ConversionError(f"--tokenizer {str(tokenizer)!r} cannot be loaded by ssv_jax.tokenizer ({e}); "
                                  f"accepted: a tokenizer.json written by ssv_jax.tokenizer") from e
    elif tplan is not None:
        tj = (main.path if main.path.is_dir() else main.path.parent) / "tokenizer.json"
        if tj.is_file():
            try:
                tok = Tokenizer.load(tj)
            except Exception as e:  # e.g. a Llama-3 tokenizer without <|endoftext|>
                report.notes.append(f"{tj} not bundled: ssv_jax.tokenizer cannot load it ({e})")
    elif base is not None:
        tok = base.tokenizer
    # -- everything is validated: read and write ---------------------------------------------------------------
    if tplan is not None:
        tparams = materialize(tplan, dtype, progress)
        report.groups.append(("target", tplan, tparams))
    else:
        tparams = base.params
        report.notes.append(f"target copied from bundle {str(target_bundle)!r}"
                            + ("; its previous draft head is replaced" if base.draft_params is not None else ""))
    dparams = None
    if dplan is not None:
        dparams = materialize(dplan, dtype, progress)
        report.groups.append(("draft", dplan, dparams))
    if dplan is not None:  # a planned target's shapes were checked before any tensor was read
        try:
            ckpt.check_draft(dplan.cfg, tcfg, dparams)
        except ValueError as e:
            raise ConversionError(f"the converted EAGLE-3 head does not fit the target: {e}") from e
    meta = {"converted_from": {"source": str(src), "format": fmt, "draft": None if dplan is None else
                               str(dplan.ck.path)},
            "notes": [n for _, p, _ in report.groups for n in p.notes] + report.notes}
    ckpt.save_bundle(out, tcfg, tparams, draft_cfg=None if dplan is None else dplan.cfg, draft_params=dparams,
                     tokenizer=tok, dtype=None if dtype == "keep" else dtype, force=force, extra_meta=meta)
    if log is not None:
        log(str(report))
    return report


# -- command line (scripts/convert_torch_checkpoint.py, console entry point ssv-convert) ----------------------------
_EPILOG = """examples:
  # an fla NSAForCausalLM directory -> a bundle in bf16
  convert_torch_checkpoint.py path/to/fla-nsa out/nsa --dtype bfloat16
  # a dense Llama target plus its EAGLE-3 head in one bundle (dense-SD baseline weights)
  convert_torch_checkpoint.py path/to/Llama-3.1-8B out/llama --draft path/to/EAGLE3-LLaMA3.1-Instruct-8B
  # an EAGLE-3 head attached to an already converted target
  convert_torch_checkpoint.py path/to/eagle3-head out/nsa-with-head --target-bundle out/nsa

formats: fla-nsa (fla NSAForCausalLM), zen-e-nsa (zen-E/NSA-1B LlamaNSAForCausalLM), llama (HF LlamaForCausalLM,
dense), eagle3 (EAGLE-3 head, midlayer.* or layers.0.*). Key maps and caveats: docs/CONVERSION.md.
exit status: 0 on success, 2 for an unknown format, a missing key, a bad shape or an existing output."""
_FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(ModelConfig)}


def _parse_set(items: list[str]) -> dict:
    """`field=value` pairs -> ModelConfig overrides with the field's type."""
    out = {}
    settable = sorted(k for k, t in _FIELD_TYPES.items() if t in ("int", "float", "str", "bool"))
    for item in items:
        key, sep, val = item.partition("=")
        if not sep or key not in settable:
            raise ConversionError(f"--set {item!r} is invalid; accepted: FIELD=VALUE with FIELD one of {settable}")
        t = _FIELD_TYPES[key]
        try:
            if t == "int":
                out[key] = int(val)
            elif t == "float":
                out[key] = float(val)
            elif t == "bool":
                if val.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(val)
                out[key] = val.lower() in ("true", "1")
            else:
                out[key] = val
        except ValueError as e:
            raise ConversionError(f"--set {item!r}: {val!r} is not a valid {t}") from e
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = argparse.ArgumentParser(
        prog="convert_torch_checkpoint",
        description="Convert a PyTorch checkpoint into an ssv-jax bundle (config.json + safetensors shards). "
                    "Everything is validated before anything is written; the write is atomic.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="HF directory (config.json + *.safetensors [with index] or pytorch_model.bin), "
                                  "or one .safetensors/.bin/.pt file")
    p.add_argument("output", help="bundle directory to write")
    p.add_argument("--format", default="auto", choices=("auto",) + FORMATS,
                   help="source format (default: detected from config.json and key names)")
    p.add_argument("--config", help="config.json of the source, when it is not beside the checkpoint")
    p.add_argument("--draft", help="an EAGLE-3 head to bundle with the target source")
    p.add_argument("--draft-config", help="config.json of the --draft head, when it is not beside it")
    p.add_argument("--target-bundle", help="when the source is an EAGLE-3 head: the existing bundle whose target "
                                           "it drafts for (copied into the output)")
    p.add_argument("--dtype", default="keep", choices=DTYPES,
                   help="storage dtype of floating tensors (default: keep the source dtype)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a ModelConfig field of the converted target, e.g. --set max_seq_len=32768; "
                        "for a dense Llama this sets the NSA settings (cmp_len, cmp_stride, slc_block, n_slc, "
                        "window). Repeatable")
    p.add_argument("--tokenizer", help="tokenizer.json (ssv_jax.tokenizer format) to bundle")
    p.add_argument("--name", help="model name stored in the config (default: FORMAT:DIRNAME)")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs the converter; returns the exit status (2 for a bad checkpoint or arguments)."""
    args = build_parser().parse_args(argv)
    try:
        convert_checkpoint(args.source, args.output, fmt=args.format, config=args.config, draft=args.draft,
                           draft_config=args.draft_config, target_bundle=args.target_bundle, dtype=args.dtype,
                           force=args.force, overrides=_parse_set(args.set), tokenizer=args.tokenizer,
                           name=args.name, progress=not args.no_progress)
    except (ConversionError, FileExistsError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
