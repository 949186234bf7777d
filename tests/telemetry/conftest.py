"""Fixtures for telemetry tests: a real OpenTelemetry SDK and a fresh Prometheus registry."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from prometheus_client.exposition import choose_encoder

from turnrouter import AgentRouter, AgentTurn, DestinationResult, RouteRequest, RoutingAid
from turnrouter.testing import OutputRecorder, ScriptedAgent, ScriptedDecisions, TelemetryCapture

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


class Outcomes:
    """A router over scripted agents (plus an eligible "conversation" default), captured."""

    def __init__(self, capture: TelemetryCapture, decisions: ScriptedDecisions,
                 *agents: ScriptedAgent) -> None:
        self.capture = capture
        self.agents = {agent.name: agent for agent in agents}
        self.agents.setdefault("conversation", ScriptedAgent("conversation"))
        self.output = OutputRecorder()
        self.router = AgentRouter(self.agents, decisions, output=self.output,
                                  telemetry=capture.telemetry)
        self._turns = 0

    async def say(self, query: str = "hello") -> DestinationResult:
        """Handle one turn of participant alice."""
        self._turns += 1
        return await self.router.handle(AgentTurn("alice", f"t{self._turns}", query))

    def turns(self) -> list[ReadableSpan]:
        """The turn spans, in end order."""
        return self.capture.spans("turnrouter.turn")

    def last_turn(self) -> dict[str, Any]:
        """The attributes of the newest turn span."""
        return dict(self.turns()[-1].attributes or {})

    def child_names(self, turn: ReadableSpan | None = None) -> list[str]:
        """Names of a turn's direct children (default: the newest), in end order."""
        return [name for name, _ in self.children(turn)]

    def children(self, turn: ReadableSpan | None = None) -> list[tuple[str, dict[str, Any]]]:
        """(name, attributes) of a turn's direct children (default: the newest), end order."""
        parent = (turn or self.turns()[-1]).context.span_id
        return [(span.name, dict(span.attributes or {})) for span in self.capture.spans()
                if span.parent is not None and span.parent.span_id == parent]

    def value(self, name: str, **labels: str) -> float | None:
        """A metric sample's value."""
        return self.capture.value(name, **labels)
