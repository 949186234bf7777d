"""The Makefile's entry points: `make demo` installs only what the demo needs (the core
dependencies and the `demo` extra, `otlp` when it exports spans), never the dev extra;
`make test` installs `dev` and builds the API reference with warnings as errors."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def dry_run(*args: str) -> list[str]:
    """The commands `make -n` would run (nothing is run), for a venv that does not exist."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    done = subprocess.run([make, "-n", "--no-print-directory", "VENV=/nonexistent-venv",
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def requirements(lines: list[str]) -> list[str]:
    """Run the requirement-listing command of a dry run with this interpreter."""
    (command,) = [line for line in lines if "tomllib" in line]
    command = command.replace("/nonexistent-venv/bin/python", sys.executable)
    command = command.split(" > ", 1)[0]
    done = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=True)
    return done.stdout.split()


def test_demo_installs_the_demo_extra_only() -> None:
    lines = dry_run("demo")
    text = "\n".join(lines)
    assert "[dev]" not in text
    assert requirements(lines) == PROJECT["dependencies"] + PROJECT[
        "optional-dependencies"]["demo"]
    # turnrouter itself, editable and without dependencies: fast, and after `make demo`
    # `.venv/bin/python first_router.py` imports it and `.venv/bin/turnrouter` exists.
    (editable,) = [line for line in lines if line.rstrip().endswith("-e .")]
    assert "--no-deps" in editable and "/nonexistent-venv/bin/python -m pip install" in editable
    assert lines.index(editable) > next(i for i, line in enumerate(lines) if "-r " in line)
    assert lines[-1].strip() == "/nonexistent-venv/bin/turnrouter demo"


def test_demo_with_span_export_adds_the_otlp_extra() -> None:
    lines = dry_run("demo", "ARGS=--otlp-endpoint http://localhost:4318")
    extras = PROJECT["optional-dependencies"]
    assert requirements(lines) == (PROJECT["dependencies"] + extras["demo"] + extras["otlp"])
    assert any("opentelemetry-exporter-otlp-proto-http" in item for item in extras["otlp"])


def test_test_installs_dev_and_builds_the_reference_strictly() -> None:
    text = "\n".join(dry_run("test"))
    assert "-e '.[dev]'" in text
    assert "mkdocs build --strict" in text
    # --quiet hides the warnings from --strict's count: a broken link built "green"
    assert "mkdocs build --strict --quiet" not in text
    assert "ruff check" in text and "mypy --strict" in text and "pytest" in text


def test_dev_brings_the_docs_tools_and_every_extra() -> None:
    extras = PROJECT["optional-dependencies"]
    dev = extras["dev"]
    (itself,) = [item for item in dev if item.startswith("turnrouter[")]
    named = set(itself.removeprefix("turnrouter[").removesuffix("]").split(","))
    for tool in ("sybil", "mkdocs", "mkdocstrings[python]"):
        assert any(item.startswith(tool) for item in dev), tool
    for extra, items in extras.items():
        assert extra == "dev" or extra in named or set(items) <= set(dev), extra


def test_the_built_site_opens_from_disk() -> None:
    """README says to open site/index.html: pages are built as page.html, so the site's
    links work from file:// (newcomer18 F10: directory URLs like quickstart/ opened as
    directory listings)."""
    config = (ROOT / "mkdocs.yml").read_text()
    assert re.search(r"^use_directory_urls: false$", config, re.MULTILINE)
    assert "open `site/index.html`" in (ROOT / "README.md").read_text()
