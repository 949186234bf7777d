"""`turnrouter tune` against the real Prometheus scraping the router processes: it
computes what the tuning dashboard computes (a test holds them within 2 points)."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from turnrouter.ops import dashboards

from .conftest import NORMAL_JOB, Stack
from .prom import eventually

pytestmark = pytest.mark.integration

WINDOW = "2m"
TARGET = "0.3"


def _panel_exprs(title: str) -> dict[str, str]:
    (model,) = [m for m in dashboards().values() if m["uid"] == "turnrouter-acknowledgment-tuning"]
    (panel,) = [p for p in model["panels"] if p["title"] == title]
    return {t["refId"]: t["expr"] for t in panel["targets"]}


def _grafana(expr: str) -> str:
    """The query as Grafana sends it for job = the normal job, all routes, range WINDOW."""
    return (expr.replace("$job", NORMAL_JOB).replace("$route", ".*")
            .replace("$__range", WINDOW).replace("$max_ack_rate", TARGET))


def _tune_rows(output: str, route: str) -> dict[str, tuple[float, float]]:
    """delay -> (ack rate, needless rate) of `route`'s rows in tune's table."""
    rows = {}
    for line in output.splitlines():
        fields = line.split()
        if len(fields) >= 8 and fields[0] == route and fields[1].endswith("s"):
            rows[f"{float(fields[1][:-1]):g}"] = (float(fields[4][:-1]) / 100,
                                                  float(fields[5][:-1]) / 100)
    return rows


def test_tune_and_dashboard_agree_on_the_same_data(stack: Stack) -> None:
    """At one instant, over one window and job: tune's all-routes acknowledgment and
    needless rates per candidate delay are within 2 points of the dashboard's, and both
    recommend the same delay for the same target."""
    def enough() -> bool | None:
        result = stack.prometheus.query(
            f'sum(increase(turnrouter_first_response_seconds_count{{job="{NORMAL_JOB}"}}'
            f"[{WINDOW}]))")["data"]["result"]
        return True if result and float(result[0]["value"][1]) >= 300 else None

    eventually(enough, timeout=180, interval=1.0, what="300 first responses in Prometheus")
    at = time.time() - 2.0
    done = subprocess.run(
        [sys.executable, "-m", "turnrouter", "tune", "--prometheus", stack.prometheus.url,
         "--selector", f'job="{NORMAL_JOB}"', "--window", WINDOW, "--at", f"{at:.3f}",
         "--max-ack-rate", TARGET],
        capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode in (0, 1), done.stderr
    tune = _tune_rows(done.stdout, "(all)")
    assert len(tune) >= 10, done.stdout

    table = _panel_exprs("Which delay? What-if per candidate delay and route")
    dashboard: dict[str, list[float]] = {}
    for ref in ("B", "D"):  # all-routes ack rate, all-routes needless rate
        response = stack.prometheus.query(_grafana(table[ref]), at=at)
        assert response["status"] == "success", response
        for series in response["data"]["result"]:
            dashboard.setdefault(series["metric"]["delay"], []).append(float(series["value"][1]))
    assert set(dashboard) == set(tune)
    for delay, (ack, needless) in tune.items():
        assert abs(dashboard[delay][0] - ack) <= 0.02, (delay, dashboard[delay], ack)
        assert abs(dashboard[delay][1] - needless) <= 0.02, (delay, dashboard[delay], needless)

    (recommended_expr,) = _panel_exprs("Recommended delay").values()
    response = stack.prometheus.query(_grafana(recommended_expr), at=at)
    assert response["status"] == "success", response
    match = re.search(r"recommended acknowledgment_delay_secs=([0-9.]+) ", done.stdout)
    if match is None:  # no candidate meets the target: the dashboard shows none either
        assert response["data"]["result"] == [], done.stdout
    else:
        (value,) = [float(s["value"][1]) for s in response["data"]["result"]]
        assert value == pytest.approx(float(match.group(1)))
