"""The NATS compose stack's Prometheus (deploy/compose/compose.nats.yaml with
deploy/prometheus/prometheus.nats.yml), run for real: it loads the main rules beside the
fleet's, so TurnrouterTargetDown goes pending when every worker is gone.

Docker cannot run here: the config's rule globs point where compose mounts them from,
its three worker targets at local ports held refusing connections (the workers are dead), its
own target at its test port, and its intervals at 1 s so the test takes seconds.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from turnrouter.ops import ALERTS, RECORDING_RULES

from .prom import (
    eventually,
    find_binary,
    free_port,
    http_get,
    refusing_ports,
    stop_process,
    wait_until_ready,
)

pytestmark = pytest.mark.integration

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
COMPOSE = DEPLOY / "compose/compose.nats.yaml"
FLEET_RULES = DEPLOY / "prometheus/rules-nats/turnrouter-nats.rules.yml"


def _config_as_compose_runs_it(prom_port: int, dead: list[int]) -> dict[str, Any]:
    """prometheus.nats.yml as the compose Prometheus reads it, each rule glob resolved
    through the service's bind mounts, its targets local."""
    service = yaml.safe_load(COMPOSE.read_text())["services"]["prometheus"]
    mounts = {target: (COMPOSE.parent / source).resolve() for source, target, *_ in
              (volume.split(":") for volume in service["volumes"]) if source.startswith(".")}
    config_flag = next(f for f in service["command"] if f.startswith("--config.file="))
    config: dict[str, Any] = yaml.safe_load(mounts[config_flag.split("=", 1)[1]].read_text())
    config["rule_files"] = [str(mounts[str(Path(glob).parent)] / Path(glob).name)
                            for glob in config["rule_files"]]
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    for job in config["scrape_configs"]:
        targets = job["static_configs"][0]["targets"]
        if job["job_name"] == "prometheus":
            job["static_configs"][0]["targets"] = [f"127.0.0.1:{prom_port}"]
        else:  # the workers: ports that refuse every connection
            assert len(targets) <= len(dead)
            job["static_configs"][0]["targets"] = [f"127.0.0.1:{port}"
                                                   for port in dead[:len(targets)]]
    return config


def test_the_nats_compose_prometheus_loads_the_main_and_the_fleet_rules(
        tmp_path: Path) -> None:
    binary = find_binary("prometheus")
    fleet = [rule["alert"] for group in yaml.safe_load(FLEET_RULES.read_text())["groups"]
             for rule in group["rules"] if "alert" in rule]
    config_path = tmp_path / "prometheus.yml"
    log_path = tmp_path / "prometheus.log"
    # The dead workers' ports stay bound for the whole test: a port merely free when
    # picked can be taken by any server started meanwhile, which then answers the scrape.
    with refusing_ports(3) as dead, log_path.open("wb") as log:
        prom_port = free_port()  # after the dead ports are held: never one of them
        url = f"http://127.0.0.1:{prom_port}"
        config_path.write_text(json.dumps(_config_as_compose_runs_it(prom_port, dead)))
        process = subprocess.Popen(
            [binary, f"--config.file={config_path}",
             f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
        try:
            wait_until_ready(lambda: http_get(f"{url}/-/ready", timeout=2.0)[0] == 200,
                             process, what="prometheus", log_path=log_path, overall=180.0)

            def rule_types() -> list[str] | None:
                groups = json.loads(http_get(f"{url}/api/v1/rules")[1])["data"]["groups"]
                rules = [rule for group in groups for rule in group["rules"]]
                return [rule["type"] for rule in rules] or None  # the files load at once

            assert len(eventually(rule_types, timeout=60, what="the rules")) == (
                len(RECORDING_RULES) + len(ALERTS) + len(fleet))
            groups = json.loads(http_get(f"{url}/api/v1/rules")[1])["data"]["groups"]
            loaded = sorted(rule["name"] for group in groups for rule in group["rules"]
                            if rule["type"] == "alerting")
            assert loaded == sorted([alert.alert for alert in ALERTS] + fleet)
            assert {"TurnrouterTargetDown", "TurnrouterAbsent"} <= set(loaded)

            def target_down() -> int | None:
                alerts = json.loads(http_get(f"{url}/api/v1/alerts")[1])["data"]["alerts"]
                down = [a for a in alerts if a["labels"]["alertname"] == "TurnrouterTargetDown"]
                return len(down) if len(down) == 3 else None

            # Every worker is gone: one TurnrouterTargetDown per worker (pending: `for: 1m`).
            try:
                assert eventually(target_down, timeout=60, what="TurnrouterTargetDown") == 3
            except AssertionError as exc:  # say what Prometheus saw of each target
                targets = json.loads(http_get(f"{url}/api/v1/targets")[1])["data"]
                seen = [(t["scrapeUrl"], t["health"], t["lastError"])
                        for t in targets["activeTargets"]]
                raise AssertionError(f"{exc}; targets: {seen}") from exc
        finally:
            stop_process(process)
