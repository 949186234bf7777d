"""Inputs on the wire against real worker processes: junk, lifecycle, interrupts."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from email.header import Header, decode_header
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace import TracerProvider

import nats
from turnrouter import ContractValueError
from turnrouter.runtime import (
    Interrupted,
    ParticipantJoined,
    ParticipantLeft,
    ResponseOutput,
    UserQuery,
)
from turnrouter.runtime.nats import NatsConfig, NatsFrontEnd, encode_token

from .conftest import NatsServer, Worker, metric_value
from .crowd import FAILURE, Heard, ask, listening, serving

SAMPLE_FLOOR = 8  # docs/distributed.md: a publisher's samples always learned per window

pytestmark = pytest.mark.anyio


@pytest.fixture
def worker(nats_server: NatsServer) -> Iterator[Worker]:
    w = Worker(nats_server.url, "solo")
    try:
        yield w
    finally:
        w.close()


@pytest.fixture
async def front(nats_server: NatsServer) -> AsyncIterator[tuple[NatsFrontEnd, Heard]]:
    """A front end and everything the output stream delivered (all routes)."""
    async with listening(nats_server.url) as pair:
        yield pair


async def counted(worker: Worker, name: str, labels: str, goal: float) -> None:
    for _ in range(100):  # polling the worker's /metrics: at most 10 s
        if await asyncio.to_thread(
                lambda: metric_value(worker.metrics(), name, labels)) >= goal:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{name}{{{labels}}} never reached {goal}")


async def test_bad_input_is_rejected_counted_and_disturbs_nothing(
        nats_server: NatsServer, worker: Worker,
        front: tuple[NatsFrontEnd, Heard]) -> None:
    """Unknown kinds, oversized, malformed, non-UTF-8, mismatched and badly named
    inputs are refused and counted by reason; the next query is answered."""
    fe, heard = front
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    ann = encode_token("ann")
    try:
        for subject, data in [
            (f"turnrouter.in.{ann}.bogus", b"{}"),
            (f"turnrouter.in.{ann}.query", b"x" * (64 * 1024 + 10)),
            (f"turnrouter.in.{ann}.query", b"{not json"),
            (f"turnrouter.in.{ann}.query", b"\xff\xfe\x00"),
            (f"turnrouter.in.{ann}.query", b'{"participant_id":"bob","text":"hi"}'),
            ("turnrouter.in.%%%.query", b'{"participant_id":"ann","text":"hi"}'),
        ]:
            await js.publish(subject, data)
    finally:
        await nc.close()
    name = "turnrouter_runtime_rejected_messages_total"
    await counted(worker, name, 'reason="unknown_subject"', 1)
    await counted(worker, name, 'reason="oversized"', 1)
    await counted(worker, name, 'reason="invalid"', 4)
    assert await ask(fe, heard, "ann", "hello") == "hello|-|N"
    assert await ask(fe, heard, "ann", "again") == "again|hello|F"


async def test_a_query_too_big_for_the_workers_ends_with_the_failure_text(
        nats_server: NatsServer, worker: Worker) -> None:
    """A front end whose `max_message_bytes` exceeds the workers' (its own check lets a
    66 KB query through, the stream stores it) hears the failure text as that turn's
    final output, counted `oversized`; the participant's next query is answered. Before,
    the worker refused it unread and the turn never ended."""
    config = NatsConfig(url=nats_server.url, max_message_bytes=131_072)
    async with listening(config) as (loose, heard):
        big = UserQuery(participant_id="gus", text="x" * 66_000)
        event = heard.events.setdefault(big.message_id, asyncio.Event())
        await loose.publish(big)
        async with asyncio.timeout(15):
            await event.wait()
        assert [(o.text, o.final) for o in heard.finals[big.message_id]] == [(FAILURE, True)]
        await counted(worker, "turnrouter_runtime_rejected_messages_total",
                      'reason="oversized"', 1)
        assert await ask(loose, heard, "gus", "next") == "next|-|N"


async def test_departure_and_rejoin_travel_in_order(
        worker: Worker, front: tuple[NatsFrontEnd, Heard]) -> None:
    """left then joined then a query, published back to back, arrive in that order: the
    query is served, and the departure released the participant's state."""
    fe, heard = front
    assert await ask(fe, heard, "cy", "one") == "one|-|N"
    await fe.publish(ParticipantLeft(participant_id="cy"))
    await fe.publish(ParticipantJoined(participant_id="cy"))
    assert await ask(fe, heard, "cy", "two") == "two|-|N"


async def test_interrupts_reach_the_owner_and_everyone(
        nats_server: NatsServer, front: tuple[NatsFrontEnd, Heard]) -> None:
    """A participant's interrupt ends their running turn on its owner; a global
    interrupt ends every running turn on every replica; history stays consistent."""
    fe, heard = front
    workers = [Worker(nats_server.url, f"i{n}") for n in range(2)]
    try:
        pids = [f"p{i}" for i in range(8)]
        for pid in pids:
            assert await ask(fe, heard, pid, "hi") == "hi|-|N"
        started = [UserQuery(participant_id=pid, text="slow") for pid in pids]
        for query in started:
            await fe.publish(query)
        async with asyncio.timeout(15):
            for query in started:  # every slow turn said its preamble: it is running
                await heard.events.setdefault(f"started {query.message_id}",
                                              asyncio.Event()).wait()
        await fe.publish(Interrupted(participant_id="p0"))
        await fe.publish(Interrupted())
        name = "turnrouter_turns_total"
        total = 0.0
        for _ in range(100):  # polling the workers' /metrics: at most 10 s
            total = sum(metric_value(w.metrics(), name, 'outcome="interrupted"')
                        for w in workers)
            if total >= len(pids):
                break
            await asyncio.sleep(0.1)
        assert total == len(pids)
        for pid in pids:
            assert await ask(fe, heard, pid, "next") == "next|hi|F"
        assert [heard.finals.get(q.message_id) for q in started] == [None] * len(pids)
    finally:
        for w in workers:
            w.close()


async def test_timing_samples_reach_every_replica(
        nats_server: NatsServer, front: tuple[NatsFrontEnd, Heard]) -> None:
    """Each replica's first-response samples are learned by every other replica, each
    publisher's within its share (all of them up to the floor of 8 per window), once
    it hears that publisher on presence (before, they are refused as
    `unknown_publisher`: the test asked at once, and a replica's first samples were
    refused in about one run of ten)."""
    fe, heard = front
    workers = [Worker(nats_server.url, f"t{n}") for n in range(2)]
    try:
        for _ in range(100):  # polling the workers' /metrics: at most 10 s
            if all(metric_value(w.metrics(), "turnrouter_nats_fleet_replicas") >= 2
                   for w in workers):
                break
            await asyncio.sleep(0.1)
        for i in range(16):
            assert await ask(fe, heard, f"s{i}", "hi") == "hi|-|N"
        name = "turnrouter_nats_timing_samples_total"
        for _ in range(100):  # polling the workers' /metrics: at most 10 s
            sent = [metric_value(w.metrics(), name, 'direction="sent"') for w in workers]
            got = [metric_value(w.metrics(), name, 'direction="received"') for w in workers]
            if sum(sent) >= 16 and all(
                    min(s, SAMPLE_FLOOR) <= g for s, g in zip(sent[::-1], got, strict=True)):
                break
            await asyncio.sleep(0.1)
        assert sum(sent) >= 16
        for other_sent, received in zip(sent[::-1], got, strict=True):
            assert min(other_sent, SAMPLE_FLOOR) <= received <= other_sent
    finally:
        for w in workers:
            w.close()


async def test_example_app_serves_a_deployment(
        nats_server: NatsServer, front: tuple[NatsFrontEnd, Heard]) -> None:
    """The factory the deployment files run answers through a real worker."""
    fe, _ = front
    worker = Worker(nats_server.url, "ex", app="turnrouter.runtime.nats.example:make_router")
    try:
        query = UserQuery(participant_id="dee", text="hello")
        outputs = fe.outputs(deliver_new=False)
        await fe.publish(query)
        async with asyncio.timeout(15):
            async for message in outputs:
                if message.request_id == query.message_id:
                    assert (message.route, message.text) == ("echo", "you said: hello")
                    break
        await outputs.aclose()
    finally:
        worker.close()


async def answer_trace_of(fe: NatsFrontEnd, heard: Heard, query: UserQuery) -> tuple[str, str]:
    """Publish `query` and wait for its one final answer: its trace id and span id."""
    event = heard.events.setdefault(query.message_id, asyncio.Event())
    await fe.publish(query)
    async with asyncio.timeout(15):
        await event.wait()
    (answer,) = heard.finals[query.message_id]
    assert answer.traceparent is not None
    _, trace_id, span_id, _ = answer.traceparent.split("-")
    return trace_id, span_id


async def test_trace_continues_from_publisher_to_output(
        nats_server: NatsServer, front: tuple[NatsFrontEnd, Heard]) -> None:
    """W3C context in the NATS headers: the answer carries the publisher's trace id, in
    a span of the replica's turn (a different span id)."""
    fe, heard = front
    worker = Worker(nats_server.url, "tr", env={"TR_TEST_TRACING": "1"})
    try:
        trace_id, span_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
        query = UserQuery(participant_id="eve", text="hi",
                          traceparent=f"00-{trace_id}-{span_id}-01")
        answer_trace, answer_span = await answer_trace_of(fe, heard, query)
        assert answer_trace == trace_id
        assert answer_span != span_id
    finally:
        worker.close()


@pytest.mark.parametrize("traceparent", [
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",   # valid: travels on
    "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",   # version ff
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",   # all-zero trace id
    "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",   # all-zero parent id
])
async def test_only_a_valid_trace_context_travels_to_the_outputs(
        nats_server: NatsServer, front: tuple[NatsFrontEnd, Heard], traceparent: str) -> None:
    """A query's W3C context (in its headers, or in its body) travels to its answer's
    headers only when valid: version ff and all-zero ids are invalid (W3C Trace
    Context) and were copied verbatim (redteam9 N4)."""
    fe, _ = front
    # The example app's destination returns its text: the worker publishes it with the
    # query's own context (not through the tracer, which drops an invalid one).
    worker = Worker(nats_server.url, "tr", "--app-dir", "examples", app="nats_app:make_router")
    nc = await nats.connect(nats_server.url)
    try:
        said = await nc.subscribe(f"{NatsConfig().prefix}.out.>")
        valid = traceparent.startswith("00-4bf") and traceparent[36:52].strip("0") != ""
        for how in ("headers", "body"):
            query = UserQuery(participant_id="eve", text="will it rain?",
                              traceparent=traceparent if how == "body" else None)
            await fe.publish(query, headers={"traceparent": traceparent}
                             if how == "headers" else None)
            async with asyncio.timeout(15):
                while True:  # this query's answer, as published
                    msg = await said.next_msg(timeout=15)
                    answer = ResponseOutput.model_validate_json(msg.data)
                    if answer.request_id == query.message_id and answer.final:
                        break
            expected = traceparent if valid else None
            assert (msg.headers or {}).get("traceparent") == expected, how
            assert answer.traceparent == expected, how
    finally:
        await nc.close()
        worker.close()


async def test_a_publish_inside_a_span_continues_that_trace(
        nats_server: NatsServer, front: tuple[NatsFrontEnd, Heard]) -> None:
    """`publish()` inside the caller's current span (and the message carrying no trace
    context of its own) sends that span's context: the replica's turn continues the
    publisher's trace, as an instrumented messaging client does. Before, the turn
    started a trace of its own unless the caller filled `traceparent` by hand."""
    fe, heard = front
    worker = Worker(nats_server.url, "tr", env={"TR_TEST_TRACING": "1"})
    provider = TracerProvider()  # a local SDK provider: the global one is never set
    try:
        with provider.get_tracer("front").start_as_current_span("user speaks") as span:
            answer_trace, answer_span = await answer_trace_of(
                fe, heard, UserQuery(participant_id="ivy", text="hi"))
        context = span.get_span_context()
        assert answer_trace == f"{context.trace_id:032x}"
        assert answer_span != f"{context.span_id:016x}"
    finally:
        worker.close()
        provider.shutdown()


async def test_a_retried_publish_runs_once(
        worker: Worker, front: tuple[NatsFrontEnd, Heard]) -> None:
    """Publishing the same message twice (a publisher's retry) runs one turn."""
    fe, heard = front
    query = UserQuery(participant_id="fay", text="hi")
    event = heard.events.setdefault(query.message_id, asyncio.Event())
    await fe.publish(query)
    await fe.publish(query)
    async with asyncio.timeout(15):
        await event.wait()
    assert await ask(fe, heard, "fay", "next") == "next|hi|F"
    assert metric_value(worker.metrics(), "turnrouter_turns_total") == 2


async def test_a_publish_that_cannot_run_is_refused_up_front(
        nats_server: NatsServer, worker: Worker, front: tuple[NatsFrontEnd, Heard]) -> None:
    """`publish` refuses, publishing nothing, what would leave a turn that never ends: a
    query over `max_message_bytes` (workers refuse it), a `Nats-*` header (a caller's
    `Nats-Msg-Id` would replace the participant-scoped one, and the stream would drop
    another participant's query as its duplicate), and a message the server refuses for
    good (a larger bound than the stream's: a retry would be refused again, so it is not
    the `LifecycleError` that says to publish again). Headers of the caller's own travel."""
    fe, heard = front
    with pytest.raises(ContractValueError, match="max_message_bytes"):
        await fe.publish(UserQuery(participant_id="gus", text="x" * 66_000))
    victim = UserQuery(participant_id="hal", text="mine")
    with pytest.raises(ContractValueError, match="Nats-"):
        await fe.publish(UserQuery(participant_id="gus", text="hi"),
                         headers={"Nats-Msg-Id": f"{encode_token('hal')}.{victim.message_id}"})
    loose = await NatsFrontEnd.connect(NatsConfig(url=nats_server.url,
                                                  max_message_bytes=200_000))
    try:
        with pytest.raises(ContractValueError, match="refused by the server"):
            await loose.publish(UserQuery(participant_id="gus", text="x" * 100_000))
    finally:
        await loose.close()
    event = heard.events.setdefault(victim.message_id, asyncio.Event())
    await fe.publish(victim, headers={"X-Request-Id": "r-1"})
    async with asyncio.timeout(15):
        await event.wait()
    assert [o.text for o in heard.finals[victim.message_id]] == ["mine|-|N"]
    assert await ask(fe, heard, "gus", "next") == "next|-|N"
    assert metric_value(worker.metrics(), "turnrouter_runtime_rejected_messages_total") == 0


@pytest.mark.parametrize("value", ["a\u0085b", "a\u009bb", "a\u2028b", "a\u2029b", "a\x7fb"])
async def test_a_header_value_with_a_control_character_past_ascii_is_refused(
        nats_server: NatsServer, value: str) -> None:
    """C1 control characters and the Unicode line separators are control characters too:
    refused, naming the header, nothing published (redteam7 D6: only C0 and DEL were)."""
    front = await NatsFrontEnd.connect(NatsConfig(url=nats_server.url, partitions=1))
    try:
        with pytest.raises(ContractValueError, match="X-Call"):
            await front.publish(UserQuery(participant_id="cc", text="hi"),
                                headers={"X-Call": value})
        await front.publish(UserQuery(participant_id="cc", text="hi"),
                            headers={"X-Call": "caf\u00e9 \u00a0ok"})  # other text passes
    finally:
        await front.close()


HEADER_TEXT = st.text(st.sampled_from("aZ09-_.:!#~ \t\r\n\x00\x7fü\u2028\ud800@/"), max_size=8)


@pytest.mark.parametrize("status", ["408", "409", "100", "503"])
async def test_a_query_with_a_status_header_of_its_own_is_answered(
        worker: Worker, front: tuple[NatsFrontEnd, Heard], status: str) -> None:
    """An application header named `Status` (a call status, say) travels with its query
    like any other header: the query is answered and its partition goes on. The worker
    took such a message for the server's reply to its pull request: never run, never
    acknowledged, it came back for ever and every participant of that partition went
    unanswered, across restarts (redteam7 D1)."""
    fe, heard = front
    query = UserQuery(participant_id="sam", text="with a status")
    event = heard.events.setdefault(query.message_id, asyncio.Event())
    await fe.publish(query, headers={"Status": status, "Description": "on a call"})
    async with asyncio.timeout(15):
        await event.wait()
    assert heard.finals[query.message_id][0].text == "with a status|-|N"
    assert (await ask(fe, heard, "sam", "next")).startswith("next|")  # same partition


async def test_an_output_with_a_status_header_does_not_stall_a_reader(
        nats_server: NatsServer) -> None:
    """A message on an output subject carrying a `Status` header (anyone may publish
    there on a server without the shipped permissions) is read as a message: a valid
    output is delivered, the reader goes on to the next. It was taken for the consumer's
    status and the reader recreated its consumer at that message, for ever."""
    async with listening(nats_server.url) as (_, heard):
        nc = await nats.connect(nats_server.url)
        try:
            subject = f"turnrouter.out.{encode_token('ola')}"
            for request_id, status in (("r1", "409"), ("r2", None)):
                body = ResponseOutput(participant_id="ola", request_id=request_id,
                                      route="echo", text=f"t-{request_id}", final=True)
                headers = {"Status": status} if status else None
                await nc.publish(subject, body.model_dump_json().encode(), headers=headers)
            for request_id in ("r1", "r2"):
                event = heard.events.setdefault(request_id, asyncio.Event())
                async with asyncio.timeout(15):
                    await event.wait()
                assert heard.finals[request_id][0].text == f"t-{request_id}"
        finally:
            await nc.close()


def _text(value: object) -> object:
    """A header value as stored: nats-py's reader (an email parser) gives a non-ASCII
    value as an `email.header.Header` of its UTF-8 bytes."""
    if isinstance(value, Header):
        return b"".join(part if isinstance(part, bytes) else part.encode()
                        for part, _ in decode_header(value)).decode()
    return value


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.one_of(HEADER_TEXT, st.just("x" * 300), st.integers()),
                       st.one_of(HEADER_TEXT, st.just("v" * 3000), st.none(), st.integers()),
                       max_size=4))
@example({"0": "\u00fc"})  # non-ASCII text is carried as UTF-8
def test_any_extra_headers_are_published_as_given_or_refused_naming_them(
        nats_server: NatsServer, headers: dict[Any, Any]) -> None:
    """Whatever `publish(headers=...)` is given (names with spaces, colons, control or
    non-ASCII characters, values that are not text or hold CR/LF or NUL, too many bytes):
    a `ContractValueError` naming the header, nothing published, or the message stored
    with exactly those headers. Before, a name NATS cannot carry was a `LifecycleError`
    (which says: publish again, for ever) and a None value an `AttributeError`."""

    async def publish() -> None:
        front = await NatsFrontEnd.connect(NatsConfig(url=nats_server.url, partitions=1))
        try:
            js = front.connection.jetstream()
            before = (await js.stream_info("TURNROUTER_IN")).state.messages
            message = ParticipantJoined(participant_id="hdr")
            refused: ContractValueError | None = None
            try:
                await front.publish(message, headers=headers)
            except ContractValueError as exc:
                refused = exc
            if refused is not None:
                assert "header" in str(refused)
                assert (await js.stream_info("TURNROUTER_IN")).state.messages == before
                return
            stored = await js.get_last_msg(
                "TURNROUTER_IN", f"turnrouter.p.0.{encode_token('hdr')}.joined")
            assert {k: _text(v) for k, v in (stored.headers or {}).items()
                    if k != "Nats-Msg-Id"} == headers
        finally:
            await front.close()

    asyncio.run(publish())


async def test_a_turn_a_previous_owner_left_ends_in_the_publishers_trace(
        nats_server: NatsServer) -> None:
    """A query a previous owner received and never acknowledged (it died) comes back as
    delivery 2 and ends with the failure text unrun; that text carries the publisher's
    trace context, so the trace shows how the turn ended (before: no context at all)."""
    config = NatsConfig(url=nats_server.url, partitions=1)
    async with serving(config, "first"):
        pass  # the deployment (streams, the partition's consumer), then a graceful end
    nc = await nats.connect(nats_server.url)
    try:
        async with listening(config) as (front, heard):
            trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
            query = UserQuery(participant_id="orphan", text="hi",
                              traceparent=f"00-{trace_id}-00f067aa0ba902b7-01")
            event = heard.events.setdefault(query.message_id, asyncio.Event())
            await front.publish(query)
            # A previous owner: pulls it (the pinned client now) and never acknowledges.
            taken = await nc.subscribe(nc.new_inbox())
            await nc.publish(
                f"$JS.API.CONSUMER.MSG.NEXT.{config.stream}.{config.consumer(0)}",
                json.dumps({"batch": 1, "expires": 2_000_000_000,
                            "group": "turnrouter"}).encode(), reply=taken.subject)
            first = await taken.next_msg(timeout=10)
            assert first.data and not (first.headers or {}).get("Status")
            async with serving(config, "second"), asyncio.timeout(30):
                await event.wait()
            (final,) = heard.finals[query.message_id]
            assert final.text == FAILURE
            assert final.traceparent is not None
            assert final.traceparent.split("-")[1] == trace_id
    finally:
        await nc.close()


async def test_departures_and_interrupts_of_strangers_leave_no_record(
        nats_server: NatsServer, front: tuple[NatsFrontEnd, Heard]) -> None:
    """`joined`, `left` and `interrupt` messages of participants nobody ever served
    write no record (a front end's flood of made-up ids left one each in the bucket, for good);
    a participant who talked still departs and is recorded as departed, and the next
    session starts fresh."""
    fe, heard = front
    worker = Worker(nats_server.url, "keeper")
    try:
        assert (await ask(fe, heard, "ann", "one")).startswith("one|")
        js = fe.connection.jetstream()
        stream = f"KV_{NatsConfig().bucket}"
        before = (await js.stream_info(stream)).state.messages
        for i in range(20):
            await fe.publish(ParticipantLeft(participant_id=f"stranger-{i}"))
            await fe.publish(Interrupted(participant_id=f"nobody-{i}"))
            await fe.publish(ParticipantJoined(participant_id=f"newcomer-{i}"))
        await fe.publish(ParticipantLeft(participant_id="ann"))
        # The departure is recorded (ann's record rewritten: still one message of hers).
        await fe.publish(ParticipantJoined(participant_id="ann"))
        assert await ask(fe, heard, "ann", "two") == "two|-|N"  # a fresh session
        assert (await js.stream_info(stream)).state.messages == before
        counts = worker.metrics()
        assert metric_value(counts, "turnrouter_runtime_rejected_messages_total") == 0
    finally:
        worker.close()


async def test_a_header_name_that_is_not_text_is_refused_for_that(
        front: tuple[NatsFrontEnd, Heard]) -> None:
    """A header name that is not a `str` is refused saying so, not with the reason for
    `Nats-*` names (redteam9 N5)."""
    fe, _ = front
    with pytest.raises(ContractValueError, match="header names are str, got int") as caught:
        await fe.publish(ParticipantJoined(participant_id="hdr"),
                         headers={5: "x"})  # type: ignore[dict-item]
    assert "Nats-" not in str(caught.value)


async def test_a_decoy_carrying_another_participants_id_is_refused_and_counted(
        nats_server: NatsServer, worker: Worker,
        front: tuple[NatsFrontEnd, Heard]) -> None:
    """A publisher on its own participant's subject takes another participant's known
    next id (`<token(vic)>.turn-1`, redteam18 F7): the stream then drops vic's `turn-1`
    (raised by `publish`), and the decoy itself is refused by the worker as
    `foreign_id`, counted, its turn never run, so the attempt shows on the dashboards.
    The publisher's own participant is served as before."""
    fe, heard = front
    decoy = UserQuery(participant_id="mallory", text="decoy")
    await fe.connection.jetstream().publish(
        f"turnrouter.in.{encode_token('mallory')}.query", decoy.model_dump_json().encode(),
        headers={"Nats-Msg-Id": f"{encode_token('vic')}.turn-1"})
    with pytest.raises(ContractValueError, match="did not publish"):
        await fe.publish(UserQuery(participant_id="vic", text="mine", message_id="turn-1"))
    await counted(worker, "turnrouter_runtime_rejected_messages_total",
                  'reason="foreign_id",topic="nats_input"', 1)
    # The partition delivers in order: mallory's next turn comes after the decoy.
    assert await ask(fe, heard, "mallory", "next") == "next|-|N"
    assert decoy.message_id not in heard.finals
    assert await ask(fe, heard, "vic", "again") == "again|-|N"


async def test_a_decoy_without_a_nats_msg_id_is_refused_and_takes_no_turn(
        nats_server: NatsServer, worker: Worker,
        front: tuple[NatsFrontEnd, Heard]) -> None:
    """redteam22 F1: a query published on vic's subject with vic's next id (`turn-1`)
    and no `Nats-Msg-Id` at all ran as vic's turn: vic's real `turn-1` was then dropped
    as already ended (its `publish` returning normally) and vic heard the decoy's answer
    as their own, its exchange in their history. Now the worker refuses it as
    `foreign_id`; vic's own `turn-1` is answered, with a history of its own."""
    fe, heard = front
    decoy = UserQuery(participant_id="vic", text="decoy", message_id="turn-1")
    await fe.connection.publish(f"turnrouter.in.{encode_token('vic')}.query",
                                decoy.model_dump_json().encode())
    await counted(worker, "turnrouter_runtime_rejected_messages_total",
                  'reason="foreign_id",topic="nats_input"', 1)
    mine = UserQuery(participant_id="vic", text="mine", message_id="turn-1")
    event = heard.events.setdefault(mine.message_id, asyncio.Event())
    await fe.publish(mine)
    async with asyncio.timeout(15):
        await event.wait()
    assert [o.text for o in heard.finals["turn-1"]] == ["mine|-|N"]
    assert await ask(fe, heard, "vic", "again") == "again|mine|F"


@pytest.mark.parametrize("message_id", ["t-2 ", "t-3\t", "t-5\r\nNats-Expected-Stream: x",
                                        "t-6\nx", "t-7\rx", "t-12\u2028", " "])
async def test_a_message_id_a_header_cannot_carry_is_refused_at_publish(
        worker: Worker, front: tuple[NatsFrontEnd, Heard], message_id: str) -> None:
    """redteam22 F2: nats-py strips a header value and flattens CR/LF, so a message id
    with whitespace at its end, CR or LF reached the workers as another id than the
    stream's: `publish` returned, the turn was refused as `foreign_id` and never ended.
    Now `publish` raises, naming the id, before anything is sent; ids with inner spaces,
    tabs or non-ASCII text go as before."""
    fe, heard = front
    for kind in (UserQuery(participant_id="ida", text="hi", message_id=message_id),
                 Interrupted(participant_id="ida", message_id=message_id)):
        with pytest.raises(ContractValueError, match="a NATS header cannot carry it"):
            await fe.publish(kind)
    assert await ask(fe, heard, "ida", "fine") == "fine|-|N"
    for fine in ("t 1", "t\t1", "tür-1"):
        query = UserQuery(participant_id="ida", text="ok", message_id=fine)
        event = heard.events.setdefault(fine, asyncio.Event())
        await fe.publish(query)
        async with asyncio.timeout(15):
            await event.wait()


async def _raw_publish(port: int, subject: str, headers: str, body: bytes) -> None:
    """Publish as a raw NATS client (header bytes nats-py would normalise)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        await reader.readline()  # INFO
        head = f"NATS/1.0\r\n{headers}\r\n\r\n".encode()
        writer.write(b'CONNECT {"verbose":false,"pedantic":false,"headers":true}\r\n'
                     + f"HPUB {subject} {len(head)} {len(head) + len(body)}\r\n".encode()
                     + head + body + b"\r\nPING\r\n")
        await writer.drain()
        async with asyncio.timeout(10):
            while (await reader.readline()).strip() != b"PONG":
                pass
    finally:
        writer.close()


async def test_an_oversized_decoy_naming_a_running_turn_does_not_end_it(
        nats_server: NatsServer, worker: Worker,
        front: tuple[NatsFrontEnd, Heard]) -> None:
    """redteam22 F3: an oversized query whose `Nats-Msg-Id` named another participant's
    running turn (with a trailing space, so the stream took it for a new id, while the
    worker read it stripped) ended that turn with the failure text; its real answer went
    unheard but into the history. Now the refusal says nothing for a turn running (or
    ended) there: the turn goes on, and its participant's next query interrupts it as
    usual."""
    fe, heard = front
    running = UserQuery(participant_id="vic", text="slow one")
    started = heard.events.setdefault(f"started {running.message_id}", asyncio.Event())
    await fe.publish(running)
    async with asyncio.timeout(15):
        await started.wait()
    token = encode_token("vic")
    await _raw_publish(nats_server.port, f"turnrouter.in.{token}.query",
                       f"Nats-Msg-Id: {token}.{running.message_id} ", b"x" * 66_000)
    await counted(worker, "turnrouter_runtime_rejected_messages_total",
                  'reason="oversized"', 1)
    # The partition runs in order: the decoy was handled before this query.
    assert await ask(fe, heard, "vic", "next") == "next|-|N"  # (it cut the slow turn)
    assert running.message_id not in heard.finals
