"""Bounds on everything that grows: each holds, and each overflow is counted."""

from __future__ import annotations

import logging
from typing import Any

import anyio
import pytest

from turnrouter import (
    Admission,
    AgentExchange,
    AgentRouter,
    AgentTurn,
    ConfigurationError,
    ContextPatch,
    ContractTypeError,
    ContractValueError,
    DestinationResult,
    LifecycleError,
    RouteDecision,
    RouteRequest,
    TurnInterrupted,
)
from turnrouter.runtime import (
    ParticipantJoined,
    ParticipantLeft,
    ResponseOutput,
    Topic,
    UserQuery,
)
from turnrouter.testing import OutputRecorder, ScriptedAgent, ScriptedDecisions

from .kit import Harness

pytestmark = pytest.mark.anyio


def overflows(h: Harness) -> list[str]:
    return [event[1] for event in h.observer.events if event[0] == "limit_exceeded"]


async def test_history_keeps_at_most_max_history_exchanges() -> None:
    """Empty exchanges cannot pile up: the count bound trims the oldest, counted."""
    h = Harness(ScriptedAgent("conversation", answer_text=""), max_history_exchanges=3)
    for _ in range(5):
        await h.say("")
    assert len(h.router.history_of("p1")) == 3
    assert overflows(h) == ["history_exchanges", "history_exchanges"]


async def test_seeded_history_reads_only_what_it_keeps() -> None:
    """A huge caller history is cut to the newest exchanges the bounds keep, counted."""
    h = Harness(ScriptedAgent("conversation"), max_history_exchanges=4)
    seeded = tuple(AgentExchange(f"q{n}", "") for n in range(200_000))
    await h.say("hi", history=seeded)
    turn = h["conversation"].calls[0]
    assert [exchange.user for exchange in turn.history] == [
        "q199996", "q199997", "q199998", "q199999"]
    # The turn's own exchange then pushes out the oldest kept one.
    assert overflows(h) == ["seeded_history", "history_exchanges"]
    assert h.router.context_state("p1").version == 200_001


async def test_seeded_history_within_bounds_is_not_an_overflow() -> None:
    """Trimming to the byte budget is the contract, not an overflow."""
    h = Harness(ScriptedAgent("conversation"), context_budget_bytes=8)
    await h.say("hi", history=tuple(AgentExchange("abcd", "") for _ in range(10)))
    assert len(h["conversation"].calls[0].history) == 2
    assert overflows(h) == []


async def test_a_full_queue_drops_the_oldest_waiting_turn_and_says_so() -> None:
    """Past max_waiting_turns the oldest waiting turn is dropped, told and counted."""
    # The second turn blocks in the shielded release of the focus owner, so the turns
    # after it wait.
    weather = ScriptedAgent("weather", results="focus", admissions=["accept", "release"])
    gate = weather.release_gate = anyio.Event()
    h = Harness(weather, ScriptedAgent("music", results="focus"),
                decisions=ScriptedDecisions("weather", "music"), max_waiting_turns=2)
    await h.say("rain?")
    async with anyio.create_task_group() as tg:
        first = h.turn("play jazz")
        tg.start_soon(h.capture, first)
        with anyio.fail_after(5):
            await h["weather"].release_entered.wait()
        waiting = [h.turn(f"again {n}") for n in range(4)]
        for turn in waiting:
            tg.start_soon(h.capture, turn)
            await anyio.wait_all_tasks_blocked()
        gate.set()
    dropped = [turn.turn_id for turn in waiting
               if isinstance(h.outcomes[turn.turn_id], TurnInterrupted)
               and "max_waiting_turns" in str(h.outcomes[turn.turn_id])]
    assert dropped == [waiting[0].turn_id, waiting[1].turn_id]
    assert overflows(h) == ["waiting_turns", "waiting_turns"]
    told = [spoken for spoken in h.output.spoken if spoken.turn_id in dropped]
    assert len(told) == 2 and all("repeat" in spoken.text for spoken in told)


async def test_participants_are_bounded_and_departures_make_room() -> None:
    """Past max_participants a new participant's turn is refused, counted."""
    h = Harness(ScriptedAgent("conversation"), max_participants=2)
    await h.say(participant="a")
    await h.say(participant="b")
    with pytest.raises(LifecycleError, match="max_participants"):
        await h.say(participant="c")
    assert overflows(h) == ["participants"]
    assert h.observer.outcome("t3") == "refused"
    await h.say(participant="a")  # a known participant still talks
    await h.router.participant_left("a")
    assert (await h.say(participant="c")).disposition == "answer"


def _runtime_topics() -> dict[str, Any]:
    return {"query_topic": Topic("q", UserQuery), "output_topic": Topic("o", ResponseOutput),
            "participant_joined_topic": Topic("j", ParticipantJoined),
            "participant_left_topic": Topic("l", ParticipantLeft)}


async def test_departed_participants_are_bounded_oldest_first() -> None:
    """Past max_departed_participants the oldest departed id is forgotten, counted."""
    h = Harness(ScriptedAgent("conversation"), max_departed_participants=3,
                **_runtime_topics())
    for n in range(5):
        await h.router.participant_left(f"gone{n}")
    assert overflows(h) == ["departed_participants", "departed_participants"]
    assert (await h.say(participant="gone0")).disposition == "answer"
    with pytest.raises(LifecycleError):
        await h.say(participant="gone4")


async def test_oversized_and_non_json_patches_are_refused() -> None:
    """A patch over max_patch_bytes, or not JSON data, is refused with a clear error."""
    h = Harness(ScriptedAgent("conversation"), max_patch_bytes=200)
    await h.say()
    with pytest.raises(ContractValueError, match="max_patch_bytes"):
        await h.router.apply_context_patch(
            "p1", ContextPatch(task_id="big", facts={"blob": "x" * 500}))
    assert overflows(h) == ["patch_bytes"]
    with pytest.raises(ContractValueError, match="JSON"):
        await h.router.apply_context_patch(
            "p1", ContextPatch(task_id="odd", facts={"thing": object()}))


async def test_patch_payloads_count_against_the_history_budget() -> None:
    """Facts and artifacts kept with a patch count against the byte budget."""
    h = Harness(ScriptedAgent("conversation", answer_text=""), context_budget_bytes=200)
    await h.say("hello")
    await h.router.apply_context_patch(
        "p1", ContextPatch(task_id="t", digest=("d",), facts={"k": "v" * 164}))
    # The patch's payload (182 bytes) and text leave no room for the older exchange.
    assert [exchange.user for exchange in h.router.history_of("p1")] == ["[background: t]"]


async def test_a_release_that_never_returns_times_out_and_is_retried() -> None:
    """release() past release_timeout_secs fails the departure; a retry releases again."""
    agent = ScriptedAgent("conversation")
    h = Harness(agent, release_timeout_secs=0.05)
    await h.say()
    agent.release_gate = anyio.Event()
    with anyio.fail_after(5), pytest.raises(ExceptionGroup) as caught:
        await h.router.participant_left("p1")
    assert caught.group_contains(TimeoutError)
    assert overflows(h) == ["release_timeout"]
    agent.release_gate.set()
    with anyio.fail_after(5):
        await h.router.participant_left("p1")
    assert agent.count("release") == 2
    assert h.router.participants == frozenset()


async def test_a_hanging_release_during_a_turn_times_out_and_the_turn_goes_on() -> None:
    """A focus owner whose release() hangs when focus moves: the turn still answers."""
    weather = ScriptedAgent("weather", results="focus",
                            admissions=[Admission("accept"), Admission("decline")])
    weather.release_gate = anyio.Event()  # never set
    music = ScriptedAgent("music", results="focus")
    h = Harness(weather, music, decisions=ScriptedDecisions("weather", "music"),
                release_timeout_secs=0.05)
    await h.say("rain?")
    with anyio.fail_after(5):
        result = await h.say("play jazz")
    assert result.disposition == "focus"
    assert h.router.focus_of("p1") == "music"
    assert overflows(h) == ["release_timeout"]
    assert ("release", "weather", "focus_taken", "TimeoutError") in h.observer.turns["t2"]


async def test_a_release_raising_its_own_timeout_error_is_not_a_limit_overflow() -> None:
    """Only the router's own deadline counts as release_timeout."""
    agent = ScriptedAgent("conversation", release_error=TimeoutError("backend"))
    h = Harness(agent)
    await h.say()
    with pytest.raises(ExceptionGroup):
        await h.router.participant_left("p1")
    assert overflows(h) == []


@pytest.mark.parametrize(("name", "value", "error"), [
    ("max_history_exchanges", 0, ConfigurationError),
    ("max_waiting_turns", -1, ConfigurationError),
    ("max_departed_participants", 1.5, ContractTypeError),
    ("max_patch_bytes", True, ContractTypeError),
    ("release_timeout_secs", float("inf"), ConfigurationError),
    ("release_timeout_secs", "10", ContractTypeError),
])
def test_bounds_are_validated(name: str, value: Any, error: type[Exception]) -> None:
    """A bad bound raises an error naming it."""
    with pytest.raises(error, match=name):
        AgentRouter({"conversation": ScriptedAgent("conversation")},
                    ScriptedDecisions("conversation"), **{name: value})


async def test_a_failing_decision_service_keeps_user_text_out_of_warnings(
        caplog: pytest.LogCaptureFixture) -> None:
    """A decision service's error message (which may quote the query) is not logged."""

    class Leaky:
        async def decide(self, request: RouteRequest) -> RouteDecision:
            raise ValueError(f"cannot route {request.turn.query!r}")

    router = AgentRouter({"conversation": ScriptedAgent("conversation")}, Leaky(),
                         output=OutputRecorder())
    with caplog.at_level(logging.WARNING, logger="turnrouter"):
        result = await router.handle(AgentTurn("p1", "t1", "my card number is 4111"))
    assert result == DestinationResult("answer", "conversation answer")
    assert "4111" not in caplog.text
    assert "ValueError" in caplog.text
