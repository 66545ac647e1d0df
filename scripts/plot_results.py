r"""Draw the figures of docs/results/ from the committed JSON files there (matplotlib, Agg backend).

    python scripts/plot_results.py                                   # docs/results/*.json -> docs/results/*.png
    python scripts/plot_results.py --results-dir DIR --out-dir OUT

Each figure is drawn only when all of its JSON files exist; one line per figure says what was written or
"skipped: <json> missing". Figures, their JSON and the command that regenerates that JSON:

- roofline.png            kernels_h200.json
      python scripts/bench_kernels.py --out docs/results/kernels_h200.json
  Achieved TFLOP/s against arithmetic intensity of the attention kernels (headline grid: C=4, gamma=0.75).
  Bytes are the JSON's `unique_bytes`; FLOPs are not in the JSON and are computed from its shapes.
- decode_layouts.png      decode_profile_h200.json, ar_8b_h200.json
      python scripts/profile_decode.py --layers 4 --context 8192 --steps 16   (the JSON's "command")
      python scripts/bench_ar.py --backend kernel --contexts 8192 32768 65536 --decode-steps 64
  ms per decode step of each weight layout, and 8B decode ms/token against context with the weight-read floor.
- schedule_ablation.png   schedule_8b_h200.json, schedule_decode_8b_h200.json
      python scripts/bench_verify.py --out-verify docs/results/verify_8b_h200.json \
          --out-schedule docs/results/schedule_8b_h200.json
      python scripts/bench_schedule_decode.py --periods 1 2 4 8 32 --out docs/results/schedule_decode_8b_h200.json
  Verify attention / forward ms against the refresh period P per tree, and decode ms/token against P per layout.
- verify_split.png        verify_8b_h200.json          (scripts/bench_verify.py, as above)
  One verify round split into draft / verify / accept+commit, per context and backend.
- overlap_heatmap.png     layout_stability.json
      python scripts/layout_stability.py --checkpoint checkpoints/ssv-small --context 4096 \
          --out docs/results/layout_stability.json
  Cross-layer layout stability (layer x offset) and adjacent-query overlap gamma per layer (bfs / dfs).
  small_eval.json holds perplexity and tau only, no selection statistics, so this figure reads the JSON of
  scripts/layout_stability.py; notebooks/01_overlap_and_layout_stability.ipynb computes the same on the fly.
- e2e_speedup.png         e2e_h200.json
      python scripts/bench_e2e.py --checkpoint checkpoints/ssv-small --contexts 4096 8192 16384 \
          --out docs/results/e2e_h200.json
  End-to-end tokens/s and speedup over AR against context, per method.
- e2e_speedup_h100.png    e2e_s41_h100.json            (its "commands": 15712, then 8192 4096)
  The same with the current head on one H100 lease, the planner included at every context.
- mode_b.png              ablation_mode_b_h200.json, mode_b_agreement_cpu.json
      python scripts/profile_policies.py ... --modes A B     (the first JSON's "command")
      python scripts/mode_b_agreement.py --checkpoint checkpoints/ssv-small --context 4096 --prompts 3
  Mode B over mode A end to end (tokens/s, tau), and its next-token agreement with mode A on identical trees
  (4K; 8K and 15.7K under `context_8192` and `context_15712`, the same command with the JSON's "command").
- group_size_e2e.png      group_size_e2e_h200.json     (profile_policies.py --group-sizes 1 2 4 8, its "command")
  group_size_e2e_s46_h100.png  group_size_e2e_s46_h100.json   (the same with the current head, on an H100)
  ms per round and tokens/s end to end against the group size C, per tree and context.
- mode_b_s46_h100.png     ablation_mode_b_s46_h100.json, mode_b_agreement_cpu.json
  mode_b.png with the current head's end-to-end ablation (H100) on the left.
- refresh_period_e2e.png  refresh_period_e2e_s46_h100.json   (profile_policies.py --schedules 1 2 4 8)
  ms per round, tau and tokens/s end to end against the refresh period P at 15.7K, per tree.
- schedule_quality.png    schedule_quality_cpu.json, schedule_quality_16k_h100.json
      python scripts/schedule_quality.py --checkpoint checkpoints/ssv-small --seq-len 4096 --windows 8
  Held-out perplexity and next-token agreement with refresh-every-layer against the refresh period P (4K
  windows; 8K ones under `seq_len_8192`, the same command with --seq-len 8192 --windows 3 --periods 1 4 8; 16K
  ones on the GPU in bf16, the second JSON's "command").
- round_stages.png        round_ops_15k_h200.json, verify_prologue_h200.json
      python scripts/round_ops.py capture ... then attribute (the JSONs' "command"s)
  The bundled round's device time per stage (`round_ops.STAGES`), one bar per traced capture.
- speedup_ceiling.png     speedup_ceiling_s42_h200.json, speedup_ceiling_best_s55_h100.json
      python scripts/round_ops.py ceiling ...   (each JSON's "command", or RESULTS "What 3.5× would take")
  Speed-up over AR against tree depth if every drafted token were accepted, beside the measured speed-up and the
  bound of a round that costs one AR step plus drafting's device time, for each ceiling, against the 3.5× target.

Every plot function takes the loaded JSON dict(s) and returns a matplotlib Figure, so notebooks can call them.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import textwrap
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.ticker  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402  (a dependency of matplotlib)

from ssv_jax.planner import card_of  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DIR = os.path.join(REPO, "docs", "results")

HBM_TBPS = 4.8  # H200 HBM3e peak
BF16_TFLOPS = 990.0  # H200 dense bf16 tensor-core peak
DPI = 110


def _log_ticks(ax, ticks, labels=None):
    """A log2 x axis with exactly these ticks (no minor ticks)."""
    ticks = sorted(ticks)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, labels or [f"{t // 1024}K" if t >= 1024 else str(t) for t in ticks])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())


def kernel_flops(row: dict, shape: dict) -> float:
    """Useful attention FLOPs of one kernel row: 4 * Q * Hq * D per attended key (QK^T and PV, 2 FLOPs per
    multiply-add). Keys: n * l' selected; whole layers add the window w and the T's compressed blocks."""
    keys = shape["n_slc"] * shape["slc_block"]
    if row["kernel"].endswith("_layer") or row["kernel"].startswith(("refresh", "reuse")):
        keys += shape["window"] + max((row["T"] - shape["cmp_len"]) // shape["cmp_stride"] + 1, 0)
    return 4.0 * row["Q"] * shape["n_heads"] * shape["head_dim"] * keys


def roofline(kern: dict):
    """kernels_h200.json -> achieved TFLOP/s vs FLOP/byte, with the HBM and bf16 ceilings and the ridge point."""
    shape = kern["shape"]
    rows = [r for r in kern["rows"] if "error" not in r and r["us"] > 0 and r["C"] == 4 and r["gamma"] == 0.75
            and not r["kernel"].startswith("refresh_part")]  # parts carry the whole layer's bytes
    fig, ax = plt.subplots(figsize=(9, 6))
    ridge = BF16_TFLOPS / HBM_TBPS
    xs = np.logspace(0, 3.5, 200)
    ax.plot(xs, np.minimum(BF16_TFLOPS, HBM_TBPS * xs), "k-", lw=1.5,
            label=f"roofline: {HBM_TBPS} TB/s HBM, {BF16_TFLOPS:.0f} TFLOP/s bf16")
    copy = kern.get("copy_ceiling_GBps")
    if copy:
        ax.plot(xs, np.minimum(BF16_TFLOPS, copy / 1e3 * xs), "k:", lw=1, label=f"measured copy {copy / 1e3} TB/s")
    ax.axvline(ridge, color="grey", ls="--", lw=1)
    ax.annotate(f"ridge {ridge:.0f} FLOP/B", (ridge, BF16_TFLOPS), xytext=(5, -15), textcoords="offset points")
    markers = {4: "v", 16: "o", 64: "s"}
    colors = plt.get_cmap("tab10")
    for i, name in enumerate(dict.fromkeys(r["kernel"] for r in rows)):
        for r in (r for r in rows if r["kernel"] == name):
            fl = kernel_flops(r, shape)
            ax.scatter(fl / r["unique_bytes"], fl / (r["us"] * 1e-6) / 1e12, color=colors(i % 10),
                       marker=markers.get(r["Q"], "x"), s=14 + r["T"] / 4096, alpha=0.8)
        ax.scatter([], [], color=colors(i % 10), marker="o", label=name)
    for q, mk in markers.items():
        ax.scatter([], [], color="k", marker=mk, facecolors="none", label=f"Q={q} queries")
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (useful FLOP / unique byte)",
           ylabel="achieved TFLOP/s", xlim=(3, 10 ** 3.5), ylim=(1, 2 * BF16_TFLOPS))
    ax.set_title(f"NSA verify attention kernels on {kern.get('machine', '?')} "
                 f"({shape.get('name', '')}, {kern.get('dtype', '')}, C=4, gamma=0.75; size ~ context T)",
                 fontsize=10)
    ax.legend(fontsize=7, loc="lower right", ncol=2)
    ax.grid(True, which="both", alpha=0.2)
    fig.text(0.01, 0.01, "Bytes: unique_bytes from the JSON (grouped_B, mode B, reads only each group's first query's "
             "blocks, fewer bytes than that, so it can sit above the roof).\nFLOPs: computed here from the recorded shapes, 4*Q*Hq*D per "
             "attended key, keys = n*l' (selected) [+ w + compressed blocks for whole layers].\nLeft out: "
             "refresh_part_* rows (they carry whole-layer bytes) and rows with us <= 0.", fontsize=7)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def decode_layouts(profile: dict, ar: dict):
    """decode_profile_h200.json (ms/step per weight layout) and ar_8b_h200.json (ms/token vs context)."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw=dict(width_ratios=(1.3, 1)))
    items = list(profile["ms_per_step"].items())
    names = [k.replace(" (", "\n(", 1) for k, _ in items]
    a.barh(range(len(items)), [v for _, v in items], color="tab:blue")
    a.set_yticks(range(len(items)), names, fontsize=7)
    a.invert_yaxis()
    for i, (_, v) in enumerate(items):
        a.text(v, i, f" {v:.2f}", va="center", fontsize=8)
    a.set(xlabel="ms per decode step", title=f"decode step by layout ({profile.get('device', '')})\n"
          + textwrap.fill(profile.get("shape", ""), 100))
    a.title.set_fontsize(8)
    dec = sorted(ar["decode"], key=lambda r: r["context"])
    ctx = [r["context"] for r in dec]
    b.plot(ctx, [r["decode_ms_per_token"] for r in dec], "o-", label=f"AR decode ({ar.get('decode_attention', '')}"
           " attention)")
    if ar.get("weight_read_floor_ms"):
        b.axhline(ar["weight_read_floor_ms"], color="r", ls="--",
                  label=f"weight-read floor {ar['weight_read_floor_ms']:.2f} ms ({ar.get('weights_gb', 0):.1f} GB)")
    b.set(xlabel="context (tokens)", ylabel="ms / token", ylim=(0, None),
          title=f"{ar.get('preset', '')} decode on {ar.get('device', '')}, B={ar.get('batch', '')}")
    _log_ticks(b, ctx)
    b.legend(fontsize=8)
    fig.tight_layout()
    return fig


def schedule_ablation(verify: dict, decode: dict):
    """schedule_8b_h200.json (verify ms vs refresh period P per tree) and schedule_decode_8b_h200.json."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.8))
    trees = defaultdict(list)
    for r in verify["rows"]:
        t = r["tree"]
        trees[f"k={t['top_k']} d={t['depth']} {t['budget']} nodes"].append(r)
    for i, (name, rows) in enumerate(trees.items()):
        rows = sorted(rows, key=lambda r: r["P"])
        c = f"C{i}"
        a.plot([r["P"] for r in rows], [r["verify_attention_ms"] for r in rows], "o-", color=c,
               label=f"{name}: attention")
        fw = [(r["P"], r["verify_forward_ms"]) for r in rows if r.get("verify_forward_ms") is not None]
        if fw:
            a.plot(*zip(*fw), "s--", color=c, label=f"{name}: whole forward")
    a.set(xlabel="refresh period P (1 = refresh every layer)", ylabel="ms per verify",
          title=f"verify at {verify.get('context', 0) // 1024}K, {verify.get('backend', '').split(';')[0]}",
          ylim=(0, None))
    a.title.set_fontsize(9)
    layouts = defaultdict(list)
    for r in decode["rows"]:
        layouts[r["layout"]].append(r)
    for name, rows in layouts.items():
        rows = sorted(rows, key=lambda r: r["P"])
        b.plot([r["P"] for r in rows], [r["decode_ms_per_token"] for r in rows], "o-", label=name)
    b.set(xlabel="refresh period P", ylabel="ms / token", ylim=(0, None),
          title=f"decode at {decode.get('context', 0) // 1024}K ({decode.get('decode_attention', '')} attention)")
    for ax, data in ((a, verify), (b, decode)):
        _log_ticks(ax, {r["P"] for r in data["rows"]})
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"refresh/reuse schedule, {verify.get('preset', '')} on {verify.get('device', '')}", fontsize=10)
    fig.tight_layout()
    return fig


def _runs(data: dict):
    """A results file's run and the runs nested in it as `previous_run`, newest first."""
    while data:
        yield data
        data = data.get("previous_run")


def verify_split(data: dict):
    """verify_8b_h200.json: stacked draft / verify / accept+commit ms per (context, backend, tree, P), from the
    newest run (this one or a nested previous one) that timed that configuration with the split."""
    newest = {}
    for run in _runs(data):
        for r in run["rows"]:
            if "draft_ms" in r and "tree" in r:
                key = (r["context"], r["backend"], r["tree"]["budget"], r.get("schedule", 1))
                newest.setdefault(key, r)
    rows = [newest[k] for k in sorted(newest)]
    fig, ax = plt.subplots(figsize=(8, 5))
    x = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    for part in ("draft_ms", "verify_ms", "accept_commit_ms"):
        v = np.array([r[part] for r in rows])
        ax.bar(x, v, bottom=bottom, label=part[:-3].replace("_", " + "))
        bottom += v
    for i, r in enumerate(rows):
        ax.text(i, bottom[i], f"{r['round_ms']:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, [f"{r['context'] // 1024}K {r['backend']}\n{r['tree']['top_k']},{r['tree']['depth']},"
                      f"{r['tree']['budget']} P={r.get('schedule', 1)}" for r in rows], fontsize=7)
    ax.set(ylabel="ms per round (label: measured round)", xlabel="context, backend; tree (k, depth, nodes), P",
           title=f"SSV round, {data.get('preset', '')} on {data.get('device', '')}")
    ax.title.set_fontsize(9)
    ax.legend()
    fig.tight_layout()
    return fig


def overlap_heatmap(layout: dict):
    """layout_stability.json (scripts/layout_stability.py): stability [layer, offset] and gamma per layer."""
    mat = np.array([[np.nan if x is None else x for x in row] for row in layout["layer_stability"]["matrix"]], float)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    im = a.imshow(mat, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    for (j, k), v in np.ndenumerate(mat):
        if not np.isnan(v):
            a.text(k, j, f"{v:.2f}", ha="center", va="center", fontsize=7, color="w" if v < 0.6 else "k")
    a.set_xticks(range(mat.shape[1]), [str(k + 1) for k in range(mat.shape[1])])
    a.set(xlabel="offset k", ylabel="layer j", title="layout stability |S_j ∩ S_{j+k}| / |S_j|")
    fig.colorbar(im, ax=a)
    for order, g in layout["query_overlap"].items():
        if isinstance(g, list):
            b.plot(range(len(g)), g, "o-", label=f"{order} order (mean {np.mean(g):.2f})")
    b.set(xlabel="layer", ylabel="mean gamma = |S_i ∩ S_{i+1}| / n", ylim=(0, 1),
          title="overlap of adjacent verify queries")
    b.legend()
    b.grid(alpha=0.3)
    fig.suptitle(f"{layout.get('model', '')}, context {layout.get('context', '?')}", fontsize=10)
    fig.tight_layout()
    return fig


def e2e_speedup(data: dict):
    """e2e_h200.json (scripts/bench_e2e.py): tokens/s and speedup over AR vs context, per method; the run with
    eight prompts per context (`eight_prompts`) where present, else the top-level run."""
    run = data.get("eight_prompts", data)
    n = len({(r["context"], r["prompt"]) for r in run["rows"]}) // max(len({r["context"] for r in run["rows"]}), 1)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.8))
    by = defaultdict(dict)
    for key, v in run["summary"].items():
        ctx, meth = key.split("/", 1)
        by[meth][int(ctx)] = v
    for meth, pts in by.items():
        ctx = sorted(pts)
        a.plot(ctx, [pts[c]["tokens_per_s"] for c in ctx], "o-", label=meth)
        b.plot(ctx, [pts[c]["speedup_vs_ar"] for c in ctx], "o-", label=meth)
    a.set(ylabel="tokens / s (decode)", title=f"{run.get('model', '')} on {run.get('device', '')}")
    b.set(ylabel="speedup over AR NSA", title=f"{run.get('new_tokens', '')} new tokens, {n} prompts per context")
    b.axhline(1.0, color="grey", lw=1)
    for ax in (a, b):
        ax.set(xlabel="context (tokens)")
        _log_ticks(ax, {c for pts in by.values() for c in pts})
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _joined(*parts) -> dict:
    """bench_e2e runs of one lease over different contexts as one run: their rows and summaries joined, the rest
    from the first."""
    return dict(parts[0], rows=[r for p in parts for r in p["rows"]],
                summary={k: v for p in parts for k, v in p["summary"].items()})


def e2e_speedup_current_head(data: dict):
    """e2e_s41_h100.json: `e2e_speedup` over the session-41 runs with the current head on one H100 lease (15712,
    then 8192 and 4096, every method)."""
    return e2e_speedup(_joined(*(data["runs"][k] for k in ("15712", "8192_4096"))))


def e2e_speedup_best_fixed(data: dict):
    """e2e_best_fixed_s45_h200.json: `e2e_speedup` over its runs (15712 and 8192, then 4096; every method with the
    profile's best fixed policy on one H200 lease)."""
    return e2e_speedup(_joined(*data["runs"].values()))


def planner_vs_best_fixed(*leases: dict):
    """Per prompt, the planner's tokens/s over the best fixed policy's (`bench_e2e --fixed profile`, the issue's
    comparison), one series per lease: e2e_best_fixed_s44_h100.json (8K, 15.7K), e2e_best_fixed_s45_h100.json and
    e2e_best_fixed_s45_h200.json (4K, 8K, 15.7K)."""
    runs = [(f"{d['device'].split()[1]}, session {d['benchmark'].rsplit('_s', 1)[1]}",
             _joined(*d["runs"].values())["rows"]) for d in leases]
    fig, ax = plt.subplots(figsize=(7.2, 4.2))
    _gain_panel(ax, runs, "planner gain over the best fixed policy, per prompt (bar: median)")
    ax.set(ylabel="planner tokens/s / best fixed policy's")
    fig.tight_layout()
    return fig


def group_size_ablation(kern: dict):
    """kernels_h200.json: kernel time vs group size C at 64K, per tree size Q (the C sweep of bench_kernels)."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2), sharey=False)
    for ax, name in zip(axes, ("grouped_A", "grouped_B", "reuse_layer")):
        for Q in (16, 64):
            pts = sorted((r["C"], r["us"]) for r in kern["rows"] if r["kernel"] == name and r["T"] == 65536
                         and r["Q"] == Q and r["gamma"] == 0.75)
            if pts:
                ax.plot([c for c, _ in pts], [u for _, u in pts], "o-", label=f"Q={Q} tree nodes")
        ax.set(title=f"{name}, T=64K", xlabel="group size C", ylabel="µs per call", xscale="log")
        _log_ticks(ax, {1, 2, 4, 8})
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def routing_share(kern: dict):
    """kernels_h200.json: a refresh layer's parts at Q=16 per context: the compressed-attention kernel, the routing
    glue (block importance + top-n = cmp_route - cmp_kernel) and the selected+window launch."""
    parts = {(r["kernel"], r["T"]): r["us"] for r in kern["rows"] if r["Q"] == 16 and r["gamma"] == 0.75}
    ctx = sorted({T for k, T in parts if k == "refresh_part_cmp_route"})
    cmp_k = np.array([parts[("refresh_part_cmp_kernel", T)] for T in ctx])
    route = np.array([parts[("refresh_part_cmp_route", T)] for T in ctx]) - cmp_k
    slc = np.array([parts[("refresh_part_slc_win", T)] for T in ctx])
    fig, ax = plt.subplots(figsize=(6, 4.2))
    x = np.arange(len(ctx))
    ax.bar(x, cmp_k, label="compressed attention (kernel)")
    ax.bar(x, route, bottom=cmp_k, label="routing (importance + top-n)")
    ax.bar(x, slc, bottom=cmp_k + route, label="selected + window (kernel)")
    for i in range(len(ctx)):
        tot = cmp_k[i] + route[i] + slc[i]
        ax.text(x[i], tot, f"routing {route[i] / tot:.0%}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, [f"{T // 1024}K" for T in ctx])
    ax.set(xlabel="context", ylabel="µs per refresh layer (Q=16, C=4)", title="routing vs attention, H200")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def planner_gain(data: dict):
    """e2e_h200.json: per prompt, the planner's tokens/s over the best fixed policy's, per context; the main run and
    each extra run present: `planner_same_class_run` (the planner choosing within the fixed policy's precision
    class), `planner_rerun` (a later run of the planner), `planner_bf16_profile` (the planner on a later profile),
    `planner_heldout_profile` (on a profile of other prompts than the benchmark's), `planner_two_file_profile`
    (the same with its 16K bucket re-measured on held-out files alone), `rerun_8k_all_methods` (a later run of
    every method), `repeat_lease` and `repeat_lease_4k` (the main run repeated on other leases), `rerun_91b8638` (the
    main run's command at a later library), labelled with their `code`; in a second panel, `eight_prompts` (eight
    prompts per context) with its `repeat_same_lease` and `second_lease`."""
    def code(run):
        return str(run.get("code", "")).split(" ")[0].rstrip(":,;")

    main = "planner, class 'exact'" if "planner_same_class_run" in data else "planner"
    runs = [(f"{main} ({code(data)})" if code(data) else main, data["rows"])]
    extra = {"planner_same_class_run": "planner, the fixed policy's class", "planner_rerun": "planner re-run",
             "planner_bf16_profile": "planner, bf16 profile", "planner_heldout_profile": "planner, held-out profile",
             "planner_two_file_profile": "planner, 16K re-profile", "rerun_8k_all_methods": "all methods re-run",
             "repeat_lease": "main run, another lease", "repeat_lease_4k": "main run's 4K, another lease",
             "rerun_91b8638": "main run, later library"}
    for key, label in extra.items():
        if key in data:
            c = code(data[key])
            runs.append((f"{label} ({c})" if c else label, data[key]["rows"]))
    eight = []
    if "eight_prompts" in data:
        run = data["eight_prompts"]
        eight = [(f"eight prompts ({code(run)})", run["rows"])] + [
            (f"{label} ({code(run[key])})", run[key]["rows"])
            for key, label in (("repeat_same_lease", "repeated, same lease"), ("second_lease", "second lease"))
            if key in run]
    panels = [(runs, "three prompts per context")] + ([(eight, "eight prompts per context")] if eight else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.2), sharey=True, squeeze=False)
    for ax, (group, title) in zip(axes[0], panels):
        _gain_panel(ax, group, f"planner gain per prompt, {title} (bar: median)")
    axes[0][0].set(ylabel="planner tokens/s / fixed policy's")
    fig.tight_layout()
    return fig


def _gain_panel(ax, runs, title):
    """One panel of `planner_gain`: each run's per-prompt gains side by side within each context."""
    ctx = sorted({r["context"] for _, rows in runs for r in rows})
    for j, (label, rows) in enumerate(runs):  # side by side within each context
        color, dx = f"C{j}", -0.12 + 0.24 * j / max(len(runs) - 1, 1)
        tps = {(r["context"], r["prompt"], r["method"]): r["tokens_per_s"] for r in rows}
        for i, c in enumerate(ctx):
            g = [tps[(c, p, "ssv_planner")] / tps[(c, p, "ssv")] for (cc, p, m) in tps
                 if cc == c and m == "ssv" and (c, p, "ssv_planner") in tps]
            ax.plot([i + dx] * len(g), g, "o", alpha=0.75, color=color, label=label if i == 0 else None)
            if g:
                ax.hlines(np.median(g), i + dx - 0.1, i + dx + 0.1, color="k")
    ax.axhline(1.0, color="grey", lw=1)
    ax.set_xticks(range(len(ctx)), [f"{c // 1024}K" if c % 1024 == 0 else str(c) for c in ctx])
    ax.set(xlabel="context", title=title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _card(prof: dict) -> str:
    """The GPU a profile ran on, short: "H200" (`planner.card_of` without the vendor)."""
    return card_of(prof).removeprefix("NVIDIA ")


def group_size_e2e(prof: dict):
    """group_size_e2e_h200.json or group_size_e2e_s46_*.json (profile_policies.py --group-sizes): end to end on the
    bundled model, ms per round and tokens/s against the group size C, one colour per tree, one line style per
    context bucket."""
    tree = lambda r: (r["policy"]["budget"], r["policy"]["depth"])  # noqa: E731
    trees = sorted({tree(r) for rs in prof["buckets"].values() for r in rs})
    fig, (a_ms, a_tps) = plt.subplots(1, 2, figsize=(9.6, 3.8))
    for bucket, style in zip(sorted(prof["buckets"], key=lambda b: -int(b.rstrip("K"))), ("o-", "s--", "^:")):
        for j, (b, d) in enumerate(trees):
            rs = [r for r in prof["buckets"][bucket] if tree(r) == (b, d)]
            rs.sort(key=lambda r: r["policy"]["group_size"])
            cs = [r["policy"]["group_size"] for r in rs]
            kw = dict(color=f"C{j}", label=f"{bucket}, {b} nodes, depth {d}")
            a_ms.plot(cs, [r["round_ms"] for r in rs], style, **kw)
            a_tps.plot(cs, [r["tokens_per_s"] for r in rs], style, **kw)
    for ax, ylabel in ((a_ms, "ms per round"), (a_tps, "tokens/s")):
        _log_ticks(ax, sorted({r["policy"]["group_size"] for rs in prof["buckets"].values() for r in rs}))
        ax.set(xlabel="group size C", ylabel=ylabel)
        ax.grid(alpha=0.3)
    a_ms.legend(fontsize=7)
    fig.suptitle(f"group size end to end, bundled model, {_card(prof)} (P=4)")
    fig.tight_layout()
    return fig


def refresh_period_e2e(prof: dict):
    """refresh_period_e2e_s46_h100.json (profile_policies.py --schedules 1 2 4 8): end to end on the bundled model,
    ms per round, tau and tokens/s against the refresh period P, one line per tree (each point the mean over the
    profiled prompts)."""
    rows = [r for rs in prof["buckets"].values() for r in rs]
    tree = lambda r: (r["policy"]["budget"], r["policy"]["depth"])  # noqa: E731
    period = lambda r: r["policy"]["schedule"] or 1  # noqa: E731  (no schedule: every layer refreshes)
    fig, axes = plt.subplots(1, 3, figsize=(11.4, 3.6))
    for j, (b, d) in enumerate(sorted({tree(r) for r in rows})):
        rs = sorted((r for r in rows if tree(r) == (b, d)), key=period)
        for ax, key in zip(axes, ("round_ms", "tau", "tokens_per_s")):
            ax.plot([period(r) for r in rs], [r[key] for r in rs], "o-", color=f"C{j}", label=f"{b} nodes, depth {d}")
    for ax, ylabel in zip(axes, ("ms per round", "τ (tokens per round)", "tokens/s")):
        _log_ticks(ax, sorted({period(r) for r in rows}))
        ax.set(xlabel="refresh period P (1: every layer routes)", ylabel=ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    ctx = sorted({p["context"] for p in prof["prompts"]})
    fig.suptitle(f"refresh period end to end, bundled model at {'/'.join(map(str, ctx))}, {_card(prof)} (C=4, "
                 f"{len(prof['prompts'])} prompts)")
    fig.tight_layout()
    return fig


def round_stages(*captures: dict):
    """round_ops_15k_h200.json, verify_prologue_h200.json (round_ops.py attribute): one horizontal bar per traced
    round (labelled by its run and its JSON's benchmark), its device µs stacked by stage of the round
    (`round_ops.stage_of`), ops per round at the bar's end."""
    from round_ops import attributions, by_stage

    runs = [(f"{label.split('/')[-1]}\n({data.get('benchmark', '')})", r) for data in captures
            for label, r in attributions(data)]
    stages = [s["stage"] for s in by_stage([row for _, r in runs for row in r["by_source"]])]
    fig, ax = plt.subplots(figsize=(9.6, 0.6 * len(runs) + 2.2))
    for i, (label, r) in enumerate(runs):
        us = {s["stage"]: s["us"] for s in by_stage(r["by_source"])}
        left = 0.0
        for j, st in enumerate(stages):
            ax.barh(i, us.get(st, 0.0), left=left, color=f"C{j}", label=st if i == 0 else None)
            left += us.get(st, 0.0)
        ax.text(left + 8, i, f"{r['ops_per_round']:.0f} ops", va="center", fontsize=7)
    ax.set_yticks(range(len(runs)), [label for label, _ in runs], fontsize=7)
    ax.invert_yaxis()
    ax.set(xlabel="device µs per round (traced GPU ops)", xlim=(0, 1.15 * max(r["gpu_busy_us_per_round"]
                                                                          for _, r in runs)))
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    fig.suptitle("the SSV round's device time by stage, bundled model at 14.8K, H200")
    fig.tight_layout()
    return fig


def mode_b(e2e: dict, agree: dict):
    """ablation_mode_b_h200.json (profile_policies.py --modes A B) and mode_b_agreement_cpu.json
    (mode_b_agreement.py): left, mode B over mode A end to end on the GPU (tokens/s and tau) against the tree's
    nodes, one colour per context bucket; right, next-token agreement with mode A on identical trees (all nodes;
    the nodes whose argmax mode A emits) per context and policy (the top-level run and the nested ones), with the
    paired tau of both modes and where a free run of mode B first parts from mode A's text."""
    fig, (a_e2e, a_agr) = plt.subplots(1, 2, figsize=(12.4, 4.4), gridspec_kw=dict(width_ratios=[1, 1.9]))
    for j, (bucket, rows) in enumerate(sorted(e2e["buckets"].items(), key=lambda kv: -int(kv[0].rstrip("K")))):
        by = {(r["policy"]["mode"], r["policy"]["budget"]): r for r in rows}
        nodes = sorted(b for m, b in by if m == "A" and ("B", b) in by)
        for key, style in (("tokens_per_s", "o-"), ("tau", "s--")):
            a_e2e.plot(nodes, [by["B", b][key] / by["A", b][key] for b in nodes], style, color=f"C{j}",
                       label=f"{bucket}: {'tokens/s' if key == 'tokens_per_s' else 'τ'}")
    a_e2e.axhline(1.0, color="grey", lw=0.8)
    a_e2e.set_xticks(sorted({r["policy"]["budget"] for rows in e2e["buckets"].values() for r in rows}))
    a_e2e.set(xlabel="tree nodes", ylabel="mode B / mode A",
              title=f"end to end, bundled model, {_card(e2e)} (P=4, C=4)")
    a_e2e.grid(alpha=0.3)
    a_e2e.legend(fontsize=7)
    runs = [agree] + [v for v in agree.values() if isinstance(v, dict) and "results" in v]
    res = [dict(r, context=run["context"]) for run in runs for r in run["results"]]
    x = np.arange(len(res))
    for off, key, label in ((-0.2, "node_agreement", "all tree nodes"),
                            (0.2, "emitted_agreement", "nodes whose argmax mode A emits")):
        a_agr.bar(x + off, [r["summary"][key] for r in res], 0.4, label=label)
    for i, r in enumerate(res):
        s = r["summary"]
        a_agr.text(i, 0.905, f"τ {s['tau_a']:.2f}→{s['tau_b']:.2f}\nfree run parts\nat token "
                   f"{int(np.median(s['free_run_first_divergence']))}", ha="center", fontsize=6.5,
                   bbox=dict(facecolor="white", alpha=0.8, lw=0))
    pol = lambda r: (f"{r['context'] / 1024:.3g}K, {r['policy']['budget']} nodes\n"  # noqa: E731
                     f"{r['policy']['order']} P={r['policy']['schedule'] or 1}")
    a_agr.set_xticks(x, [pol(r) for r in res], fontsize=6.5, rotation=30)
    a_agr.set(ylim=(0.9, 1.0), ylabel="next-token agreement with mode A",
              title=f"identical trees, CPU {agree['dtype']} (C=4)")
    a_agr.grid(axis="y", alpha=0.3)
    a_agr.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2)
    fig.suptitle("mode B (shared index, class approx) against mode A (exact merge)")
    fig.tight_layout()
    return fig


def schedule_quality(q: dict, gpu: dict):
    """schedule_quality_cpu.json and schedule_quality_16k_h100.json (schedule_quality.py): per refresh period P,
    held-out perplexity relative to P=1 and the share of next-token argmaxes equal to refresh-every-layer's (all
    positions; positions where routing chooses, with the per-window spread); one colour per window length (the
    CPU file's top-level run and nested ones, then the GPU file's bf16 run)."""
    runs = [q] + [v for v in q.values() if isinstance(v, dict) and "rows" in v] + [gpu["bfloat16"]]
    fig, (a_ppl, a_agr) = plt.subplots(1, 2, figsize=(9.6, 3.6))
    for j, run in enumerate(runs):
        rows, periods, c = run["rows"], run["periods"], f"C{j}"
        what = f"{run['windows']} × {run['seq_len']} tokens"
        what += f", {run['dtype']} GPU" if run["device"] != "cpu" else ""
        ppl = [r["perplexity"] / rows[0]["perplexity"] for r in rows]
        a_ppl.plot(periods, ppl, "o-", color=c, label=f"{what} (P=1: {rows[0]['perplexity']:.2f})")
        a_agr.plot(periods, [r["agreement"] for r in rows], "o-", color=c, label=f"{what}, all positions")
        a_agr.plot(periods, [r["agreement_routed"] for r in rows], "s--", color=c,
                   label=f"{what}, positions ≥ {run['routed_from_position']}")
        for p, r in zip(periods, rows):
            a_agr.plot([p] * len(r["per_window_agreement_routed"]), r["per_window_agreement_routed"], ".", color=c,
                       alpha=0.35)
    # a ±2 % axis: a zoomed one would draw differences in the third digit as a trend
    a_ppl.set(xlabel="refresh period P", ylabel="held-out perplexity / P=1's", ylim=(0.98, 1.02))
    a_ppl.legend(fontsize=7)
    a_agr.set(xlabel="refresh period P", ylabel="next-token agreement with P=1")
    a_agr.legend(fontsize=6.5)
    for ax in (a_ppl, a_agr):
        _log_ticks(ax, sorted({p for run in runs for p in run["periods"]}))
        ax.grid(alpha=0.3)
    fig.suptitle(f"what reuse layers cost in model quality ({q['source'].split(',')[0]}; {q['device']} "
                 f"{q['dtype']} unless marked GPU)")
    fig.tight_layout()
    return fig


def speedup_ceiling(*ceilings: dict):
    """speedup_ceiling_*.json (round_ops.py ceiling): per ceiling, the speed-up over AR against tree depth with every
    drafted token accepted (the measured round plus `level_ms` a level), the measured speed-up at its depth, and the
    bound of a round that costs one AR step plus drafting's device time; the target as a horizontal line."""
    fig, ax = plt.subplots(figsize=(7.2, 4.2))
    for j, c in enumerate(ceilings):
        src = c["sources"]
        e2e = os.path.basename(src["e2e"]).removesuffix(".json")
        label = f"{src['policy'].split(' order')[0]} ({e2e})"
        ph = c["perfect_head"]
        ax.plot([p["depth"] for p in ph], [p["speedup"] for p in ph], "-", color=f"C{j}",
                label=f"every token accepted: {label}")
        ax.plot([c["depth"]], [c["measured"]], "o", color=f"C{j}", ms=7, label=f"measured (τ {c['tau']:.2f})")
        ax.plot([c["depth"]], [c["verify_as_cheap_as_ar"]], "^", color=f"C{j}", ms=7,
                label="round = AR step + drafting's device time")
    target = ceilings[0]["target"]
    ax.axhline(target, color="k", ls="--", lw=1, label=f"target {target}×")
    ax.set(xlabel="tree depth (drafted levels)", ylabel="speed-up over AR NSA", ylim=(1, None))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6.5, loc="lower right")
    fig.suptitle(f"what {target}× would take, bundled model at {ceilings[0]['sources']['context']}")
    fig.tight_layout()
    return fig


FIGURES = [  # (png, function, the JSON files it reads, in argument order)
    ("roofline.png", roofline, ["kernels_h200.json"]),
    ("decode_layouts.png", decode_layouts, ["decode_profile_h200.json", "ar_8b_h200.json"]),
    ("schedule_ablation.png", schedule_ablation, ["schedule_8b_h200.json", "schedule_decode_8b_h200.json"]),
    ("verify_split.png", verify_split, ["verify_8b_h200.json"]),
    ("overlap_heatmap.png", overlap_heatmap, ["layout_stability.json"]),
    ("e2e_speedup.png", e2e_speedup, ["e2e_h200.json"]),
    ("e2e_speedup_h100.png", e2e_speedup_current_head, ["e2e_s41_h100.json"]),
    ("group_size_ablation.png", group_size_ablation, ["kernels_h200.json"]),
    ("routing_share.png", routing_share, ["kernels_h200.json"]),
    ("planner_gain.png", planner_gain, ["e2e_h200.json"]),
    ("e2e_speedup_best_fixed_h200.png", e2e_speedup_best_fixed, ["e2e_best_fixed_s45_h200.json"]),
    ("planner_vs_best_fixed.png", planner_vs_best_fixed,
     ["e2e_best_fixed_s44_h100.json", "e2e_best_fixed_s45_h100.json", "e2e_best_fixed_s45_h200.json"]),
    ("group_size_e2e.png", group_size_e2e, ["group_size_e2e_h200.json"]),
    ("group_size_e2e_s46_h100.png", group_size_e2e, ["group_size_e2e_s46_h100.json"]),
    ("refresh_period_e2e.png", refresh_period_e2e, ["refresh_period_e2e_s46_h100.json"]),
    ("round_stages.png", round_stages, ["round_ops_15k_h200.json", "verify_prologue_h200.json"]),
    ("mode_b.png", mode_b, ["ablation_mode_b_h200.json", "mode_b_agreement_cpu.json"]),
    ("mode_b_s46_h100.png", mode_b, ["ablation_mode_b_s46_h100.json", "mode_b_agreement_cpu.json"]),
    ("schedule_quality.png", schedule_quality, ["schedule_quality_cpu.json", "schedule_quality_16k_h100.json"]),
    ("speedup_ceiling.png", speedup_ceiling, ["speedup_ceiling_s42_h200.json", "speedup_ceiling_best_s55_h100.json"]),
]


def save_png(fig, path: str) -> None:
    """Write `fig` as a 256-colour palette PNG: the figures are flat colours and anti-aliased lines, which a
    palette keeps to the eye at about a third of the bytes of matplotlib's RGBA output."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    buf.seek(0)
    Image.open(buf).convert("RGB").quantize(colors=256).save(path, format="PNG", optimize=True)


def draw_all(results_dir: str = DEFAULT_DIR, out_dir: str | None = None) -> dict:
    """Draw every figure whose JSON files exist. Returns {png: written path, or None when skipped}."""
    out_dir = out_dir or results_dir
    os.makedirs(out_dir, exist_ok=True)
    done = {}
    for png, fn, names in FIGURES:
        missing = [n for n in names if not os.path.exists(os.path.join(results_dir, n))]
        if missing:
            print(f"skipped: {missing[0]} missing ({png})")
            done[png] = None
            continue
        data = []
        for n in names:
            with open(os.path.join(results_dir, n)) as f:
                data.append(json.load(f))
        fig = fn(*data)
        path = os.path.join(out_dir, png)
        save_png(fig, path)
        plt.close(fig)
        print(path)
        done[png] = path
    return done


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results-dir", default=DEFAULT_DIR, help="where the JSON files are (default docs/results)")
    ap.add_argument("--out-dir", default=None, help="where the PNGs go (default: --results-dir)")
    a = ap.parse_args(argv)
    draw_all(a.results_dir, a.out_dir)


if __name__ == "__main__":
    main()
