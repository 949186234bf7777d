"""Server start-up waits: patient with a slow but live server, quick to fail on one that
exited or hangs (`wait_until_ready`)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .prom import stop_process, wait_until_ready


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts, stopped after it."""
    processes: list[subprocess.Popen[bytes]] = []
    yield processes
    for process in processes:
        stop_process(process, grace=5)


def _start(processes: list[subprocess.Popen[bytes]], code: str,
           log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as handle:
        process = subprocess.Popen([sys.executable, "-c", code], stdout=handle,
                                   stderr=subprocess.STDOUT)
    processes.append(process)
    return process


def test_a_process_that_exits_fails_at_once(
        tmp_path: Path, started: list[subprocess.Popen[bytes]]) -> None:
    """An exited server is reported with its status, without waiting for any bound."""
    log = tmp_path / "log"
    process = _start(started, "import sys; sys.exit(3)", log)
    process.wait(timeout=30)
    begin = time.monotonic()
    with pytest.raises(AssertionError, match="exited with 3"):
        wait_until_ready(lambda: False, process, what="server", log_path=log, stall=30,
                         overall=60)
    assert time.monotonic() - begin < 10


def test_a_hung_process_fails_after_the_stall_bound(
        tmp_path: Path, started: list[subprocess.Popen[bytes]]) -> None:
    """Alive but neither using CPU nor logging: fails after `stall`, not `overall`."""
    log = tmp_path / "log"
    process = _start(started, "import time; time.sleep(600)", log)
    with pytest.raises(AssertionError, match="no progress"):
        wait_until_ready(lambda: False, process, what="server", log_path=log, stall=1.5,
                         overall=300, interval=0.1)
    assert process.poll() is None


def test_a_slow_process_making_progress_is_waited_for(
        tmp_path: Path, started: list[subprocess.Popen[bytes]]) -> None:
    """A server logging as it starts is waited for beyond `stall`, until ready."""
    log = tmp_path / "log"
    ready = tmp_path / "ready"
    code = ("import time, pathlib\n"
            "for i in range(25):\n"
            "    print('starting', i, flush=True); time.sleep(0.1)\n"
            f"pathlib.Path({str(ready)!r}).write_text('x')\n"
            "time.sleep(600)\n")
    process = _start(started, code, log)
    took = wait_until_ready(ready.exists, process, what="server", log_path=log, stall=1.0,
                            overall=120, interval=0.05)
    assert took > 1.0  # longer than the stall bound: progress kept it waiting


def test_a_busy_process_never_ready_fails_at_the_overall_bound(
        tmp_path: Path, started: list[subprocess.Popen[bytes]]) -> None:
    """Progress is not forever: the overall bound ends the wait."""
    log = tmp_path / "log"
    process = _start(started, "while True: pass", log)
    with pytest.raises(AssertionError, match="still making progress"):
        wait_until_ready(lambda: False, process, what="server", log_path=log, stall=5,
                         overall=2, interval=0.1)
