"""Telemetry overhead: AgentRouter.handle() off, with metrics, traced and head-sampled,
against a minimal hand-written loop with and without the same raw SDK spans.

One process runs every variant, interleaved chunk by chunk of turns within each round
(the first round warms up and is discarded), so the ratios hold on a shared, noisy
machine:

- `loop`: a minimal hand-written router loop: per turn decide, admit, answer (the agent
  calls `started()` and speaks through the output callback), remember the exchange;
- `loop+spans`: the same loop making, with the SDK (`TracerProvider` +
  `BatchSpanProcessor`, an exporter that discards), the spans turnrouter makes for such
  a turn: `turnrouter.turn` and its `turnrouter.route`, `turnrouter.admission` and
  `invoke_agent {route}` children, with the same attributes and the one
  `turnrouter.first_response` event (`tests/test_benchmarks.py` checks they are the
  router's, name for name, parent for parent, key for key);
- `loop+current`: `loop+spans` also making the spans current as turnrouter's span
  contract has it (the turn span for the whole turn, each child while its call runs,
  so the decision service's and the agent's own spans nest under them): what a
  hand-written router keeping that contract pays;
- `off`: AgentRouter with `Telemetry.disabled()`;
- `metrics`: metrics on, a `NoOpTracerProvider`;
- `metrics+spans`: the `metrics` router, each turn followed by the spans of `loop+spans`
  made by hand: what the SDK charges for those spans, paid between the router's work;
- `traced`: metrics and the SDK provider of `loop+spans`;
- `sampled10`: the same with `ParentBased(TraceIdRatioBased(0.1))`: one turn in ten traced;
- `sampled0`: the same sampler at 0: every turn's root span is non-recording;
- `metrics+root0`: the `metrics` router inside a turn span made by hand under the
  `sampled0` sampler and current during the turn: what the SDK charges an unsampled turn
  (sampler, ids, context) with no glue at all; with `metrics+spans`, the floor of
  `sampled10`.

Goals (issue #32): traced <= 1.2x loop+spans; sampled10 <= 1.2x metrics; off <= 3.6x loop.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_telemetry_overhead.py [--turns N]
        [--repeats R]
    PYTHONPATH=src .venv/bin/python benchmarks/bench_telemetry_overhead.py --baseline TREE
        [--rounds K]

`--baseline TREE` (another checkout, e.g. `git worktree add /tmp/old REV`) runs this
script in a fresh process per tree and round (`PYTHONPATH=<tree>/src`), the trees
alternating, and prints each tree's medians over rounds side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace import NoOpTracerProvider, Span, Tracer
from prometheus_client import CollectorRegistry

from turnrouter import (
    Admission,
    AgentRouter,
    AgentTurn,
    DestinationResult,
    RouteDecision,
    RouteRequest,
    RouterObserver,
    RoutingAid,
)
from turnrouter.telemetry import Telemetry

#: This checkout's sources (what `--baseline` times as "this").
THIS_TREE = Path(__file__).resolve().parents[1] / "src"
#: Spans of one plain answered turn: turn, route, admission, invoke_agent.
SPANS_PER_TURN = 4
ROUTES = ("weather", "calendar", "conversation")
VARIANTS = ("loop", "loop+spans", "loop+current", "off", "metrics", "metrics+spans",
            "metrics+root0", "traced", "sampled10", "sampled0")
GOALS = {"traced / loop+spans": 1.2, "sampled10 / metrics": 1.2, "off / loop": 3.6}

_ACCEPT = Admission("accept")
_RESULT = DestinationResult("answer", "done")
Output = Callable[[AgentTurn, str, str], Awaitable[None]]


class DiscardingExporter(SpanExporter):
    """Counts each batch's spans and keeps nothing."""

    def __init__(self) -> None:
        self.exported = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.exported += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class SpeakingAgent:
    """Admits every turn and answers at once, speaking its answer through `output`."""

    def __init__(self, name: str, output: Output) -> None:
        self.aid = RoutingAid(name, f"{name} requests")
        self.name = name
        self.output = output

    def routing_aid(self, participant_id: str) -> RoutingAid:
        return self.aid

    async def admit(self, turn: AgentTurn, *, focused: bool) -> Admission:
        return _ACCEPT

    async def answer(
        self, turn: AgentTurn, *, started: Callable[[], Awaitable[None]]
    ) -> DestinationResult:
        await started()
        await self.output(turn, self.name, _RESULT.text)
        return _RESULT

    async def release(self, participant_id: str) -> None:
        return None


class FirstCandidate:
    async def decide(self, request: RouteRequest) -> RouteDecision:
        return RouteDecision(request.candidates[0].name)


async def _discard(turn: AgentTurn, route: str, text: str) -> None:
    return None


async def _nothing() -> None:
    return None


def agents() -> dict[str, SpeakingAgent]:
    return {name: SpeakingAgent(name, _discard) for name in ROUTES}


def turns(n: int, participants: int = 100) -> list[AgentTurn]:
    return [AgentTurn(f"p{i % participants}", f"t{i}", "what's the weather")
            for i in range(n)]


async def loop(agents: dict[str, SpeakingAgent], decisions: FirstCandidate,
               turns: list[AgentTurn]) -> None:
    """The least a router must do per turn: decide, admit, answer (which outputs),
    remember the exchange."""
    history: dict[str, list[tuple[str, str]]] = {}
    for turn in turns:
        candidates = tuple(agent.routing_aid(turn.participant_id) for agent in agents.values())
        decision = await decisions.decide(RouteRequest(turn, candidates))
        agent = agents[decision.choice]
        admission = await agent.admit(turn, focused=False)
        if admission.disposition == "accept":
            result = await agent.answer(turn, started=_nothing)
            history.setdefault(turn.participant_id, []).append((turn.query, result.text))


class _FirstResponse:
    """`started()` of the traced loop: the first call adds the first-response event."""

    __slots__ = ("seconds", "span", "t0")

    def __init__(self, span: Span, t0: float) -> None:
        self.span, self.t0 = span, t0
        self.seconds: float | None = None

    async def __call__(self) -> None:
        if self.seconds is None:
            self.seconds = seconds = time.perf_counter() - self.t0
            self.span.add_event("turnrouter.first_response",
                                {"turnrouter.first_response.seconds": seconds})


async def loop_with_spans(agents: dict[str, SpeakingAgent], decisions: FirstCandidate,
                          turns: list[AgentTurn], tracer: Tracer) -> None:
    """`loop` making the spans turnrouter makes for a plain answered turn, with the SDK
    as a hand-written router would: attributes known up front at `start_span`, the
    rest in one `set_attributes` call at the end, the event at `started()`."""
    history: dict[str, list[tuple[str, str]]] = {}
    set_in_context, start_span = trace.set_span_in_context, tracer.start_span
    for turn in turns:
        root = start_span("turnrouter.turn", attributes={
            "turnrouter.participant.id": turn.participant_id,
            "turnrouter.turn.id": turn.turn_id})
        ctx = set_in_context(root)
        candidates = tuple(agent.routing_aid(turn.participant_id) for agent in agents.values())
        span = start_span("turnrouter.route", context=ctx, attributes={
            "turnrouter.decision.candidates": tuple(aid.name for aid in candidates),
            "turnrouter.decision.excluded": ()})
        decision = await decisions.decide(RouteRequest(turn, candidates))
        choice = decision.choice
        span.set_attributes({"turnrouter.decision.choice": choice})
        span.end()
        agent = agents[choice]
        span = start_span("turnrouter.admission", context=ctx, attributes={
            "turnrouter.route": choice, "turnrouter.admission.focused": False})
        admission = await agent.admit(turn, focused=False)
        span.set_attributes({"turnrouter.admission.disposition": admission.disposition})
        span.end()
        if admission.disposition == "accept":
            span = start_span("invoke_agent " + choice, context=ctx, attributes={
                "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": choice,
                "turnrouter.fallback": False})
            started = _FirstResponse(span, time.perf_counter())
            result = await agent.answer(turn, started=started)
            span.set_attributes({"turnrouter.first_response.seconds": started.seconds or 0.0,
                                 "turnrouter.result.disposition": result.disposition})
            span.end()
            history.setdefault(turn.participant_id, []).append((turn.query, result.text))
            root.set_attributes({"turnrouter.outcome": result.disposition,
                                 "turnrouter.attempts": 1, "turnrouter.route": choice})
        root.end()


async def loop_with_current_spans(agents: dict[str, SpeakingAgent],
                                  decisions: FirstCandidate, turns: list[AgentTurn],
                                  tracer: Tracer) -> None:
    """`loop_with_spans`, each span current as turnrouter's are: the turn span for the
    whole turn, the route, admission and `invoke_agent` spans while their call runs."""
    history: dict[str, list[tuple[str, str]]] = {}
    set_in_context, start_span = trace.set_span_in_context, tracer.start_span
    attach, detach = otel_context.attach, otel_context.detach
    for turn in turns:
        root = start_span("turnrouter.turn", attributes={
            "turnrouter.participant.id": turn.participant_id,
            "turnrouter.turn.id": turn.turn_id})
        ctx = set_in_context(root)
        turn_token = attach(ctx)
        candidates = tuple(agent.routing_aid(turn.participant_id) for agent in agents.values())
        span = start_span("turnrouter.route", context=ctx, attributes={
            "turnrouter.decision.candidates": tuple(aid.name for aid in candidates),
            "turnrouter.decision.excluded": ()})
        token = attach(set_in_context(span, ctx))
        decision = await decisions.decide(RouteRequest(turn, candidates))
        detach(token)
        choice = decision.choice
        span.set_attributes({"turnrouter.decision.choice": choice})
        span.end()
        agent = agents[choice]
        span = start_span("turnrouter.admission", context=ctx, attributes={
            "turnrouter.route": choice, "turnrouter.admission.focused": False})
        token = attach(set_in_context(span, ctx))
        admission = await agent.admit(turn, focused=False)
        detach(token)
        span.set_attributes({"turnrouter.admission.disposition": admission.disposition})
        span.end()
        if admission.disposition == "accept":
            span = start_span("invoke_agent " + choice, context=ctx, attributes={
                "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": choice,
                "turnrouter.fallback": False})
            token = attach(set_in_context(span, ctx))
            started = _FirstResponse(span, time.perf_counter())
            result = await agent.answer(turn, started=started)
            detach(token)
            span.set_attributes({"turnrouter.first_response.seconds": started.seconds or 0.0,
                                 "turnrouter.result.disposition": result.disposition})
            span.end()
            history.setdefault(turn.participant_id, []).append((turn.query, result.text))
            root.set_attributes({"turnrouter.outcome": result.disposition,
                                 "turnrouter.attempts": 1, "turnrouter.route": choice})
        detach(turn_token)
        root.end()


def hand_spans(tracer: Tracer, turn: AgentTurn, candidates: tuple[str, ...],
               choice: str) -> None:
    """The spans of `loop_with_spans` for one answered turn, made in one go."""
    start_span = tracer.start_span
    root = start_span("turnrouter.turn", attributes={
        "turnrouter.participant.id": turn.participant_id,
        "turnrouter.turn.id": turn.turn_id})
    ctx = trace.set_span_in_context(root)
    span = start_span("turnrouter.route", context=ctx, attributes={
        "turnrouter.decision.candidates": candidates, "turnrouter.decision.excluded": ()})
    span.set_attributes({"turnrouter.decision.choice": choice})
    span.end()
    span = start_span("turnrouter.admission", context=ctx, attributes={
        "turnrouter.route": choice, "turnrouter.admission.focused": False})
    span.set_attributes({"turnrouter.admission.disposition": "accept"})
    span.end()
    span = start_span("invoke_agent " + choice, context=ctx, attributes={
        "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": choice,
        "turnrouter.fallback": False})
    span.add_event("turnrouter.first_response", {"turnrouter.first_response.seconds": 0.0})
    span.set_attributes({"turnrouter.first_response.seconds": 0.0,
                         "turnrouter.result.disposition": "answer"})
    span.end()
    root.set_attributes({"turnrouter.outcome": "answer", "turnrouter.attempts": 1,
                         "turnrouter.route": choice})
    root.end()


async def _drive_with_hand_spans(
    handle: Callable[[AgentTurn], Awaitable[DestinationResult]], turns: list[AgentTurn],
    tracer: Tracer,
) -> None:
    """The metrics-only router, each turn followed by its spans made by hand: the SDK's
    charge for the spans, paid between the router's work as the traced router pays it."""
    candidates = ROUTES
    for turn in turns:
        await handle(turn)
        hand_spans(tracer, turn, candidates, candidates[0])


async def _drive_in_hand_roots(
    handle: Callable[[AgentTurn], Awaitable[DestinationResult]], turns: list[AgentTurn],
    tracer: Tracer,
) -> None:
    """The metrics-only router, each turn inside a turn span made by hand and current
    while the turn runs (unsampled under `metrics+root0`'s sampler): what the SDK charges
    a turn's root span and its context, with no glue."""
    set_in_context, start_span = trace.set_span_in_context, tracer.start_span
    attach, detach = otel_context.attach, otel_context.detach
    for turn in turns:
        root = start_span("turnrouter.turn", attributes={
            "turnrouter.participant.id": turn.participant_id,
            "turnrouter.turn.id": turn.turn_id})
        token = attach(set_in_context(root))
        await handle(turn)
        detach(token)
        root.end()


async def router_turns(observer: RouterObserver, agents: dict[str, SpeakingAgent],
                       decisions: FirstCandidate, turns: list[AgentTurn]) -> float:
    """Seconds for a fresh router with `observer` to handle `turns` one after another."""
    router = AgentRouter(agents, decisions, output=_discard, telemetry=observer)
    start = time.perf_counter()
    await _drive(router.handle, turns)
    elapsed = time.perf_counter() - start
    await router.stop()
    return elapsed


async def _drive(handle: Callable[[AgentTurn], Awaitable[DestinationResult]],
                 turns: list[AgentTurn]) -> None:
    for turn in turns:
        await handle(turn)


def sdk_provider(sampler: Sampler | None = None) -> tuple[TracerProvider, DiscardingExporter]:
    """An SDK provider with a batch processor and an exporter that discards."""
    exporter = DiscardingExporter()
    provider = TracerProvider() if sampler is None else TracerProvider(sampler=sampler)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider, exporter


class OpcodeCounter:
    """Counts the bytecodes this thread executes in frames started inside the block
    (`sys.settrace`): deterministic, where wall-clock time on a shared machine is not.
    The batch processor's export thread is not counted (background work)."""

    def __init__(self) -> None:
        self.count = 0

    def __enter__(self) -> OpcodeCounter:
        sys.settrace(self._trace)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(None)

    def _trace(self, frame: FrameType, event: str, arg: object) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            self.count += 1
        return self._trace


class Variants:
    """Each variant's way of running a list of turns, over shared agents and providers."""

    def __init__(self) -> None:
        self.agents, self.decisions = agents(), FirstCandidate()
        self.providers = {name: sdk_provider(sampler) for name, sampler in (
            ("loop+spans", None), ("loop+current", None), ("metrics+spans", None),
            ("traced", None), ("sampled10", ParentBased(TraceIdRatioBased(0.1))),
            ("sampled0", ParentBased(TraceIdRatioBased(0.0))),
            ("metrics+root0", ParentBased(TraceIdRatioBased(0.0))))}
        self.noop = NoOpTracerProvider()

    def runner(self, variant: str) -> tuple[Callable[[list[AgentTurn]], Awaitable[None]],
                                            Callable[[], Awaitable[None]]]:
        """`(run, close)`: `run(turns)` handles turns (a router's state is kept from
        one call to the next), `close()` stops the router."""
        agents_, decisions = self.agents, self.decisions
        if variant == "loop":
            return (lambda turns: loop(agents_, decisions, turns)), _nothing
        if variant == "loop+spans":
            tracer = self.providers[variant][0].get_tracer("bench")
            return (lambda turns: loop_with_spans(agents_, decisions, turns, tracer)), _nothing
        if variant == "loop+current":
            tracer = self.providers[variant][0].get_tracer("bench")
            return (lambda turns: loop_with_current_spans(agents_, decisions, turns, tracer),
                    _nothing)
        observer: RouterObserver
        if variant == "off":
            observer = Telemetry.disabled()
        elif variant in ("metrics", "metrics+spans", "metrics+root0"):
            observer = Telemetry(tracer_provider=self.noop, registry=CollectorRegistry())
        else:
            observer = Telemetry(tracer_provider=self.providers[variant][0],
                                 registry=CollectorRegistry())
        router = AgentRouter(agents_, decisions, output=_discard, telemetry=observer)
        handle = router.handle
        if variant == "metrics+spans":
            tracer = self.providers[variant][0].get_tracer("bench")
            return (lambda turns: _drive_with_hand_spans(handle, turns, tracer)), router.stop
        if variant == "metrics+root0":
            tracer = self.providers[variant][0].get_tracer("bench")
            return (lambda turns: _drive_in_hand_roots(handle, turns, tracer)), router.stop
        return (lambda turns: _drive(handle, turns)), router.stop

    def flush(self) -> None:
        for provider, _ in self.providers.values():
            provider.force_flush()

    def shutdown(self) -> None:
        for provider, _ in self.providers.values():
            provider.shutdown()


async def measure(n: int, repeats: int, bytecodes: int = 0,
                  chunk: int = 250) -> dict[str, float]:
    """Median µs per turn of each variant, spans exported per turn (`spans/<variant>`:
    a router's count includes the release spans of its `stop()`, 100 a round) and, with
    `bytecodes` > 0, bytecodes per turn over that many turns after 200 of warm-up
    (`bytecodes/<variant>`).

    Each round gives every variant a fresh router (or loop) and the same `n` turns in
    chunks of `chunk`, the variants taking turns chunk by chunk (in an order that
    rotates), so a burst of load on a shared machine falls on all of them alike."""
    variants, turns_ = Variants(), turns(n)
    chunks = [turns_[i:i + chunk] for i in range(0, n, chunk)]
    results: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    figures: dict[str, float] = {}
    try:
        for index in range(repeats + 1):  # round 0 warms up and is discarded
            runners = {variant: variants.runner(variant) for variant in VARIANTS}
            spent = dict.fromkeys(VARIANTS, 0.0)
            gc.collect()
            for number, part in enumerate(chunks):
                shift = number % len(VARIANTS)
                for variant in VARIANTS[shift:] + VARIANTS[:shift]:
                    run = runners[variant][0]
                    start = time.perf_counter()
                    await run(part)
                    spent[variant] += time.perf_counter() - start
            for _, close in runners.values():
                await close()
            variants.flush()
            if index:
                for variant, seconds in spent.items():
                    results[variant].append(seconds)
            else:
                for _, exporter in variants.providers.values():
                    exporter.exported = 0
        for name, (_, exporter) in variants.providers.items():
            if name in VARIANTS:
                figures[f"spans/{name}"] = exporter.exported / (repeats * n)
        if bytecodes > 0:
            counted = turns(200 + bytecodes)
            for variant in VARIANTS:
                run, close = variants.runner(variant)
                await run(counted[:200])
                spans_to = variants.providers[variant][1] if variant in variants.providers \
                    else None
                variants.flush()
                before = spans_to.exported if spans_to is not None else 0
                random.seed(0)  # the same trace ids, so the same turns sampled, every run
                with OpcodeCounter() as counter:
                    await run(counted[200:])
                figures[f"bytecodes/{variant}"] = counter.count / bytecodes
                if spans_to is not None:  # the counted turns' share that was traced
                    variants.flush()
                    figures[f"traced_share/{variant}"] = (
                        spans_to.exported - before) / (SPANS_PER_TURN * bytecodes)
                await close()
    finally:
        variants.shutdown()
    return {key: statistics.median(values) / n * 1e6
            for key, values in results.items()} | figures


def ratios(f: dict[str, float], prefix: str = "") -> dict[str, float]:
    """The goals' ratios of time per turn (or, with `prefix="bytecodes/"`, of
    bytecodes per turn), and the floor any router meets for the sampled goal."""
    def g(variant: str) -> float:
        return f[prefix + variant]

    return {
        "off / loop": g("off") / g("loop"),
        "metrics / loop": g("metrics") / g("loop"),
        "traced / loop+spans": g("traced") / g("loop+spans"),
        # Against a hand-written router keeping the same span contract (spans current).
        "traced / loop+current": g("traced") / g("loop+current"),
        "sampled10 / metrics": g("sampled10") / g("metrics"),
        "sampled0 / metrics": g("sampled0") / g("metrics"),
        # What turnrouter's tracing adds to what the SDK charges for the same spans.
        "traced / metrics+spans": g("traced") / g("metrics+spans"),
        # The goal's ratio for any router with these metrics and the SDK's spans.
        "floor of traced / loop+spans": g("metrics+spans") / g("loop+spans"),
        # What turnrouter adds to what the SDK charges an unsampled turn.
        "sampled0 / metrics+root0": g("sampled0") / g("metrics+root0"),
        # Any router that keeps the metrics and traces one turn in ten pays at least
        # the metrics plus a tenth of what the SDK charges for the spans...
        "floor of sampled10 / metrics": (
            g("metrics") + 0.1 * (g("loop+spans") - g("loop"))) / g("metrics"),
        # ... and, keeping the unsampled turns' context, what the SDK charges their
        # root spans: nine turns in ten as `metrics+root0`, one as `metrics+spans`.
        "floor of sampled10 / metrics, with roots": (
            0.9 * g("metrics+root0") + 0.1 * g("metrics+spans")) / g("metrics"),
    }


def report(f: dict[str, float]) -> str:
    lines = [f"{variant:<14} {f[variant]:9.2f} µs/turn  {f[variant] / f['loop']:6.2f}x loop"
             for variant in VARIANTS]
    lines.append("spans exported per turn: " + ", ".join(
        f"{key[6:]} {value:.2f}" for key, value in f.items() if key.startswith("spans/")))
    if "traced_share/sampled10" in f:
        lines.append("turns traced in the bytecode count: " + ", ".join(
            f"{key[13:]} {value:.3f}" for key, value in f.items()
            if key.startswith("traced_share/")))
    for name, value in ratios(f).items():
        goal = GOALS.get(name)
        verdict = "" if goal is None else (
            f"  goal <= {goal:g}x: {'met' if value <= goal else 'MISSED'}")
        lines.append(f"{name:<42} {value:6.2f}x{verdict}")
    if "bytecodes/loop" in f:
        lines.append("bytecodes per turn: " + ", ".join(
            f"{variant} {f['bytecodes/' + variant]:.0f}" for variant in VARIANTS))
        lines.extend(f"  {name:<40} {value:6.2f}x" for name, value in
                     ratios(f, "bytecodes/").items())
    return "\n".join(lines)


def compare(baseline: Path, rounds: int, extra: list[str]) -> dict[str, object]:
    """`rounds` rounds of this script's measurement, `baseline`'s tree then this one,
    each in a fresh process; each tree's medians over rounds of the figures and of the
    ratios (a ratio's median is taken over rounds, each measured within one process)."""
    trees = {"baseline": baseline.resolve() / "src", "this": THIS_TREE}
    if not (trees["baseline"] / "turnrouter" / "__init__.py").is_file():
        raise SystemExit(f"--baseline {baseline}: no src/turnrouter there")
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for _ in range(rounds):
        for name, src in trees.items():
            out = subprocess.run(
                [sys.executable, __file__, "--json", *extra], check=True, text=True,
                capture_output=True, env={**os.environ, "PYTHONPATH": str(src)},
            ).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
    result: dict[str, object] = {}
    for name, figures in runs.items():
        entry: dict[str, object] = {
            "per_turn": {key: round(statistics.median(f[key] for f in figures), 2)
                         for key in figures[0]},
            "ratios": {key: round(statistics.median(ratios(f)[key] for f in figures), 3)
                       for key in ratios(figures[0])},
            "ratios_by_round": {key: [round(ratios(f)[key], 2) for f in figures]
                                for key in GOALS},
        }
        if "bytecodes/loop" in figures[0]:  # deterministic: the first round's
            entry["bytecode_ratios"] = {key: round(value, 3) for key, value in
                                        ratios(figures[0], "bytecodes/").items()}
        result[name] = entry
    result["load_average"] = [round(x, 2) for x in os.getloadavg()]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=5, help="measured rounds (>= 1)")
    parser.add_argument("--chunk", type=int, default=250,
                        help="turns a variant runs before the next variant's turn")
    parser.add_argument("--bytecodes", type=int, default=0, metavar="N",
                        help="also count bytecodes per turn over N turns (deterministic)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--baseline", type=Path, metavar="TREE",
                        help="compare another checkout with this one, interleaved")
    parser.add_argument("--rounds", type=int, default=3,
                        help="with --baseline: processes per tree, alternating")
    args = parser.parse_args()
    if min(args.turns, args.repeats, args.rounds, args.chunk) < 1 or args.bytecodes < 0:
        parser.error("--turns, --repeats, --rounds and --chunk take a positive count, "
                     "--bytecodes a count >= 0")
    if args.baseline is not None:
        print(json.dumps(compare(args.baseline, args.rounds, [
            f"--turns={args.turns}", f"--repeats={args.repeats}", f"--chunk={args.chunk}",
            f"--bytecodes={args.bytecodes}"]), indent=2))
        return
    figures = asyncio.run(measure(args.turns, args.repeats, args.bytecodes, args.chunk))
    if args.json:
        print(json.dumps(figures))
        return
    print(f"turns {args.turns}, repeats {args.repeats} (median), "
          f"{SPANS_PER_TURN} spans per traced turn")
    print(report(figures))


if __name__ == "__main__":
    main()
