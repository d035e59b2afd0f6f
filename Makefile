# The two commands a new user needs: `make demo` and `make test`.
# Each sets up .venv on first use (scripts/setup_env.sh) and reuses it afterwards.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test lint bench clean

setup:
	@bash scripts/setup_env.sh

# Writes results/demo-latest/ (ignored by git: the tree stays clean); results/demo/ is the recorded run.
demo: setup
	$(PY) -m wrapopt.cli demo --out results/demo-latest

# Two parts, each under its heading: the single-process tests, then the tests that start
# several processes (gloo ranks, torchrun; marked `multiprocess`, see pyproject.toml).
# A failure in either fails `make test` (a failure in the first stops it there).
# The house lint first (ruff, settings in pyproject.toml: lines of at most 120 characters and
# pyflakes' real-mistake rules), then the two parts of the suite.
lint: setup
	$(VENV)/bin/ruff check wrapopt tests benchmarks scripts examples

# The single-process tests run on up to 4 pytest-xdist workers, a test file to a worker (its
# module fixtures built once); the multi-process ones one at a time: their ranks fill the cores.
test: setup lint
	@echo "== make test 1/2: single-process tests (pytest -m 'not multiprocess', xdist workers) =="
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadfile -m "not multiprocess" tests
	@echo "== make test 2/2: multi-process tests: gloo ranks, torchrun (pytest -m multiprocess) =="
	$(PY) -m pytest -q -m multiprocess tests

bench: setup
	$(PY) -m benchmarks.run_all

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
