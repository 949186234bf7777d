"""`turnrouter demo`: many participants talking to the simulated deployment.

Everything goes through the runtime topics, as in production: participants join,
speak, barge in, speak over a running answer, and leave; the router routes on the
embedded `LexicalDecisions`, acknowledges slow answers with the template acknowledger,
and reports to a real `Telemetry` whose registry is served on `/metrics`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

import anyio
from prometheus_client import CollectorRegistry

from .._contracts import AgentTurn
from .._exceptions import LifecycleError
from .._router import AgentRouter
from ..decisions import LexicalDecisions
from ..runtime import (
    AgentRuntime,
    Interrupted,
    ParticipantJoined,
    ParticipantLeft,
    ResponseOutput,
    Topic,
    UserQuery,
)
from ..telemetry import Telemetry, serve_metrics
from ._report import DemoReport
from ._world import DEFAULT_ROUTE, Sample, SimulatedOutage, build_agents, load_sample

__all__ = ["DemoConfig", "run_demo"]

logger = logging.getLogger("turnrouter.demo")


@dataclass(frozen=True)
class DemoConfig:
    """Knobs of a demo run (the CLI flags)."""

    duration: float = 30.0
    serve: bool = False
    participants: int = 40
    seed: int = 7
    clarify_heavy: bool = False
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    speed: float = 1.0
    """Time compression: 2.0 runs the same conversations twice as fast."""
    progress: bool = True
    acknowledgment_delay: float = 0.6


def _tracer_provider(out: TextIO) -> Any:
    """An SDK tracer provider owned by the demo (the library never configures one).

    Spans are sampled so metrics carry exemplars; they are exported over OTLP/HTTP when
    OTEL_EXPORTER_OTLP_ENDPOINT is set and the exporter is installed.
    """
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        print("tracing: opentelemetry-sdk not installed; spans off", file=out)
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": "turnrouter-demo"}))
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            print("tracing: install opentelemetry-exporter-otlp-proto-http to export spans",
                  file=out)
        else:
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
            print(f"tracing: exporting spans to {os.environ['OTEL_EXPORTER_OTLP_ENDPOINT']}",
                  file=out)
    return provider


def _acknowledger() -> Any:
    """The template acknowledger (no model), when the acknowledgment module is present."""
    try:
        from ..llm import TemplateAcknowledger
    except ImportError:
        return None
    return TemplateAcknowledger()


class _Topics:
    query: Topic[UserQuery] = Topic("turnrouter.demo.query", UserQuery)
    output: Topic[ResponseOutput] = Topic("turnrouter.demo.output", ResponseOutput)
    joined: Topic[ParticipantJoined] = Topic("turnrouter.demo.joined", ParticipantJoined)
    left: Topic[ParticipantLeft] = Topic("turnrouter.demo.left", ParticipantLeft)
    interrupted: Topic[Interrupted] = Topic("turnrouter.demo.interrupted", Interrupted)


#: Exchanges each demo participant's history keeps (sessions run 3 to 10 turns).
DEMO_HISTORY_EXCHANGES = 8


class _Crowd:
    """Participants joining, talking, interrupting and leaving through the topics."""

    def __init__(self, runtime: AgentRuntime, router: AgentRouter, sample: Sample,
                 config: DemoConfig, rng: random.Random) -> None:
        self.runtime, self.router, self.config, self.rng = runtime, router, config, rng
        in_scope = [q for q in sample.queries if q[1] != "oos"]
        self.oos = [q[0] for q in sample.queries if q[1] == "oos"]
        self.by_domain: dict[str, list[str]] = {}
        for text, domain, _ in in_scope:
            self.by_domain.setdefault(domain, []).append(text)
        self.in_scope = [q[0] for q in in_scope]
        self.oos_share = 0.45 if config.clarify_heavy else 0.08
        self.published = 0
        self.active = 0

    def pick(self, pid: str) -> str:
        rng = self.rng
        if self.router.focus_of(pid) == "travel" and rng.random() < 0.7:
            return rng.choice(self.by_domain["travel"])
        if rng.random() < self.oos_share:
            return rng.choice(self.oos)
        return rng.choice(self.in_scope)

    async def _sleep(self, seconds: float) -> None:
        await anyio.sleep(seconds / self.config.speed)

    async def _settle_patches(self, pid: str) -> None:
        """The participant answers the router's question about a held background result."""
        for held in self.router.pending_patches(pid):
            settle = (self.router.approve_patch if self.rng.random() < 0.7
                      else self.router.reject_patch)
            with contextlib.suppress(LifecycleError):  # settled or dropped meanwhile
                await settle(held.patch_id)

    async def participant(self, slot: int) -> None:
        rng, publish = self.rng, self.runtime.publish
        generation = 0
        await self._sleep(rng.uniform(0, 2.0))  # arrivals spread out
        while True:
            generation += 1
            pid = f"user-{slot:05d}-{generation}"
            await publish(_Topics.joined, ParticipantJoined(participant_id=pid))
            self.active += 1
            try:
                for _ in range(rng.randint(3, 10)):
                    await self._settle_patches(pid)
                    await publish(_Topics.query, UserQuery(participant_id=pid,
                                                           text=self.pick(pid)))
                    self.published += 1
                    if rng.random() < 0.01:
                        # A flaky speech recogniser publishes a malformed query now and
                        # then: the router rejects and counts it.
                        await publish(_Topics.query, {"participant_id": pid, "text": None})
                        self.published += 1
                    roll = rng.random()
                    if roll < 0.05:  # barge-in while the answer is on its way
                        await self._sleep(rng.uniform(0.1, 0.6))
                        await publish(_Topics.interrupted, Interrupted(participant_id=pid))
                    elif roll < 0.09:  # speaks again before the answer: supersedes it
                        await self._sleep(rng.uniform(0.1, 0.4))
                        continue
                    await self._sleep(rng.uniform(1.5, 4.0))  # listen, think
            finally:
                self.active -= 1
                with anyio.CancelScope(shield=True):
                    await publish(_Topics.left, ParticipantLeft(participant_id=pid))
            await self._sleep(rng.uniform(0.2, 1.0))


class _ExpectedFaults(logging.Filter):
    """Keep the demo's own injected faults out of the log; real problems still show."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], SimulatedOutage):
            return False
        return "rejected a message" not in record.getMessage()


async def run_demo(config: DemoConfig, *, out: TextIO = sys.stdout) -> DemoReport:
    """Run the simulated deployment; return (and print) its report."""
    quiet = _ExpectedFaults()
    for name in ("turnrouter", "turnrouter.runtime"):
        logging.getLogger(name).addFilter(quiet)
    rng = random.Random(config.seed)
    sample = load_sample()
    registry = CollectorRegistry()
    tracer_provider = _tracer_provider(out)
    telemetry = Telemetry(tracer_provider=tracer_provider, registry=registry)
    runtime = AgentRuntime()

    async def publish_answer(turn: AgentTurn, route: str, text: str) -> None:
        await runtime.publish(_Topics.output, ResponseOutput(
            participant_id=turn.participant_id, request_id=turn.turn_id, route=route,
            text=text))

    agents = build_agents(sample, rng=rng, publish=publish_answer, speed=config.speed,
                          clarify_heavy=config.clarify_heavy)
    acknowledger = _acknowledger()
    ack: dict[str, Any] = {}
    if acknowledger is not None:
        ack = {"acknowledgment_llm": acknowledger,
               "acknowledgment_delay_secs": config.acknowledgment_delay / config.speed}
    router = AgentRouter(
        agents, LexicalDecisions(examples=sample.examples),
        default_destination=DEFAULT_ROUTE, telemetry=telemetry,
        query_topic=_Topics.query, output_topic=_Topics.output,
        participant_joined_topic=_Topics.joined, participant_left_topic=_Topics.left,
        interrupted_topic=_Topics.interrupted,
        # A short memory, as voice sessions keep: longer sessions overflow it now and
        # then, so the overflow panel and counter have real data.
        max_history_exchanges=DEMO_HISTORY_EXCHANGES, **ack,
    )
    for agent in agents.values():
        agent.router, agent.spawn = router, runtime.start_soon
    server = None
    if config.metrics_port is not None:
        server = serve_metrics(config.metrics_port, registry=registry,
                               addr=config.metrics_host)
        print(f"metrics: http://{config.metrics_host}:{server.port}/metrics", file=out,
              flush=True)
    crowd = _Crowd(runtime, router, sample, config, rng)
    heard: list[int] = [0]

    async def count_output(message: ResponseOutput) -> None:
        heard[0] += 1

    start = time.monotonic()
    try:
        async with runtime:
            runtime.register(router.runtime_subscriber())
            runtime.subscribe(_Topics.output, count_output)
            async with anyio.create_task_group() as tg:
                for slot in range(config.participants):
                    tg.start_soon(crowd.participant, slot)
                if config.progress:
                    tg.start_soon(_progress, registry, crowd, start, out)
                if config.serve:
                    await anyio.sleep_forever()
                await anyio.sleep(config.duration)
                tg.cancel_scope.cancel()
            # Leaving the runtime drains the turns and departures still under way.
    finally:
        with anyio.CancelScope(shield=True):
            await router.stop()
        if server is not None:
            server.close()
        if tracer_provider is not None:
            tracer_provider.shutdown()  # flush the batch exporter before exit
        for name in ("turnrouter", "turnrouter.runtime"):
            logging.getLogger(name).removeFilter(quiet)
    elapsed = time.monotonic() - start
    report = DemoReport.read(registry, elapsed, crowd.published)
    print("\n" + report.render(), file=out)
    return report


async def _progress(registry: CollectorRegistry, crowd: _Crowd, start: float,
                    out: TextIO) -> None:
    """A live status line (rewritten in place on a terminal, one line per 5 s otherwise)."""
    tty = out.isatty()
    ticks = 0
    while True:
        await anyio.sleep(1.0)
        ticks += 1
        if not tty and ticks % 5:
            continue
        report = DemoReport.read(registry, time.monotonic() - start, crowd.published)
        line = (f"{report.elapsed:6.1f}s  participants {crowd.active:4d}  turns "
                f"{report.total_turns:6.0f}  clarify {report.clarification_rate:5.1%}  "
                f"ack {report.acknowledgment_rate:5.1%}")
        print("\r" + line if tty else line, end="" if tty else "\n", file=out, flush=True)
