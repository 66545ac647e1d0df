# One command each, on a fresh machine: `make demo` (the main job), `make test` (the test suite).
PY ?= .venv/bin/python
# pytest-xdist processes for `make test` (2-core machine: 12.1 min with 2, 16.3 in one process, when last compared)
TEST_WORKERS ?= 2

.venv/bin/python:
	@if command -v pyenv >/dev/null 2>&1 && PYENV_VERSION=3.12.1 python3.12 --version >/dev/null 2>&1; then \
	  PYENV_VERSION=3.12.1 python3.12 -m venv .venv; else python3.12 -m venv .venv; fi
	.venv/bin/python -m pip install -q --upgrade pip

.venv/.installed: .venv/bin/python pyproject.toml
	.venv/bin/python -m pip install -q -e '.[test]'
	touch .venv/.installed

install: .venv/.installed

demo: .venv/.installed
	$(PY) scripts/ssv_generate.py

test: .venv/.installed
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist worksteal --durations=25

.PHONY: install demo test
