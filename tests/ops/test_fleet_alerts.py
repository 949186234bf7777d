"""promtool runs the NATS fleet's backlog alert at 15 s and 1 min scrape (and evaluation)
intervals: a backlog pages within minutes and resolves when it is gone; too few inputs
and a fleet keeping up stay quiet."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import DEPLOY, require_binary

TESTS = DEPLOY / "prometheus/tests-nats"
RULES = DEPLOY / "prometheus/rules-nats/turnrouter-nats.rules.yml"
RUNBOOK = DEPLOY.parent / "docs/runbook.md"
THRESHOLD = "  > 2.5\n"
FLEET_ALERTS = [rule for group in yaml.safe_load(RULES.read_text())["groups"]
                for rule in group["rules"] if "alert" in rule]


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require_binary("promtool"), *args], capture_output=True,
                          text=True, timeout=120, check=False)


@pytest.mark.parametrize("interval", ["15s", "1m"])
def test_the_backlog_alert_at_each_scrape_interval(interval: str) -> None:
    """TurnrouterInputBacklog: quiet before, firing 7 min into a backlog, resolved 10 min
    after it ended; quiet for a handful of slow inputs and for a fleet keeping up."""
    result = _promtool("test", "rules", str(TESTS / f"backlog-{interval}.test.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_backlog_tests_catch_a_wrong_threshold(tmp_path: Path) -> None:
    """A threshold above the backlog's p95 makes the tests fail (they test something)."""
    rules = RULES.read_text()
    assert THRESHOLD in rules
    (tmp_path / "rules-nats").mkdir()
    (tmp_path / "rules-nats" / RULES.name).write_text(rules.replace(THRESHOLD, "  > 12\n"))
    (tmp_path / "tests").mkdir()
    shutil.copy(TESTS / "backlog-15s.test.yml", tmp_path / "tests")
    result = _promtool("test", "rules", str(tmp_path / "tests/backlog-15s.test.yml"))
    assert result.returncode != 0
    assert "TurnrouterInputBacklog" in result.stdout + result.stderr


@pytest.mark.parametrize("rule", FLEET_ALERTS, ids=lambda rule: rule["alert"])
def test_runbook_section_matches_the_fleet_alert(rule: dict[str, Any]) -> None:
    """Each fleet alert's runbook section names its severity, its hold time and the
    thresholds of its expression as the rule file has them (the runbook cannot drift
    from the rules)."""
    text = RUNBOOK.read_text()
    start = text.index(f"\n## {rule['alert']}\n")
    end = text.find("\n## ", start + 1)
    section = " ".join(text[start:end if end > 0 else None].split())
    minutes = int(rule["for"].removesuffix("m"))
    assert f"for {minutes} minute" in section
    assert rule["labels"]["severity"] in section.lower()
    for number in re.findall(r">=?\s*([0-9.]+)", rule["expr"]):
        assert float(number) == 0 or number in section, number


@pytest.mark.parametrize("interval", ["15s", "1m"])
def test_a_fleet_serving_nobody_pages_through_restart_gaps(interval: str) -> None:
    """TurnrouterFleetNotServing (operator18 H1): a server outage pages within 5 minutes
    (6 at a 1-minute scrape) although every worker exits after --reconnect-for and fails a
    scrape each minute, and resolves once a replica serves; a healthy fleet with failed
    scrapes, one replica restarting in a loop beside a serving one, and a fleet taking
    90 s to connect stay quiet."""
    result = _promtool("test", "rules", str(TESTS / f"not-serving-{interval}.test.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_not_serving_tests_catch_an_alert_on_the_latest_sample(tmp_path: Path) -> None:
    """On the latest sample instead of a window, each restart gap resets the alert's
    `for:` and the outage pages nobody: the tests fail (what operator18 saw)."""
    rules = RULES.read_text()
    windowed = "(max_over_time(turnrouter_nats_serving[3m]))"
    assert windowed in rules
    (tmp_path / "rules-nats").mkdir()
    (tmp_path / "rules-nats" / RULES.name).write_text(
        rules.replace(windowed, "(turnrouter_nats_serving)"))
    (tmp_path / "tests").mkdir()
    for interval in ("15s", "1m"):
        shutil.copy(TESTS / f"not-serving-{interval}.test.yml", tmp_path / "tests")
        result = _promtool("test", "rules",
                           str(tmp_path / f"tests/not-serving-{interval}.test.yml"))
        assert result.returncode != 0, interval
        assert "a server outage pages" in result.stdout + result.stderr
