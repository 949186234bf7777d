"""A takeover on a real nats-server: the new owner ends every turn its partitions'
records left in flight, also while those records are being written, and keeps serving
the partition while it reads them."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import time
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client
from nats.js.api import KeyValueConfig
from prometheus_client import CollectorRegistry, generate_latest

import nats
from turnrouter.runtime import ResponseOutput, UserQuery
from turnrouter.runtime.nats import (
    NatsConfig,
    NatsFrontEnd,
    NatsWorker,
    encode_token,
    parse_record,
    state_json,
)

from .app import PREAMBLE, make_router
from .conftest import NatsServer, Worker, cancelled, metric_value, settled, until_true
from .crowd import FAILURE, ask, listening, serving
from .proxy import Hold, Match, proxied, reads_of

pytestmark = pytest.mark.anyio

#: Participants per partition whose record a dead replica left with a turn in flight.
LEFT = 4


@contextlib.asynccontextmanager
async def heir(port: int, config: NatsConfig, match: Match, registry: CollectorRegistry
               ) -> AsyncIterator[tuple[NatsWorker, asyncio.Task[None], Hold]]:
    """A worker ("heir") connected to the server on `port` through a proxy that holds
    the publishes `match` picks; stopped on exit, what was held let go first."""
    async with proxied(port) as proxy:
        hold = proxy.hold(match)
        worker = NatsWorker(make_router, dataclasses.replace(config, url=proxy.url),
                            registry=registry, replica="heir")
        run = asyncio.create_task(worker.run())
        try:
            yield worker, run, hold
        finally:
            hold.release()
            worker.request_stop()
            async with asyncio.timeout(30):
                await asyncio.gather(run, return_exceptions=True)


async def rewrite(nc: Client, config: NatsConfig, writing: asyncio.Event) -> None:
    """Rewrite a record of every partition (nothing unfinished in it), 16 times per
    partition and round, until cancelled (by `cancelled`: a plain `cancel()` may be lost
    on Python 3.11); `writing` is set once a round was stored. While the server is away,
    a round is tried again 0.1 s later.

    Each write waits for its acknowledgment (the partitions' writes side by side), as a
    replica's do: writes sent without waiting outran a server storing each one before
    acknowledging it, filled the stream's ingest queue (nats-server's
    `max_buffered_msgs`), and the server dropped writes, the takeover's claims among
    them, about one run in fifteen."""
    js = nc.jetstream()
    keys = [f"$KV.{config.bucket}.{n}.{encode_token(f'busy-{n}')}"
            for n in range(config.partitions)]
    count = 0
    while True:
        stored = True
        for _ in range(16):
            count += 1
            value = state_json("gone", [], None, [], [f"t-{count}"])
            acks = await asyncio.gather(*(js.publish(key, value) for key in keys),
                                        return_exceptions=True)
            if any(isinstance(ack, BaseException) for ack in acks):
                stored = False  # the server is away: nats-py reconnects
                await asyncio.sleep(0.1)
                break
        if stored:
            writing.set()


async def test_a_takeover_ends_every_turn_left_in_flight_while_records_change(
        nats_server: NatsServer) -> None:
    """Every partition holds records of participants whose turn a replica that died
    left in flight, and another record of the partition is rewritten all the while (as
    a paused previous owner's late writes or the new owner's own claims do). The worker
    that takes the partitions over ends each of those turns with the failure text, once,
    before anyone talks. nats-py's KV watch, which the takeover read the records with,
    could signal the end of a partition's records before delivering them while one of
    them was written: the red team's kill -9 runs left up to 9 turns without an ending
    until their participant spoke again."""
    config = NatsConfig(url=nats_server.url)
    nc = await nats.connect(nats_server.url)
    kv = await nc.jetstream().create_key_value(KeyValueConfig(bucket=config.bucket,
                                                              history=1))
    left = {f"left-{n}-{i}": n for n in range(config.partitions) for i in range(LEFT)}
    for pid, n in left.items():
        await kv.put(f"{n}.{encode_token(pid)}", state_json("gone", ["t-1"], None))
    writing = asyncio.Event()
    writers = [asyncio.create_task(rewrite(nc, config, writing))]
    worker: Worker | None = None
    finals: dict[str, list[ResponseOutput]] = {}
    try:
        async with asyncio.timeout(15):
            await writing.wait()
        worker = await asyncio.to_thread(Worker, nats_server.url, "heir")  # bounded: 60 s
        async with asyncio.timeout(15):
            front = await NatsFrontEnd.connect(config)
        try:
            async with asyncio.timeout(30):  # every turn ended (a liveness bound)
                async for out in front.outputs(deliver_new=False):
                    if out.final:
                        finals.setdefault(out.participant_id, []).append(out)
                    if set(finals) >= set(left):
                        break
        except TimeoutError:
            missing = sorted(set(left) - set(finals))
            raise AssertionError(f"{len(missing)} turns left in flight never ended: "
                                 f"{missing[:8]}") from None
        finally:
            await front.close()
    finally:
        await cancelled(*writers)
        with contextlib.suppress(Exception):
            await settled(nc)
        await nc.close()
        if worker is not None:
            worker.close()
    assert {pid: [(o.request_id, o.route, o.text) for o in outs]
            for pid, outs in finals.items()} == {
        pid: [("t-1", "none", FAILURE)] for pid in left}


async def test_the_survivor_of_an_owner_and_server_crash_ends_its_turns() -> None:
    """kill -9 of the replica running 16 long turns (each marked in flight) and of
    nats-server together, the server back at once: the surviving replica takes the
    partitions over and ends every one of those turns with the failure text, with no
    participant talking again, while another record of each partition is rewritten
    (the red team's runs left 2-5 turns in flight for good)."""
    server = NatsServer(sync_always=True)
    config = NatsConfig(url=server.url)
    workers = [await asyncio.to_thread(Worker, server.url, "doomed")]
    async with asyncio.timeout(15):
        nc = await nats.connect(server.url, max_reconnect_attempts=-1,
                                reconnect_time_wait=0.1)
        front = await NatsFrontEnd.connect(config)
    pids = [f"long-{i}" for i in range(16)]
    finals: dict[str, list[ResponseOutput]] = {}
    started: set[str] = set()
    writing = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []

    async def listen(subscribed: asyncio.Event) -> None:
        async for out in front.outputs(subscribed=subscribed):
            if out.final:
                finals.setdefault(out.participant_id, []).append(out)
            elif out.text == PREAMBLE:
                started.add(out.participant_id)

    try:
        subscribed = asyncio.Event()
        tasks.append(asyncio.create_task(listen(subscribed)))
        await subscribed.wait()
        for pid in pids:
            await front.publish(UserQuery(participant_id=pid, text="slow story",
                                          message_id="t-1"))
        await until_true(lambda: started >= set(pids), "every long turn started")
        await until_true(lambda: metric_value(
            workers[0].metrics(), "turnrouter_nats_inflight_marks_total") >= len(pids),
            "every long turn marked in flight")
        kv = await nc.jetstream().key_value(config.bucket)
        for _ in range(300):  # the marks are written (bounded poll: at most 15 s)
            records = [parse_record((await kv.get(key)).value or b"")
                       for key in await kv.keys()]
            if sum(r.inflight == ["t-1"] for r in records) == len(pids):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the long turns were never all marked in flight")
        workers.append(await asyncio.to_thread(Worker, server.url, "heir"))
        tasks.append(asyncio.create_task(rewrite(nc, config, writing)))
        async with asyncio.timeout(15):
            await writing.wait()
        workers[0].signal(signal.SIGKILL)
        await asyncio.to_thread(server.crash)
        await asyncio.to_thread(server.restart)
        await until_true(lambda: set(finals) >= set(pids),
                         "every long turn ended after the restart", within=60)
        assert {pid: [(o.request_id, o.route, o.text) for o in finals[pid]]
                for pid in pids} == {pid: [("t-1", "none", FAILURE)] for pid in pids}
    finally:
        await cancelled(*tasks)
        await front.close()
        await nc.close()
        for worker in workers:
            worker.close()
        server.close()


async def test_a_takeover_serves_the_partition_while_it_reads_the_records(
        nats_server: NatsServer) -> None:
    """The records a takeover reads are answered late (a partition of thousands of
    participants on a loaded server): the new owner keeps pulling and answering the
    partition meanwhile, and then ends the turn the previous owner left in flight, before
    that participant's next turn. A record with only an answer in its outbox has it
    published again without being claimed (no write). Before, the takeover read and
    claimed every record one after another before pulling again: at 3,000 participants
    per replica that outlasted the failover timeout, the server moved the partition
    again, and takeovers repeated for a minute, ending running turns with the failure
    text.

    Held without touching the worker: its connection goes through a proxy that keeps
    the reads of the left turn's record from the server until the test releases them."""
    config = NatsConfig(url=nats_server.url, partitions=1)
    registry = CollectorRegistry()
    nc = await nats.connect(nats_server.url)
    kv = await nc.jetstream().create_key_value(KeyValueConfig(bucket=config.bucket,
                                                              history=1))
    zed, olga = f"0.{encode_token('zed')}", f"0.{encode_token('olga')}"
    await kv.put(zed, state_json("gone", ["t-left"], None))
    told = await kv.put(olga, state_json("gone", [], None,
                                         [("t-told", "echo", "told", time.time())]))
    record_subject = f"$KV.{config.bucket}.{zed}"
    try:
        async with heir(nats_server.port, config, reads_of(record_subject),
                        registry) as (worker, _, reads), listening(config) as (front, heard):
            async with asyncio.timeout(15):
                await worker.ready.wait()
            # amy is answered while the takeover waits for zed's record.
            assert (await ask(front, heard, "amy", "hello")).startswith("hello|")
            async with asyncio.timeout(15):
                await reads.event.wait()
            assert (await ask(front, heard, "amy", "still")).startswith("still|")
            async with asyncio.timeout(15):  # republished as recorded, unclaimed
                await heard.events.setdefault("t-told", asyncio.Event()).wait()
            assert "t-left" not in heard.finals
            # zed's next query waits for the takeover's claim of zed.
            later = UserQuery(participant_id="zed", text="again")
            await front.publish(later)
            reads.release()
            async with asyncio.timeout(15):
                await heard.events.setdefault(later.message_id, asyncio.Event()).wait()
            assert heard.order["zed"] == ["t-left", later.message_id]
            assert [(m.route, m.text) for m in heard.finals["t-left"]] == [
                ("none", FAILURE)]
            assert [(m.route, m.text) for m in heard.finals["t-told"]] == [
                ("echo", "told")]
            assert (await kv.get(olga)).revision == told
            exposition = generate_latest(registry).decode()
            assert metric_value(exposition, "turnrouter_nats_takeovers_total") == 1
            assert metric_value(exposition, "turnrouter_nats_partitions_lost_total") == 0
    finally:
        await nc.close()


async def test_a_held_answer_too_big_to_publish_ends_its_turn_with_the_failure_text(
        nats_server: NatsServer) -> None:
    """A record whose outbox holds an answer over this worker's `max_message_bytes` (a
    replica with a larger bound died holding it): the turn still ends audibly, with the
    failure text as its final output, and the participant goes on. Before, the answer
    was logged as too big and the turn got no final output at all (redteam7 D8)."""
    config = NatsConfig(url=nats_server.url, partitions=1)
    nc = await nats.connect(nats_server.url)
    kv = await nc.jetstream().create_key_value(KeyValueConfig(bucket=config.bucket,
                                                              history=1))
    await kv.put(f"0.{encode_token('olga')}", state_json(
        "gone", [], None, [("t-big", "echo", "x" * 70_000, time.time())]))
    try:
        async with listening(config) as (front, heard), serving(config, "heir"):
            async with asyncio.timeout(15):
                await heard.events.setdefault("t-big", asyncio.Event()).wait()
            assert [(m.route, m.text) for m in heard.finals["t-big"]] == [("none", FAILURE)]
            assert (await ask(front, heard, "olga", "next")).startswith("next|")
    finally:
        await nc.close()


@pytest.mark.parametrize("fate", ["stored late", "lost", "claimed by another", "stopped"])
async def test_a_takeover_claims_again_a_record_whose_claim_went_unanswered(
        nats_server: NatsServer, fate: str, caplog: pytest.LogCaptureFixture) -> None:
    """The new owner's claim of a record holding a turn in flight gets no reply in time
    (the write lost with the connection, or dropped by a server whose stream's ingest
    queue is full): the takeover claims the record again, and the turn ends with the
    failure text, once, with nobody talking. The first claim's write reaches the server
    after the worker gave up on it, or never. Before, a takeover's claim was made once,
    and the turn stayed in flight until its participant talked again (seen in the
    server-crash test above while its writer overfilled the server's queue). When
    another replica claimed the record meanwhile (the server moved the partition during
    an outage before this replica heard so), the takeover leaves it: a claim over the
    new owner's would end that owner's running turn with the failure text. A worker
    stopping does not wait for the takeover to try again (up to its 30 s).

    Held without touching the worker: its connection goes through a proxy that keeps
    the writes of the left turn's record from the server until the test lets them go."""
    caplog.set_level(logging.INFO, logger="turnrouter.runtime.nats")
    config = NatsConfig(url=nats_server.url, partitions=1)
    nc = await nats.connect(nats_server.url)
    kv = await nc.jetstream().create_key_value(KeyValueConfig(bucket=config.bucket,
                                                              history=1))
    zed = f"0.{encode_token('zed')}"
    await kv.put(zed, state_json("gone", ["t-left"], None))
    record_subject = f"$KV.{config.bucket}.{zed}"
    try:
        async with heir(nats_server.port, config,
                        lambda subject, _: subject == record_subject,
                        CollectorRegistry()) as (worker, run, writes), \
                listening(config) as (front, heard):
            async with asyncio.timeout(15):
                await worker.ready.wait()
            # amy's turn gives the partition to the worker, whose takeover claims
            # zed's record: that write is held, gets no reply, and is made again.
            assert (await ask(front, heard, "amy", "hello")).startswith("hello|")
            if fate == "claimed by another":
                async with asyncio.timeout(30):
                    await writes.holding(1)  # the worker read the record, then wrote
                await kv.put(zed, state_json("newer", ["t-new"], None))
                await until_true(lambda: any(
                    "another replica claimed" in r.getMessage() for r in caplog.records),
                    "the takeover left the record")
                writes.drop(len(writes.held))
                writes.release()
                record = parse_record((await kv.get(zed)).value or b"")
                assert (record.owner, record.inflight) == ("newer", ["t-new"])
                assert "t-left" not in heard.finals
                return
            if fate == "stopped":
                async with asyncio.timeout(30):
                    await writes.holding(1)
                worker.request_stop()
                async with asyncio.timeout(15):  # the claim's 5 s, not the scan's 30
                    await run
                return
            async with asyncio.timeout(30):
                await writes.holding(2)
            if fate == "lost":
                writes.drop(1)
            writes.release()
            async with asyncio.timeout(15):
                await heard.events.setdefault("t-left", asyncio.Event()).wait()
            assert [(m.route, m.text) for m in heard.finals["t-left"]] == [
                ("none", FAILURE)]
            assert parse_record((await kv.get(zed)).value or b"").inflight == []
            assert "zed" not in heard.order or heard.order["zed"] == ["t-left"]
            # Logged the first time (then at every power of ten), with the count.
            assert [r.getMessage() for r in caplog.records
                    if "claim failed" in r.getMessage()] == [
                "turnrouter: participant claim failed (1 so far): TimeoutError()"]
    finally:
        await nc.close()


async def test_a_record_whose_claim_keeps_failing_holds_up_no_other(
        nats_server: NatsServer) -> None:
    """65 records of one partition hold a turn left in flight (one more than a takeover
    reads at a time), and one of them can never be claimed (its writes never reach the
    server): the 64 others end with the failure text, each once. The claims that
    failed are made again once every record was read; before, the failing one's
    retries held up the records after its batch until the takeover's 30 s were over,
    and those turns stayed in flight."""
    config = NatsConfig(url=nats_server.url, partitions=1)
    nc = await nats.connect(nats_server.url)
    kv = await nc.jetstream().create_key_value(KeyValueConfig(bucket=config.bucket,
                                                              history=1))
    pids = [f"p{k:02d}" for k in range(65)]
    for k, pid in enumerate(pids):
        await kv.put(f"0.{encode_token(pid)}", state_json("gone", [f"t-left-{k}"], None))
    poisoned = f"$KV.{config.bucket}.0.{encode_token(pids[0])}"
    try:
        async with heir(nats_server.port, config, lambda subject, _: subject == poisoned,
                        CollectorRegistry()) as (worker, _, writes), \
                listening(config) as (front, heard):
            async with asyncio.timeout(15):
                await worker.ready.wait()
            ended = asyncio.Event()  # the 64 turns and amy's answer
            heard.waiters.append((heard.count + 64 + 1, ended))
            assert (await ask(front, heard, "amy", "hello")).startswith("hello|")
            async with asyncio.timeout(25):  # under the takeover's 30 s
                await ended.wait()
            writes.drop(len(writes.held))
            assert {turn: [(m.route, m.text) for m in heard.finals[turn]]
                    for turn in heard.finals if turn.startswith("t-left-")} == {
                f"t-left-{k}": [("none", FAILURE)] for k in range(1, 65)}
    finally:
        await nc.close()


def _partition_read(api: str, payload: bytes, bucket: str) -> int | None:
    """The partition whose record a JetStream API request reads (`STREAM.MSG.GET` of
    the bucket's stream, its subject in the payload; or a direct get naming it), else
    None."""
    root = f"$KV.{bucket}."
    if api == f"$JS.API.STREAM.MSG.GET.KV_{bucket}":
        subject = json.loads(payload).get("last_by_subj", "")
    elif api.startswith(f"$JS.API.DIRECT.GET.KV_{bucket}."):
        subject = api.split(".", 5)[-1]
    else:
        return None
    return int(subject[len(root):].split(".", 1)[0]) if subject.startswith(root) else None


def _partition_listed(api: str, payload: bytes, bucket: str) -> int | None:
    """The partition whose keys a takeover's listing request asks for (`STREAM.INFO`
    of the bucket's stream with a subject filter), else None."""
    if api != f"$JS.API.STREAM.INFO.KV_{bucket}" or b"subjects_filter" not in payload:
        return None
    filtered = json.loads(payload).get("subjects_filter")
    return int(filtered.split(".")[2]) if isinstance(filtered, str) else None


async def test_the_takeovers_of_a_populated_bucket_read_few_records_at_once(
        nats_server: NatsServer) -> None:
    """A replica taking every partition of a bucket that holds many records (at its
    start, or its own partitions back after it lost them) reads those records a bounded
    number at a time across all its takeovers (64, each its share), in about as many
    tasks. Before, each of its 16 takeovers read 64 at a time: ~1,000 reads and tasks
    under way, every input's own read of a record (a claim, the refusal of a query that
    waited too long) queued behind them, and a flood of new participants arriving then
    held a partition's message past `ack_wait` (redelivered: its query ended with the
    failure text) and its pin past `failover_timeout`: a lone worker lost its own
    partitions and took them back, reading every record again (redteam14 D3).

    Counted, not timed: a proxy holds the takeovers' listings of their keys until all 16
    asked (each scan under way), then their reads of records, never answered, until a
    read of every partition is held; the tasks and reads under way then are counted."""
    config = NatsConfig(url=nats_server.url)
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await js.create_key_value(KeyValueConfig(bucket=config.bucket, history=1))
    bucket = config.bucket
    await asyncio.gather(*(
        js.publish(f"$KV.{bucket}.{n}.{encode_token(f'old-{n}-{i}')}",
                   state_json("gone", [], None, [], ["t-1"]))
        for n in range(config.partitions) for i in range(80)))
    listed: set[int] = set()
    reading: set[int] = set()

    def listing(api: str, payload: bytes) -> bool:
        n = _partition_listed(api, payload, bucket)
        if n is not None:
            listed.add(n)
        return n is not None

    def read(api: str, payload: bytes) -> bool:
        n = _partition_read(api, payload, bucket)
        if n is not None:
            reading.add(n)
        return n is not None

    every = set(range(config.partitions))
    try:
        async with proxied(nats_server.port) as proxy:
            listings, reads = proxy.hold(listing), proxy.hold(read)
            worker = NatsWorker(make_router, dataclasses.replace(config, url=proxy.url),
                                registry=CollectorRegistry(), replica="heir")
            run = asyncio.create_task(worker.run())
            try:
                async with asyncio.timeout(30):
                    while listed != every:  # every takeover is under way, listing
                        await listings.holding(len(listings.held) + 1)
                before = len(asyncio.all_tasks())
                listings.release()
                async with asyncio.timeout(30):
                    while reading != every:  # every takeover has its first reads out
                        await reads.holding(len(reads.held) + 1)
                grown = len(asyncio.all_tasks()) - before
                held = len(reads.held)
            finally:
                reads.release()
                worker.request_stop()
                async with asyncio.timeout(30):
                    await asyncio.gather(run, return_exceptions=True)
    finally:
        await nc.close()
    assert held <= 64, f"{held} reads of records under way at once"
    assert grown <= 128, f"{grown} more tasks once the takeovers read records"
