"""Balance between honest replicas on a real nats-server: it splits the partitions
evenly, counts no replica as a name on the presence subject, and does so again after
the server crashed and came back (docs/distributed.md, "Partitions and ownership")."""

from __future__ import annotations

import asyncio

import pytest

from .conftest import NatsServer, Worker, metric_value

pytestmark = pytest.mark.anyio

UNVERIFIED = ("turnrouter_runtime_rejected_messages_total",
              'reason="unverified",topic="nats_presence"')


def owned(workers: list[Worker]) -> list[float]:
    return [metric_value(w.metrics(), "turnrouter_nats_partitions_owned") for w in workers]


async def until_even(workers: list[Worker], within: float) -> None:
    """Until each worker owns its half of the 16 partitions (polling their /metrics,
    at most `within` seconds): a liveness bound, not a timing claim."""
    seen: list[float] = []
    for _ in range(int(within / 0.2)):
        seen = await asyncio.to_thread(owned, workers)
        if seen == [8, 8]:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"the partitions stayed split {seen}")


async def test_two_honest_replicas_split_evenly_also_after_a_server_restart() -> None:
    """Two idle replicas end up with 8 partitions each, without counting each other
    `unverified`; after kill -9 of nats-server and its restart (pins start afresh,
    often 15/1) they split 8/8 again. Before, the replica handing an idle partition
    over pulled it again at once and often won it back before the peer's pull was
    pinned, took its peer for a name that is no replica and backed balance off 10 s,
    then 20, 40...: two replicas stayed at 15/1 for over a minute."""
    server = NatsServer(sync_always=True)
    workers: list[Worker] = []
    try:
        for name in ("b0", "b1"):
            workers.append(await asyncio.to_thread(Worker, server.url, name))
        await until_even(workers, 30)
        await asyncio.to_thread(server.crash)
        await asyncio.to_thread(server.restart)
        await until_even(workers, 30)
        texts = await asyncio.to_thread(lambda: [w.metrics() for w in workers])
        assert [metric_value(text, *UNVERIFIED) for text in texts] == [0, 0]
    finally:
        for worker in workers:
            worker.close()
        server.close()
