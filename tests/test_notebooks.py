"""The research notebooks execute end to end on the CPU (nbclient, kernel python3 of this interpreter), in a
temporary working directory so nothing is written to the repository; and scripts/plot_results.py draws the figures
whose JSON files exist and skips the others."""

import json
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(REPO, "notebooks")
RESULTS = os.path.join(REPO, "docs", "results")
CELL_TIMEOUT_S = 300


def run_notebook(name: str, tmp_path, monkeypatch):
    """Execute a copy of notebooks/<name> with tmp_path as the working directory; returns the executed notebook."""
    pytest.importorskip("nbclient")
    import nbformat
    from nbclient import NotebookClient

    src = os.path.join(tmp_path, name)
    shutil.copy(os.path.join(NOTEBOOKS, name), src)
    nb = nbformat.read(src, as_version=4)
    old = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", REPO + (os.pathsep + old if old else ""))  # the kernel imports ssv_jax
    NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    return nb


def last_json_line(nb) -> dict:
    """The JSON object printed last by the notebook's last code cell."""
    cell = [c for c in nb.cells if c.cell_type == "code"][-1]
    text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
    return json.loads(text.strip().splitlines()[-1])


def images(nb) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def test_committed_notebooks_have_no_outputs():
    nbformat = pytest.importorskip("nbformat")
    for name in sorted(os.listdir(NOTEBOOKS)):
        if name.endswith(".ipynb"):
            nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
            nbformat.validate(nb)
            assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), name


def test_overlap_and_layout_stability_notebook(tmp_path, monkeypatch):
    nb = run_notebook("01_overlap_and_layout_stability.ipynb", tmp_path, monkeypatch)
    s = last_json_line(nb)
    for key in ("mean_adjacent_query_overlap", "mean_adjacent_query_overlap_dfs", "mean_stability_offset1"):
        assert 0.0 <= s[key] <= 1.0, (key, s)
    assert images(nb) >= 1
    assert os.listdir(tmp_path) == ["01_overlap_and_layout_stability.ipynb"]  # wrote nothing next to it


def test_kernel_roofline_notebook(tmp_path, monkeypatch):
    nb = run_notebook("02_kernel_roofline.ipynb", tmp_path, monkeypatch)
    s = last_json_line(nb)
    assert s["points"] > 0
    assert s["ridge_flop_per_byte"] == pytest.approx(990 / 4.8)
    assert 0 < s["max_intensity"] < s["ridge_flop_per_byte"]  # every kernel is memory-bound
    assert images(nb) == 1


def test_planner_trace_notebook(tmp_path, monkeypatch):
    nb = run_notebook("03_planner_trace.ipynb", tmp_path, monkeypatch)
    s = last_json_line(nb)
    assert s["chunks"] >= 1 and s["rounds"] >= s["chunks"]
    assert len(s["policies"]) == s["switches"] + 1  # each switch moves to a policy not yet run (drift only)
    assert s["tau"] >= 1.0 and s["new_tokens"] == 48
    assert images(nb) == 1


def test_plot_results_writes_the_figures_whose_json_exists(tmp_path):
    pytest.importorskip("matplotlib")
    Image = pytest.importorskip("PIL.Image")  # matplotlib depends on Pillow
    out = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "plot_results.py"), "--out-dir",
                          str(tmp_path)], capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    lines = out.strip().splitlines()
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    try:
        import plot_results
    finally:
        sys.path.pop(0)
    assert len(lines) == len(plot_results.FIGURES)
    for (png, _, names), line in zip(plot_results.FIGURES, lines):
        missing = [n for n in names if not os.path.exists(os.path.join(RESULTS, n))]
        path = os.path.join(tmp_path, png)
        if missing:
            assert line.startswith(f"skipped: {missing[0]} missing") and not os.path.exists(path)
        else:
            assert line == path and os.path.getsize(path) > 5_000
            with open(path, "rb") as f:
                assert f.read(8) == b"\x89PNG\r\n\x1a\n"
            with Image.open(path) as im:  # a 256-colour palette keeps the committed figures small
                assert im.mode == "P" and len(im.getcolors(256) or ()) > 2
    if not os.path.exists(os.path.join(RESULTS, "e2e_h200.json")):
        assert "skipped: e2e_h200.json missing" in out


def test_the_ceiling_figure_plots_each_ceilings_bounds_against_depth():
    """speedup_ceiling.png: per ceiling JSON, the every-token-accepted curve over its depths, the measured speed-up
    and the AR-step-plus-drafting bound at the policy's depth, and the target as a horizontal line."""
    pytest.importorskip("matplotlib")
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    try:
        import plot_results
        import round_ops
    finally:
        sys.path.pop(0)
    cs = [round_ops.ceiling(0.4, 1.0, 4.4, 6, 200.0, 0.05, 3.5, max_depth=9),
          round_ops.ceiling(0.41, 0.87, 3.98, 5, 193.7, 0.032, 3.5, max_depth=9)]
    for c, e2e in zip(cs, ("a.json", "b.json")):
        c["sources"] = dict(e2e=e2e, policy="tree(k=4, depth=6, budget=32) order=dfs", context=15712)
    fig = plot_results.speedup_ceiling(*cs)
    lines = {ln.get_label(): ln for ln in fig.axes[0].get_lines()}
    for c, name in zip(cs, ("a", "b")):
        curve = lines[f"every token accepted: tree(k=4, depth=6, budget=32) ({name})"]
        assert list(curve.get_xdata()) == list(range(c["depth"], 10))
        assert list(curve.get_ydata()) == pytest.approx([p["speedup"] for p in c["perfect_head"]])
    points = [(ln.get_label(), ln.get_xdata()[0], ln.get_ydata()[0]) for ln in fig.axes[0].get_lines()
              if ln.get_marker() in ("o", "^")]
    assert points == [("measured (τ 4.40)", 6, pytest.approx(cs[0]["measured"])),
                      ("round = AR step + drafting's device time", 6, pytest.approx(cs[0]["verify_as_cheap_as_ar"])),
                      ("measured (τ 3.98)", 5, pytest.approx(cs[1]["measured"])),
                      ("round = AR step + drafting's device time", 5, pytest.approx(cs[1]["verify_as_cheap_as_ar"]))]
    assert lines["target 3.5×"].get_ydata()[0] == 3.5
