"""The destination-status and acknowledgment signals the rules and dashboards read."""

from __future__ import annotations

import pytest

from turnrouter import AgentRouter, AgentTurn, RoutingAid
from turnrouter.events import (
    AcknowledgmentGenerated,
    AnswerAfterAcknowledgment,
    RouteIneligible,
    TurnFinished,
    TurnStarted,
)
from turnrouter.telemetry import NEEDLESS_WITHIN_SECONDS
from turnrouter.testing import OutputRecorder, ScriptedAgent, ScriptedDecisions, TelemetryCapture

pytestmark = pytest.mark.anyio


class Busy(ScriptedAgent):
    """A destination whose routing aid says it is at capacity."""

    def routing_aid(self, participant_id: str) -> RoutingAid:
        return RoutingAid(self.name, "busy", eligible=False, eligibility="capacity")


async def test_a_routed_turn_counts_each_ineligible_candidate_by_reason(
        turnrouter_telemetry: TelemetryCapture) -> None:
    """Ineligible routes are counted by route and their eligibility state."""
    router = AgentRouter(
        {"weather": ScriptedAgent("weather"), "travel": Busy("travel"),
         "music": ScriptedAgent("music", eligible=False),
         "conversation": ScriptedAgent("conversation")},
        ScriptedDecisions("weather"), output=OutputRecorder(),
        telemetry=turnrouter_telemetry.telemetry)
    await router.handle(AgentTurn("p1", "t1", "rain?"))
    value = turnrouter_telemetry.value
    assert value("turnrouter_ineligible_routes_total", route="travel", reason="capacity") == 1
    assert value("turnrouter_ineligible_routes_total", route="music",
                 reason="unavailable") == 1
    assert value("turnrouter_ineligible_routes_total", route="weather",
                 reason="unavailable") is None


@pytest.mark.parametrize(("reason", "label"), [
    ("policy", "policy"), ("not_candidate", "not_candidate"), ("on holiday", "other")])
def test_unknown_eligibility_states_are_counted_as_other(
        reason: str, label: str, turnrouter_telemetry: TelemetryCapture) -> None:
    """The reason label stays bounded: unknown eligibility states read `other`."""
    telemetry = turnrouter_telemetry.telemetry
    observer = telemetry.turn_started(TurnStarted(AgentTurn("p", "t", "q"), None))
    observer.route_ineligible(RouteIneligible("travel", reason))
    observer.finished(TurnFinished("answer", None, None, None, 1, None))
    assert turnrouter_telemetry.value("turnrouter_ineligible_routes_total",
                                      route="travel", reason=label) == 1


@pytest.mark.parametrize(("gap", "needless"), [
    (0.0, True), (NEEDLESS_WITHIN_SECONDS, True), (NEEDLESS_WITHIN_SECONDS + 0.01, False),
    (2.0, False)])
def test_an_answer_right_behind_its_acknowledgment_makes_it_needless(
        gap: float, needless: bool, turnrouter_telemetry: TelemetryCapture) -> None:
    """Needless: the answer started within NEEDLESS_WITHIN_SECONDS of the acknowledgment;
    counted by trigger, so early (prediction-triggered) ones that turned out needless
    are told from the delay's."""
    telemetry = turnrouter_telemetry.telemetry
    observer = telemetry.turn_started(TurnStarted(AgentTurn("p", "t", "q"), None))
    observer.answer_after_acknowledgment(AnswerAfterAcknowledgment("calendar", "delay", gap))
    observer.acknowledgment_generated(AcknowledgmentGenerated("calendar", 0.31))
    observer.finished(TurnFinished("answer", "calendar", None, None, 1, None))
    early = telemetry.turn_started(TurnStarted(AgentTurn("p", "t2", "q"), None))
    early.answer_after_acknowledgment(AnswerAfterAcknowledgment("calendar", "prediction", gap))
    early.answer_after_acknowledgment(AnswerAfterAcknowledgment("calendar", "prediction", gap))
    early.finished(TurnFinished("answer", "calendar", None, None, 1, None))
    value = turnrouter_telemetry.value
    assert value("turnrouter_needless_acknowledgments_total", route="calendar",
                 trigger="delay") == (1.0 if needless else None)
    assert value("turnrouter_needless_acknowledgments_total", route="calendar",
                 trigger="prediction") == (2.0 if needless else None)
    assert value("turnrouter_acknowledgment_generation_seconds_count", route="calendar") == 1
    assert value("turnrouter_acknowledgment_generation_seconds_sum",
                 route="calendar") == pytest.approx(0.31)
