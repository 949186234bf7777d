"""Each turn outcome through the real router: its span tree, attributes and metrics."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from opentelemetry import trace
from opentelemetry.trace import StatusCode
from prometheus_client import REGISTRY

from turnrouter import (
    AgentRouter,
    AgentTurn,
    DestinationResult,
    RouteDecision,
    TurnInterrupted,
    current_turn_context,
)
from turnrouter.llm import TemplateAcknowledger
from turnrouter.telemetry import ATTR, CONTENT_CAPTURE_ENV, Telemetry
from turnrouter.testing import (
    ManualClock,
    OutputRecorder,
    ScriptedAgent,
    ScriptedDecisions,
    ScriptedDepartingAgent,
    TelemetryCapture,
)

from .conftest import Outcomes

pytestmark = pytest.mark.anyio


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


@pytest.mark.parametrize("end", ["participant_left", "stop"])
async def test_focus_held_at_a_departure_or_stop_is_counted_lost(
        capture: TelemetryCapture, end: str) -> None:
    """voice22 F3: a participant who leaves (or a router that stops) while a route holds
    their focus ends that focus, but only `taken` was counted, so "focus held now"
    (taken - released - lost) grew for every call that ended in a booking flow. Now it
    is counted `lost`, once, beside the release span of reason departure/shutdown."""
    o = _focus_on_weather(capture)
    await o.say("plan my trip")
    if end == "stop":
        await o.router.stop()
    else:
        await o.router.participant_left("alice")
    assert o.router.focus_of("alice") is None
    assert o.value("turnrouter_focus_transitions_total", route="weather",
                   transition="taken") == 1
    assert o.value("turnrouter_focus_transitions_total", route="weather",
                   transition="lost") == 1
    assert o.value("turnrouter_focus_transitions_total", route="weather",
                   transition="released") is None
    (release,) = capture.spans("turnrouter.release")
    assert release.attributes is not None
    assert release.attributes[ATTR.RELEASE_REASON] == (
        "shutdown" if end == "stop" else "departure")


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
    ("policy", ScriptedDecisions(RouteDecision("clarify", rationale="policy: -> clarify")),
     [ScriptedAgent("weather")], 1),
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
    # A destination's question is counted on its route; the router's own on none.
    asked_by = "weather" if reason == "destination" else "none"
    assert o.value("turnrouter_turns_total", route=asked_by, outcome="clarify") == 1
    assert turn.get(ATTR.ROUTE) == (None if asked_by == "none" else asked_by)
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


async def test_a_departure_without_a_caller_span_joins_the_participants_trace(
        capture: TelemetryCapture) -> None:
    """With no span current, a departure's release span is a child of the participant's
    latest turn (its trace), not the root of a new trace."""
    o = Outcomes(capture, ScriptedDecisions("weather"), ScriptedAgent("weather", results="focus"))
    await o.say("plan my trip")
    (turn,) = capture.spans("turnrouter.turn")
    await o.router.participant_left("alice")
    (departure,) = capture.spans("turnrouter.release")
    assert departure.parent is not None
    assert departure.context.trace_id == turn.context.trace_id
    assert departure.parent.span_id == turn.context.span_id
    await o.router.stop()


async def test_failed_departure_release_is_an_error(capture: TelemetryCapture) -> None:
    """A participant_left() hook that raises: release span ERROR, counted at stage release."""
    weather = ScriptedDepartingAgent("weather", results="focus",
                                     departure_error=RuntimeError("gone"))
    o = Outcomes(capture, ScriptedDecisions("weather"), weather)
    await o.say()
    with pytest.raises(ExceptionGroup):
        await o.router.participant_left("alice")
    release = capture.span("turnrouter.release")
    assert release.status.status_code is StatusCode.ERROR
    assert dict(release.attributes or {})[ATTR.ERROR_TYPE] == "RuntimeError"
    assert o.value("turnrouter_failures_total", route="weather", stage="release") == 1
    weather.departure_error = None
    await o.router.stop()


async def test_cancelled_admission_is_marked_interrupted(capture: TelemetryCapture) -> None:
    """An interrupt during admit(): the admission span says interrupted, not an error."""
    weather = ScriptedAgent("weather")
    weather.admit_gate = anyio.Event()  # never set
    weather.admit_entered = anyio.Event()
    o = Outcomes(capture, ScriptedDecisions("weather"), weather)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_interruptible, o.say())
        await weather.admit_entered.wait()
        await o.router.interrupt("alice")
    admission = capture.span("turnrouter.admission")
    attributes = dict(admission.attributes or {})
    assert attributes[ATTR.ADMISSION_DISPOSITION] == "interrupted"
    assert attributes[ATTR.INTERRUPTED] is True
    assert admission.status.status_code is not StatusCode.ERROR
    assert o.value("turnrouter_admissions_total", route="weather", disposition="interrupted",
                   focused="false") == 1
    assert o.value("turnrouter_failures_total", route="weather", stage="admission") is None


async def _interruptible(turn: Awaitable[object]) -> None:
    """Await a turn that may be interrupted (in a task group, so it must not raise)."""
    with contextlib.suppress(TurnInterrupted):
        await turn


async def test_queued_turn_cancelled_before_it_ran(capture: TelemetryCapture) -> None:
    """A turn interrupted while queued is one interrupted turn span with no attempts."""
    weather = ScriptedAgent("weather", results=["focus", "release"])
    o = Outcomes(capture, ScriptedDecisions("weather"), weather)
    await o.say("plan")
    weather.release_gate = anyio.Event()  # the post-answer release of turn 2 waits here
    async with anyio.create_task_group() as tg:
        tg.start_soon(_interruptible, o.say("done"))
        await weather.release_entered.wait()  # turn 2 is in its protected bookkeeping
        tg.start_soon(_interruptible, o.say("queued"))  # turn 3 queues behind it
        await anyio.lowlevel.checkpoint()  # asyncio runs it up to its wait in the queue
        tg.start_soon(o.router.interrupt, "alice")  # waits for turn 2 to drain
        for _ in range(100):  # until the queued turn has ended, still behind turn 2
            if [span for span in o.turns() if dict(span.attributes or {})[ATTR.TURN_ID] == "t3"]:
                break
            await anyio.lowlevel.checkpoint()
        weather.release_gate.set()
    outcomes = {dict(span.attributes or {})[ATTR.TURN_ID]: dict(span.attributes or {})
                for span in o.turns()}
    assert outcomes["t2"][ATTR.OUTCOME] == "release"  # protected: completed
    assert (outcomes["t3"][ATTR.OUTCOME], outcomes["t3"][ATTR.ATTEMPTS]) == ("interrupted", 0)
    t3 = next(span for span in o.turns() if dict(span.attributes or {})[ATTR.TURN_ID] == "t3")
    assert o.children(t3) == []
    assert o.value("turnrouter_turns_in_flight") == 0


async def test_turn_context_agrees_with_the_span_context(capture: TelemetryCapture) -> None:
    """Inside answer(), current_turn_context() names the turn whose invoke_agent span is
    current."""
    seen: dict[str, Any] = {}

    class Looking(ScriptedAgent):
        async def answer(self, turn: AgentTurn, *, started: Any) -> DestinationResult:
            seen["exchange_id"] = current_turn_context().exchange_id
            seen["span"] = trace.get_current_span().get_span_context()
            return await super().answer(turn, started=started)

    o = Outcomes(capture, ScriptedDecisions("weather"), Looking("weather"))
    await o.say()
    invoke = capture.span("invoke_agent weather").context
    turn = o.turns()[-1]
    assert seen["exchange_id"] == dict(turn.attributes or {})[ATTR.TURN_ID] == "t1"
    assert (seen["span"].trace_id, seen["span"].span_id) == (invoke.trace_id, invoke.span_id)
    assert invoke.trace_id == turn.context.trace_id


def _registry_snapshot() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in REGISTRY.collect() for sample in family.samples
            if sample.name.startswith("turnrouter_")}


async def test_disabled_router_writes_nothing(capture: TelemetryCapture) -> None:
    """Telemetry.disabled(): a router's turns, focus, departure and stop write no metric
    and make no span."""
    before = _registry_snapshot()
    agents = {"weather": ScriptedAgent("weather", results="focus"),
              "conversation": ScriptedAgent("conversation")}
    router = AgentRouter(agents, ScriptedDecisions("weather"), output=OutputRecorder(),
                         telemetry=Telemetry.disabled())
    await router.handle(AgentTurn("alice", "t1", "plan"))
    await router.handle(AgentTurn("bob", "t2", "plan"))
    await router.participant_left("alice")
    await router.stop()
    assert _registry_snapshot() == before
    assert capture.spans() == []


async def test_default_telemetry_uses_the_default_registry() -> None:
    """AgentRouter(telemetry omitted) counts on prometheus_client's default registry."""
    key = ("turnrouter_turns_total", (("outcome", "answer"), ("route", "weather")))
    before = _registry_snapshot().get(key, 0.0)
    router = AgentRouter({"weather": ScriptedAgent("weather"),
                          "conversation": ScriptedAgent("conversation")},
                         ScriptedDecisions("weather"), output=OutputRecorder())
    await router.handle(AgentTurn("alice", "t1", "rain?"))
    await router.stop()
    assert _registry_snapshot()[key] == before + 1


async def test_content_capture_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """With OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true the router's spans carry
    the query and the answer."""
    monkeypatch.setenv(CONTENT_CAPTURE_ENV, "true")
    with TelemetryCapture() as capture:
        o = Outcomes(capture, ScriptedDecisions("weather"),
                     ScriptedAgent("weather", answer_text="sunny"))
        await o.say("rain today?")
        assert o.last_turn()[ATTR.QUERY] == "rain today?"
        invoke = dict(capture.span("invoke_agent weather").attributes or {})
        assert "rain today?" in str(invoke[ATTR.GEN_AI_INPUT_MESSAGES])
        assert "sunny" in str(invoke[ATTR.GEN_AI_OUTPUT_MESSAGES])


async def test_no_ids_in_labels_after_router_scenarios(capture: TelemetryCapture) -> None:
    """After routed turns, focus, reroutes and a departure, no label value is a participant
    or turn id."""
    o = Outcomes(capture, ScriptedDecisions("weather", "music"),
                 ScriptedAgent("weather", admissions=["decline", "accept"], results="focus"),
                 ScriptedAgent("music"))
    await o.say()
    await o.say()
    await o.router.participant_left("alice")
    values = {value for family in capture.registry.collect() for sample in family.samples
              for value in sample.labels.values()}
    assert values
    assert values.isdisjoint({"alice", "t1", "t2"})


class _ClockedAgent(ScriptedAgent):
    """Starts answering `latency` seconds of the manual clock after answer() begins."""

    def __init__(self, clock: ManualClock, latency: float) -> None:
        super().__init__("calendar")
        self.clock, self.latency = clock, latency

    async def answer(self, turn: AgentTurn, *, started: Any) -> DestinationResult:
        await self.clock.sleep(self.latency)
        await started()
        return DestinationResult(text="at nine")


async def test_acknowledgment_span_is_a_child_of_its_turn(capture: TelemetryCapture) -> None:
    """A slow answer's acknowledgment: a turnrouter.acknowledgment span under the turn."""
    clock = ManualClock()
    agents = {"calendar": _ClockedAgent(clock, 2.5), "conversation": ScriptedAgent("conversation")}
    router = AgentRouter(agents, ScriptedDecisions("calendar"), output=OutputRecorder(),
                         telemetry=capture.telemetry, clock=clock,
                         acknowledgment_llm=TemplateAcknowledger(),
                         acknowledgment_delay_secs=1.0)
    done = anyio.Event()

    async def turn() -> None:
        await router.handle(AgentTurn("alice", "t1", "what's on tomorrow"))
        done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(turn)
        await clock.run_until(done)
    ack = capture.span("turnrouter.acknowledgment")
    turn_span = capture.span("turnrouter.turn")
    assert ack.parent is not None
    assert ack.parent.span_id == turn_span.context.span_id
    attributes = dict(ack.attributes or {})
    assert (attributes[ATTR.ACK_OUTCOME], attributes[ATTR.ACK_TRIGGER]) == ("emitted", "delay")
    assert capture.value("turnrouter_acknowledgments_total", route="calendar",
                         outcome="emitted", trigger="delay") == 1
    assert capture.value("turnrouter_silence_seconds_sum", route="calendar") == 1.0
    await router.stop()
