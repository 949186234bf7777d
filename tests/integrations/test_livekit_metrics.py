"""A per-job router's metrics at a LiveKit worker's own `/metrics`: LiveKit's `AgentServer`
with `prometheus_port` and `prometheus_multiproc_dir` (its default process executor and
multiprocessing context), jobs launched with `simulate_job` (no LiveKit server), each
entrypoint building its own `AgentRouter` with `Telemetry()`."""

from __future__ import annotations

import asyncio
import socket
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("livekit.agents", reason="needs the livekit extra")

from livekit.agents import AgentServer
from prometheus_client.parser import text_string_to_metric_families

from .livekit_metrics_job import BOUND_SECS, entrypoint


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name.startswith("turnrouter_")}


class Worker:
    """A LiveKit worker, and the socket its jobs report to."""

    def __init__(self, server: AgentServer, metrics_port: int) -> None:
        self.server = server
        self.metrics_port = metrics_port
        self.reports: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = (
            asyncio.Queue())
        self.report_port = 0
        self.connections: list[asyncio.StreamWriter] = []

    async def job(self, kind: str, turns: int
                  ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Launch a job; return its connection once it said `ready`."""
        await self.server.simulate_job(f"{kind}-{turns}-{self.report_port}", fake_job=True)
        reader, writer = await asyncio.wait_for(self.reports.get(), BOUND_SECS)
        self.connections.append(writer)
        assert await asyncio.wait_for(reader.readline(), BOUND_SECS) == b"ready\n"
        return reader, writer

    @staticmethod
    async def exited(reader: asyncio.StreamReader) -> None:
        """Wait until the job's process is gone (its end of the connection closed)."""
        assert await asyncio.wait_for(reader.read(), BOUND_SECS) == b""

    async def scrape(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return await asyncio.to_thread(_scrape, self.metrics_port)


async def _run(directory: Path) -> None:
    metrics_port = _free_port()
    server = AgentServer(host="127.0.0.1", prometheus_port=metrics_port,
                         prometheus_multiproc_dir=str(directory), num_idle_processes=0)
    server.rtc_session(entrypoint)
    worker = Worker(server, metrics_port)
    started = asyncio.Event()
    server.on("worker_started", lambda *_: started.set())

    async def report(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await worker.reports.put((reader, writer))

    listener = await asyncio.start_server(report, "127.0.0.1", 0)
    worker.report_port = listener.sockets[0].getsockname()[1]
    run = asyncio.create_task(server.run(devmode=True, unregistered=True))
    try:
        await asyncio.wait_for(started.wait(), BOUND_SECS)
        turns = ("turnrouter_turns_total", (("outcome", "answer"), ("route", "conversation")))
        participants = ("turnrouter_active_participants", ())
        for count in (3, 5):
            reader, _ = await worker.job("stop", count)
            await worker.exited(reader)
        seen = await worker.scrape()
        assert seen[turns] == 8  # both jobs' turns, one series
        assert seen[("turnrouter_turn_duration_seconds_count", turns[1])] == 8
        assert not [key for key in seen if "pid" in dict(key[1])]

        reader, writer = await worker.job("leave", 2)
        seen = await worker.scrape()
        assert seen[turns] == 10
        assert seen[participants] == 2  # the running job's participants
        writer.write(b"go\n")
        await writer.drain()
        await worker.exited(reader)  # ended without stopping its router
        seen = await worker.scrape()
        assert seen.get(participants, 0) == 0
        assert seen[turns] == 10
    finally:
        for connection in worker.connections:
            connection.close()
            await connection.wait_closed()
        listener.close()
        await listener.wait_closed()
        await server.aclose()
        await asyncio.wait_for(run, BOUND_SECS)


def test_per_job_routers_metrics_reach_the_workers_endpoint(tmp_path: Path) -> None:
    """Counters add up over jobs; an exited job's participants stop counting."""
    asyncio.run(_run(tmp_path / "metrics"))
