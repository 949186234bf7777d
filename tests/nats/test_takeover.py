"""A takeover on a real nats-server: the new owner ends every turn its partitions'
records left in flight, also while those records are being written."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from nats.js.api import KeyValueConfig

import nats
from turnrouter.runtime import ResponseOutput
from turnrouter.runtime.nats import NatsConfig, NatsFrontEnd, encode_token, state_json

from .conftest import NatsServer, Worker, settled
from .crowd import FAILURE

pytestmark = pytest.mark.anyio

#: Participants per partition whose record a dead replica left with a turn in flight.
LEFT = 4


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

    async def rewrite() -> None:
        """Rewrite a record of every partition (nothing unfinished in it), 16 times per
        partition and round, until cancelled."""
        keys = [f"$KV.{config.bucket}.{n}.{encode_token(f'busy-{n}')}"
                for n in range(config.partitions)]
        count = 0
        while True:
            for _ in range(16):
                count += 1
                value = state_json("gone", [], None, [], [f"t-{count}"])
                for key in keys:
                    await nc.publish(key, value)
            await settled(nc)  # stored: one round at a time, no backlog
            writing.set()

    writers = [asyncio.create_task(rewrite())]
    worker: Worker | None = None
    finals: dict[str, list[ResponseOutput]] = {}
    try:
        async with asyncio.timeout(15):
            await writing.wait()
        worker = await asyncio.to_thread(Worker, nats_server.url, "heir")
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
        for task in writers:
            task.cancel()
        await asyncio.gather(*writers, return_exceptions=True)
        with contextlib.suppress(Exception):
            await settled(nc)
        await nc.close()
        if worker is not None:
            worker.close()
    assert {pid: [(o.request_id, o.route, o.text) for o in outs]
            for pid, outs in finals.items()} == {
        pid: [("t-1", "none", FAILURE)] for pid in left}
