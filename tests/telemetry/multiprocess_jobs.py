"""A LiveKit-style job for tests/telemetry/test_multiprocess.py: run in a process of its own
(spawn), it builds a real `AgentRouter` with `Telemetry()` (prometheus_client's default
registry, in multiprocess mode when `PROMETHEUS_MULTIPROC_DIR` was set before the start)
and handles turns."""

from __future__ import annotations

import logging
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
    junk: bytes | None = None
    """Written, before the router is built, to every file prometheus_client will open
    under this process's pid (as a crashed process whose pid this one got left them)."""


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
    if job.junk is not None:
        plant(os.getpid(), "file", job.junk)
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


#: The files prometheus_client opens for a process's counters, histograms and turnrouter's
#: gauges (by their multiprocess modes).
KINDS = ("counter", "histogram", "gauge_livesum", "gauge_livemax", "gauge_mostrecent")


def plant(pid: int, shape: str, content: bytes = b"") -> None:
    """Put a `shape` ("file" holding `content`, "fifo", "directory", "symlink" to a
    file outside the directory) where each of `KINDS` of `pid` goes."""
    folder = os.environ["PROMETHEUS_MULTIPROC_DIR"]
    for kind in KINDS:
        path = os.path.join(folder, f"{kind}_{pid}.db")
        if shape == "file":
            with open(path, "wb") as file:
                file.write(content)
        elif shape == "fifo":
            os.mkfifo(path)
        elif shape == "directory":
            os.mkdir(path)
        else:
            target = os.path.join(os.path.dirname(folder), f"target-{kind}")
            with open(target, "wb") as file:
                file.write(content)
            os.symlink(target, path)


#: A forked job's exit status when its router failed (else: the warnings it logged).
FAILED = 99


def forks(requests: Queue[tuple[str, bytes] | None], results: Queue[int]) -> None:
    """Fork one job per request `(shape, content)`: it plants that junk (`plant`) under
    its own pid, builds `Telemetry()` and a router, answers one turn and exits with the
    number of warnings turnrouter logged, or `FAILED`. Puts each job's exit status.
    Forking from this process (imported, in multiprocess mode) costs milliseconds a job
    where a spawned one costs a second."""
    while (request := requests.get(timeout=BOUND_SECS)) is not None:
        child = os.fork()
        if child == 0:  # pragma: no cover (the forked job; its status is the result)
            status = FAILED
            try:
                status = _forked(*request)
            finally:
                os._exit(status)
        _, status = os.waitpid(child, 0)
        results.put(os.waitstatus_to_exitcode(status))


def _forked(shape: str, content: bytes) -> int:
    warnings = _Warnings()
    logging.getLogger("turnrouter").addHandler(warnings)
    plant(os.getpid(), shape, content)
    anyio.run(_one_turn)
    return len(warnings.records)


class _Warnings(logging.Handler):
    """The warnings logged."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def _one_turn() -> None:
    router = AgentRouter({"conversation": ScriptedAgent("conversation")},
                         ScriptedDecisions("conversation"), output=OutputRecorder(),
                         telemetry=Telemetry())
    await router.handle(AgentTurn("p0", "t0", "hello"))
    await router.stop()


def telemetry_error(results: Queue[tuple[str, str, str] | None], unset: bool) -> None:
    """Build a `Telemetry()` (after removing PROMETHEUS_MULTIPROC_DIR when `unset`) and
    put what it raised: its type, message and cause's type; None when it raised nothing."""
    if unset:
        del os.environ["PROMETHEUS_MULTIPROC_DIR"]
    try:
        Telemetry()
    except Exception as exc:
        results.put((type(exc).__name__, str(exc), type(exc.__cause__).__name__))
        return
    results.put(None)
