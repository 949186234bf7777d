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
FLEET = {"TurnrouterPartitionUnconsumed": "critical", "TurnrouterFleetNotServing": "critical",
         "TurnrouterReplicaUnscraped": "warning",
         "TurnrouterFencedWrites": "warning", "TurnrouterReplicaNotServing": "warning",
         "TurnrouterInputBacklog": "critical"}


def test_every_fleet_alert_is_covered() -> None:
    shipped = {rule["alert"]: rule["labels"]["severity"]
               for group in yaml.safe_load(FLEET_RULES.read_text())["groups"]
               for rule in group["rules"] if "alert" in rule}
    assert shipped == FLEET


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
        alertmanager.post([
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


@pytest.mark.parametrize("where", [{}, {"cluster": "eu-1", "namespace": "turnrouter"}],
                         ids=["compose", "kubernetes"])
def test_a_job_with_no_router_up_holds_its_job_wide_alerts(where: dict[str, str],
                                                          tmp_path: Path) -> None:
    """The job's last router died while TurnrouterFailures inhibited its slow-route
    warning: Failures clears at the death, but the warning, kept firing by
    keep_firing_for, would have opened a ticket before TargetDown paged (ops13 D1).
    TurnrouterJobDown holds the dead job's warnings (not its pages, not another job's,
    not the fleet's) and notifies nobody itself."""
    alertmanager = Alertmanager(find_binary("prometheus-alertmanager"), tmp_path,
                                CONFIG.read_text())
    try:
        alertmanager.wait_ready()
        dead, alive = {**where, "job": "turnrouter"}, {**where, "job": "turnrouter-eu"}
        slow = {"alertname": "TurnrouterSlowFirstResponse", "severity": "warning",
                "route": "weather"}
        alertmanager.post([
            {"labels": {**dead, "alertname": "TurnrouterJobDown", "severity": "none"}},
            {"labels": {**dead, "alertname": "TurnrouterTargetDown", "severity": "critical",
                        "instance": "router-1:9464"}},
            {"labels": {**dead, **slow}}, {"labels": {**alive, **slow}},
            {"labels": {**dead, "alertname": "TurnrouterInputBacklog",
                        "severity": "critical"}},
            {"labels": {**dead, "alertname": "TurnrouterDeadAir", "severity": "critical"}}])

        def settled() -> dict[tuple[str, str], dict[str, Any]] | None:
            alerts = {(a["labels"]["alertname"], a["labels"]["job"]): a
                      for a in alertmanager.alerts()}
            held = alerts.get(("TurnrouterSlowFirstResponse", "turnrouter"))
            if len(alerts) < 6 or held is None or held["status"]["state"] != "suppressed":
                return None  # TurnrouterJobDown not processed yet
            return alerts

        alerts = eventually(settled, timeout=60, what="the dead job's warning held")
        down = alerts[("TurnrouterJobDown", "turnrouter")]
        assert alerts[("TurnrouterSlowFirstResponse", "turnrouter")]["status"][
            "inhibitedBy"] == [down["fingerprint"]]
        for key in (("TurnrouterSlowFirstResponse", "turnrouter-eu"),
                    ("TurnrouterTargetDown", "turnrouter"),
                    ("TurnrouterInputBacklog", "turnrouter"), ("TurnrouterJobDown", "turnrouter"),
                    ("TurnrouterDeadAir", "turnrouter")):  # (a page: never muted by it)
            status = alerts[key]["status"]
            assert (status["state"], status["inhibitedBy"]) == ("active", []), (key, status)
        assert [receiver["name"] for receiver in down["receivers"]] == ["silent"]
    finally:
        alertmanager.stop()
