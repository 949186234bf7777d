"""`turnrouter demo`: many participants talking to the simulated deployment.

Everything goes through the runtime topics, as in production: participants join,
speak, barge in, speak over a running answer, and leave; the router routes on the
embedded `LexicalDecisions`, acknowledges slow answers with the template acknowledger,
and reports to a real `Telemetry` whose registry is served on `/metrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import heapq
import importlib
import itertools
import logging
import os
import random
import signal
import sys
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TextIO

import anyio
from prometheus_client import CollectorRegistry

from .._contracts import AgentTurn
from .._exceptions import ConfigurationError, LifecycleError
from .._load import OverloadPolicy
from .._redact import redact_url
from .._router import AgentRouter
from .._timing import JsonLinesSink, TimingSample
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
from ..telemetry._serve import bind_error
from ._report import DemoReport
from ._tracing import NO_SDK, env_tracer_provider
from ._world import DEFAULT_ROUTE, Sample, SimulatedOutage, build_agents, load_sample

__all__ = [
    "DEFAULT_ACK_DELAY",
    "OTLP_PROTOCOLS",
    "DemoConfig",
    "demo_resource",
    "demo_tracer_provider",
    "otlp_settings",
    "run_demo",
]

#: Seconds of the fallback acknowledgment delay by default. Chosen with `turnrouter tune`
#: on the demo's own latencies: at 0.8 s no route but travel (acknowledged early, by
#: prediction, on purpose) acknowledges most of its turns, and silence p95 stays near 1 s.
DEFAULT_ACK_DELAY = 0.8
#: OTLP trace export protocols, as in OTEL_EXPORTER_OTLP_PROTOCOL.
OTLP_PROTOCOLS = ("http/protobuf", "grpc")

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
    acknowledgment_delay: float | None = DEFAULT_ACK_DELAY
    """Seconds of simulated time before the fallback acknowledgment; None: off."""
    samples_path: str | None = None
    """Append every first-response timing sample (JSON lines, `turnrouter tune
    --samples`) here, in seconds of the simulated conversations (times `speed`)."""
    otlp_endpoint: str | None = None
    """Export spans here (default: OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT; none: no export)."""
    otlp_protocol: str | None = None
    """`http/protobuf` or `grpc` (default: OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL or HTTP)."""
    failing_routes: tuple[str, ...] = ()
    """Routes whose answers all fail (rehearse `TurnrouterFailures`)."""
    slow_routes: tuple[str, ...] = ()
    """Routes that answer after about 3 s (rehearse `TurnrouterSlowFirstResponse`)."""
    shedding: bool = True
    """Admission control: the default `OverloadPolicy`, its durations divided by `speed`
    (False: off)."""


def _env(*names: str) -> str | None:
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


def otlp_endpoint_from_env() -> tuple[str | None, str]:
    """(endpoint, protocol) from the environment alone (`otlp_settings` without flags)."""
    return otlp_settings(DemoConfig())


def otlp_settings(config: DemoConfig) -> tuple[str | None, str]:
    """(endpoint, protocol) of the span export: flags first, then the standard
    OpenTelemetry environment variables. ConfigurationError for an unknown protocol."""
    endpoint = config.otlp_endpoint or _env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                                            "OTEL_EXPORTER_OTLP_ENDPOINT")
    protocol = config.otlp_protocol or _env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                                            "OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf"
    if protocol not in OTLP_PROTOCOLS:
        raise ConfigurationError(f"OTLP protocol must be one of {', '.join(OTLP_PROTOCOLS)}, "
                                 f"got {protocol!r}")
    if endpoint is not None and endpoint != config.otlp_endpoint:
        _check_env_endpoint(endpoint, protocol)
    return endpoint, protocol


def _check_env_endpoint(endpoint: str, protocol: str) -> None:
    """An endpoint from OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT checked as the flag is: a
    malformed one failed only in the exporter, one ERROR line per batch, and the run
    went on exporting nothing. (gRPC also takes `host:port`.)"""
    shown = redact_url(endpoint)[:200]
    problem = None
    if len(endpoint) > 2000 or not endpoint.isprintable() or any(
            c.isspace() for c in endpoint):
        problem = "holds spaces or control characters, or is over 2,000 characters"
    elif protocol == "http/protobuf" or "://" in endpoint:
        try:
            parts = urllib.parse.urlsplit(endpoint)
            parts.port  # noqa: B018 (parses it: a bad port raises ValueError)
        except ValueError as exc:
            problem = f"is not a URL ({exc})"
        else:
            if parts.scheme not in ("http", "https") or not parts.hostname:
                problem = "must be an http(s) URL with a host"
    if problem is not None:
        raise ConfigurationError(
            f"OTEL_EXPORTER_OTLP_ENDPOINT (or _TRACES_ENDPOINT) {shown!r} {problem}")


def service_resource(default_name: str) -> Any:
    """The SDK resource: OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES as the SDK reads
    them; `service.name` is `default_name` only when neither names the service."""
    from opentelemetry.sdk.resources import Resource

    resource = Resource.create({})
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": default_name}))
    return resource


def demo_resource() -> Any:
    """`service_resource("turnrouter-demo")`."""
    return service_resource("turnrouter-demo")


def _exporter(endpoint: str, protocol: str) -> Any:
    """An OTLP span exporter for `endpoint` (a base URL: `/v1/traces` is added for HTTP,
    as for OTEL_EXPORTER_OTLP_ENDPOINT). ConfigurationError if it is not installed."""
    if protocol == "grpc":
        try:
            module = importlib.import_module(
                "opentelemetry.exporter.otlp.proto.grpc.trace_exporter")
        except ImportError as exc:
            raise ConfigurationError(
                "--otlp-protocol grpc needs opentelemetry-exporter-otlp-proto-grpc: pip "
                "install opentelemetry-exporter-otlp-proto-grpc") from exc
        return module.OTLPSpanExporter(endpoint=endpoint)
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise ConfigurationError(
            "exporting spans needs opentelemetry-exporter-otlp-proto-http: install "
            "turnrouter's otlp extra (from a checkout: pip install -e '.[otlp]'; `make "
            "demo ARGS=\"--otlp-endpoint ...\"` installs it)") from exc
    traces = endpoint if _env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") == endpoint else (
        endpoint.rstrip("/") + "/v1/traces")
    return OTLPSpanExporter(endpoint=traces)


def demo_tracer_provider(config: DemoConfig, out: TextIO) -> Any:
    """An SDK tracer provider owned by the demo (the library never configures one), from
    the OpenTelemetry environment as the SDK documents it (`env_tracer_provider`:
    OTEL_SDK_DISABLED, OTEL_TRACES_EXPORTER, OTEL_TRACES_SAMPLER[_ARG]); spans are
    exported over OTLP when an endpoint is given (flag or environment). None when
    nothing would be exported: no spans, and no exemplars linking to unexported traces.
    """
    endpoint, protocol = otlp_settings(config)
    try:
        resource = demo_resource()
    except ImportError as exc:
        if config.otlp_endpoint:  # asked for on the command line: not a quiet fallback
            raise ConfigurationError(f"--otlp-endpoint: {NO_SDK}") from exc
        print(f"tracing: {NO_SDK}; spans off", file=out)
        return None
    return env_tracer_provider(endpoint=endpoint, protocol=protocol, out=out,
                               resource=resource, exporter=_exporter)


def install_env_tracing(service: str, out: TextIO) -> Any:
    """Install `env_tracer_provider` as the global tracer provider (for applications
    whose routers follow the global one, such as `turnrouter worker`); the OTLP endpoint
    and protocol come from the environment, `service` names the service unless
    OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES do. Returns the provider, or None."""
    from opentelemetry import trace

    endpoint, protocol = otlp_endpoint_from_env()
    try:
        resource = service_resource(service)
    except ImportError:
        print(f"tracing: {NO_SDK}; spans off", file=out)
        return None
    provider = env_tracer_provider(endpoint=endpoint, protocol=protocol, out=out,
                                   resource=resource, exporter=_exporter)
    if provider is not None:
        trace.set_tracer_provider(provider)
    return provider


class _SpeedSink:
    """Timing samples in seconds of the simulated conversations (the demo compresses
    time by `speed`), appended to a JSON-lines file."""

    def __init__(self, path: str, speed: float) -> None:
        self._sink = JsonLinesSink(path, flush_every=100)
        self._path, self._speed = path, speed
        #: The first write that failed (a full disk, a file that takes no writes): the
        #: run goes on, and `close()` says so, naming --samples (the exit status is 1).
        self.error: OSError | None = None

    def record(self, sample: TimingSample) -> None:
        try:
            self._sink.record(TimingSample(sample.route, sample.seconds * self._speed,
                                           sample.censored, sample.at))
        except OSError as exc:
            self.error = self.error or exc

    def close(self) -> None:
        try:
            self._sink.close()
        except OSError as exc:
            self.error = self.error or exc
        if self.error is not None:
            raise OSError(f"--samples {self._path!r}: samples not written: "
                          f"{self.error.strerror or self.error}")


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


class _Caller:
    """One simulated caller: its slot, the conversation it is in, what it does next."""

    __slots__ = ("generation", "next", "pid", "slot", "talking", "turns_left")

    def __init__(self, slot: int) -> None:
        self.slot, self.generation = slot, 0
        self.pid = ""
        self.talking = False
        self.turns_left = 0
        #: The step it takes when it is due (`_Crowd.join`, `speak`, `barge_in`, ...).
        self.next: Callable[[_Caller], Awaitable[None]] | None = None


class _Crowd:
    """Participants joining, talking, interrupting and leaving through the topics.

    Every caller is driven from one task, on one heap of due steps: a task and a
    timer per caller would cost the router's core more than the refusal of a
    caller's turn does (a task wake-up, a future and a timer per sleep), and the
    process' capacity would then depend on its simulated callers. Each caller still
    speaks on its own schedule (it does not wait for an answer).
    """

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
        #: (when, sequence, caller): the callers' next steps, in the loop's time.
        self._due: list[tuple[float, int, _Caller]] = []
        self._sequence = itertools.count().__next__
        self._now = asyncio.get_running_loop().time

    def pick(self, pid: str) -> str:
        rng = self.rng
        if self.router.focus_of(pid) == "travel" and rng.random() < 0.7:
            return rng.choice(self.by_domain["travel"])
        if rng.random() < self.oos_share:
            return rng.choice(self.oos)
        return rng.choice(self.in_scope)

    def _after(self, caller: _Caller, seconds: float,
               step: Callable[[_Caller], Awaitable[None]]) -> None:
        """`caller` takes `step` in `seconds` of simulated time."""
        caller.next = step
        heapq.heappush(self._due, (self._now() + seconds / self.config.speed,
                                   self._sequence(), caller))

    async def _settle_patches(self, pid: str) -> None:
        """The participant answers the router's question about a held background result."""
        for held in self.router.pending_patches(pid):
            settle = (self.router.approve_patch if self.rng.random() < 0.7
                      else self.router.reject_patch)
            with contextlib.suppress(LifecycleError):  # settled or dropped meanwhile
                await settle(held.patch_id)

    async def run(self, participants: int, spawn: Callable[..., object]) -> None:
        """Drive `participants` callers until cancelled; then every caller still in a
        conversation leaves. `spawn(fn, caller)` runs a caller's step that waits on
        the router (settling a held patch) beside the others."""
        callers = [_Caller(slot) for slot in range(participants)]
        for caller in callers:
            self._after(caller, self.rng.uniform(0, 2.0), self.join)  # arrivals spread out
        due, now, pop = self._due, self._now, heapq.heappop
        try:
            while True:
                wait = due[0][0] - now() if due else 1.0
                if wait > 0:
                    await asyncio.sleep(wait)
                    continue
                caller = pop(due)[2]
                step = caller.next
                assert step is not None
                caller.next = None
                if step == self.speak and self.router.pending_patches(caller.pid):
                    spawn(self._settle_then_speak, caller)  # rare: not on the heap's time
                else:
                    await step(caller)
        finally:
            with anyio.CancelScope(shield=True):
                for caller in callers:
                    if caller.talking:
                        await self.leave(caller, again=False)

    async def join(self, caller: _Caller) -> None:
        caller.generation += 1
        caller.pid = pid = f"user-{caller.slot:05d}-{caller.generation}"
        await self.runtime.publish(_Topics.joined, ParticipantJoined(participant_id=pid))
        caller.talking = True
        self.active += 1
        caller.turns_left = self.rng.randint(3, 10)
        await self.speak(caller)

    async def _settle_then_speak(self, caller: _Caller) -> None:
        await self._settle_patches(caller.pid)
        if caller.talking:  # not made to leave (the run ended) meanwhile
            await self.speak(caller)

    async def speak(self, caller: _Caller) -> None:
        rng, publish, pid = self.rng, self.runtime.publish, caller.pid
        await publish(_Topics.query, UserQuery(participant_id=pid, text=self.pick(pid)))
        self.published += 1
        if rng.random() < 0.01:
            # A flaky speech recogniser publishes a malformed query now and then: the
            # router rejects and counts it.
            await publish(_Topics.query, {"participant_id": pid, "text": None})
            self.published += 1
        caller.turns_left -= 1
        then = self.speak if caller.turns_left else self.leave
        roll = rng.random()
        if roll < 0.05:  # barge-in while the answer is on its way
            self._after(caller, rng.uniform(0.1, 0.6), self.barge_in)
        elif roll < 0.09:  # speaks again before the answer: supersedes it
            self._after(caller, rng.uniform(0.1, 0.4), then)
        else:
            self._after(caller, rng.uniform(1.5, 4.0), then)  # listen, think

    async def barge_in(self, caller: _Caller) -> None:
        await self.runtime.publish(_Topics.interrupted,
                                   Interrupted(participant_id=caller.pid))
        then = self.speak if caller.turns_left else self.leave
        self._after(caller, self.rng.uniform(1.5, 4.0), then)  # listen, think

    async def leave(self, caller: _Caller, *, again: bool = True) -> None:
        caller.talking = False
        self.active -= 1
        await self.runtime.publish(_Topics.left, ParticipantLeft(participant_id=caller.pid))
        if again:
            self._after(caller, self.rng.uniform(0.2, 1.0), self.join)


class _ExpectedFaults(logging.Filter):
    """Keep the demo's own injected faults out of the log; real problems still show.

    The short history (`DEMO_HISTORY_EXCHANGES`) overflows by design: the report counts
    it instead of the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], SimulatedOutage):
            return False
        message = record.getMessage()  # failures are logged by type (see _logging)
        return not (f"({SimulatedOutage.__name__})" in message or "(rejected)" in message
                    or "limit history_exchanges exceeded" in message)


async def run_demo(config: DemoConfig, *, out: TextIO | None = None) -> DemoReport:
    """Run the simulated deployment; return (and print) its report.

    ConfigurationError (before anything runs) when the OTLP settings are invalid or the
    exporter is missing, or `/metrics` cannot be served on the configured host and port.
    """
    # `--serve` ends at Ctrl-C or SIGTERM: the handlers are installed before `/metrics`
    # is announced, so a signal sent as soon as the line is read drains and reports too
    # (newcomer16: one within 0.6 s of it killed the demo, exit 143, no report).
    with contextlib.ExitStack() as handlers:
        signals = None
        if config.serve and threading.current_thread() is threading.main_thread():
            signals = handlers.enter_context(
                anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM))
        return await _run_demo(config, out, functools.partial(
            _until_stopped, signals, handlers))


async def _run_demo(config: DemoConfig, out: TextIO | None,
                    until_stopped: Callable[[], Awaitable[None]]) -> DemoReport:
    out = sys.stdout if out is None else out  # the stream current now, not at import
    otlp_settings(config)  # validate before starting anything
    rng = random.Random(config.seed)
    sample = load_sample()
    registry = CollectorRegistry()
    server = None
    routers: list[AgentRouter] = []  # the one the run builds: `/ready` reads it
    if config.metrics_port is not None:
        try:
            server = serve_metrics(config.metrics_port, registry=registry,
                                   addr=config.metrics_host,
                                   ready=lambda: not any(r.busy for r in routers))
        except (OSError, ValueError) as exc:  # unknown host, port in use, bad address
            raise ConfigurationError(
                f"cannot serve metrics on {config.metrics_host!r} port "
                f"{config.metrics_port}: {bind_error(exc)}") from exc
        print(f"metrics: http://{config.metrics_host}:{server.port}/metrics", file=out,
              flush=True)
    quiet = _ExpectedFaults()
    tracer_provider = sink = None
    try:
        tracer_provider = demo_tracer_provider(config, out)
        sink = _SpeedSink(config.samples_path, config.speed) if config.samples_path else None
        for name in ("turnrouter", "turnrouter.runtime"):
            logging.getLogger(name).addFilter(quiet)
        report = await _run(config, rng, sample, registry, tracer_provider, sink, out,
                            routers, until_stopped)
    finally:
        # Every step runs even if one before it fails (a sink on a full disk raises).
        for name in ("turnrouter", "turnrouter.runtime"):
            logging.getLogger(name).removeFilter(quiet)
        with contextlib.ExitStack() as cleanup:
            if sink is not None:
                cleanup.callback(sink.close)
            if tracer_provider is not None:
                cleanup.callback(tracer_provider.shutdown)  # flush the exporter before exit
            if server is not None:
                cleanup.callback(server.close)
    print("\n" + report.render(), file=out)
    return report


async def _run(config: DemoConfig, rng: random.Random, sample: Sample,
               registry: CollectorRegistry, tracer_provider: Any, sink: _SpeedSink | None,
               out: TextIO, routers: list[AgentRouter],
               until_stopped: Callable[[], Awaitable[None]]) -> DemoReport:
    telemetry = Telemetry(tracer_provider=tracer_provider, registry=registry)
    runtime = AgentRuntime()

    async def publish_answer(turn: AgentTurn, route: str, text: str) -> None:
        await runtime.publish(_Topics.output, ResponseOutput(
            participant_id=turn.participant_id, request_id=turn.turn_id, route=route,
            text=text))

    agents = build_agents(sample, rng=rng, publish=publish_answer, speed=config.speed,
                          clarify_heavy=config.clarify_heavy,
                          failing_routes=config.failing_routes,
                          slow_routes=config.slow_routes)
    acknowledger = _acknowledger()
    ack: dict[str, Any] = {}
    if acknowledger is not None and config.acknowledgment_delay is not None:
        ack = {"acknowledgment_llm": acknowledger,
               "acknowledgment_delay_secs": config.acknowledgment_delay / config.speed}
    if sink is not None:
        ack["timing_sink"] = sink
    router = AgentRouter(
        agents, LexicalDecisions(examples=sample.examples, fallback_route=DEFAULT_ROUTE),
        default_destination=DEFAULT_ROUTE, telemetry=telemetry,
        query_topic=_Topics.query, output_topic=_Topics.output,
        participant_joined_topic=_Topics.joined, participant_left_topic=_Topics.left,
        interrupted_topic=_Topics.interrupted,
        # A short memory, as voice sessions keep: longer sessions overflow it now and
        # then, so the overflow panel and counter have real data.
        max_history_exchanges=DEMO_HISTORY_EXCHANGES,
        overload=OverloadPolicy().scaled(config.speed) if config.shedding else None, **ack,
    )
    routers.append(router)
    for agent in agents.values():
        agent.router, agent.spawn = router, runtime.start_soon
    crowd = _Crowd(runtime, router, sample, config, rng)
    # As `turnrouter worker` does once ready: the start-up heap (modules, the decision
    # model, the sample) leaves the collector's full passes, which otherwise walk it all
    # and stall every turn in flight (the p95 first response under load). Only when
    # nothing is frozen yet, so the heap is given back as found.
    frozen = gc.get_freeze_count() == 0
    if frozen:
        gc.freeze()
    start = time.monotonic()
    try:
        async with runtime:
            runtime.register(router.runtime_subscriber())
            async with anyio.create_task_group() as tg:
                tg.start_soon(crowd.run, config.participants, tg.start_soon)
                if config.progress:
                    tg.start_soon(_progress, registry, crowd, start, out)
                if config.serve:
                    await until_stopped()
                else:
                    await anyio.sleep(config.duration)
                tg.cancel_scope.cancel()
            # Leaving the runtime drains the turns and departures still under way.
    finally:
        if frozen:
            gc.unfreeze()
        with anyio.CancelScope(shield=True):
            await router.stop()
    elapsed = time.monotonic() - start
    return DemoReport.read(registry, elapsed, crowd.published)


async def _until_stopped(signals: AsyncIterator[signal.Signals] | None,
                         handlers: contextlib.ExitStack) -> None:
    """Until Ctrl-C or SIGTERM (`--serve`; `signals` received since `run_demo` began):
    the run then ends as a timed one does, its turns drained and its report printed.
    The handlers go at the first signal, so a second Ctrl-C interrupts the drain. Off
    the main thread, where none can be installed (`signals` None), until cancelled."""
    if signals is None:
        await anyio.sleep_forever()
        return
    async for _ in signals:
        handlers.close()
        return


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
