"""Every result file that the docs cite is committed: a figure in README, RESULTS or the notes names the JSON (or
PNG) it comes from, and that file is in the repository."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "docs/RESULTS.md", "docs/DESIGN_NOTES.md", "pallas_kernels/NOTES.md"]
# a file name, optionally under docs/results/; not a path's tail (`$OUT/x.json`, `checkpoints/b/config.json`) and
# not a glob (`*_h100.json`)
CITED = re.compile(r"(?<![\w*/$.-])(?:docs/results/)?([A-Za-z0-9][\w-]*\.(?:json|png))\b")


def cited(text: str) -> set[str]:
    return {m.group(1) for m in CITED.finditer(text)}


def test_the_citation_pattern_reads_names_not_output_paths_or_globs():
    text = ("`e2e_s42_h200.json`, docs/results/roofline.png; --out $OUT/kernels.json, "
            "`checkpoints/ssv-small/config.json`, `*_h100.json`, `tokenizer.json`")
    assert cited(text) == {"e2e_s42_h200.json", "roofline.png", "tokenizer.json"}


@pytest.mark.parametrize("doc", DOCS)
def test_every_result_file_a_doc_cites_is_committed(doc):
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    names = {Path(p).name for p in tracked.split()}
    missing = sorted(cited((ROOT / doc).read_text(encoding="utf-8")) - names)
    assert not missing, f"{doc} cites files that are not committed: {missing}"
