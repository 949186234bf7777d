"""The distinct-participant windows behind the broad-clarification page: bounded, counted
once per participant, expired by a controllable clock, exposed as two gauges."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from turnrouter import AgentRouter, AgentTurn
from turnrouter.telemetry import MAX_WINDOW_PARTICIPANTS, ParticipantWindow, Telemetry
from turnrouter.testing import OutputRecorder, ScriptedAgent, ScriptedDecisions


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_participant_counts_once_and_expires() -> None:
    clock = _Clock()
    window = ParticipantWindow(window_secs=60.0, clock=clock)
    for _ in range(100):
        assert window.note("loud")
    window.note("quiet")
    assert len(window) == 2
    clock.now = 30.0
    window.note("quiet")
    clock.now = 61.0
    assert sorted(window.live()) == ["quiet"]
    clock.now = 91.0
    assert len(window) == 0


def test_the_bound_drops_the_oldest_and_reports_an_overflow() -> None:
    clock = _Clock()
    window = ParticipantWindow(window_secs=60.0, max_participants=3, clock=clock)
    assert all(window.note(name) for name in ("a", "b", "c"))
    assert window.note("d") is False  # "a" was inside the window
    assert sorted(window.live()) == ["b", "c", "d"]
    clock.now = 100.0
    assert window.note("e") is True  # expired ids make room without an overflow
    assert sorted(window.live()) == ["e"]


@given(st.lists(st.text(max_size=300), max_size=200), st.integers(1, 20))
def test_never_holds_more_than_its_bound(ids: list[str], bound: int) -> None:
    window = ParticipantWindow(max_participants=bound)
    for pid in ids:
        window.note(pid)
    assert len(window) <= min(bound, len(set(ids)))


@pytest.mark.parametrize("kwargs", [{"window_secs": 0}, {"window_secs": float("nan")},
                                    {"max_participants": 0}, {"max_participants": True},
                                    {"max_participants": 1.5}])
def test_bad_settings_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        ParticipantWindow(**kwargs)  # type: ignore[arg-type]


def test_default_bound_is_documented() -> None:
    assert MAX_WINDOW_PARTICIPANTS == 10_000


@pytest.mark.anyio
async def test_the_gauges_count_distinct_participants_and_clarified_ones() -> None:
    """Five participants speak, one of them is clarified on every turn: the window holds
    five speakers and one clarified participant, however many turns it took; once its
    latest turn is answered it is no longer counted as clarified."""
    registry = CollectorRegistry()
    telemetry = Telemetry(registry=registry)
    decisions_flip = [False]
    decisions = ScriptedDecisions(
        lambda request: "clarify" if request.turn.participant_id == "loud"
        and not decisions_flip[0] else "weather")
    router = AgentRouter({"weather": ScriptedAgent("weather")}, decisions,
                         output=OutputRecorder(), telemetry=telemetry)
    try:
        for turn in range(20):
            await router.handle(AgentTurn("loud", f"loud-{turn}", "what?"))
        for name in ("a", "b", "c", "d"):
            await router.handle(AgentTurn(name, f"{name}-1", "will it rain?"))
        assert registry.get_sample_value("turnrouter_window_participants") == 5
        assert registry.get_sample_value("turnrouter_window_clarified_participants") == 1
        # A clarified participant whose next turn is answered no longer counts.
        decisions_flip[0] = True
        await router.handle(AgentTurn("loud", "loud-answered", "will it rain?"))
        assert registry.get_sample_value("turnrouter_window_clarified_participants") == 0
        assert registry.get_sample_value("turnrouter_window_participants") == 5
    finally:
        await router.stop()
    assert registry.get_sample_value("turnrouter_clarifications_total",
                                     {"reason": "low_confidence"}) == 20
