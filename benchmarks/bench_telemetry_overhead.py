"""Telemetry overhead: AgentRouter.handle() with telemetry off, metrics only, and traced.

Everything is measured in one process and one run, interleaved per repeat, so the ratios
are meaningful on a shared, noisy machine:

- the minimal hand-written routing loop of `bench_router.py`;
- AgentRouter with `Telemetry.disabled()`;
- AgentRouter with metrics on and a no-op tracer provider;
- AgentRouter with metrics and an OpenTelemetry SDK tracer (BatchSpanProcessor, an
  exporter that discards);
- the raw cost of the same number of SDK spans per turn (a turn span and its route,
  admission and `invoke_agent` children) made in a tight loop with the same processor;
- for reference, the same spans carrying the contract's attributes and event, and the
  same again made current while their operation runs, as the router does;
- the metrics-only router with those spans made by hand after each turn: the SDK's cost
  for the same data paid between the router's work instead of in a tight loop. Traced
  divided by this is what turnrouter's tracing adds beyond the SDK's own cost;
- the same with bare spans (no attributes): the floor of any router that keeps these
  metrics and makes these four spans, against the goal's budget.

Goals: metrics on at most 7x the minimal loop; fully traced at most 1.3x (minimal loop +
raw spans).

    .venv/bin/python benchmarks/bench_telemetry_overhead.py [--turns N] [--repeats R]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import NoOpTracerProvider, Tracer
from prometheus_client import CollectorRegistry

from turnrouter import AgentRouter, AgentTurn, RouterObserver
from turnrouter.telemetry import Telemetry

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_router import (
    FirstCandidate,
    InstantAgent,
    _noop_output,
    _turns,
    minimal_loop,
)

#: Spans of one plain answered turn: turn, route, admission, invoke_agent.
SPANS_PER_TURN = 4
_CHILDREN = ("turnrouter.route", "turnrouter.admission", "invoke_agent weather")

METRICS_GOAL = 7.0
TRACED_GOAL = 1.3


class DiscardingExporter(SpanExporter):
    """Accepts every batch and keeps nothing."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def bare_turn_spans(tracer: Tracer) -> None:
    """One turn's worth of bare SDK spans: a root and three children, no attributes."""
    root = tracer.start_span("turnrouter.turn")
    ctx = trace.set_span_in_context(root)
    for name in _CHILDREN:
        tracer.start_span(name, context=ctx).end()
    root.end()


def raw_spans(provider: TracerProvider, n: int) -> float:
    """Seconds for `n` turns' worth of bare SDK spans in a tight loop (the goal's budget)."""
    tracer = provider.get_tracer("bench")
    start = time.perf_counter()
    for _ in range(n):
        bare_turn_spans(tracer)
    return time.perf_counter() - start


_CANDIDATES = ("weather", "calendar", "conversation")


def turn_spans(tracer: Tracer, turn_id: str, current: bool) -> None:
    """One plain answered turn's four spans, made by hand with the contract's data.

    With `current`, each span is also the current span while its operation would run
    (what lets decision services and agents nest their own spans), as the router does.
    `tests/test_benchmarks.py` checks these spans carry what the router's spans carry.
    """
    set_in_context = trace.set_span_in_context
    attach, detach = otel_context.attach, otel_context.detach
    root = tracer.start_span("turnrouter.turn", attributes={
        "turnrouter.participant.id": "p1", "turnrouter.turn.id": turn_id})
    ctx = set_in_context(root)
    turn_token = attach(ctx) if current else None
    span = tracer.start_span("turnrouter.route", context=ctx, attributes={
        "turnrouter.decision.candidates": _CANDIDATES, "turnrouter.decision.excluded": ()})
    if current:
        detach(attach(set_in_context(span)))
    span.set_attributes({"turnrouter.decision.choice": "weather"})
    span.end()
    span = tracer.start_span("turnrouter.admission", context=ctx, attributes={
        "turnrouter.route": "weather", "turnrouter.admission.focused": False})
    if current:
        detach(attach(set_in_context(span)))
    span.set_attributes({"turnrouter.admission.disposition": "accept"})
    span.end()
    span = tracer.start_span("invoke_agent weather", context=ctx, attributes={
        "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "weather",
        "turnrouter.fallback": False})
    token = attach(set_in_context(span)) if current else None
    span.add_event("turnrouter.first_response", {"turnrouter.first_response.seconds": 0.1})
    if token is not None:
        detach(token)
    span.set_attributes({"turnrouter.first_response.seconds": 0.1,
                         "turnrouter.result.disposition": "answer"})
    span.end()
    root.set_attributes({"turnrouter.outcome": "answer", "turnrouter.attempts": 1,
                         "turnrouter.route": "weather"})
    root.end()
    if turn_token is not None:
        detach(turn_token)


def raw_spans_with_data(provider: TracerProvider, n: int, *, current: bool = False) -> float:
    """Seconds for `n` turns of `turn_spans` in a tight loop: what the SDK itself charges
    for a traced turn's data."""
    tracer = provider.get_tracer("bench")
    start = time.perf_counter()
    for i in range(n):
        turn_spans(tracer, f"t{i}", current)
    return time.perf_counter() - start


async def metrics_router_with_hand_spans(
    provider: TracerProvider, agents: dict[str, InstantAgent], decisions: FirstCandidate,
    turns: list[AgentTurn], *, bare: bool = False,
) -> float:
    """Seconds for the metrics-only router plus, after each turn, `turn_spans` made by hand
    (current): the SDK's cost paid between the router's work rather than in a tight loop,
    where its code and data stay hot in the CPU caches. With `bare`, the spans carry no
    attributes at all: the floor of any router with metrics and these four spans."""
    router = AgentRouter(agents, decisions, output=_noop_output, telemetry=Telemetry(
        tracer_provider=NoOpTracerProvider(), registry=CollectorRegistry()))
    handle, tracer = router.handle, provider.get_tracer("bench")
    start = time.perf_counter()
    for turn in turns:
        await handle(turn)
        if bare:
            bare_turn_spans(tracer)
        else:
            turn_spans(tracer, turn.turn_id, True)
    elapsed = time.perf_counter() - start
    await router.stop()
    return elapsed


async def timed_router(observer: RouterObserver, agents: dict[str, InstantAgent],
                       decisions: FirstCandidate, turns: list[AgentTurn]) -> float:
    router = AgentRouter(agents, decisions, output=_noop_output, telemetry=observer)
    handle = router.handle
    start = time.perf_counter()
    for turn in turns:
        await handle(turn)
    elapsed = time.perf_counter() - start
    await router.stop()
    return elapsed


async def measure(n: int, repeats: int) -> dict[str, float]:
    """Median µs per turn of each variant."""
    agents = {name: InstantAgent(name) for name in ("weather", "calendar", "conversation")}
    decisions = FirstCandidate()
    turns = _turns(n, 100)
    provider = TracerProvider()
    processor = BatchSpanProcessor(DiscardingExporter())
    provider.add_span_processor(processor)
    noop = NoOpTracerProvider()
    results: dict[str, list[float]] = {
        "minimal": [], "disabled": [], "metrics": [], "traced": [], "raw_spans": [],
        "raw_data": [], "raw_data_current": [], "interleaved": [], "interleaved_bare": []}
    try:
        for index in range(repeats + 1):  # round 0 warms up and is discarded
            round_: dict[str, float] = {}
            gc.collect()
            start = time.perf_counter()
            await minimal_loop(agents, decisions, turns)
            round_["minimal"] = time.perf_counter() - start
            gc.collect()
            round_["disabled"] = await timed_router(
                Telemetry.disabled(), agents, decisions, turns)
            gc.collect()
            round_["metrics"] = await timed_router(
                Telemetry(tracer_provider=noop, registry=CollectorRegistry()),
                agents, decisions, turns)
            processor.force_flush()
            gc.collect()
            round_["traced"] = await timed_router(
                Telemetry(tracer_provider=provider, registry=CollectorRegistry()),
                agents, decisions, turns)
            processor.force_flush()
            gc.collect()
            round_["raw_spans"] = raw_spans(provider, n)
            processor.force_flush()
            gc.collect()
            round_["raw_data"] = raw_spans_with_data(provider, n)
            processor.force_flush()
            gc.collect()
            round_["raw_data_current"] = raw_spans_with_data(provider, n, current=True)
            processor.force_flush()
            gc.collect()
            round_["interleaved"] = await metrics_router_with_hand_spans(
                provider, agents, decisions, turns)
            processor.force_flush()
            gc.collect()
            round_["interleaved_bare"] = await metrics_router_with_hand_spans(
                provider, agents, decisions, turns, bare=True)
            processor.force_flush()
            if index:
                for key, value in round_.items():
                    results[key].append(value)
    finally:
        provider.shutdown()
    return {key: statistics.median(values) / n * 1e6 for key, values in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5, help="measured rounds (>= 1)")
    args = parser.parse_args()
    f = asyncio.run(measure(args.turns, args.repeats))
    minimal = f["minimal"]
    traced_budget = minimal + f["raw_spans"]
    metrics_ratio = f["metrics"] / minimal
    traced_ratio = f["traced"] / traced_budget
    print(f"turns {args.turns}, repeats {args.repeats} (median), "
          f"{SPANS_PER_TURN} spans per traced turn")
    print(f"minimal loop                    {minimal:8.2f} µs/turn")
    print(f"router, telemetry disabled      {f['disabled']:8.2f} µs/turn"
          f"  {f['disabled'] / minimal:5.2f}x minimal")
    print(f"router, metrics + no-op tracer  {f['metrics']:8.2f} µs/turn"
          f"  {metrics_ratio:5.2f}x minimal  (goal <= {METRICS_GOAL:g}x)")
    print(f"router, metrics + SDK tracer    {f['traced']:8.2f} µs/turn"
          f"  {f['traced'] / minimal:5.2f}x minimal")
    print(f"raw SDK spans ({SPANS_PER_TURN} per turn)       {f['raw_spans']:8.2f} µs/turn"
          f"  ({f['raw_spans'] / SPANS_PER_TURN:.2f} µs/span)")
    print(f"traced / (minimal + raw spans)  {traced_ratio:8.2f}x"
          f"          (goal <= {TRACED_GOAL:g}x; budget {traced_budget:.2f} µs/turn)")
    for key, label in (("raw_data", "with the contract's attributes and event"),
                       ("raw_data_current", "with that data, current while their call runs")):
        print(f"raw SDK spans {label:<47} {f[key]:8.2f} µs/turn; traced / (minimal + "
              f"those) {f['traced'] / (minimal + f[key]):.2f}x")
    print(f"the SDK's own cost of the contract's data alone: (minimal + raw spans with data) "
          f"/ (minimal + raw spans) = {(minimal + f['raw_data']) / traced_budget:.2f}x")
    print(f"metrics-only router + the same spans by hand after each turn "
          f"{f['interleaved']:8.2f} µs/turn; traced / that {f['traced'] / f['interleaved']:.2f}x"
          f"\n  (what turnrouter's tracing adds beyond the SDK's own cost for the data; the "
          f"hand-made spans cost {f['interleaved'] - f['metrics']:.2f} µs/turn there)")
    print(f"metrics-only router + bare spans (no attributes) by hand after each turn "
          f"{f['interleaved_bare']:8.2f} µs/turn = {f['interleaved_bare'] / traced_budget:.2f}x "
          f"the goal's budget\n  (the floor of any router with these metrics and four spans)")
    print(f"telemetry cost per turn: metrics {f['metrics'] - f['disabled']:.2f} µs, "
          f"traced {f['traced'] - f['disabled']:.2f} µs")
    for goal, ratio, limit in (("metrics", metrics_ratio, METRICS_GOAL),
                               ("fully traced", traced_ratio, TRACED_GOAL)):
        verdict = "met" if ratio <= limit else "MISSED"
        print(f"goal {goal} <= {limit:g}x: {verdict} ({ratio:.2f}x)")


if __name__ == "__main__":
    main()
