"""Each turn outcome through the real router: its span tree, attributes and metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import StatusCode

from turnrouter import AgentRouter, AgentTurn, DestinationResult, RouteDecision
from turnrouter.telemetry import ATTR
from turnrouter.testing import (
    OutputRecorder,
    ScriptedAgent,
    ScriptedDecisions,
    TelemetryCapture,
)

pytestmark = pytest.mark.anyio


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

    def children(self, turn: ReadableSpan | None = None) -> list[tuple[str, dict[str, Any]]]:
        """(name, attributes) of a turn's direct children (default: the newest), end order."""
        parent = (turn or self.turns()[-1]).context.span_id
        return [(span.name, dict(span.attributes or {})) for span in self.capture.spans()
                if span.parent is not None and span.parent.span_id == parent]

    def value(self, name: str, **labels: str) -> float | None:
        """A metric sample's value."""
        return self.capture.value(name, **labels)


@pytest.fixture
async def capture() -> AsyncIterator[TelemetryCapture]:
    """A fresh capture per test."""
    with TelemetryCapture() as made:
        yield made


def _focus_on_weather(capture: TelemetryCapture, *others: ScriptedAgent,
                      **weather: Any) -> Outcomes:
    weather.setdefault("results", ["focus", "answer"])
    return Outcomes(capture, ScriptedDecisions("weather", "music"),
                    ScriptedAgent("weather", **weather), *others)


async def test_focus_taken_then_kept(capture: TelemetryCapture) -> None:
    """A focus result marks the turn; the next turn goes to the owner without routing."""
    o = _focus_on_weather(capture)
    await o.say("plan my trip")
    turn = o.last_turn()
    assert (turn[ATTR.OUTCOME], turn[ATTR.FOCUS_AFTER]) == ("focus", "weather")
    assert ATTR.FOCUS_BEFORE not in turn
    assert o.value("turnrouter_focus_transitions_total", route="weather",
                   transition="taken") == 1

    await o.say("and tomorrow?")
    turn = o.last_turn()
    assert (turn[ATTR.OUTCOME], turn[ATTR.FOCUS_BEFORE], turn[ATTR.ATTEMPTS]) == (
        "answer", "weather", 0)
    assert [name for name, _ in o.children()] == ["turnrouter.admission",
                                                  "invoke_agent weather"]
    assert o.children()[0][1][ATTR.ADMISSION_FOCUSED] is True
    assert o.value("turnrouter_admissions_total", route="weather", disposition="accept",
                   focused="true") == 1
    assert o.value("turnrouter_decision_duration_seconds_count") == 1  # first turn only


async def test_focus_taken_from_another_route_releases_it(capture: TelemetryCapture) -> None:
    """A route taking focus releases the previous owner (reason focus_taken, lost)."""
    o = Outcomes(capture, ScriptedDecisions("music", "weather"),
                 ScriptedAgent("music", results="focus", admissions=["accept", "decline"]),
                 ScriptedAgent("weather", results="focus"))
    await o.say("play jazz")
    await o.say("weather instead")  # music, focused, declines; weather takes focus
    children = o.children()
    assert ("turnrouter.release", {ATTR.ROUTE: "music",
                                   ATTR.RELEASE_REASON: "focus_taken"}) in children
    turn = o.last_turn()
    assert (turn[ATTR.FOCUS_BEFORE], turn[ATTR.FOCUS_AFTER]) == ("music", "weather")
    assert o.value("turnrouter_focus_transitions_total", route="music",
                   transition="lost") == 1


async def test_release_result_ends_focus(capture: TelemetryCapture) -> None:
    """A release result from the owner: outcome release, release span post_answer."""
    o = _focus_on_weather(capture, results=["focus", "release"])
    await o.say("plan my trip")
    await o.say("that's all")
    turn = o.last_turn()
    assert turn[ATTR.OUTCOME] == "release"
    assert ATTR.FOCUS_AFTER not in turn
    assert o.children()[-1] == ("turnrouter.release", {
        ATTR.ROUTE: "weather", ATTR.RELEASE_REASON: "post_answer"})
    assert o.value("turnrouter_focus_transitions_total", route="weather",
                   transition="released") == 1
    assert o.value("turnrouter_turns_total", route="weather", outcome="release") == 1


async def test_release_admission_reroutes_the_same_query(capture: TelemetryCapture) -> None:
    """A focused owner's release admission: release span (reroute), then a routed answer."""
    o = _focus_on_weather(capture, ScriptedAgent("music"),
                          admissions=["accept", "release"])
    await o.say("plan my trip")
    await o.say("play something")
    names = [name for name, _ in o.children()]
    assert names == ["turnrouter.admission", "turnrouter.release", "turnrouter.route",
                     "turnrouter.admission", "invoke_agent music"]
    attributes = dict(o.children())
    assert attributes["turnrouter.release"][ATTR.RELEASE_REASON] == "reroute"
    assert attributes["turnrouter.route"][ATTR.DECISION_EXCLUDED] == ("weather",)
    turn = o.last_turn()
    assert (turn[ATTR.ROUTE], turn[ATTR.FOCUS_BEFORE], turn[ATTR.ATTEMPTS]) == (
        "music", "weather", 1)
    assert o.value("turnrouter_admissions_total", route="weather", disposition="release",
                   focused="true") == 1
    assert o.value("turnrouter_reroutes_total", route="weather") == 1


async def test_ineligible_owner_loses_focus(capture: TelemetryCapture) -> None:
    """An owner that became ineligible is released (reason ineligible) before routing."""
    o = _focus_on_weather(capture, ScriptedAgent("music"))
    await o.say("plan my trip")
    o.agents["weather"].eligible = False
    await o.say("play something")
    assert o.children()[0] == ("turnrouter.release", {
        ATTR.ROUTE: "weather", ATTR.RELEASE_REASON: "ineligible"})
    assert o.value("turnrouter_focus_transitions_total", route="weather",
                   transition="lost") == 1


def _ineligible(name: str, **kwargs: Any) -> ScriptedAgent:
    return ScriptedAgent(name, eligible=False, **kwargs)


@pytest.mark.parametrize(("reason", "decisions", "agents", "route_spans"), [
    ("no_eligible_route", ScriptedDecisions("weather"),
     [_ineligible("weather"), _ineligible("conversation")], 0),
    ("low_confidence", ScriptedDecisions(RouteDecision("clarify")),
     [ScriptedAgent("weather")], 1),
    ("destination", ScriptedDecisions("weather"),
     [ScriptedAgent("weather", admissions="clarify")], 1),
    ("default_unavailable", ScriptedDecisions("weather", "music"),
     [ScriptedAgent("weather", admissions="decline"),
      ScriptedAgent("music", admissions="decline"), _ineligible("conversation")], 2),
    ("decision_failed", ScriptedDecisions(RuntimeError("classifier down")),
     [ScriptedAgent("weather"), _ineligible("conversation")], 1),
])
async def test_clarification_reasons(
    capture: TelemetryCapture, reason: str, decisions: ScriptedDecisions,
    agents: list[ScriptedAgent], route_spans: int,
) -> None:
    """Each clarification reason ends the turn as clarify, counted under that reason."""
    o = Outcomes(capture, decisions, *agents)
    await o.say("hmm")
    turn = o.last_turn()
    assert turn[ATTR.OUTCOME] == "clarify"
    assert turn["turnrouter.clarification.reason"] == reason
    assert not any(name.startswith("invoke_agent") for name, _ in o.children())
    assert len(capture.spans("turnrouter.route")) == route_spans
    assert o.value("turnrouter_clarifications_total", reason=reason) == 1
    assert o.value("turnrouter_turns_total", route="none", outcome="clarify") == 1
    if reason == "decision_failed":
        route = capture.span("turnrouter.route")
        assert route.status.status_code is StatusCode.ERROR
        assert dict(route.attributes or {})[ATTR.ERROR_TYPE] == "RuntimeError"
        assert o.value("turnrouter_failures_total", route="none", stage="decision") == 1


async def test_failure_after_started(capture: TelemetryCapture) -> None:
    """An answer failing after started(): first-response recorded, spans marked ERROR."""
    o = Outcomes(capture, ScriptedDecisions("weather"),
                 ScriptedAgent("weather", results=RuntimeError("lost the stream"),
                               fail_after_started=True))
    with pytest.raises(RuntimeError, match="lost the stream"):
        await o.say()
    invoke = capture.span("invoke_agent weather")
    assert [event.name for event in invoke.events] == ["turnrouter.first_response"]
    for span in (invoke, o.turns()[-1]):
        assert span.status.status_code is StatusCode.ERROR
        assert dict(span.attributes or {})[ATTR.ERROR_TYPE] == "RuntimeError"
    assert o.last_turn()[ATTR.OUTCOME] == "failed"
    assert o.output.texts == []  # no failure message once the destination had started
    assert o.value("turnrouter_first_response_seconds_count", route="weather") == 1
    assert o.value("turnrouter_failures_total", route="weather", stage="answer") == 1


async def test_interrupted_turn(capture: TelemetryCapture) -> None:
    """An interrupt marks the turn and its open answer span, without an error status."""
    weather = ScriptedAgent("weather")
    weather.answer_gate = anyio.Event()  # never set: the answer runs until interrupted
    o = Outcomes(capture, ScriptedDecisions("weather"), weather)
    outcome: list[BaseException] = []

    async def turn() -> None:
        try:
            await o.say()
        except Exception as exc:  # TurnInterrupted
            outcome.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(turn)
        await weather.started_called.wait()
        await o.router.interrupt("alice")
    assert [type(exc).__name__ for exc in outcome] == ["TurnInterrupted"]
    for span in (capture.span("invoke_agent weather"), o.turns()[-1]):
        assert dict(span.attributes or {})[ATTR.INTERRUPTED] is True
        assert span.status.status_code is not StatusCode.ERROR
    assert o.last_turn()[ATTR.OUTCOME] == "interrupted"
    assert o.value("turnrouter_interruptions_total") == 1
    assert o.value("turnrouter_turns_total", route="weather", outcome="interrupted") == 1
    assert o.value("turnrouter_turns_in_flight") == 0


async def test_departure_and_shutdown_release_spans(capture: TelemetryCapture) -> None:
    """Departure and stop() release focus owners under the caller's span, not a turn."""
    o = Outcomes(capture, ScriptedDecisions("weather"), ScriptedAgent("weather", results="focus"))
    await o.say("plan my trip")
    tracer = capture.tracer_provider.get_tracer("app")
    with tracer.start_as_current_span("participant left") as caller:
        await o.router.participant_left("alice")
    (departure,) = capture.spans("turnrouter.release")
    assert dict(departure.attributes or {}) == {ATTR.ROUTE: "weather",
                                                ATTR.RELEASE_REASON: "departure"}
    assert departure.parent is not None
    assert departure.parent.span_id == caller.get_span_context().span_id
    assert o.value("turnrouter_active_participants") == 0

    await o.router.handle(AgentTurn("bob", "b1", "plan my trip"))  # bob: weather focus
    capture.clear()
    await o.router.stop()
    (shutdown,) = capture.spans("turnrouter.release")
    assert dict(shutdown.attributes or {})[ATTR.RELEASE_REASON] == "shutdown"
    assert capture.spans("turnrouter.turn") == []
    assert o.value("turnrouter_active_participants") == 0
