"""The README's Python examples run as written (on CPU, from the repository root)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), re.S)


def test_the_readme_has_python_examples():
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("i", range(len(EXAMPLES)))
def test_a_readme_example_runs(i):
    out = subprocess.run([sys.executable, "-c", EXAMPLES[i]], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip()  # every example prints its result
