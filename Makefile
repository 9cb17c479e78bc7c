# Two commands do all set-up on a fresh machine with Python 3.11+: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint test-fast equivalence multiprocess elastic bench mutation clean gpu-check

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch: take the pinned CPU wheel only when no torch is present (never an open range).
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m hspmd.cli demo

test: $(STAMP) lint
	$(PY) -m pytest -q -n 2 --dist loadgroup

# The linter (ruff, pyproject's [tool.ruff]) over everything, the type checker (mypy) over the core layers.
lint: $(STAMP)
	$(PY) -m ruff check hspmd tests benchmarks examples tools
	$(PY) -m mypy

test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 -m "not multiprocess"

equivalence: $(STAMP)
	$(PY) -m pytest -q -m equivalence

multiprocess: $(STAMP)
	$(PY) -m pytest -q -m multiprocess

elastic: $(STAMP)
	$(PY) -m pytest -q -m elastic_full tests/test_elastic.py tests/test_multinode_elastic.py

# Run first on a lent GPU machine (no venv needed there: its python3 holds torch, CuPy, pytest).
# Without a CUDA GPU it says it skipped and exits 0. One summary line at the end, under 8 minutes.
GPU_PYTHON := $(if $(wildcard $(PY)),$(PY),$(PYTHON))
gpu-check:
	PYTHONPATH=. $(GPU_PYTHON) tools/gpu_check.py

calibration: $(STAMP)
	$(PY) benchmarks/bench_calibration.py

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(PY) $$b || exit 1; done

# Mutation testing of the core modules against their fast tests (slow; not part of `make test`):
# `make mutation MODULES="schedules geometry"` for some; scores in mutation-scores.txt.
mutation: $(STAMP)
	$(PY) -m pip install -q -e ".[test,mutation]"
	nice -n 19 $(PY) tools/mutation.py $(MODULES)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
