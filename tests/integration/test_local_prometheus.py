"""deploy/prometheus/prometheus.local.yml (docs/quickstart.md, no Docker) works as shipped:
a real Prometheus loads it with its rules and scrapes a router serving on localhost.

The only change to the file is the two ports (the test cannot take 9464 and 9090 on a
shared machine); the rule path stays relative to the config, as a user runs it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml
from prometheus_client import CollectorRegistry

from turnrouter import AgentRouter, AgentTurn, Destination, DestinationResult
from turnrouter.ops import ALERTS, RECORDING_RULES
from turnrouter.telemetry import Telemetry, serve_metrics
from turnrouter.testing import OutputRecorder, ScriptedDecisions

from .prom import eventually, find_binary, free_port, http_get, stop_process, wait_until_ready

pytestmark = pytest.mark.integration

DEPLOY = Path(__file__).resolve().parents[2] / "deploy/prometheus"
LOCAL_CONFIG = DEPLOY / "prometheus.local.yml"
FLEET_RULES = DEPLOY / "rules-nats/turnrouter-nats.rules.yml"


def _fleet_rule_count() -> int:
    """The fleet's rules (turnrouter worker), which the local config loads as well."""
    groups = yaml.safe_load(FLEET_RULES.read_text(encoding="utf-8"))["groups"]
    return sum(len(group["rules"]) for group in groups)


class Echo(Destination):
    async def answer(self, turn: AgentTurn, *, started: Any) -> DestinationResult:
        await started()
        return DestinationResult(text=turn.query)


async def _one_turn(registry: CollectorRegistry) -> None:
    router = AgentRouter({"conversation": Echo("anything")}, ScriptedDecisions("conversation"),
                         output=OutputRecorder(), telemetry=Telemetry(registry=registry))
    await router.handle(AgentTurn("alice", "t1", "hello"))
    await router.stop()


def test_promtool_accepts_the_local_config_as_shipped() -> None:
    result = subprocess.run([find_binary("promtool"), "check", "config", str(LOCAL_CONFIG)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 2 rule files found" in result.stdout
    assert f"SUCCESS: {len(RECORDING_RULES) + len(ALERTS)} rules found" in result.stdout
    assert f"SUCCESS: {_fleet_rule_count()} rules found" in result.stdout


def test_a_real_prometheus_scrapes_localhost_with_the_local_config(tmp_path: Path) -> None:
    binary = find_binary("prometheus")
    registry = CollectorRegistry()
    anyio.run(_one_turn, registry)
    metrics = serve_metrics(0, registry=registry)
    app_port = metrics.port
    prom_port = free_port()
    text = LOCAL_CONFIG.read_text(encoding="utf-8")
    assert text.count('"localhost:9464"') == 1 and text.count('"localhost:9090"') == 1
    (tmp_path / "prometheus.local.yml").write_text(
        text.replace('"localhost:9464"', f'"localhost:{app_port}"')
            .replace('"localhost:9090"', f'"localhost:{prom_port}"'), encoding="utf-8")
    shutil.copytree(DEPLOY / "rules", tmp_path / "rules")
    shutil.copytree(DEPLOY / "rules-nats", tmp_path / "rules-nats")
    log_path = tmp_path / "prometheus.log"
    url = f"http://127.0.0.1:{prom_port}"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [binary, f"--config.file={tmp_path / 'prometheus.local.yml'}",
             f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
        try:
            wait_until_ready(lambda: http_get(f"{url}/-/ready", timeout=2.0)[0] == 200,
                             process, what="prometheus", log_path=log_path, overall=180.0)

            def rules_loaded() -> int | None:
                groups = json.loads(http_get(f"{url}/api/v1/rules")[1])["data"]["groups"]
                count = sum(len(group["rules"]) for group in groups)
                return count or None

            assert eventually(rules_loaded, timeout=60, what="rules") == (
                len(RECORDING_RULES) + len(ALERTS) + _fleet_rule_count())

            def scraped() -> float | None:
                query = urllib.parse.quote('sum(turnrouter_turns_total{job="turnrouter"})')
                body = json.loads(http_get(f"{url}/api/v1/query?query={query}")[1])
                result = body["data"]["result"]
                return float(result[0]["value"][1]) if result else None

            # The scrape interval is the shipped 15 s: the first scrape comes within it.
            assert eventually(scraped, timeout=90, what="a scrape of the app") == 1.0
        finally:
            stop_process(process)
            metrics.close()
