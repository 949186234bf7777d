"""AgentRouter lifecycle: ordering, interruption, departure and shutdown, with cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import anyio
import pytest

from turnrouter import Admission, AgentTurn, DestinationResult, LifecycleError, TurnInterrupted
from turnrouter.testing import (
    ManualClock,
    ScriptedAgent,
    ScriptedDecisions,
    ScriptedDepartingAgent,
)

from .kit import Harness

pytestmark = pytest.mark.anyio


def gated(name: str, **kwargs: object) -> ScriptedAgent:
    agent = ScriptedAgent(name, **kwargs)  # type: ignore[arg-type]
    agent.answer_gate = anyio.Event()
    return agent


# ---------------------------------------------------------------- ordering


async def test_new_turn_cancels_and_drains_the_running_one_first() -> None:
    """A participant's new turn interrupts its running turn and waits until it drained."""
    h = Harness(gated("weather"), decisions=ScriptedDecisions("weather"))
    agent = h["weather"]
    first, second = h.turn("one"), h.turn("two")
    async with anyio.create_task_group() as tg:
        tg.start_soon(h.capture, first)
        await agent.answer_entered.wait()
        agent.answer_gate = None  # the second turn answers at once
        await h.capture(second)
    assert isinstance(h.outcomes["t1"], TurnInterrupted)
    assert isinstance(h.outcomes["t1"], asyncio.CancelledError)
    assert h.outcomes["t2"] == DestinationResult("answer", "weather answer")
    assert agent.cancelled == ["answer"]
    # The first answer was drained before the second admission began.
    assert agent.methods() == ["admit", "answer", "admit", "answer"]
    assert [e.user for e in h.router.history_of("p1")] == ["two"]


async def test_queued_turns_run_in_arrival_order() -> None:
    """Turns waiting for a participant run one at a time in arrival order."""
    h = Harness(ScriptedAgent("weather"), decisions=ScriptedDecisions("weather"))
    agent = h["weather"]
    agent.admit_gate = anyio.Event()
    turns = [h.turn(str(i)) for i in range(3)]
    async with anyio.create_task_group() as tg:
        tg.start_soon(h.capture, turns[0])
        await agent.admit_entered.wait()
        agent.admit_gate = None
        tg.start_soon(h.capture, turns[1])
        tg.start_soon(h.capture, turns[2])
    # Turn 0 was superseded by 1; 1 was still queued when 2 arrived, so both run, in order.
    assert isinstance(h.outcomes["t1"], TurnInterrupted)
    answered = [c.query for c in agent.calls if c.method == "answer"]
    assert answered == ["1", "2"]
    assert [e.user for e in h.router.history_of("p1")] == ["1", "2"]


async def test_participants_run_concurrently_and_independently() -> None:
    """A blocked participant neither delays nor affects another participant."""
    h = Harness(gated("weather"), decisions=ScriptedDecisions("weather"))
    agent = h["weather"]
    async with anyio.create_task_group() as tg:
        tg.start_soon(h.capture, h.turn("slow", "a"))
        await agent.answer_entered.wait()
        gate = agent.answer_gate
        agent.answer_gate = None
        result = await h.say("fast", "b")
        assert result.text == "weather answer"
        assert "t1" not in h.outcomes  # a is still answering
        assert gate is not None
        gate.set()
    assert h.outcomes["t1"] == DestinationResult("answer", "weather answer")


# ---------------------------------------------------------------- interrupt


async def test_interrupt_during_admission_keeps_history_and_focus() -> None:
    """Interrupting during admit() cancels the turn; history and focus are kept."""
    h = Harness(ScriptedAgent("booking", results="focus"), decisions=ScriptedDecisions("booking"))
    agent = h["booking"]
    await h.say("book")
    agent.admit_gate = anyio.Event()
    agent.admit_entered = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(h.capture, h.turn("for two"))
        await agent.admit_entered.wait()
        await h.router.interrupt("p1")
        assert "t2" in h.outcomes  # interrupt() returned after the turn drained
    assert isinstance(h.outcomes["t2"], TurnInterrupted)
    assert agent.cancelled == ["admit"]
    assert h.router.focus_of("p1") == "booking"
    assert [e.user for e in h.router.history_of("p1")] == ["book"]
    assert h.observer.outcome("t2") == "interrupted"
    assert h.output.texts == []


async def test_interrupt_before_started_suppresses_control_output() -> None:
    """An answer interrupted before started() gets no failure message."""
    h = Harness(gated("weather", call_started=False), decisions=ScriptedDecisions("weather"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(h.capture, h.turn())
        await h["weather"].answer_entered.wait()
        await h.router.interrupt("p1")
    assert isinstance(h.outcomes["t1"], TurnInterrupted)
    assert h.output.texts == []
    assert h.router.history_of("p1") == ()


async def test_interrupt_after_started_cancels_the_answer() -> None:
    """An answer interrupted after started() is cancelled and drained; no exchange kept."""
    h = Harness(gated("weather"), decisions=ScriptedDecisions("weather"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(h.capture, h.turn())
        await h["weather"].started_called.wait()
        await h.router.interrupt("p1")
    assert h["weather"].cancelled == ["answer"]
    assert isinstance(h.outcomes["t1"], TurnInterrupted)
    assert h.router.history_of("p1") == ()
    assert "first_response" in h.observer.kinds("t1")


class Swallowing(ScriptedAgent):
    """A destination whose answer() catches its cancellation and answers anyway."""

    async def answer(self, turn: AgentTurn, *, started: Any) -> DestinationResult:
        await started()
        with contextlib.suppress(asyncio.CancelledError):  # (the misbehaviour under test)
            await anyio.sleep_forever()
        return DestinationResult("focus", "swallowed")


async def test_an_interrupt_a_destination_swallows_still_interrupts_the_turn() -> None:
    """interrupt() ends the turn as interrupted even when answer() swallowed the
    cancellation and returned: no exchange recorded, no focus taken."""
    h = Harness(Swallowing("weather"), decisions=ScriptedDecisions("weather"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(h.capture, h.turn())
        with anyio.fail_after(5):
            while not h["weather"].count("admit"):
                await anyio.lowlevel.checkpoint()
            for _ in range(5):  # into answer()'s wait (bounded)
                await anyio.lowlevel.checkpoint()
        await h.router.interrupt("p1")
    assert isinstance(h.outcomes["t1"], TurnInterrupted)
    assert h.router.history_of("p1") == ()
    assert h.router.focus_of("p1") is None
    assert h.observer.outcome("t1") == "interrupted"


class SlowToEnd(ScriptedAgent):
    """A destination whose answer(), cancelled, cleans up until `cleaned` is set."""

    cleaned: anyio.Event
    entered: anyio.Event

    async def answer(self, turn: AgentTurn, *, started: Any) -> DestinationResult:
        await started()
        self.entered.set()
        try:
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                await self.cleaned.wait()
        return DestinationResult("answer", "never")


@pytest.mark.parametrize("how", ["interrupt", "leave", "stop"])
async def test_a_turn_slow_to_end_on_cancellation_is_named_in_a_warning(
        how: str, caplog: pytest.LogCaptureFixture) -> None:
    """voice22 F1: interrupt(), a departure and stop() wait for the cancelled turn to
    end, and a destination that swallowed the cancel or cleaned up for long held them
    (and a voice front end's barge-in) with nothing logged. Now one warning names the
    destination once the turn still runs 1 s (the router's clock) after the cancel;
    nothing is said of a turn that ends before."""
    clock = ManualClock()
    agent = SlowToEnd("weather")
    agent.cleaned, agent.entered = anyio.Event(), anyio.Event()
    h = Harness(agent, decisions=ScriptedDecisions("weather"), clock=clock)
    caplog.set_level(logging.WARNING, logger="turnrouter")
    ended = anyio.Event()

    async def cancel() -> None:
        with contextlib.suppress(Exception):
            if how == "interrupt":
                await h.router.interrupt("p1")
            elif how == "leave":
                await h.router.participant_left("p1")
            else:
                await h.router.stop()
        ended.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(h.capture, h.turn())
        with anyio.fail_after(10):
            await agent.entered.wait()
            sleepers = clock.sleepers
            tg.start_soon(cancel)
            await clock.wait_for_sleepers(sleepers + 1)  # the warning's timer
            clock.advance(0.999)
            await anyio.lowlevel.checkpoint()
            assert not [r for r in caplog.records if "still runs" in r.getMessage()]
            clock.advance(0.001)
            while not [r for r in caplog.records if "still runs" in r.getMessage()]:
                await anyio.lowlevel.checkpoint()
            assert not ended.is_set()
            agent.cleaned.set()
            await ended.wait()
    (warning,) = [r for r in caplog.records if "still runs" in r.getMessage()]
    assert warning.levelname == "WARNING"
    assert "destination 'weather'" in warning.getMessage()
    assert isinstance(h.outcomes["t1"], TurnInterrupted)
    assert clock.sleepers == 0


async def test_a_turn_that_ends_on_cancellation_is_not_warned_of(
        caplog: pytest.LogCaptureFixture) -> None:
    """The warning's timer goes with the wait: a prompt turn leaves no sleeper and no
    warning, however far the clock moves afterwards."""
    clock = ManualClock()
    h = Harness(gated("weather"), decisions=ScriptedDecisions("weather"), clock=clock)
    caplog.set_level(logging.WARNING, logger="turnrouter")
    async with anyio.create_task_group() as tg:
        tg.start_soon(h.capture, h.turn())
        with anyio.fail_after(10):
            await h["weather"].answer_entered.wait()
        await h.router.interrupt("p1")
    clock.advance(60)
    assert clock.sleepers == 0
    assert not [r for r in caplog.records if "still runs" in r.getMessage()]
    assert isinstance(h.outcomes["t1"], TurnInterrupted)


async def test_a_cancelled_caller_waits_for_the_previous_owners_release() -> None:
    """A caller cancelled (task.cancel()) while the previous focus owner's release()
    runs: the release finishes (it is not torn half-way), then the cancellation
    propagates, as for interrupt()."""
    h = Harness(ScriptedAgent("booking", results="focus", admissions=["accept", "decline"]),
                ScriptedAgent("weather", results="focus"),
                decisions=ScriptedDecisions("booking", "weather"))
    booking = h["booking"]
    await h.say("book")
    gate = booking.release_gate = anyio.Event()
    task = asyncio.get_running_loop().create_task(h.router.handle(h.turn("weather?")))
    with anyio.fail_after(5):
        await booking.release_entered.wait()
    task.cancel()
    await anyio.lowlevel.checkpoint()
    assert not task.done()  # waits for the release
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert booking.cancelled == []
    assert ("release", "booking", "focus_taken", None) in h.observer.turns["t2"]


async def test_interrupt_during_a_release_ends_the_turn_once_released() -> None:
    """An interrupt while a released owner's release() runs lets it finish, then ends the
    turn: the query is not rerouted and nothing more is said."""
    h = Harness(ScriptedAgent("booking", results="focus",
                              admissions=["accept", Admission("release", text="Done here.")]),
                ScriptedAgent("weather"), decisions=ScriptedDecisions("booking", "weather"))
    booking = h["booking"]
    await h.say("book")
    gate = booking.release_gate = anyio.Event()

    async def open_gate() -> None:
        gate.set()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(h.capture, h.turn("what's the weather"))
            await booking.release_entered.wait()
            tg.start_soon(open_gate)  # runs once interrupt() has asked for the cancel
            await h.router.interrupt("p1")
    assert isinstance(h.outcomes["t2"], TurnInterrupted)
    assert booking.methods() == ["admit", "answer", "admit", "release"]
    assert ("release", "booking", "reroute", None) in h.observer.turns["t2"]  # not torn
    assert h["weather"].calls == [] and len(h.decisions.requests) == 1
    assert h.output.texts == ["Done here."]
    assert h.router.focus_of("p1") is None
    assert h.observer.outcome("t2") == "interrupted"


async def test_interrupt_one_participant_leaves_others_running() -> None:
    """interrupt(pid) cancels only that participant's turn."""
    h = Harness(gated("weather"), decisions=ScriptedDecisions("weather"))
    agent = h["weather"]
    async with anyio.create_task_group() as tg:
        tg.start_soon(h.capture, h.turn("x", "a"))
        tg.start_soon(h.capture, h.turn("y", "b"))
        with anyio.fail_after(5):
            while agent.count("answer") < 2:
                await anyio.lowlevel.checkpoint()
        await h.router.interrupt("a")
        assert isinstance(h.outcomes["t1"], TurnInterrupted)
        assert "t2" not in h.outcomes
        assert agent.answer_gate is not None
        agent.answer_gate.set()
    assert h.outcomes["t2"] == DestinationResult("answer", "weather answer")


async def test_interrupt_all_cancels_every_participant() -> None:
    """interrupt() with no participant cancels every running turn."""
    h = Harness(gated("weather"), decisions=ScriptedDecisions("weather"))
    agent = h["weather"]
    async with anyio.create_task_group() as tg:
        for pid in ("a", "b", "c"):
            tg.start_soon(h.capture, h.turn("x", pid))
        with anyio.fail_after(5):
            while agent.count("answer") < 3:
                await anyio.lowlevel.checkpoint()
        await h.router.interrupt()
    assert all(isinstance(v, TurnInterrupted) for v in h.outcomes.values())
    assert len(h.outcomes) == 3


async def test_interrupt_without_turns_is_a_no_op() -> None:
    """Interrupting an idle or unknown participant returns at once."""
    h = Harness(ScriptedAgent("weather"), decisions=ScriptedDecisions("weather"))
    await h.router.interrupt("nobody")
    await h.router.interrupt()
    assert (await h.say()).text == "weather answer"


async def test_caller_cancellation_propagates_as_plain_cancellation() -> None:
    """Cancelling the caller of handle() cancels the turn and propagates unchanged."""
    h = Harness(gated("weather"), decisions=ScriptedDecisions("weather"))
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            async def cancel_when_answering() -> None:
                await h["weather"].answer_entered.wait()
                scope.cancel()
            tg.start_soon(cancel_when_answering)
            await h.router.handle(h.turn())
    assert scope.cancelled_caught
    assert h.observer.outcome("t1") == "interrupted"
    h["weather"].answer_gate = None
    assert (await h.say()).text == "weather answer"  # the participant is still usable


# ---------------------------------------------------------------- departure


async def test_departure_prefers_the_hook_and_releases_every_used_destination() -> None:
    """participant_left() calls each used destination's hook, else release()."""
    h = Harness(ScriptedDepartingAgent("booking", admissions="decline"),
                ScriptedAgent("weather"),
                ScriptedAgent("music"),
                decisions=ScriptedDecisions("booking", "weather"))
    await h.say()
    await h.router.participant_left("p1")
    assert h["booking"].methods() == ["admit", "participant_left"]
    assert h["weather"].methods() == ["admit", "answer", "release"]
    assert h["music"].calls == []
    assert h.router.history_of("p1") == ()
    assert "p1" not in h.router.participants


async def test_departure_failures_are_grouped_retried_and_block_turns() -> None:
    """Failed releases raise an ExceptionGroup, block handle(), and are retried alone."""
    h = Harness(ScriptedAgent("weather", release_error=RuntimeError("w")),
                ScriptedAgent("music"), decisions=ScriptedDecisions("weather"))
    await h.say()
    h["music"].eligible = True
    with pytest.raises(ExceptionGroup) as info:
        await h.router.participant_left("p1")
    assert [type(e) for e in info.value.exceptions] == [RuntimeError]
    with pytest.raises(LifecycleError) as blocked:
        await h.say()
    assert isinstance(blocked.value, RuntimeError)
    h["weather"].release_error = None
    await h.router.participant_left("p1")
    assert h["weather"].count("release") == 2
    assert (await h.say()).text == "weather answer"


async def test_departure_attempts_every_used_destination_despite_failures() -> None:
    """A failing release does not end the departure: every used destination is attempted
    and the failures are raised together."""
    h = Harness(ScriptedAgent("booking", admissions="decline", release_error=RuntimeError("b")),
                ScriptedAgent("weather", release_error=ValueError("w")),
                ScriptedAgent("music"), decisions=ScriptedDecisions("booking", "weather"))
    await h.say()
    with pytest.raises(ExceptionGroup) as info:
        await h.router.participant_left("p1")
    assert sorted(type(e).__name__ for e in info.value.exceptions) == ["RuntimeError",
                                                                        "ValueError"]
    assert h["booking"].methods() == ["admit", "release"]
    assert h["weather"].methods() == ["admit", "answer", "release"]
    assert h["music"].calls == []


async def test_concurrent_departures_join_one_operation() -> None:
    """Concurrent participant_left() callers share one departure."""
    h = Harness(ScriptedDepartingAgent("weather"), decisions=ScriptedDecisions("weather"))
    await h.say()
    h["weather"].release_gate = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(h.router.participant_left, "p1")
        tg.start_soon(h.router.participant_left, "p1")
        await h["weather"].release_entered.wait()
        with pytest.raises(LifecycleError):
            await h.say()
        h["weather"].release_gate.set()
    assert h["weather"].count("participant_left") == 1


async def test_cancelled_departure_waiter_does_not_abandon_the_departure() -> None:
    """Cancelling a departure waiter lets the departure finish before cancelling."""
    h = Harness(ScriptedAgent("weather"), ScriptedAgent("music"),
                decisions=ScriptedDecisions("weather"))
    await h.say()
    agent = h["weather"]
    agent.release_gate = anyio.Event()
    finished_while_waiting: list[bool] = []
    async with anyio.create_task_group() as tg:
        async def leave() -> None:
            with anyio.CancelScope() as scope:
                waiter_scope.append(scope)
                await h.router.participant_left("p1")
            finished_while_waiting.append(scope.cancelled_caught)
        waiter_scope: list[anyio.CancelScope] = []
        tg.start_soon(leave)
        await agent.release_entered.wait()
        waiter_scope[0].cancel()
        await anyio.lowlevel.checkpoint()
        assert finished_while_waiting == []  # still waiting for the release
        assert agent.release_gate is not None
        agent.release_gate.set()
    assert finished_while_waiting == [True]
    assert "p1" not in h.router.participants
    assert agent.cancelled == []


async def test_natively_cancelled_departure_waiter_still_completes_departure() -> None:
    """asyncio task.cancel() on a waiter neither aborts the release nor returns early."""
    h = Harness(ScriptedAgent("weather"), decisions=ScriptedDecisions("weather"))
    await h.say()
    agent = h["weather"]
    agent.release_gate = anyio.Event()
    task = asyncio.get_running_loop().create_task(h.router.participant_left("p1"))
    await agent.release_entered.wait()
    task.cancel()
    await anyio.lowlevel.checkpoint()
    assert not task.done()
    agent.release_gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "p1" not in h.router.participants


@pytest.mark.parametrize("operation", ["participant_left", "stop"])
async def test_a_cancelled_waiter_of_a_failing_operation_gets_its_cancellation(
        operation: str) -> None:
    """A waiter cancelled while a release runs that then fails ends cancelled (the
    contract: cancellation propagates once the operation completed), not with the
    operation's ExceptionGroup; the failure stays tracked, and a retry completes it."""
    h = Harness(ScriptedAgent("weather"), decisions=ScriptedDecisions("weather"))
    await h.say()
    agent = h["weather"]
    agent.release_gate, agent.release_error = anyio.Event(), OSError("release failed")
    call = (h.router.stop() if operation == "stop"
            else h.router.participant_left("p1"))
    task = asyncio.get_running_loop().create_task(call)
    await agent.release_entered.wait()
    task.cancel()
    await anyio.lowlevel.checkpoint()
    assert not task.done()  # it waits for the release
    agent.release_gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
    with pytest.raises(LifecycleError):  # the failed operation still holds admission
        await h.say()
    agent.release_error = None
    await (h.router.stop() if operation == "stop" else h.router.participant_left("p1"))
    assert "p1" not in h.router.participants


async def test_departure_interrupts_and_drains_the_running_turn_first() -> None:
    """A departure cancels the participant's running turn before releasing."""
    h = Harness(gated("weather"), decisions=ScriptedDecisions("weather"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(h.capture, h.turn())
        await h["weather"].answer_entered.wait()
        await h.router.participant_left("p1")
    assert isinstance(h.outcomes["t1"], TurnInterrupted)
    assert h["weather"].methods() == ["admit", "answer", "release"]


async def test_departure_of_unknown_participant_is_a_no_op() -> None:
    """participant_left() for a participant without state does nothing."""
    h = Harness(ScriptedAgent("weather"), decisions=ScriptedDecisions("weather"))
    await h.router.participant_left("ghost")
    assert h["weather"].calls == []


async def test_cleanup_runs_after_releases_even_without_a_route() -> None:
    """cleanup_participant runs after releases, also for a participant that never routed."""
    log: list[str] = []

    async def cleanup(pid: str) -> None:
        log.append(f"cleanup {pid}")

    h = Harness(ScriptedAgent("weather"), decisions=ScriptedDecisions("clarify"),
                cleanup_participant=cleanup)
    await h.say()
    await h.router.participant_left("p1")
    assert log == ["cleanup p1"]


async def test_failed_cleanup_is_retried_and_blocks_turns() -> None:
    """A failing cleanup fails the departure; a retry cleans up and reopens turns."""
    failures = [RuntimeError("once")]

    async def cleanup(pid: str) -> None:
        if failures:
            raise failures.pop()

    h = Harness(ScriptedAgent("weather"), decisions=ScriptedDecisions("weather"),
                cleanup_participant=cleanup)
    await h.say()
    with pytest.raises(ExceptionGroup):
        await h.router.participant_left("p1")
    with pytest.raises(LifecycleError):
        await h.say()
    await h.router.participant_left("p1")
    assert h["weather"].count("release") == 1  # the release is not repeated
    assert ("failure", None, "cleanup", "RuntimeError") in h.observer.events


# ---------------------------------------------------------------- stop


async def test_stop_drains_releases_and_allows_a_fresh_lifecycle() -> None:
    """stop() interrupts turns, releases every participant, then permits new turns."""
    h = Harness(gated("weather"), ScriptedAgent("music"), decisions=ScriptedDecisions("weather"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(h.capture, h.turn("x", "a"))
        await h["weather"].answer_entered.wait()
        await h.router.stop()
    assert isinstance(h.outcomes["t1"], TurnInterrupted)
    assert h["weather"].methods() == ["admit", "answer", "release"]
    assert h.router.participants == frozenset()
    assert h.observer.active_participants == 0
    assert h.observer.in_flight == 0
    h["weather"].answer_gate = None
    assert (await h.say("again", "a")).text == "weather answer"


async def test_stop_clears_history_only_participants() -> None:
    """Participants with only history (no used route) are cleared by stop()."""
    h = Harness(ScriptedAgent("weather"), decisions=ScriptedDecisions("clarify"))
    from turnrouter import AgentExchange
    await h.say(history=(AgentExchange("a", "b"),))
    assert h.router.history_of("p1")
    await h.router.stop()
    assert h.router.history_of("p1") == ()


async def test_stop_failures_are_grouped_and_keep_admission_closed() -> None:
    """Release failures during stop() raise together; handle() stays closed until retry."""
    h = Harness(ScriptedAgent("weather", release_error=RuntimeError("a")),
                ScriptedAgent("music", release_error=RuntimeError("b")),
                decisions=ScriptedDecisions("weather", "music"))
    await h.say(participant="x")
    await h.say(participant="y")
    with pytest.raises(ExceptionGroup) as info:
        await h.router.stop()
    assert len(info.value.exceptions) == 2
    with pytest.raises(LifecycleError):
        await h.say(participant="z")
    h["weather"].release_error = None
    h["music"].release_error = None
    await h.router.stop()
    assert (await h.say(participant="z")).disposition == "answer"


async def test_concurrent_stops_join_and_turns_are_refused_meanwhile() -> None:
    """Concurrent stop() callers join one shutdown; handle() raises while it runs."""
    h = Harness(ScriptedAgent("weather"), decisions=ScriptedDecisions("weather"))
    await h.say()
    h["weather"].release_gate = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(h.router.stop)
        tg.start_soon(h.router.stop)
        await h["weather"].release_entered.wait()
        with pytest.raises(LifecycleError, match="shutting down"):
            await h.say(participant="new")
        h["weather"].release_gate.set()
    assert h["weather"].count("release") == 1


async def test_cancelled_stop_waiter_waits_for_shutdown() -> None:
    """Cancelling a stop() waiter does not cancel shutdown; it propagates afterwards."""
    h = Harness(ScriptedAgent("weather"), decisions=ScriptedDecisions("weather"))
    await h.say()
    agent = h["weather"]
    agent.release_gate = anyio.Event()
    scopes: list[anyio.CancelScope] = []
    caught: list[bool] = []

    async def stopper() -> None:
        with anyio.CancelScope() as scope:
            scopes.append(scope)
            await h.router.stop()
        caught.append(scope.cancelled_caught)

    async with anyio.create_task_group() as tg:
        tg.start_soon(stopper)
        await agent.release_entered.wait()
        scopes[0].cancel()
        await anyio.lowlevel.checkpoint()
        assert caught == []  # the waiter still waits for the shutdown
        agent.release_gate.set()
    assert caught == [True]
    assert h.router.participants == frozenset()
    assert agent.cancelled == []


async def test_turn_waiting_in_queue_is_interrupted_by_stop() -> None:
    """Queued turns are cancelled by stop() too, never left waiting."""
    h = Harness(gated("weather"), decisions=ScriptedDecisions("weather"))
    second = h.turn("b")
    async with anyio.create_task_group() as tg:
        tg.start_soon(h.capture, h.turn("a"))
        await h["weather"].answer_entered.wait()
        tg.start_soon(h.capture, second)
        await anyio.lowlevel.checkpoint()
        await h.router.stop()
    assert all(isinstance(v, TurnInterrupted) for v in h.outcomes.values())
    assert h.observer.in_flight == 0


def _unused(turn: AgentTurn) -> None:  # keeps the import used for typing clarity
    del turn


async def test_handle_is_refused_as_soon_as_departure_is_requested() -> None:
    """A turn issued right after participant_left() was called is refused."""
    h = Harness(ScriptedAgent("weather"), decisions=ScriptedDecisions("weather"))
    await h.say()
    task = asyncio.get_running_loop().create_task(h.router.participant_left("p1"))
    await anyio.lowlevel.checkpoint()  # participant_left has started, not finished
    with pytest.raises(LifecycleError):
        await h.say()
    await task
    assert (await h.say()).text == "weather answer"  # a fresh lifecycle afterwards


async def test_cleanup_runs_even_when_a_release_fails() -> None:
    """cleanup_participant runs once turns drained, even if a release failed; the retry
    repeats only the failed release."""
    cleaned: list[str] = []

    async def cleanup(pid: str) -> None:
        cleaned.append(pid)

    h = Harness(ScriptedAgent("weather", release_error=RuntimeError("w")),
                decisions=ScriptedDecisions("weather"), cleanup_participant=cleanup)
    await h.say()
    with pytest.raises(ExceptionGroup):
        await h.router.participant_left("p1")
    assert cleaned == ["p1"]
    h["weather"].release_error = None
    await h.router.participant_left("p1")
    assert cleaned == ["p1"]
    assert h["weather"].count("release") == 2
