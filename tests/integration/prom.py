"""A real Prometheus server for the integration tests, and a small HTTP API client."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import pytest

__all__ = ["Prometheus", "eventually", "find_binary", "free_port", "http_get", "stop_process"]

T = TypeVar("T")


def find_binary(name: str) -> str:
    """The binary's path; skip the test when it is missing, unless CI is set (then fail)."""
    path = shutil.which(name)
    if path is not None:
        return path
    if os.environ.get("CI"):
        pytest.fail(f"{name} is not installed, and CI is set: install the Debian "
                    f"'prometheus' package (see .ci/run)")
    pytest.skip(f"{name} is not installed (apt-get install prometheus)")


def stop_process(process: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """Terminate `process`, killing it if it has not exited after `grace` seconds."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def http_get(url: str, headers: Mapping[str, str] | None = None,
             timeout: float = 5.0) -> tuple[int, bytes]:
    """GET `url`: (status, body); HTTP errors are returned, not raised."""
    request = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return int(response.status), bytes(response.read())
    except urllib.error.HTTPError as error:
        return int(error.code), bytes(error.read())


def eventually(probe: Callable[[], T | None], *, timeout: float, what: str,
               interval: float = 0.25) -> T:
    """Poll `probe` until it returns something other than None, or fail after `timeout`."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            result = probe()
        except (OSError, ValueError, KeyError) as exc:  # server not up yet, partial data
            result, last_error = None, exc
        if result is not None:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}"
                                 + (f" (last error: {last_error!r})" if last_error else ""))
        time.sleep(interval)


class Prometheus:
    """A `prometheus` process on a free local port with its own config and data dir."""

    def __init__(self, binary: str, workdir: Path, config: Mapping[str, Any],
                 rules: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workdir = workdir
        (workdir / "rules.yml").write_text(rules, encoding="utf-8")
        config_path = workdir / "prometheus.yml"
        config_path.write_text(json.dumps({**config, "rule_files": ["rules.yml"]}),
                               encoding="utf-8")
        self.log_path = workdir / "prometheus.log"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [binary, f"--config.file={config_path}",
             f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}",
             "--enable-feature=exemplar-storage", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=workdir)

    def log_tail(self, lines: int = 30) -> str:
        """The end of the server's log, for failure messages."""
        text = self.log_path.read_text(encoding="utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>; return the decoded JSON body (any status)."""
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        _, body = http_get(f"{self.url}/api/v1/{path}{query}")
        return json.loads(body)

    def query(self, expr: str) -> dict[str, Any]:
        """An instant query; the full response (status, data or error)."""
        response: dict[str, Any] = self.api("query", query=expr)
        return response

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait until the server answers /-/ready (fails early if the process died)."""
        def ready() -> bool | None:
            if self.process.poll() is not None:
                raise AssertionError(f"prometheus exited:\n{self.log_tail()}")
            status, _ = http_get(f"{self.url}/-/ready", timeout=1.0)
            return True if status == 200 else None
        eventually(ready, timeout=timeout, what="prometheus to be ready")

    def stop(self) -> None:
        """Terminate the server (kill after a bounded wait)."""
        stop_process(self.process)
        self._log.close()
