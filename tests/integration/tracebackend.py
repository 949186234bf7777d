"""A real OTLP trace backend for the integration tests: Arize Phoenix, in a venv of its own.

Phoenix brings ~800 MB of dependencies and a pytest plugin of its own, so it lives in
`.venv-phoenix` (`make` builds it; `TURNROUTER_PHOENIX_PYTHON` names another interpreter)
rather than in the project's environment. Phoenix accepts OTLP/HTTP at `/v1/traces`,
stores the spans in SQLite under its working directory, and serves them back over its
REST API (`GET /v1/projects/<project>/spans`, filterable by `name` and `trace_id`). It
runs on loopback with no network: its telemetry pixels and external resources are off.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from .prom import free_port, http_get, stop_process, wait_until_ready

__all__ = ["DEFAULT_PROJECT", "Phoenix", "require_phoenix"]

#: Where Phoenix puts spans whose resource names no `openinference.project.name`.
DEFAULT_PROJECT = "default"
#: The REST API's largest page.
PAGE = 1000


ROOT = Path(__file__).resolve().parents[2]


def phoenix_python() -> str:
    """The interpreter that has Phoenix installed."""
    # abspath, not resolve(): a venv's python is a symlink to the base interpreter.
    return os.path.abspath(os.environ.get("TURNROUTER_PHOENIX_PYTHON",
                                          str(ROOT / ".venv-phoenix" / "bin" / "python")))


def require_phoenix() -> None:
    """Skip when Phoenix is not installed, unless CI is set (then fail)."""
    python = phoenix_python()
    if Path(python).exists() and subprocess.run(
        [python, "-c", "import importlib.util, sys; "
                       "sys.exit(importlib.util.find_spec('phoenix') is None)"],
        check=False, timeout=60,
    ).returncode == 0:
        return
    if os.environ.get("CI"):
        pytest.fail(f"arize-phoenix is not installed for {python}, and CI is set: "
                    "`make` builds .venv-phoenix (see the Makefile)")
    pytest.skip(f"arize-phoenix is not installed for {python} (make .venv-phoenix)")


def _clean_environ() -> dict[str, str]:
    """This process's environment without OpenTelemetry or Phoenix settings."""
    return {key: value for key, value in os.environ.items()
            if not key.startswith(("OTEL_", "PHOENIX_"))}


class Phoenix:
    """A `phoenix serve` process on free local ports with its own working directory."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.grpc_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        #: What `OTEL_EXPORTER_OTLP_ENDPOINT` should be (the exporter adds `/v1/traces`).
        self.otlp_endpoint = self.url
        data = workdir / "phoenix"
        data.mkdir(parents=True, exist_ok=True)
        env = {
            **_clean_environ(),
            "PHOENIX_HOST": "127.0.0.1",
            "PHOENIX_PORT": str(self.port),
            "PHOENIX_GRPC_PORT": str(self.grpc_port),
            "PHOENIX_WORKING_DIR": str(data),
            "PHOENIX_TELEMETRY_ENABLED": "false",
            "PHOENIX_ALLOW_EXTERNAL_RESOURCES": "false",
            "PHOENIX_DISABLE_AGENT_ASSISTANT": "true",
            "PHOENIX_LOG_MIGRATIONS": "false",
        }
        self.log_path = workdir / "phoenix.log"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [phoenix_python(), "-m", "phoenix.server.main", "serve"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=data, env=env)

    def log_tail(self, lines: int = 40) -> str:
        """The end of the server's log, for failure messages."""
        text = self.log_path.read_text(encoding="utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self) -> float:
        """Wait until `/healthz` answers; the seconds it took. On a loaded 2-core machine
        Phoenix's start-up (imports, migrations) took over 90 s: the wait lasts while the
        process is alive and making progress (CPU time or log output), up to 15 minutes,
        and fails at once if it exits (see `wait_until_ready`)."""
        def ready() -> bool:
            return http_get(f"{self.url}/healthz", timeout=2.0)[0] == 200
        try:
            return wait_until_ready(ready, self.process, what="phoenix",
                                    log_path=self.log_path, stall=120.0, overall=900.0)
        except AssertionError as error:
            raise AssertionError(f"{error}\n{self.log_tail()}") from None

    def get(self, path: str, params: list[tuple[str, str]] | None = None) -> Any:
        """GET /v1/<path>; the decoded JSON body (raises on a non-200 answer)."""
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        # Generous: on a loaded machine a page of 1000 spans took over 5 s.
        status, body = http_get(f"{self.url}/v1/{path}{query}", timeout=60.0)
        if status != 200:
            raise AssertionError(f"GET /v1/{path}{query}: HTTP {status}: {body[:500]!r}")
        return json.loads(body)

    def spans(self, project: str = DEFAULT_PROJECT, *, name: str | None = None,
              trace_id: str | None = None) -> list[dict[str, Any]]:
        """Every stored span of `project`, optionally only those named `name` or in one trace.

        Each span is Phoenix's JSON: `name`, `context` (`trace_id`, `span_id`), `parent_id`,
        `start_time`, `end_time`, `status_code`, `attributes`, `events`.
        """
        params = [("limit", str(PAGE))]
        if name is not None:
            params.append(("name", name))
        if trace_id is not None:
            params.append(("trace_id", trace_id))
        found: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            page = self.get(f"projects/{urllib.parse.quote(project, safe='')}/spans",
                            params + ([("cursor", cursor)] if cursor else []))
            found.extend(page["data"])
            cursor = page.get("next_cursor")
            if not cursor:
                return found

    def stop(self) -> None:
        """Terminate the server (kill after a bounded wait)."""
        stop_process(self.process, grace=15)
        self._log.close()
