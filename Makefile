# The two commands of the README: `make demo` (the main job) and `make test` (the test suite); `make bench` runs
# the benchmark's quick preset (4 methods on ELPV, 3 paired seeds, 12-16 minutes on CPU).
# Each creates and fills the virtual environment .venv when it is missing or older than pyproject.toml.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python recipes/train.py experiment=demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

# Timed work runs under one machine-wide lock, so two measurements never share the cores.
bench: $(STAMP)
	flock -x /tmp/elastic-bench.lock $(BIN)/python recipes/benchmark.py benchmark=quick

clean:
	rm -rf $(VENV) outputs multirun .elastic_cache
