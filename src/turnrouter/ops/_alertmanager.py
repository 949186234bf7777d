"""The Alertmanager configuration for the turnrouter alerts, built as data.

Receivers are set without editing the file: `python -m turnrouter.ops alertmanager
--pager-url URL --tickets-url URL --watchdog-url URL` (or the `TURNROUTER_ALERT_*_URL`
environment variables) writes the configuration with them; the checked-in
`deploy/alertmanager/alertmanager.yml` is the same file with placeholder addresses.

Routing: critical alerts page, warnings open a ticket, `TurnrouterWatchdog` goes to the
dead man's switch. Groups are per alert, group labels (cluster, namespace, job) and
route, with a 1-minute `group_interval`: a slow route's ticket is not held behind another
route's, and a new one is notified within `group_wait` (30 s) of firing.

Inhibition: a critical suppresses its own warning; `TurnrouterFailures` suppresses the
latency warnings of its job and the `TurnrouterRouteFailing` pages of its stage (one
incident, one page); `TurnrouterRouteFailing` the latency and acknowledgment warnings of
its route; `TurnrouterTargetDown` suppresses the other alerts of its
own instance (a dead router's windows are meaningless; not its job's, whose other
replicas may still run) and `TurnrouterJobDown` (no router of the job up; it notifies
nobody) the warnings of its job, except the NATS fleet's in both cases: those are about the
replicas still running (one dead worker is when `TurnrouterPartitionUnconsumed`
matters), and all replicas of a fleet share one job.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from .._redact import redact_url
from ._fleet import FLEET_ALERTS
from ._rules import ALERTS, GROUP_LABELS, check_group_labels

__all__ = [
    "ALERTMANAGER_ENV",
    "ALERTMANAGER_FILE",
    "PLACEHOLDER_URLS",
    "alertmanager_config",
    "receiver_urls",
    "render_alertmanager",
]

ALERTMANAGER_FILE = "deploy/alertmanager/alertmanager.yml"
#: Receiver -> the environment variable that sets its webhook address.
ALERTMANAGER_ENV: Mapping[str, str] = {
    "pager": "TURNROUTER_ALERT_PAGER_URL",
    "tickets": "TURNROUTER_ALERT_TICKETS_URL",
    "watchdog": "TURNROUTER_ALERT_WATCHDOG_URL",
}
#: The checked-in file's addresses (`.invalid` never resolves).
PLACEHOLDER_URLS: Mapping[str, str] = {
    name: f"http://alert-{name}.invalid/turnrouter" for name in ALERTMANAGER_ENV}
WATCHDOG = "TurnrouterWatchdog"
#: Fires while no router of a job is up; notifies nobody, holds the job's warnings.
JOB_DOWN = "TurnrouterJobDown"
_AVAILABILITY = ("TurnrouterTargetDown", "TurnrouterAbsent")
_LATENCY_WARNINGS = ("TurnrouterSlowFirstResponse", "TurnrouterDecisionSlow",
                     "TurnrouterAcknowledgmentOveruse")
FAILURES = "TurnrouterFailures"
ROUTE_FAILING = "TurnrouterRouteFailing"
#: The per-route warnings a failing route's page holds.
_ROUTE_WARNINGS = ("TurnrouterSlowFirstResponse", "TurnrouterAcknowledgmentOveruse")


def _check_url(name: str, url: object) -> str:
    if not isinstance(url, str) or not url.startswith(("http://", "https://")) \
            or not url.isprintable() or len(url) > 2000 or any(c.isspace() for c in url):
        raise ValueError(f"the {name} receiver's URL must be an http(s) address without "
                         f"spaces, got {redact_url(str(url))[:100]!r}")
    return url


def receiver_urls(given: Mapping[str, str | None] | None = None,
                  environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Each receiver's address: `given`, else its `ALERTMANAGER_ENV` variable, else the
    placeholder (ValueError naming a malformed one, or an empty one: `--pager-url
    "$PAGER_URL"` with the variable unset would ship the placeholder pager)."""
    env = os.environ if environ is None else environ
    out = {}
    for name, variable in ALERTMANAGER_ENV.items():
        url = (given or {}).get(name)
        if url is None:
            url = env.get(variable)
        if url is not None and not url.strip():
            raise ValueError(f"the {name} receiver's address (--{name}-url or {variable}) is "
                             "empty: give its webhook URL")
        out[name] = _check_url(name, url or PLACEHOLDER_URLS[name])
    return out


def alertmanager_config(urls: Mapping[str, str] | None = None,
                        group_labels: Sequence[str] = GROUP_LABELS) -> dict[str, Any]:
    """The configuration (a dict), with `urls` by receiver (default: `receiver_urls()`
    from the environment)."""
    chosen = receiver_urls(urls)
    labels = list(check_group_labels(group_labels))
    assert {WATCHDOG, JOB_DOWN, FAILURES, ROUTE_FAILING} <= {a.alert for a in ALERTS}
    # The fleet's alerts outlive one dead replica: its job is the whole fleet's.
    fleet = tuple(alert["alert"] for alert in FLEET_ALERTS)
    others = "|".join((*_AVAILABILITY, WATCHDOG, JOB_DOWN, *fleet))
    return {
        "route": {
            "receiver": "tickets",
            "group_by": ["alertname", *labels, "route"],
            "group_wait": "30s",
            "group_interval": "1m",
            "repeat_interval": "4h",
            "routes": [
                {"receiver": "watchdog", "matchers": [f'alertname="{WATCHDOG}"'],
                 "group_wait": "0s", "group_interval": "1m", "repeat_interval": "5m"},
                {"receiver": "silent", "matchers": [f'alertname="{JOB_DOWN}"']},
                {"receiver": "pager", "matchers": ['severity="critical"'],
                 "group_wait": "10s", "repeat_interval": "1h"},
                {"receiver": "tickets", "matchers": ['severity="warning"']},
            ],
        },
        "inhibit_rules": [
            {"source_matchers": ['severity="critical"'],
             "target_matchers": ['severity="warning"'],
             "equal": ["alertname", *labels]},
            {"source_matchers": ['alertname="TurnrouterFailures"'],
             "target_matchers": ['severity="warning"',
                                 f'alertname=~"{"|".join(_LATENCY_WARNINGS)}"'],
             "equal": labels},
            # One incident, one page: while the job fails at a stage, the route pages of
            # that stage are held (the job-wide page fires first for a route with more
            # than about a fifth of the turns; a smaller route's page fires first and
            # is held from then on). Another stage's route page still pages.
            {"source_matchers": [f'alertname="{FAILURES}"'],
             "target_matchers": [f'alertname="{ROUTE_FAILING}"'],
             "equal": [*labels, "stage"]},
            # A failing route looks slow or needlessly acknowledged too: its own
            # latency and acknowledgment tickets are held (other routes' are not).
            {"source_matchers": [f'alertname="{ROUTE_FAILING}"'],
             "target_matchers": ['severity="warning"',
                                 f'alertname=~"{"|".join(_ROUTE_WARNINGS)}"'],
             "equal": [*labels, "route"]},
            # Only the dead target's own alerts (those labelled with its instance): a
            # job-wide alert is about the replicas still running too (one dead replica
            # of three muted the others' pages), and it clears by itself once no
            # replica of the job is up (`turnrouter:up:max`).
            {"source_matchers": ['alertname="TurnrouterTargetDown"'],
             "target_matchers": ['alertname=~"Turnrouter.+"', f'alertname!~"{others}"'],
             "equal": [*labels, "instance"]},
            # No router of the job up: its job-wide alerts' windows outlive the routers,
            # and a warning that `keep_firing_for` holds would open a ticket once the
            # alert inhibiting it (TurnrouterFailures) cleared at the death (ops13 D1).
            # Warnings only: one failed scrape of a one-replica job must not mute its
            # pages (they clear by themselves once no target is up).
            {"source_matchers": [f'alertname="{JOB_DOWN}"'],
             "target_matchers": ['severity="warning"', f'alertname!~"{others}"'],
             "equal": list(labels)},
        ],
        "receivers": [
            *({"name": name, "webhook_configs": [
                {"url": chosen[name], "send_resolved": name != "watchdog"}]}
              for name in ("pager", "tickets", "watchdog")),
            {"name": "silent"},  # (TurnrouterJobDown: an inhibitor, no notification)
        ],
    }


HEADER = """\
# Generated by `python -m turnrouter.ops` (src/turnrouter/ops/_alertmanager.py).
# Set the receivers without editing this file:
#   python -m turnrouter.ops alertmanager --pager-url URL --tickets-url URL \\
#       --watchdog-url URL > alertmanager.yml
# or with TURNROUTER_ALERT_PAGER_URL, TURNROUTER_ALERT_TICKETS_URL and
# TURNROUTER_ALERT_WATCHDOG_URL set (docs/operations.md). Critical alerts page, warnings
# open a ticket, TurnrouterWatchdog (always firing) reaches the dead man's switch; groups
# are per alert, cluster, namespace, job and route. A critical inhibits its own warning;
# TurnrouterFailures the latency warnings of its job and the TurnrouterRouteFailing pages
# of its stage; TurnrouterRouteFailing the latency and acknowledgment warnings of its
# route; TurnrouterTargetDown the other
# alerts of its own instance (not its job's: other replicas may still run) and
# TurnrouterJobDown (no router of the job up; notifies nobody) the warnings of its job,
# both but the NATS fleet's.
"""


def _placeholder_note(urls: Mapping[str, str]) -> str:
    """What the header says about the receivers still at their placeholder address."""
    left = [name for name, url in urls.items() if url == PLACEHOLDER_URLS.get(name)]
    if not left:
        return ""
    if len(left) == len(PLACEHOLDER_URLS):
        return "# The addresses below are placeholders.\n"
    if len(left) == 1:
        return f"# The {left[0]} address below is a placeholder.\n"
    return f"# The {' and '.join(left)} addresses below are placeholders.\n"


def render_alertmanager(urls: Mapping[str, str] | None = None,
                        group_labels: Sequence[str] = GROUP_LABELS) -> str:
    """The configuration as YAML text; its header calls the receivers' addresses
    placeholders only when they are."""
    from ._yaml import dump

    config = alertmanager_config(urls, group_labels)
    chosen = {receiver["name"]: receiver["webhook_configs"][0]["url"]
              for receiver in config["receivers"] if "webhook_configs" in receiver}
    return HEADER + _placeholder_note(chosen) + dump(config)
