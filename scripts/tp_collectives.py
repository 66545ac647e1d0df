"""What the 2-device tensor-parallel verify program communicates, and what in it does not shrink with the shard
(issue #9), from CPU-compiled HLO: no GPU is used and nothing here is a GPU measurement.

    python scripts/tp_collectives.py --out docs/results/tp_collectives_cpu.json    # about 7 minutes on 2 cores

Forces 2 host devices (XLA_FLAGS=--xla_force_host_platform_device_count=2, set here before jax is imported) and
compiles, at the llama31-8b-nsa shape (all 32 layers, and 4 to check the per-layer counts), the functions that
`scripts/bench_verify.py` times for its verify stage: `jax.jit` of `ssv_round(..., phase="draft")` and of
`ssv_round(..., phase="verify")` (verify = their difference) on a 2-device "tp" mesh, with the 64-node tree, at two
contexts (default 8K and 128K: bench_verify's cache capacities); plus the one-device verify program, the whole
round (`phase="all"`) on the mesh, and the other attention backend's collectives at 2 and 4 layers. Inputs are
`jax.ShapeDtypeStruct`s carrying the shardings of `ssv_jax.sharding` in bench_verify's `layout(n_dev)` (per-layer
buffers; projections fused, per shard on the mesh), so no weights or caches are allocated.

The backend is the kernel path, as in the 2-GPU run: on CPU its Pallas kernels compile in interpret mode, per shard
under `shard_map`, so they hold no collectives, but their loops (and the copies of their inputs into loop state)
are not what Triton runs on the GPU. `--backend reference` analyses the jnp path, which XLA's partitioner splits.

From the optimized HLO text it reports every collective (kind, result shape and dtype, bytes, and where in the
source it comes from: draft / verify per layer / verify once / accept+commit), the matmul FLOPs by function
against the one-device program, large top-level results, results as large as a layer of the KV cache, top-level
ops per layer (a kernel-launch proxy) and custom calls, and it prices the verify stage's collectives with an
assumed cost per collective (`--latency-us`, `--bandwidth-gbs`: assumptions, not measurements).
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import linecache  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_verify import random_draft_cache, round_state  # noqa: E402

from ssv_jax import cache as kvc  # noqa: E402
from ssv_jax import draft as dr  # noqa: E402
from ssv_jax import model as M  # noqa: E402
from ssv_jax import sharding  # noqa: E402
from ssv_jax.config import get_config  # noqa: E402
from ssv_jax.policy import SSVPolicy  # noqa: E402
from ssv_jax.speculative import SSVModel, ssv_round  # noqa: E402

TREE64 = dict(top_k=8, depth=6, budget=64)  # bench_verify's verify-round tree
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
SHAPE_RE = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")
PLUMBING = {"parameter", "bitcast", "get-tuple-element", "tuple", "constant", "while", "call", "conditional",
            "after-all", "partition-id", "replica-id"}
MIB = 1 << 20


# -- abstract inputs ---------------------------------------------------------------------------------------------
def abstract_params(cfg, mesh):
    """bench_verify's `layout(n_dev)` (`sharding.split_layers`) as ShapeDtypeStructs: per-layer buffers with the
    projections fused; on a mesh the fused matrices are [in, n, out / n] split on their shard axis, and every other
    per-layer weight keeps its stacked spec without the layer axis (`check_layout_rule`)."""
    stacked = jax.eval_shape(lambda k: M.init_params(cfg, k, jnp.bfloat16), jax.random.key(0))
    if mesh is None:
        return jax.eval_shape(lambda p: M.split_layers(p, fuse=True), stacked)
    specs = sharding.param_specs(stacked)
    n = mesh.shape[sharding.AXIS]

    def put(x, spec):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    def layer():
        lp = {k: put(jax.ShapeDtypeStruct(a.shape[1:], a.dtype), P(*specs["layers"][k][1:]))
              for k, a in stacked["layers"].items()}
        for fused, names in M.FUSED_PROJECTIONS.items():
            parts = [lp.pop(k) for k in names]
            width = sum(a.shape[-1] for a in parts)
            lp[fused] = put(jax.ShapeDtypeStruct((parts[0].shape[0], n, width // n), parts[0].dtype),
                            P(None, sharding.AXIS, None))
        return lp

    out = {k: put(v, specs[k]) for k, v in stacked.items() if k != "layers"}
    out["layers"] = [layer() for _ in range(cfg.n_layers)]
    return out


def check_layout_rule(mesh) -> bool:
    """On real (tiny) arrays: `sharding.split_layers(shard_params(...), mesh)`, what bench_verify runs on a mesh,
    gives the fused matrices P(None, "tp", None) and every other layer weight its stacked PartitionSpec minus the
    layer axis, as `abstract_params` assumes."""
    cfg = get_config("tiny")
    p = sharding.shard_params(M.init_params(cfg, jax.random.key(0), jnp.bfloat16), cfg, mesh)
    specs = sharding.param_specs(p)["layers"]
    lp = sharding.split_layers(p, mesh)["layers"][1]

    def spec(k):
        return P(None, sharding.AXIS, None) if k in M.FUSED_PROJECTIONS else P(*specs[k][1:])

    return all(a.sharding.is_equivalent_to(NamedSharding(mesh, spec(k)), a.ndim) for k, a in lp.items())


def abstract_state(cfg, dcfg, cap, T, mesh):
    """bench_verify's round state over caches of `cap` slots holding T tokens, as ShapeDtypeStructs: on a mesh
    the target cache split over KV heads, the rest (draft cache included) replicated."""
    st = jax.eval_shape(lambda: round_state(kvc.random_cache(cfg, 1, cap, T, jax.random.key(2)),
                                            random_draft_cache(dcfg, T, cap, jax.random.key(3)), cfg.hidden))
    if mesh is None:
        return st
    put = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s))  # noqa: E731
    rep = jax.tree.map(lambda x: put(x, P()), st._replace(tcache=None))
    return rep._replace(tcache=jax.tree.map(put, st.tcache, sharding.cache_specs()))


def compile_text(cfg, dcfg, policy, phase, params, dparams, st, mesh) -> tuple[str, float, dict]:
    """The optimized HLO of bench_verify's jitted round function for `phase` ("draft", "verify" or "all"), the
    compile time, and the arguments' names by shape (`arg_names`)."""
    eos = jnp.int32(-2)

    def f(p, dp, s):
        out = ssv_round(SSVModel(cfg, p, dcfg, dp), policy, 0.0, s, jax.random.key(0), eos, 4000, phase=phase,
                        mesh=mesh)
        return out.tokens if phase == "draft" else out

    t0 = time.perf_counter()
    txt = jax.jit(f).lower(params, dparams, st).compile().as_text()
    return txt, time.perf_counter() - t0, arg_names(("params", params), ("draft_params", dparams), ("state", st))


# -- HLO text ----------------------------------------------------------------------------------------------------
def shapes_of(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """[(dtype, dims)] of every array type in an HLO type string."""
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in SHAPE_RE.findall(type_text)]


def nbytes(type_text: str) -> int:
    """Bytes of every array in an HLO type string."""
    return sum(DTYPE_BYTES[dt] * int(np.prod(dims, dtype=np.int64)) for dt, dims in shapes_of(type_text))


def _split_type(rest: str) -> tuple[str, str]:
    """'TYPE opcode(...)...' -> (TYPE, 'opcode(...)...'); TYPE may be a parenthesised tuple."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[:i + 1], rest[i + 1:].lstrip()
    t, _, tail = rest.partition(" ")
    return t, tail


class Hlo:
    """The parts of a compiled module's text this analysis needs: instructions per computation, the call graph
    (which computations run inside a while loop), and the source stack of each instruction."""

    INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
    COMP = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")

    def __init__(self, text: str):
        self.comps: dict[str, list[dict]] = {}
        self.entry = None
        cur = None
        section = None
        files, funcs, locs, frames = {}, {}, {}, {}
        for line in text.splitlines():
            if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
                section, cur = line, None
                continue
            m = self.COMP.match(line)
            if m and not line.startswith(" "):
                cur, section = m.group(2), None
                self.comps[cur] = []
                if m.group(1):
                    self.entry = cur
                continue
            if line.startswith("}"):
                cur = None
                continue
            if cur is not None:
                mi = self.INSTR.match(line)
                if mi:
                    typ, tail = _split_type(mi.group(2))
                    op = tail.split("(", 1)[0]
                    self.comps[cur].append(dict(name=mi.group(1), type=typ, op=op, text=tail))
                continue
            if section and line.strip():
                key, _, val = line.strip().partition(" ")
                if section == "FileNames":
                    files[int(key)] = val.strip('"')
                elif section == "FunctionNames":
                    funcs[int(key)] = val.strip('"')
                elif section == "FileLocations":
                    d = dict(re.findall(r"(\w+)=(\d+)", val))
                    locs[int(key)] = (files[int(d["file_name_id"])], funcs[int(d["function_name_id"])],
                                      int(d["line"]))
                else:
                    d = dict(re.findall(r"(\w+)=(\d+)", val))
                    frames[int(key)] = (int(d["file_location_id"]), int(d["parent_frame_id"]) - 1)
        self._locs, self._frames = locs, frames
        self.by_name = {c: {i["name"]: i for i in ins} for c, ins in self.comps.items()}
        self.types = {c: {n: i["type"] for n, i in d.items()} for c, d in self.by_name.items()}
        self.in_loop = self._loop_membership()

    def _loop_membership(self) -> dict[str, bool]:
        """computation -> whether it is reached from ENTRY only through a while loop's body or condition."""
        edges = collections.defaultdict(list)
        self.caller = {}  # computation -> (calling computation, instruction): fused bodies lack stack frames
        for c, ins in self.comps.items():
            for i in ins:
                for attr, names in re.findall(r"\b(body|condition|calls|to_apply|called_computations|"
                                              r"branch_computations)=\{?([%\w.\-, ]+)\}?", i["text"]):
                    for n in re.findall(r"%([\w.\-]+)", names):
                        edges[c].append((n, attr in ("body", "condition")))
                        self.caller.setdefault(n, (c, i))
        out = {self.entry: False}
        todo = [self.entry]
        while todo:
            c = todo.pop()
            for n, loop in edges[c]:
                v = out[c] or loop
                if n not in out or (out[n] and not v):
                    out[n] = v
                    todo.append(n)
        return out

    def _frame_stack(self, instr: dict) -> list[tuple[str, str, int]] | None:
        m = re.search(r"stack_frame_id=(\d+)", instr["text"])
        if not m:
            return None
        out, f, seen = [], int(m.group(1)), set()
        while f > 0 and f not in seen:
            seen.add(f)
            loc, parent = self._frames[f]
            out.append(self._locs[loc])
            f = parent
        return [(fn, fun, ln) for fn, fun, ln in reversed(out) if "/ssv_jax/" in fn or "/pallas_kernels/" in fn]

    def stack(self, comp: str, instr: dict, _depth: int = 0) -> list[tuple[str, str, int]]:
        """(file, function, line) of the project frames, outermost first. Instructions the compiler made
        without metadata (e.g. the bodies of XNNPACK fusions) take the stack of their fusion, else of the
        nearest operand that has one."""
        st = self._frame_stack(instr)
        if st is not None or _depth > 6:
            return st or []
        if comp in self.caller:
            st = self.stack(*self.caller[comp], _depth + 1)
            if st:
                return st
        for name in re.findall(r"%([\w.\-]+)", instr["text"].split("), ", 1)[0]):
            src = self.by_name[comp].get(name)
            if src is not None:
                st = self.stack(comp, src, _depth + 1)
                if st:
                    return st
        return []

    def instructions(self):
        """(computation, instruction) over every computation reachable from ENTRY."""
        for c, ins in self.comps.items():
            if c in self.in_loop:
                for i in ins:
                    yield c, i


def site(stack, depth: int = 3, quoted: int = 2) -> str:
    """The innermost `depth` project frames, innermost first, the first `quoted` with their source line, e.g.
    'model.py:_mm:71 `...` < model.py:_finish:214 `x = x + _mm(...)` < model.py:forward_tree.<locals>.layer:422'."""
    if not stack:
        return "(no project frame)"
    frames = list(reversed(stack[-depth:]))
    return " < ".join(f"{Path(fn).name}:{fun}:{ln}" + (f" `{linecache.getline(fn, ln).strip()}`" if j < quoted else "")
                      for j, (fn, fun, ln) in enumerate(frames))


def function_site(stack) -> str:
    """The innermost project function other than the matmul helper: groups a program's matmuls by what they
    compute, whatever the layout (fused or not) puts on which line."""
    funs = [f"{Path(fn).name}:{fun.removesuffix('.<locals>.<genexpr>')}" for fn, fun, _ in stack if fun != "_mm"]
    return funs[-1] if funs else "(no project frame)"


def stage(stack) -> str:
    """Which bench_verify stage an op belongs to, from its source stack."""
    funs = [f for _, f, _ in stack]
    if "forward_tree" in funs or any("forward_tree(" in linecache.getline(fn, ln) for fn, _, ln in stack):
        return "verify_per_layer" if "forward_tree.<locals>.layer" in funs else "verify_once"
    if "build_tree" in funs:
        return "draft"
    return "accept_commit" if stack else "unattributed"


def plain_type(type_text: str) -> str:
    """A result type without layouts: 'f32[1,64,4096]' or '(f32[2,3], s32[2])'."""
    return re.sub(r"\{[^}]*\}", "", type_text)


def collectives(h: Hlo, n_dev: int, args: dict | None = None) -> list[dict]:
    """Every collective in the program (an async pair counted once, at its start). `bytes`: the operand's size
    (for an all-gather the gathered result, for a reduce-scatter n times the result)."""
    out = []
    for comp, i in h.instructions():
        kind = i["op"].removesuffix("-start")
        if kind not in COLLECTIVES:
            continue
        st = h.stack(comp, i)
        reducer = re.search(r"to_apply=%([\w.\-]+)", i["text"])
        shapes = shapes_of(i["type"])
        out.append(dict(kind=kind, result=plain_type(i["type"]), dtypes=sorted({d for d, _ in shapes}),
                        bytes=nbytes(i["type"]) * (n_dev if kind == "reduce-scatter" else 1), computation=comp,
                        in_loop=h.in_loop[comp], stage=stage(st), site=site(st),
                        # XLA:CPU widens 16-bit all-reduces to f32 and renames the reducer "*_promoted"
                        cpu_promoted=bool(reducer and "promoted" in reducer.group(1)),
                        same_shape_as=(args or {}).get(shapes[0][1], []) if not st else []))
    return out


def dot_flops(h: Hlo) -> list[dict]:
    """Every dot outside while loops: 2 * output elements * contracted size, with its stage and function."""
    out = []
    for comp, i in h.instructions():
        if i["op"] != "dot" or h.in_loop[comp]:
            continue
        lhs = re.match(r"dot\(%([\w.\-]+),", i["text"]).group(1)
        lhs = shapes_of(h.types[comp][lhs])[0][1]
        cdims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", i["text"]).group(1)
        k = int(np.prod([lhs[int(d)] for d in cdims.split(",") if d]))
        st = h.stack(comp, i)
        out.append(dict(stage=stage(st), function=function_site(st),
                        flops=2 * int(np.prod(shapes_of(i["type"])[0][1])) * k))
    return out


def arg_names(*trees) -> dict:
    """{shape: [argument paths]} of the jitted function's abstract arguments, by per-device shape and, marked
    "(whole)", by global shape: names the inputs that compiler-made instructions (no source frame) copy, convert
    or gather."""
    out = collections.defaultdict(list)
    for name, tree in trees:
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
            local = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
            out[tuple(local)].append(name + jax.tree_util.keystr(path))
            if tuple(local) != tuple(x.shape):
                out[tuple(x.shape)].append(name + jax.tree_util.keystr(path) + " (whole)")
    return {k: sorted(set(v)) for k, v in out.items()}


def large_results(h: Hlo, min_bytes: int, entry_only: bool, args: dict) -> list[dict]:
    """Non-plumbing instructions whose result is at least `min_bytes` (in ENTRY only, or anywhere), grouped by
    (opcode, result, stage, site) with a count; `same_shape_as`: the arguments of that shape (`arg_names`)."""
    c = collections.Counter()
    for comp, i in h.instructions():
        if i["op"] in PLUMBING or (entry_only and comp != h.entry):
            continue
        b = nbytes(i["type"])
        if b >= min_bytes:
            st = h.stack(comp, i)
            c[(i["op"], plain_type(i["type"]), b, h.in_loop[comp], stage(st), site(st, 2))] += 1
    out = []
    for (o, r, b, lp, s, si), n in sorted(c.items(), key=lambda kv: -kv[0][2] * kv[1]):
        shape = tuple(shapes_of(r)[0][1])
        out.append(dict(op=o, result=r, bytes=b, in_loop=lp, stage=s, site=si, count=n,
                        same_shape_as=args.get(shape, [])))
    return out


def custom_calls(h: Hlo, stage_name: str) -> list[dict]:
    """The custom calls (e.g. XLA's TopK) of one stage outside loops: target, operand and result shapes, count."""
    c = collections.Counter()
    for comp, i in h.instructions():
        if i["op"] != "custom-call" or h.in_loop[comp]:
            continue
        st = h.stack(comp, i)
        if stage(st) == stage_name:
            target = re.search(r'custom_call_target="([^"]+)"', i["text"]).group(1)
            ops = re.findall(r"%([\w.\-]+)", i["text"].split("), ", 1)[0])
            operands = ", ".join(plain_type(h.types[comp][n]) for n in ops if n in h.types[comp])
            c[(target, operands, plain_type(i["type"]), function_site(st))] += 1
    return [dict(target=t, operands=o, result=r, function=f, count=n) for (t, o, r, f), n in sorted(c.items())]


def top_level_ops(h: Hlo, stage_name: str, per: int) -> dict:
    """Non-plumbing, non-copy instructions of the entry computation in one stage, by opcode and project function,
    divided by `per` (the layer count for the per-layer stage): on a GPU most become one kernel launch each. A
    proxy only: the CPU compiler fuses differently, and copies are left out because here they are mostly the
    interpret-mode kernels' loop state."""
    c = collections.Counter()
    for i in h.comps[h.entry]:
        if i["op"] not in PLUMBING and i["op"] != "copy":
            st = h.stack(h.entry, i)
            if stage(st) == stage_name:
                c[f"{i['op']} | {function_site(st)}"] += 1
    return {k: v / per for k, v in sorted(c.items(), key=lambda kv: -kv[1])}


# -- summaries ---------------------------------------------------------------------------------------------------
def by_kind(colls: list[dict], per: float = 1.0) -> dict:
    """{kind: {count, bytes}}, divided by `per` (e.g. the layer count)."""
    out = {}
    for c in colls:
        d = out.setdefault(c["kind"], dict(count=0, bytes=0))
        d["count"] += 1 / per
        d["bytes"] += c["bytes"] / per
    return out


def grouped(colls: list[dict]) -> list[dict]:
    """Collectives grouped by (stage, kind, result, site) with a count."""
    c = collections.Counter((x["stage"], x["kind"], x["result"], x["bytes"], x["site"], tuple(x["same_shape_as"]))
                            for x in colls)
    return [dict(stage=s, kind=k, result=r, bytes_each=b, count=n, site=si, **({"same_shape_as": list(a)} if a else {}))
            for (s, k, r, b, si, a), n in sorted(c.items())]


def flops_by_function(dots: list[dict]) -> dict:
    """Dot FLOPs summed per 'stage | function'."""
    out = collections.defaultdict(int)
    for d in dots:
        out[f"{d['stage']} | {d['function']}"] += d["flops"]
    return dict(out)


def signature(colls: list[dict]) -> list:
    """The collectives as sorted (stage, kind, result type) triples, to compare two programs."""
    return sorted((c["stage"], c["kind"], c["result"]) for c in colls)


def cost_us(colls: list[dict], latency_us: float, gbs: float) -> float:
    """ASSUMED cost model: latency + bytes / bandwidth per collective."""
    return sum(latency_us + c["bytes"] / (gbs * 1e3) for c in colls)


def analyse_collectives(program, backend: str, layers: tuple[int, int], contexts: list[int], n_dev: int):
    """The mesh's draft and draft+verify programs at two layer counts and every context. Returns (summary, the
    verify stage's collectives by context, the draft stage's): the summary holds the verify stage's collectives
    (per call, per layer, once per call, the detail) per context, the draft stage's, and two cross-checks of the
    attribution by source stack (bench_verify's program difference, the layer difference)."""
    L1, L = layers
    colls = {}
    for n, T in [(L1, contexts[0])] + [(L, T) for T in contexts]:
        for ph in ("draft", "verify"):
            p = program(n, T, n_dev, ph, backend)
            colls[(n, T, ph)] = collectives(p["hlo"], n_dev, p["args"])
    n_kind = lambda cs, k: by_kind(cs).get(k, {}).get("count", 0)  # noqa: E731
    out, lists = dict(backend=backend, layers=L, by_context={}), {}
    for T in contexts:
        lists[T] = verify = [c for c in colls[(L, T, "verify")] if c["stage"] != "draft"]
        per_layer = [c for c in verify if c["stage"] == "verify_per_layer"]
        out["by_context"][T] = dict(
            per_call=by_kind(verify), per_layer=by_kind(per_layer, per=L),
            once_per_call=by_kind([c for c in verify if c["stage"] != "verify_per_layer"]),
            bytes_per_call=sum(c["bytes"] for c in verify),
            bytes_per_call_without_cpu_promotion=sum(c["bytes"] // (2 if c["cpu_promoted"] else 1) for c in verify),
            check_count_by_program_difference={
                k: v for k in COLLECTIVES
                if (v := n_kind(colls[(L, T, "verify")], k) - n_kind(colls[(L, T, "draft")], k))},
            detail=grouped(verify))
    T0 = contexts[0]
    out["check_per_layer_count_by_layer_difference"] = {
        k: v for k in COLLECTIVES
        if (v := (n_kind(colls[(L, T0, "verify")], k) - n_kind(colls[(L1, T0, "verify")], k)) / (L - L1))}
    out["same_at_every_context"] = all(signature(colls[(L, T, ph)]) == signature(colls[(L, T0, ph)])
                                       for T in contexts for ph in ("draft", "verify"))
    draft = [c for c in colls[(L, T0, "draft")] if c["stage"] == "draft"]
    out["draft_stage"] = dict(per_call=by_kind(draft), detail=grouped(draft))
    return out, lists, draft


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama31-8b-nsa")
    ap.add_argument("--layers", type=int, nargs=2, default=[4, 32],
                    help="two layer counts (the second is the one analysed; per-layer counts are also checked "
                         "against their difference)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 131072],
                    help="committed tokens; the cache capacity is bench_verify's (context + 4096, rounded)")
    ap.add_argument("--backend", default="kernel", choices=("kernel", "reference"))
    ap.add_argument("--other-backend-layers", type=int, nargs=2, default=[2, 4],
                    help="layer counts for the other backend's collectives (not with --collectives-only)")
    ap.add_argument("--collectives-only", action="store_true",
                    help="only the backend's collectives (no whole round, other backend or one-device comparison)")
    ap.add_argument("--latency-us", type=float, nargs="+", default=[8.0, 5.0, 15.0],
                    help="ASSUMED fixed cost per collective on 2 H200s (the first is the headline)")
    ap.add_argument("--bandwidth-gbs", type=float, nargs="+", default=[150.0, 75.0],
                    help="ASSUMED effective bandwidth per collective (operand bytes / time), GB/s (first: headline)")
    ap.add_argument("--hlo-dir", default=None, help="also write each program's HLO text here")
    ap.add_argument("--out", default="docs/results/tp_collectives_cpu.json")
    a = ap.parse_args(argv)

    n_dev = 2
    if len(jax.devices()) < n_dev:
        raise RuntimeError("needs 2 host devices: set XLA_FLAGS=--xla_force_host_platform_device_count=2 before "
                           "jax is imported")
    mesh = sharding.make_mesh(n_dev)
    base = get_config(a.preset)
    L1, L = sorted(a.layers)
    progs = {}

    def program(n_layers, T, devices, phase, backend=a.backend):
        key = (n_layers, T, devices, phase, backend)
        if key not in progs:
            cfg = base.replace(n_layers=n_layers)
            dcfg = dr.DraftConfig.for_target(cfg)
            m = mesh if devices > 1 else None
            cap = kvc.cache_capacity(cfg, T + 4096)
            dparams = jax.eval_shape(lambda k: dr.init_draft_params(dcfg, k, jnp.bfloat16), jax.random.key(1))
            if m is not None:  # the draft head is replicated
                dparams = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(m, P())),
                                       dparams)
            pol = SSVPolicy(**TREE64, backend=backend, group_size=4)
            txt, secs, args = compile_text(cfg, dcfg, pol, phase, abstract_params(cfg, m), dparams,
                                           abstract_state(cfg, dcfg, cap, T, m), m)
            print(f"compiled {backend} layers={n_layers} context={T} devices={devices} phase={phase}: {secs:.1f} s, "
                  f"{len(txt) / 1e6:.1f} MB of HLO", flush=True)
            if a.hlo_dir:
                Path(a.hlo_dir).mkdir(parents=True, exist_ok=True)
                Path(a.hlo_dir, f"{backend}_L{n_layers}_T{T}_d{devices}_{phase}.hlo").write_text(txt)
            progs[key] = dict(hlo=Hlo(txt), cap=cap, cfg=cfg, args=args, compile_s=round(secs, 1))
        return progs[key]

    main_an, lists, draft = analyse_collectives(program, a.backend, (L1, L), a.contexts, n_dev)
    verify = lists[a.contexts[-1]]

    def estimate(lat, gbs):
        return dict(latency_us=lat, bandwidth_gbs=gbs, verify_collectives_us=round(cost_us(verify, lat, gbs), 1),
                    draft_collectives_us=round(cost_us(draft, lat, gbs), 1))

    kernel_note = " (Pallas kernels in interpret mode on CPU, per shard under shard_map)"
    result = dict(
        analysis="CPU-compiled HLO analysis (XLA:CPU, 2 forced host devices); NOT a GPU measurement. The "
                 "collectives come from XLA's SPMD partitioner, which runs before the backend passes; the GPU "
                 "compiler may still combine, schedule or widen them differently, and it fuses differently",
        preset=a.preset, jax=jax.__version__,
        backend=a.backend + (kernel_note if a.backend == "kernel" else " (jnp reference, partitioned by XLA)"),
        config=dict(layers=L, also_compiled_layers=L1, tree=TREE64, group_size=4, schedule="refresh every layer",
                    contexts=a.contexts, cache_capacity={T: kvc.cache_capacity(base, T + 4096) for T in a.contexts},
                    mesh={"tp": n_dev},
                    layout="bench_verify's layout(n_dev): per-layer weight buffers; projections fused, per shard "
                           "([in, n, out / n]) on the mesh",
                    layout_rule_checked_on_real_tiny_arrays=check_layout_rule(mesh),
                    functions="jax.jit(ssv_round(..., phase='draft' | 'verify' | 'all', mesh)) as bench_verify "
                              "jits them; verify stage = (draft+verify) - draft"),
        verify_stage=main_an,
        estimate=dict(
            label="ASSUMPTION, not a measurement: each collective costs latency + operand bytes / bandwidth on 2 "
                  "H200s over NVLink, one after another (each all-reduce is on the layer chain's critical path); "
                  f"operand bytes as compiled for CPU; the verify stage at context {a.contexts[-1]}",
            headline=estimate(a.latency_us[0], a.bandwidth_gbs[0]),
            sensitivity=[estimate(x, b) for x in a.latency_us for b in a.bandwidth_gbs][1:],
            measured="docs/results/tp_h200x2.json (traced): verify 18.27 -> 13.27 ms at 128K; the 65 all-reduces "
                     "take 0.85-0.94 ms per GPU; see its shortfall_128k"),
    )
    if not a.collectives_only:
        other = "reference" if a.backend == "kernel" else "kernel"
        other_an = analyse_collectives(program, other, tuple(sorted(a.other_backend_layers)), a.contexts, n_dev)[0]
        result.update(other_backend=other_an, not_halving=not_halving(program, L, a.contexts[-1], n_dev),
                      whole_round=whole_round(collectives(program(L, a.contexts[0], n_dev, "all")["hlo"], n_dev), L))
    result["compile_s"] = {"_".join(map(str, k)): v["compile_s"] for k, v in progs.items()}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    vs = main_an["by_context"][a.contexts[-1]]
    print(json.dumps(dict(per_call=vs["per_call"], per_layer=vs["per_layer"], once=vs["once_per_call"],
                          estimate=result["estimate"]["headline"],
                          same_at_every_context=main_an["same_at_every_context"]), indent=1))


def whole_round(round_colls: list[dict], n_layers: int) -> dict:
    """The collectives of a whole round (`ssv_round(phase="all")`, the body of bench_verify's round loop)."""
    return dict(per_kind=by_kind(round_colls),
                count_by_stage=dict(collections.Counter(c["stage"] for c in round_colls)),
                accept_commit_detail=grouped([c for c in round_colls if c["stage"] == "accept_commit"]),
                note=f"ssv_round(phase='all') at {n_layers} layers; its draft and verify collectives are those above")


def not_halving(program, n_layers: int, T: int, n_dev: int) -> dict:
    """What in the mesh's verify program does not shrink to 1/n_dev of the one-device program: matmul FLOPs by
    function, large top-level results, results as large as a layer of the cache, top-level ops and custom calls
    per layer."""
    progs = {f"dev{d}": program(n_layers, T, d, "verify") for d in (n_dev, 1)}
    f2, f1 = (flops_by_function(dot_flops(progs[k]["hlo"])) for k in (f"dev{n_dev}", "dev1"))
    flops = [dict(function=s, flops_1dev=f1.get(s, 0), flops_per_shard=f2.get(s, 0),
                  ratio=round(f2.get(s, 0) / f1[s], 3) if f1.get(s) else None)
             for s in sorted(set(f2) | set(f1), key=lambda s: -max(f1.get(s, 0), f2.get(s, 0)))]
    layer_kv = {k: p["cap"] * p["cfg"].n_kv_heads * p["cfg"].head_dim * 2 // d
                for (k, p), d in zip(progs.items(), (n_dev, 1))}
    ops = {k: top_level_ops(p["hlo"], "verify_per_layer", n_layers) for k, p in progs.items()}
    return dict(
        context=T, layers=n_layers,
        note="matmuls outside while loops (the interpret-mode attention kernels are loops), by the innermost "
             "project function. Cache-sized 'copy' results feed while loops: the interpret-mode kernels' loop "
             "state, which the Triton kernels do not have; f32 copies of bf16 weights come from XLA:CPU's dots",
        matmul_flops=flops,
        matmul_flops_total=dict(dev1=sum(f1.values()), per_shard=sum(f2.values())),
        top_level_results_ge_64MiB={k: large_results(p["hlo"], 64 * MIB, True, p["args"]) for k, p in progs.items()},
        results_ge_one_layer_of_kv=dict(layer_kv_bytes=layer_kv, **{
            k: large_results(p["hlo"], layer_kv[k], False, p["args"]) for k, p in progs.items()}),
        top_level_ops_per_layer=dict(total={k: sum(v.values()) for k, v in ops.items()}, **ops),
        verify_custom_calls={k: custom_calls(p["hlo"], "verify_per_layer") for k, p in progs.items()})


if __name__ == "__main__":
    main()
