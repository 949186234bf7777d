"""The shipped Alertmanager configuration: valid for `amtool`, routes every alert by
severity, and inhibits the warning while the critical of the same alert and job fires."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from turnrouter.ops import (
    ALERTMANAGER_ENV,
    ALERTS,
    PLACEHOLDER_URLS,
    RECORDING_RULES,
    AlertRule,
    receiver_urls,
    render_alertmanager,
)

from .conftest import DEPLOY, require_binary

CONFIG = DEPLOY / "alertmanager/alertmanager.yml"
FLEET_RULES = DEPLOY / "prometheus/rules-nats/turnrouter-nats.rules.yml"
RECEIVER = {"critical": "pager", "warning": "tickets", "none": "watchdog"}


def _amtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = require_binary("amtool")
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=60,
                          check=False)


def test_amtool_check_config() -> None:
    """`amtool check-config` accepts the configuration (routes, inhibit rules, receivers)."""
    result = _amtool("check-config", str(CONFIG))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
    assert "6 inhibit rules" in result.stdout


@pytest.mark.parametrize("alert", ALERTS, ids=lambda a: f"{a.alert}-{a.severity}")
def test_every_alert_routes_to_its_severity_receiver(alert: object) -> None:
    """`amtool config routes test`: criticals page, warnings open tickets."""
    severity = alert.severity  # type: ignore[attr-defined]
    receiver = "silent" if alert.alert == "TurnrouterJobDown" else RECEIVER[severity]  # type: ignore[attr-defined]
    result = _amtool("config", "routes", "test", f"--config.file={CONFIG}",
                     f"--verify.receivers={receiver}",
                     f"alertname={alert.alert}", f"severity={severity}",  # type: ignore[attr-defined]
                     "job=turnrouter")
    assert result.returncode == 0, result.stdout + result.stderr


def test_routes_test_can_fail() -> None:
    """A warning does not resolve to the pager (the routing test tests something)."""
    result = _amtool("config", "routes", "test", f"--config.file={CONFIG}",
                     "--verify.receivers=pager", "alertname=TurnrouterDecisionSlow",
                     "severity=warning")
    assert result.returncode != 0


def test_warning_is_inhibited_by_the_critical_of_the_same_alert_and_job() -> None:
    """The first inhibit rule: critical suppresses warning with equal alertname and job,
    and every alert name that has both severities is covered by it."""
    config = yaml.safe_load(CONFIG.read_text())
    rule = config["inhibit_rules"][0]
    assert rule["source_matchers"] == ['severity="critical"']
    assert rule["target_matchers"] == ['severity="warning"']
    assert set(rule["equal"]) == {"alertname", "cluster", "namespace", "job"}
    both = {a.alert for a in ALERTS if a.severity == "critical"} & {
        a.alert for a in ALERTS if a.severity == "warning"}
    assert "TurnrouterHighClarificationRate" in both


def test_target_down_inhibits_no_fleet_alert() -> None:
    """TurnrouterTargetDown of one NATS worker mutes none of the fleet's alerts: they are
    about the replicas still running, and every replica of a fleet shares its job (the
    real Alertmanager check: tests/integration/test_fleet_inhibition.py)."""
    config = yaml.safe_load(CONFIG.read_text())
    (rule,) = [r for r in config["inhibit_rules"]
               if r["source_matchers"] == ['alertname="TurnrouterTargetDown"']]
    (excluded,) = [m for m in rule["target_matchers"] if m.startswith("alertname!~")]
    pattern = re.compile(excluded.removeprefix("alertname!~").strip('"'))
    fleet = [rule["alert"] for group in yaml.safe_load(FLEET_RULES.read_text())["groups"]
             for rule in group["rules"] if "alert" in rule]
    assert fleet and all(pattern.fullmatch(name) for name in fleet)
    assert not pattern.fullmatch("TurnrouterFailures")  # the main rules: its instance's muted
    assert rule["equal"][-1] == "instance"  # a job-wide alert is not one dead replica's


def test_broken_config_is_rejected(tmp_path: Path) -> None:
    """amtool rejects an inhibit rule with an invalid matcher (the check checks)."""
    broken = tmp_path / "alertmanager.yml"
    text = CONFIG.read_text()
    assert "- severity=\"critical\"" in text
    broken.write_text(text.replace("- severity=\"critical\"", "- severity=~\"(critical\"", 1))
    result = _amtool("check-config", str(broken))
    assert result.returncode != 0


RUNBOOK = DEPLOY.parent / "docs/runbook.md"


def _section(text: str, alert: str) -> str:
    start = text.index(f"## {alert}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


@pytest.mark.parametrize("alert", ALERTS, ids=lambda a: f"{a.alert}-{a.severity}")
def test_runbook_section_matches_what_ships(alert: object) -> None:
    """Each alert's runbook section names its hold time, its threshold and its traffic
    floor as the rule file has them (the runbook cannot drift from the rules)."""
    assert isinstance(alert, AlertRule)
    if alert.raw:  # availability and watchdog: no threshold, no floor
        assert f"## {alert.alert}" in RUNBOOK.read_text()
        return
    section = " ".join(_section(RUNBOOK.read_text(), alert.alert).split())
    assert f"for {alert.for_.removesuffix('m')} minute" in section
    seconds = alert.alert in {"TurnrouterSlowFirstResponse", "TurnrouterDeadAir",
                              "TurnrouterDecisionSlow", "TurnrouterSaturated"}
    if alert.alert == "TurnrouterOverloaded":  # a mean state (0, 1, 2), not a ratio
        shown = f"above {alert.threshold:g}"
    else:
        shown = f"{alert.threshold:g} s" if seconds else f"{alert.threshold:.0%}"
    assert shown in section
    assert f"{alert.min_turns}" in section


OPERATIONS = RUNBOOK.parent / "operations.md"


@pytest.mark.parametrize("name", sorted({a.alert for a in ALERTS}))
def test_operations_page_lists_every_shipped_alert_and_recording(name: str) -> None:
    """docs/operations.md's alerts table has a row for every shipped alert, and its
    "Recorded:" list names every recording rule (the page cannot fall behind the rules)."""
    text = OPERATIONS.read_text()
    assert f"\n| {name} |" in text, f"{name} has no row in the alerts table"
    recorded = text[text.index("Recorded:"):text.index("Alerts and thresholds")]
    for rule in RECORDING_RULES:
        assert f"`{rule.record}`" in recorded, rule.record


def test_runbook_describes_the_shipped_inhibition() -> None:
    """The runbook's routing paragraph names the shipped Alertmanager file and rules."""
    text = RUNBOOK.read_text()
    assert "deploy/alertmanager/alertmanager.yml" in text
    assert "suppressed" in text and "`pager`" in text and "`tickets`" in text


def test_header_calls_only_placeholder_addresses_placeholders(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The generated file says its addresses are placeholders only when they are: the
    checked-in file says so, a configuration with your addresses does not, and one with
    some of them names the receivers still to set."""
    for variable in ALERTMANAGER_ENV.values():
        monkeypatch.delenv(variable, raising=False)
    assert "# The addresses below are placeholders." in CONFIG.read_text()
    yours = {"pager": "https://events.example.com/pager",
             "tickets": "https://tickets.example.com/hook",
             "watchdog": "https://hc.example.com/ping"}
    assert "placeholder" not in render_alertmanager(yours)
    text = render_alertmanager({"pager": yours["pager"]})
    assert "# The tickets and watchdog addresses below are placeholders." in text
    assert PLACEHOLDER_URLS["tickets"] in text and yours["pager"] in text


@pytest.mark.parametrize("url", ["ftp://u:hunter2secret@hooks.example/x",
                                 "https://u:hunter2secret@hooks.example/x y",
                                 "https://hooks.example/x?token=hunter2secret\n"])
def test_a_refused_receiver_url_does_not_show_its_password(url: str) -> None:
    """The error naming a malformed receiver URL masks its password and secret query
    values (webhook addresses often carry them)."""
    with pytest.raises(ValueError, match="pager receiver") as raised:
        receiver_urls({"pager": url}, environ={})
    assert "hunter2secret" not in str(raised.value)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["http", "https", "ftp", "HTTP", ""]), st.text(max_size=30),
       st.text(max_size=20).filter(lambda s: not any(c in s for c in "/?#@")),
       st.text(max_size=30))
def test_any_receiver_url_is_kept_or_refused_without_its_password(
        scheme: str, host: str, password: str, tail: str) -> None:
    """Any receiver address with a password: kept as given (it is the configuration),
    or a one-line ValueError naming the receiver that never shows the password."""
    secret = "S3CR3T" + password
    url = f"{scheme}://user:{secret}@{host}{tail}"
    try:
        urls = receiver_urls({"pager": url}, environ={})
    except ValueError as exc:
        message = str(exc)
        assert "pager receiver" in message and "\n" not in message.strip()
        assert "S3CR3T" not in message or "S3CR3T" in host + tail
        return
    assert urls["pager"] == url
