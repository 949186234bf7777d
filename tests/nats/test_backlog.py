"""A backlog in the input stream: a query that waited longer than `max_input_wait` is
answered with the router's busy text instead of being run.

The age is made certain without sleeping: the backlog is published while no worker
runs, then a worker whose `max_input_wait` is a microsecond serves it (every query it is
delivered was stored before it started). Workers with the default bound serve before
and after it, in the test's own event loop, each with its own registry.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from turnrouter import ConfigurationError, ContractValueError, OverloadPolicy
from turnrouter.cli import worker_parser
from turnrouter.runtime import Interrupted, ParticipantJoined, ParticipantLeft, UserQuery
from turnrouter.runtime.nats import NatsConfig, NatsFrontEnd, NatsWorker, encode_token

from .app import make_router
from .conftest import ROOT, NatsServer, Worker, metric_value, until_true
from .crowd import FAILURE, Heard, ask, listening, serving
from .proxy import proxied

#: What a participant refused for load hears (the test app keeps the default policy).
BUSY = OverloadPolicy().busy_text
REJECTED = "turnrouter_runtime_rejected_messages_total"
RULES = ROOT / "deploy/prometheus/rules-nats/turnrouter-nats.rules.yml"


def metric(registry: CollectorRegistry, name: str, labels: str = "") -> float:
    return metric_value(generate_latest(registry).decode(), name, labels)


async def finals(heard: Heard, *queries: UserQuery) -> list[str]:
    """The terminal text of each query, once all ended (bounded wait)."""
    async with asyncio.timeout(15):
        for query in queries:
            await heard.events.setdefault(query.message_id, asyncio.Event()).wait()
    return [heard.finals[q.message_id][0].text for q in queries]


@pytest.mark.anyio
async def test_a_query_past_max_input_wait_is_answered_busy_and_never_run(
        nats_server: NatsServer) -> None:
    """A backlog served by a worker whose bound it outlived: each query ends once with
    the busy text (route none), counted (`rejected{reason="expired"}`),
    and never reaches its destination (not in history); the joined, left and interrupt
    messages queued with them are applied; the participant hears everything in the order
    they asked, and the next query, fresh, runs with the history intact."""
    config = NatsConfig(url=nats_server.url, partitions=2)
    async with listening(config) as (front, heard):
        async with serving(config, "before"):
            assert await ask(front, heard, "ann", "a1") == "a1|-|N"
            assert await ask(front, heard, "bob", "b1") == "b1|-|N"
        # Nobody serves now: what follows waits in the input stream.
        stale = [UserQuery(participant_id="ann", text="stale one"),
                 UserQuery(participant_id="ann", text="stale two"),
                 UserQuery(participant_id="bob", text="stale three")]
        await front.publish(stale[0])
        await front.publish(Interrupted(participant_id="ann"))
        await front.publish(stale[1])
        await front.publish(ParticipantLeft(participant_id="bob"))
        await front.publish(ParticipantJoined(participant_id="bob"))
        await front.publish(stale[2])
        tiny = NatsConfig(url=nats_server.url, partitions=2, max_input_wait=1e-6)
        async with serving(tiny, "behind") as registry:
            assert await finals(heard, *stale) == [BUSY] * 3
            # Counted once told: the front end may hear the third busy text before the
            # worker's count of it (a clean-clone CI read 2 of 3).
            await until_true(lambda: metric(registry, REJECTED, 'reason="expired"') == 3,
                             "three expired queries counted")
            assert metric(registry, REJECTED) == 3  # nothing else was refused
            assert metric(registry, "turnrouter_turns_total") == 0  # none ran
        async with serving(config, "after"):
            # ann's history holds a1 only (no stale query ran); bob's is gone (left).
            assert await ask(front, heard, "ann", "a2") == "a2|a1|F"
            assert await ask(front, heard, "bob", "b2") == "b2|-|N"
    assert [len(heard.finals[q.message_id]) for q in stale] == [1, 1, 1]
    assert all(heard.finals[q.message_id][0].route == "none" for q in stale)
    texts = {turn: outputs[0].text for turn, outputs in heard.finals.items()}
    assert [texts[turn].split("|")[0] for turn in heard.order["ann"]] == [
        "a1", BUSY, BUSY, "a2"]
    assert [texts[turn].split("|")[0] for turn in heard.order["bob"]] == ["b1", BUSY, "b2"]


@pytest.mark.anyio
async def test_a_backlog_of_new_participants_is_refused_without_claiming_them(
        nats_server: NatsServer) -> None:
    """Queries of participants nobody served yet, past the bound: each ends once with
    the busy text, and no record is written for any of them (no claim, no write: a burst
    of new participants was refused at three server round trips each, one at a time per
    partition, slower than it grew, and everyone behind it waited past the bound). A
    fresh query of theirs afterwards runs and starts their record."""
    config = NatsConfig(url=nats_server.url, partitions=2)
    async with listening(config) as (front, heard):
        async with serving(config, "before"):
            assert await ask(front, heard, "old", "o1") == "o1|-|N"
        burst = [UserQuery(participant_id=f"new{k}", text=f"n{k}") for k in range(12)]
        for query in burst:
            await front.publish(query)
        tiny = NatsConfig(url=nats_server.url, partitions=2, max_input_wait=1e-6)
        async with serving(tiny, "behind") as registry:
            assert await finals(heard, *burst) == [BUSY] * len(burst)
            assert metric(registry, REJECTED, 'reason="expired"') == len(burst)
        kv = await front.connection.jetstream().key_value(config.bucket)
        keys = await kv.keys()
        assert not [key for key in keys
                    if any(key.endswith(encode_token(q.participant_id)) for q in burst)]
        async with serving(config, "after"):
            assert await ask(front, heard, "new0", "again") == "again|-|N"
        assert any(key.endswith(encode_token("new0")) for key in await kv.keys())
    assert [len(heard.finals[q.message_id]) for q in burst] == [1] * len(burst)


@pytest.mark.anyio
async def test_an_ended_turn_published_again_after_the_window_gets_no_busy_text(
        nats_server: NatsServer) -> None:
    """A query that ended (answered), published again once the streams' deduplication
    window has passed and found past the bound: its participant's record says it ended,
    so it gets no output, as any turn published again after the window; before, the
    backlog's refusal (made without reading the record) said the busy text as the turn's
    second final. The next query finds the history of the first."""
    window = 1.5
    config = NatsConfig(url=nats_server.url, partitions=1, dedup_window=window)
    async with listening(config) as (front, heard):
        first = UserQuery(participant_id="ann", text="a1")
        async with serving(config, "before"):
            await front.publish(first)
            assert await finals(heard, first) == ["a1|-|N"]
        answered = time.time()
        await until_true(lambda: time.time() - answered > window + 0.5,
                         "the streams' window passed", within=window + 10)
        await front.publish(first)  # the same message: its id, its turn
        tiny = NatsConfig(url=nats_server.url, partitions=1, dedup_window=window,
                          max_input_wait=1e-6)
        async with serving(tiny, "behind") as registry:
            assert metric(registry, "turnrouter_nats_duplicates_dropped_total",
                          'where="input"') == 0
            nxt = UserQuery(participant_id="ann", text="a2")
            await front.publish(nxt)  # after it on the partition: handled after it
            assert await finals(heard, nxt) == [BUSY]
            assert metric(registry, "turnrouter_nats_duplicates_dropped_total",
                          'where="input"') == 1
        async with serving(config, "after"):
            assert await ask(front, heard, "ann", "a3") == "a3|a1|F"
    assert [o.text for o in heard.finals[first.message_id]] == ["a1|-|N"]


@pytest.mark.anyio
async def test_a_new_session_may_use_the_last_ones_ids_again(nats_server: NatsServer) -> None:
    """A participant who left and joined again, numbering turns per session as front
    ends do (`turn-1`, ...), is answered in the new session; a `left` reusing an earlier
    message id departs them again (a fresh history follows). Before, once the streams'
    deduplication window had passed, the new session's `turn-1` was taken for a replay
    of the old one (no output at all: its record kept the old session's turn ids), and
    the reused `left` for a duplicate (the worker's handled-input memory outlived the
    stream's window), so the old session's history carried into the new one."""
    window = 1.5
    config = NatsConfig(url=nats_server.url, partitions=1, dedup_window=window)
    async with listening(config) as (front, heard), serving(config, "sessions"):
        one = UserQuery(participant_id="ivy", text="s1", message_id="turn-1")
        await front.publish(one)
        assert await finals(heard, one) == ["s1|-|N"]
        await front.publish(ParticipantLeft(participant_id="ivy", message_id="bye"))
        left = time.time()
        await until_true(lambda: time.time() - left > window + 0.5,
                         "the streams' window passed", within=window + 10)
        await front.publish(ParticipantJoined(participant_id="ivy", message_id="hello"))
        heard.events.pop("turn-1", None)
        heard.finals.pop("turn-1", None)
        again = UserQuery(participant_id="ivy", text="s2", message_id="turn-1")
        await front.publish(again)
        assert await finals(heard, again) == ["s2|-|N"]  # a fresh session: no history
        two = UserQuery(participant_id="ivy", text="s2b", message_id="turn-2")
        await front.publish(two)
        assert await finals(heard, two) == ["s2b|s2|F"]
        await front.publish(ParticipantLeft(participant_id="ivy", message_id="bye"))
        await front.publish(ParticipantJoined(participant_id="ivy", message_id="hello2"))
        three = UserQuery(participant_id="ivy", text="s3", message_id="turn-3")
        await front.publish(three)
        assert await finals(heard, three) == ["s3|-|N"]  # the reused "bye" departed them


@pytest.mark.anyio
async def test_an_id_reused_within_the_window_is_refused_not_dropped_silently(
        nats_server: NatsServer, caplog: pytest.LogCaptureFixture) -> None:
    """Within the streams' deduplication window (2 min), a new session's `turn-1` is a
    duplicate to the stream, which drops it: `publish` raises `ContractValueError`
    naming the id and the window, so the caller can give it a new id. A retry returns
    normally (stored once, answered once), be it the same object or one built again
    with the same id and text (a new time). What another front end published (or one
    this front end no longer remembers) it cannot tell from a retry: logged, counted
    in `inputs_duplicated` and raised too (redteam18 F7: it may be an id taken on
    purpose). Before, `publish` returned as if a reused id's
    message was stored, and the participant was never answered (redteam7 D2)."""
    config = NatsConfig(url=nats_server.url, partitions=1)
    async with listening(config) as (front, heard), serving(config, "sessions"):
        one = UserQuery(participant_id="ivy", text="s1", message_id="turn-1")
        await front.publish(one)
        assert await finals(heard, one) == ["s1|-|N"]
        await front.publish(one)  # a retry of the same message: fine, not run again
        await front.publish(UserQuery(participant_id="ivy", text="s1", message_id="turn-1"))
        await front.publish(ParticipantLeft(participant_id="ivy", message_id="bye"))
        await front.publish(ParticipantJoined(participant_id="ivy", message_id="hello"))
        again = UserQuery(participant_id="ivy", text="s2", message_id="turn-1")
        with pytest.raises(ContractValueError, match=r"'turn-1'.*dedup_window \(120 s\)"):
            await front.publish(again)
        assert front.inputs_duplicated == 0
        second = await NatsFrontEnd.connect(config)
        try:
            with caplog.at_level(logging.WARNING, logger="turnrouter.runtime.nats"), \
                    pytest.raises(ContractValueError, match="did not publish"):
                await second.publish(again)  # another front end's id: it cannot tell
            assert second.inputs_duplicated == 1
            assert "dropped query 'turn-1'" in caplog.text
        finally:
            await second.close()
        heard.events.pop("turn-1")
        first = heard.finals.pop("turn-1")
        other = UserQuery(participant_id="ada", text="a1", message_id="turn-1")
        await front.publish(other)  # another participant's turn-1: its own id
        assert await finals(heard, other) == ["a1|-|N"]
        fresh = UserQuery(participant_id="ivy", text="s2", message_id="s2-turn-1")
        await front.publish(fresh)
        assert await finals(heard, fresh) == ["s2|-|N"]  # the new session, fresh history
        assert [o.text for o in [*first, *heard.finals["turn-1"]]] == ["s1|-|N", "a1|-|N"]


@pytest.mark.anyio
async def test_a_turn_a_crash_left_in_flight_ends_before_a_later_query_is_refused(
        nats_server: NatsServer) -> None:
    """A participant whose turn was running on a replica killed -9 (its record marks the
    turn in flight), and whose next query then waited past the bound: they hear the cut
    turn's failure text, then the new query's busy text, in that order. Before, the
    backlog's refusal (made without reading the record) said busy first, and the failure
    text followed when the new owner swept the partition's records."""
    config = NatsConfig(url=nats_server.url, partitions=1)
    async with listening(config) as (front, heard):
        slow = UserQuery(participant_id="zoe", text="slow")
        doomed = Worker(nats_server.url, "doomed", "--partitions", "1")
        try:
            kv = await front.connection.jetstream().key_value(config.bucket)
            records = await kv.watch(f"0.{encode_token('zoe')}")
            await front.publish(slow)
            async with asyncio.timeout(15):  # its preamble: the turn runs
                await heard.events.setdefault(f"started {slow.message_id}",
                                              asyncio.Event()).wait()
                async for entry in records:  # until the record marks it in flight
                    if entry is not None and slow.message_id.encode() in (entry.value or b""):
                        break
            await records.stop()  # type: ignore[no-untyped-call]  # (nats-py)
            # Its message acknowledged (after the mark): the stream, a work queue, no
            # longer holds it, so only the record tells what ran.
            js = front.connection.jetstream()
            for _ in range(1500):
                if (await js.stream_info(config.stream)).state.messages == 0:
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("the slow turn's message was never acknowledged")
            doomed.signal(signal.SIGKILL)
            doomed.proc.wait(15)
        finally:
            doomed.close()
        # Until the server dropped the dead worker's waiting pulls: one of them could
        # otherwise take `late` (delivery 1) before the server noticed the death, and the
        # survivor would rightly end it as a turn a previous owner may have run (the
        # failure text), not as a backlog's query (seen once, on a loaded CI machine).
        for _ in range(1500):
            if (await js.consumer_info(config.stream, config.consumer(0))).num_waiting == 0:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the dead worker's pull requests never left the server")
        late = UserQuery(participant_id="zoe", text="late")
        await front.publish(late)
        tiny = NatsConfig(url=nats_server.url, partitions=1, max_input_wait=1e-6)
        async with serving(tiny, "survivor"):
            assert await finals(heard, slow, late) == [FAILURE, BUSY]
    assert heard.order["zoe"] == [slow.message_id, late.message_id]


@pytest.mark.anyio
async def test_an_expired_query_supersedes_the_running_turn_before_it_is_refused(
        nats_server: NatsServer) -> None:
    """A query that outlived the bound while its participant's previous turn still runs:
    that turn is cut (as a newer turn would cut it) and has ended before the busy text
    is said, so nothing of it follows the busy text; the next query finds history
    without either. The stale query is held in the stream by holding the worker's
    acknowledgment of the running turn's message (one message in flight per
    partition), until it is older than the bound."""
    bound = 2.0
    config = NatsConfig(url=nats_server.url, partitions=1)
    async with proxied(nats_server.port) as proxy, listening(config) as (front, heard):
        held = NatsConfig(url=proxy.url, partitions=1, ack_wait=60.0, max_input_wait=bound)
        async with serving(held, "held") as registry:
            assert await ask(front, heard, "zed", "hi") == "hi|-|N"
            acks = proxy.hold(lambda subject, _: subject.startswith("$JS.ACK."))
            slow = UserQuery(participant_id="zed", text="slow")
            await front.publish(slow)
            async with asyncio.timeout(15):  # its preamble: the slow turn runs
                await heard.events.setdefault(f"started {slow.message_id}",
                                              asyncio.Event()).wait()
                await acks.event.wait()  # and its message's acknowledgment is held
            late = UserQuery(participant_id="zed", text="late")
            await front.publish(late)
            stored_by = time.time()  # the stream stored it before publish returned
            await until_true(lambda: time.time() - stored_by > bound,
                             "the held query outlived the bound", within=bound + 10)
            acks.release()
            assert await finals(heard, late) == [BUSY]
            assert metric(registry, REJECTED, 'reason="expired"') == 1
            assert metric(registry, "turnrouter_turns_total", 'outcome="interrupted"') == 1
            assert await ask(front, heard, "zed", "next") == "next|hi|F"
    assert slow.message_id not in heard.finals  # cut: it said nothing after its preamble
    assert [heard.finals[turn][0].text.split("|")[0] for turn in heard.order["zed"]] == [
        "hi", BUSY, "next"]


# ---------------------------------------------------------------- no server needed


@given(st.one_of(st.floats(), st.integers(), st.booleans(), st.none(),
                 st.text(max_size=5), st.just(10**400), st.just(-0.0)))
def test_max_input_wait_is_a_bounded_duration(value: object) -> None:
    """`max_input_wait` takes seconds in (0, 1 year]; NaN, infinities, zero, negative,
    huge numbers, text and None are a ConfigurationError naming the field."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if number and 0 < value <= 366 * 86400:  # type: ignore[operator]
        assert NatsConfig(max_input_wait=value).max_input_wait == value  # type: ignore[arg-type]
        return
    with pytest.raises(ConfigurationError, match="max_input_wait"):
        NatsConfig(max_input_wait=value)  # type: ignore[arg-type]


def test_the_worker_flag_sets_the_bound() -> None:
    """`--max-input-wait` sets `NatsConfig.max_input_wait`; its default is the config's."""
    args = ["--nats", "nats://127.0.0.1:1", "--app", "a:b"]
    assert worker_parser().parse_args(args).max_input_wait == NatsConfig().max_input_wait
    assert worker_parser().parse_args([*args, "--max-input-wait", "4.5"]).max_input_wait == 4.5


def test_the_backlog_alert_threshold_and_the_bound_are_bucket_bounds() -> None:
    """The backlog alert's threshold and the default `max_input_wait` are bounds of the
    input wait histogram (its p95 compares exactly), which reads waits up to 30 s."""
    registry = CollectorRegistry()
    NatsWorker(make_router, NatsConfig(), registry=registry)
    bounds = {sample.labels["le"] for family in registry.collect()
              for sample in family.samples
              if sample.name == "turnrouter_nats_input_wait_seconds_bucket"}
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    (alert,) = [rule for rule in rules if rule.get("alert") == "TurnrouterInputBacklog"]
    threshold = float(alert["expr"].split("\n")[1].split(">")[1])
    assert {str(threshold), str(NatsConfig().max_input_wait), "30.0"} <= bounds
