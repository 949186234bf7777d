"""The job of tests/integrations/test_livekit_metrics.py: a LiveKit entrypoint (run by
LiveKit's own worker, in a job process of its own) that builds its router, as the
LiveKit adapter's docs say, and reports to the test over a local socket."""

from __future__ import annotations

import asyncio

from livekit.agents import JobContext

from turnrouter import AgentRouter, AgentTurn
from turnrouter.telemetry import Telemetry
from turnrouter.testing import OutputRecorder, ScriptedAgent, ScriptedDecisions

#: Seconds the job waits for the test at most.
BOUND_SECS = 60.0

#: The connection to the test, open until the process exits (the test reads its end).
_KEPT: list[asyncio.StreamWriter] = []


async def entrypoint(ctx: JobContext) -> None:
    """Room `<kind>-<turns>-<port>`: answer `turns` turns, one participant each; `stop`
    stops the router, `leave` leaves it running (its participants held) until the test
    says `go`; then say `ready` on 127.0.0.1:`port` and end the job."""
    kind, turns, port = ctx.job.room.name.split("-")
    router = AgentRouter({"conversation": ScriptedAgent("conversation")},
                         ScriptedDecisions("conversation"), output=OutputRecorder(),
                         telemetry=Telemetry())
    for index in range(int(turns)):
        await router.handle(AgentTurn(f"p{index}", f"t{index}", "hello"))
    if kind == "stop":
        await router.stop()
    reader, writer = await asyncio.open_connection("127.0.0.1", int(port))
    _KEPT.append(writer)
    writer.write(b"ready\n")
    await writer.drain()
    if kind == "leave":
        await asyncio.wait_for(reader.readline(), BOUND_SECS)
    ctx.shutdown()
