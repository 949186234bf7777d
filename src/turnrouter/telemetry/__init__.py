"""OpenTelemetry spans and Prometheus metrics for turnrouter (see `docs/telemetry.md`).

```python
from turnrouter.telemetry import Telemetry, serve_metrics

router = AgentRouter(..., telemetry=Telemetry())    # global tracer provider, default registry
server = serve_metrics(9464)                         # /metrics with OpenMetrics negotiation
router = AgentRouter(..., telemetry=Telemetry.disabled())   # no spans, no metrics
```
"""

from ._families import EXEMPLAR_INTERVAL_SECS
from ._metrics import (
    FAST_BUCKETS,
    INELIGIBLE_REASONS,
    LATENCY_BUCKETS,
    METRICS,
    NEEDLESS_WITHIN_SECONDS,
    RESPONSE_BUCKETS,
    MetricSpec,
    MetricType,
    metric,
    metrics_markdown_table,
)
from ._multiprocess import MULTIPROCESS_GAUGE_MODES
from ._serve import READY_REASON_CHARS, ASGIApp, MetricsServer, metrics_app, serve_metrics
from ._spans import (
    ATTR,
    CONTENT_CAPTURE_ENV,
    EVENT_DEFAULT_FALLBACK,
    EVENT_FAILURE,
    EVENT_FIRST_RESPONSE,
    EVENT_FOCUS,
    EVENT_REROUTE,
    SPAN_ACKNOWLEDGMENT,
    SPAN_ADMISSION,
    SPAN_CONTEXT_PATCH,
    SPAN_INVOKE_AGENT_PREFIX,
    SPAN_RELEASE,
    SPAN_ROUTE,
    SPAN_TURN,
    TOP_SCORES,
    TRACER_NAME,
)
from ._telemetry import MAX_TRACED_PARTICIPANTS, Telemetry
from ._window import MAX_WINDOW_PARTICIPANTS, PARTICIPANT_WINDOW_SECS, ParticipantWindow

__all__ = [
    "ATTR",
    "CONTENT_CAPTURE_ENV",
    "EVENT_DEFAULT_FALLBACK",
    "EVENT_FAILURE",
    "EVENT_FIRST_RESPONSE",
    "EVENT_FOCUS",
    "EVENT_REROUTE",
    "EXEMPLAR_INTERVAL_SECS",
    "FAST_BUCKETS",
    "INELIGIBLE_REASONS",
    "LATENCY_BUCKETS",
    "MAX_TRACED_PARTICIPANTS",
    "MAX_WINDOW_PARTICIPANTS",
    "METRICS",
    "MULTIPROCESS_GAUGE_MODES",
    "NEEDLESS_WITHIN_SECONDS",
    "PARTICIPANT_WINDOW_SECS",
    "READY_REASON_CHARS",
    "RESPONSE_BUCKETS",
    "SPAN_ACKNOWLEDGMENT",
    "SPAN_ADMISSION",
    "SPAN_CONTEXT_PATCH",
    "SPAN_INVOKE_AGENT_PREFIX",
    "SPAN_RELEASE",
    "SPAN_ROUTE",
    "SPAN_TURN",
    "TOP_SCORES",
    "TRACER_NAME",
    "ASGIApp",
    "MetricSpec",
    "MetricType",
    "MetricsServer",
    "ParticipantWindow",
    "Telemetry",
    "metric",
    "metrics_app",
    "metrics_markdown_table",
    "serve_metrics",
]
