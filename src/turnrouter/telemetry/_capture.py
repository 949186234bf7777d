"""`TelemetryCapture`: real telemetry recorded in memory, for tests.

A `Telemetry` wired to an OpenTelemetry SDK tracer provider with an in-memory exporter
and to a fresh Prometheus registry, so a test sees exactly the spans and metric samples
a deployment would export, without a collector and without touching global state.
Needs `opentelemetry-sdk` (the `turnrouter[testing]` extra); the library itself never
imports the SDK.
"""

from __future__ import annotations

import os
from types import TracebackType
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from .._exceptions import ConfigurationError
from ._telemetry import Telemetry

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

__all__ = ["TelemetryCapture"]

#: Encodes a registry in OpenMetrics, the format that carries exemplars.
_openmetrics = choose_encoder("application/openmetrics-text")[0]


class TelemetryCapture:
    """Spans and metrics of the routers that use `telemetry`, captured in memory.

    ```python
    @pytest.fixture
    def capture():
        with TelemetryCapture() as captured:
            yield captured

    async def test_weather_answers(capture):
        router = AgentRouter(agents, decisions, output=..., telemetry=capture.telemetry)
        await router.handle(AgentTurn("alice", "t1", "will it rain?"))
        assert capture.span("turnrouter.turn").attributes["turnrouter.route"] == "weather"
        assert capture.value("turnrouter_turns_total", route="weather",
                             outcome="answer") == 1
    ```

    Spans are exported synchronously as they end (`SimpleSpanProcessor`), so a span is
    visible as soon as its operation finished. Every trace is sampled, whatever
    `OTEL_TRACES_SAMPLER` says; `OTEL_SDK_DISABLED=true` is refused with a
    ConfigurationError. `tracer_provider` is the SDK provider, for the test's own spans
    (a caller span, an agent's LLM span) in the same traces.

    Args:
        capture_content: Record query and answer text on the spans, as
            `Telemetry(capture_content=True)` does (default False).
    """

    def __init__(self, *, capture_content: bool = False) -> None:
        try:
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import SimpleSpanProcessor
            from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
                InMemorySpanExporter,
            )
            from opentelemetry.sdk.trace.sampling import ALWAYS_ON
        except ImportError as exc:  # pragma: no cover - the dev environment has the SDK
            raise ConfigurationError(
                "TelemetryCapture needs the OpenTelemetry SDK: "
                "pip install opentelemetry-sdk (or, from a checkout, pip install -e '.[testing]')"
            ) from exc
        if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            # The SDK would hand out no-op tracers: every span assertion would see nothing.
            raise ConfigurationError(
                "TelemetryCapture cannot record spans with OTEL_SDK_DISABLED=true in the "
                "environment; unset it for the tests that capture telemetry"
            )
        self.exporter: InMemorySpanExporter = InMemorySpanExporter()
        # Every turn sampled, whatever OTEL_TRACES_SAMPLER says (CI jobs often turn it off).
        self.tracer_provider: TracerProvider = TracerProvider(sampler=ALWAYS_ON)
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.registry = CollectorRegistry()
        self.telemetry = Telemetry(tracer_provider=self.tracer_provider,
                                   registry=self.registry, capture_content=capture_content)

    def spans(self, name: str | None = None) -> list[ReadableSpan]:
        """Finished spans in the order they ended, optionally only those called `name`."""
        finished = self.exporter.get_finished_spans()
        return [span for span in finished if name is None or span.name == name]

    def span(self, name: str) -> ReadableSpan:
        """The one finished span called `name` (AssertionError naming what ended if not)."""
        found = self.spans(name)
        if len(found) != 1:
            ended = [span.name for span in self.spans()]
            raise AssertionError(f"expected one {name!r} span, found {len(found)}: {ended}")
        return found[0]

    def value(self, name: str, **labels: str) -> float | None:
        """A sample's value, e.g. `value("turnrouter_turns_total", route="weather",
        outcome="answer")`; None when the sample does not exist (yet)."""
        return self.registry.get_sample_value(name, labels)

    def openmetrics(self) -> str:
        """The registry in the OpenMetrics text format, the one that carries exemplars."""
        encoded: bytes = _openmetrics(self.registry)
        return encoded.decode()

    def clear(self) -> None:
        """Forget the spans finished so far (metric values are cumulative and stay)."""
        self.exporter.clear()

    def close(self) -> None:
        """Shut the tracer provider down; spans ending later are not recorded."""
        self.tracer_provider.shutdown()

    def __enter__(self) -> TelemetryCapture:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
