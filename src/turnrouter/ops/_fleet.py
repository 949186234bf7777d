"""The NATS runtime's fleet view: its Grafana dashboard and its alerts, generated.

The runtime's families (`turnrouter_nats_*`, docs/distributed.md "Telemetry") live in
`turnrouter.runtime.nats`, which needs nats-py, so they are named here rather than read
from `turnrouter.telemetry.METRICS`; a test checks every name against what a worker
exposes. Written by `python -m turnrouter.ops` with the other generated files.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._dashboards import (
    ALERT_WINDOW,
    JOB,
    RATE,
    _dashboard,
    _targets,
    _thresholds,
    _timeseries,
    _with_group_labels,
    render_dashboard,
)
from ._rules import GROUP_LABELS, RUNBOOK_URL, check_group_labels

__all__ = ["FLEET_ALERTS", "FLEET_DASHBOARD", "FLEET_K8S_RULE", "FLEET_RULES",
           "fleet_alerts", "fleet_dashboard", "fleet_files", "fleet_rule_groups"]

FLEET_DASHBOARD = "deploy/k8s/nats/turnrouter-fleet.json"
FLEET_RULES = "deploy/prometheus/rules-nats/turnrouter-nats.rules.yml"
FLEET_K8S_RULE = "deploy/k8s/nats/prometheusrule-nats.yaml"

_OWNED = "turnrouter_nats_partitions_owned"
_PARTITIONS = "turnrouter_nats_partitions"
_HEARD_OWNED = "turnrouter_nats_fleet_partitions_owned"
_HEARD_REPLICAS = "turnrouter_nats_fleet_replicas"
_REFUSED = "turnrouter_nats_state_writes_refused_total"
_WAIT = "turnrouter_nats_input_wait_seconds"
_SERVING = "turnrouter_nats_serving"
#: TurnrouterFleetNotServing: no replica of a job reported serving within this window
#: (longer than a worker's restart gap, a failed scrape or two), held for
#: `NOT_SERVING_FOR` (a fleet starting from nothing has that long to connect): it pages
#: this long after the last replica stopped serving, plus up to one scrape interval.
NOT_SERVING_WINDOW = "3m"
NOT_SERVING_FOR = "2m"
#: The input backlog alert: the delivery wait's p95 over 5 min above this many seconds
#: (a bucket bound: more than 5% of the inputs waited longer), over at least
#: `BACKLOG_MIN_INPUTS` inputs in 5 min.
BACKLOG_SECONDS = 2.5
BACKLOG_MIN_INPUTS = 150


def _rate(name: str, by: str, *matchers: str, window: str = RATE) -> str:
    selector = ", ".join((JOB, *matchers))
    return f"sum by ({by}) (rate({name}{{{selector}}}[{window}]))" if by else (
        f"sum(rate({name}{{{selector}}}[{window}]))")


def _quantile(q: float, family: str, by: str, *matchers: str, window: str = RATE) -> str:
    """A quantile of histogram `family` by `by`, only where the window holds
    observations: an idle fleet shows a gap, not NaN (as the main dashboards)."""
    grouped = f"{by}, le" if by else "le"
    selector = ", ".join((JOB, *matchers))
    return (f"histogram_quantile({q:g}, sum by ({grouped}) "
            f"(rate({family}_bucket{{{selector}}}[{window}])))\n"
            f"and on ({by}) (sum by ({by}) (rate({family}_count{{{selector}}}[{window}])) > 0)")


#: The fencing alert's threshold (TurnrouterFencedWrites), refused writes per second.
FENCED_WRITES_PER_SECOND = 0.1


def fleet_dashboard() -> dict[str, Any]:
    """`turnrouter-fleet`: ownership, failover and fencing per replica and in total."""
    write = "turnrouter_nats_state_write_seconds"
    panels = [
        _timeseries("Partitions owned per replica",
                    "Pinned partitions each replica consumes (balance: about partitions / "
                    "replicas).",
                    _targets((f"sum by (instance) ({_OWNED}{{{JOB}}})", "{{instance}}")),
                    unit="short"),
        _timeseries("Partitions: fleet total vs deployment",
                    "A gap means a partition nobody consumes (alert "
                    "TurnrouterPartitionUnconsumed), unless the replicas hear the fleet "
                    "own them all on presence (a replica not scraped: alert "
                    "TurnrouterReplicaUnscraped).",
                    _targets((f"sum by (job) ({_OWNED}{{{JOB}}})",
                              "{{job}} owned by the scraped replicas"),
                             (f"max by (job) ({_HEARD_OWNED}{{{JOB}}})",
                              "{{job}} owned, as the replicas hear it"),
                             (f"max by (job) ({_PARTITIONS}{{{JOB}}})", "{{job}} partitions")),
                    unit="short"),
        _timeseries("Turns per replica and total", "Turns each replica ran, and the fleet.",
                    _targets((_rate("turnrouter_turns_total", "instance"), "{{instance}}"),
                             (_rate("turnrouter_turns_total", ""), "fleet")),
                    unit="reqps"),
        _timeseries("Takeovers and partitions lost",
                    "A replica pinned after another owner (or none), and pins that moved "
                    "away or were handed over.",
                    _targets((_rate("turnrouter_nats_takeovers_total", "instance"),
                              "takeovers {{instance}}"),
                             (_rate("turnrouter_nats_partitions_lost_total", "instance, how"),
                              "{{how}} {{instance}}")),
                    unit="ops"),
        _timeseries("Refused state writes (fencing) and turns ended by a takeover",
                    "Refused writes: another replica claimed the participant. The dashed "
                    "line is TurnrouterFencedWrites' threshold for what it evaluates, each "
                    f"job's total over 5 minutes (over {FENCED_WRITES_PER_SECOND:g}/s for 10 "
                    "minutes). Failure text: turns found unfinished on a dead or paused "
                    "owner.",
                    _targets((_rate(_REFUSED, "instance"), "refused {{instance}}"),
                             (_rate(_REFUSED, "job", window=ALERT_WINDOW),
                              "refused {{job}}, 5m (TurnrouterFencedWrites)"),
                             (_rate("turnrouter_nats_inflight_failed_total", "instance"),
                              "failure text {{instance}}")),
                    unit="ops", draw="dashed",
                    thresholds=_thresholds(("green", None),
                                           ("red", FENCED_WRITES_PER_SECOND))),
        _timeseries("Redeliveries and duplicates dropped",
                    "Inputs delivered again (after a crash or a pause), inputs handled "
                    "already, outputs the stream dropped as duplicates.",
                    _targets((_rate("turnrouter_nats_redeliveries_total", "instance"),
                              "redelivered {{instance}}"),
                             (_rate("turnrouter_nats_duplicates_dropped_total", "where"),
                              "duplicate {{where}}")),
                    unit="ops"),
        _timeseries("State write latency",
                    "Revision-checked record writes: one per finished turn, one more for "
                    "a turn still running after mark_after.",
                    _targets((_quantile(0.5, write, ""), "p50"),
                             (_quantile(0.99, write, ""), "p99")),
                    unit="s"),
        _timeseries("Input wait",
                    "By stage: delivery (stored in the stream until a replica received "
                    "it; includes clock skew between hosts) and queued (received until "
                    "handled, behind the partition's previous message). A delivery p95 "
                    f"over {BACKLOG_SECONDS:g} s (the dashed line) is a backlog: "
                    "TurnrouterInputBacklog evaluates each job's delivery p95 over 5 "
                    "minutes, drawn as its own series. Queries past max_input_wait are "
                    "answered busy (rejected expired).",
                    _targets(*((_quantile(q, _WAIT, "stage"), f"p{name} {{{{stage}}}}")
                               for q, name in ((0.99, "99"), (0.95, "95"), (0.5, "50"))),
                             (_quantile(0.95, _WAIT, "job", 'stage="delivery"',
                                        window=ALERT_WINDOW),
                              "delivery p95 {{job}}, 5m (TurnrouterInputBacklog)")),
                    unit="s", draw="dashed",
                    thresholds=_thresholds(("green", None), ("red", BACKLOG_SECONDS))),
        _timeseries("Turns marked in flight, participants let go when idle",
                    "Turns still running after mark_after, recorded in flight before their "
                    "message was acknowledged (the others need no mark); participants let "
                    "go after idle_after without an input (their record keeps their state).",
                    _targets((_rate("turnrouter_nats_inflight_marks_total", "instance"),
                              "marked {{instance}}"),
                             (_rate("turnrouter_turns_total", "instance"),
                              "turns {{instance}}"),
                             (_rate("turnrouter_nats_idle_participants_total", "instance"),
                              "let go idle {{instance}}")),
                    unit="ops"),
        _timeseries("Rejected inputs and fleet timing samples",
                    "Inputs refused before the router (by reason) and first-response "
                    "samples shared with the fleet.",
                    _targets((_rate("turnrouter_runtime_rejected_messages_total", "reason",
                                    'topic="nats_input"'), "rejected {{reason}}"),
                             (_rate("turnrouter_nats_timing_samples_total", "direction"),
                              "samples {{direction}}")),
                    unit="ops"),
        _timeseries("Backpressure: held messages and superseded queries",
                    "A saturated replica holds its partition's next message until it is "
                    "ready again; a held query that a newer one of the same participant "
                    "follows is dropped unrun (docs/distributed.md).",
                    _targets((_rate("turnrouter_nats_backpressure_total", "instance, what"),
                              "{{what}} {{instance}}")),
                    unit="ops"),
        _timeseries("Replicas serving, and deployment parts recreated",
                    "Serving: started, connected to NATS, streams, consumers and bucket "
                    "there (the ready file). Heard vs scraped: replicas on presence "
                    "against those Prometheus scrapes (more heard: one is not scraped, "
                    "alert TurnrouterReplicaUnscraped). Recreated: a part found deleted "
                    "under a running replica, by part (docs/distributed.md).",
                    _targets((f"sum by (instance) (turnrouter_nats_serving{{{JOB}}})",
                              "serving {{instance}}"),
                             (f"max({_HEARD_REPLICAS}{{{JOB}}})", "replicas heard"),
                             (f"count({_HEARD_REPLICAS}{{{JOB}}})", "replicas scraped"),
                             (_rate("turnrouter_nats_deployment_missing_total", "part"),
                              "missing {{part}}")),
                    unit="short"),
    ]
    model = _dashboard("turnrouter-fleet", "turnrouter fleet (NATS runtime)",
                       "Router replicas on NATS JetStream: ownership, failover, fencing "
                       "(docs/distributed.md).", panels)
    model["tags"] = [*model["tags"], "nats"]
    return model


_DELIVERY = f'{_WAIT}_bucket{{stage="delivery"}}'


def fleet_alerts(group_labels: Sequence[str] = GROUP_LABELS) -> tuple[dict[str, Any], ...]:
    """The fleet's alerts, as they appear in the rule file, aggregated by
    `group_labels` (default cluster, namespace, job, as the main rules): two fleets whose
    worker Services share a name never merge (a healthy fleet hid one missing half its
    partitions)."""
    g = ", ".join(check_group_labels(group_labels))
    backlog: dict[str, Any] = {
        "alert": "TurnrouterInputBacklog",
        "expr": (f"histogram_quantile(0.95, sum by ({g}, le) (rate({_DELIVERY}[5m])))\n"
                 f"  > {BACKLOG_SECONDS:g}\nand on ({g})\n"
                 f'  sum by ({g}) (increase({_WAIT}_count{{stage="delivery"}}[5m])) '
                 f">= {BACKLOG_MIN_INPUTS}"),
        "for": "5m",
        "labels": {"severity": "critical"},
        "annotations": {
            "summary": "Inputs of the NATS runtime wait in the stream: the fleet is past its "
                       "capacity",
            "description": "p95 of the time inputs of job {{ $labels.job }} waited in the "
                           "input stream before a replica received them is {{ $value | "
                           f"humanizeDuration }}}} (threshold {BACKLOG_SECONDS:g}s): answers "
                           "come that late, and queries past max_input_wait are answered "
                           "with the busy text (rejected, reason expired). Add replicas: "
                           "each serves a share of the partitions (no more replicas than "
                           "partitions help).",
            "runbook_url": f"{RUNBOOK_URL}#turnrouterinputbacklog",
        },
    }
    return (
        {
            "alert": "TurnrouterPartitionUnconsumed",
            # Unless the replicas hear the whole fleet own every partition: a replica
            # Prometheus does not scrape (TurnrouterReplicaUnscraped) is no gap.
            "expr": (f"max by ({g}) ({_PARTITIONS})\n  - sum by ({g}) ({_OWNED}) > 0\n"
                     f"unless on ({g})\n  max by ({g}) ({_HEARD_OWNED})\n"
                     f"  >= max by ({g}) ({_PARTITIONS})"),
            "for": "1m",
            "labels": {"severity": "critical"},
            "annotations": {
                "summary": "A partition of the NATS runtime has had no replica for a minute",
                "description": "{{ $value }} partition(s) of job {{ $labels.job }} are "
                               "consumed by no replica: their participants are not served. "
                               "Check that replicas run and reach NATS "
                               "(docs/distributed.md).",
                "runbook_url": f"{RUNBOOK_URL}#turnrouterpartitionunconsumed",
            },
        },
        {
            "alert": "TurnrouterFleetNotServing",
            # Over a window, not the latest sample: a replica that cannot reach NATS
            # exits after --reconnect-for and its supervisor restarts it, and each
            # restart is a failed scrape that would reset a `for:` on the latest value
            # (a 10-minute server outage paged nobody). The window bridges those gaps;
            # a serving replica's 1 in it keeps it quiet (one replica restarting, or a
            # rollout), and a fleet starting up has the `for:` to connect.
            "expr": (f"max by ({g}) (max_over_time({_SERVING}[{NOT_SERVING_WINDOW}]))"
                     " == 0"),
            "for": NOT_SERVING_FOR,
            "labels": {"severity": "critical"},
            "annotations": {
                "summary": "No replica of the NATS runtime has served for minutes",
                "description": "No replica of job {{ $labels.job }} reported "
                               f"turnrouter_nats_serving 1 in the last {NOT_SERVING_WINDOW} "
                               "(restarts included): nobody is served. The NATS server is "
                               "down or unreachable, or a stream, consumer or the bucket is "
                               "missing (the replicas' logs and /ready say which; "
                               "docs/distributed.md).",
                "runbook_url": f"{RUNBOOK_URL}#turnrouterfleetnotserving",
            },
        },
        {
            "alert": "TurnrouterReplicaUnscraped",
            "expr": (f"max by ({g}) ({_HEARD_REPLICAS})\n"
                     f"  > count by ({g}) ({_HEARD_REPLICAS})"),
            "for": "5m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "A replica of the NATS runtime is not scraped",
                "description": "The replicas of job {{ $labels.job }} hear {{ $value }} "
                               "replicas on presence, more than Prometheus scrapes: the "
                               "fleet's alerts and dashboards miss one. Add every "
                               "worker's metrics port to the scrape targets (a "
                               "ServiceMonitor selecting every worker pod).",
                "runbook_url": f"{RUNBOOK_URL}#turnrouterreplicaunscraped",
            },
        },
        {
            "alert": "TurnrouterFencedWrites",
            "expr": f"sum by ({g}) (rate({_REFUSED}[5m])) > {FENCED_WRITES_PER_SECOND:g}",
            "for": "10m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "Replicas keep losing participants to each other",
                "description": "State writes of job {{ $labels.job }} are refused for a "
                               "newer revision ({{ $value }}/s): partitions move back and "
                               "forth (replicas pausing, restarting or overloaded past the "
                               "failover timeout).",
                "runbook_url": f"{RUNBOOK_URL}#turnrouterfencedwrites",
            },
        },
        {
            "alert": "TurnrouterReplicaNotServing",
            "expr": f"min by ({g}, instance) (turnrouter_nats_serving) == 0",
            "for": "2m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "A replica of the NATS runtime has not served for two minutes",
                "description": "Replica {{ $labels.instance }} of job {{ $labels.job }} is "
                               "running but not serving: its connection to NATS is lost, or "
                               "a stream, consumer or the bucket is missing and not "
                               "recreated yet (its log says which; docs/distributed.md).",
                "runbook_url": f"{RUNBOOK_URL}#turnrouterreplicanotserving",
            },
        },
        backlog,
    )


#: The fleet's alerts with the default group labels.
FLEET_ALERTS: tuple[dict[str, Any], ...] = fleet_alerts()


def fleet_rule_groups(runbook_url: str | None = None,
                      group_labels: Sequence[str] = GROUP_LABELS) -> dict[str, Any]:
    """The fleet rule file's content (one group); each alert links to its section of the
    runbook at `runbook_url` (default `RUNBOOK_URL`), as the main rule file's do."""
    rules = []
    for alert in fleet_alerts(group_labels):
        rule = dict(alert)
        if runbook_url is not None:
            rule["annotations"] = {**rule["annotations"], "runbook_url":
                                   f"{runbook_url}#{rule['alert'].lower()}"}
        rules.append(rule)
    return {"groups": [{"name": "turnrouter.nats", "rules": rules}]}


_HEADER = ("# Generated by `python -m turnrouter.ops` (src/turnrouter/ops/_fleet.py). Do not "
           "edit by hand.\n")


def fleet_files(runbook_url: str | None = None,
                group_labels: Sequence[str] = GROUP_LABELS) -> dict[str, str]:
    """Repository-relative path -> content of the fleet's generated files (alerts
    linking to the runbook at `runbook_url`, default `RUNBOOK_URL`; rules and dashboard
    by `group_labels`, as the main ones)."""
    from ._yaml import dump

    rule = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "turnrouter-nats",
                     "labels": {"app.kubernetes.io/name": "turnrouter-worker"}},
        "spec": fleet_rule_groups(runbook_url, group_labels),
    }
    return {
        FLEET_DASHBOARD: render_dashboard(_with_group_labels(
            fleet_dashboard(), check_group_labels(group_labels))),
        FLEET_RULES: _HEADER + "# Alerts of the NATS runtime (docs/distributed.md, "
                     "\"Telemetry\"); promtool tests in\n# deploy/prometheus/tests-nats/.\n"
                     + dump(fleet_rule_groups(runbook_url, group_labels)),
        FLEET_K8S_RULE: _HEADER + "# The alerts of " + FLEET_RULES + " as a PrometheusRule.\n"
                        + dump(rule),
    }
