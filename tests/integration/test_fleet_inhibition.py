"""The shipped Alertmanager configuration, run for real, with the alerts of a NATS fleet
whose one worker is down: the fleet's alerts and the main rules' job-wide alerts stay
active (they are about the replicas still running, and every replica shares the job);
only the dead worker's own alerts (its instance) are held as suppressed by
TurnrouterTargetDown.

The alerts are posted to Alertmanager's API as Prometheus would send them: labelled as
the NATS compose stack labels them (no `cluster`, no `namespace`: Alertmanager compares a
missing label as empty, so `equal` matches) and as a Kubernetes fleet does.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from .prom import Alertmanager, eventually, find_binary

pytestmark = pytest.mark.integration

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
CONFIG = DEPLOY / "alertmanager/alertmanager.yml"
FLEET_RULES = DEPLOY / "prometheus/rules-nats/turnrouter-nats.rules.yml"
#: The fleet's alerts and severities (a test below keeps this the rule file's list).
FLEET = {"TurnrouterPartitionUnconsumed": "critical", "TurnrouterReplicaUnscraped": "warning",
         "TurnrouterFencedWrites": "warning", "TurnrouterReplicaNotServing": "warning",
         "TurnrouterInputBacklog": "critical"}


def test_every_fleet_alert_is_covered() -> None:
    shipped = {rule["alert"]: rule["labels"]["severity"]
               for group in yaml.safe_load(FLEET_RULES.read_text())["groups"]
               for rule in group["rules"] if "alert" in rule}
    assert shipped == FLEET


def _post(alertmanager: Alertmanager, alerts: list[dict[str, Any]]) -> None:
    request = urllib.request.Request(
        f"{alertmanager.url}/api/v2/alerts", data=json.dumps(alerts).encode(),
        headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert answer.status == 200


@pytest.mark.parametrize("where", [{}, {"cluster": "eu-1", "namespace": "turnrouter"}],
                         ids=["compose", "kubernetes"])
def test_one_dead_worker_mutes_only_its_own_alerts(where: dict[str, str],
                                              tmp_path: Path) -> None:
    alertmanager = Alertmanager(find_binary("prometheus-alertmanager"), tmp_path,
                                CONFIG.read_text())
    try:
        alertmanager.wait_ready()
        job = {**where, "job": "turnrouter"}
        fleet = [{"labels": {**job, "alertname": name, "severity": severity,
                             **({"instance": "worker-2:9464"}
                                if name == "TurnrouterReplicaNotServing" else {})}}
                 for name, severity in FLEET.items()]
        overloaded = [{"labels": {**job, "alertname": "TurnrouterOverloaded",
                                  "severity": "warning", "instance": instance}}
                      for instance in ("worker-1:9464", "worker-2:9464")]
        _post(alertmanager, [
            {"labels": {**job, "alertname": "TurnrouterTargetDown", "severity": "critical",
                        "instance": "worker-1:9464"}},
            {"labels": {**job, "alertname": "TurnrouterFailures", "severity": "critical"}},
            *overloaded, *fleet])

        def settled() -> dict[tuple[str, str | None], dict[str, Any]] | None:
            alerts = {(a["labels"]["alertname"], a["labels"].get("instance")): a
                      for a in alertmanager.alerts()}
            dead = alerts.get(("TurnrouterOverloaded", "worker-1:9464"))
            if len(alerts) < 4 + len(FLEET) or dead is None \
                    or dead["status"]["state"] != "suppressed":
                return None  # not yet inhibited: TurnrouterTargetDown not processed yet
            return alerts

        alerts = eventually(settled, timeout=60, what="the dead worker's alert inhibited")
        down = alerts[("TurnrouterTargetDown", "worker-1:9464")]
        assert down["status"]["state"] == "active"
        assert alerts[("TurnrouterOverloaded", "worker-1:9464")]["status"]["inhibitedBy"] == [
            down["fingerprint"]]
        for key in (("TurnrouterFailures", None), ("TurnrouterOverloaded", "worker-2:9464")):
            status = alerts[key]["status"]
            assert (status["state"], status["inhibitedBy"]) == ("active", []), (key, status)
        by_name = {name: alert for (name, _), alert in alerts.items()}
        for name in FLEET:
            status = by_name[name]["status"]
            assert (status["state"], status["inhibitedBy"]) == ("active", []), (name, status)
    finally:
        alertmanager.stop()
