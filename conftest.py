"""Docs that run: every ```python and ```sh block of README.md and docs/*.md is a test.

Sybil (https://sybil.readthedocs.io) collects the blocks. The blocks of one page share a
namespace and run in order, in a scratch directory that links the checkout's top-level
entries (so `examples/...`, `deploy/...` and `.venv/bin/python` resolve; `deploy/` and
`dashboards/` are copies, and files a block writes vanish afterwards). Python blocks run
as written (no top-level `await`: write a complete script with `asyncio.run`); a python
block starting with `>>>` is a doctest, its printed output compared with what it shows. Shell
blocks run with `bash -eo pipefail`, `turnrouter` on PATH, each bounded by
`SHELL_TIMEOUT_SECS`.

A block that cannot run in the test suite (it needs Docker, Kubernetes, a cluster, a
model provider's key) is preceded by a skip marker whose reason is shown to the reader:

    <!-- skip: next "needs Docker" -->

(`skip: start "reason"` ... `skip: end` for a run of blocks). tests/test_docs.py checks
that every skip marker gives a reason and that shell blocks are tagged `sh`.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from sybil import Example, Sybil
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser

ROOT = Path(__file__).resolve().parent
SHELL_TIMEOUT_SECS = 180.0
#: What a block may expect in its working directory: links to the checkout, and copies
#: of what a documented command may rewrite (`python -m turnrouter.ops` regenerates).
_LINKED = ("benchmarks", "docs", "examples", "src", "tests", "Makefile", "pyproject.toml",
           "README.md")
_COPIED = ("dashboards", "deploy")


def _setup(namespace: dict[str, Any]) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="turnrouter-docs-"))
    for name in _LINKED:
        (workdir / name).symlink_to(ROOT / name)
    for name in _COPIED:
        shutil.copytree(ROOT / name, workdir / name, symlinks=True)
    # `.venv/bin/python` in a block is the interpreter running the tests.
    (workdir / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    namespace["__docs_cwd__"] = os.getcwd()
    namespace["__docs_env__"] = {key: os.environ.get(key)
                                 for key in ("METRICS_PORT", "NATS_PORT", "NATS_MONITOR_PORT")}
    namespace["__docs_workdir__"] = workdir
    os.environ["METRICS_PORT"] = "0"  # blocks that serve metrics take any free port
    os.environ["NATS_PORT"] = str(_free_port())  # and a NATS server a free one
    os.environ["NATS_MONITOR_PORT"] = str(_free_port())  # its monitoring port too
    os.chdir(workdir)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _teardown(namespace: dict[str, Any]) -> None:
    os.chdir(namespace["__docs_cwd__"])
    for key, value in namespace["__docs_env__"].items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    shutil.rmtree(namespace["__docs_workdir__"], ignore_errors=True)


def _run_shell(example: Example) -> None:
    source = str(example.parsed)
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    # PYTHONPATH=src (a worktree) keeps pointing at this checkout's sources.
    if env.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join(
            str((ROOT / part).resolve()) if not os.path.isabs(part) else part
            for part in env["PYTHONPATH"].split(os.pathsep))
    try:
        done = subprocess.run(["bash", "-eo", "pipefail", "-c", source], cwd=os.getcwd(),
                              env=env, capture_output=True, text=True,
                              timeout=SHELL_TIMEOUT_SECS, check=False)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"shell block timed out after {SHELL_TIMEOUT_SECS:g} s:\n"
                             f"{source}") from exc
    if done.returncode != 0:
        raise AssertionError(f"shell block exited {done.returncode}:\n{source}\n"
                             f"--- stdout\n{done.stdout[-4000:]}\n"
                             f"--- stderr\n{done.stderr[-4000:]}")


pytest_collect_file = Sybil(
    parsers=[
        SkipParser(),
        PythonCodeBlockParser(),
        CodeBlockParser(language="sh", evaluator=_run_shell),
    ],
    patterns=["README.md", "docs/*.md"],
    setup=_setup,
    teardown=_teardown,
).pytest()
