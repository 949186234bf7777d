"""promtool scenarios of every alert behaviour, at 15 s, 30 s and 1 min scrape intervals.

Each interval gets its own test file, `deploy/prometheus/tests/scrape-<interval>.test.yml`,
whose `evaluation_interval` equals the scrape interval (the slowest case: Prometheus'
defaults are 1 min for both). The scenarios are data: counters grow at a rate per second,
gauges hold a level, `up` goes to 0 and every other series goes stale when the router dies
(what a failed scrape does). Expectations are wall-clock bounds from the issue (a broad
incident pages within 3 minutes; one loud client never pages; a dead router pages for
itself and opens no ticket; a slow route's ticket fires after its 10 minutes).

Regenerate the files with `python -m tests.ops.scenarios` (tests/ops/test_scenarios.py
fails when they differ from what this module builds).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
TESTS_DIR = ROOT / "deploy/prometheus/tests"
INTERVALS = {"15s": 15, "30s": 30, "1m": 60}
RUNBOOK = "https://github.com/turnrouter/turnrouter/blob/main/docs/runbook.md"
JOB = "turnrouter"
#: Minutes every scenario runs.
LENGTH = 45
CLARIFY = "TurnrouterHighClarificationRate"
TRAFFIC_ALERTS = (CLARIFY, "TurnrouterSlowFirstResponse", "TurnrouterDeadAir",
                  "TurnrouterAcknowledgmentOveruse", "TurnrouterFailures",
                  "TurnrouterRouteFailing", "TurnrouterDecisionSlow", "TurnrouterOverloaded")
AVAILABILITY = ("TurnrouterTargetDown", "TurnrouterAbsent", "TurnrouterJobDown")

Segments = list[tuple[float, float]]
"""(from minute, value): a counter's rate per second, or a gauge's level, from then on."""


@dataclass
class Series:
    labels: str
    segments: Segments
    counter: bool = True
    #: Minute from which the series is stale (the router died).
    dies: float | None = None

    def values(self, step: int) -> str:
        out: list[str] = []
        total = 0.0
        steps = LENGTH * 60 // step
        for index in range(steps + 1):
            minute = index * step / 60
            if self.dies is not None and minute >= self.dies:
                out.append("stale")
                break
            level = [value for start, value in self.segments if start <= minute][-1]
            if self.counter:
                out.append(f"{total:g}")
                total += level * step
            else:
                out.append(f"{level:g}")
        return " ".join(out)


@dataclass
class Scenario:
    name: str
    series: list[Series]
    #: (minute, alertname, [(severity or extra labels, ...)]): the alerts firing then.
    expect: list[tuple[float, str, list[dict[str, str]]]] = field(default_factory=list)

    def as_test(self, interval: str) -> dict[str, Any]:
        step = INTERVALS[interval]
        return {
            "name": f"{self.name} (scrape {interval})",
            "interval": interval,
            "input_series": [{"series": s.labels, "values": s.values(step)}
                             for s in self.series],
            # The ALERTS series (not alert_rule_test): labels without the annotations'
            # wording, which the rule tests of turnrouter.rules.test.yml pin already.
            "promql_expr_test": [
                {"expr": f'ALERTS{{alertname="{alertname}", alertstate="firing"}}',
                 "eval_time": _duration(minute),
                 "exp_samples": [
                     {"labels": "ALERTS{" + ", ".join(
                         f'{key}="{value}"' for key, value in sorted(
                             {"alertname": alertname, "alertstate": "firing",
                              **labels}.items())) + "}",
                      "value": 1} for labels in alerts]}
                for minute, alertname, alerts in self.expect],
        }


def _duration(minute: float) -> str:
    seconds = round(minute * 60)
    return f"{seconds // 60}m{seconds % 60}s" if seconds % 60 else f"{seconds // 60}m"


def _traffic(turns: Segments, clarified: Segments, participants: Segments,
             clarified_participants: Segments, dies: float | None = None,
             overload: Segments | None = None, vanishes: bool = False) -> list[Series]:
    """A router's turns, clarifications, window gauges, overload state and `up`
    (`vanishes`: at its death the target leaves service discovery, so `up` goes stale
    instead of 0)."""
    job = f'job="{JOB}"'
    out = [
        Series(f'turnrouter_turns_total{{{job}, route="weather", outcome="answer"}}', turns,
               dies=dies),
        Series(f'turnrouter_clarifications_total{{{job}, reason="low_confidence"}}', clarified,
               dies=dies),
        Series(f"turnrouter_window_participants{{{job}}}", participants, counter=False,
               dies=dies),
        Series(f"turnrouter_window_clarified_participants{{{job}}}", clarified_participants,
               counter=False, dies=dies),
        Series(f'turnrouter_turns_in_flight{{{job}, instance="a:9464"}}', [(0, 2)],
               counter=False, dies=dies),
        Series(f'turnrouter_overload_state{{{job}, instance="a:9464"}}',
               overload or [(0, 0.0)], counter=False, dies=dies),
    ]
    up = [(0.0, 1.0)] if dies is None or vanishes else [(0.0, 1.0), (dies, 0.0)]
    out.append(Series(f'up{{{job}, instance="a:9464"}}', up, counter=False,
                      dies=dies if vanishes else None))
    return out


CRIT = {"severity": "critical", "job": JOB}
WARN = {"severity": "warning", "job": JOB}
#: 40 participants, 4 turns/s, 5% clarified: about 2 participants' latest turn clarified.
NORMAL = {"turns": [(0.0, 4.0)], "clarified": [(0.0, 0.2)], "participants": [(0.0, 40.0)],
          "clarified_participants": [(0.0, 2.0)]}


def _quiet(minute: float, *names: str) -> list[tuple[float, str, list[dict[str, str]]]]:
    return [(minute, name, []) for name in names]


def scenarios() -> list[Scenario]:
    onset = 15.0
    broad = Scenario(
        "a broad incident (half the turns of half the participants clarified) pages within "
        "3 minutes, the ticket after 10",
        _traffic([(0, 4.0)], [(0, 0.2), (onset, 2.0)], [(0, 40.0)],
                 [(0, 2.0), (onset, 20.0)]),
        [(onset - 0.25, CLARIFY, []), (onset + 3, CLARIFY, [CRIT]),
         (onset + 13, CLARIFY, [WARN, CRIT])],
    )
    # The looping client: 4 turns/s all clarified, 26% of all turns, among 40
    # users whose own turns are clarified 5% of the time.
    loud = Scenario(
        "one looping client among 40 users never pages (at most a ticket)",
        _traffic([(0, 11.4), (onset, 15.4)], [(0, 0.57), (onset, 4.57)],
                 [(0, 40.0), (onset, 41.0)], [(0, 2.0), (onset, 3.0)]),
        [(onset + 3, CLARIFY, []), (onset + 8, CLARIFY, []), (onset + 25, CLARIFY, [WARN])],
    )
    idle = Scenario(
        "one looping client on an idle router never pages (at most a ticket)",
        _traffic([(0, 0.0), (onset, 4.0)], [(0, 0.0), (onset, 4.0)], [(0, 0.0), (onset, 1.0)],
                 [(0, 0.0), (onset, 1.0)]),
        [(onset + 3, CLARIFY, []), (onset + 8, CLARIFY, []), (onset + 25, CLARIFY, [WARN])],
    )
    death = 25.0
    # The incident begins 7 minutes before the router dies: the page fires, the ticket
    # (10 minutes) is still pending. Its 5-minute windows outlive the router, but the
    # ticket must not open after the page cleared (both clear within one evaluation).
    died = Scenario(
        "a router that dies during an incident pages TargetDown and opens no late ticket",
        _traffic([(0, 4.0)], [(0, 0.2), (death - 7, 2.0)], [(0, 40.0)],
                 [(0, 2.0), (death - 7, 20.0)], dies=death),
        [(death - 0.25, CLARIFY, [CRIT]),
         *[(death + minutes, CLARIFY, []) for minutes in (1.5, 2, 3, 4, 5, 6, 8, 12)],
         (death + 2.5, "TurnrouterTargetDown", [{"severity": "critical", "job": JOB,
                                                 "instance": "a:9464"}]),
         # At once (no hold): Alertmanager holds the job's other alerts meanwhile.
         (death - 0.25, "TurnrouterJobDown", []),
         (death + 1.5, "TurnrouterJobDown", [{"severity": "none", "job": JOB}])],
    )
    # Its pods deleted (a deployment scaled to zero): no `up` of the job at all, so no
    # TargetDown; JobDown holds the job's warnings for 15 minutes all the same, and the
    # traffic alerts clear at once as for a dead target (operator15: its windows kept a
    # page firing 4 minutes while `up` was gone, not 0).
    gone = Scenario(
        "a job whose targets vanish from service discovery fires JobDown for 15 minutes "
        "and clears its traffic alerts",
        _traffic([(0, 4.0)], [(0, 0.2), (death - 7, 2.0)], [(0, 40.0)],
                 [(0, 2.0), (death - 7, 20.0)], dies=death, vanishes=True),
        [(death - 0.25, CLARIFY, [CRIT]),
         *[(death + minutes, CLARIFY, []) for minutes in (1.5, 2, 3, 4, 5, 6, 8, 12)],
         (death - 0.25, "TurnrouterJobDown", []),
         *[(death + minutes, "TurnrouterJobDown", [{"severity": "none", "job": JOB}])
           for minutes in (1.5, 5, 10, 14)],
         (death + 16, "TurnrouterJobDown", []),
         (death + 2.5, "TurnrouterTargetDown", [])],
    )
    normal = Scenario(
        "normal traffic raises nothing but the watchdog",
        _traffic(NORMAL["turns"], NORMAL["clarified"], NORMAL["participants"],
                 NORMAL["clarified_participants"]),
        [*_quiet(40, *TRAFFIC_ALERTS, *AVAILABILITY),
         (1, "TurnrouterWatchdog", [{"severity": "none"}]),
         (40, "TurnrouterWatchdog", [{"severity": "none"}])],
    )
    absent = Scenario(
        "no turnrouter target at all pages TurnrouterAbsent",
        [Series('up{job="prometheus", instance="p:9090"}', [(0, 1.0)], counter=False)],
        [(3, "TurnrouterAbsent", []), (7, "TurnrouterAbsent", [{"severity": "critical"}])],
    )
    no_metrics = Scenario(
        "a scraped target without turnrouter metrics pages TurnrouterAbsent",
        [Series(f'up{{job="{JOB}", instance="a:9464"}}', [(0, 1.0)], counter=False)],
        [(7, "TurnrouterAbsent", [{"severity": "critical", "job": JOB,
                                   "instance": "a:9464"}])],
    )
    # Busy by the router's own thresholds (whatever the event-loop lag): a 1-minute burst
    # raises nothing, busy from 15m warns within 7 minutes, and clears once ready again.
    busy = {"severity": "warning", "job": JOB, "instance": "a:9464"}
    overloaded = Scenario(
        "a router busy for minutes warns TurnrouterOverloaded within 7 minutes; a 1-minute "
        "burst does not",
        _traffic(NORMAL["turns"], NORMAL["clarified"], NORMAL["participants"],
                 NORMAL["clarified_participants"],
                 overload=[(0, 0.0), (5, 1.0), (6, 0.0), (onset, 1.0), (30, 0.0)]),
        [*_quiet(12, "TurnrouterOverloaded"), *_quiet(onset + 2, "TurnrouterOverloaded"),
         (onset + 7, "TurnrouterOverloaded", [busy]), (29, "TurnrouterOverloaded", [busy]),
         *_quiet(36, "TurnrouterOverloaded")],
    )
    # A new series: the router starts busy (a warm-up burst, or a rolling deploy under
    # load). Two and a half minutes of it raise nothing; busy for good warns within 7.
    warm_up = Scenario(
        "a router busy for its first 2.5 minutes after a start warns nothing",
        _traffic(NORMAL["turns"], NORMAL["clarified"], NORMAL["participants"],
                 NORMAL["clarified_participants"], overload=[(0, 1.0), (2.5, 0.0)]),
        [*_quiet(4, "TurnrouterOverloaded"), *_quiet(6, "TurnrouterOverloaded"),
         *_quiet(8, "TurnrouterOverloaded"), *_quiet(12, "TurnrouterOverloaded")],
    )
    busy_from_start = Scenario(
        "a router busy from its start warns TurnrouterOverloaded within 7 minutes",
        _traffic(NORMAL["turns"], NORMAL["clarified"], NORMAL["participants"],
                 NORMAL["clarified_participants"], overload=[(0, 1.0)]),
        [*_quiet(2, "TurnrouterOverloaded"), (7, "TurnrouterOverloaded", [busy]),
         (15, "TurnrouterOverloaded", [busy])],
    )
    slow = _slow_route()
    return [broad, loud, idle, died, gone, normal, absent, no_metrics, slow, overloaded, warm_up,
            busy_from_start, _replica_dies_while_busy(), _small_route_fails()]


def _small_route_fails() -> Scenario:
    """A small route (meta, 3.6% of the turns, one every 7 s) fails every answer from 15m
    to 30m, among normal traffic: the job fails 3.6% of its turns, under
    TurnrouterFailures' 5% (the gap the route's page closes). Its page fires within 7
    minutes (its ratio passes 25% about 75 s in, then 5 minutes held) and resolves within
    5 minutes of the fix; the job-wide page never fires."""
    onset, fixed = 15.0, 30.0
    job = f'job="{JOB}"'
    series = _traffic(NORMAL["turns"], NORMAL["clarified"], NORMAL["participants"],
                      NORMAL["clarified_participants"])
    series += [
        Series(f'turnrouter_turns_total{{{job}, route="meta", outcome="answer"}}',
               [(0, 0.15), (onset, 0.0), (fixed, 0.15)]),
        Series(f'turnrouter_turns_total{{{job}, route="meta", outcome="failed"}}',
               [(0, 0.0), (onset, 0.15), (fixed, 0.0)]),
        Series(f'turnrouter_failures_total{{{job}, route="meta", stage="answer"}}',
               [(0, 0.0), (onset, 0.15), (fixed, 0.0)]),
    ]
    page = {"severity": "critical", "job": JOB, "route": "meta", "stage": "answer"}
    failing = "TurnrouterRouteFailing"
    return Scenario(
        "a small route failing every answer pages TurnrouterRouteFailing within 7 minutes, "
        "not TurnrouterFailures, and resolves within 5 minutes of the fix",
        series,
        [*_quiet(onset - 0.25, failing), *_quiet(onset + 5, failing),
         (onset + 7, failing, [page]), (fixed - 0.25, failing, [page]),
         *_quiet(fixed + 5, failing),
         *[(minute, "TurnrouterFailures", []) for minute in (onset + 7, fixed - 0.25)]],
    )


def _replica_dies_while_busy() -> Scenario:
    """Two replicas of one job; a is saturated and busy from 18m, its warnings pending,
    and dies at 21.5m (b serves on, so the job stays up). Its windows outlive it: without
    its own `up` in the gate its warnings fired from them (operator18 M4: a ticket at
    1 min scrape before TargetDown could inhibit it)."""
    job = f'job="{JOB}"'
    dies = 21.5
    series: list[Series] = []
    for instance, died in (("a:9464", dies), ("b:9464", None)):
        where = f'{job}, instance="{instance}"'
        series += [
            Series(f'turnrouter_turns_total{{{where}, route="weather", outcome="answer"}}',
                   [(0, 2.0)], dies=died),
            Series(f"turnrouter_turns_in_flight{{{where}}}", [(0, 2.0)], counter=False,
                   dies=died),
            Series(f"turnrouter_overload_state{{{where}}}",
                   [(0, 0.0), (18, 1.0)] if died else [(0, 0.0)], counter=False, dies=died),
            Series(f'turnrouter_event_loop_lag_seconds_bucket{{{where}, le="0.1"}}',
                   [(0, 50.0)], dies=died),
            Series(f'turnrouter_event_loop_lag_seconds_bucket{{{where}, le="0.5"}}',
                   [(0, 50.0), (18, 100.0)] if died else [(0, 50.0)], dies=died),
            Series(f'turnrouter_event_loop_lag_seconds_bucket{{{where}, le="+Inf"}}',
                   [(0, 50.0), (18, 100.0)] if died else [(0, 50.0)], dies=died),
            Series(f"up{{{where}}}", [(0.0, 1.0), (dies, 0.0)] if died else [(0.0, 1.0)],
                   counter=False),
        ]
    a = {"severity": "warning", "job": JOB, "instance": "a:9464"}
    return Scenario(
        "a saturated replica that dies opens no ticket from its windows while another "
        "keeps the job up",
        series,
        [*[(dies + minutes, name, []) for minutes in (1, 2, 2.5, 3, 4, 5, 6)
           for name in ("TurnrouterOverloaded", "TurnrouterSaturated")],
         (dies + 2.5, "TurnrouterTargetDown", [{**a, "severity": "critical"}])],
    )


def _slow_route() -> Scenario:
    """billing turns slow at 15m (p95 about 2 s, default target 1.5 s); travel is slow by
    design (p95 about 3 s) and has its own 4 s threshold in the shipped rules."""
    onset = 15.0
    series: list[Series] = []
    job = f'job="{JOB}"'
    for route, fast, slow_share in (("billing", (0, 1.0), (onset, 0.8)),
                                    ("travel", (0, 0.5), (onset, 0.5))):
        le = {"billing": ("1.5", "2.5"), "travel": ("2.0", "3.0")}[route]
        series += [
            Series(f'turnrouter_first_response_seconds_bucket{{{job}, route="{route}", '
                   f'le="{le[0]}"}}', [fast, slow_share]),
            Series(f'turnrouter_first_response_seconds_bucket{{{job}, route="{route}", '
                   f'le="{le[1]}"}}', [(0, 1.0)]),
            Series(f'turnrouter_first_response_seconds_bucket{{{job}, route="{route}", '
                   f'le="+Inf"}}', [(0, 1.0)]),
            Series(f'turnrouter_first_response_seconds_count{{{job}, route="{route}"}}',
                   [(0, 1.0)]),
        ]
    series.append(Series(f'up{{{job}, instance="a:9464"}}', [(0, 1.0)], counter=False))
    series.append(Series(f'turnrouter_turns_in_flight{{{job}, instance="a:9464"}}',
                         [(0, 1.0)], counter=False))
    ticket = {"severity": "warning", "job": JOB, "route": "billing"}
    return Scenario(
        "a slow route opens its own ticket after 10 minutes; a route slow by design does not",
        series,
        [(onset + 2, "TurnrouterSlowFirstResponse", []),
         (onset + 17, "TurnrouterSlowFirstResponse", [ticket])],
    )


def render(interval: str) -> str:
    header = (
        f"# Generated by `python -m tests.ops.scenarios` (tests/ops/scenarios.py): every\n"
        f"# alert behaviour at a {interval} scrape interval, evaluated every {interval}.\n"
        f"#   promtool test rules deploy/prometheus/tests/scrape-{interval}.test.yml\n")
    body = {
        "rule_files": ["../rules/turnrouter.rules.yml"],
        "evaluation_interval": interval,
        "tests": [scenario.as_test(interval) for scenario in scenarios()],
    }
    return header + yaml.safe_dump(body, sort_keys=False, width=1000)


def files() -> dict[Path, str]:
    return {TESTS_DIR / f"scrape-{interval}.test.yml": render(interval)
            for interval in INTERVALS}


def main() -> int:
    for path, text in files().items():
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
