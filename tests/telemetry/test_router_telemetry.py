"""End to end: scripted turns through `AgentRouter` with a real SDK and registry."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from opentelemetry.trace import StatusCode, Tracer

from turnrouter import AgentRouter, AgentTurn, RouteDecision, RouteRequest
from turnrouter.telemetry import ATTR
from turnrouter.testing import ScriptedAgent, ScriptedDecisions

from .conftest import Outcomes, Rig

pytestmark = pytest.mark.anyio


@pytest.fixture
def router_rig() -> Iterator[Rig]:
    """A rig for router scenarios."""
    made = Rig()
    yield made
    made.close()


@pytest.fixture
async def stopped() -> AsyncIterator[list[AgentRouter]]:
    """Routers appended here are stopped after the test."""
    routers: list[AgentRouter] = []
    yield routers
    for router in routers:
        await router.stop()


async def test_answered_turn(router_rig: Rig, stopped: list[AgentRouter]) -> None:
    """An answered turn: route, admission and invoke_agent under one turn span."""
    s = Outcomes(router_rig, ScriptedDecisions("weather"), ScriptedAgent("weather"))
    stopped.append(s.router)
    await s.say("rain today?")
    assert s.child_names() == ["turnrouter.route", "turnrouter.admission", "invoke_agent weather"]
    turn = dict(s.turns()[-1].attributes or {})
    assert turn[ATTR.OUTCOME] == "answer"
    assert turn[ATTR.ROUTE] == "weather"
    assert turn[ATTR.ATTEMPTS] == 1
    invoke = s.capture.span("invoke_agent weather")
    assert [event.name for event in invoke.events] == ["turnrouter.first_response"]
    value = router_rig.value
    assert value("turnrouter_turns_total", route="weather", outcome="answer") == 1
    assert value("turnrouter_admissions_total", route="weather", disposition="accept",
                 focused="false") == 1
    assert value("turnrouter_first_response_seconds_count", route="weather") == 1
    assert value("turnrouter_decision_duration_seconds_count") == 1
    assert value("turnrouter_turns_in_flight") == 0
    assert value("turnrouter_active_participants") == 1
    assert "trace_id" in router_rig.openmetrics()


async def test_decline_then_reroute(router_rig: Rig, stopped: list[AgentRouter]) -> None:
    """A declining route is counted as a reroute and the second choice answers."""
    s = Outcomes(router_rig, ScriptedDecisions("weather", "music"),
                 ScriptedAgent("weather", admissions="decline"), ScriptedAgent("music"))
    stopped.append(s.router)
    await s.say()
    assert s.child_names() == ["turnrouter.route", "turnrouter.admission", "turnrouter.route",
                            "turnrouter.admission", "invoke_agent music"]
    second_route = s.capture.spans("turnrouter.route")[1]
    assert dict(second_route.attributes or {})[ATTR.DECISION_EXCLUDED] == ("weather",)
    value = router_rig.value
    assert value("turnrouter_reroutes_total", route="weather") == 1
    assert value("turnrouter_admissions_total", route="weather", disposition="decline",
                 focused="false") == 1
    assert value("turnrouter_turns_total", route="music", outcome="answer") == 1


async def test_default_fallback(router_rig: Rig, stopped: list[AgentRouter]) -> None:
    """After exhausted declines the default answers without admission (fallback=true)."""
    s = Outcomes(router_rig, ScriptedDecisions("weather", "music"),
                 ScriptedAgent("weather", admissions="decline"),
                 ScriptedAgent("music", admissions="decline"))
    stopped.append(s.router)
    await s.say()
    invoke = s.capture.span("invoke_agent conversation")
    assert dict(invoke.attributes or {})[ATTR.FALLBACK] is True
    value = router_rig.value
    assert value("turnrouter_default_fallbacks_total", route="conversation") == 1
    assert value("turnrouter_turns_total", route="conversation", outcome="answer") == 1


async def test_clarify(router_rig: Rig, stopped: list[AgentRouter]) -> None:
    """A clarify decision without scores ends the turn with a clarification."""
    s = Outcomes(router_rig, ScriptedDecisions(RouteDecision("clarify")),
                 ScriptedAgent("weather"))
    stopped.append(s.router)
    await s.say("hmm")
    turn = dict(s.turns()[-1].attributes or {})
    assert turn[ATTR.OUTCOME] == "clarify"
    assert ATTR.ROUTE not in turn
    assert "invoke_agent weather" not in [span.name for span in s.capture.spans()]
    value = router_rig.value
    assert value("turnrouter_clarifications_total", reason="low_confidence") == 1
    assert value("turnrouter_turns_total", route="none", outcome="clarify") == 1


async def test_failure_before_started(router_rig: Rig, stopped: list[AgentRouter]) -> None:
    """An answer that fails before started() marks the spans and counts the failure."""
    s = Outcomes(router_rig, ScriptedDecisions("weather"),
                 ScriptedAgent("weather", results=RuntimeError("agent crashed"),
                               call_started=False))
    stopped.append(s.router)
    with pytest.raises(RuntimeError, match="agent crashed"):
        await s.say()
    for name in ("invoke_agent weather", "turnrouter.turn"):
        span = s.capture.span(name)
        assert span.status.status_code is StatusCode.ERROR
        assert dict(span.attributes or {})[ATTR.ERROR_TYPE] == "RuntimeError"
    assert dict(s.turns()[-1].attributes or {})[ATTR.OUTCOME] == "failed"
    assert s.capture.span("invoke_agent weather").events == ()
    value = router_rig.value
    assert value("turnrouter_failures_total", route="weather", stage="answer") == 1
    assert value("turnrouter_turns_total", route="weather", outcome="failed") == 1
    assert value("turnrouter_first_response_seconds_count", route="weather") is None
    assert value("turnrouter_turns_in_flight") == 0


class TracingDecisions(ScriptedDecisions):
    """Scripted decisions that open a span of their own, as a real classifier would."""

    def __init__(self, tracer: Tracer, *script: str) -> None:
        super().__init__(*script)
        self.tracer = tracer

    async def decide(self, request: RouteRequest) -> RouteDecision:
        with self.tracer.start_as_current_span("classify"):
            return await super().decide(request)


async def test_classifier_spans_nest_under_route(router_rig: Rig,
                                                 stopped: list[AgentRouter]) -> None:
    """During decide() the route span is current: a classifier's spans are its children."""
    decisions = TracingDecisions(router_rig.tracer_provider.get_tracer("classifier"), "weather")
    s = Outcomes(router_rig, decisions, ScriptedAgent("weather"))
    stopped.append(s.router)
    await s.say()
    classify = router_rig.span("classify")
    assert classify.parent is not None
    assert classify.parent.span_id == router_rig.span("turnrouter.route").context.span_id
    assert s.child_names() == ["turnrouter.route", "turnrouter.admission", "invoke_agent weather"]


async def test_heard_turn_marks_started_on_the_span_and_measures_to_the_audio(
        router_rig: Rig, stopped: list[AgentRouter]) -> None:
    """With report_heard=True, invoke_agent still gets its first-response event and
    seconds at started(); the histogram waits for the reported audio."""
    s = Outcomes(router_rig, ScriptedDecisions("weather"), ScriptedAgent("weather"))
    stopped.append(s.router)
    routed = await s.router.route_turn(AgentTurn("alice", "t1", "rain?"), report_heard=True)
    assert routed.route == "weather"
    invoke = s.capture.span("invoke_agent weather")
    assert [event.name for event in invoke.events] == ["turnrouter.first_response"]
    seconds = dict(invoke.attributes or {})[ATTR.FIRST_RESPONSE_SECONDS]
    assert isinstance(seconds, float) and seconds >= 0.0
    value = router_rig.value
    assert value("turnrouter_first_response_seconds_count", route="weather") in (None, 0)
    assert s.router.mark_heard("alice", "t1") is True
    assert value("turnrouter_first_response_seconds_count", route="weather") == 1


async def test_a_barge_in_before_the_audio_is_an_interrupted_first_response(
        router_rig: Rig, stopped: list[AgentRouter]) -> None:
    """With report_heard=True and a barge-in before the audio: the first response goes to
    `turnrouter_first_response_interrupted_seconds`, nothing to the first-response or
    silence histograms (voice7: both got the text's 0.1 s)."""
    s = Outcomes(router_rig, ScriptedDecisions("weather"), ScriptedAgent("weather"))
    stopped.append(s.router)
    await s.router.route_turn(AgentTurn("alice", "t1", "rain?"), report_heard=True)
    await s.router.interrupt("alice")
    value = router_rig.value
    assert value("turnrouter_first_response_interrupted_seconds_count", route="weather") == 1
    assert value("turnrouter_first_response_seconds_count", route="weather") in (None, 0)
    assert value("turnrouter_silence_seconds_count", route="weather") in (None, 0)
    assert s.router.mark_heard("alice", "t1") is False
