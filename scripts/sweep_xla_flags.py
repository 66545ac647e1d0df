"""The 8B decode step under different XLA_FLAGS (GPU; issue #2): each flag set runs `profile_decode.py` in its
own process (XLA reads its flags once per process) and the step times land in one JSON.

    python scripts/sweep_xla_flags.py --out $OUT/decode_xla_flags_sweep.json
    python scripts/sweep_xla_flags.py --sets default pdl --steps 64

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
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="+", default=list(SETS), help=f"flag sets to run, of {sorted(SETS)}")
    ap.add_argument("--extra", nargs="*", default=[], help="more sets as name=flags (flags space-separated)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--capacity", type=int, default=8448)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--timeout", type=int, default=150, help="seconds per flag set")
    ap.add_argument("--out", default="decode_xla_flags_sweep.json")
    a = ap.parse_args()
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
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profile_decode.py")
    results = {}
    for name, flags in sets.items():
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "r.json")
            cmd = [sys.executable, script, "--layers", str(a.layers), "--context", str(a.context), "--capacity",
                   str(a.capacity), "--steps", str(a.steps), "--variants", "kernel_fused", "--trace", "none",
                   "--outdir", tmp, "--json", out]
            env = dict(os.environ, XLA_FLAGS=flags)
            try:
                p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
                if p.returncode == 0 and os.path.exists(out):
                    with open(out) as f:
                        results[name] = {"flags": flags, "ms_per_step": json.load(f)["kernel_fused"]}
                else:
                    results[name] = {"flags": flags, "error": (p.stderr or p.stdout)[-600:]}
            except subprocess.TimeoutExpired:
                results[name] = {"flags": flags, "error": f"timed out after {a.timeout} s"}
        print(name, json.dumps(results[name])[:300], flush=True)
    res = {"benchmark": "decode_step_xla_flags_sweep", "layers": a.layers, "context": a.context,
           "capacity": a.capacity, "steps": a.steps, "runs": results}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
