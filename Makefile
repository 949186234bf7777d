# Two entry points for a fresh machine (Python 3.11+, make): `make demo`, `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The trace backend of the integration tests, kept out of the project's environment.
PHOENIX_VENV ?= .venv-phoenix
PHOENIX_STAMP := $(PHOENIX_VENV)/.installed

.PHONY: demo test lint typecheck unit bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

$(PHOENIX_STAMP):
	$(PYTHON) -m venv $(PHOENIX_VENV)
	$(PHOENIX_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PHOENIX_VENV)/bin/python -m pip install --quiet 'arize-phoenix==20.26.1'
	touch $(PHOENIX_STAMP)

demo: $(STAMP)
	$(BIN)/turnrouter demo $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples

typecheck: $(STAMP)
	$(BIN)/mypy --strict src/turnrouter tests benchmarks examples

unit: $(STAMP) $(PHOENIX_STAMP)
	TURNROUTER_PHOENIX_PYTHON=$(PHOENIX_VENV)/bin/python $(BIN)/pytest -q

test: lint typecheck unit

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_router.py
	$(BIN)/python benchmarks/bench_decisions.py

clean:
	rm -rf $(VENV) $(PHOENIX_VENV) .mypy_cache .pytest_cache .ruff_cache
