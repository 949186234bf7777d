"""The docs test itself (conftest.py at the repository root): what it runs, what it
refuses, and that a broken documented example fails the suite."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)", re.MULTILINE)
SKIP = re.compile(r"<!--\s*skip:\s*(\w+)(.*?)-->", re.DOTALL)
#: Languages of blocks that are data or output, not something to run.
SHOWN = {"", "text", "yaml", "json", "promql", "jsonl"}
SHELL_ALIASES = {"bash", "shell", "console", "shell-session", "zsh", "sh-session"}


def fences(text: str) -> list[str]:
    """The language tags of the opening fences of `text` (closing fences dropped)."""
    tags = [match.group(1) for match in FENCE.finditer(text)]
    return tags[0::2]


def skip_problems(text: str) -> list[str]:
    """Skip markers without a quoted reason (the reader must see why a block is not run)."""
    problems = []
    for action, rest in SKIP.findall(text):
        if action not in {"next", "start", "end"}:
            problems.append(f"unknown skip action {action!r}")
        elif action != "end" and not re.fullmatch(r'\s*"[^"]{8,}"\s*', rest):
            problems.append(f"skip: {action} without a quoted reason: {rest.strip()!r}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_skip_marker_gives_its_reason(page: Path) -> None:
    assert skip_problems(page.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_commands_are_tagged_so_the_docs_test_runs_them(page: Path) -> None:
    """`bash`/`console` blocks would be skipped silently: shell is tagged `sh`."""
    tags = set(fences(page.read_text(encoding="utf-8")))
    assert not tags & SHELL_ALIASES, f"{page.name}: tag shell blocks `sh`"
    assert tags <= SHOWN | {"python", "sh"}, f"{page.name}: unknown block tags {tags - SHOWN}"


def test_the_work_log_check_flags_machine_load_and_earlier_trees() -> None:
    for text in ("load average 2.5", "this 2-core machine", "before/after",
                 '"before" = the committed tree', "Run 1 predates", "the previous predictor",
                 "before → after", "abc1234f", "2026-01-02"):
        assert NOTEBOOK.search(text), text
    for text in ("before any glue", "after one short turn", "a 2-core CPU limit",
                 "the load one process serves"):
        assert not NOTEBOOK.search(text), text


def test_the_checker_flags_markers_without_reason() -> None:
    assert skip_problems('<!-- skip: next "needs Docker here" -->') == []
    assert skip_problems("<!-- skip: next -->") != []
    assert skip_problems('<!-- skip: next "x" -->') != []       # a reason says something
    assert skip_problems("<!-- skip: later -->") != []


@given(st.text(max_size=200))
def test_the_checkers_take_any_text(text: str) -> None:
    assert isinstance(skip_problems(text), list)
    assert isinstance(fences(text), list)
    assert isinstance(uncompared_output(text), list)


def _run_docs_test(tmp_path: Path, page: str) -> subprocess.CompletedProcess[str]:
    """Run the repository's docs test on a checkout holding one page, in a subprocess."""
    for name in ("src", "examples", "benchmarks", "tests", "deploy", "dashboards"):
        (tmp_path / name).symlink_to(ROOT / name)
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "docs").mkdir()
    (tmp_path / "Makefile").write_text("", encoding="utf-8")
    (tmp_path / "pyproject.toml").write_text("", encoding="utf-8")
    (tmp_path / "README.md").write_text(page, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfs", "-p", "no:cacheprovider", "README.md"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)


def test_a_broken_python_block_fails_the_docs_test(tmp_path: Path) -> None:
    page = ("# page\n\n```python\nfrom turnrouter import AgentRouter\n"
            "AgentRouter({}, None)\n```\n")
    result = _run_docs_test(tmp_path, page)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAILED README.md::line:3" in result.stdout
    assert "ConfigurationError" in result.stdout


def test_a_failing_command_and_a_skip_marker(tmp_path: Path) -> None:
    page = ('# page\n\n```sh\nturnrouter --no-such-flag\n```\n\n'
            '<!-- skip: next "needs Docker here" -->\n```sh\ndocker compose up\n```\n'
            "\n```python\nprint('ran')\n```\n")
    result = _run_docs_test(tmp_path, page)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAILED README.md::line:3" in result.stdout
    assert "shell block exited 2" in result.stdout
    assert "needs Docker here" in result.stdout      # the skip, with its reason
    assert "1 failed, 2 passed, 1 skipped" in result.stdout


def test_shown_output_is_compared(tmp_path: Path) -> None:
    """A ```python block starting with `>>>` is a doctest: stale printed output fails."""
    page = ("# page\n\n```python\nvalue = 0.87\n```\n\n"
            "```python\n>>> print('weather', value)\nweather 0.71\n```\n\n"
            "```python\n>>> print('weather', value)\nweather 0.87\n```\n")
    result = _run_docs_test(tmp_path, page)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAILED README.md::line:8" in result.stdout
    assert "1 failed, 2 passed" in result.stdout


PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def uncompared_output(text: str) -> list[str]:
    """Python blocks that print and end in comment lines: output shown but never checked
    (write such an example as a `>>>` doctest block, which the docs test compares)."""
    found = []
    for match in PYTHON_BLOCK.finditer(text):
        lines = match.group(1).rstrip().splitlines()
        if "print(" in match.group(1) and lines and lines[-1].lstrip().startswith("#"):
            found.append(lines[-1])
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_printed_output_is_shown_as_a_doctest(page: Path) -> None:
    assert uncompared_output(page.read_text(encoding="utf-8")) == []


def test_the_output_checker_flags_comment_output() -> None:
    assert uncompared_output("```python\nprint(1)\n# 1\n```\n") == ["# 1"]
    assert uncompared_output("```python\n>>> print(1)\n1\n```\n") == []
    assert uncompared_output("```python\nx = 1  # one\n```\n") == []


#: What a user page must not hold: dated work logs, commit hashes, machine paths.
NOTEBOOK = re.compile(
    r"\b20\d\d-\d\d-\d\d\b"                              # a date
    r"|<[0-9a-f]{7,40}>"                                  # a commit placeholder
    r"|\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"  # a commit hash
    r"|(?<![\w.])/(?:work|home|root|tmp)/"               # a machine path
    r"|\b[Ss]ession of\b|\blast session\b"
    # the machine's load and earlier trees ("before" = the committed tree)
    r"|\b[Ll]oad average\b|\b\d+-core machine\b|\bbefore/after\b|\bbefore → after\b"
    r"|\b[Rr]un \d+ predates\b|\bthe previous predictor\b|\"before\" =")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_user_pages_hold_no_work_log(page: Path) -> None:
    """Measurements with dates, trees and machine load go to benchmarks/reports/."""
    found = [(number, match.group(0))
             for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
             for match in NOTEBOOK.finditer(line)]
    assert found == [], f"{page.name}: move these to benchmarks/reports/: {found}"


def test_the_work_log_check_finds_what_it_looks_for() -> None:
    for line in ("run of 2026-12-02", "`<0fd4331>/src`", "main at 0fd4331",
                 "tar -C /tmp/base", "/" + "work/shared/data", "Session of today"):
        assert NOTEBOOK.search(line), line
    for line in ('"at":1764547200.123', "deadline", "a 1,000-turn run", "cafe"):
        assert not NOTEBOOK.search(line), line


def test_no_absolute_machine_paths_in_the_tree() -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60, check=False)
    if files.returncode != 0:
        pytest.skip("not a git checkout")
    pattern = re.compile(r"(?<![\w.])/(?:work|home|root)/")
    found = []
    for name in files.stdout.splitlines():
        path = ROOT / name
        if not path.is_file() or path.suffix in {".jsonl", ".png", ".whl"}:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        found += [f"{name}:{number}" for number, line in enumerate(text.splitlines(), 1)
                  if pattern.search(line)]
    assert found == []


def _first_python_block(page: Path) -> str:
    text = page.read_text(encoding="utf-8")
    start = text.index("```python\n") + len("```python\n")
    return text[start:text.index("```", start)]


def _run_script(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "app.py"
    script.write_text(source, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "METRICS_PORT": "0"}
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_readme_first_block_is_a_script_that_runs_as_is(tmp_path: Path) -> None:
    """`python first_router.py` with the README's first block, in a directory of its own."""
    result = _run_script(tmp_path, _first_python_block(ROOT / "README.md"))
    assert result.returncode == 0, result.stderr
    assert "> will it rain tomorrow?\n  Sunny, 24 degrees." in result.stdout
    assert "Your last invoice is paid." in result.stdout
    assert result.stderr == ""


def test_quickstart_app_fits_in_forty_lines_and_runs(tmp_path: Path) -> None:
    """Three destinations, acknowledgments, metrics and a routing policy in <= 40 lines."""
    source = _first_python_block(ROOT / "docs" / "quickstart.md")
    assert len(source.splitlines()) <= 40
    for feature in ("acknowledgment_delay_secs", "Telemetry()", "serve_metrics",
                    "PolicyDecisions"):
        assert feature in source
    result = _run_script(tmp_path, source)
    assert result.returncode == 0, result.stderr
    assert "metrics on http://127.0.0.1:" in result.stdout
    assert "(billing) " in result.stdout               # the acknowledgment, before...
    assert result.stdout.index("(billing) ") < result.stdout.index("Your invoice is paid.")
    assert "lobby-kiosk> rain?\n  Happy to chat!" in result.stdout   # pinned by the policy
