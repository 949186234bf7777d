"""A fleet on a three-server NATS cluster (streams and bucket replicated three times):
the loss of a server, its leader of the streams included, costs no turn and no history
(docs/distributed.md, "A NATS cluster")."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Callable, Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.msg import Msg
from prometheus_client import CollectorRegistry

import nats
from turnrouter import ConfigurationError
from turnrouter.runtime.nats import (
    STALL_SECS,
    NatsConfig,
    NatsFrontEnd,
    NatsWorker,
)

from .app import make_router
from .cluster import NatsCluster
from .conftest import Worker, cancelled, until_true
from .proxy import proxied
from .test_durability import Talk, pids

pytestmark = pytest.mark.anyio


async def explain(front: NatsFrontEnd, config: NatsConfig, workers: list[Worker]) -> None:
    """Print each partition consumer's state and the workers' logs (bounded requests)."""
    for n in range(config.partitions):
        try:
            info = json.loads((await front.connection.request(
                f"$JS.API.CONSUMER.INFO.{config.stream}.{config.consumer(n)}", b"",
                timeout=2)).data)
        except Exception as exc:  # the report goes on: one partition's state is missing
            print(f"partition {n}: {exc!r}")
            continue
        print(f"partition {n}:", {key: info.get(key) for key in (
            "num_pending", "num_ack_pending", "num_waiting", "delivered", "ack_floor",
            "cluster", "priority_groups")})
    for worker in workers:
        print(f"worker {worker.name}:", worker.stderr()[-4000:])


@pytest.fixture
def cluster() -> Iterator[NatsCluster]:
    made = NatsCluster()
    try:
        yield made
    finally:
        made.close()


async def test_a_fleet_on_a_cluster_keeps_its_streams_and_bucket_replicated(
        cluster: NatsCluster) -> None:
    """`--replicas 3` makes both streams and the state bucket with three copies; a worker
    configured with another count is refused at start, naming the setting."""
    worker = Worker(cluster.url, "r3", "--replicas", "3")
    try:
        front = await NatsFrontEnd.connect(NatsConfig(url=cluster.url, replicas=3))
        try:
            nc = front.connection
            for stream in ("TURNROUTER_IN", "TURNROUTER_OUT", "KV_turnrouter_state"):
                info = json.loads((await nc.request(
                    f"$JS.API.STREAM.INFO.{stream}", b"", timeout=5)).data)
                assert info["config"]["num_replicas"] == 3, (stream, info)
        finally:
            await front.close()
        stray = NatsWorker(make_router, NatsConfig(url=cluster.url),
                           registry=CollectorRegistry())
        with pytest.raises(ConfigurationError, match="replicas 3 there, 1 here"):
            async with asyncio.timeout(30):
                await stray.run()
    finally:
        worker.close()


async def test_a_worker_started_while_a_server_of_the_cluster_is_down_waits_for_it(
        cluster: NatsCluster) -> None:
    """A worker started with `--replicas 3` while one of the three servers is down (a
    rolling restart) cannot make its streams yet: it says so, tries again, and serves
    once the server is back."""
    down = cluster.servers[2]
    await asyncio.to_thread(down.crash)
    failed = asyncio.Event()

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "set-up attempt" in record.getMessage():
                failed.set()

    watch = Watch()
    logger = logging.getLogger("turnrouter.runtime.nats")
    logger.addHandler(watch)
    worker = NatsWorker(make_router, NatsConfig(url=cluster.url, replicas=3),
                        replica="early", registry=CollectorRegistry())
    run = asyncio.create_task(worker.run())
    try:
        async with asyncio.timeout(60):
            await failed.wait()
        assert not worker.ready.is_set() and not run.done()
        await asyncio.to_thread(down.restart)
        async with asyncio.timeout(90):
            await worker.ready.wait()
    finally:
        logger.removeHandler(watch)
        worker.request_stop()
        async with asyncio.timeout(30):
            await asyncio.gather(run, return_exceptions=True)
    assert run.exception() is None


#: The stream whose leader a test kills, from the configuration.
LEADS: dict[str, Callable[[NatsConfig], str]] = {
    "input": lambda config: config.stream,
    "output": lambda config: config.output_stream,
    "bucket": lambda config: f"KV_{config.bucket}",
}


@pytest.mark.parametrize("stream", LEADS)
async def test_kill_nine_of_a_streams_leader_history_equals_what_was_heard(
        cluster: NatsCluster, stream: str) -> None:
    """kill -9 of the server leading the input stream, the output stream or the
    bucket while turns run on two workers (half answered at once, half marked in
    flight): the cluster elects new leaders, the workers and the front end move to the
    servers left, every turn ends exactly once, and each participant's history holds
    exactly the answers that were heard. (The output stream's: 3 of 6 runs lost the
    answers of turns whose participant a write left unsure, published while that
    stream had no leader and never again: their participants waited for them.)"""
    workers = [Worker(cluster.url, f"w{i}", "--replicas", "3") for i in range(2)]
    config = NatsConfig(url=cluster.url, replicas=3)
    front = await NatsFrontEnd.connect(config)

    async def crash_the_leader() -> None:
        leader = await asyncio.to_thread(cluster.leader_of, LEADS[stream](config))
        await asyncio.to_thread(leader.crash)  # the two left keep a quorum

    try:
        talk = Talk(front, pids(16),
                    # a cluster's patience: electing the input stream's new leader
                    # may take as long
                    publish_secs=40, answer_secs=40)
        await talk.through(crash_the_leader, config, workers, wait_secs=90)
    except BaseException:
        # What the partitions' consumers say, and the workers' logs: a failure here is
        # read from them (the server's state is gone once the test ends).
        await explain(front, config, workers)
        raise
    finally:
        await front.close()
        for worker in workers:
            worker.close()


async def test_a_partition_whose_consumer_leader_loses_its_pulls_gets_a_new_leader(
        cluster: NatsCluster) -> None:
    """The state seen after a server's crash and restart while turns ran: a partition's
    consumer with inputs pending, no pull waiting and no pinned client, for good, while
    the replicas pulled it (their pulls reached no leader that kept them). Provoked
    here by a proxy that drops the worker's pulls of one partition while the consumer's
    first leader leads it: the worker sees the state last `STALL_SECS`, asks that leader
    to step down (once, logged and counted), and the partition, led by another server,
    is pinned and consumed (the probes pending on it taken)."""
    n = 3
    config = NatsConfig(url=cluster.url, replicas=3)
    info_subject = f"$JS.API.CONSUMER.INFO.{config.stream}.{config.consumer(n)}"
    next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{config.stream}.{config.consumer(n)}"
    leaders: list[str] = []  # the consumer's leaders, the first one losing the pulls
    elected = asyncio.Event()
    said: list[str] = []

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    async def on_elected(msg: Msg) -> None:
        leader = json.loads(msg.data).get("leader")
        if leaders and leader != leaders[0]:
            leaders.append(leader)
            elected.set()

    handler = Said()
    logging.getLogger("turnrouter.runtime.nats").addHandler(handler)
    nc = await nats.connect(servers=cluster.url.split(","))
    registry = CollectorRegistry()
    try:
        async with proxied(cluster.servers[0].port) as proxy:
            proxy.hold(lambda subject, _: subject == next_subject and not elected.is_set())
            worker = NatsWorker(make_router, dataclasses.replace(config, url=proxy.url),
                                replica="w", registry=registry)
            run = asyncio.create_task(worker.run())
            try:
                async with asyncio.timeout(60):
                    await worker.ready.wait()
                info = json.loads((await nc.request(info_subject, b"", timeout=5)).data)
                leaders.append(info["cluster"]["leader"])
                await nc.subscribe("$JS.EVENT.ADVISORY.CONSUMER.LEADER_ELECTED."
                                   f"{config.stream}.{config.consumer(n)}", cb=on_elected)
                async with asyncio.timeout(STALL_SECS + 30):
                    await elected.wait()
                await until_true(lambda: n in worker.owned_partitions,
                                 "the partition pinned after the election")
                info = json.loads((await nc.request(info_subject, b"", timeout=5)).data)
                assert info["cluster"]["leader"] != leaders[0]
                assert registry.get_sample_value(
                    "turnrouter_nats_deployment_missing_total",
                    {"part": "consumer_leader"}) == 1
                assert len([line for line in said if "stalled" in line]) == 1, said
            finally:
                worker.request_stop()
                await cancelled(run, within=30)
    finally:
        logging.getLogger("turnrouter.runtime.nats").removeHandler(handler)
        await nc.close()


@given(st.one_of(st.integers(-3, 8), st.integers(), st.floats(), st.booleans(),
                 st.text(max_size=3), st.none()))
def test_replicas_is_a_replication_factor(value: object) -> None:
    """`replicas` is JetStream's replication factor, an int in 1..5; anything else (bools,
    floats, text, huge ints) is a ConfigurationError naming the field."""
    if type(value) is int and 1 <= value <= 5:
        assert NatsConfig(replicas=value).replicas == value
        return
    with pytest.raises(ConfigurationError, match="replicas"):
        NatsConfig(replicas=value)  # type: ignore[arg-type]


def test_replicas_is_a_worker_flag() -> None:
    """`turnrouter worker --replicas 3` (default 1), as a deployment file writes it."""
    from turnrouter.cli import worker_parser

    parser = worker_parser()
    base = ["--nats", "nats://n1:4222,nats://n2:4222", "--app", "m:f"]
    assert parser.parse_args(base).replicas == 1
    assert parser.parse_args([*base, "--replicas", "3"]).replicas == 3
