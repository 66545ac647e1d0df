"""The 8B decode step, or an end-to-end run, under different XLA_FLAGS (GPU; issues #2 and #8): each flag set
runs `profile_decode.py` (or, with `--e2e`, `bench_e2e.py` with the arguments after `--`) in its own process (XLA
reads its flags once per process) and the times land in one JSON.

    python scripts/sweep_xla_flags.py --out $OUT/decode_xla_flags_sweep.json
    python scripts/sweep_xla_flags.py --sets default pdl --steps 64
    python scripts/sweep_xla_flags.py --e2e --sets default cmdbuf_off min_graph_1 --out $OUT/e2e_flags.json -- \
        --checkpoint checkpoints/ssv-small --contexts 15712 --prompts 1 --methods ar ssv --no-split

A flag set that XLA rejects, or that crashes or times out, is recorded with its error instead of a time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

SETS = {
    "default": "",
    "pdl": "--xla_gpu_enable_pdl=true",
    "softmax_priority_fusion": "--xla_gpu_experimental_enable_triton_softmax_priority_fusion=true",
    "triton_gemm_any": "--xla_gpu_triton_gemm_any=true",
    "heroless_priority_fusion": "--xla_gpu_experimental_enable_triton_heroless_priority_fusion=true",
    "fusion_autotuner": "--xla_gpu_experimental_enable_fusion_autotuner=true",
    "generic_triton_gemms": "--xla_gpu_unsupported_enable_generic_triton_emitter_for_gemms=true",
    "all_fusions_with_triton": "--xla_gpu_experimental_all_fusions_with_triton=true",
    "split_k_autotuning_off": "--xla_gpu_enable_split_k_autotuning=false",
    # command buffers (CUDA graphs): none at all; graphs of any length (XLA's default minimum is 5 commands);
    # the while loops inside a round captured too, unrolled into the graph
    "cmdbuf_off": "--xla_gpu_enable_command_buffer=",
    "min_graph_1": "--xla_gpu_graph_min_graph_size=1",
    "cmdbuf_while_unroll": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL "
                           "--xla_gpu_command_buffer_unroll_loops=true --xla_gpu_graph_min_graph_size=1",
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="+", default=list(SETS), help=f"flag sets to run, of {sorted(SETS)}")
    ap.add_argument("--extra", nargs="*", default=[], help="more sets as name=flags (flags space-separated)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--capacity", type=int, default=8448)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--timeout", type=int, default=150, help="seconds per flag set")
    ap.add_argument("--out", default=None, help="the JSON to write (default decode_xla_flags_sweep.json, or "
                                                 "e2e_xla_flags_sweep.json with --e2e)")
    ap.add_argument("--e2e", action="store_true",
                    help="run scripts/bench_e2e.py with the arguments after `--` instead of the decode step")
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    a = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if rest and not a.e2e:
        raise SystemExit("arguments after `--` are bench_e2e.py's; they need --e2e")
    sets = {}
    for name in a.sets:
        if name not in SETS:
            raise SystemExit(f"unknown flag set {name!r}; accepted: {sorted(SETS)}")
        sets[name] = SETS[name]
    for item in a.extra:
        name, _, flags = item.partition("=")
        if not flags:
            raise SystemExit(f"--extra {item!r} is invalid; accepted: name=--xla_flag=value ...")
        sets[name] = flags
    here = os.path.dirname(os.path.abspath(__file__))
    script = os.path.join(here, "bench_e2e.py" if a.e2e else "profile_decode.py")
    results = {}
    for name, flags in sets.items():
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "r.json")
            if a.e2e:
                cmd = [sys.executable, script, *rest, "--out", out]
            else:
                cmd = [sys.executable, script, "--layers", str(a.layers), "--context", str(a.context), "--capacity",
                       str(a.capacity), "--steps", str(a.steps), "--variants", "kernel_fused", "--trace", "none",
                       "--outdir", tmp, "--json", out]
            env = dict(os.environ, XLA_FLAGS=flags)
            try:
                p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
                if p.returncode == 0 and os.path.exists(out):
                    with open(out) as f:
                        r = json.load(f)
                    results[name] = ({"flags": flags, "summary": r["summary"], "rows": r["rows"]} if a.e2e
                                     else {"flags": flags, "ms_per_step": r["kernel_fused"]})
                else:
                    results[name] = {"flags": flags, "error": (p.stderr or p.stdout)[-600:]}
            except subprocess.TimeoutExpired:
                results[name] = {"flags": flags, "error": f"timed out after {a.timeout} s"}
        print(name, json.dumps(results[name])[:300], flush=True)
    if a.e2e:
        res = {"benchmark": "e2e_xla_flags_sweep", "bench_e2e_args": rest, "runs": results}
    else:
        res = {"benchmark": "decode_step_xla_flags_sweep", "layers": a.layers, "context": a.context,
               "capacity": a.capacity, "steps": a.steps, "runs": results}
    with open(a.out or f"{'e2e' if a.e2e else 'decode'}_xla_flags_sweep.json", "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
