"""A new `outputs()` reader whose consumer the server refuses (the consumer slots taken)
asks again for `READER_PATIENCE` seconds, then says why (redteam18 F4: it raised at
once "cannot read the output stream", as if the stream were missing)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest

import nats
from turnrouter import LifecycleError
from turnrouter.runtime.nats import READER_PATIENCE, NatsConfig, NatsFrontEnd

from .conftest import NatsServer, until_true
from .crowd import serving

pytestmark = pytest.mark.anyio


async def api(nc: Any, subject: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    reply = await nc.request(subject, json.dumps(body or {}).encode(), timeout=5)
    answer: dict[str, Any] = json.loads(reply.data)
    assert "error" not in answer, answer
    return answer


async def test_a_reader_refused_a_consumer_retries_then_says_why(
        nats_server: NatsServer) -> None:
    """The output stream takes one consumer, held by another client: a reader retries
    (counted in `readers_refused`) and reads once the slot is free; a second reader,
    refused for `READER_PATIENCE`, raises `LifecycleError` quoting the server's reason."""
    config = NatsConfig(url=nats_server.url)
    front = await NatsFrontEnd.connect(config)
    other = await NatsFrontEnd.connect(config)
    nc = await nats.connect(nats_server.url)
    reader: asyncio.Task[None] | None = None
    try:
        stream = (await api(nc, f"$JS.API.STREAM.INFO.{config.output_stream}"))["config"]
        await api(nc, f"$JS.API.STREAM.DELETE.{config.output_stream}")
        await api(nc, f"$JS.API.STREAM.CREATE.{config.output_stream}",
                  {**stream, "max_consumers": 1})
        held = await api(nc, f"$JS.API.CONSUMER.CREATE.{config.output_stream}",
                         {"stream_name": config.output_stream,
                          "config": {"deliver_subject": "somewhere", "ack_policy": "none",
                                     "inactive_threshold": 60 * 10**9}})
        subscribed = asyncio.Event()

        async def read() -> None:
            async for _ in front.outputs(subscribed=subscribed):
                pass

        reader = asyncio.create_task(read())
        await until_true(lambda: front.readers_refused >= 1, "a refusal", within=10)
        assert not subscribed.is_set()
        await api(nc, f"$JS.API.CONSUMER.DELETE.{config.output_stream}.{held['name']}")
        async with asyncio.timeout(READER_PATIENCE):
            await subscribed.wait()

        async def read_other() -> None:
            async with asyncio.timeout(READER_PATIENCE + 5):
                async for _ in other.outputs():
                    pass

        with pytest.raises(LifecycleError,
                           match=r"refused the reader's consumer.*maximum consumers"):
            await read_other()
        assert other.readers_refused >= 2
    finally:
        if reader is not None:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        await nc.close()
        await other.close()
        await front.close()


async def test_a_consumer_may_not_hold_its_slot_past_the_cap(
        nats_server: NatsServer, caplog: pytest.LogCaptureFixture) -> None:
    """The output stream caps its consumers' inactivity threshold (60 s): a client asking
    10 years is refused by the server (before, accepted: an unread consumer held its slot
    until an operator removed it). An output stream made before the cap is taken as it
    is, with a warning, so an upgrade does not stop the fleet."""
    config = NatsConfig(url=nats_server.url, partitions=1)
    front = await NatsFrontEnd.connect(config)
    nc = await nats.connect(nats_server.url)
    try:
        stream = config.output_stream
        reply = await nc.request(f"$JS.API.CONSUMER.CREATE.{stream}", json.dumps(
            {"stream_name": stream, "config": {
                "deliver_subject": "somewhere", "ack_policy": "none",
                "inactive_threshold": 10 * 365 * 86400 * 10**9}}).encode(), timeout=5)
        assert "inactive threshold exceeds" in json.loads(reply.data)["error"]["description"]
        old = (await api(nc, f"$JS.API.STREAM.INFO.{stream}"))["config"]
        await api(nc, f"$JS.API.STREAM.DELETE.{stream}")
        del old["consumer_limits"]
        await api(nc, f"$JS.API.STREAM.CREATE.{stream}", old)
        with caplog.at_level(logging.WARNING, logger="turnrouter.runtime.nats"):
            async with serving(config, "upgraded"):
                pass
        assert "inactive threshold" in caplog.text
    finally:
        await nc.close()
        await front.close()
