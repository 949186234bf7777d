"""A partition's pin moves away from its owner while the owner is not done with one of
its participants: a turn marked in flight, after the new owner's takeover read the
records, is ended by the old owner itself; a claim of a participant's record still
under way is fenced when it completes, not kept to be served stale when the partition
comes back."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from prometheus_client import CollectorRegistry, generate_latest

import nats
from turnrouter.runtime import ParticipantJoined, UserQuery
from turnrouter.runtime.nats import (
    NatsConfig,
    NatsWorker,
    encode_token,
    parse_record,
    state_json,
)

from .app import make_router
from .conftest import NatsServer, Worker, cancelled, metric_value, until_true
from .crowd import FAILURE, ask, listening
from .proxy import Hold, proxied, reads_of

pytestmark = pytest.mark.anyio


@contextlib.asynccontextmanager
async def pin_holder(nc: Client, config: NatsConfig, n: int) -> AsyncIterator[asyncio.Event]:
    """A client pulling partition `n` in the replicas' priority group, as a new owner
    does, that never claims a record: the new owner whose takeover read the records
    before the old owner's last write. The event is set once the server pinned it; it
    keeps the pin (pulling every 0.3 s) until the block ends."""
    info = json.loads((await nc.request(
        f"$JS.API.CONSUMER.INFO.{config.stream}.{config.consumer(n)}", b"",
        timeout=5)).data)
    group = info["config"]["priority_groups"][0]
    got: asyncio.Queue[Msg] = asyncio.Queue()
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=got.put)
    pinned = asyncio.Event()

    async def pull() -> None:
        pin: str | None = None
        while True:
            request = {"batch": 1, "expires": 300_000_000, "group": group,
                       **({"id": pin} if pin else {})}
            await nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{config.stream}."
                             f"{config.consumer(n)}", json.dumps(request).encode(),
                             reply=inbox)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.5):  # the request expires after 0.3 s
                    msg = await got.get()
                    if msg.headers and "Nats-Pin-Id" in msg.headers:
                        pin = msg.headers["Nats-Pin-Id"]
                        pinned.set()
                    if msg.reply:
                        await nc.publish(msg.reply, b"+ACK")  # a probe: nobody's input

    task = asyncio.create_task(pull())
    try:
        yield pinned
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await sub.unsubscribe()


async def test_a_turn_marked_after_the_takeover_read_ends_on_the_old_owner(
        nats_server: NatsServer) -> None:
    """The owner marks a long turn in flight and acknowledges its message; the pin then
    moves (the owner pauses past the failover timeout) to a new owner that never claims
    the participant, as one whose takeover read the record before the mark. Told by the
    server that it lost the partition, the old owner ends the turn with the failure
    text, recorded in the participant's record, while the new owner still holds the pin
    and nobody talks (before, the participant heard nothing until their next query)."""
    config = NatsConfig(url=nats_server.url)
    worker = Worker(nats_server.url, "old")
    nc = await nats.connect(nats_server.url)
    try:
        async with listening(config) as (front, heard):
            kv = await nc.jetstream().key_value(config.bucket)
            slow = UserQuery(participant_id="zed", text="slow")
            await front.publish(slow)
            async with asyncio.timeout(15):  # its preamble: the turn is running
                await heard.events.setdefault(f"started {slow.message_id}",
                                              asyncio.Event()).wait()
            token = encode_token("zed")
            js = nc.jetstream()

            async def marked_and_acknowledged() -> int | None:
                """The partition of the record marking the turn in flight, once the query's
                message is acknowledged (None before)."""
                for n in range(config.partitions):
                    with contextlib.suppress(nats.js.errors.KeyNotFoundError):
                        entry = await kv.get(f"{n}.{token}")
                        if parse_record(entry.value or b"").inflight == [slow.message_id]:
                            info = await js.consumer_info(config.stream, config.consumer(n))
                            return n if info.num_ack_pending == info.num_pending == 0 else None
                return None

            for _ in range(300):  # bounded poll of the server's state: at most 15 s
                partition = await marked_and_acknowledged()
                if partition is not None:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the turn was never marked in flight and acknowledged")
            n = partition
            worker.signal(signal.SIGSTOP)
            try:
                async with pin_holder(nc, config, n) as pinned:
                    # A probe of the partition: the message the server pins the new owner on
                    # once the paused owner stopped pulling for failover_timeout.
                    await js.publish(config.probe_subject(n), b"")
                    async with asyncio.timeout(15):
                        await pinned.wait()
                    worker.signal(signal.SIGCONT)
                    async with asyncio.timeout(15):  # while the new owner holds the pin
                        await heard.events.setdefault(slow.message_id, asyncio.Event()).wait()
                    finals = heard.finals[slow.message_id]
                    assert [(m.route, m.text) for m in finals] == [("none", FAILURE)]
                    entry = await kv.get(f"{n}.{token}")
                    record = parse_record(entry.value or b"")
                    assert record.inflight == []
                    assert slow.message_id in record.ended
            finally:
                worker.signal(signal.SIGCONT)
            await until_true(lambda: metric_value(
                worker.metrics(), "turnrouter_nats_inflight_failed_total") >= 1,
                "the old owner counted the turn it ended")
    finally:
        await nc.close()
        worker.close()


async def test_a_replica_resumed_after_a_pause_checks_its_record_before_running(
        nats_server: NatsServer) -> None:
    """A query delivered to a replica's waiting pull the moment it paused (SIGSTOP),
    the participant's record written meanwhile by another replica (which ended that
    turn, as a new owner does): on resume the replica, not hearing its own presence
    for longer than two probe periods, writes the record before running the turn, is
    refused, and never runs the destination. chaos11 D3 saw a resumed replica run
    3-4 such turns per 6 s pause on a loaded machine (for a participant already told
    "something went wrong"); here, unloaded, the tree before the check did not run it
    either (its in-flight mark was refused first), so this guards the outcome, and the
    chaos harness measures the fix (benchmarks/reports/nats-server-faults.md). The
    replica's pulls are held on resume (a proxy), so the server's word that the pin
    moved comes after the query."""
    config = NatsConfig(url=nats_server.url)
    async with proxied(nats_server.port) as proxy:
        worker = await asyncio.to_thread(  # (the proxy runs on this loop meanwhile)
            Worker, proxy.url, "old", env={"TR_TEST_SAY_ANSWERED": "1"})
        nc = await nats.connect(nats_server.url)
        try:
            async with listening(config) as (front, heard):
                assert (await ask(front, heard, "zed", "hello")).startswith("hello")
                kv = await nc.jetstream().key_value(config.bucket)
                token = encode_token("zed")
                entries = []
                for n in range(config.partitions):
                    with contextlib.suppress(nats.js.errors.KeyNotFoundError):
                        entries.append(await kv.get(f"{n}.{token}"))
                (entry,) = entries
                n = int(entry.key.split(".", 1)[0])
                query = UserQuery(participant_id="zed", text="again")
                running = f"running {query.message_id}"
                worker.signal(signal.SIGSTOP)
                try:
                    await front.publish(query)  # to the paused replica's waiting pull
                    # Another replica takes the partition and ends that turn, its write
                    # first, as a new owner does with a query its previous owner took.
                    record = parse_record(entry.value or b"")
                    await kv.update(entry.key, state_json(
                        "other", [], record.snapshot, [],
                        [*record.ended, query.message_id]), last=entry.revision)
                    async with pin_holder(nc, config, n) as pinned:
                        await nc.jetstream().publish(config.probe_subject(n), b"")
                        async with asyncio.timeout(15):
                            await pinned.wait()
                        pulls = proxy.hold(lambda subject, _: subject == (
                            f"$JS.API.CONSUMER.MSG.NEXT.{config.stream}."
                            f"{config.consumer(n)}"))
                        worker.signal(signal.SIGCONT)
                        await until_true(lambda: running in worker.stderr() or metric_value(
                            worker.metrics(), "turnrouter_nats_state_writes_refused_total")
                            >= 1, "the resumed replica handled the query")
                        assert running not in worker.stderr()
                        pulls.release()
                        await until_true(lambda: metric_value(
                            worker.metrics(), "turnrouter_nats_partitions_lost_total",
                            'how="lost"') >= 1, "the resumed replica told its pin moved")
                finally:
                    worker.signal(signal.SIGCONT)
                assert running not in worker.stderr()
                assert query.message_id not in heard.finals
        finally:
            await nc.close()
            worker.close()


async def update_stream(nc: Client, name: str, **changes: Any) -> dict[str, Any]:
    """Change stream `name`'s configuration as an operator does (`$JS.API.STREAM.UPDATE`
    with the whole configuration); the values `changes` replaced."""
    info = json.loads((await nc.request(f"$JS.API.STREAM.INFO.{name}", b"",
                                        timeout=5)).data)
    config = info["config"]
    before = {key: config.get(key) for key in changes}
    reply = json.loads((await nc.request(f"$JS.API.STREAM.UPDATE.{name}",
                                         json.dumps({**config, **changes}).encode(),
                                         timeout=5)).data)
    assert "error" not in reply, reply
    return before


@contextlib.asynccontextmanager
async def probing(nc: Client, config: NatsConfig, n: int) -> AsyncIterator[None]:
    """While the block runs, a probe of partition `n` every 0.3 s: the message the server
    pins a partition's next owner on, once the last one stopped pulling for
    failover_timeout (a probe the last owner took meanwhile is gone)."""
    js = nc.jetstream()

    async def probe() -> None:
        while True:
            await js.publish(config.probe_subject(n), b"")
            await asyncio.sleep(0.3)  # the probes' pace, not a wait for async work

    task = asyncio.create_task(probe())
    try:
        yield
    finally:
        await cancelled(task)  # its JetStream publish may lose a plain cancel() on 3.11


async def first_of(*events: asyncio.Event) -> None:
    """Until one of `events` is set (the caller bounds the wait)."""
    waits = [asyncio.create_task(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            task.cancel()
        await asyncio.gather(*waits, return_exceptions=True)


async def test_a_claim_outliving_its_partition_is_not_served_when_it_comes_back(
        nats_server: NatsServer) -> None:
    """A save of zed got an error reply, so the worker dropped zed and reads its record
    to end what it left unfinished; its pin moves to a new owner while that read waits at
    the server. The worker must neither write the record nor keep a state of zed: the
    new owner then
    marks a turn of zed in flight, and when the partition comes back the worker's
    takeover has to read that record, end the turn with the failure text and never run
    it, even delivered afresh (before, the claimed state was served, stale: no ending,
    and the turn ran a second time).

    Held without touching the worker: its connection goes through a proxy that keeps
    the publishes matching a rule from the server (the claim's read of zed's record,
    then the worker's pulls of the partition, so the pin can move), a real server
    refuses the save (an operator lowered the bucket's message size for a moment), and
    the new owner is this test, pulling in the replicas' priority group and writing
    zed's record as an owner does."""
    # A failover timeout of 2 s: the new owner, pulling every 0.3 s, keeps the pin
    # through a stall of the loaded machine's event loop (the worker pulls too).
    config = NatsConfig(url=nats_server.url, partitions=1, failover_timeout=2.0)
    n, turn = 0, "turn-elsewhere"
    key = f"{n}.{encode_token('zed')}"
    registry = CollectorRegistry()

    def metric(name: str, labels: str = "") -> float:
        return metric_value(generate_latest(registry).decode(), name, labels)

    async with proxied(nats_server.port) as proxy:
        worker = NatsWorker(make_router, dataclasses.replace(config, url=proxy.url),
                            registry=registry, replica="old")
        run = asyncio.create_task(worker.run())
        nc = await nats.connect(nats_server.url)
        try:
            async with listening(config) as (front, heard):
                async with asyncio.timeout(15):
                    await worker.ready.wait()
                kv = await nc.jetstream().key_value(config.bucket)
                # zed has a record (a `joined` of a participant without one claims
                # nothing), so the `joined` below claims and saves it.
                await kv.put(key, state_json("old", [], None))
                await front.publish(ParticipantJoined(participant_id="zed"))
                await until_true(lambda: metric("turnrouter_nats_state_write_seconds_count") >= 1,
                                 "zed was claimed and saved")
                record_subject = f"$KV.{config.bucket}.{key}"
                reads = proxy.hold(reads_of(record_subject))
                limits = await update_stream(nc, f"KV_{config.bucket}", max_msg_size=1)
                await front.publish(ParticipantJoined(participant_id="zed"))  # saved: refused
                async with asyncio.timeout(15):  # zed dropped, claimed again: its read waits
                    await reads.event.wait()
                await update_stream(nc, f"KV_{config.bucket}", **limits)
                before = await kv.get(key)
                revision = before.revision or 0
                pulls = proxy.hold(lambda subject, _: subject == (
                    f"$JS.API.CONSUMER.MSG.NEXT.{config.stream}.{config.consumer(n)}"))
                async with pin_holder(nc, config, n) as pinned:
                    async with probing(nc, config, n):
                        await until_true(pinned.is_set, "the new owner was pinned", within=15)
                    pulls.release()  # their pin is refused (423): the worker lost the partition
                    await until_true(lambda: metric("turnrouter_nats_partitions_lost_total",
                                                    'how="lost"') >= 1,
                                     "the worker saw its partition lost")
                    assert n not in worker.owned_partitions
                    reads.release()  # the worker's read of zed's record completes now
                    # The new owner claims zed and marks a turn in flight, on the revision
                    # it read: the worker writes nothing after an uncertain write of its
                    # own but ends what its own record left (nothing here), so this is not
                    # refused (a claim of the worker's landing after it would end the
                    # new owner's turn as left unfinished).
                    record = parse_record(before.value or b"")
                    assert record.owner == "old" and record.inflight == []
                    await kv.update(key, state_json("new", [turn], record.snapshot, [],
                                                    record.ended), last=revision)
                # The new owner stops pulling: the partition comes back to the worker.
                async with probing(nc, config, n):
                    await until_true(lambda: n in worker.owned_partitions,
                                     "the worker took the partition back", within=15)
                # The turn's query delivered afresh (as after a server crash: delivery 1).
                await front.publish(UserQuery(participant_id="zed", text="slow", message_id=turn))
                started = heard.events.setdefault(f"started {turn}", asyncio.Event())
                async with asyncio.timeout(15):
                    await first_of(heard.events.setdefault(turn, asyncio.Event()), started)
                assert not started.is_set(), (
                    "the destination ran a turn zed's record had marked in flight elsewhere")
                assert [(m.route, m.text) for m in heard.finals[turn]] == [("none", FAILURE)]
                await until_true(lambda: metric("turnrouter_nats_duplicates_dropped_total",
                                                'where="input"') >= 1,
                                 "the query of the ended turn was dropped")
                assert not started.is_set()
                record = parse_record((await kv.get(key)).value or b"")
                assert record.inflight == [] and turn in record.ended
        finally:
            await nc.close()
            run.cancel()
            async with asyncio.timeout(20):
                await asyncio.gather(run, return_exceptions=True)


async def test_a_partition_stays_with_its_owner_through_a_long_held_message(
        nats_server: NatsServer) -> None:
    """A participant's claim waits at the server three times the failover timeout (its
    record's read answered late, as by a loaded server), keeping the partition's loop on
    that one message: the owner keeps the partition's pin all the while (it pulls with
    its pin while busy), so nothing moves: no partition lost, no second takeover, the
    participant answered once the read returns, the partition's next turn too. Before,
    an owner busy with one message sent no pull, and the server gave the partition to
    another replica after failover_timeout (the red team's overload runs: partitions
    moving between busy replicas, their running turns ended with the failure text).

    Held without touching the worker: its connection goes through a proxy that keeps
    the reads of bob's record from the server until the test releases them."""
    config = NatsConfig(url=nats_server.url, partitions=1)
    registry = CollectorRegistry()
    record_subject = f"$KV.{config.bucket}.0.{encode_token('bob')}"
    async with proxied(nats_server.port) as proxy:
        worker = NatsWorker(make_router, dataclasses.replace(config, url=proxy.url),
                            registry=registry, replica="busy")
        run = asyncio.create_task(worker.run())
        reads = proxy.hold(reads_of(record_subject))
        try:
            async with listening(config) as (front, heard):
                async with asyncio.timeout(15):
                    await worker.ready.wait()
                assert (await ask(front, heard, "amy", "hello")).startswith("hello|")
                query = UserQuery(participant_id="bob", text="hi")
                await front.publish(query)
                async with asyncio.timeout(15):
                    await reads.event.wait()
                # The stall under test: the claim held past the pin's failover timeout.
                await asyncio.sleep(3 * config.failover_timeout)
                reads.release()
                async with asyncio.timeout(15):
                    await heard.events.setdefault(query.message_id, asyncio.Event()).wait()
                assert [m.text for m in heard.finals[query.message_id]] == ["hi|-|N"]
                assert (await ask(front, heard, "amy", "again")).startswith("again|")
                exposition = generate_latest(registry).decode()
                assert metric_value(exposition, "turnrouter_nats_partitions_lost_total") == 0
                assert metric_value(exposition, "turnrouter_nats_takeovers_total") == 1
        finally:
            reads.release()
            run.cancel()
            async with asyncio.timeout(20):
                await asyncio.gather(run, return_exceptions=True)


async def test_a_graceful_stop_runs_what_its_last_keep_alive_pull_delivers(
        nats_server: NatsServer) -> None:
    """The worker is told to stop (SIGTERM) while busy with bob's message (its claim's
    read held at the server, so keep-alive pulls are out) and carol's query waits behind
    it. Once bob's message is acknowledged, carol's query is delivered to the stopping
    worker's last pulls (its own or a keep-alive): the worker runs it, or leaves it in the
    stream for the next owner, never unread: an unread message would come back to the
    next owner as a redelivery, and a redelivered query ends with the failure text.
    carol hears her answer, bob his, and the heir (started meanwhile) takes the
    partition over with carol's history."""
    config = NatsConfig(url=nats_server.url, partitions=1)
    record_subject = f"$KV.{config.bucket}.0.{encode_token('bob')}"
    next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{config.stream}.{config.consumer(0)}"
    keeping = asyncio.Event()

    def keep_alive(subject: str, payload: bytes) -> bool:
        """Watches for the worker's keep-alive pulls (one message each); holds nothing."""
        if subject == next_subject and b'"batch": 1,' in payload:
            keeping.set()
        return False

    async with proxied(nats_server.port) as proxy:
        worker = NatsWorker(make_router, dataclasses.replace(config, url=proxy.url),
                            replica="stopping")
        heir = NatsWorker(make_router, config, replica="heir")
        runs = [asyncio.create_task(worker.run())]
        reads = proxy.hold(reads_of(record_subject))
        proxy.hold(keep_alive)
        try:
            async with listening(config) as (front, heard):
                async with asyncio.timeout(15):
                    await worker.ready.wait()
                assert (await ask(front, heard, "amy", "hello")).startswith("hello|")
                assert worker.owned_partitions == {0}
                runs.append(asyncio.create_task(heir.run()))
                async with asyncio.timeout(15):
                    await heir.ready.wait()
                bob = UserQuery(participant_id="bob", text="hi")
                await front.publish(bob)
                async with asyncio.timeout(15):
                    await reads.event.wait()
                    await keeping.wait()
                carol = UserQuery(participant_id="carol", text="hey")
                await front.publish(carol)  # stored: acknowledged by the stream
                worker.request_stop()
                await until_true(lambda: not worker.readiness.serving,
                                 "the worker began its graceful stop")
                reads.release()
                for query in (bob, carol):
                    async with asyncio.timeout(30):
                        await heard.events.setdefault(query.message_id,
                                                      asyncio.Event()).wait()
                assert [m.text for m in heard.finals[bob.message_id]] == ["hi|-|N"]
                assert [m.text for m in heard.finals[carol.message_id]] == ["hey|-|N"]
                async with asyncio.timeout(30):
                    await runs[0]
                assert (await ask(front, heard, "carol", "again")) == "again|hey|F"
        finally:
            reads.release()
            for run in runs:
                run.cancel()
            async with asyncio.timeout(30):
                await asyncio.gather(*runs, return_exceptions=True)


async def test_keep_alive_pulls_stop_past_drain_timeout_on_one_message(
        nats_server: NatsServer, caplog: pytest.LogCaptureFixture) -> None:
    """The keep-alive pulls of a busy owner are bounded: once one message has held a
    partition's loop longer than `drain_timeout` (a stuck loop), the worker says so once
    in its log and sends no more keep-alive pulls for it, leaving the server free to
    give the partition to another replica after the failover timeout; the message still
    ends normally when its claim's read comes back."""
    config = NatsConfig(url=nats_server.url, partitions=1, drain_timeout=1.5)
    record_subject = f"$KV.{config.bucket}.0.{encode_token('bob')}"
    next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{config.stream}.{config.consumer(0)}"
    keep_alives: list[float] = []

    def keep_alive(subject: str, payload: bytes) -> bool:
        """Counts the worker's keep-alive pulls (one message each); holds nothing."""
        if subject == next_subject and b'"batch": 1,' in payload:
            keep_alives.append(time.monotonic())
        return False

    async with proxied(nats_server.port) as proxy:
        worker = NatsWorker(make_router, dataclasses.replace(config, url=proxy.url),
                            replica="stuck")
        run = asyncio.create_task(worker.run())
        reads = proxy.hold(reads_of(record_subject))
        proxy.hold(keep_alive)
        try:
            async with listening(config) as (front, heard):
                async with asyncio.timeout(15):
                    await worker.ready.wait()
                bob = UserQuery(participant_id="bob", text="hi")
                await front.publish(bob)
                async with asyncio.timeout(15):
                    await reads.event.wait()
                await until_true(lambda: "letting the partition go" in caplog.text,
                                 "the worker gave the stuck partition up", within=15)
                assert keep_alives, "keep-alive pulls went out before drain_timeout"
                sent = len(keep_alives)
                # The absence under test: four keep-alive periods without one.
                await asyncio.sleep(2 * config.pull_expires)
                assert len(keep_alives) == sent
                reads.release()
                async with asyncio.timeout(15):
                    await heard.events.setdefault(bob.message_id, asyncio.Event()).wait()
                assert [m.text for m in heard.finals[bob.message_id]] == ["hi|-|N"]
                assert caplog.text.count("letting the partition go") == 1
        finally:
            reads.release()
            run.cancel()
            async with asyncio.timeout(20):
                await asyncio.gather(run, return_exceptions=True)


async def pinned_client(nc: Client, config: NatsConfig, n: int) -> str:
    """The pin id the server gave partition `n`'s consumer now ('' when none)."""
    info = json.loads((await nc.request(
        f"$JS.API.CONSUMER.INFO.{config.stream}.{config.consumer(n)}", b"",
        timeout=5)).data)
    groups = info.get("priority_groups") or [{}]
    return str(groups[0].get("pinned_client_id") or "")


async def test_a_refusal_of_a_pull_made_with_a_replaced_pin_keeps_the_partition(
        nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server pins the worker's partition afresh (a new pin id) while one of the
    worker's pulls made with the old pin id is still on its way (after a server's
    return, the pulls sent while it was away arrive together). That pull is refused
    (423, pin id mismatch) once the worker already serves the partition under its new
    pin and runs bob's turn: the refusal is of the old pin, not of the new one, so the
    partition stays and bob hears his answer. Before, the worker took the 423 for the
    loss of the partition: it dropped bob and ended his running turn with the failure
    text, though the server still pinned it (the chaos run's turns cut just after a
    server's return).

    Held without touching the worker: its connection goes through a proxy that keeps
    one pull carrying the old pin from the server until the test releases it, and the
    test unpins the partition as an operator can (`$JS.API.CONSUMER.UNPIN`)."""
    monkeypatch.setenv("TR_TEST_ANSWER_SECS", "1.5")  # bob's turn runs meanwhile
    config = NatsConfig(url=nats_server.url, partitions=1)
    n = 0
    next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{config.stream}.{config.consumer(n)}"
    registry = CollectorRegistry()

    def metric(name: str, labels: str = "") -> float:
        return metric_value(generate_latest(registry).decode(), name, labels)

    async with proxied(nats_server.port) as proxy:
        worker = NatsWorker(make_router, dataclasses.replace(config, url=proxy.url),
                            registry=registry, replica="owner")
        run = asyncio.create_task(worker.run())
        nc = await nats.connect(nats_server.url)
        pulls: Hold | None = None
        try:
            async with listening(config) as (front, heard):
                async with asyncio.timeout(15):
                    await worker.ready.wait()
                assert (await ask(front, heard, "q-amy", "hello")).startswith("hello|")
                old = await pinned_client(nc, config, n)
                assert old and worker.owned_partitions == {n}
                caught: list[bytes] = []

                def one_pull_with_the_old_pin(subject: str, payload: bytes) -> bool:
                    if subject == next_subject and old.encode() in payload and not caught:
                        caught.append(payload)
                        return True
                    return False

                pulls = proxy.hold(one_pull_with_the_old_pin)
                async with asyncio.timeout(15):
                    await pulls.event.wait()
                reply = json.loads((await nc.request(
                    f"$JS.API.CONSUMER.UNPIN.{config.stream}.{config.consumer(n)}",
                    json.dumps({"group": "turnrouter"}).encode(), timeout=5)).data)
                assert "error" not in reply, reply
                bob = UserQuery(participant_id="bob", text="hi")
                await front.publish(bob)
                # The worker's next pull with the old pin is refused (a real loss: the
                # server pinned nobody), it pulls without one and is pinned afresh.
                kv = await nc.jetstream().key_value(config.bucket)
                key = f"{n}.{encode_token('bob')}"

                async def running() -> bool:
                    with contextlib.suppress(nats.js.errors.KeyNotFoundError):
                        entry = await kv.get(key)
                        return parse_record(entry.value or b"").inflight == [bob.message_id]
                    return False

                for _ in range(300):  # bounded poll of the server's state: at most 15 s
                    if await running():
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError("bob's turn never ran")
                new = await pinned_client(nc, config, n)
                assert new and new != old and worker.owned_partitions == {n}
                lost = metric("turnrouter_nats_partitions_lost_total", 'how="lost"')
                assert pulls.release() == 1  # refused now: 423, the old pin
                async with asyncio.timeout(15):
                    await heard.events.setdefault(bob.message_id, asyncio.Event()).wait()
                assert [m.text for m in heard.finals[bob.message_id]] == ["hi|-|N"]
                assert await pinned_client(nc, config, n) == new
                assert worker.owned_partitions == {n}
                assert metric("turnrouter_nats_partitions_lost_total", 'how="lost"') == lost
                assert (await ask(front, heard, "bob", "again")) == "again|hi|F"
        finally:
            if pulls is not None:
                pulls.release()
            await nc.close()
            run.cancel()
            async with asyncio.timeout(20):
                await asyncio.gather(run, return_exceptions=True)


async def test_a_partition_whose_pulls_were_answered_503_resumes_within_seconds(
        nats_server: NatsServer) -> None:
    """A partition's pulls answered 503 ("no responders", as while a cluster elects the
    consumer's leader) for a few seconds: the worker pulls it about once a second
    meanwhile and consumes it again at once after. Before, the loop counted a 503 it
    read as a message being handled, so keep-alive pulls went out every 0.2 s, each
    answered 503 and each costing the loop a 1 s pause when read: the loop read a
    growing queue of stale 503s and sent no pull of its own (the partition stalled,
    docs/distributed.md, "A NATS cluster")."""
    n = 3
    config = NatsConfig(url=nats_server.url)
    next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{config.stream}.{config.consumer(n)}"
    info_subject = f"$JS.API.CONSUMER.INFO.{config.stream}.{config.consumer(n)}"
    nc = await nats.connect(nats_server.url)
    try:
        async with proxied(nats_server.port) as proxy:
            worker = NatsWorker(make_router, dataclasses.replace(config, url=proxy.url),
                                replica="w", registry=CollectorRegistry())
            run = asyncio.create_task(worker.run())
            try:
                async with asyncio.timeout(60):
                    await worker.ready.wait()
                await until_true(lambda: n in worker.owned_partitions, "partition pinned")
                nobody = proxy.rename(lambda subject, _: subject == next_subject,
                                      f"$JS.API.CONSUMER.MSG.NEXT.{config.stream}.nobody")
                await asyncio.sleep(3)  # the spell of 503s (a fault's length, not a wait)
                nobody.active = False
                sent = proxy.uplink.count(b".nobody ")
                # Pulls meanwhile: about one a second (the loop's), not five (keep-alives).
                assert 1 <= sent <= 6, sent
                js = nc.jetstream()
                for _ in range(3):
                    await js.publish(config.probe_subject(n), b"")

                async def consumed() -> bool:
                    info = json.loads((await nc.request(info_subject, b"", timeout=5)).data)
                    return bool(info["num_pending"] == 0 and info["num_ack_pending"] == 0)

                for _ in range(160):  # 8 s at most (a queue of stale 503s took minutes)
                    if await consumed():
                        break
                    await asyncio.sleep(0.05)  # polling the server's count, bounded
                else:
                    raise AssertionError("the partition not consumed 8 s after the 503s")
            finally:
                worker.request_stop()
                await cancelled(run, within=30)
    finally:
        await nc.close()
