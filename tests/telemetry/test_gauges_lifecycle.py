"""Participant and in-flight gauges stay right through interrupts, departures and stop()."""

from __future__ import annotations

import anyio
import pytest

from turnrouter import AgentRouter, AgentTurn, TurnInterrupted
from turnrouter.testing import OutputRecorder, ScriptedAgent, ScriptedDecisions

from .conftest import Rig

pytestmark = pytest.mark.anyio


async def test_gauges_follow_interrupts_supersession_departure_and_stop() -> None:
    """In-flight counts running turns only; active participants drop on departure and stop."""
    rig = Rig()
    agent = ScriptedAgent("conversation")
    agent.answer_gate = anyio.Event()
    router = AgentRouter({"conversation": agent}, ScriptedDecisions("conversation"),
                         output=OutputRecorder(), telemetry=rig.telemetry)
    outcomes: list[object] = []

    async def turn(pid: str, tid: str) -> None:
        try:
            outcomes.append(await router.handle(AgentTurn(pid, tid, "hello")))
        except TurnInterrupted as exc:
            outcomes.append(exc)

    def gauge(name: str) -> float | None:
        return rig.value(name)

    async with anyio.create_task_group() as tg:
        for pid in ("a", "b", "c"):
            tg.start_soon(turn, pid, f"{pid}1")
        with anyio.fail_after(5):
            while agent.count("answer") < 3:
                await anyio.lowlevel.checkpoint()
        assert gauge("turnrouter_turns_in_flight") == 3
        assert gauge("turnrouter_active_participants") == 3
        await router.interrupt("a")
        assert gauge("turnrouter_turns_in_flight") == 2
        tg.start_soon(turn, "b", "b2")  # supersedes b1, then waits on the gate itself
        with anyio.fail_after(5):
            while agent.count("answer") < 4:
                await anyio.lowlevel.checkpoint()
        assert gauge("turnrouter_turns_in_flight") == 2
        await router.participant_left("c")
        assert gauge("turnrouter_active_participants") == 2
        assert gauge("turnrouter_turns_in_flight") == 1
        await router.stop()
    assert gauge("turnrouter_turns_in_flight") == 0
    assert gauge("turnrouter_active_participants") == 0
    assert rig.value("turnrouter_interruptions_total") == 4
    assert sum(isinstance(o, TurnInterrupted) for o in outcomes) == 4
    rig.close()
