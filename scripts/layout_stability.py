"""Measure the paper's observations on a model: cross-layer layout stability (observation 2) and the overlap of
adjacent verify queries in bfs and dfs order (observation 1). Writes a JSON.

    python scripts/layout_stability.py --checkpoint checkpoints/ssv-small --context 4096 --out docs/results/layout.json
    python scripts/layout_stability.py --random-preset tiny --context 512 --out /tmp/layout.json
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from ssv_jax import analysis
from ssv_jax import cache as kvc
from ssv_jax import model as M
from ssv_jax import draft as dr
from ssv_jax import tree as tr
from ssv_jax.generate_cli import load_model, prompts
from ssv_jax.speculative import ssv_prefill


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--random-preset", default=None)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--prompts", type=int, default=2, help="number of held-out prompts (or random sequences)")
    ap.add_argument("--max-offset", type=int, default=4)
    ap.add_argument("--tree", type=int, nargs=3, default=[4, 4, 16], metavar=("TOP_K", "DEPTH", "BUDGET"))
    ap.add_argument("--out", default="docs/results/layout_stability.json")
    a = ap.parse_args(argv)

    m, tok, desc = load_model(argparse.Namespace(random_preset=a.random_preset, checkpoint=a.checkpoint, seed=0))
    cfg = m.cfg
    found = prompts(tok, cfg.vocab_size, a.context, a.prompts)
    names = [name for name, _ in found]
    spec = tr.TreeSpec(*a.tree)
    stab, gam = [], {"bfs": [], "dfs": []}
    t0 = time.perf_counter()
    for _, p in found:
        sels = analysis.sequence_selections(m.params, cfg, p[None])
        stab.append(analysis.layer_stability(sels, a.max_offset, min_pos=cfg.n_slc * cfg.slc_block))
        tc = kvc.init_cache(cfg, 1, a.context + 1024)
        dc = dr.init_draft_cache(m.draft_cfg, 1, max_len=tc.capacity)
        tc, dc, first, hidden = ssv_prefill(m, p[None], tc, dc, 0.0, jax.random.key(0), chunk=512)
        tree = tr.build_tree(m.draft_params, m.draft_cfg, m.params["embed"], hidden, first, tc.length, dc, spec)
        for order in ("bfs", "dfs"):
            t = tree if order == "bfs" else tr.permute_tree(tree, *tr.flatten_order(tree, order))
            sel = analysis.tree_selections(m.params, cfg, M.TreeInputs(t.tokens, t.depth, t.mask), tc)
            gam[order].append(analysis.query_overlap(sel))
    stab = np.nanmean(np.stack(stab), 0)
    res = dict(
        model=desc, config=cfg.name, context=a.context, prompts=names, tree=dict(zip(("top_k", "depth", "budget"),
                                                                                     a.tree)),
        layer_stability=dict(
            description="mean |S_j ∩ S_{j+k}| / |S_j| over queries past the first n*l' tokens and KV heads; "
                        "row j = layer, column k-1 = offset k",
            matrix=[[None if np.isnan(x) else float(x) for x in row] for row in stab],
            mean_by_offset=[float(np.nanmean(stab[:, k])) for k in range(stab.shape[1])]),
        query_overlap=dict(
            description="mean gamma = |S_i ∩ S_{i+1}| / n between adjacent flattened tree queries, per layer",
            **{o: [float(x) for x in np.mean(np.stack(v), 0)] for o, v in gam.items()}),
        seconds=time.perf_counter() - t0)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps(dict(mean_by_offset=res["layer_stability"]["mean_by_offset"],
                          gamma_bfs=float(np.mean(res["query_overlap"]["bfs"])),
                          gamma_dfs=float(np.mean(res["query_overlap"]["dfs"]))), indent=2))


if __name__ == "__main__":
    main()
