"""Runtime topics: configuration errors, delivery, status, departures, malformed input."""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import re
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnrouter import (
    Admission,
    AgentRouter,
    AgentTurn,
    ConfigurationError,
    ContractValueError,
    LifecycleError,
)
from turnrouter.runtime import (
    AgentRuntime,
    Interrupted,
    ParticipantJoined,
    ParticipantLeft,
    ResponseOutput,
    Topic,
    UserQuery,
)
from turnrouter.testing import RecordingObserver, ScriptedAgent, ScriptedDecisions

from .kit import publish_and_drain

FAILURE_TEXT = "Sorry, something went wrong. Please try again."
CLARIFICATION_TEXT = ("Sorry, I'm not sure I can help with that. "
                      "Could you say it another way?")

pytestmark = pytest.mark.anyio

QUERY = Topic("q", UserQuery)
OUTPUT = Topic("o", ResponseOutput)
JOINED = Topic("j", ParticipantJoined)
LEFT = Topic("l", ParticipantLeft)
INTERRUPTED = Topic("i", Interrupted)


def make_router(**kwargs: Any) -> tuple[AgentRouter, dict[str, ScriptedAgent],
                                        RecordingObserver]:
    agents = {"weather": ScriptedAgent("weather"), "conversation": ScriptedAgent("conversation")}
    observer = RecordingObserver()
    topics: dict[str, Any] = {"query_topic": QUERY, "output_topic": OUTPUT,
                              "participant_joined_topic": JOINED, "participant_left_topic": LEFT,
                              "interrupted_topic": INTERRUPTED}
    topics.update(kwargs.pop("topics", {}))
    router = AgentRouter(agents, kwargs.pop("decisions", ScriptedDecisions("weather")),
                         telemetry=observer, **topics, **kwargs)
    return router, agents, observer


class Harness:
    """A running runtime with the router registered and output collected."""

    def __init__(self, router: AgentRouter) -> None:
        self.router = router
        self.outputs: list[ResponseOutput] = []
        self.runtime = AgentRuntime()

    async def collect(self, message: ResponseOutput) -> None:
        self.outputs.append(message)


# ---------------------------------------------------------------- configuration


class _SpokenQuery(UserQuery):
    """A subclass of UserQuery: not the exact payload class a query topic must carry."""


@pytest.mark.parametrize(
    ("topics", "error", "match"),
    [
        ({"output_topic": None}, ValueError, "together"),
        ({"participant_joined_topic": None}, ValueError, "participant_joined_topic"),
        ({"query_topic": Topic("q", ResponseOutput)}, TypeError, "exactly UserQuery"),
        ({"query_topic": Topic("q", _SpokenQuery)}, TypeError, "exactly UserQuery"),
        ({"interrupted_topic": Topic("i", ParticipantLeft)}, TypeError, "Interrupted"),
        ({"query_topic": "q"}, TypeError, "Topic"),
        ({"interrupted_topic": Topic("q", Interrupted)}, ValueError, "distinct"),
    ],
)
def test_runtime_configuration_errors(topics: dict[str, Any], error: type[Exception],
                                      match: str) -> None:
    """Incomplete topics raise ValueError, wrong payload classes TypeError."""
    with pytest.raises(error, match=match):
        make_router(topics=topics)


def test_runtime_subscriber_requires_topics() -> None:
    """runtime_subscriber() without query and output topics is a configuration error."""
    router = AgentRouter({"conversation": ScriptedAgent("conversation")},
                         ScriptedDecisions("conversation"), telemetry=RecordingObserver())
    with pytest.raises(ConfigurationError, match="query_topic"):
        router.runtime_subscriber()


def test_only_explicitly_supplied_topics_are_subscribed() -> None:
    """The subscriber listens to the configured input topics only, never to its output."""
    router, _, _ = make_router(topics={"participant_joined_topic": None,
                                       "participant_left_topic": None,
                                       "interrupted_topic": None})
    assert router.runtime_subscriber().subscriptions == (QUERY,)
    router, _, _ = make_router(topics={"participant_left_topic": None})
    assert router.runtime_subscriber().subscriptions == (QUERY, JOINED, INTERRUPTED)


def test_topic_validates_its_payload() -> None:
    """A Topic coerces dicts to its payload and rejects other types."""
    assert QUERY.coerce({"participant_id": "p", "text": "hi"}).text == "hi"
    with pytest.raises(ValueError, match="malformed UserQuery"):
        QUERY.coerce({"participant_id": "", "text": "hi"})
    with pytest.raises(TypeError, match="carries UserQuery"):
        QUERY.coerce(ParticipantLeft(participant_id="p"))


# ---------------------------------------------------------------- delivery




async def test_query_is_routed_with_publication_identity() -> None:
    """A published query becomes a turn with the message id and timestamp."""
    router, _, _ = make_router(decisions=ScriptedDecisions("clarify"))
    query = UserQuery(participant_id="p1", text="hmm", timestamp_us=1234)
    outputs = await publish_and_drain(
        router, OUTPUT, (JOINED, ParticipantJoined(participant_id="p1")), (QUERY, query))
    assert len(outputs) == 1
    assert outputs[0].request_id == query.message_id
    assert outputs[0].route == "clarify"
    assert outputs[0].participant_id == "p1"
    assert outputs[0].final is True  # the router's clarification ends the turn


async def test_destination_sees_runtime_turn() -> None:
    """Destinations receive the query text, message id and timestamp as the turn."""
    seen: list[AgentTurn] = []

    def admit(turn: AgentTurn, focused: bool) -> Admission:
        seen.append(turn)
        return Admission("accept")

    router = AgentRouter({"weather": ScriptedAgent("weather", admissions=admit)},
                         ScriptedDecisions("weather"), query_topic=QUERY, output_topic=OUTPUT,
                         telemetry=RecordingObserver())
    query = UserQuery(participant_id="p1", text="rain?", timestamp_us=99)
    await publish_and_drain(router, OUTPUT, (QUERY, query))
    [turn] = seen
    assert (turn.participant_id, turn.turn_id, turn.query, turn.timestamp_us) == (
        "p1", query.message_id, "rain?", 99)


async def test_set_status_wraps_each_runtime_turn_and_failures_are_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """set_status gets processing then idle; a failing callback does not fail the turn."""
    seen: list[tuple[str, str]] = []

    async def status(value: str, pid: str) -> None:
        seen.append((value, pid))
        if value == "idle":
            raise RuntimeError("status sink down")

    router, agents, _ = make_router(set_status=status)
    with caplog.at_level(logging.WARNING, logger="turnrouter"):
        await publish_and_drain(router, OUTPUT, (QUERY, UserQuery(participant_id="p1", text="x")))
    assert seen == [("processing", "p1"), ("idle", "p1")]
    assert agents["weather"].count("answer") == 1
    assert sum("set_status" in r.getMessage() for r in caplog.records) == 1


async def test_malformed_messages_are_rejected_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A malformed query is logged, counted and dropped; other participants go on."""
    router, agents, observer = make_router()
    with caplog.at_level(logging.WARNING, logger="turnrouter.runtime"):
        await publish_and_drain(
            router, OUTPUT,
            (QUERY, {"participant_id": "", "text": "x"}),
            (QUERY, ParticipantLeft(participant_id="p9")),
            (QUERY, UserQuery(participant_id="p2", text="ok")),
        )
    assert observer.events.count(("message_rejected", "q", "invalid")) == 1
    assert observer.events.count(("message_rejected", "q", "wrong_type")) == 1
    assert [c.participant_id for c in agents["weather"].calls if c.method == "answer"] == ["p2"]
    assert sum("(rejected) failed" in r.getMessage() for r in caplog.records) == 2


async def test_background_failure_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """A destination failure in a runtime turn is logged once, by type: its message (which
    may quote the user) only at DEBUG."""
    router, agents, _ = make_router()
    agents["weather"]._results = [RuntimeError("user said: my secret address")]
    with caplog.at_level(logging.WARNING):
        outputs = await publish_and_drain(
            router, OUTPUT, (QUERY, UserQuery(participant_id="p", text="x")))
    failures = [r for r in caplog.records if "runtime turn" in r.getMessage()]
    assert len(failures) == 1
    assert "RuntimeError" in failures[0].getMessage()
    assert "secret" not in caplog.text
    assert [(o.text, o.final) for o in outputs] == [(FAILURE_TEXT, True)]  # the ending
    caplog.clear()
    agents["weather"]._results = [RuntimeError("user said: my secret address")]
    with caplog.at_level(logging.DEBUG):
        await publish_and_drain(
            router, OUTPUT, (QUERY, UserQuery(participant_id="p", text="x")))
    assert "secret" in caplog.text


async def test_a_router_subscribed_twice_to_one_runtime_is_refused() -> None:
    """The contract says register the subscriber once: a second subscriber of the same
    router on the same runtime (or the same agent object again) is a `ValueError`, as
    every query would run its destination twice (contract11: two answers, two
    exchanges of one turn in the history). Another runtime may take one of its own,
    and the registered one still answers once."""
    router, agents, _observer = make_router()
    async with AgentRuntime() as runtime:
        subscriber = router.runtime_subscriber()
        runtime.register(subscriber)
        with pytest.raises(ValueError, match=r"registered already.*twice"):
            runtime.register(router.runtime_subscriber())
        with pytest.raises(ValueError, match="registered already"):
            runtime.register(subscriber)
        async with AgentRuntime() as other:
            other.register(router.runtime_subscriber())
        await runtime.publish(QUERY, UserQuery(participant_id="p1", text="x"))
    assert agents["weather"].count("answer") == 1
    assert len(router.history_of("p1")) == 1


async def test_departure_closes_admission_until_rejoin() -> None:
    """After ParticipantLeft, queries and handle() are refused until ParticipantJoined."""
    router, agents, observer = make_router()
    async with AgentRuntime() as runtime:
        runtime.register(router.runtime_subscriber())
        await runtime.publish(QUERY, UserQuery(participant_id="p1", text="x"))
    async with AgentRuntime() as runtime:
        runtime.register(router.runtime_subscriber())
        await runtime.publish(LEFT, ParticipantLeft(participant_id="p1"))
    assert agents["weather"].count("release") == 1
    async with AgentRuntime() as runtime:
        runtime.register(router.runtime_subscriber())
        refused = UserQuery(participant_id="p1", text="again")
        await runtime.publish(QUERY, refused)
    # Counted once, by the router (outcome refused): not also as a rejected message,
    # which made one query two (ops7: the demo reported "lost -2").
    assert observer.outcome(refused.message_id) == "refused"
    assert not [e for e in observer.events if e[0] == "message_rejected"]
    assert agents["weather"].count("answer") == 1
    with pytest.raises(LifecycleError, match="joined"):
        await router.route_turn(AgentTurn("p1", "t", "x"), output=_silent)
    await publish_and_drain(router, OUTPUT, (JOINED, ParticipantJoined(participant_id="p1")),
                            (QUERY, UserQuery(participant_id="p1", text="back")))
    assert agents["weather"].count("answer") == 2


async def test_interrupted_topic_cancels_the_participants_turn() -> None:
    """An Interrupted message cancels that participant's running answer."""
    router, agents, _ = make_router()
    agent = agents["weather"]
    agent.answer_gate = anyio.Event()
    async with AgentRuntime() as runtime:
        runtime.register(router.runtime_subscriber())
        await runtime.publish(QUERY, UserQuery(participant_id="p1", text="x"))
        await agent.answer_entered.wait()
        await runtime.publish(INTERRUPTED, Interrupted(participant_id="p1"))
    assert agent.cancelled == ["answer"]
    assert router.history_of("p1") == ()


async def test_interrupted_without_a_participant_cancels_every_turn() -> None:
    """An Interrupted message naming no participant cancels every participant's answer."""
    router, agents, _ = make_router(decisions=ScriptedDecisions(
        lambda request: "weather" if request.turn.participant_id == "p1" else "conversation"))
    for agent in agents.values():
        agent.answer_gate = anyio.Event()
    with anyio.fail_after(10):
        async with AgentRuntime() as runtime:
            runtime.register(router.runtime_subscriber())
            await runtime.publish(QUERY, UserQuery(participant_id="p1", text="x"))
            await runtime.publish(QUERY, UserQuery(participant_id="p2", text="y"))
            await agents["weather"].started_called.wait()
            await agents["conversation"].started_called.wait()
            await runtime.publish(INTERRUPTED, Interrupted())
    assert agents["weather"].cancelled == ["answer"]
    assert agents["conversation"].cancelled == ["answer"]
    assert router.history_of("p1") == () and router.history_of("p2") == ()


# ---------------------------------------------------------------- superseded before start


def superseded(observer: RecordingObserver) -> int:
    return observer.events.count(("message_rejected", QUERY.name, "superseded"))


async def test_a_query_superseded_before_its_task_started_is_dropped_unrun() -> None:
    """The participant spoke again before the router started on its query: the older
    query is dropped before any work (no turn, no decision, no answer), counted as
    rejected (reason superseded); the newer one and other participants' are served."""
    router, agents, observer = make_router()
    old = UserQuery(participant_id="p1", text="first")
    other = UserQuery(participant_id="p2", text="mine")
    new = UserQuery(participant_id="p1", text="second")
    await publish_and_drain(router, OUTPUT, (QUERY, old), (QUERY, other), (QUERY, new))
    assert old.message_id not in observer.turns
    assert observer.outcome(other.message_id) == "answer"
    assert [call.query for call in agents["weather"].calls if call.method == "answer"] == [
        "mine", "second"]
    assert superseded(observer) == 1
    assert observer.outcome(new.message_id) == "answer"
    assert [e for e in observer.events if e[0] == "message_rejected"] == [
        ("message_rejected", QUERY.name, "superseded")]


async def test_a_started_query_is_left_to_the_router_to_supersede() -> None:
    """A query whose turn already runs is not dropped: the newer turn interrupts it
    (outcome interrupted), as without the runtime."""
    router, agents, observer = make_router()
    agent = agents["weather"]
    agent.answer_gate = anyio.Event()
    first = UserQuery(participant_id="p1", text="first")
    second = UserQuery(participant_id="p1", text="second")
    with anyio.fail_after(10):
        async with AgentRuntime() as runtime:
            runtime.register(router.runtime_subscriber())
            await runtime.publish(QUERY, first)
            await agent.answer_entered.wait()
            agent.answer_gate = None
            await runtime.publish(QUERY, second)
    assert observer.outcome(first.message_id) == "interrupted"
    assert observer.outcome(second.message_id) == "answer"
    assert superseded(observer) == 0


async def test_queued_queries_of_a_cancelled_runtime_leave_nothing_behind() -> None:
    """The runtime cancels query tasks that never started (its body failed): nothing is
    counted, no task outlives the exit, the dropped queries are freed, and the next
    runtime serves the participant's next query (no stale entry supersedes it)."""
    router, agents, observer = make_router()
    before = asyncio.all_tasks()
    queued = [UserQuery(participant_id="p1", text=f"q{n}") for n in range(3)]
    gone = [weakref.ref(query) for query in queued]

    async def fails(queries: list[UserQuery]) -> None:
        async with AgentRuntime() as runtime:
            runtime.register(router.runtime_subscriber())
            for query in queries:
                await runtime.publish(QUERY, query)
            raise ValueError("body")

    with anyio.fail_after(10), pytest.raises(ValueError, match="body"):
        await fails(queued)
    assert asyncio.all_tasks() == before
    assert observer.turns == {} and superseded(observer) == 0
    assert agents["weather"].calls == []
    later = UserQuery(participant_id="p1", text="later")
    await publish_and_drain(router, OUTPUT, (QUERY, later))
    assert observer.outcome(later.message_id) == "answer"
    del queued
    gc.collect()
    assert [ref() for ref in gone] == [None, None, None]


async def test_a_runtime_cancelled_while_the_newest_query_runs_drops_only_the_stale() -> None:
    """Cancellation between the drop and the newer turn: the stale query was counted
    once, the running newer one ends interrupted, and no task is left."""
    router, agents, observer = make_router()
    agent = agents["weather"]
    agent.answer_gate = anyio.Event()
    old = UserQuery(participant_id="p1", text="old")
    new = UserQuery(participant_id="p1", text="new")
    before = asyncio.all_tasks()
    with anyio.fail_after(10):
        async with AgentRuntime() as runtime:
            runtime.register(router.runtime_subscriber())
            await runtime.publish(QUERY, old)
            await runtime.publish(QUERY, new)
            await agent.answer_entered.wait()
            runtime.cancel()
    await router.stop()  # its load sampler
    assert asyncio.all_tasks() == before
    assert superseded(observer) == 1
    assert old.message_id not in observer.turns
    assert observer.outcome(new.message_id) == "interrupted"
    assert agent.cancelled == ["answer"]


@settings(max_examples=60, deadline=None)
@given(pids=st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=40),
       batch=st.integers(min_value=1, max_value=8))
def test_every_query_is_answered_superseded_or_interrupted_once(pids: list[str],
                                                                batch: int) -> None:
    """Any burst of queries (the publisher yielding every `batch` publications): each
    ends exactly one way (answered, dropped as superseded, or interrupted by the
    router), the counts balance, and each participant's last query is answered."""
    router, _, observer = make_router()
    queries = [UserQuery(participant_id=pid, text=f"q{n}") for n, pid in enumerate(pids)]

    async def main() -> None:
        with anyio.fail_after(10):
            async with AgentRuntime(publish_batch=batch) as runtime:
                runtime.register(router.runtime_subscriber())
                for query in queries:
                    await runtime.publish(QUERY, query)

    anyio.run(main)
    outcomes = {q.message_id: observer.outcome(q.message_id) for q in queries
                if q.message_id in observer.turns}
    assert set(outcomes.values()) <= {"answer", "interrupted"}
    assert len(outcomes) + superseded(observer) == len(queries)
    last = {query.participant_id: query.message_id for query in queries}
    assert all(outcomes.get(m) == "answer" for m in last.values())


async def test_trace_context_of_the_query_is_entered() -> None:
    """The query's W3C trace context is handed to the observer around the turn."""
    router, _, observer = make_router()
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    await publish_and_drain(
        router, OUTPUT, (QUERY, UserQuery(participant_id="p", text="x", traceparent=parent)))
    assert ("enter_context", {"traceparent": parent}) in observer.events


async def _silent(turn: AgentTurn, route: str, text: str) -> None:
    return None


async def test_held_patch_question_is_published_on_the_output_topic() -> None:
    """A human-gated patch's question reaches the output topic of a runtime router."""
    from turnrouter import ContextPatch

    router, _, _ = make_router()
    outputs: list[ResponseOutput] = []

    async def collect(message: ResponseOutput) -> None:
        outputs.append(message)

    async with AgentRuntime() as runtime:
        runtime.register(router.runtime_subscriber())
        runtime.subscribe(OUTPUT, collect)
        await runtime.publish(QUERY, UserQuery(participant_id="p1", text="book it"))
    held = await router.apply_context_patch(
        "p1", ContextPatch(task_id="booking", digest=("Table booked for two.",)), "human_gated")
    assert [o.text for o in outputs][-1].startswith("A background task finished: Table booked")
    assert outputs[-1].request_id == f"patch:{held.patch_id}"


async def test_left_then_joined_back_to_back_readmits() -> None:
    """A joined event published right after a left event reopens admission."""
    router, agents, _ = make_router()
    await publish_and_drain(router, OUTPUT, (QUERY, UserQuery(participant_id="p1", text="x")))
    await publish_and_drain(router, OUTPUT, (LEFT, ParticipantLeft(participant_id="p1")),
                            (JOINED, ParticipantJoined(participant_id="p1")))
    assert agents["weather"].count("release") == 1
    await publish_and_drain(router, OUTPUT, (QUERY, UserQuery(participant_id="p1", text="again")))
    assert agents["weather"].count("answer") == 2


async def test_successful_stop_reopens_departed_participants() -> None:
    """After a successful stop(), departed participants start a fresh lifecycle."""
    router, agents, _ = make_router()
    await router.participant_left("p1")
    with pytest.raises(LifecycleError):
        await router.route_turn(AgentTurn("p1", "t", "x"), output=_silent)
    await router.stop()
    await router.route_turn(AgentTurn("p1", "t2", "x"), output=_silent)
    assert agents["weather"].count("answer") == 1


async def test_without_a_joined_topic_departure_does_not_lock_out() -> None:
    """With only query and output topics, a departed participant may come back."""
    router, agents, _ = make_router(topics={"participant_joined_topic": None,
                                            "participant_left_topic": None})
    await router.route_turn(AgentTurn("p1", "t1", "x"), output=_silent)
    await router.participant_left("p1")
    await router.route_turn(AgentTurn("p1", "t2", "x"), output=_silent)
    assert agents["weather"].count("answer") == 2


async def test_status_goes_idle_even_when_the_runtime_cancels_the_turn() -> None:
    """set_status receives idle after processing even if the runtime is cancelled."""
    seen: list[str] = []

    async def status(value: str, pid: str) -> None:
        seen.append(value)

    router, agents, _ = make_router(set_status=status)
    agent = agents["weather"]
    agent.answer_gate = anyio.Event()
    async with AgentRuntime() as runtime:
        runtime.register(router.runtime_subscriber())
        await runtime.publish(QUERY, UserQuery(participant_id="p1", text="x"))
        await agent.answer_entered.wait()
        runtime.cancel()
    assert seen == ["processing", "idle"]


# ---------------------------------------------------------------- bypassed validation


def bypassed_messages() -> list[tuple[Topic[Any], Any]]:
    """One instance per subscribed topic that skipped validation, each invalid."""
    return [
        (QUERY, UserQuery.model_construct(participant_id=None, text="secret words")),
        (QUERY, UserQuery(participant_id="p2", text="x").model_copy(update={"text": 5})),
        (JOINED, ParticipantJoined.model_construct(participant_id="")),
        (LEFT, ParticipantLeft(participant_id="p3").model_copy(update={"participant_id": 7})),
        (INTERRUPTED, Interrupted.model_construct(participant_id="", bogus=1)),
    ]


def test_topic_revalidates_instances_that_skipped_validation() -> None:
    """coerce() validates payload instances again: bypassed ones raise ValueError."""
    for topic, message in bypassed_messages():
        with pytest.raises(ValueError, match=f"malformed {topic.payload.__name__}") as info:
            topic.coerce(message)
        assert "secret words" not in str(info.value)
    valid = UserQuery.model_construct(participant_id="p", text="fine", message_id="m1",
                                      timestamp_us=5)
    assert QUERY.coerce(valid) == UserQuery(participant_id="p", text="fine", message_id="m1",
                                            timestamp_us=5)


async def test_bypassed_messages_are_counted_and_do_not_disturb_a_turn_in_flight() -> None:
    """Bypassed instances reaching the router are rejected; another turn completes."""
    router, agents, observer = make_router()
    agent = agents["weather"]
    agent.answer_gate = anyio.Event()
    outputs: list[ResponseOutput] = []

    async def collect(message: ResponseOutput) -> None:
        outputs.append(message)

    subscriber = router.runtime_subscriber()
    with anyio.fail_after(10):
        async with AgentRuntime() as runtime:
            runtime.register(subscriber)
            runtime.subscribe(OUTPUT, collect)
            await runtime.publish(QUERY, UserQuery(participant_id="p1", text="rain?"))
            await agent.answer_entered.wait()
            for topic, message in bypassed_messages():  # as a networked runtime delivers
                await subscriber.deliver(topic, message, runtime)
            agent.answer_gate.set()
    assert agent.cancelled == []
    assert [e for e in observer.events if e[0] == "message_rejected"] == [
        ("message_rejected", "q", "invalid"), ("message_rejected", "q", "invalid"),
        ("message_rejected", "j", "invalid"), ("message_rejected", "l", "invalid"),
        ("message_rejected", "i", "invalid")]
    assert [h.user for h in router.history_of("p1")] == ["rain?"]


async def test_publishing_an_own_bypassed_instance_raises_to_the_publisher_only() -> None:
    """publish() raises ContractValueError for its own bypassed instance; nobody sees it."""
    router, agents, observer = make_router()
    agent = agents["weather"]
    agent.answer_gate = anyio.Event()
    seen: list[UserQuery] = []

    async def spy(message: UserQuery) -> None:
        seen.append(message)

    with anyio.fail_after(10):
        async with AgentRuntime() as runtime:
            runtime.register(router.runtime_subscriber())
            runtime.subscribe(QUERY, spy)
            await runtime.publish(QUERY, UserQuery(participant_id="p1", text="rain?"))
            await agent.answer_entered.wait()
            for topic, message in bypassed_messages():
                with pytest.raises(ContractValueError, match="built without validation"):
                    await runtime.publish(topic, message)
            agent.answer_gate.set()
    assert [m.text for m in seen] == ["rain?"]
    assert not [e for e in observer.events if e[0] == "message_rejected"]
    assert agent.count("answer") == 1 and agent.cancelled == []


async def test_plain_callbacks_get_only_valid_payloads(
        caplog: pytest.LogCaptureFixture) -> None:
    """subscribe() callbacks never see invalid messages; each is logged and counted."""
    seen: list[ResponseOutput] = []

    async def collect(message: ResponseOutput) -> None:
        seen.append(message)

    good = ResponseOutput(participant_id="p", request_id="r", route="x", text="hi")
    with caplog.at_level(logging.WARNING, logger="turnrouter.runtime"):
        async with AgentRuntime() as runtime:
            runtime.subscribe(OUTPUT, collect)
            await runtime.publish(OUTPUT, {"participant_id": "p"})
            await runtime.publish(OUTPUT, good.model_dump())
            await runtime.publish(OUTPUT, UserQuery(participant_id="p", text="x"))  # type: ignore[misc]
    assert seen == [good]
    assert runtime.rejected_messages == 2
    assert sum("rejected a message" in r.getMessage() for r in caplog.records) == 2


async def test_lone_surrogate_query_is_rejected_before_any_answer() -> None:
    """A query holding a lone surrogate is rejected and counted; nothing is answered."""
    router, agents, observer = make_router()
    outputs = await publish_and_drain(
        router, OUTPUT, (QUERY, {"participant_id": "p1", "text": "hi \ud800"}),
        (QUERY, UserQuery(participant_id="p2", text="hi \u00e9")))
    assert observer.events.count(("message_rejected", "q", "invalid")) == 1
    assert [c.participant_id for c in agents["weather"].calls if c.method == "answer"] == ["p2"]
    assert [h.user for h in router.history_of("p2")] == ["hi \u00e9"]
    assert outputs == []
    with pytest.raises(ValueError, match="lone surrogate"):
        UserQuery(participant_id="p", text="\udc80")
    with pytest.raises(ContractValueError, match=r"AgentTurn\.query .*lone surrogate"):
        AgentTurn("p", "t", "x\udfff")


# ---------------------------------------------------------------- background work


async def test_background_work_is_drained_on_exit() -> None:
    """Exiting the runtime waits for its background tasks, including ones they start."""
    done: list[str] = []
    gate = anyio.Event()

    async def child() -> None:
        await gate.wait()
        done.append("child")

    async def parent(runtime: AgentRuntime) -> None:
        runtime.start_soon(child)
        done.append("parent")

    with anyio.fail_after(5):
        async with AgentRuntime() as runtime:
            runtime.start_soon(parent, runtime)
            await anyio.wait_all_tasks_blocked()
            gate.set()
    assert done == ["parent", "child"]
    with pytest.raises(LifecycleError, match="not running"):
        runtime.start_soon(child)


async def test_exit_waits_for_tracked_futures_and_cancels_them_on_error() -> None:
    """A tracked future is waited for on exit; a failing body cancels it instead."""
    loop = asyncio.get_running_loop()
    finished = loop.create_future()
    with anyio.fail_after(5):
        async with AgentRuntime() as runtime:
            runtime.track(finished)
            loop.call_soon(finished.set_result, None)
    assert finished.done() and not finished.cancelled()
    forever = loop.create_future()

    async def failing_body() -> None:
        async with AgentRuntime() as runtime:
            runtime.track(forever)
            raise ZeroDivisionError

    with anyio.fail_after(5), pytest.raises(ZeroDivisionError):
        await failing_body()
    assert forever.cancelled()
    with pytest.raises(LifecycleError, match="not running"):
        runtime.track(loop.create_future())


async def test_runtime_departure_failure_is_logged_and_waited_for(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A ParticipantLeft whose release fails is logged once by type; the runtime's exit
    waits for the departure and does not raise."""
    router, agents, _ = make_router()
    agents["weather"].release_error = RuntimeError("secret detail")
    await publish_and_drain(router, OUTPUT, (QUERY, UserQuery(participant_id="p", text="x")))
    agents["weather"].release_gate = anyio.Event()
    with caplog.at_level(logging.WARNING), anyio.fail_after(5):
        async with AgentRuntime() as runtime:
            runtime.register(router.runtime_subscriber())
            await runtime.publish(LEFT, ParticipantLeft(participant_id="p"))
            await agents["weather"].release_entered.wait()
            agents["weather"].release_gate.set()
    # Logged when the departure ended: by the exit, with no await since.
    failures = [r.getMessage() for r in caplog.records if "participant_left" in r.getMessage()]
    assert len(failures) == 1 and "ExceptionGroup" in failures[0]
    assert "secret" not in caplog.text


class _GatedRelease(ScriptedAgent):
    """Releases each participant when its own gate opens; `failing` ones then raise."""

    def __init__(self, name: str, gates: dict[str, anyio.Event], failing: set[str]) -> None:
        super().__init__(name)
        self.gates, self.failing = gates, failing

    async def release(self, participant_id: str) -> None:
        await self.gates[participant_id].wait()
        if participant_id in self.failing:
            raise RuntimeError("hidden detail")


async def test_runtime_exit_waits_for_the_last_of_concurrent_departures(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Departures in flight together and one started after another ended: the runtime's
    exit returns only once the last ended, and each failure is logged once."""
    gates = {pid: anyio.Event() for pid in ("a", "b", "c")}
    router = AgentRouter({"weather": _GatedRelease("weather", gates, {"b"})},
                         ScriptedDecisions("weather"), telemetry=RecordingObserver(),
                         query_topic=QUERY, output_topic=OUTPUT,
                         participant_joined_topic=JOINED, participant_left_topic=LEFT)
    await publish_and_drain(router, OUTPUT, *[
        (QUERY, UserQuery(participant_id=pid, text="x")) for pid in gates])
    exited = anyio.Event()

    async def runtime_body() -> None:
        async with AgentRuntime() as runtime:
            runtime.register(router.runtime_subscriber())
            for pid in ("a", "b"):
                await runtime.publish(LEFT, ParticipantLeft(participant_id=pid))
            await runtime.publish(QUERY, UserQuery(participant_id="c", text="x"))
            gates["a"].set()
            gates["b"].set()
            await anyio.wait_all_tasks_blocked()
            assert set(router.participants) == {"b", "c"}  # b's failed departure is kept
            await runtime.publish(LEFT, ParticipantLeft(participant_id="c"))
        exited.set()

    with caplog.at_level(logging.WARNING), anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(runtime_body)
            await anyio.wait_all_tasks_blocked()
            assert not exited.is_set() and set(router.participants) == {"b", "c"}
            gates["c"].set()
    assert exited.is_set() and set(router.participants) == {"b"}
    failures = [r.getMessage() for r in caplog.records if "participant_left" in r.getMessage()]
    assert len(failures) == 1 and "'b'" in failures[0]
    assert "hidden" not in caplog.text


class _StartsWork:
    """A subscriber that starts one background task per message; records which ran."""

    def __init__(self, topic: Topic[Any]) -> None:
        self.subscriptions = (topic,)
        self.ran: list[str] = []

    async def deliver(self, topic: Topic[Any], message: Any, runtime: AgentRuntime) -> None:
        runtime.start_soon(self._work, message.participant_id)

    async def _work(self, pid: str) -> None:
        self.ran.append(pid)


async def test_a_publish_burst_lets_its_work_run_every_batch() -> None:
    """A publisher that never awaits anything else still lets the work its messages
    started run: at most `publish_batch` of it waits when publish() returns."""
    subscriber = _StartsWork(JOINED)
    waiting: list[int] = []
    with anyio.fail_after(5):
        async with AgentRuntime(publish_batch=4) as runtime:
            runtime.register(subscriber)
            for n in range(1, 11):
                await runtime.publish(JOINED, ParticipantJoined(participant_id=f"p{n}"))
                waiting.append(n - len(subscriber.ran))
            assert subscriber.ran == [f"p{n}" for n in range(1, 8)]
    assert max(waiting) == 4 and min(waiting) == 1
    assert len(subscriber.ran) == 10


async def test_a_publisher_cancelled_at_its_scheduling_point_delivers_nothing() -> None:
    """The yielding publish() of a cancelled publisher raises the cancellation before
    any subscriber sees its message; the others were delivered."""
    subscriber = _StartsWork(JOINED)
    with anyio.fail_after(5):
        async with AgentRuntime(publish_batch=2) as runtime:
            runtime.register(subscriber)
            await runtime.publish(JOINED, ParticipantJoined(participant_id="first"))
            with anyio.CancelScope() as scope:
                scope.cancel()
                await runtime.publish(JOINED, ParticipantJoined(participant_id="second"))
            assert scope.cancelled_caught
            await runtime.publish(JOINED, ParticipantJoined(participant_id="third"))
    assert subscriber.ran == ["first", "third"]


def _waits_until_cancelled(
    cancelled: anyio.Event,
) -> Callable[[], Coroutine[Any, Any, None]]:
    """Background work that waits forever and sets `cancelled` when it is cancelled."""

    async def waits() -> None:
        try:
            await anyio.sleep_forever()
        finally:
            cancelled.set()

    return waits


async def test_a_background_failure_cancels_the_rest_and_is_raised() -> None:
    """As in a task group: one failing task cancels the others; the exit raises it."""
    cancelled = anyio.Event()
    waits = _waits_until_cancelled(cancelled)

    async def fails() -> None:
        raise KeyError("boom")

    async def run() -> None:
        async with AgentRuntime() as runtime:
            runtime.start_soon(waits)
            await anyio.wait_all_tasks_blocked()
            runtime.start_soon(fails)

    with anyio.fail_after(5), pytest.raises(BaseExceptionGroup) as caught:
        await run()
    assert caught.group_contains(KeyError)
    assert cancelled.is_set()


async def test_an_error_in_the_body_cancels_background_work() -> None:
    """The body's own error cancels the background tasks and propagates."""
    cancelled = anyio.Event()
    waits = _waits_until_cancelled(cancelled)

    async def run() -> None:
        async with AgentRuntime() as runtime:
            runtime.start_soon(waits)
            await anyio.wait_all_tasks_blocked()
            raise ValueError("body")

    with anyio.fail_after(5), pytest.raises(ValueError, match="body"):
        await run()
    assert cancelled.is_set()


async def test_a_cancelled_exit_still_waits_for_background_work() -> None:
    """Cancelling the exit cancels the background work, waits for it, then propagates."""
    finished = anyio.Event()

    async def slow_cleanup() -> None:
        try:
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.lowlevel.checkpoint()
            finished.set()

    with anyio.fail_after(5):
        with anyio.CancelScope() as scope:
            async with AgentRuntime() as runtime:
                runtime.start_soon(slow_cleanup)
                await anyio.wait_all_tasks_blocked()
                scope.cancel()
        assert scope.cancelled_caught
    assert finished.is_set()


def test_a_validated_message_is_delivered_without_validating_again() -> None:
    """coerce returns a constructed (validated) message itself; a bypassed one is new."""
    query = UserQuery(participant_id="p1", text="hi")
    assert QUERY.coerce(query) is query
    bypassed = UserQuery.model_construct(participant_id="p1", text="other", message_id="m",
                                         timestamp_us=1)
    assert QUERY.coerce(bypassed) is not bypassed
    broken = UserQuery.model_construct(participant_id="", text="x", message_id="m",
                                       timestamp_us=1)
    with pytest.raises(ValueError, match="malformed"):
        QUERY.coerce(broken)


@pytest.mark.parametrize(("field", "junk"), [
    ("text", None), ("participant_id", 7), ("participant_id", ["p"]),
    ("participant_id", "p" * 1_000_000), ("timestamp_us", -1)])
def test_a_validated_message_changed_afterwards_is_validated_again(
        field: str, junk: object) -> None:
    """A message whose field was changed after its validation (`object.__setattr__`
    on the frozen model) is not known valid by its identity any more: coerce validates
    it again and refuses it, naming the field (bounds17 H1: it went through, and the
    subscriber's contract error cancelled every turn of the runtime)."""
    query = UserQuery(participant_id="p1", text="hi")
    object.__setattr__(query, field, junk)
    with pytest.raises(ValueError, match=f"malformed UserQuery: {field}"):
        QUERY.coerce(query)


async def test_a_query_changed_after_it_was_published_is_rejected_where_it_lands(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A publisher that changes its query (`object.__setattr__`) after `publish()`,
    before the query's task runs: the subscriber rejects it (counted, logged) and the
    other participants' turns run on; before, its `AgentTurn`'s contract error was
    raised in the runtime's task, which cancelled every turn in flight (bounds17 H1)."""
    router, agents, observer = make_router()
    changed = UserQuery(participant_id="p1", text="hi")
    with caplog.at_level(logging.WARNING, logger="turnrouter.runtime"):
        async with AgentRuntime() as runtime:
            runtime.register(router.runtime_subscriber())
            await runtime.publish(QUERY, UserQuery(participant_id="p0", text="one"))
            await runtime.publish(QUERY, changed)
            await runtime.publish(QUERY, UserQuery(participant_id="p2", text="two"))
            object.__setattr__(changed, "text", None)  # before its task started
        await router.stop()
    assert observer.events.count(("message_rejected", "q", "invalid")) == 1
    answered = [c.participant_id for c in agents["weather"].calls if c.method == "answer"]
    assert sorted(answered) == ["p0", "p2"]
    assert sum("(rejected) failed" in r.getMessage() for r in caplog.records) == 1


async def test_publishing_a_message_changed_after_validation_raises_naming_it() -> None:
    """The publisher's own instance, changed after validation, raises
    `ContractValueError` in `publish()` (as a `model_construct()` one does), before any
    subscriber sees it; the runtime and its other turns go on."""
    router, agents, _ = make_router()
    bad = UserQuery(participant_id="p1", text="t")
    object.__setattr__(bad, "text", None)
    async with AgentRuntime() as runtime:
        runtime.register(router.runtime_subscriber())
        await runtime.publish(QUERY, UserQuery(participant_id="p0", text="one"))
        with pytest.raises(ContractValueError, match="text"):
            await runtime.publish(QUERY, bad)
    await router.stop()
    assert [c.participant_id for c in agents["weather"].calls if c.method == "answer"] == ["p0"]


def test_publication_ids_are_unique_hex_unguessable_and_fresh_in_a_forked_child() -> None:
    """Message ids are 32 hex digits, never repeat, share no part with the ids before
    them (a process prefix and a counter let a front end sharing the NATS user publish
    another's next ids first: redteam16 F3), and a forked child's are its own."""
    ids = [UserQuery(participant_id="p", text="x").message_id for _ in range(5000)]
    ids += [ParticipantJoined(participant_id="p").message_id for _ in range(5000)]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"[0-9a-f]{32}", message_id) for message_id in ids)
    assert len({message_id[:16] for message_id in ids}) == len(ids)  # no shared prefix
    assert len({message_id[16:] for message_id in ids}) == len(ids)
    context = multiprocessing.get_context("fork")
    parent, child = context.Pipe()
    process = context.Process(target=_send_an_id, args=(child,), daemon=True)
    process.start()
    try:
        assert parent.poll(30), "the forked child sent no id"
        forked = parent.recv()
    finally:
        process.join(timeout=30)
    assert isinstance(forked, str) and len(forked) == 32
    assert forked[:16] != ids[0][:16]  # another prefix, not the parent's counter continued
    assert forked not in ids


def _send_an_id(connection: Any) -> None:
    connection.send(UserQuery(participant_id="p", text="x").message_id)
    connection.close()


def test_a_dict_of_many_unknown_keys_is_refused_naming_the_first_few() -> None:
    """Unknown keys are found before pydantic lists an error for each (a 1 MB dict of
    90,000 of them took 200-400 ms to refuse, past the loop's 100 ms bound: bounds17
    M4): the first five are named, bounded, with how many more; values never shown."""
    message: dict[Any, Any] = {"participant_id": "p", "text": "secret words"}
    message.update({f"k{i}": "secret value" for i in range(90_000)})
    message[("a", 1)] = 0  # not a str: shown bounded too
    with pytest.raises(ValueError, match=r"k0: Extra inputs are not permitted") as refused:
        QUERY.coerce(message)
    text = str(refused.value)
    assert "(+89996 more)" in text and "secret" not in text and len(text) < 600
