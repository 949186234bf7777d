"""Admission control: a saturated router refuses new work visibly and keeps answering.

Saturation is driven by a `ManualClock`: the lag sampler sleeps on the router's clock,
so advancing the clock past a sample's deadline by `x` is an event-loop lag of `x`,
with no real waiting and no timing assertion.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from turnrouter import (
    Admission,
    AgentRouter,
    AgentTurn,
    ConfigurationError,
    ContractTypeError,
    DestinationResult,
    LifecycleError,
    OverloadPolicy,
    RouterBusyError,
    RoutingAid,
    SystemClock,
    TurnInterrupted,
)
from turnrouter.runtime import ResponseOutput, Topic, UserQuery
from turnrouter.telemetry import Telemetry, serve_metrics
from turnrouter.testing import (
    ManualClock,
    OutputRecorder,
    RecordingObserver,
    ScriptedAgent,
    ScriptedDecisions,
)

from .kit import Harness, publish_and_drain

pytestmark = pytest.mark.anyio

POLICY = OverloadPolicy(busy_lag_secs=0.1, shed_lag_secs=0.5, sample_secs=0.01,
                        busy_text="Busy, call back soon.")


def harness(clock: ManualClock, **kwargs: Any) -> Harness:
    kwargs.setdefault("overload", POLICY)
    return Harness(ScriptedAgent("weather"), decisions=ScriptedDecisions("weather"),
                   clock=clock, **kwargs)


def status(h: Harness) -> str:
    return h.router.load.status


async def lag(clock: ManualClock, seconds: float, samples: int = 2) -> None:
    """`samples` lag samples of `seconds` each: the sampler's deadline passed by that."""
    for _ in range(samples):
        with anyio.fail_after(5):
            await clock.wait_for_sleepers(1)
        clock.advance(POLICY.sample_secs + seconds)
        await clock.settle()


async def hold_turn(h: Harness, tg: Any, participant: str = "p1") -> anyio.Event:
    """Start a turn whose answer waits on a gate (the router has work in flight)."""
    agent = h["weather"]
    gate = agent.answer_gate = anyio.Event()
    tg.start_soon(h.capture, h.turn("hold", participant))
    with anyio.fail_after(5):
        await agent.answer_entered.wait()
    agent.answer_gate = None
    return gate

async def cancel_while_told_busy(h: Harness, newcomer: AgentTurn) -> None:
    """Route `newcomer` with an output that never returns, and cancel it while it is
    told busy: the refusal is not counted (no turn, no shed event)."""
    telling = anyio.Event()

    async def slow_output(turn: AgentTurn, route: str, text: str) -> None:
        telling.set()
        await anyio.sleep_forever()

    async with anyio.create_task_group() as inner:
        inner.start_soon(partial(h.router.route_turn, newcomer, output=slow_output))
        with anyio.fail_after(5):
            await telling.wait()
        inner.cancel_scope.cancel()
    assert newcomer.turn_id not in h.observer.turns
    assert not [e for e in h.observer.events if e[0] == "shed"]



async def test_busy_refuses_new_participants_and_keeps_admitted_ones() -> None:
    """Past busy_lag_secs a new participant's turn is shed: counted (outcome busy,
    reason new_participant), told busy_text, RouterBusyError; an admitted one goes on."""
    clock = ManualClock()
    h = harness(clock)
    async with anyio.create_task_group() as tg:
        gate = await hold_turn(h, tg)
        assert h.router.load.status == "ready" and not h.router.busy
        await lag(clock, 0.2, samples=1)
        assert not h.router.busy  # one sample is a pause, not saturation
        await lag(clock, 0.2)
        assert h.router.busy and h.router.load.status == "busy"
        assert h.router.load.turns_in_flight == 1
        assert h.router.sheds("p2") and not h.router.sheds("p1")
        newcomer = h.turn("hi", "p2")
        with pytest.raises(RouterBusyError, match="busy") as refused:
            await h.router.handle(newcomer)
        assert isinstance(refused.value, LifecycleError)
        assert h.observer.outcome(newcomer.turn_id) == "busy"
        assert ("shed", "p2", "new_participant") in h.observer.events
        # On route "none", as its metrics label it: not a clarification question.
        assert [(s.turn_id, s.route, s.text) for s in h.output.spoken] == [
            (newcomer.turn_id, "none", "Busy, call back soon.")]
        assert h.router.busy_text == "Busy, call back soon."  # what front ends say too
        assert "p2" not in h.router.participants
        # The admitted participant's next turn is still served.
        assert (await h.say("again", "p1")).text == "weather answer"
        gate.set()
    await h.router.stop()


async def test_a_crowd_arriving_at_once_is_admitted_a_budget_at_a_time() -> None:
    """Between two samples the router cannot see what its admissions cost: of 100 new
    participants arriving in one instant, `new_per_sample` are admitted and the rest
    refused as when busy (told busy_text, counted new_participant); an admitted one's
    next turn goes on. A calm sample that used the whole budget doubles it; turning
    busy halves it (spike12 D1: all of 1,000 were admitted and the loop stalled 4 s)."""
    clock = ManualClock()
    policy = OverloadPolicy(busy_lag_secs=0.1, shed_lag_secs=0.5, sample_secs=0.01,
                            new_per_sample=16)
    h = harness(clock, overload=policy)
    agent = h["weather"]
    agent.answer_gate = gate = anyio.Event()
    ended = {"count": 0, "until": 100 - 16}
    enough = anyio.Event()

    async def capture(turn: AgentTurn) -> None:  # (the refused ones end at once)
        await h.capture(turn)
        ended["count"] += 1
        if ended["count"] == ended["until"]:
            enough.set()

    async with anyio.create_task_group() as tg:
        for i in range(100):
            tg.start_soon(capture, h.turn("hi", f"c{i}"))
        with anyio.fail_after(5):
            await enough.wait()
        refused = [t for t, o in h.outcomes.items() if isinstance(o, RouterBusyError)]
        assert len(refused) == 100 - 16
        assert h.observer.events.count(("shed", "c99", "new_participant")) == 1
        assert len(h.router.participants) == 16 and not h.router.busy
        assert h.router.refusing  # (the budget holds newcomers back, the lag still low)
        await lag(clock, 0.0, samples=1)  # calm, and the budget was used up: doubled
        late = [h.turn("hi", f"d{i}") for i in range(40)]
        ended["count"], ended["until"], enough = 0, 40 - 32, anyio.Event()
        for turn in late:
            tg.start_soon(capture, turn)
        with anyio.fail_after(5):
            await enough.wait()
        assert sum(isinstance(h.outcomes.get(t.turn_id), RouterBusyError)
                   for t in late) == 40 - 32
        await lag(clock, 0.2)  # busy: halved, and refusing anyway
        assert h.router.busy
        gate.set()
    await h.router.stop()


async def test_shedding_refuses_admitted_participants_then_recovers() -> None:
    """Past shed_lag_secs turns of admitted participants are shed too; below half the
    thresholds the router is ready again and admits everyone."""
    clock = ManualClock()
    h = harness(clock)
    async with anyio.create_task_group() as tg:
        gate = await hold_turn(h, tg, "p0")
        await h.say("hello", "p1")
        await lag(clock, 0.6)
        assert status(h) == "shedding"
        assert h.router.sheds("p1")
        turn = h.turn("more", "p1")
        with pytest.raises(RouterBusyError, match="shedding"):
            await h.router.handle(turn)
        assert ("shed", "p1", "shedding") in h.observer.events
        await lag(clock, 0.2, samples=1)  # above half the busy threshold: still busy
        assert status(h) == "busy"
        await lag(clock, 0.0, samples=POLICY.calm_samples - 1)
        assert status(h) == "busy"  # calm must hold before admissions resume
        await lag(clock, 0.0, samples=1)
        assert status(h) == "ready"
        assert (await h.say("hi", "p2")).text == "weather answer"
        gate.set()
    await h.router.stop()


async def test_samples_report_lag_turns_in_flight_and_wait() -> None:
    """Each sample reports the lag, the turns in flight and the state to the observer."""
    clock = ManualClock()
    h = harness(clock)
    async with anyio.create_task_group() as tg:
        gate = await hold_turn(h, tg)
        await lag(clock, 0.2)
        gate.set()
    samples = h.observer.load_samples
    assert [(round(s.lag_secs, 6), s.turns_in_flight, s.state) for s in samples[-2:]] == [
        (0.2, 1, 0), (0.2, 1, 1)]
    await h.router.stop()
    assert h.observer.load_samples[-1].state == 0


async def test_the_sampler_belongs_to_the_router() -> None:
    """The sampler starts with the first turn, ends with stop() (cancelled, awaited) and
    ends on its own once idle; the next turn starts it again."""
    clock = ManualClock()
    h = harness(clock)

    def samplers() -> int:
        return sum(1 for task in asyncio.all_tasks()
                   if task.get_name() == "turnrouter load sampler" and not task.done())

    assert samplers() == 0
    await h.say()
    assert samplers() == 1
    # Idle: no turn in flight, not busy. It ends by itself after a bounded count.
    for _ in range(200):
        if not samplers():
            break
        await lag(clock, 0.0, samples=1)
    assert samplers() == 0
    await h.say()
    assert samplers() == 1
    await h.router.stop()
    assert samplers() == 0


async def test_cancelling_a_turn_while_busy_leaks_nothing() -> None:
    """A caller cancelled while its turn is counted in flight leaves the count right."""
    clock = ManualClock()
    h = harness(clock)
    async with anyio.create_task_group() as tg:
        await hold_turn(h, tg)
        assert h.router.load.turns_in_flight == 1
        tg.cancel_scope.cancel()
    assert h.router.load.turns_in_flight == 0
    await h.router.stop()


class _Draining:
    """Answers at once, except turn `t1`, which (once entered) drains only when `gate`
    is set, whatever cancels it: its participant's next turns wait in line meanwhile."""

    def __init__(self) -> None:
        self.entered, self.gate = anyio.Event(), anyio.Event()

    def routing_aid(self, participant_id: str) -> RoutingAid:
        return RoutingAid("weather", "weather reports")

    async def admit(self, turn: AgentTurn, *, focused: bool) -> Admission:
        return Admission("accept")

    async def answer(self, turn: AgentTurn, *,
                     started: Callable[[], Awaitable[None]]) -> DestinationResult:
        if turn.turn_id == "t1":
            self.entered.set()
            cancelled = False
            while not self.gate.is_set():  # drains before it returns (the contract)
                try:
                    await self.gate.wait()
                except asyncio.CancelledError:
                    cancelled = True
            if cancelled:
                raise asyncio.CancelledError
        await started()
        return DestinationResult("answer", "sunny")

    async def release(self, participant_id: str) -> None:
        return None


async def test_queued_turns_count_in_flight_and_their_wait_is_measured() -> None:
    """A turn waiting behind its participant's running turn counts in flight from its
    arrival; one dropped from the full line leaves the count right; the one that runs
    reports how long it waited before routing (`RouterLoad.wait_secs`)."""
    clock, agent = ManualClock(), _Draining()
    router = AgentRouter({"weather": agent}, ScriptedDecisions("weather"),
                         output=OutputRecorder(), default_destination="weather", clock=clock,
                         overload=POLICY, max_waiting_turns=1)
    outcomes: dict[str, object] = {}

    async def run(turn_id: str) -> None:
        try:
            outcomes[turn_id] = await router.handle(AgentTurn("p1", turn_id, "rain?"))
        except TurnInterrupted as exc:
            outcomes[turn_id] = exc

    async with anyio.create_task_group() as tg:
        try:  # the gate opens whatever happens: t1 drains, nothing hangs
            tg.start_soon(run, "t1")
            with anyio.fail_after(5):
                await agent.entered.wait()
            assert router.load.turns_in_flight == 1
            tg.start_soon(run, "t2")  # supersedes t1, waits for it to drain
            await clock.settle()
            assert router.load.turns_in_flight == 2
            tg.start_soon(run, "t3")  # the line holds one: t2 is dropped
            await clock.settle()
            assert isinstance(outcomes.get("t2"), TurnInterrupted)
            assert router.load.turns_in_flight == 2
            clock.advance(0.03)  # t3 waits 0.03 s (less than a sample's lag threshold)
            await clock.settle()
        finally:
            agent.gate.set()
    assert isinstance(outcomes["t1"], TurnInterrupted)
    assert outcomes["t3"] == DestinationResult("answer", "sunny")
    assert router.load.turns_in_flight == 0
    assert router.load.wait_secs == pytest.approx(0.03)
    await router.stop()


async def test_overload_none_turns_admission_control_off() -> None:
    """With overload=None the router never samples and never sheds."""
    clock = ManualClock()
    h = harness(clock, overload=None)
    async with anyio.create_task_group() as tg:
        gate = await hold_turn(h, tg)
        assert clock.sleepers == 0  # no sampler sleeps
        assert (await h.say("hi", "p2")).text == "weather answer"
        gate.set()
    assert h.observer.load_samples == []
    assert h.router.load.status == "ready"
    assert h.router.busy_text == OverloadPolicy().busy_text  # front ends' busy text


async def test_telemetry_counts_shed_turns_and_samples() -> None:
    """Telemetry: turns_total{outcome=busy}, shed reason, lag histogram, state gauge."""
    clock = ManualClock()
    registry = CollectorRegistry()
    h = harness(clock, telemetry=Telemetry(registry=registry))
    async with anyio.create_task_group() as tg:
        gate = await hold_turn(h, tg)
        await lag(clock, 0.2)
        with pytest.raises(RouterBusyError):
            await h.say("hi", "p2")
        get = registry.get_sample_value
        assert get("turnrouter_turns_total", {"route": "none", "outcome": "busy"}) == 1
        assert get("turnrouter_shed_turns_total", {"reason": "new_participant"}) == 1
        assert get("turnrouter_overload_state") == 1
        assert get("turnrouter_event_loop_lag_seconds_count") == 2
        assert get("turnrouter_event_loop_lag_seconds_bucket", {"le": "0.2"}) == 2
        gate.set()
    await h.router.stop()
    assert registry.get_sample_value("turnrouter_overload_state") == 0


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


async def test_readiness_endpoint_flips_with_the_router() -> None:
    """`/ready` and `/readyz` answer 200 while ready and 503 while busy (real HTTP)."""
    clock = ManualClock()
    h = harness(clock)
    with serve_metrics(0, registry=CollectorRegistry(), ready=lambda: not h.router.busy) as srv:
        base = f"http://127.0.0.1:{srv.port}"
        assert await anyio.to_thread.run_sync(_status, base + "/ready") == 200
        async with anyio.create_task_group() as tg:
            gate = await hold_turn(h, tg)
            await lag(clock, 0.2)
            assert await anyio.to_thread.run_sync(_status, base + "/ready") == 503
            assert await anyio.to_thread.run_sync(_status, base + "/readyz") == 503
            assert await anyio.to_thread.run_sync(_status, base + "/metrics") == 200
            await lag(clock, 0.0, samples=POLICY.calm_samples)
            assert await anyio.to_thread.run_sync(_status, base + "/readyz") == 200
            gate.set()
    await h.router.stop()


async def test_a_failing_readiness_check_reads_busy() -> None:
    """A `ready` callable that raises answers 503, never 200."""
    def broken() -> bool:
        raise RuntimeError("no router yet")

    with serve_metrics(0, registry=CollectorRegistry(), ready=broken) as srv:
        url = f"http://127.0.0.1:{srv.port}/ready"
        assert await anyio.to_thread.run_sync(_status, url) == 503


async def test_runtime_sheds_quietly_and_balances(caplog: pytest.LogCaptureFixture) -> None:
    """Through the runtime a shed query is told busy_text and counted once, as a turn
    with outcome busy: neither logged as dropped nor counted as rejected."""
    clock = ManualClock()
    observer = RecordingObserver()
    query: Topic[UserQuery] = Topic("q", UserQuery)
    output: Topic[ResponseOutput] = Topic("o", ResponseOutput)
    agent = ScriptedAgent("weather")
    router = AgentRouter({"weather": agent}, ScriptedDecisions("weather"),
                         default_destination="weather", query_topic=query,
                         output_topic=output, telemetry=observer, clock=clock,
                         overload=POLICY)
    caplog.set_level(logging.WARNING)
    async with anyio.create_task_group() as tg:
        gate = agent.answer_gate = anyio.Event()
        tg.start_soon(partial(router.route_turn, AgentTurn("p1", "t0", "hold"),
                              output=OutputRecorder()))
        with anyio.fail_after(5):
            await agent.answer_entered.wait()
        agent.answer_gate = None
        await lag(clock, 0.2)
        message = UserQuery(participant_id="p2", text="hi")
        outputs = await publish_and_drain(router, output, (query, message))
        gate.set()
    assert [(o.request_id, o.text) for o in outputs] == [
        (message.message_id, POLICY.busy_text)]
    assert observer.outcome(message.message_id) == "busy"
    assert not [e for e in observer.events if e[0] == "message_rejected"]
    assert not [r for r in caplog.records if "dropped query" in r.getMessage()]
    await router.stop()


@given(busy=st.one_of(st.floats(allow_nan=True), st.integers(), st.text(max_size=3),
                      st.none(), st.booleans()),
       shed=st.one_of(st.floats(allow_nan=True), st.integers(min_value=-10**30,
                                                              max_value=10**30)),
       sample=st.one_of(st.floats(allow_nan=True), st.integers(), st.none()),
       text=st.one_of(st.text(max_size=5), st.none(), st.integers()),
       calm=st.one_of(st.integers(min_value=-5, max_value=2000), st.floats(), st.booleans()),
       new=st.one_of(st.integers(min_value=-5, max_value=10**6), st.floats(), st.booleans(),
                     st.none(), st.text(max_size=3)),
       share=st.one_of(st.none(), st.floats(allow_nan=True), st.integers(), st.booleans(),
                       st.text(max_size=3)),
       window=st.one_of(st.floats(allow_nan=True), st.integers(min_value=-10**30,
                                                               max_value=10**30),
                        st.none(), st.text(max_size=3)),
       cap=st.one_of(st.none(), st.integers(min_value=-5, max_value=2 * 10**6),
                     st.floats(allow_nan=True), st.booleans(), st.text(max_size=3)))
def test_overload_policy_accepts_only_sane_settings(busy: Any, shed: Any, sample: Any,
                                                    text: Any, calm: Any, new: Any,
                                                    share: Any, window: Any,
                                                    cap: Any) -> None:
    """Any junk is refused with an error naming the setting; what is accepted is sane."""
    try:
        policy = OverloadPolicy(busy, shed, sample, text, calm, new, share, window, cap)
    except (ConfigurationError, ContractTypeError) as exc:
        error: Exception | None = exc
    else:
        error = None
    if error is not None:
        assert "OverloadPolicy" in str(error)
        return
    assert 0 < policy.busy_lag_secs <= policy.shed_lag_secs
    assert policy.sample_secs > 0 and policy.busy_text and 1 <= policy.calm_samples <= 1000
    assert type(policy.new_per_sample) is int and 8 <= policy.new_per_sample <= 65536
    assert policy.max_busy_fraction is None or 0 < policy.max_busy_fraction <= 1
    assert math.isfinite(policy.demand_window_secs) and policy.demand_window_secs > 0
    assert policy.max_turns_in_flight is None or (
        type(policy.max_turns_in_flight) is int and 1 <= policy.max_turns_in_flight <= 10**6)


async def test_turns_past_max_turns_in_flight_are_shed_until_they_end() -> None:
    """spike23: destinations waiting on a saturated backend leave the loop idle, so lag
    never rises; `max_turns_in_flight` bounds the turns handled at once. Past it a turn
    (an admitted participant's too) is told busy_text, counted (reason turns_in_flight)
    and refused, the lag states staying ready; once turns end, turns are admitted."""
    clock = ManualClock()
    h = harness(clock, overload=dataclasses.replace(POLICY, max_turns_in_flight=2))
    agent = h["weather"]
    gate = agent.answer_gate = anyio.Event()
    async with anyio.create_task_group() as tg:
        for pid in ("p1", "p2"):
            agent.answer_entered = anyio.Event()
            tg.start_soon(h.capture, h.turn("hold", pid))
            with anyio.fail_after(5):
                await agent.answer_entered.wait()
        assert h.router.load.turns_in_flight == 2 and h.router.load.status == "ready"
        assert h.router.refusing and h.router.sheds("p1") and h.router.sheds("p3")
        refused = [h.turn("hi", pid) for pid in ("p3", "p1")]  # a newcomer, and p1
        for turn in refused:
            with pytest.raises(RouterBusyError, match="max_turns_in_flight is 2"):
                await h.router.handle(turn)
            assert h.observer.outcome(turn.turn_id) == "busy"
            assert ("shed", turn.participant_id, "turns_in_flight") in h.observer.events
        assert [(s.turn_id, s.text) for s in h.output.spoken if s.route == "none"] == [
            (turn.turn_id, "Busy, call back soon.") for turn in refused]
        agent.answer_gate = None
        gate.set()
    assert h.router.load.turns_in_flight == 0
    assert not h.router.refusing and not h.router.sheds("p3")
    assert (await h.say("now", "p3")).text == "weather answer"
    await h.router.stop()


def test_router_refuses_a_non_policy() -> None:
    with pytest.raises(ContractTypeError, match="overload"):
        AgentRouter({"conversation": ScriptedAgent("conversation")},
                    ScriptedDecisions("conversation"), overload=0.1)  # type: ignore[arg-type]


def test_a_scaled_policy_divides_its_durations() -> None:
    scaled = POLICY.scaled(10)
    assert [round(v, 9) for v in (scaled.busy_lag_secs, scaled.shed_lag_secs,
                                  scaled.sample_secs)] == [0.01, 0.05, 0.001]
    with pytest.raises(ConfigurationError):
        POLICY.scaled(0)


async def test_overflows_are_logged_first_then_at_powers_of_ten(
        caplog: pytest.LogCaptureFixture) -> None:
    """The 1st, 10th, 100th and 1,000th overflow of a limit are logged, no other."""
    h = Harness(ScriptedAgent("conversation"), max_participants=1, overload=None)
    await h.say(participant="a")
    caplog.set_level(logging.WARNING, logger="turnrouter")
    for n in range(1500):
        with pytest.raises(LifecycleError):
            await h.say(participant=f"refused-{n}")
    logged = [r.getMessage() for r in caplog.records if "limit participants" in r.getMessage()]
    assert [m.split("(")[1].split(" ")[0] for m in logged] == ["1", "10", "100", "1000"]


async def test_wait_ready_returns_when_the_router_calms_and_can_be_cancelled() -> None:
    """wait_ready() returns at once while ready, else once the lag falls; a cancelled
    waiter leaves nothing behind."""
    clock = ManualClock()
    h = harness(clock)
    with anyio.fail_after(5):
        await h.router.wait_ready()  # ready: at once
    async with anyio.create_task_group() as tg:
        gate = await hold_turn(h, tg)
        await lag(clock, 0.2)
        calmed = anyio.Event()

        async def waiter() -> None:
            await h.router.wait_ready()
            calmed.set()

        with anyio.CancelScope() as scope:  # a waiter cancelled while busy
            scope.cancel()
            await h.router.wait_ready()
        tg.start_soon(waiter)
        await clock.settle()
        assert not calmed.is_set()
        await lag(clock, 0.0, samples=POLICY.calm_samples)
        with anyio.fail_after(5):
            await calmed.wait()
        gate.set()
    await h.router.stop()


def test_the_demo_sheds_unless_told_not_to() -> None:
    """`turnrouter demo --no-shedding` turns admission control off; it is on by default."""
    from turnrouter.cli import demo_parser

    assert demo_parser().parse_args([]).no_shedding is False
    assert demo_parser().parse_args(["--no-shedding"]).no_shedding is True


@given(junk=st.one_of(st.integers(), st.text(max_size=5), st.booleans(), st.floats()))
def test_serve_metrics_refuses_a_ready_check_that_is_not_callable(junk: Any) -> None:
    with pytest.raises(ContractTypeError, match="ready"):
        serve_metrics(0, registry=CollectorRegistry(), ready=junk)


async def test_the_readiness_server_answers_junk_paths_with_metrics_not_errors() -> None:
    """Only /ready and /readyz are the check; any other path is the metrics app."""
    with serve_metrics(0, registry=CollectorRegistry(), ready=lambda: False) as srv:
        base = f"http://127.0.0.1:{srv.port}"
        for path in ("/", "/ready/x", "/READY", "/metrics?x=1"):
            assert await anyio.to_thread.run_sync(_status, base + path) == 200


async def test_a_shed_turn_cancelled_while_being_told_is_not_counted() -> None:
    """Cancelling the caller while the busy text is delivered takes the turn back: it is
    not counted (the query's publisher did not finish publishing it either)."""
    clock = ManualClock()
    h = harness(clock)
    async with anyio.create_task_group() as tg:
        gate = await hold_turn(h, tg)
        await lag(clock, 0.2)
        newcomer = h.turn("hi", "p2")
        await cancel_while_told_busy(h, newcomer)
        gate.set()
    await h.router.stop()


def _shedding_router(**kwargs: Any) -> tuple[AgentRouter, RecordingObserver, ScriptedAgent,
                                            ManualClock, Topic[UserQuery],
                                            Topic[ResponseOutput]]:
    clock = ManualClock()
    observer = RecordingObserver()
    query: Topic[UserQuery] = Topic("q", UserQuery)
    output: Topic[ResponseOutput] = Topic("o", ResponseOutput)
    agent = ScriptedAgent("weather")
    router = AgentRouter({"weather": agent}, ScriptedDecisions("weather"),
                         default_destination="weather", query_topic=query,
                         output_topic=output, telemetry=observer, clock=clock,
                         overload=POLICY, **kwargs)
    return router, observer, agent, clock, query, output


async def test_runtime_sheds_with_each_querys_reason_and_trace() -> None:
    """Shed in the publisher's call, a query still gets its reason (a new participant
    while busy, an admitted one while shedding) and its busy text is told inside the
    query's trace context; no RouterBusyError is raised only to be caught again."""
    router, observer, agent, clock, query, output = _shedding_router()
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    raised: list[str] = []

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if event == "exception" and isinstance(arg[1], RouterBusyError):
            raised.append(frame.f_code.co_name)
        return tracer

    async with anyio.create_task_group() as tg:
        gate = agent.answer_gate = anyio.Event()
        tg.start_soon(partial(router.route_turn, AgentTurn("p1", "t0", "hold"),
                              output=OutputRecorder()))
        with anyio.fail_after(5):
            await agent.answer_entered.wait()
        agent.answer_gate = None
        await lag(clock, 0.2)
        assert router.busy and not router.sheds("p1")
        newcomer = UserQuery(participant_id="p2", text="hi", traceparent=parent)
        with anyio.fail_after(5):
            sys.settrace(tracer)
            try:
                first = await publish_and_drain(router, output, (query, newcomer))
            finally:
                sys.settrace(None)
        await lag(clock, 0.6)
        assert router.sheds("p1")  # shedding: admitted participants' turns too
        admitted = UserQuery(participant_id="p1", text="again")
        with anyio.fail_after(5):
            second = await publish_and_drain(router, output, (query, admitted))
        gate.set()
    assert [(o.request_id, o.text, o.final) for o in first + second] == [
        (newcomer.message_id, POLICY.busy_text, True),
        (admitted.message_id, POLICY.busy_text, True)]
    assert [e for e in observer.events if e[0] == "enter_context"] == [
        ("enter_context", {"traceparent": parent})]
    assert [e for e in observer.events if e[0] == "shed"] == [
        ("shed", "p2", "new_participant"), ("shed", "p1", "shedding")]
    assert observer.outcome(newcomer.message_id) == observer.outcome(
        admitted.message_id) == "busy"
    assert raised == []
    await router.stop()


async def test_runtime_sheds_with_status_reports_too() -> None:
    """With a `set_status` callback a shed query is still reported processing, then
    idle, as every runtime query is, and counted once."""
    statuses: list[tuple[str, str]] = []

    async def set_status(status: str, participant_id: str) -> None:
        statuses.append((status, participant_id))

    router, observer, agent, clock, query, output = _shedding_router(set_status=set_status)
    async with anyio.create_task_group() as tg:
        gate = agent.answer_gate = anyio.Event()
        tg.start_soon(partial(router.route_turn, AgentTurn("p1", "t0", "hold"),
                              output=OutputRecorder()))
        with anyio.fail_after(5):
            await agent.answer_entered.wait()
        agent.answer_gate = None
        await lag(clock, 0.2)
        message = UserQuery(participant_id="p2", text="hi")
        with anyio.fail_after(5):
            outputs = await publish_and_drain(router, output, (query, message))
        gate.set()
    assert [(o.request_id, o.text) for o in outputs] == [(message.message_id,
                                                          POLICY.busy_text)]
    assert statuses == [("processing", "p2"), ("idle", "p2")]
    assert [e for e in observer.events if e[0] == "shed"] == [
        ("shed", "p2", "new_participant")]
    await router.stop()


# The projected busy fraction (`OverloadPolicy.max_busy_fraction`): the clock's busy time
# is scripted with `ManualClock.work()`, one sample period at a time, dyadic numbers so
# the projection's arithmetic is exact.
PERIOD = 1 / 64
PROJECTING = OverloadPolicy(busy_lag_secs=0.25, shed_lag_secs=0.5, sample_secs=PERIOD,
                            new_per_sample=65536, max_busy_fraction=0.5,
                            demand_window_secs=1.0)  # (64 samples)


async def period(clock: ManualClock, busy: float) -> None:
    """One sample period on time, `busy` of its share worked (the rest idle)."""
    with anyio.fail_after(5):
        await clock.wait_for_sleepers(1)
    clock.work(busy * PERIOD)
    clock.advance((1 - busy) * PERIOD)
    await clock.settle()


async def admits(h: Harness, participant: str) -> bool:
    """Whether a newcomer's turn is admitted (else it was refused busy)."""
    try:
        await h.say("hi", participant)
    except RouterBusyError:
        return False
    return True

async def hold_eight(h: Harness, tg: Any) -> anyio.Event:
    """Eight participants held: p0 with a turn waiting on the returned gate, p1-p7
    admitted."""
    gate = await hold_turn(h, tg, "p0")
    for i in range(1, 8):
        assert await admits(h, f"p{i}")
    return gate



async def test_a_ramp_is_admitted_up_to_the_projected_busy_fraction() -> None:
    """Each participant held brings 1/64 of the loop's time; newcomers arrive 3 a sample
    period. The router admits them, spread over the demand window, until the
    participants held would take `max_busy_fraction` (0.5: 32 participants), then
    refuses the rest (reason new_participant) while the lag stays at 0: lag shows an
    overload only once it happened (spike12's ramp stalled the loop for 3-4 s)."""
    clock = ManualClock()
    h = harness(clock, overload=PROJECTING)
    async with anyio.create_task_group() as tg:
        gate = await hold_eight(h, tg)
        for _ in range(32):  # history: half the window, 8 participants
            await period(clock, len(h.router.participants) / 64)
        refused = arrived = 0
        for n in range(200):
            for k in range(3):
                arrived += 1
                refused += not await admits(h, f"c{n}-{k}")
            held = len(h.router.participants)
            assert held <= 32  # never past the projection
            await period(clock, held / 64)
        assert len(h.router.participants) == 32
        assert refused == arrived - 24
        assert h.observer.events.count(("shed", "c199-2", "new_participant")) == 1
        assert h.router.refusing and h.router.sheds("c-late") and not h.router.sheds("p1")
        assert not h.router.busy and h.router.load.status == "ready"
        assert h.router.load.lag_secs == 0
        assert (await h.say("again", "p1")).text == "weather answer"  # held: served
        # Participants leave: their demand goes with them, newcomers come in again.
        for i in range(8):
            await h.router.participant_left(f"p{i + 1}" if i < 7 else "c0-0")
        for _ in range(64):
            await period(clock, len(h.router.participants) / 64)
        assert await admits(h, "after-leaving")
        gate.set()
    await h.router.stop()


async def test_newcomers_are_spread_over_the_window() -> None:
    """With room for 24 more, a crowd at the door gets them over the demand window (so
    the demand they bring shows before more come in), not all in one sample period."""
    clock = ManualClock()
    h = harness(clock, overload=PROJECTING)
    async with anyio.create_task_group() as tg:
        gate = await hold_eight(h, tg)
        for _ in range(64):
            await period(clock, 8 / 64)  # (busy 1/8: at least half of 0.5 is not idle)
        outcomes = [await admits(h, f"c{n}") for n in range(24)]
        assert 1 <= sum(outcomes) <= 4  # room 24 over 64 periods: 1 a period, 4 kept
        gate.set()
    await h.router.stop()


async def test_a_hiccup_on_a_mostly_idle_loop_refuses_nobody() -> None:
    """A 0.3 s block (a collector pause, a blocking call) while 8 participants keep the
    loop 1/32 busy counts as a few busy samples, not as their demand: every newcomer
    right after it is admitted (spike13: a turn-rate ceiling noted in the hiccup's
    second refused newcomers for 14-27 s)."""
    clock = ManualClock()
    h = harness(clock, overload=PROJECTING)
    async with anyio.create_task_group() as tg:
        gate = await hold_eight(h, tg)
        for _ in range(64):
            await period(clock, 1 / 32)
        with anyio.fail_after(5):
            await clock.wait_for_sleepers(1)
        clock.work(0.3)  # the hiccup: one sample 0.3 s late, all of it busy
        await clock.settle()
        assert h.router.load.lag_secs == pytest.approx(0.3 - PERIOD)
        for n in range(64):
            assert await admits(h, f"c{n}"), n
            await period(clock, 1 / 32)
        assert not h.router.busy
        gate.set()
    await h.router.stop()


async def test_a_loop_past_the_projection_but_mostly_idle_still_admits() -> None:
    """Whatever the projection says, while the loop is busy less than half of
    max_busy_fraction a few newcomers a sample period still come in (an estimate from a
    start-up's one-off work must not lock the door)."""
    clock = ManualClock()
    h = harness(clock, overload=PROJECTING)
    async with anyio.create_task_group() as tg:
        gate = await hold_turn(h, tg, "p0")
        for _ in range(64):
            await period(clock, 3 / 16)  # one participant bringing 3/16: room for 1 more
        assert [await admits(h, f"c{n}") for n in range(3)] == [True, True, False]
        gate.set()
    await h.router.stop()


async def test_the_projection_resets_when_the_sampler_ends() -> None:
    """Stopping the router (the sampler cancelled) or the sampler ending once idle drops
    the demand measured: no newcomer is held back by what a past load measured."""
    clock = ManualClock()
    h = harness(clock, overload=PROJECTING)
    async with anyio.create_task_group() as tg:
        gate = await hold_turn(h, tg, "p0")
        for _ in range(64):
            await period(clock, 1.0)  # one participant taking the whole loop
        assert h.router.refusing and not h.router.busy
        assert h.router.load.status == "ready"
        gate.set()
    # Idle: no turn in flight. The sampler ends by itself; the door opens.
    for _ in range(200):
        if not clock.sleepers:
            break
        await period(clock, 0.0)
    assert not h.router.refusing
    assert await admits(h, "next")
    async with anyio.create_task_group() as tg:
        gate = await hold_turn(h, tg, "p0")
        for _ in range(64):
            await period(clock, 1.0)
        assert h.router.refusing
        gate.set()
        await h.router.stop()
    assert not h.router.refusing and not h.router.sheds("another")


async def test_a_newcomer_refused_by_the_projection_and_cancelled_is_not_counted() -> None:
    """Cancelling a newcomer's caller while it is told busy_text (the door closed by the
    projection) takes the turn back: not counted, nobody admitted, the door still
    closed for the next newcomer."""
    clock = ManualClock()
    h = harness(clock, overload=PROJECTING)
    async with anyio.create_task_group() as tg:
        gate = await hold_turn(h, tg, "p0")
        for _ in range(64):
            await period(clock, 1.0)
        newcomer = h.turn("hi", "c1")
        await cancel_while_told_busy(h, newcomer)
        assert "c1" not in h.router.participants and h.router.sheds("c2")
        with pytest.raises(RouterBusyError, match="leaves no room"):
            await h.router.handle(h.turn("hi", "c2"))
        gate.set()
    await h.router.stop()


async def test_without_busy_time_or_with_the_projection_off_only_lag_counts() -> None:
    """max_busy_fraction=None, or a clock without busy_time: no projection."""
    for policy, clock in ((dataclasses.replace(PROJECTING, max_busy_fraction=None),
                           ManualClock()), (PROJECTING, _LagOnlyClock())):
        h = harness(clock, overload=policy)
        async with anyio.create_task_group() as tg:
            gate = await hold_turn(h, tg, "p0")
            for _ in range(64):
                await period(clock, 1.0)
            assert not h.router.refusing
            assert await admits(h, "c1")
            gate.set()
        await h.router.stop()


class _LagOnlyClock(ManualClock):
    """A clock that cannot tell how busy the loop was (a custom `Clock`)."""

    busy_time = None  # type: ignore[assignment]

    def work(self, seconds: float) -> None:
        self.advance(seconds)


@pytest.mark.parametrize(("field", "value"), [
    ("max_busy_fraction", 0), ("max_busy_fraction", 1.5), ("max_busy_fraction", math.nan),
    ("max_busy_fraction", True), ("max_busy_fraction", "0.7"),
    ("demand_window_secs", 0), ("demand_window_secs", math.inf),
    ("demand_window_secs", None)])
def test_the_projection_settings_are_checked(field: str, value: Any) -> None:
    with pytest.raises((ConfigurationError, ContractTypeError), match=field):
        OverloadPolicy(**{field: value})


def test_a_scaled_policy_divides_the_demand_window_too() -> None:
    scaled = PROJECTING.scaled(4)
    assert scaled.demand_window_secs == 0.25 and scaled.max_busy_fraction == 0.5
    assert OverloadPolicy().max_busy_fraction is None  # (opt in: docs/limits.md)


def test_the_system_clock_reads_its_threads_busy_time() -> None:
    """`SystemClock.busy_time()`: seconds the calling thread ran or waited to run, never
    going back; another thread reads its own (a thread that only started reads less)."""
    clock = SystemClock()
    first = clock.busy_time()
    sum(range(10_000))
    assert 0 < first <= clock.busy_time()
    other: list[float] = []
    fds = _open_fds()
    for _ in range(3):  # (each thread's reader is closed when the thread ends)
        thread = threading.Thread(target=lambda: other.append(clock.busy_time()))
        thread.start()
        thread.join(timeout=10)
    assert len(other) == 3 and all(0 <= seen <= clock.busy_time() for seen in other)
    assert _open_fds() == fds


def _open_fds() -> int:
    """This process' open file descriptors (-1 where that cannot be read)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1
