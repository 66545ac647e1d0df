"""Checkpoint I/O.

Two formats, for two jobs (reasons in docs/DESIGN_NOTES.md, "Data, tokenizer, training"):

* **Bundles** (`save_bundle` / `load_bundle`): the shipped model. A directory holding `config.json` (the
  ModelConfig, the optional DraftConfig, a tensor index and a SHA-256 per shard), `tokenizer.json`, and the
  weights as safetensors shards of at most `SHARD_BYTES` each (`target-0000N.safetensors`,
  `draft-0000N.safetensors`). Nested parameter dicts are flattened with "/" separators. Floating arrays can be
  stored in bf16; integer arrays are stored as they are. Writes are atomic: a sibling temp directory is filled,
  then renamed into place.
* **Training state** (`TrainCheckpointer`): fp32 master weights, optimizer state and the step, through orbax's
  `CheckpointManager`, so that a training run resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

from ssv_jax import model as M
from ssv_jax.config import ModelConfig

FORMAT = "ssv-bundle"
VERSION = 1
SHARD_BYTES = 15 * 2 ** 20  # each file stays under the 16 MiB the device transfer allows
_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


class Bundle(NamedTuple):
    """What `load_bundle` returns. `draft_cfg`, `draft_params` and `tokenizer` are None when absent."""

    cfg: ModelConfig
    params: dict
    draft_cfg: Any
    draft_params: dict | None
    tokenizer: Any


# -- pytree <-> flat dict ------------------------------------------------------------------------------------------
def flatten_params(tree: dict, prefix: str = "") -> dict[str, Any]:
    """Nested dict of arrays -> {"a/b/c": array}. Only dicts with string keys are accepted as containers."""
    if not isinstance(tree, dict):
        raise ValueError(f"parameters at {prefix or '<root>'!r} are a {type(tree).__name__}; accepted: nested "
                         f"dicts of arrays")
    out = {}
    for k, v in tree.items():
        if not isinstance(k, str) or "/" in k or not k:
            raise ValueError(f"parameter key {k!r} under {prefix or '<root>'!r} is invalid; accepted: a non-empty "
                             f"string without '/'")
        name = f"{prefix}/{k}" if prefix else k
        if isinstance(v, dict):
            out.update(flatten_params(v, name))
        elif hasattr(v, "shape") and hasattr(v, "dtype"):
            out[name] = v
        else:
            raise ValueError(f"parameter {name!r} is a {type(v).__name__}; accepted: an array or a dict")
    return out


def unflatten_params(flat: dict[str, Any]) -> dict:
    """Inverse of `flatten_params`."""
    tree: dict = {}
    for name, v in flat.items():
        node = tree
        *parents, leaf = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return tree


def _storage_dtype(name: str | None):
    if name is None:
        return None
    if name not in _DTYPES:
        raise ValueError(f"dtype={name!r} is invalid; accepted: {sorted(_DTYPES)} or None (keep)")
    return _DTYPES[name]


def _dtype_name(dtype) -> str | None:
    if dtype is None:
        return None
    d = np.dtype(dtype)
    for k, v in _DTYPES.items():
        if np.dtype(v) == d:
            return k
    raise ValueError(f"dtype={dtype!r} is invalid; accepted: bfloat16, float16, float32 or None (keep)")


def _to_numpy(x, store) -> np.ndarray:
    a = np.asarray(jax.device_get(x))
    if store is not None and jnp.issubdtype(a.dtype, jnp.floating):  # jnp's test knows bfloat16
        a = a.astype(store)
    return np.ascontiguousarray(a)


def _write_shards(d: Path, stem: str, flat: dict[str, np.ndarray]) -> tuple[list[str], dict]:
    """Writes `flat` as shards of <= SHARD_BYTES (one oversize tensor gets its own shard)."""
    shards, cur, cur_bytes, index = [], {}, 0, {}

    def flush():
        nonlocal cur, cur_bytes
        if cur:
            fname = f"{stem}-{len(shards):05d}.safetensors"
            save_file(cur, str(d / fname))
            shards.append(fname)
            cur, cur_bytes = {}, 0

    for name in sorted(flat):
        a = flat[name]
        if cur and cur_bytes + a.nbytes > SHARD_BYTES:
            flush()
        cur[name] = a
        cur_bytes += a.nbytes
        index[name] = {"shard": len(shards), "shape": list(a.shape), "dtype": str(a.dtype)}
    flush()
    for v in index.values():
        v["shard"] = shards[v["shard"]]
    return shards, index


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _cfg_dict(cfg) -> dict:
    if hasattr(cfg, "to_dict"):
        return cfg.to_dict()
    if dataclasses.is_dataclass(cfg):
        return dataclasses.asdict(cfg)
    raise ValueError(f"config of type {type(cfg).__name__} cannot be serialised; accepted: a dataclass or an "
                     f"object with to_dict()")


def check_draft(draft_cfg, cfg: ModelConfig, draft_params) -> None:
    """Raise `ValueError` unless `draft_cfg` is a `DraftConfig` that can draft for `cfg` (`draft.check_compatible`)
    and `draft_params` has the keys, shapes and dtype kinds of `draft.init_draft_params(draft_cfg, ...)`."""
    from ssv_jax.draft import DraftConfig, check_compatible, init_draft_params

    if not isinstance(draft_cfg, DraftConfig):
        raise ValueError(f"draft_cfg is a {type(draft_cfg).__name__}; accepted: ssv_jax.draft.DraftConfig")
    check_compatible(draft_cfg, cfg)
    want = flatten_params(jax.eval_shape(lambda: init_draft_params(draft_cfg, jax.random.key(0))))
    got = flatten_params(draft_params)
    missing, unexpected = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or unexpected:
        problem = " and ".join(([f"lack keys {missing}"] if missing else [])
                               + ([f"have unexpected keys {unexpected}"] if unexpected else []))
        raise ValueError(f"draft params {problem}; accepted: exactly the keys {sorted(want)} for this DraftConfig "
                         f"(has_embed={draft_cfg.has_embed})")
    for name, w in want.items():
        a = got[name]
        if tuple(a.shape) != tuple(w.shape):
            raise ValueError(f"draft params[{name!r}] has shape {tuple(a.shape)}; accepted: {tuple(w.shape)} for "
                             f"this DraftConfig")
        floating = jnp.issubdtype(w.dtype, jnp.floating)
        if not (jnp.issubdtype(a.dtype, jnp.floating) if floating else np.dtype(a.dtype) == w.dtype):
            raise ValueError(f"draft params[{name!r}] has dtype {np.dtype(a.dtype).name}; accepted: "
                             f"{'a floating dtype' if floating else w.dtype.name}")


def save_bundle(path: str | Path, cfg: ModelConfig, params: dict, *, draft_cfg=None, draft_params: dict | None = None,
                tokenizer=None, dtype=None, force: bool = False, extra_meta: dict | None = None) -> Path:
    """Writes a bundle directory at `path` (atomically) and returns it.

    `params` must match `cfg` (`model.check_params`: the `init_params` layout) and a draft head must fit the target
    (`check_draft`); a mismatch raises `ValueError` before anything is written.
    `dtype` ("bfloat16", "float16", "float32", a numpy/jnp dtype, or None to keep) is applied to floating arrays.
    `tokenizer` is an `ssv_jax.tokenizer.Tokenizer` (or anything with `to_str()`). An existing `path` is replaced
    only when `force` (a bool). `extra_meta` (JSON-able) is stored under "meta" in config.json.
    """
    path = Path(path)
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg is a {type(cfg).__name__}; accepted: ssv_jax.config.ModelConfig")
    if not isinstance(force, bool):
        raise ValueError(f"force={force!r} is invalid; accepted: True or False")
    if tokenizer is not None and not callable(getattr(tokenizer, "to_str", None)):
        raise ValueError(f"tokenizer={tokenizer!r} is invalid; accepted: None or an ssv_jax.tokenizer.Tokenizer "
                         f"(an object with a to_str() method)")
    if (draft_cfg is None) != (draft_params is None):
        raise ValueError("draft_cfg and draft_params must be given together; got "
                         f"draft_cfg={'set' if draft_cfg is not None else None}, "
                         f"draft_params={'set' if draft_params is not None else None}")
    M.check_params(cfg, params)
    if draft_cfg is not None:
        check_draft(draft_cfg, cfg, draft_params)
    if path.exists() and not force:
        raise FileExistsError(f"bundle path {str(path)!r} exists; pass force=True to replace it")
    dname = dtype if isinstance(dtype, str) or dtype is None else _dtype_name(dtype)
    store = _storage_dtype(dname)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        meta: dict[str, Any] = {"format": FORMAT, "version": VERSION, "dtype": dname, "model": cfg.to_dict(),
                                "draft": None, "tensors": {}, "sha256": {}, "meta": extra_meta or {}}
        groups = [("target", params)] + ([("draft", draft_params)] if draft_params is not None else [])
        for stem, tree in groups:
            flat = {k: _to_numpy(v, store) for k, v in flatten_params(tree).items()}
            shards, index = _write_shards(tmp, stem, flat)
            meta["tensors"][stem] = index
            for s in shards:
                meta["sha256"][s] = _sha256(tmp / s)
        if draft_cfg is not None:
            meta["draft"] = _cfg_dict(draft_cfg)
        if tokenizer is not None:
            (tmp / "tokenizer.json").write_text(tokenizer.to_str(), encoding="utf-8")
        (tmp / "config.json").write_text(json.dumps(meta, indent=1))
        if path.exists():
            old = path.parent / f".{path.name}.old-{os.getpid()}"
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old)
        else:
            tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _load_group(path: Path, index: dict, sha: dict, dtype, verify: bool) -> dict:
    by_shard: dict[str, list[str]] = {}
    for name, info in index.items():
        by_shard.setdefault(info["shard"], []).append(name)
    flat = {}
    for shard, names in sorted(by_shard.items()):
        f = path / shard
        if not f.is_file():
            raise ValueError(f"bundle {str(path)!r} is corrupt: shard {shard!r} is missing")
        if verify and sha.get(shard) and _sha256(f) != sha[shard]:
            raise ValueError(f"bundle {str(path)!r} is corrupt: shard {shard!r} fails its SHA-256 check")
        try:
            data = load_file(str(f))
        except Exception as e:  # safetensors raises its own error types
            raise ValueError(f"bundle {str(path)!r} is corrupt: shard {shard!r} cannot be read ({e})") from e
        for name in names:
            if name not in data:
                raise ValueError(f"bundle {str(path)!r} is corrupt: tensor {name!r} is missing from {shard!r}")
            a = data[name]
            if list(a.shape) != index[name]["shape"]:
                raise ValueError(f"bundle {str(path)!r} is corrupt: tensor {name!r} has shape {list(a.shape)}, "
                                 f"the index says {index[name]['shape']}")
            x = jnp.asarray(a)
            if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating):
                x = x.astype(dtype)
            flat[name] = x
    return unflatten_params(flat)


def read_bundle_meta(path: str | Path) -> dict:
    """The parsed config.json of a bundle, with clear errors for a missing or foreign directory."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"bundle directory {str(path)!r} does not exist")
    cj = path / "config.json"
    if not cj.is_file():
        raise ValueError(f"{str(path)!r} is not a bundle: config.json is missing")
    try:
        meta = json.loads(cj.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"bundle {str(path)!r} is corrupt: config.json is not JSON ({e})") from e
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"{str(path)!r} is not a bundle of format {FORMAT!r} v{VERSION} (found "
                         f"{meta.get('format')!r} v{meta.get('version')!r})")
    return meta


def inference_dtype(name="auto"):
    """The compute dtype for a name or dtype: "auto" is bfloat16 on a GPU backend (the Pallas kernels' dots then
    run on tensor cores; fp32 kernel dots run at full precision on the CUDA cores, several times slower) and
    float32 elsewhere (the CPU tests and exactness checks); None stays None (keep the stored dtype). Only
    float32, bfloat16 and float16 are accepted (float64 would silently be float32 without jax_enable_x64)."""
    if name is None:
        return None
    if isinstance(name, str) and name == "auto":
        return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    try:
        dt = jnp.dtype(name)
    except TypeError:
        dt = None
    if dt is None or dt not in [jnp.dtype(v) for v in _DTYPES.values()]:
        raise ValueError(f"dtype={name!r} is invalid; accepted: 'auto', 'float32', 'bfloat16', 'float16' (or one "
                         "of those dtypes), or None (keep the stored dtype)")
    return dt


def load_bundle(path: str | Path, dtype="auto", *, verify: bool = True) -> Bundle:
    """Reads a bundle written by `save_bundle`. Floating arrays are cast to `dtype` (`inference_dtype`: "auto" is
    bfloat16 on a GPU, float32 elsewhere; None keeps the stored dtype). `verify` checks each shard's SHA-256.
    The params are checked against the config (`model.check_params`, `check_draft`) and come in the
    `init_params` layout (stacked layers). Raises FileNotFoundError for a missing directory and ValueError for a
    corrupt or foreign one."""
    dtype = inference_dtype(dtype)
    path = Path(path)
    meta = read_bundle_meta(path)
    tensors = meta.get("tensors")
    missing = [k for k in ("model", "tensors", "sha256") if k not in meta]
    missing += [] if missing or not isinstance(tensors, dict) or "target" in tensors else ["tensors/target"]
    if meta.get("draft") is not None and isinstance(tensors, dict) and "draft" not in tensors:
        missing.append("tensors/draft")
    if missing:
        raise ValueError(f"bundle {str(path)!r} is corrupt: config.json lacks {missing}")
    try:
        cfg = ModelConfig.from_dict(meta["model"])
    except ValueError as e:
        raise ValueError(f"bundle {str(path)!r} is corrupt: its model config is invalid ({e})") from e
    params = _load_group(path, tensors["target"], meta["sha256"], dtype, verify)
    try:
        M.check_params(cfg, params)
    except ValueError as e:
        raise ValueError(f"bundle {str(path)!r} is corrupt: its target weights do not match its config ({e})") from e
    draft_cfg = draft_params = None
    if meta.get("draft") is not None:
        from ssv_jax.draft import DraftConfig  # lazy: the draft module is optional for target-only bundles

        draft_params = _load_group(path, tensors["draft"], meta["sha256"], dtype, verify)
        try:
            draft_cfg = DraftConfig.from_dict(meta["draft"])
            check_draft(draft_cfg, cfg, draft_params)
        except ValueError as e:
            raise ValueError(f"bundle {str(path)!r} is corrupt: its draft head is invalid ({e})") from e
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        from ssv_jax.tokenizer import Tokenizer

        tokenizer = Tokenizer.load(path / "tokenizer.json")
    return Bundle(cfg, params, draft_cfg, draft_params, tokenizer)


# -- training state (orbax) ----------------------------------------------------------------------------------------
class TrainCheckpointer:
    """Resumable training state through orbax: `save(step, state)` keeps the last `keep` checkpoints under
    `directory`; `restore(abstract_state)` returns (step, state) of the latest one, or (0, None)."""

    def __init__(self, directory: str | Path, keep: int = 2):
        import orbax.checkpoint as ocp

        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep={keep!r} is invalid; accepted: an integer >= 1")
        self._ocp = ocp
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

    def latest_step(self) -> int | None:
        """The step of the newest checkpoint, or None."""
        return self.manager.latest_step()

    def save(self, step: int, state, *, wait: bool = True) -> None:
        """Saves the pytree `state` as checkpoint `step` (blocking unless `wait=False`)."""
        self.manager.save(int(step), args=self._ocp.args.StandardSave(state), force=True)
        if wait:
            self.manager.wait_until_finished()

    def restore(self, abstract_state) -> tuple[int, Any]:
        """(step, state) of the newest checkpoint restored onto `abstract_state`'s structure and shardings, or
        (0, None) when there is none."""
        step = self.manager.latest_step()
        if step is None:
            return 0, None
        state = self.manager.restore(step, args=self._ocp.args.StandardRestore(abstract_state))
        return int(step), state

    def close(self) -> None:
        """Waits for pending writes and releases the manager."""
        self.manager.wait_until_finished()
        self.manager.close()
