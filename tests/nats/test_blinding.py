"""A front end sharing the `frontend` credential can change another's output consumer
(redteam18 F1): it learns the consumer's name (from the deliveries' reply subjects) and
its deliver subject (from its idle heartbeats) under the inbox prefix all front ends
share, and "creates" a consumer of that name with a filter that reads nothing, which
the server takes as an update. The reader then heard nothing, and nothing said so: its
heartbeats kept coming. It now notices its idle consumer leaving a stored output unread,
makes it again from the last output read (none lost), logs and counts it in
`readers_starved`."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest

import nats
from turnrouter.runtime.nats import NatsFrontEnd

from .conftest import NatsServer, Worker
from .crowd import Heard, ask, listen
from .test_trust import PASSWORDS, WORKER_ENV, frontend_config, locked

pytestmark = pytest.mark.anyio
__all__ = ["locked"]  # (the fixture of the shipped configuration, used by name)


async def test_a_reader_whose_consumer_another_front_end_changed_reads_again(
        locked: NatsServer, caplog: pytest.LogCaptureFixture) -> None:
    worker = Worker(locked.url, "locked", "--nats-user", "worker", env=WORKER_ENV)
    front = await NatsFrontEnd.connect(frontend_config(locked.url))
    attacker = await nats.connect(locked.url, user="frontend",
                                  password=PASSWORDS["TURNROUTER_FRONTEND_PASSWORD"],
                                  inbox_prefix="_INBOX_turnrouter_frontend")
    heard, ready = Heard(), asyncio.Event()
    reader = asyncio.create_task(listen(front, heard, ready))
    try:
        async with asyncio.timeout(15):
            await ready.wait()
        names: set[str] = set()
        inboxes: set[str] = set()
        sniffed = asyncio.Event()

        async def sniff(msg: Any) -> None:
            if msg.reply and msg.reply.startswith("$JS.ACK.TURNROUTER_OUT."):
                names.add(msg.reply.split(".")[3])
            elif names and (msg.headers or {}).get("Status") == "100" and not msg.reply:
                inboxes.add(msg.subject)  # an idle heartbeat, on the deliver subject
                sniffed.set()

        await attacker.subscribe("_INBOX_turnrouter_frontend.>", cb=sniff)
        assert await ask(front, heard, "ann", "hello") == "hello|-|N"
        async with asyncio.timeout(5):
            await sniffed.wait()
        assert len(names) == 1 and len(inboxes) == 1
        config = {"name": names.pop(), "deliver_subject": inboxes.pop(),
                  "deliver_policy": "new", "ack_policy": "none", "mem_storage": True,
                  "filter_subject": "turnrouter.out.nobody", "idle_heartbeat": 500_000_000,
                  "flow_control": True}
        reply = await attacker.request(
            "$JS.API.CONSUMER.CREATE.TURNROUTER_OUT",
            json.dumps({"stream_name": "TURNROUTER_OUT", "config": config}).encode(),
            timeout=5)
        answer = json.loads(reply.data)
        assert answer.get("config", {}).get("filter_subject") == "turnrouter.out.nobody", (
            answer)  # the attack took: the reader's consumer reads nothing now
        assert front.readers_starved == 0
        with caplog.at_level(logging.WARNING, logger="turnrouter.runtime.nats"):
            async with asyncio.timeout(10):  # (before: never answered)
                assert await ask(front, heard, "bob", "after") == "after|-|N"
        assert front.readers_starved == 1
        assert "left output" in caplog.text
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        await attacker.close()
        await front.close()
        worker.close()
