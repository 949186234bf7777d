"""Operations artefacts generated from `turnrouter.telemetry.METRICS`.

Grafana dashboards (`dashboards/*.json`), Prometheus recording and alert rules
(`deploy/prometheus/rules/turnrouter.rules.yml`), the Alertmanager configuration
(`deploy/alertmanager/alertmanager.yml`) and the Kubernetes wrappers
(`deploy/k8s/base/`) are built here as data and checked in. Regenerate them with
`python -m turnrouter.ops`; `python -m turnrouter.ops --check` (and a test) fails when a
checked-in file is out of date. Writing YAML needs PyYAML (a dev dependency).

The alert thresholds (`CLARIFICATION_WARNING`, `MIN_TURNS`, ...) and the what-if model
of the acknowledgment delay (`Candidate`, `candidates`, `GENERATION_SECS`) are exported
so a deployment's own checks and dashboards can use the numbers the alerts fire on
(see docs/operations.md).
"""

from ._alertmanager import (
    ALERTMANAGER_ENV,
    ALERTMANAGER_FILE,
    PLACEHOLDER_URLS,
    alertmanager_config,
    receiver_urls,
    render_alertmanager,
)
from ._dashboards import DASHBOARDS, dashboard_files, dashboards, queries
from ._files import (
    COMPOSE_RULES,
    DEMO_OVERRIDES,
    K8S_DASHBOARDS,
    K8S_RULE,
    MAX_OVERRIDES_BYTES,
    RULES_FILE,
    generated_files,
    main,
    read_overrides,
    stale_files,
    write_files,
)
from ._promql import (
    Selector,
    exposed_series_names,
    grouping_labels,
    le_regex,
    le_value,
    metric_names,
    selectors,
)
from ._rules import (
    ACK_OVERUSE_RATIO,
    ALERTS,
    CLARIFICATION_CONFIRM,
    CLARIFICATION_CRITICAL,
    CLARIFICATION_WARNING,
    DEAD_AIR_SECONDS,
    DECISION_SLOW_SECONDS,
    FAILURE_RATIO,
    GROUP_LABELS,
    JOB_MATCHER,
    MIN_CLARIFIED_PARTICIPANTS,
    MIN_ROUTE_TURNS,
    MIN_TURNS,
    MIN_TURNS_1M,
    OVERLOAD_STATE,
    RECORDING_RULES,
    ROUTE_FAILURE_RATIO,
    RUNBOOK_URL,
    SATURATION_LAG_SECONDS,
    SLOW_FIRST_RESPONSE_SECONDS,
    AlertRule,
    RecordingRule,
    RouteOverride,
    check_group_labels,
    load_overrides,
    render_rules,
    rule_groups,
)
from ._tuning import EARLY_SECS, GENERATION_SECS, Candidate, candidates

__all__ = [
    "ACK_OVERUSE_RATIO",
    "ALERTMANAGER_ENV",
    "ALERTMANAGER_FILE",
    "ALERTS",
    "CLARIFICATION_CONFIRM",
    "CLARIFICATION_CRITICAL",
    "CLARIFICATION_WARNING",
    "COMPOSE_RULES",
    "DASHBOARDS",
    "DEAD_AIR_SECONDS",
    "DECISION_SLOW_SECONDS",
    "DEMO_OVERRIDES",
    "EARLY_SECS",
    "FAILURE_RATIO",
    "GENERATION_SECS",
    "GROUP_LABELS",
    "JOB_MATCHER",
    "K8S_DASHBOARDS",
    "K8S_RULE",
    "MAX_OVERRIDES_BYTES",
    "MIN_CLARIFIED_PARTICIPANTS",
    "MIN_ROUTE_TURNS",
    "MIN_TURNS",
    "MIN_TURNS_1M",
    "OVERLOAD_STATE",
    "PLACEHOLDER_URLS",
    "RECORDING_RULES",
    "ROUTE_FAILURE_RATIO",
    "RULES_FILE",
    "RUNBOOK_URL",
    "SATURATION_LAG_SECONDS",
    "SLOW_FIRST_RESPONSE_SECONDS",
    "AlertRule",
    "Candidate",
    "RecordingRule",
    "RouteOverride",
    "Selector",
    "alertmanager_config",
    "candidates",
    "check_group_labels",
    "dashboard_files",
    "dashboards",
    "exposed_series_names",
    "generated_files",
    "grouping_labels",
    "le_regex",
    "le_value",
    "load_overrides",
    "main",
    "metric_names",
    "queries",
    "read_overrides",
    "receiver_urls",
    "render_alertmanager",
    "render_rules",
    "rule_groups",
    "selectors",
    "stale_files",
    "write_files",
]
