# The two commands a new user needs: `make demo` and `make test`.
# Each sets up .venv on first use (scripts/setup_env.sh) and reuses it afterwards.
VENV ?= .venv
PY := $(VENV)/bin/python
# Python's bytecode cache on, whatever the shell says: with PYTHONDONTWRITEBYTECODE set (this VM sets
# it) nothing writes __pycache__ (git ignores it), so every process `make test` starts (ranks, CLI
# runs, torchrun, pytest workers) compiled wrapopt's modules anew and pytest rewrote every test file
# anew: about a second of CPU per process. See results/make_test_time.md.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup demo test lint bench clean

setup:
	@bash scripts/setup_env.sh

# Writes results/demo-latest/ (ignored by git: the tree stays clean); results/demo/ is the recorded run.
demo: setup
	$(PY) -m wrapopt.cli demo --out results/demo-latest

# The house lint (ruff, settings in pyproject.toml: lines of at most 120 characters and
# pyflakes' real-mistake rules) runs first; `make test` then runs the suite in three parts, below.
lint: setup
	$(VENV)/bin/ruff check wrapopt tests benchmarks scripts examples

# Three parts (See [Note: the parts of make test] in tests/conftest.py). The single-process tests
# run on 2 pytest-xdist workers, a test file to a worker (its module fixtures built once): 4 workers
# on this 2-core VM beside the other parts spent more CPU on what each worker builds anew (imports,
# traces, compiled kernels), results/make_test_time.md.
# Beside them, in a second pytest, the multi-process tests that start their own processes (most of
# their time is spent waiting: timeouts they test, workers, a server); when those pass, a third
# pytest runs the tests that read the shared spawns of 2 and 4 gloo ranks (the two spawns side by
# side: See [Note: the shared spawns side by side]), beside what is left of the first part. The
# second and third parts' output, kept in files, follows the first's. A failure in any part fails
# `make test`; one in the second part stops the third from starting.
test: setup lint
	@echo "== make test 1/3: single-process tests (pytest -m 'not multiprocess', xdist workers) =="
	@echo "   beside them, 2/3 then 3/3: the multi-process tests (their output below)"
	@two=$$(mktemp); three=$$(mktemp); \
	( $(PY) -m pytest -q -p no:cacheprovider -m "multiprocess and not shared_spawn" tests >$$two 2>&1 || exit 97; \
	  $(PY) -m pytest -q -p no:cacheprovider -m "multiprocess and shared_spawn" tests >$$three 2>&1 ) & side=$$!; \
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not multiprocess" tests; one=$$?; \
	echo "   (waiting for parts 2 and 3)"; wait $$side; rest=$$?; \
	echo "== make test 2/3: multi-process tests that start their own processes (pytest -m 'multiprocess and not shared_spawn') =="; \
	cat $$two; \
	echo "== make test 3/3: the shared spawns of 2 and 4 gloo ranks (pytest -m 'multiprocess and shared_spawn') =="; \
	if [ $$rest -eq 97 ]; then echo "not run: part 2 failed"; else cat $$three; fi; \
	rm -f $$two $$three; \
	[ $$one -eq 0 ] && [ $$rest -eq 0 ]

bench: setup
	$(PY) -m benchmarks.run_all

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
