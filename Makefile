# Two entry points for a fresh machine (Python 3.11+, make): `make demo`, `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Two stamps: the demo needs only the `demo` extra (seconds to install); everything else
# (tests, lint, docs, benchmarks) the `dev` extra.
DEMO_STAMP := $(VENV)/.installed-demo
STAMP := $(VENV)/.installed
# The trace backend of the integration tests, kept out of the project's environment.
PHOENIX_VENV ?= .venv-phoenix
PHOENIX_STAMP := $(PHOENIX_VENV)/.installed

.PHONY: demo test lint typecheck unit docs bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(DEMO_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[demo]'
	touch $(DEMO_STAMP)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP) $(DEMO_STAMP)

$(PHOENIX_STAMP):
	$(PYTHON) -m venv $(PHOENIX_VENV)
	$(PHOENIX_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PHOENIX_VENV)/bin/python -m pip install --quiet 'arize-phoenix==20.26.1'
	touch $(PHOENIX_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/turnrouter demo $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples conftest.py

typecheck: $(STAMP)
	$(BIN)/mypy --strict src/turnrouter tests benchmarks examples conftest.py

unit: $(STAMP) $(PHOENIX_STAMP)
	TURNROUTER_PHOENIX_PYTHON=$(PHOENIX_VENV)/bin/python $(BIN)/pytest -q

# The API reference (mkdocs.yml): warnings fail the build; the site goes to site/.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict --quiet --site-dir site

test: lint typecheck docs unit

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_router.py
	$(BIN)/python benchmarks/bench_decisions.py

clean:
	rm -rf $(VENV) $(PHOENIX_VENV) .mypy_cache .pytest_cache .ruff_cache site
