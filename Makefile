# Two entry points for a fresh machine (Python 3.11+, make): `make demo`, `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# `make demo` installs only what the demo needs: the core dependencies and the `demo`
# extra (+ `otlp` when it exports spans), then turnrouter itself as an editable install
# without dependencies (so `.venv/bin/python first_router.py` and `.venv/bin/turnrouter`
# work afterwards), seconds rather than the dev extra's minutes. Everything else (tests, lint, docs, benchmarks) installs `dev`.
comma := ,
DEMO_EXTRAS := demo$(if $(or $(findstring otlp,$(ARGS)),$(OTEL_EXPORTER_OTLP_ENDPOINT),$(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)),$(comma)otlp)
DEMO_STAMP := $(VENV)/.installed-$(subst $(comma),-,$(DEMO_EXTRAS))
STAMP := $(VENV)/.installed
# The trace backend of the integration tests, kept out of the project's environment.
PHOENIX_VENV ?= .venv-phoenix
PHOENIX_STAMP := $(PHOENIX_VENV)/.installed

.PHONY: demo test lint typecheck unit docs bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(DEMO_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -c 'import sys, tomllib; project = tomllib.load(open("pyproject.toml", "rb"))["project"]; extras = project["optional-dependencies"]; print("\n".join(project["dependencies"] + [r for e in sys.argv[1].split(",") for r in extras[e]]))' $(DEMO_EXTRAS) > $(VENV)/demo-requirements.txt
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r $(VENV)/demo-requirements.txt
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $@

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP) $(VENV)/.installed-demo $(VENV)/.installed-demo-otlp

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
	$(BIN)/mkdocs build --strict --site-dir site

test: lint typecheck docs unit

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_router.py
	$(BIN)/python benchmarks/bench_decisions.py

clean:
	rm -rf $(VENV) $(PHOENIX_VENV) .mypy_cache .pytest_cache .ruff_cache site
