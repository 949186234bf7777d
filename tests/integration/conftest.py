"""One real Prometheus scraping two real metrics sources for the whole integration run.

The normal source and the clarification-heavy source are scraped as separate jobs, so one
server (and one start-up) covers both scenarios: the rules aggregate by `job`, and the
clarification alert must fire for one job and not the other.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from turnrouter.ops import render_rules

from .prom import Prometheus, eventually, find_binary, free_port, http_get, stop_process
from .sources import source_command

NORMAL_JOB = "turnrouter-normal"
CLARIFY_JOB = "turnrouter-clarify"
#: Test copy of the rules: evaluated every second, alerts held for 2s instead of minutes.
RULE_INTERVAL = "1s"
ALERT_FOR = "2s"
ROOT = Path(__file__).resolve().parents[2]


class Source:
    """A metrics source process serving `/metrics` on a free port."""

    def __init__(self, workdir: Path, name: str, *, clarify_heavy: bool, seed: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        self.log_path = workdir / f"{name}.log"
        self._log = self.log_path.open("wb")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.process = subprocess.Popen(
            source_command(self.port, clarify_heavy=clarify_heavy, seed=seed),
            stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)

    def log_tail(self, lines: int = 30) -> str:
        """The end of the source's output."""
        text = self.log_path.read_text(encoding="utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def wait_serving(self, timeout: float = 30.0) -> None:
        """Wait until `/metrics` answers with turnrouter metrics."""
        def serving() -> bool | None:
            if self.process.poll() is not None:
                raise AssertionError(f"metrics source exited:\n{self.log_tail()}")
            status, body = http_get(self.url, timeout=1.0)
            return True if status == 200 and b"turnrouter_turns_total" in body else None
        eventually(serving, timeout=timeout, what=f"metrics on {self.url}")

    def stop(self) -> None:
        """Terminate the process (kill after a bounded wait)."""
        stop_process(self.process)
        self._log.close()


@dataclass
class Stack:
    """The running servers."""

    prometheus: Prometheus
    normal: Source
    clarify: Source


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Two metrics sources and a Prometheus scraping them every second, all up."""
    binary = find_binary("prometheus")
    workdir = tmp_path_factory.mktemp("prometheus")
    normal = Source(workdir, "normal", clarify_heavy=False, seed=1)
    clarify = Source(workdir, "clarify", clarify_heavy=True, seed=2)
    prometheus: Prometheus | None = None
    try:
        normal.wait_serving()
        clarify.wait_serving()
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                       "evaluation_interval": "1s"},
            "scrape_configs": [
                {"job_name": NORMAL_JOB,
                 "static_configs": [{"targets": [f"127.0.0.1:{normal.port}"]}]},
                {"job_name": CLARIFY_JOB,
                 "static_configs": [{"targets": [f"127.0.0.1:{clarify.port}"]}]},
            ],
        }
        prometheus = Prometheus(binary, workdir, config,
                                render_rules(interval=RULE_INTERVAL, for_=ALERT_FOR))
        prometheus.wait_ready()
        server = prometheus

        def targets_up() -> bool | None:
            active = server.api("targets")["data"]["activeTargets"]
            healthy = {t["labels"]["job"] for t in active if t["health"] == "up"}
            return True if {NORMAL_JOB, CLARIFY_JOB} <= healthy else None

        eventually(targets_up, timeout=30, what="both scrape targets to be up")
        yield Stack(prometheus, normal, clarify)
    except BaseException:
        if prometheus is not None:
            print(f"prometheus log:\n{prometheus.log_tail()}", file=sys.stderr)
        raise
    finally:
        if prometheus is not None:
            prometheus.stop()
        normal.stop()
        clarify.stop()
