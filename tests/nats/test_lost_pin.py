"""A partition's pin moves while its owner's turn is marked in flight, after the new
owner's takeover read the records: the old owner ends that turn itself."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

import nats
from turnrouter.runtime import UserQuery
from turnrouter.runtime.nats import NatsConfig, NatsFrontEnd, encode_token, parse_record

from .conftest import NatsServer, Worker, metric_value, until_true
from .crowd import FAILURE, Heard, listen

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
    front = await NatsFrontEnd.connect(config)
    heard = Heard()
    ready = asyncio.Event()
    listener = asyncio.create_task(listen(front, heard, ready))
    nc = await nats.connect(nats_server.url)
    try:
        await ready.wait()
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
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        await nc.close()
        await front.close()
        worker.close()
