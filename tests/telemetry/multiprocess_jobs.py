"""A LiveKit-style job for tests/telemetry/test_multiprocess.py: run in a process of its own
(spawn), it builds a real `AgentRouter` with `Telemetry()` (prometheus_client's default
registry, in multiprocess mode when `PROMETHEUS_MULTIPROC_DIR` was set before the start)
and handles turns."""

from __future__ import annotations

import os
from dataclasses import dataclass
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event

import anyio
import anyio.to_thread
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import REGISTRY
from prometheus_client.openmetrics.exposition import generate_latest

from turnrouter import AgentRouter, AgentTurn
from turnrouter.llm import TemplateAcknowledger
from turnrouter.telemetry import Telemetry
from turnrouter.testing import OutputRecorder, ScriptedAgent, ScriptedDecisions

#: Seconds any wait of a job (or of the test on a job) may take at most.
BOUND_SECS = 60.0


@dataclass(frozen=True)
class Job:
    """What one job process does."""

    turns: int = 0
    """Turns answered (participants p0 and p1 in turn)."""
    held: int = 0
    """Turns then left running (participants h0, h1, ...) until the job is released."""
    ack_delay: float | None = None
    """The router's acknowledgment delay (None: acknowledgments off)."""
    stop: bool = True
    """Released: finish the held turns and stop the router; else leave without stopping
    (its participants still held when the process exits)."""
    traced: bool = False
    """Record through a sampled OpenTelemetry SDK (histogram exemplars)."""


@dataclass(frozen=True)
class Ready:
    """What a job reports once its turns are answered or running."""

    pid: int
    exemplars: int
    """Trace exemplars in the job's own registry, in OpenMetrics."""


def run(job: Job, ready: Event, release: Event, results: Queue[Ready]) -> None:
    """The job process's target."""
    if job.traced:
        trace.set_tracer_provider(TracerProvider())
    anyio.run(_run, job, ready, release, results)


async def _run(job: Job, ready: Event, release: Event, results: Queue[Ready]) -> None:
    agent = ScriptedAgent("conversation")
    acknowledging = job.ack_delay is not None
    router = AgentRouter({"conversation": agent}, ScriptedDecisions("conversation"),
                         output=OutputRecorder(), telemetry=Telemetry(),
                         acknowledgment_llm=TemplateAcknowledger() if acknowledging else None,
                         acknowledgment_delay_secs=job.ack_delay)
    for index in range(job.turns):
        await router.handle(AgentTurn(f"p{index % 2}", f"t{index}", "hello"))
    gate = agent.answer_gate = anyio.Event()
    async with anyio.create_task_group() as group:
        for index in range(job.held):
            group.start_soon(router.handle, AgentTurn(f"h{index}", f"h{index}", "hello"))
        with anyio.fail_after(BOUND_SECS):
            while agent.count("answer") < job.turns + job.held:
                await anyio.lowlevel.checkpoint()
        text = generate_latest(REGISTRY).decode()  # type: ignore[no-untyped-call]
        results.put(Ready(os.getpid(), text.count("trace_id=")))
        ready.set()
        if not await anyio.to_thread.run_sync(release.wait, BOUND_SECS):
            raise TimeoutError("the test never released the job")
        if not job.stop:
            group.cancel_scope.cancel()
            return
        gate.set()
    await router.stop()
