"""The streams a deployment creates: their documented bounds on a real server, and a
stream of another configuration refused with the settings that differ."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.js.api import KeyValueConfig
from prometheus_client import CollectorRegistry

import nats
from turnrouter import ConfigurationError
from turnrouter.cli import worker_parser
from turnrouter.runtime import UserQuery
from turnrouter.runtime.nats import NatsConfig, NatsFrontEnd, NatsWorker

from .app import make_router
from .conftest import NatsServer
from .test_probes import deployed as served_once
from .test_reader_slots import api as _api

pytestmark = pytest.mark.anyio


async def stream_config(front: NatsFrontEnd, name: str) -> dict[str, object]:
    reply = await front.connection.request(f"$JS.API.STREAM.INFO.{name}", b"", timeout=5)
    config: dict[str, object] = json.loads(reply.data)["config"]
    return config


async def test_both_streams_are_bounded_in_bytes_and_age(nats_server: NatsServer) -> None:
    """The output stream holds at most `output_max_bytes` and `output_max_age`, dropping
    the oldest, as the input stream does with its own bounds (it had no byte bound)."""
    config = NatsConfig(url=nats_server.url, output_max_bytes=8 * 1024**2,
                        output_max_age=120.0, input_max_bytes=16 * 1024**2,
                        input_max_age=900.0, state_max_age=3600.0)
    front = await NatsFrontEnd.connect(config)
    try:
        output = await stream_config(front, config.output_stream)
        assert (output["max_bytes"], output["max_age"], output["discard"]) == (
            8 * 1024**2, 120 * 10**9, "old")
        inputs = await stream_config(front, config.stream)
        assert (inputs["max_bytes"], inputs["max_age"], inputs["discard"]) == (
            16 * 1024**2, 900 * 10**9, "old")
    finally:
        await front.close()


async def test_the_state_bucket_keeps_a_record_for_state_max_age(
        nats_server: NatsServer) -> None:
    """The bucket a worker creates keeps each record for `state_max_age` after its last
    write (30 days by default; `--state-max-age`): records of participants gone silent,
    or of made-up ids, do not pile up for good (redteam9 N2)."""
    assert NatsConfig().state_max_age == 30 * 86400
    assert worker_parser().parse_args(
        ["--nats", "n", "--app", "a:b", "--state-max-age", "3600"]).state_max_age == 3600
    config = NatsConfig(url=nats_server.url, state_max_age=2 * 86400.0)
    worker = NatsWorker(make_router, config, registry=CollectorRegistry())
    run = asyncio.create_task(worker.run())
    front = await NatsFrontEnd.connect(config)
    try:
        async with asyncio.timeout(15):
            await worker.ready.wait()
        bucket = await stream_config(front, f"KV_{config.bucket}")
        assert bucket["max_age"] == 2 * 86400 * 10**9
        # Never shorter than the inputs it ended may live: one could run again.
        with pytest.raises(ConfigurationError, match="at least input_max_age"):
            NatsConfig(state_max_age=3600.0)
        assert NatsConfig(state_max_age=3600.0, input_max_age=1800.0).state_max_age == 3600
    finally:
        await front.close()
        worker.request_stop()
        async with asyncio.timeout(30):
            await asyncio.gather(run, return_exceptions=True)


async def test_a_stream_of_another_configuration_is_refused_naming_what_differs(
        nats_server: NatsServer) -> None:
    """A replica whose bounds differ from the deployment's (another configuration, or a
    turnrouter whose streams have new bounds) is refused at start with the settings
    that differ and what to do, not the server's bare error code."""
    first = await NatsFrontEnd.connect(NatsConfig(url=nats_server.url))
    try:
        other = NatsConfig(url=nats_server.url, output_max_bytes=2 * 1024**3)
        worker = NatsWorker(make_router, other, registry=CollectorRegistry())
        with pytest.raises(ConfigurationError) as caught:
            async with asyncio.timeout(30):
                await worker.run()
        message = str(caught.value)
        assert f"stream {other.output_stream} exists with another configuration" in message
        assert f"max_bytes {1024**3} there, {2 * 1024**3} here" in message
        assert "same NatsConfig" in message
        assert "max_age" not in message  # only what differs
    finally:
        await first.close()


@pytest.mark.parametrize("value", [0, -1, 1024, 2**51, 1.5, True, "1GiB", None])
def test_output_max_bytes_is_an_int_within_its_bound(value: object) -> None:
    with pytest.raises(ConfigurationError, match="output_max_bytes"):
        NatsConfig(output_max_bytes=value)  # type: ignore[arg-type]


async def test_a_replica_of_another_partition_count_is_refused_naming_it(
        nats_server: NatsServer) -> None:
    """`partitions` differing from the deployment's is named as such, in a short line
    (it was a cut list of probe subjects that never said "partitions")."""
    first = await NatsFrontEnd.connect(NatsConfig(url=nats_server.url))
    try:
        worker = NatsWorker(make_router, NatsConfig(url=nats_server.url, partitions=8),
                            registry=CollectorRegistry())
        with pytest.raises(ConfigurationError) as caught:
            async with asyncio.timeout(30):
                await worker.run()
        message = str(caught.value)
        assert "partitions 16 there, 8 here" in message, message
        assert len(message) < 400 and "probe" not in message, message
    finally:
        await first.close()


@pytest.mark.parametrize(("setting", "value", "shown"), [
    ("failover_timeout", 30.0, "failover_timeout 1 s there, 30 s here"),
    ("ack_wait", 3.0, "ack_wait 1.5 s there, 3 s here"),
])
async def test_a_replica_of_another_consumer_configuration_is_refused_and_changes_nothing(
        nats_server: NatsServer, setting: str, value: float, shown: str) -> None:
    """A replica started with another `failover_timeout` or `ack_wait` than the running
    fleet's is refused at start, naming the setting, and leaves the partitions'
    consumers as they were. Before, its create updated all of them: one stray replica
    set the fleet's failover to 30 s, silently."""
    config = NatsConfig(url=nats_server.url)
    first = NatsWorker(make_router, config, registry=CollectorRegistry())
    running = asyncio.create_task(first.run())
    try:
        async with asyncio.timeout(30):
            await first.ready.wait()
        other = (NatsConfig(url=nats_server.url, failover_timeout=value)
                 if setting == "failover_timeout" else
                 NatsConfig(url=nats_server.url, ack_wait=value))
        stray = NatsWorker(make_router, other, registry=CollectorRegistry())
        with pytest.raises(ConfigurationError) as caught:
            async with asyncio.timeout(30):
                await stray.run()
        message = str(caught.value)
        assert f"consumer {config.consumer(0)} of stream {config.stream} exists with " \
               "another configuration" in message, message
        assert shown in message and "same NatsConfig" in message, message
        front = await NatsFrontEnd.connect(config)
        try:
            for partition in range(config.partitions):
                reply = await front.connection.request(
                    f"$JS.API.CONSUMER.INFO.{config.stream}.{config.consumer(partition)}",
                    b"", timeout=5)
                held = json.loads(reply.data)["config"]
                assert (held["ack_wait"], held["priority_timeout"]) == (
                    int(config.ack_wait * 1e9), int(config.failover_timeout * 1e9))
        finally:
            await front.close()
    finally:
        first.request_stop()
        async with asyncio.timeout(30):
            await running


async def test_a_server_taking_less_than_max_message_bytes_is_refused_at_start(
        tmp_path: Path) -> None:
    """A server whose `max_payload` is under `max_message_bytes` plus headers is refused
    at start by a front end and a worker, naming both settings: its inputs would be
    refused at publish and its outputs never published (the turn never ending). A
    `max_message_bytes` that fits starts."""
    conf = tmp_path / "small.conf"
    conf.write_text("max_payload: 65536\n")
    server = NatsServer(config=conf)
    try:
        config = NatsConfig(url=server.url)  # max_message_bytes 64 KiB: no room for headers
        with pytest.raises(ConfigurationError, match=r"max_message_bytes 65536.*max_payload"):
            await NatsFrontEnd.connect(config)
        worker = NatsWorker(make_router, config, registry=CollectorRegistry())
        with pytest.raises(ConfigurationError, match="max_payload, 65536 bytes"):
            async with asyncio.timeout(30):
                await worker.run()
        front = await NatsFrontEnd.connect(NatsConfig(url=server.url,
                                                      max_message_bytes=32 * 1024))
        await front.close()
    finally:
        server.close()


async def test_the_per_participant_queue_bound_is_the_input_streams(
        nats_server: NatsServer) -> None:
    """`max_queued_per_participant` (`--max-queued-per-participant`) is the input
    stream's per-subject bound: past it the stream drops a participant's oldest queued
    input of that kind, so a client flooding one participant holds at most that many
    ahead of its partition-mates."""
    config = NatsConfig(url=nats_server.url, max_queued_per_participant=3)
    front = await NatsFrontEnd.connect(config)  # no worker: the inputs stay queued
    try:
        js = front.connection.jetstream()
        assert (await js.stream_info(config.stream)).config.max_msgs_per_subject == 3
        for k in range(5):
            await front.publish(UserQuery(participant_id="flood", text=f"q{k}"))
        assert (await js.stream_info(config.stream)).state.messages == 3
    finally:
        await front.close()
    args = worker_parser().parse_args(["--nats", nats_server.url, "--app", "m:f",
                                       "--max-queued-per-participant", "3"])
    assert args.max_queued_per_participant == 3


@given(st.one_of(st.integers(-5, 2_000_000), st.floats(), st.booleans(),
                 st.text(max_size=3), st.none()))
def test_the_per_participant_queue_bound_is_a_bounded_count(value: object) -> None:
    """Anything but an int in 1..1000000 is a ConfigurationError naming the setting."""
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 1_000_000:
        assert NatsConfig(max_queued_per_participant=value).max_queued_per_participant == value
        return
    with pytest.raises(ConfigurationError, match="max_queued_per_participant"):
        NatsConfig(max_queued_per_participant=value)  # type: ignore[arg-type]


async def test_replicas_on_a_single_server_are_refused_naming_the_setting(
        nats_server: NatsServer) -> None:
    """More than one copy on a server that is not clustered is refused naming the
    setting and what to do, not with the server's bare error (redteam9)."""
    config = NatsConfig(url=nats_server.url, replicas=3)
    worker = NatsWorker(make_router, config, registry=CollectorRegistry())
    with pytest.raises(ConfigurationError, match=r"replicas 3 needs a NATS cluster.*--replicas 1"):
        async with asyncio.timeout(30):
            await worker.run()


async def test_an_existing_bucket_keeping_records_otherwise_is_named_at_start(
        nats_server: NatsServer, caplog: pytest.LogCaptureFixture) -> None:
    """A bucket made before `state_max_age` (records kept for ever) is taken as it is,
    and the worker says so once at start, naming how to change it: the setting applies
    only to a bucket a worker creates (review9)."""


    config = NatsConfig(url=nats_server.url)
    nc = await nats.connect(nats_server.url)
    try:
        await nc.jetstream().create_key_value(KeyValueConfig(bucket=config.bucket, history=1))
    finally:
        await nc.close()
    caplog.set_level(logging.WARNING, logger="turnrouter.runtime.nats")
    await served_once(config)
    said = [r.getMessage() for r in caplog.records if "keeps records" in r.getMessage()]
    assert len(said) == 1, said
    assert "for ever" in said[0] and f"nats stream edit KV_{config.bucket}" in said[0]


async def _refused_at_start(config: NatsConfig) -> str:
    worker = NatsWorker(make_router, config, registry=CollectorRegistry())
    with pytest.raises(ConfigurationError) as caught:
        async with asyncio.timeout(30):
            await worker.run()
    return str(caught.value)


@pytest.mark.parametrize(("part", "field", "value"), [
    ("input", "max_msgs", 10), ("input", "no_ack", True),
    ("output", "max_msgs_per_subject", 1), ("output", "max_consumers", 1),
    ("consumer", "max_deliver", 1), ("consumer", "max_waiting", 1),
])
async def test_a_layout_changed_by_hand_is_refused_naming_the_setting(
        nats_server: NatsServer, part: str, field: str, value: object) -> None:
    """A stream or consumer someone changed in a setting turnrouter leaves to the
    server (a cap on messages, consumers, deliveries or waiting pulls: answers lost,
    readers refused, turns never redelivered) is refused at start naming that setting,
    not adopted (redteam21 F3: an output stream capped at one message per participant
    was taken with a warning about another setting, and a restarted front end's replay
    lost two thirds of the answers) nor refused without saying what differs (F4)."""
    config = NatsConfig(url=nats_server.url, partitions=2)
    await served_once(config)
    nc = await nats.connect(nats_server.url)
    try:
        if part == "consumer":
            name = config.consumer(0)
            held = (await _api(nc, f"$JS.API.CONSUMER.INFO.{config.stream}.{name}"))["config"]
            assert isinstance(held, dict)
            await _api(nc, f"$JS.API.CONSUMER.DELETE.{config.stream}.{name}")
            await _api(nc, f"$JS.API.CONSUMER.CREATE.{config.stream}.{name}", {
                "stream_name": config.stream, "action": "create",
                "config": {**held, field: value}})
        else:
            stream = config.stream if part == "input" else config.output_stream
            held = (await _api(nc, f"$JS.API.STREAM.INFO.{stream}"))["config"]
            assert isinstance(held, dict)
            await _api(nc, f"$JS.API.STREAM.UPDATE.{stream}", {**held, field: value})
    finally:
        await nc.close()
    message = await _refused_at_start(config)
    assert f"{field} {value} there, unset here" in message, message
    assert "inactive threshold" not in message


@pytest.mark.parametrize(("limits", "said"), [
    ({"max_msg_size": 2000}, "max value size"),
    ({"max_bytes": 20_000, "discard": "old"}, "discards old records"),
    ({"max_msgs": 100, "discard": "old"}, "discards old records"),
])
async def test_a_bucket_made_by_hand_with_limits_that_lose_state_is_refused(
        nats_server: NatsServer, limits: dict[str, object], said: str) -> None:
    """A state bucket made by hand whose values are smaller than a record may be (the
    writes of participants with some history refused: their turns ended with the
    failure text while the worker said it was ready), or capped and discarding old
    records (participants' state deleted without a trace), is refused at start, naming
    the limit and how to lift it (redteam21 F2)."""
    config = NatsConfig(url=nats_server.url, partitions=2)
    nc = await nats.connect(nats_server.url)
    try:
        await nc.jetstream().create_key_value(KeyValueConfig(bucket=config.bucket, history=1))
        held = (await _api(nc, f"$JS.API.STREAM.INFO.KV_{config.bucket}"))["config"]
        assert isinstance(held, dict)
        await _api(nc, f"$JS.API.STREAM.UPDATE.KV_{config.bucket}", {**held, **limits})
    finally:
        await nc.close()
    message = await _refused_at_start(config)
    assert said in message and f"KV_{config.bucket}" in message, message


async def test_a_bucket_capped_but_refusing_new_writes_is_taken_with_a_warning(
        nats_server: NatsServer, caplog: pytest.LogCaptureFixture) -> None:
    """A bucket capped in bytes that refuses new writes when full (what `nats kv add
    --max-bucket-size` makes) loses nothing already written: taken, said once at start
    (once full, state writes are refused and turns end with the failure text)."""
    config = NatsConfig(url=nats_server.url, partitions=2)
    nc = await nats.connect(nats_server.url)
    try:
        await nc.jetstream().create_key_value(KeyValueConfig(
            bucket=config.bucket, history=1, max_bytes=10 * 1024**2))
    finally:
        await nc.close()
    caplog.set_level(logging.WARNING, logger="turnrouter.runtime.nats")
    await served_once(config)
    said = [r.getMessage() for r in caplog.records if "is capped" in r.getMessage()]
    assert len(said) == 1 and "max_bytes 10485760" in said[0], said
