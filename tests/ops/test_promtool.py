"""promtool checks the rule file and the Prometheus config, and runs the rule unit tests."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from turnrouter.ops import ALERTS, RECORDING_RULES, read_overrides, render_rules

from .conftest import DEPLOY, require_binary
from .scenarios import INTERVALS, TESTS_DIR
from .scenarios import files as scenario_files

DEMO_OVERRIDES = DEPLOY / "prometheus/overrides.demo.yml"
FLEET_RULES = DEPLOY / "prometheus/rules-nats/turnrouter-nats.rules.yml"


def fleet_alerts() -> list[dict[str, Any]]:
    """The alerts of the NATS fleet's rule file."""
    return [rule for group in yaml.safe_load(FLEET_RULES.read_text())["groups"]
            for rule in group["rules"] if "alert" in rule]


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require_binary("promtool"), *args], capture_output=True, text=True,
                          timeout=120, check=False)


def test_promtool_check_rules() -> None:
    """`promtool check rules` accepts the generated rule file (one for everyone)."""
    result = _promtool("check", "rules", str(DEPLOY / "prometheus/rules/turnrouter.rules.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    """`promtool test rules`: every rule and alert firing, quiet, held and idle."""
    result = _promtool("test", "rules",
                       str(DEPLOY / "prometheus/tests/turnrouter.rules.test.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_can_fail(tmp_path: Path) -> None:
    """A wrong threshold makes the promtool tests fail (the tests do test something)."""
    rules = (DEPLOY / "prometheus/rules/turnrouter.rules.yml").read_text()
    (tmp_path / "rules").mkdir()
    assert "turnrouter:clarified_participants:ratio > 0.25" in rules
    (tmp_path / "rules/turnrouter.rules.yml").write_text(
        rules.replace("turnrouter:clarified_participants:ratio > 0.25",
                      "turnrouter:clarified_participants:ratio > 0.6"))
    (tmp_path / "tests").mkdir()
    tests = DEPLOY / "prometheus/tests/turnrouter.rules.test.yml"
    (tmp_path / "tests" / tests.name).write_text(tests.read_text())
    result = _promtool("test", "rules", str(tmp_path / "tests" / tests.name))
    assert result.returncode != 0
    assert "TurnrouterHighClarificationRate" in result.stdout + result.stderr


def _rule_files_where_compose_mounts_them(compose: str, tmp_path: Path) -> Path:
    """The compose file's Prometheus config, written under `tmp_path` with each container
    path of its `rule_files` replaced by the host directory compose mounts there (a glob
    whose directory is not mounted stays as it is, and finds nothing)."""
    compose_file = DEPLOY / "compose" / compose
    service = yaml.safe_load(compose_file.read_text())["services"]["prometheus"]
    mounts = {}
    for volume in service["volumes"]:
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            mounts[target] = (compose_file.parent / source).resolve()
    config_flag = next(f for f in service["command"] if f.startswith("--config.file="))
    config = yaml.safe_load(mounts[config_flag.split("=", 1)[1]].read_text())
    config["rule_files"] = [
        str(mounts[str(Path(glob).parent)] / Path(glob).name)
        if str(Path(glob).parent) in mounts else glob for glob in config["rule_files"]]
    local = tmp_path / "prometheus.yml"
    local.write_text(yaml.safe_dump(config))
    return local


@pytest.mark.parametrize(("compose", "rules"), [
    ("compose.yaml", len(RECORDING_RULES) + len(ALERTS)),
    # The fleet loads the main rules (TurnrouterTargetDown, TurnrouterAbsent) too.
    ("compose.nats.yaml", len(RECORDING_RULES) + len(ALERTS) + len(fleet_alerts()))])
def test_promtool_check_config_of_the_compose_prometheus(compose: str, rules: int,
                                                         tmp_path: Path) -> None:
    """Each compose Prometheus config is valid, with its rule files where compose mounts
    them, and loads every rule of the stack: the demo's the main rule file, the NATS
    fleet's the main rule file and the fleet's."""
    local = _rule_files_where_compose_mounts_them(compose, tmp_path)
    result = _promtool("check", "config", str(local))
    assert result.returncode == 0, result.stdout + result.stderr
    found = [int(n) for n in re.findall(r"SUCCESS: (\d+) rules found", result.stdout)]
    assert sum(found) == rules, result.stdout


def test_promtool_unit_tests_of_per_route_overrides(tmp_path: Path) -> None:
    """Rules generated with the demo's overrides: routes slow by design do not page,
    other routes keep the defaults, and an overridden route pages above its own bound."""
    tests = DEPLOY / "prometheus/tests/overrides.test.yml"
    # The test file reads the shipped rule file (one rule set for everyone), as written.
    result = _promtool("test", "rules", str(tests))
    assert result.returncode == 0, result.stdout + result.stderr
    # The same tests pass on rules rendered now with the demo's overrides ...
    (tmp_path / "tests").mkdir()
    (tmp_path / "rules").mkdir()
    (tmp_path / "tests" / tests.name).write_text(tests.read_text())
    rules = tmp_path / "rules/turnrouter.rules.yml"
    rules.write_text(render_rules(overrides=read_overrides(DEMO_OVERRIDES)))
    result = _promtool("test", "rules", str(tmp_path / "tests" / tests.name))
    assert result.returncode == 0, result.stdout + result.stderr
    # ... and without the overrides the same data pages for the slow-by-design route.
    rules.write_text(render_rules())
    result = _promtool("test", "rules", str(tmp_path / "tests" / tests.name))
    assert result.returncode != 0
    assert "route=\"travel\"" in result.stdout + result.stderr


@pytest.mark.parametrize("interval", sorted(INTERVALS))
def test_every_alert_behaviour_at_each_scrape_interval(interval: str) -> None:
    """A broad incident pages within 3 minutes, one loud client never pages, a dead router
    pages TargetDown and opens no late ticket, normal traffic raises nothing, absent
    metrics page, a slow route opens its own ticket: at 15 s, 30 s and 1 min scrape (and
    evaluation) intervals."""
    result = _promtool("test", "rules", str(TESTS_DIR / f"scrape-{interval}.test.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_scrape_interval_scenarios_are_current() -> None:
    """The checked-in scenario files are what tests/ops/scenarios.py builds
    (regenerate with `python -m tests.ops.scenarios`)."""
    for path, text in scenario_files().items():
        assert path.read_text() == text, f"{path.name} is stale"


def test_scrape_interval_scenarios_catch_a_late_ticket(tmp_path: Path) -> None:
    """Without the `up` gate the 15 s scenario of a dying router fails: its warning
    fires after the router died (the scenarios test something)."""
    rules = (DEPLOY / "prometheus/rules/turnrouter.rules.yml").read_text()
    (tmp_path / "rules").mkdir()
    (tmp_path / "rules/turnrouter.rules.yml").write_text(
        rules.replace("turnrouter:up:max > 0", "turnrouter:up:max > -1"))
    (tmp_path / "tests").mkdir()
    scenario = TESTS_DIR / "scrape-15s.test.yml"
    (tmp_path / "tests" / scenario.name).write_text(scenario.read_text())
    result = _promtool("test", "rules", str(tmp_path / "tests" / scenario.name))
    assert result.returncode != 0
    assert "TurnrouterHighClarificationRate" in result.stdout + result.stderr
