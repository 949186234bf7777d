"""Timing samples shared by the fleet, against a real nats-server and an in-process
worker: batched, flushed at a graceful end, junk refused line by line."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from prometheus_client import CollectorRegistry, generate_latest

import nats
from turnrouter import AgentRouter, AgentTurn, Prediction, TimingSample
from turnrouter.runtime.nats import NatsConfig, NatsWorker, WorkerContext, samples_body
from turnrouter.telemetry import Telemetry

from .app import Always, Echo
from .conftest import NatsServer, metric_value, settled, until_true

pytestmark = pytest.mark.anyio


class Learner:
    """A timing predictor that keeps what the fleet taught it and says when a sample of
    route `until` arrives."""

    def __init__(self, until: str) -> None:
        self.learned: list[TimingSample] = []
        self.until = until
        self.arrived = asyncio.Event()

    def predict(self, route: str, turn: AgentTurn) -> Prediction | None:
        return None

    def record(self, sample: TimingSample, turn: AgentTurn | None = None) -> None:
        self.learned.append(sample)
        if sample.route == self.until:
            self.arrived.set()

    def estimate(self, route: str) -> float | None:
        return None


class Running:
    """An in-process worker whose factory hands over its context and learner."""

    def __init__(self, url: str, learner: Learner) -> None:
        self.registry = CollectorRegistry()
        self.learner = learner
        self.ctx: WorkerContext | None = None
        self.worker = NatsWorker(self._make, NatsConfig(url=url), registry=self.registry,
                                 replica="fleet-test")

    def _make(self, ctx: WorkerContext) -> AgentRouter:
        self.ctx = ctx
        ctx.learn_from_fleet(self.learner)
        echo = Echo(ctx, 0.0)
        # Fleet samples are learned for the router's own routes only.
        return AgentRouter({"echo": echo, "good": echo, "sentinel": echo}, Always(),
                           default_destination="echo",
                           telemetry=Telemetry(registry=ctx.registry),
                           timing_sink=ctx.timing_sink)

    def value(self, name: str, labels: str = "") -> float:
        return metric_value(generate_latest(self.registry).decode(), name, labels)


@pytest.fixture
async def running(nats_server: NatsServer) -> AsyncIterator[Running]:
    r = Running(nats_server.url, Learner(until="sentinel"))
    task = asyncio.create_task(r.worker.run())
    async with asyncio.timeout(15):
        await r.worker.ready.wait()
    try:
        yield r
    finally:
        r.worker.request_stop()
        async with asyncio.timeout(20):
            await task


PEER = {"Turnrouter-Replica": "peer"}  # the publisher every fleet sample names


def sample(route: str, seconds: float = 0.25) -> TimingSample:
    return TimingSample(route, seconds, at=1_700_000_000.0)


async def test_samples_go_out_in_batches_and_the_rest_at_a_graceful_end(
        nats_server: NatsServer) -> None:
    """130 samples recorded at once leave as messages of 64, 64 and, once the worker
    stops, the last 2: none lost, each counted as sent."""
    config = NatsConfig(url=nats_server.url)
    nc = await nats.connect(nats_server.url)
    bodies: list[bytes] = []
    got_all = asyncio.Event()

    async def keep(msg: Msg) -> None:
        bodies.append(msg.data)
        if sum(body.count(b"\n") + 1 for body in bodies) >= 130:
            got_all.set()

    await nc.subscribe(config.timing_subject, cb=keep)
    await settled(nc)
    r = Running(nats_server.url, Learner(until="-"))
    task = asyncio.create_task(r.worker.run())
    try:
        async with asyncio.timeout(15):
            await r.worker.ready.wait()
        assert r.ctx is not None
        for i in range(130):
            r.ctx.timing_sink.record(sample(f"route{i}"))
        r.worker.request_stop()  # before the 50 ms flush of the last two
        async with asyncio.timeout(20):
            await task
            await got_all.wait()
    finally:
        await nc.close()
    lines = [line for body in bodies for line in body.decode().split("\n")]
    assert [body.count(b"\n") + 1 for body in bodies] == [64, 64, 2]
    assert [TimingSample.from_json(line).route for line in lines] == [
        f"route{i}" for i in range(130)]
    assert r.value("turnrouter_nats_timing_samples_total", 'direction="sent"') == 130
    assert r.value("turnrouter_nats_timing_samples_total", 'direction="dropped"') == 0


async def test_a_lone_sample_is_sent_within_the_flush_interval(
        nats_server: NatsServer, running: Running) -> None:
    """One sample does not wait for a full batch: it goes out on its own."""
    nc = await nats.connect(nats_server.url)
    arrived: asyncio.Queue[bytes] = asyncio.Queue()

    async def keep(msg: Msg) -> None:
        arrived.put_nowait(msg.data)

    try:
        await nc.subscribe(NatsConfig().timing_subject, cb=keep)
        await settled(nc)
        assert running.ctx is not None
        running.ctx.timing_sink.record(sample("alone"))
        async with asyncio.timeout(10):
            body = await arrived.get()
    finally:
        await nc.close()
    assert TimingSample.from_json(body.decode()).route == "alone"


async def announce(nc: Client, running: Running) -> None:
    """`PEER` says it is live on presence (fleet samples of no live replica are refused)."""
    await nc.publish(f"{NatsConfig().prefix}.presence",
                     b'{"replica": "peer", "owned": 0}')
    await nc.flush()
    partitions = NatsConfig().partitions
    await until_true(lambda: running.worker.fleet.fair_share() < partitions,
                     "the peer is live")


async def test_fleet_samples_far_from_the_replicas_own_are_refused(
        nats_server: NatsServer, running: Running) -> None:
    """Once this replica measured a route itself (4 recent samples), a fleet sample more
    than 8x away from the median of its own is refused (`outlier`): the fleet cannot
    move what a replica measures; samples within the band are learned."""
    assert running.ctx is not None
    for seconds in (0.4, 0.5, 0.5, 0.6):
        running.ctx.timing_sink.record(sample("good", seconds))
    nc = await nats.connect(nats_server.url)
    try:
        await announce(nc, running)
        body = samples_body([sample("good", seconds).to_json()
                             for seconds in (0.5, 3.9, 4.1, 500.0, 0.06, 0.3)])
        await nc.publish(NatsConfig().timing_subject, body, headers=PEER)
        await nc.publish(NatsConfig().timing_subject, sample("sentinel").to_json().encode(),
                         headers=PEER)
        async with asyncio.timeout(10):
            await running.learner.arrived.wait()
    finally:
        await nc.close()
    assert [(s.route, s.seconds) for s in running.learner.learned] == [
        ("good", 0.5), ("good", 3.9), ("good", 0.3), ("sentinel", 0.25)]
    assert running.value("turnrouter_runtime_rejected_messages_total",
                         'reason="outlier",topic="nats_timing"') == 3


async def test_junk_on_the_timing_subject_is_refused_line_by_line(
        nats_server: NatsServer, running: Running) -> None:
    """Non-UTF-8, oversized and malformed messages are refused and counted; in a batch
    with bad lines the good ones are still learned; a message in the worker's own name
    that it did not send is refused, not learned (its own come back and are skipped:
    tests/nats/test_fleet_guard.py)."""
    config = NatsConfig()
    nc = await nats.connect(nats_server.url)
    good = [sample("good", 0.5).to_json(), sample("good", 1.5).to_json()]
    try:
        await announce(nc, running)
        for body in (b"\xff\xfe", b"x" * (config.max_message_bytes + 1), b"[1, 2]",
                     samples_body([good[0], "{not json", '{"route": "", "seconds": 1}',
                                   "[" * 10_000, good[1], ""]),
                     b'{"route": "r", "seconds": 1e999}'):
            await nc.publish(config.timing_subject, body, headers=PEER)
        await nc.publish(config.timing_subject, sample("own").to_json().encode(),
                         headers={"Turnrouter-Replica": "fleet-test"})
        await nc.publish(config.timing_subject, sample("sentinel").to_json().encode(),
                         headers=PEER)
        async with asyncio.timeout(10):  # one subscription: handled in publish order
            await running.learner.arrived.wait()
    finally:
        await nc.close()
    assert [(s.route, s.seconds) for s in running.learner.learned] == [
        ("good", 0.5), ("good", 1.5), ("sentinel", 0.25)]
    rejected = "turnrouter_runtime_rejected_messages_total"
    assert running.value(rejected, 'reason="oversized",topic="nats_timing"') == 1
    # non-UTF-8, a list, 3 bad lines of the batch, an infinite number, the forged own
    assert running.value(rejected, 'reason="invalid",topic="nats_timing"') == 7
    assert running.value("turnrouter_nats_timing_samples_total",
                         'direction="received"') == 3


async def test_another_worker_with_this_replicas_name_is_warned_of(
        nats_server: NatsServer, running: Running, caplog: pytest.LogCaptureFixture) -> None:
    """redteam22 N1: a second worker given a running replica's `--replica` (a fixed name
    in a scaled Deployment) started, said ready and sat idle, with no word: the fleet
    took the two for one. Each worker now tags its presence with an id of its own
    process; another id under this replica's name is logged once (a presence without
    the tag, an older replica's, is not: it cannot tell)."""
    nc = await nats.connect(nats_server.url)
    subject = f"{NatsConfig().prefix}.presence"
    body = b'{"replica": "fleet-test", "owned": 0}'
    try:
        with caplog.at_level(logging.WARNING, logger="turnrouter.runtime.nats"):
            await nc.publish(subject, body)
            for _ in range(3):
                await nc.publish(subject, body, headers={"Turnrouter-Instance": "0" * 16})
            await nc.flush()
            await until_true(lambda: "announces this replica's name" in caplog.text,
                             "the twin is warned of")
    finally:
        await nc.close()
    warnings = [r for r in caplog.records if "announces this replica's name" in r.getMessage()]
    assert len(warnings) == 1
    assert "'fleet-test' (--replica)" in warnings[0].getMessage()
