"""A real Prometheus server for the integration tests, and a small HTTP API client."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import pytest

__all__ = [
    "Alertmanager",
    "Prometheus",
    "eventually",
    "find_binary",
    "free_port",
    "http_get",
    "refusing_ports",
    "stop_process",
    "wait_until_ready",
]

T = TypeVar("T")


def find_binary(name: str) -> str:
    """The binary's path; skip the test when it is missing, unless CI is set (then fail)."""
    path = shutil.which(name)
    if path is not None:
        return path
    if os.environ.get("CI"):
        pytest.fail(f"{name} is not installed, and CI is set: install the Debian "
                    f"'prometheus' and 'prometheus-alertmanager' packages (see .ci/run)")
    pytest.skip(f"{name} is not installed (apt-get install prometheus prometheus-alertmanager)")


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


@contextlib.contextmanager
def refusing_ports(count: int) -> Iterator[list[int]]:
    """`count` ports on 127.0.0.1 that refuse connections for the block's length: bound
    (so no other process, nor a server this test starts, can take one) but not listening.
    A port merely free when chosen can be taken by the next server started on this machine,
    which then answers a scrape meant to fail."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(int(sock.getsockname()[1]))
        yield ports


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


def _cpu_ticks(pid: int) -> int | None:
    """User + system CPU ticks of `pid` (None where /proc is unavailable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[11]) + int(fields[12])


def wait_until_ready(probe: Callable[[], bool], process: subprocess.Popen[bytes], *,
                     what: str, log_path: Path, stall: float = 60.0, overall: float = 600.0,
                     interval: float = 0.5) -> float:
    """Poll `probe` until it is true; return the seconds it took.

    Robust to a slow, loaded machine without hiding a server that never comes up: fails
    at once if the process exits, after `stall` seconds in which it neither used CPU nor
    wrote to its log (hung), and in any case after `overall` seconds.
    """
    start = time.monotonic()
    last_progress = start
    last_mark: tuple[int | None, int] = (_cpu_ticks(process.pid), -1)
    last_error: BaseException | None = None
    while True:
        if process.poll() is not None:
            raise AssertionError(f"{what}: the process exited with {process.returncode}")
        try:
            if probe():
                return time.monotonic() - start
        except (OSError, ValueError, KeyError) as exc:  # not up yet
            last_error = exc
        now = time.monotonic()
        try:
            size = log_path.stat().st_size
        except OSError:
            size = -1
        mark = (_cpu_ticks(process.pid), size)
        if mark != last_mark:
            last_mark, last_progress = mark, now
        detail = f" (last error: {last_error!r})" if last_error else ""
        if now - last_progress > stall:
            raise AssertionError(f"{what}: no progress (no CPU time, no log output) for "
                                 f"{stall:g}s after {now - start:.0f}s{detail}")
        if now - start > overall:
            raise AssertionError(f"{what}: not ready after {overall:g}s although still "
                                 f"making progress{detail}")
        time.sleep(interval)


class _LocalServer:
    """A server process on a free local port, its output in a log file of `workdir`."""

    def __init__(self, workdir: Path, name: str, argv: list[str]) -> None:
        self.log_path = workdir / f"{name}.log"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                        cwd=workdir)

    def log_tail(self, lines: int = 30) -> str:
        """The end of the server's log, for failure messages."""
        text = self.log_path.read_text(encoding="utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """Terminate the server (kill after a bounded wait)."""
        stop_process(self.process)
        self._log.close()


class Prometheus(_LocalServer):
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
        super().__init__(workdir, "prometheus", [
            binary, f"--config.file={config_path}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--enable-feature=exemplar-storage", "--log.level=warn"])

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>; return the decoded JSON body (any status)."""
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        _, body = http_get(f"{self.url}/api/v1/{path}{query}")
        return json.loads(body)

    def query(self, expr: str, at: float | None = None) -> dict[str, Any]:
        """An instant query (POST: the what-if queries are long), at `at` (Unix time) or
        now; the full response (status, data or error)."""
        form = {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})}
        request = urllib.request.Request(
            f"{self.url}/api/v1/query", data=urllib.parse.urlencode(form).encode(),
            headers={"Content-Type": "application/x-www-form-urlencoded"})
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                body = answer.read()
        except urllib.error.HTTPError as error:
            body = error.read()
        response: dict[str, Any] = json.loads(body)
        return response

    def wait_ready(self) -> None:
        """Wait until the server answers /-/ready (see `wait_until_ready`)."""
        def ready() -> bool:
            return http_get(f"{self.url}/-/ready", timeout=2.0)[0] == 200
        try:
            wait_until_ready(ready, self.process, what="prometheus", log_path=self.log_path,
                             overall=180.0)
        except AssertionError as error:
            raise AssertionError(f"{error}\n{self.log_tail()}") from None


class Alertmanager(_LocalServer):
    """A Debian `prometheus-alertmanager` on a free local port, clustering off."""

    def __init__(self, binary: str, workdir: Path, config: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config_path = workdir / "alertmanager.yml"
        config_path.write_text(config, encoding="utf-8")
        super().__init__(workdir, "alertmanager", [
            binary, f"--config.file={config_path}",
            f"--storage.path={workdir / 'alertmanager-data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--cluster.listen-address=", "--log.level=warn"])

    def wait_ready(self) -> None:
        """Wait until the server answers /-/ready (see `wait_until_ready`)."""
        def ready() -> bool:
            return http_get(f"{self.url}/-/ready", timeout=2.0)[0] == 200
        try:
            wait_until_ready(ready, self.process, what="alertmanager", log_path=self.log_path,
                             overall=180.0)
        except AssertionError as error:
            raise AssertionError(f"{error}\n{self.log_tail()}") from None

    def post(self, alerts: list[dict[str, Any]]) -> None:
        """Send `alerts` as Prometheus does (`POST /api/v2/alerts`)."""
        request = urllib.request.Request(
            f"{self.url}/api/v2/alerts", data=json.dumps(alerts).encode(),
            headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert answer.status == 200

    def alerts(self) -> list[dict[str, Any]]:
        """Every alert it holds (`/api/v2/alerts`), active, suppressed or unprocessed."""
        status, body = http_get(f"{self.url}/api/v2/alerts")
        if status != 200:
            raise AssertionError(f"alertmanager /api/v2/alerts: HTTP {status}: {body[:300]!r}")
        alerts: list[dict[str, Any]] = json.loads(body)
        return alerts
