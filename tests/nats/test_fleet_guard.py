"""Defence in depth: what a permitted publisher can still put on the fleet subjects
(fleet-wide interrupts, presence, timing samples) is validated, bounded and counted.

One in-process `NatsWorker` on a real nats-server; a raw connection plays the publisher.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.client import Client
from prometheus_client import CollectorRegistry

import nats
from turnrouter import ContractValueError, TimingSample
from turnrouter.runtime import Interrupted, ResponseOutput, UserQuery
from turnrouter.runtime.nats import (
    NatsConfig,
    NatsFrontEnd,
    NatsWorker,
    Rejected,
    parse_presence,
    samples_body,
)

from .app import PREAMBLE, make_router
from .conftest import NatsServer, until_true

pytestmark = pytest.mark.anyio

REJECTED = "turnrouter_runtime_rejected_messages_total"


class Running:
    def __init__(self, worker: NatsWorker, registry: CollectorRegistry,
                 nc: Client) -> None:
        self.worker, self.registry, self.nc = worker, registry, nc

    def value(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    async def until(self, goal: float, name: str, **labels: str) -> None:
        """Until the counter reaches `goal` (bounded, see `until_true`)."""
        await self.nc.flush()
        await until_true(lambda: self.value(name, **labels) >= goal,
                         f"{name}{labels} reaches {goal}")


@asynccontextmanager
async def serving(url: str, **config: Any) -> AsyncIterator[Running]:
    """One worker (two partitions, `config` on top) and a raw publisher connection."""
    registry = CollectorRegistry()
    worker = NatsWorker(make_router, NatsConfig(url=url, partitions=2, **config),
                        registry=registry, replica="guarded")
    run = asyncio.create_task(worker.run())
    nc = await nats.connect(url)
    try:
        async with asyncio.timeout(15):
            await worker.ready.wait()
        yield Running(worker, registry, nc)
    finally:
        await nc.close()
        worker.request_stop()
        async with asyncio.timeout(30):
            await asyncio.gather(run, return_exceptions=True)


async def ghosts(nc: Client, presence: str) -> None:
    """40 replica names that claim no partition, announced until cancelled (at a
    publisher's pace, not a wait for the worker)."""
    while True:
        for i in range(40):
            await nc.publish(presence, json.dumps({"replica": f"ghost-{i}", "owned": 0}).encode())
        await asyncio.sleep(0.2)


@pytest.fixture
async def running(nats_server: NatsServer) -> AsyncIterator[Running]:
    async with serving(nats_server.url) as serving_worker:
        yield serving_worker


async def test_fleet_interrupts_are_validated_and_a_flood_is_coalesced(
        running: Running) -> None:
    """Junk, oversized or participant-scoped messages on `<prefix>.ctl.interrupt` are
    refused and counted; a flood of valid ones starts at most two interrupt passes at a
    time (the rest are counted as coalesced), and the worker keeps serving."""
    subject = running.worker.config.interrupt_all_subject
    for body in (b"", b"junk", b"[" * 5000, b"x" * 70_000,
                 Interrupted(participant_id="alice").model_dump_json().encode()):
        await running.nc.publish(subject, body)
    await running.until(4, REJECTED, topic="nats_control", reason="invalid")
    await running.until(1, REJECTED, topic="nats_control", reason="oversized")
    before = len(asyncio.all_tasks())
    flood = 2000
    body = Interrupted().model_dump_json().encode()
    for _ in range(flood):
        await running.nc.publish(subject, body)
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, len(asyncio.all_tasks()) - before)
            await asyncio.sleep(0)

    watcher = asyncio.create_task(watch())
    try:
        await running.nc.publish(subject, b"sentinel")  # handled after the whole flood
        await running.until(5, REJECTED, topic="nats_control", reason="invalid")
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    assert peak <= 4  # the watcher, the waiter, at most one pending and one running pass


async def test_a_flood_past_the_fleet_backlog_is_dropped_counted_and_logged_sparingly(
        nats_server: NatsServer, caplog: pytest.LogCaptureFixture) -> None:
    """With `fleet_backlog=1`, a burst on `<prefix>.ctl.interrupt` overflows the
    subscription: the client drops what does not fit, each drop is counted (`dropped`),
    every message is either handled or counted, the log gets a line at the 1st, 2nd,
    4th, ... drop only, and the worker goes on handling the subject."""
    flood = 3000
    async with serving(nats_server.url, fleet_backlog=1) as running:
        subject = running.worker.config.interrupt_all_subject

        def handled_and_dropped() -> tuple[float, float]:
            return (running.value(REJECTED, topic="nats_control", reason="invalid"),
                    running.value(REJECTED, topic="nats_control", reason="dropped"))

        with caplog.at_level(logging.WARNING, logger="turnrouter.runtime.nats"):
            for _ in range(flood):
                await running.nc.publish(subject, b"junk")
            await running.nc.flush()
            await until_true(lambda: sum(handled_and_dropped()) >= flood,
                             "every message handled or dropped")
        handled, dropped = handled_and_dropped()
        assert handled + dropped == flood and dropped >= 1
        lines = [r for r in caplog.records if "flooded fleet subject" in r.getMessage()]
        assert 1 <= len(lines) <= int(dropped).bit_length()
        await running.nc.publish(subject, b"junk")
        await running.until(handled + 1, REJECTED, topic="nats_control", reason="invalid")


async def test_names_on_the_presence_subject_never_hold_a_barge_in(
        nats_server: NatsServer) -> None:
    """40 names on `<prefix>.presence` claiming no partition: balance hands the idle
    partition over (never the one with a turn running), gets it back unclaimed, counts
    the 40 names `unverified` and ignores them for balance; the running turn is untouched
    and its barge-in ends it at once (a handover would have held it for drain_timeout,
    then ended it with the failure text). A name that says it owns a partition counts
    again."""
    async with serving(nats_server.url, drain_timeout=60.0) as running:
        worker, nc = running.worker, running.nc
        presence = f"{worker.config.prefix}.presence"

        front = await NatsFrontEnd.connect(worker.config)
        heard: list[ResponseOutput] = []
        changed = asyncio.Event()
        subscribed = asyncio.Event()

        async def listen() -> None:
            async for output in front.outputs(subscribed=subscribed):
                if output.participant_id == "carol":
                    heard.append(output)
                    changed.set()

        async def until_heard(what: str) -> None:
            async with asyncio.timeout(15):
                while not any(output.text.startswith(what) for output in heard):
                    changed.clear()
                    await changed.wait()

        haunting = asyncio.create_task(ghosts(nc, presence))
        reader = asyncio.create_task(listen())
        try:
            async with asyncio.timeout(10):
                await subscribed.wait()
            await front.publish(UserQuery(participant_id="carol", text="slow story",
                                          message_id="c1"))
            await until_heard(PREAMBLE)
            partition = worker.ledger.people["carol"].partition
            turns = worker.inputs.turns_of.of("carol")
            assert turns
            await running.until(40, REJECTED, topic="nats_presence", reason="unverified")
            assert partition in worker.owned_partitions
            assert not any(turn.done() for turn in turns)
            assert worker.fleet.fair_share() == 2  # the names no longer count
            await front.publish(Interrupted(participant_id="carol", message_id="c1-stop"))
            done, _ = await asyncio.wait(turns, timeout=10)  # drain_timeout is 60 s
            assert done == set(turns)
            await front.publish(UserQuery(participant_id="carol", text="again",
                                          message_id="c2"))
            await until_heard("again|")
            assert worker.config.failure_text not in [output.text for output in heard]
            haunting.cancel()
            await nc.publish(presence, json.dumps({"replica": "ghost-0", "owned": 1}).encode())
            await until_true(lambda: worker.fleet.fair_share() == 1,
                             "a name owning a partition counts again")
        finally:
            for task in (haunting, reader):
                task.cancel()
            await asyncio.gather(haunting, reader, return_exceptions=True)
            await front.close()


async def test_a_busy_partition_is_handed_over_only_after_a_short_bounded_wait(
        nats_server: NatsServer) -> None:
    """Every partition has a turn running and 40 names claim no partition: balance
    waits for an idle partition, then tries a busy one, waits at most `pull_expires`
    for its turns, keeps it (counted `handover_aborted`) and backs off; no turn is cut
    and a barge-in still ends its turn at once."""
    async with serving(nats_server.url, drain_timeout=60.0) as running:
        worker, nc = running.worker, running.nc
        presence = f"{worker.config.prefix}.presence"

        front = await NatsFrontEnd.connect(worker.config)
        haunting = asyncio.create_task(ghosts(nc, presence))
        try:
            pids = [f"busy-{i}" for i in range(10)]  # the server's hash: both partitions
            for pid in pids:
                await front.publish(UserQuery(participant_id=pid, text="slow story",
                                              message_id=f"{pid}-1"))
            await until_true(lambda: all(worker.inputs.turns_of.of(p) for p in pids),
                             "every slow turn running")
            partitions = {worker.ledger.people[p].partition for p in pids}
            assert partitions == {0, 1}
            turns = [t for p in pids for t in worker.inputs.turns_of.of(p)]
            await running.until(1, REJECTED, topic="nats_presence",
                                reason="handover_aborted")
            assert worker.owned_partitions == frozenset({0, 1})
            assert not any(turn.done() for turn in turns)
            first = worker.inputs.turns_of.of(pids[0])
            await front.publish(Interrupted(participant_id=pids[0],
                                            message_id=f"{pids[0]}-stop"))
            done, _ = await asyncio.wait(first, timeout=10)  # drain_timeout is 60 s
            assert done == set(first)
        finally:
            haunting.cancel()
            await asyncio.gather(haunting, return_exceptions=True)
            await front.close()
            await worker.router.interrupt(None)  # the slow turns: a stop waits for them


async def test_presence_junk_is_refused_without_tracebacks(
        running: Running, caplog: pytest.LogCaptureFixture) -> None:
    """Infinity, NaN, deep nesting, long or odd names and impossible counts on
    `<prefix>.presence` are counted, never logged with a traceback, and do not enter
    the peer table (the fair share stays that of a lone replica)."""
    subject = f"{running.worker.config.prefix}.presence"
    junk = [b'{"replica":"x","owned":Infinity}', b'{"replica":"x","owned":NaN}',
            b"[" * 100, json.dumps({"replica": "x" * 65, "owned": 0}).encode(),
            json.dumps({"replica": "a b", "owned": 0}).encode(),
            json.dumps({"replica": "x", "owned": 3}).encode(),
            json.dumps({"replica": "x", "owned": True}).encode(),
            json.dumps({"replica": "x", "owned": 0, "more": 1}).encode()]
    with caplog.at_level(logging.DEBUG):
        for body in [*junk, b"{" + b" " * 300 + b"}"]:
            await running.nc.publish(subject, body)
        await running.until(len(junk), REJECTED, topic="nats_presence", reason="invalid")
        await running.until(1, REJECTED, topic="nats_presence", reason="oversized")
    assert "Traceback" not in caplog.text
    assert running.worker.fleet.fair_share() == 2


async def test_a_full_presence_table_makes_room_once_names_stop(running: Running) -> None:
    """1024 names announced once fill the presence table (the next is refused,
    `overflow`); once they are no longer announced (1.5 s), a replica announced later
    counts for balance. Before, the table kept them for good and that replica never
    counted."""
    subject = f"{running.worker.config.prefix}.presence"
    fleet = running.worker.fleet
    for i in range(1025):
        await running.nc.publish(subject, json.dumps({"replica": f"once-{i}",
                                                      "owned": 2}).encode())
    await running.until(1, REJECTED, topic="nats_presence", reason="overflow")

    async def later() -> None:  # a replica's pace: one announcement per probe period
        while True:
            await running.nc.publish(subject, json.dumps({"replica": "later",
                                                          "owned": 1}).encode())
            await asyncio.sleep(running.worker.config.probe_interval)

    # 2 partitions: the share is 1 while the 1024 names are live (1.5 s), 2 once gone.
    await until_true(lambda: fleet.fair_share() == 2, "the names gone from presence")
    announcing = asyncio.create_task(later())
    try:
        await until_true(lambda: fleet.fair_share() == 1, "the later replica counted")
    finally:
        announcing.cancel()
        await asyncio.gather(announcing, return_exceptions=True)


async def announce(running: Running, *names: str) -> None:
    """Put `names` on presence as live replicas (as a worker-credentialed liar can) and
    wait until the worker counts them all (at most 15: its 16 partitions' share is 1)."""
    for name in names:
        await running.nc.publish(f"{running.worker.config.prefix}.presence",
                                 json.dumps({"replica": name, "owned": 0}).encode())
    share = -(-running.worker.config.partitions // (1 + len(names)))
    await running.nc.flush()
    await until_true(lambda: running.worker.fleet.fair_share() == share,
                     f"{len(names)} names on presence")


async def test_timing_samples_are_range_checked_and_weighted_per_publisher(
        running: Running) -> None:
    """Fleet samples of a publisher no live replica announces on presence are refused
    (`unknown_publisher`, before parsing); of an announced one, samples naming unknown
    routes or out-of-range seconds are refused; one publisher flooding a route is held
    to its share (the floor, with no other samples); a message without its publisher's
    name is refused. Range-checked: `seconds` in (0, 600], `at` from 0 to an hour
    ahead."""
    subject = running.worker.config.timing_subject
    headers = {"Turnrouter-Replica": "mallory"}
    forged = [TimingSample("echo", 0.001).to_json() for _ in range(64)]
    await running.nc.publish(subject, samples_body(forged), headers=headers)
    await running.until(1, REJECTED, topic="nats_timing", reason="unknown_publisher")
    await announce(running, "mallory")
    bad = [TimingSample(f"fake-{i}", 0.5).to_json() for i in range(256)]
    await running.nc.publish(subject, samples_body(bad), headers=headers)
    await running.until(256, REJECTED, topic="nats_timing", reason="unknown_route")
    await running.nc.publish(subject, samples_body(
        [TimingSample("echo", 1e300).to_json(), TimingSample("echo", 0.0).to_json(),
         TimingSample("echo", 0.5, at=1e300).to_json(),
         TimingSample("echo", 0.5, at=-1.0).to_json()]),
        headers=headers)
    await running.until(4, REJECTED, topic="nats_timing", reason="out_of_range")
    await running.nc.publish(subject, samples_body(forged), headers=headers)
    received = "turnrouter_nats_timing_samples_total"

    def kept_and_refused() -> tuple[float, float]:
        return (running.value(received, direction="received"),
                running.value(REJECTED, topic="nats_timing", reason="over_share"))

    await until_true(lambda: sum(kept_and_refused()) >= 64, "each of the 64 kept or refused")
    kept, refused = kept_and_refused()
    # The floor per 10 s window: 8, or 16 if a window ended during the message.
    assert kept + refused == 64 and kept <= 2 * 8
    await running.nc.publish(subject, samples_body(forged[:1]))  # no publisher header
    await running.until(1, REJECTED, topic="nats_timing", reason="invalid")
    assert running.value(REJECTED, topic="nats_timing", reason="unknown_publisher") == 1


async def test_refused_timing_messages_are_logged_sparingly(
        running: Running, caplog: pytest.LogCaptureFixture) -> None:
    """An announced publisher's timing messages of junk lines, or not UTF-8, are each
    counted, and logged the first time and at every power of ten with the count so far:
    one WARNING per message let a publisher with the workers' credentials write
    thousands of lines a second (redteam9 N3)."""
    subject = running.worker.config.timing_subject
    headers = {"Turnrouter-Replica": "mallory"}
    await announce(running, "mallory")
    caplog.set_level(logging.WARNING, logger="turnrouter.runtime.nats")
    for i in range(30):
        body = b"\xff\xfe" if i % 2 else samples_body(["{not json"])
        await running.nc.publish(subject, body, headers=headers)
    await running.until(30, REJECTED, topic="nats_timing", reason="invalid")
    said = [record.getMessage() for record in caplog.records if "timing" in record.getMessage()]
    assert len(said) == 2, said  # the 1st and the 10th
    assert "(10 so far)" in said[1]


async def test_timing_messages_forged_in_the_replicas_own_name_are_counted(
        running: Running) -> None:
    """A timing message in the receiving replica's own name that it did not send (a
    worker-credentialed forger borrowing a live name) is refused and counted
    (`invalid`), while the replica's own samples coming back from the server are not.
    Before, every message in its own name was dropped uncounted (redteam7 D7)."""
    subject = running.worker.config.timing_subject
    own = {"Turnrouter-Replica": running.worker.replica}
    for body in (samples_body([TimingSample("echo", 0.5).to_json()]), b"\xff" * 100,
                 samples_body(["nan"])):
        await running.nc.publish(subject, body, headers=own)
    await running.until(3, REJECTED, topic="nats_timing", reason="invalid")
    front = await NatsFrontEnd.connect(running.worker.config)
    try:
        for k in range(3):
            await front.publish(UserQuery(participant_id=f"own-{k}", text="hi"))
        await until_true(lambda: running.value("turnrouter_nats_timing_samples_total",
                                               direction="sent") >= 3,
                         "the replica's own samples sent")
    finally:
        await front.close()
    # One more forged message after them: once it is counted, their echoes came back
    # (sent before it) and none was taken for a forger's.
    await running.nc.publish(subject, b"\xff", headers=own)
    await running.until(4, REJECTED, topic="nats_timing", reason="invalid")
    assert running.value(REJECTED, topic="nats_timing", reason="invalid") == 4


async def test_rotating_publisher_names_cannot_outweigh_the_replica(
        running: Running) -> None:
    """A liar announcing 15 names on presence and publishing 64 samples under each gets
    no more of a route's samples learned than the floor (8 per 10 s window, 16 if a
    window ends meanwhile) while this replica measured none itself: the fleet as a whole
    is capped (`fleet_share`), whatever names it uses."""
    names = [f"liar{k}" for k in range(15)]
    await announce(running, *names)
    body = samples_body([TimingSample("echo", 500.0).to_json() for _ in range(64)])
    for name in names:
        await running.nc.publish(running.worker.config.timing_subject, body,
                                 headers={"Turnrouter-Replica": name})
    received = "turnrouter_nats_timing_samples_total"

    def seen() -> float:
        return running.value(received, direction="received") + sum(
            running.value(REJECTED, topic="nats_timing", reason=reason)
            for reason in ("over_share", "fleet_share"))

    await running.nc.flush()
    await until_true(lambda: seen() >= 64 * len(names), "every sample kept or refused")
    assert running.value(received, direction="received") <= 2 * 8
    # The first name is held by its own share (`over_share`); the others by the fleet's.
    assert running.value(REJECTED, topic="nats_timing", reason="fleet_share") >= (
        64 * (len(names) - 2))


async def test_a_flood_of_timing_bytes_is_refused_unparsed(running: Running) -> None:
    """One publisher's timing messages past 1 MiB per 10 s window are refused before
    they are parsed (`overflow`): 40 messages of 60 kB span at most two windows, so at
    least 40 - 2 x 17 are refused; each one parsed is counted (here `invalid`)."""
    await announce(running, "flooder")
    body = b"x" * 60_000  # one line that is no sample: cheap to refuse once parsed
    for _ in range(40):
        await running.nc.publish(running.worker.config.timing_subject, body,
                                 headers={"Turnrouter-Replica": "flooder"})

    def counted() -> tuple[float, float]:
        return (running.value(REJECTED, topic="nats_timing", reason="invalid"),
                running.value(REJECTED, topic="nats_timing", reason="overflow"))

    await running.nc.flush()
    await until_true(lambda: sum(counted()) >= 40, "each message parsed or refused")
    parsed, refused = counted()
    assert parsed + refused == 40 and refused >= 40 - 2 * 17


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=80),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8),
                                                                 inner, max_size=4),
    max_leaves=20)


@given(st.binary(max_size=400) | JSONISH.map(lambda v: json.dumps(v).encode()))
def test_presence_parser_refuses_junk_with_rejected(data: bytes) -> None:
    """Any bytes: a (replica, owned) within bounds, or `Rejected`, nothing else."""
    try:
        replica, owned = parse_presence(data, 16)
    except Rejected as exc:
        reason = exc.reason
    else:
        assert 1 <= len(replica) <= 64 and 0 <= owned <= 16
        return
    assert reason in ("invalid", "oversized")


@given(st.text(min_size=1, max_size=64, alphabet="abcXYZ019_.:-"), st.integers(0, 16))
def test_presence_parser_reads_what_replicas_send(replica: str, owned: int) -> None:
    """What a replica publishes is read back unchanged."""
    body = json.dumps({"replica": replica, "owned": owned}).encode()
    assert parse_presence(body, 16) == (replica, owned)


@pytest.mark.parametrize("body", [b'{"replica":"a","replica":"b","owned":1}',
                                  b'{"replica":"a","owned":1,"owned":0}'])
def test_presence_with_a_key_twice_is_refused(body: bytes) -> None:
    """Two readers of a JSON object with a key twice may each take another value (the
    standard library keeps the last): such a presence message says nothing for sure."""
    with pytest.raises(Rejected) as refused:
        parse_presence(body, 16)
    assert refused.value.reason == "invalid"


@pytest.mark.parametrize("name", ["", "x" * 65, "a b", "é", "a\nb"])
def test_replica_names_are_bounded(name: str) -> None:
    """A replica name peers would refuse is refused up front."""
    with pytest.raises(ContractValueError, match="replica"):
        NatsWorker(make_router, NatsConfig(), replica=name or "\0")
