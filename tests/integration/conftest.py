"""One real Prometheus and one real Alertmanager for the whole integration run, scraping
three real metrics sources (`turnrouter demo --serve`), one job each.

- `turnrouter-normal`: the demo as shipped (40 participants, real time): nothing may be
  pending or firing for it;
- `turnrouter-clarify`: `--clarify-heavy` at 4x speed: the clarification critical fires,
  reaches Alertmanager, and its warning is inhibited there;
- `turnrouter-heavy`: one participant alone, clarify-heavy, real time: nothing pages;
- `turnrouter-doomed`: two participants, stopped by a test: TurnrouterTargetDown pages.

Alertmanager runs the configuration `python -m turnrouter.ops alertmanager` prints with
the receivers set through the documented environment variables (the local webhook).

The rules are the shipped ones generated with the demo's per-route overrides
(deploy/prometheus/overrides.demo.yml), evaluated every second with every `for:` cut to
2 s (stricter than production: whatever would merely be pending is firing here). Long
time ranges (10 minutes of normal traffic, 30 of one heavy participant, onset-to-page
times, blips) are covered by promtool rule unit tests, in milliseconds; see
docs/operations.md.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from turnrouter.ops import ALERTMANAGER_ENV, read_overrides, render_rules

from .prom import (
    Alertmanager,
    Prometheus,
    eventually,
    find_binary,
    free_port,
    http_get,
    stop_process,
    wait_until_ready,
)
from .sources import source_command

NORMAL_JOB = "turnrouter-normal"
CLARIFY_JOB = "turnrouter-clarify"
HEAVY_JOB = "turnrouter-heavy"
DOOMED_JOB = "turnrouter-doomed"
#: Test copy of the rules: evaluated every second, alerts held for 2s instead of minutes.
RULE_INTERVAL = "1s"
ALERT_FOR = "2s"
ROOT = Path(__file__).resolve().parents[2]
DEMO_OVERRIDES = ROOT / "deploy/prometheus/overrides.demo.yml"
ALERTMANAGER_CONFIG = ROOT / "deploy/alertmanager/alertmanager.yml"


class Source:
    """A metrics source process serving `/metrics` on a free port."""

    def __init__(self, workdir: Path, name: str, args: list[str],
                 otlp_endpoint: str | None = None, samples: bool = False) -> None:
        self.port = free_port()
        #: The timing samples the demo appends (`--samples`), when asked for.
        self.samples = workdir / f"{name}-samples.jsonl" if samples else None
        if self.samples is not None:
            args = [*args, "--samples", str(self.samples)]
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        self.log_path = workdir / f"{name}.log"
        self._log = self.log_path.open("wb")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
        if otlp_endpoint is not None:
            # Spans exported (to a sink that accepts and drops them): the demo records
            # spans, and trace exemplars, only when something receives them.
            env["OTEL_EXPORTER_OTLP_ENDPOINT"] = otlp_endpoint
        self.process = subprocess_popen(source_command(self.port, args), self._log, env)

    def log_tail(self, lines: int = 30) -> str:
        """The end of the source's output."""
        text = self.log_path.read_text(encoding="utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def wait_serving(self) -> None:
        """Wait until `/metrics` answers with turnrouter metrics."""
        def serving() -> bool:
            status, body = http_get(self.url, timeout=2.0)
            return status == 200 and b"turnrouter_turns_total" in body
        try:
            wait_until_ready(serving, self.process, what=f"metrics on {self.url}",
                             log_path=self.log_path, overall=180.0)
        except AssertionError as error:
            raise AssertionError(f"{error}\n{self.log_tail()}") from None

    def stop(self) -> None:
        """Terminate the process (kill after a bounded wait)."""
        stop_process(self.process)
        self._log.close()


def subprocess_popen(command: list[str], log: Any, env: dict[str, str]) -> Any:
    """Start `command` with its output in `log`."""
    import subprocess

    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                            stdin=subprocess.DEVNULL)


@dataclass
class Webhook:
    """A local HTTP receiver standing in for the pager and the ticket system."""

    received: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def notifications(self, receiver: str) -> list[dict[str, Any]]:
        """The alerts delivered to `receiver` so far (each notification's `alerts`)."""
        with self.lock:
            return [alert for body in self.received.get(receiver, [])
                    for alert in body.get("alerts", [])]


def _serve_webhook(hook: Webhook) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = min(int(self.headers.get("Content-Length") or 0), 10_000_000)
            raw = self.rfile.read(length)
            if self.path.startswith("/v1/traces"):  # the sources' OTLP spans: dropped
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = json.loads(raw or b"{}")
            with hook.lock:
                hook.received.setdefault(self.path.strip("/"), []).append(body)
            self.send_response(200)
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def alertmanager_test_config(webhook_url: str) -> str:
    """The configuration `python -m turnrouter.ops alertmanager` prints with the receivers
    set through their environment variables (pointed at the test webhook), the waits
    cut to a second (routes and inhibit rules unchanged)."""
    import subprocess

    env = {**os.environ, **{variable: f"{webhook_url}/{name}"
                            for name, variable in ALERTMANAGER_ENV.items()},
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                        os.environ.get("PYTHONPATH")]))}
    printed = subprocess.run([sys.executable, "-m", "turnrouter.ops", "alertmanager"],
                             capture_output=True, text=True, env=env, timeout=60, check=True)
    config = yaml.safe_load(printed.stdout)
    for route in [config["route"], *config["route"]["routes"]]:
        for key in ("group_wait", "group_interval"):
            if key in route:
                route[key] = "1s"
    return json.dumps(config)


@dataclass
class Stack:
    """The running servers."""

    prometheus: Prometheus
    alertmanager: Alertmanager
    webhook: Webhook
    normal: Source
    clarify: Source
    heavy: Source
    doomed: Source


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Three metrics sources, Alertmanager and a Prometheus scraping every second, all up."""
    binary = find_binary("prometheus")
    am_binary = find_binary("prometheus-alertmanager")
    workdir = tmp_path_factory.mktemp("prometheus")
    hook = Webhook()
    hook_server = _serve_webhook(hook)
    sink = f"http://127.0.0.1:{hook_server.server_address[1]}"
    sources = {
        NORMAL_JOB: Source(workdir, "normal", ["--seed", "1"], otlp_endpoint=sink,
                           samples=True),
        CLARIFY_JOB: Source(workdir, "clarify", ["--clarify-heavy", "--speed", "4",
                                                  "--seed", "2"]),
        HEAVY_JOB: Source(workdir, "heavy", ["--clarify-heavy", "--participants", "1",
                                              "--seed", "3"]),
        DOOMED_JOB: Source(workdir, "doomed", ["--participants", "2", "--seed", "4"]),
    }
    prometheus: Prometheus | None = None
    alertmanager: Alertmanager | None = None
    try:
        alertmanager = Alertmanager(am_binary, workdir, alertmanager_test_config(
            f"http://127.0.0.1:{hook_server.server_address[1]}"))
        for source in sources.values():
            source.wait_serving()
        alertmanager.wait_ready()
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                       "evaluation_interval": "1s"},
            "alerting": {"alertmanagers": [
                {"static_configs": [{"targets": [f"127.0.0.1:{alertmanager.port}"]}]}]},
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{s.port}"]}]}
                for job, s in sources.items()],
        }
        prometheus = Prometheus(binary, workdir, config, render_rules(
            interval=RULE_INTERVAL, for_=ALERT_FOR, overrides=read_overrides(DEMO_OVERRIDES)))
        prometheus.wait_ready()
        server = prometheus

        def targets_up() -> bool | None:
            active = server.api("targets")["data"]["activeTargets"]
            healthy = {t["labels"]["job"] for t in active if t["health"] == "up"}
            return True if set(sources) <= healthy else None

        eventually(targets_up, timeout=60, what="every scrape target to be up")
        yield Stack(prometheus, alertmanager, hook, sources[NORMAL_JOB],
                    sources[CLARIFY_JOB], sources[HEAVY_JOB], sources[DOOMED_JOB])
    except BaseException:
        if prometheus is not None:
            print(f"prometheus log:\n{prometheus.log_tail()}", file=sys.stderr)
        if alertmanager is not None:
            print(f"alertmanager log:\n{alertmanager.log_tail()}", file=sys.stderr)
        raise
    finally:
        if prometheus is not None:
            prometheus.stop()
        if alertmanager is not None:
            alertmanager.stop()
        for source in sources.values():
            source.stop()
        hook_server.shutdown()
        hook_server.server_close()
