"""examples/pipecat_app.py runs offline and exits 0 (its own checks passed)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pipecat_app.py"


@pytest.mark.skipif(importlib.util.find_spec("pipecat") is None, reason="needs turnrouter[pipecat]")
def test_pipecat_example_routes_three_destinations_and_exits_0() -> None:
    """The example routes to weather, research (after an acknowledgment) and a Pipecat
    LLM service, nests turnrouter's spans under Pipecat's turn spans, and exits 0."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(EXAMPLE.parents[1] / "src"), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True,
                         timeout=120, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "(answered by research)" in run.stdout
    assert "bot: Let me look into that." in run.stdout
    assert "    turnrouter.turn\n" in run.stdout
    logged = run.stdout + run.stderr
    assert "| ERROR" not in logged and "deprecated" not in logged  # a clean run


@pytest.mark.parametrize(("example", "framework", "extra"),
                         [("pipecat_app.py", "pipecat", "pipecat,demo"),
                          ("livekit_app.py", "livekit", "livekit,testing")])
def test_an_example_without_its_framework_says_so_in_one_line(example: str, framework: str,
                                                              extra: str) -> None:
    """Run without its voice framework (hidden from the import system, as in an
    environment without the extra), an example exits with one line naming the extra to
    install, not a traceback (newcomer16)."""
    path = EXAMPLE.parent / example
    hide = (f"import runpy, sys; sys.modules[{framework!r}] = None; "
            f"runpy.run_path({str(path)!r}, run_name='__main__')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(EXAMPLE.parents[1] / "src"), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True,
                         timeout=120, env=env)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines() == [
        f"examples/{example} needs the {framework} extra ({framework} is missing): "
        f"pip install -e '.[{extra}]'"], run.stderr
