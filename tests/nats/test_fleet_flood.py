"""A flood of big messages on a fleet subject, over TLS (redteam18 F2): the worker reads
it on a connection of its own, bounded, and counts every message; its turns go on.

One in-process `NatsWorker` on a real nats-server with TLS; a raw TLS connection with
the worker's rights (none needed here) floods `<prefix>.timing` in a publisher's name no
replica announces (refused unparsed, `unknown_publisher`), while a front end asks.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

import nats
from turnrouter.runtime.nats import NatsConfig, NatsWorker

from .app import make_router
from .conftest import NatsServer, until_true
from .crowd import ask, listening
from .test_trust import certificates  # noqa: F401  (the module's CA and server certificate)

pytestmark = pytest.mark.anyio

REJECTED = "turnrouter_runtime_rejected_messages_total"
#: 1,000 messages of 60 kB: 60 MB, sent in 1 to 4 s here; under the server's limit for a
#: slow reader (64 MiB), so a worker slow on a loaded machine is not cut off by it.
FLOOD, SIZE = 1000, 60_000


def rss_bytes() -> int:
    """This process's resident set (Linux /proc)."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.parametrize("tls_from", ["config", "server"])
async def test_a_timing_flood_over_tls_is_read_bounded_counted_and_turns_go_on(
        certificates: Path, caplog: pytest.LogCaptureFixture,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch, tls_from: str) -> None:
    """Every flood message is counted by the worker (refused, or dropped when its queue
    is full); the worker's turn connection is never lost; memory stays bounded (before:
    nats-py's TLS reader buffered the flood without bound, 150 MB in 5 s in a longer
    flood, its PONGs behind it, until the connection carrying the turns was dropped for
    unanswered pings; here the worker grew 63 MB); and queries asked during the flood are
    answered. (60 MB stays under the server's 64 MiB for a slow reader: a worker slowed
    by a loaded machine is not cut off, see docs/distributed.md, "Trust".) The same
    when the TLS comes from the server alone (a `nats://` URL: before, only a configured
    TLS had its reads bounded)."""
    server = NatsServer(scheme="tls", args=[
        "--tls", "--tlscert", str(certificates / "server.pem"),
        "--tlskey", str(certificates / "server-key.pem")])
    ca = str(certificates / "ca.pem")
    if tls_from == "config":
        config = NatsConfig(url=server.url, tls_ca_file=ca, partitions=2)
    else:  # a nats:// URL to a server that requires TLS: nats-py upgrades on its own
        monkeypatch.setenv("SSL_CERT_FILE", ca)  # (its default context trusts the CA)
        config = NatsConfig(url=server.url.replace("tls://", "nats://"), partitions=2)
    registry = CollectorRegistry()
    worker = NatsWorker(make_router, config, registry=registry, replica="flooded")
    run = asyncio.create_task(worker.run())
    flooder = await nats.connect(server.url, tls=ssl.create_default_context(cafile=ca),
                                 pending_size=8 * 1024 * 1024)

    def counted() -> float:
        return sum(registry.get_sample_value(REJECTED, {"topic": "nats_timing",
                                                        "reason": reason}) or 0.0
                   for reason in ("unknown_publisher", "dropped"))

    peak = base = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, rss_bytes())
            await asyncio.sleep(0.01)

    try:
        async with asyncio.timeout(30):
            await worker.ready.wait()
        async with listening(NatsConfig(url=server.url, tls_ca_file=ca)) as (front, heard):
            assert await ask(front, heard, "ann", "before") == "before|-|N"
            base = peak = rss_bytes()
            watcher = asyncio.create_task(watch())
            body = b"x" * SIZE
            with caplog.at_level(logging.WARNING, logger="turnrouter.runtime.nats"):
                for i in range(FLOOD):
                    await flooder.publish(config.timing_subject, body,
                                          headers={"Turnrouter-Replica": "flooder"})
                    if i % 50 == 49:
                        await flooder.flush(timeout=30)
                answers = [await ask(front, heard, f"p{i}", f"during {i}") for i in range(3)]
                await until_true(lambda: counted() >= FLOOD, "every flood message counted")
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        assert answers == [f"during {i}|-|N" for i in range(3)]
        assert counted() == FLOOD
        lost = [r.getMessage() for r in caplog.records
                if "lost the connection" in r.getMessage()]
        assert lost == []  # (the turns' connection)
        # (a 60 MB flood; what the worker holds of it is bounded by its reader and the
        # fleet subjects' 8 MiB each; the publisher's own buffer is 8 MiB)
        assert peak - base < 48 * 1024 * 1024
    finally:
        await flooder.close()
        worker.request_stop()
        async with asyncio.timeout(30):
            await asyncio.gather(run, return_exceptions=True)
        server.close()
