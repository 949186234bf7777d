"""Fixtures for telemetry tests: a real OpenTelemetry SDK and a fresh Prometheus registry."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from turnrouter import AgentTurn, RouteRequest, RoutingAid
from turnrouter.telemetry import Telemetry

#: Encodes a registry in OpenMetrics, the format that carries exemplars.
openmetrics_latest = choose_encoder("application/openmetrics-text")[0]


@pytest.fixture
def anyio_backend() -> str:
    """Async telemetry tests run on asyncio."""
    return "asyncio"


class Rig:
    """A `Telemetry` wired to an in-memory span exporter and its own registry."""

    def __init__(self, capture_content: bool = False) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.registry = CollectorRegistry()
        self.telemetry = Telemetry(tracer_provider=self.provider, registry=self.registry,
                                   capture_content=capture_content)

    def spans(self, name: str | None = None) -> list[ReadableSpan]:
        """Finished spans, in end order, optionally only those called `name`."""
        finished = self.exporter.get_finished_spans()
        return [span for span in finished if name is None or span.name == name]

    def span(self, name: str) -> ReadableSpan:
        """The one finished span called `name`."""
        found = self.spans(name)
        assert len(found) == 1, [span.name for span in self.spans()]
        return found[0]

    def value(self, name: str, **labels: str) -> float | None:
        """A sample's value from the registry (None when absent)."""
        return self.registry.get_sample_value(name, labels)

    def openmetrics(self) -> str:
        """The registry in OpenMetrics format (the one that carries exemplars)."""
        return openmetrics_latest(self.registry).decode()

    def close(self) -> None:
        """Shut the tracer provider down."""
        self.provider.shutdown()


@pytest.fixture
def rig() -> Iterator[Rig]:
    """A fresh rig without content capture."""
    made = Rig()
    yield made
    made.close()


@pytest.fixture
def capture_rig() -> Iterator[Rig]:
    """A fresh rig with content capture on."""
    made = Rig(capture_content=True)
    yield made
    made.close()


def make_turn(query: str = "what's the weather", participant: str = "alice",
              turn_id: str = "t1") -> AgentTurn:
    """A user turn."""
    return AgentTurn(participant, turn_id, query)


def make_request(turn: AgentTurn, names: Sequence[str] = ("weather", "music"),
                 excluded: Sequence[str] = ()) -> RouteRequest:
    """A decision request over candidate routes `names`."""
    return RouteRequest(turn, tuple(RoutingAid(name, f"{name} things") for name in names),
                        frozenset(excluded))
