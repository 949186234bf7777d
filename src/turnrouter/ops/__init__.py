"""Operations artefacts generated from `turnrouter.telemetry.METRICS`.

Grafana dashboards (`dashboards/*.json`), Prometheus recording and alert rules
(`deploy/prometheus/rules/turnrouter.rules.yml`) and their Kubernetes wrappers
(`deploy/k8s/base/`) are built here as data and checked in. Regenerate them with
`python -m turnrouter.ops`; `python -m turnrouter.ops --check` (and a test) fails when a
checked-in file is out of date. Writing YAML needs PyYAML (a dev dependency).
"""

from ._dashboards import DASHBOARDS, dashboard_files, dashboards, queries
from ._files import (
    K8S_DASHBOARDS,
    K8S_RULE,
    RULES_FILE,
    generated_files,
    main,
    read_overrides,
    stale_files,
    write_files,
)
from ._promql import exposed_series_names, le_value, metric_names
from ._rules import (
    ALERTS,
    RECORDING_RULES,
    AlertRule,
    RecordingRule,
    RouteOverride,
    load_overrides,
    render_rules,
    rule_groups,
)

__all__ = [
    "ALERTS",
    "DASHBOARDS",
    "K8S_DASHBOARDS",
    "K8S_RULE",
    "RECORDING_RULES",
    "RULES_FILE",
    "AlertRule",
    "RecordingRule",
    "RouteOverride",
    "dashboard_files",
    "dashboards",
    "exposed_series_names",
    "generated_files",
    "le_value",
    "load_overrides",
    "main",
    "metric_names",
    "queries",
    "read_overrides",
    "render_rules",
    "rule_groups",
    "stale_files",
    "write_files",
]
