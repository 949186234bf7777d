"""Probes are inputs of their partition: each partition's consumer reads through one
filter subject (a second one, for probes, made the server's CPU per input grow with the
number of participants queued), and a deployment an earlier turnrouter made (two
filters per consumer, probes on `<prefix>.probe.<n>`) is used as it is."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

import nats
from turnrouter.runtime.nats import NatsConfig, NatsFrontEnd, NatsWorker

from .app import make_router
from .conftest import NatsServer
from .test_lost_pin import pin_holder
from .test_reader_slots import api as _api

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("partitions", [1, 2, 3, 7, 16, 64])
async def test_a_probe_is_stored_in_the_partition_it_probes(
        nats_server: NatsServer, partitions: int) -> None:
    """The probe subject of partition `n` is an input subject whose token the server's
    `partition()` transform sends to `n`, for any partition count."""
    config = NatsConfig(url=nats_server.url, partitions=partitions,
                        prefix=f"probes{partitions}")
    front = await NatsFrontEnd.connect(config)  # (creates the input stream)
    try:
        js = front.connection.jetstream()
        for n in range(partitions):
            subject = config.probe_subject(n)
            token = subject.split(".")[2]
            assert subject == f"{config.prefix}.in.{token}.probe"
            ack = await js.publish(subject, b"")
            stored = await _api(front.connection, f"$JS.API.STREAM.MSG.GET.{config.stream}",
                                {"seq": ack.seq})
            assert stored["message"]["subject"] == f"{config.prefix}.p.{n}.{token}.probe"
    finally:
        await front.close()


async def _watch(nc: Any, subject: str) -> tuple[Any, asyncio.Queue[str]]:
    seen: asyncio.Queue[str] = asyncio.Queue()

    async def put(msg: Any) -> None:
        # A probe's id names its subject form: a probe on the earlier subject (a stale
        # worker's) cannot dedupe away one on the newer (review20 F2).
        if msg.headers and msg.headers.get("Nats-Msg-Id"):
            assert msg.headers["Nats-Msg-Id"].startswith(msg.subject + "."), msg.headers
            # ... and holds more than its window: the fleet's key, which nobody
            # without it can guess to take the id first (redteam21 F1).
            window, _, key = msg.headers["Nats-Msg-Id"][len(msg.subject) + 1:].partition(".")
            assert window.isdigit() and len(key) >= 16, msg.headers
        await seen.put(msg.subject)
    return await nc.subscribe(subject, cb=put), seen


async def _probed(config: NatsConfig, nc: Any, n: int) -> str:
    """The subject on which a worker probes partition `n` while a client holds its pin
    (so the worker owns every partition but `n`); the deployment exists."""
    watched = [await _watch(nc, f"{config.prefix}.probe.*"),
               await _watch(nc, f"{config.prefix}.in.*.probe")]
    try:
        async with pin_holder(nc, config, n) as pinned:
            for _ in range(40):  # a probe of our own pins the holder: at most 20 s
                for subject in (config.probe_subject(n), config.legacy_probe_subject(n)):
                    await nc.publish(subject, b"")
                try:
                    async with asyncio.timeout(0.5):
                        await pinned.wait()
                    break
                except TimeoutError:
                    continue
            assert pinned.is_set()
            worker = NatsWorker(make_router, config, registry=CollectorRegistry())
            running = asyncio.create_task(worker.run())
            try:
                async with asyncio.timeout(30):
                    await worker.ready.wait()
                for _, seen in watched:  # forget our own probes
                    while not seen.empty():
                        seen.get_nowait()
                async with asyncio.timeout(15):  # the worker probes every 0.5 s
                    while True:
                        getters = [asyncio.ensure_future(seen.get()) for _, seen in watched]
                        done, pending = await asyncio.wait(
                            getters, return_when=asyncio.FIRST_COMPLETED)
                        for getter in pending:
                            getter.cancel()
                        probes = [getter.result() for getter in done]
                        wanted = [subject for subject in probes if subject in (
                            config.probe_subject(n), config.legacy_probe_subject(n))]
                        if wanted:
                            return wanted[0]
            finally:
                worker.request_stop()
                async with asyncio.timeout(30):
                    await running
    finally:
        for sub, _ in watched:
            await sub.unsubscribe()


async def deployed(config: NatsConfig) -> None:
    """The deployment as a worker makes it (the worker stopped)."""
    worker = NatsWorker(make_router, config, registry=CollectorRegistry())
    running = asyncio.create_task(worker.run())
    async with asyncio.timeout(30):
        await worker.ready.wait()
    worker.request_stop()
    async with asyncio.timeout(30):
        await running


async def test_each_partition_is_read_through_one_filter_and_probed_on_its_input(
        nats_server: NatsServer) -> None:
    config = NatsConfig(url=nats_server.url, partitions=2)
    nc = await nats.connect(nats_server.url)
    try:
        await deployed(config)
        assert await _probed(config, nc, 1) == config.probe_subject(1)
        for n in range(config.partitions):
            held = (await _api(nc, f"$JS.API.CONSUMER.INFO.{config.stream}."
                                   f"{config.consumer(n)}"))["config"]
            assert held["filter_subject"] == f"{config.prefix}.p.{n}.>"
            assert not held.get("filter_subjects")
        stream = (await _api(nc, f"$JS.API.STREAM.INFO.{config.stream}"))["config"]
        assert stream["subjects"] == [f"{config.prefix}.in.*.*"]
    finally:
        await nc.close()


async def test_a_deployment_an_earlier_turnrouter_made_is_used_as_it_is(
        nats_server: NatsServer, caplog: pytest.LogCaptureFixture) -> None:
    """Stream and consumers in the earlier form (probe subjects in the stream, a second
    filter per consumer): a worker starts on them, says once how to take the newer
    form, changes nothing, and probes where those consumers read."""
    config = NatsConfig(url=nats_server.url, partitions=2)
    nc = await nats.connect(nats_server.url)
    try:
        front = await NatsFrontEnd.connect(config)  # the input stream, newer form
        await front.close()
        stream = (await _api(nc, f"$JS.API.STREAM.INFO.{config.stream}"))["config"]
        stream["subjects"] = [*stream["subjects"], *(
            config.legacy_probe_subject(n) for n in range(config.partitions))]
        await _api(nc, f"$JS.API.STREAM.UPDATE.{config.stream}", stream)
        for n in range(config.partitions):
            await _api(nc, f"$JS.API.CONSUMER.CREATE.{config.stream}.{config.consumer(n)}", {
                "stream_name": config.stream, "action": "create", "config": {
                    "durable_name": config.consumer(n),
                    "filter_subjects": [f"{config.prefix}.p.{n}.>",
                                        config.legacy_probe_subject(n)],
                    "ack_policy": "explicit", "ack_wait": int(config.ack_wait * 1e9),
                    "max_ack_pending": 1, "deliver_policy": "all",
                    "priority_policy": "pinned_client", "priority_groups": ["turnrouter"],
                    "priority_timeout": int(config.failover_timeout * 1e9)}})
        with caplog.at_level(logging.WARNING, logger="turnrouter.runtime.nats"):
            assert await _probed(config, nc, 1) == config.legacy_probe_subject(1)
        said = [r.getMessage() for r in caplog.records if "earlier turnrouter" in
                r.getMessage() and "consumer" in r.getMessage()]
        assert said and "nats consumer rm" in said[0], said
        for n in range(config.partitions):  # unchanged
            held = (await _api(nc, f"$JS.API.CONSUMER.INFO.{config.stream}."
                                   f"{config.consumer(n)}"))["config"]
            assert held["filter_subjects"] == [f"{config.prefix}.p.{n}.>",
                                               config.legacy_probe_subject(n)]
        # A front end of this turnrouter connects to the earlier stream too.
        front = await NatsFrontEnd.connect(config)
        await front.close()
    finally:
        await nc.close()
