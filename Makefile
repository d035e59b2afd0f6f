# The two commands a new user needs: `make demo` and `make test`.
# Each sets up .venv on first use (scripts/setup_env.sh) and reuses it afterwards.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test bench clean

setup:
	@bash scripts/setup_env.sh

demo: setup
	$(PY) -m wrapopt.cli demo --out results/demo

test: setup
	$(PY) -m pytest -q tests

bench: setup
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
