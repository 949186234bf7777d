"""Fixtures for telemetry tests: a real OpenTelemetry SDK and a fresh Prometheus registry."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
from prometheus_client.exposition import choose_encoder

from turnrouter import AgentTurn, RouteRequest, RoutingAid
from turnrouter.testing import TelemetryCapture

#: Encodes a registry in OpenMetrics, the format that carries exemplars.
openmetrics_latest = choose_encoder("application/openmetrics-text")[0]

@pytest.fixture
def anyio_backend() -> str:
    """Async telemetry tests run on asyncio."""
    return "asyncio"


#: The public kit's capture is what the telemetry tests use (dogfooding it).
Rig = TelemetryCapture


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
