"""Head sampling through the router, with the SDK's own samplers and in-memory exporter.

The turn span carries the head decision: a sampled turn keeps its whole span tree, an
unsampled one records nothing and starts no child span (the SDK is asked about the
turn span only), its non-recording span staying current so that the spans of the
decision service and the agent follow the same decision. Exemplars point at sampled
turns only.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator, Sequence

import pytest
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_ON,
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import Link, SpanKind, TraceState
from opentelemetry.util.types import Attributes
from prometheus_client import CollectorRegistry

from turnrouter import AgentRouter, AgentTurn, RouteDecision, RouteRequest
from turnrouter.telemetry import Telemetry
from turnrouter.testing import OutputRecorder, ScriptedAgent, ScriptedDecisions

from .conftest import openmetrics_latest

pytestmark = pytest.mark.anyio

#: Trace ids `TraceIdRatioBased(0.5)` keeps (low 64 bits under 2**63) and drops.
KEPT, DROPPED = 0x1, 0xF000_0000_0000_0001
TRACE_ID = re.compile(r'trace_id="([0-9a-f]{32})"')


class Asked(Sampler):
    """Delegates to `inner`, noting each span the SDK was asked about (every span a
    tracer started, recording or not) as (trace id, name)."""

    def __init__(self, inner: Sampler) -> None:
        self.inner = inner
        self.asked: list[tuple[int, str]] = []

    def should_sample(
        self, parent_context: Context | None, trace_id: int, name: str,
        kind: SpanKind | None = None, attributes: Attributes = None,
        links: Sequence[Link] | None = None, trace_state: TraceState | None = None,
    ) -> SamplingResult:
        self.asked.append((trace_id, name))
        return self.inner.should_sample(parent_context, trace_id, name, kind, attributes,
                                        links, trace_state)

    def get_description(self) -> str:
        return f"Asked({self.inner.get_description()})"

    def names(self, trace_id: int) -> list[str]:
        return [name for asked_id, name in self.asked if asked_id == trace_id]


class ScriptedIds(IdGenerator):
    """Trace ids in turn from `trace_ids` (a ratio sampler decides on the trace id), so
    which turns are sampled is known; random span ids."""

    def __init__(self, trace_ids: Sequence[int]) -> None:
        self._trace_ids: Iterator[int] = itertools.cycle(trace_ids)
        self._spans = RandomIdGenerator()

    def generate_span_id(self) -> int:
        return self._spans.generate_span_id()

    def generate_trace_id(self) -> int:
        return next(self._trace_ids)


class DropTurnsKeepTheRest(Sampler):
    """Not parent-based: drops `turnrouter.turn` spans, keeps every other span."""

    def should_sample(
        self, parent_context: Context | None, trace_id: int, name: str,
        kind: SpanKind | None = None, attributes: Attributes = None,
        links: Sequence[Link] | None = None, trace_state: TraceState | None = None,
    ) -> SamplingResult:
        if name == "turnrouter.turn":
            return SamplingResult(Decision.DROP)
        return ALWAYS_ON.should_sample(parent_context, trace_id, name, kind, attributes,
                                       links, trace_state)

    def get_description(self) -> str:
        return "DropTurnsKeepTheRest"


class Traced:
    """A router whose decision service and agent make their own spans ("classify" while
    deciding, "speak" while answering), traced by an SDK provider with `sampler`."""

    def __init__(self, sampler: Sampler, ids: IdGenerator | None = None) -> None:
        self.exporter = InMemorySpanExporter()
        self.sampler = sampler
        self.provider = TracerProvider(sampler=sampler, id_generator=ids)
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.registry = CollectorRegistry()
        tracer = self.provider.get_tracer("application")

        def classify(request: RouteRequest) -> RouteDecision:
            tracer.start_span("classify").end()  # the current span is its parent
            return RouteDecision("weather")

        async def speak(turn: AgentTurn, route: str, text: str) -> None:
            tracer.start_span("speak").end()

        self.router = AgentRouter(
            {"weather": ScriptedAgent("weather", output=speak)}, ScriptedDecisions(classify),
            output=OutputRecorder(),
            telemetry=Telemetry(tracer_provider=self.provider, registry=self.registry))

    async def turns(self, count: int) -> None:
        for index in range(count):
            result = await self.router.handle(AgentTurn("alice", f"t{index}", "rain?"))
            assert result.disposition == "answer"

    def spans(self, trace_id: int | None = None) -> list[ReadableSpan]:
        return [span for span in self.exporter.get_finished_spans()
                if span.context is not None
                and (trace_id is None or span.context.trace_id == trace_id)]

    def exemplar_traces(self) -> set[int]:
        return {int(found, 16) for found in
                TRACE_ID.findall(openmetrics_latest(self.registry).decode())}

    def count(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)

    async def close(self) -> None:
        await self.router.stop()
        self.provider.shutdown()


def _tree(spans: list[ReadableSpan]) -> set[tuple[str, str | None]]:
    """(name, parent's name) of each span; a parent outside `spans` is "?"."""
    names = {span.context.span_id: span.name for span in spans if span.context}
    return {(span.name, None if span.parent is None else names.get(span.parent.span_id, "?"))
            for span in spans}


#: The spans of one sampled, answered turn: turnrouter's and the application's own.
SAMPLED_TREE = {
    ("turnrouter.turn", None), ("turnrouter.route", "turnrouter.turn"),
    ("classify", "turnrouter.route"), ("turnrouter.admission", "turnrouter.turn"),
    ("invoke_agent weather", "turnrouter.turn"), ("speak", "invoke_agent weather"),
}


@pytest.mark.parametrize("sampler", [
    ParentBased(TraceIdRatioBased(0.5)),  # the SDK's default kind
    TraceIdRatioBased(0.5),  # not parent-based: each span decided on its trace id
], ids=["parent-based", "ratio-alone"])
async def test_a_ratio_sampler_traces_whole_turns_or_nothing(sampler: Sampler) -> None:
    """Kept turns have the full span tree with unchanged parents; dropped turns export
    nothing, and turnrouter asked the SDK about their turn span only (no child span
    started), while the application's spans under it were dropped too: with a ratio
    sampler, parent-based or not, exactly what starting the child spans would give.
    Every turn is counted; exemplars point at kept turns only."""
    asked = Asked(sampler)
    traced = Traced(asked, ScriptedIds([KEPT + 1, DROPPED + 1, KEPT + 2, DROPPED + 2]))
    try:
        await traced.turns(4)
        for kept in (KEPT + 1, KEPT + 2):
            assert _tree(traced.spans(kept)) == SAMPLED_TREE
            assert len(traced.spans(kept)) == len(SAMPLED_TREE)
            assert asked.names(kept) == [
                "turnrouter.turn", "turnrouter.route", "classify", "turnrouter.admission",
                "invoke_agent weather", "speak"]
        for dropped in (DROPPED + 1, DROPPED + 2):
            assert traced.spans(dropped) == []
            assert asked.names(dropped) == ["turnrouter.turn", "classify", "speak"]
        assert traced.count("turnrouter_turns_total", route="weather", outcome="answer") == 4
        assert traced.count("turnrouter_decision_duration_seconds_count") == 4
        assert traced.count("turnrouter_first_response_seconds_count", route="weather") == 4
        exemplars = traced.exemplar_traces()
        assert exemplars and exemplars <= {KEPT + 1, KEPT + 2}
    finally:
        await traced.close()


async def test_an_unsampled_turn_span_stays_current_so_the_application_follows_it() -> None:
    """Under a parent-based sampler, the application's spans during an unsampled turn are
    children of its (non-recording) turn span, dropped with it: not the roots of traces
    of their own (which this root sampler would keep)."""
    asked = Asked(ParentBased(DropTurnsKeepTheRest()))
    traced = Traced(asked)
    caller = trace.get_current_span()
    try:
        await traced.turns(3)
        assert traced.spans() == []
        assert [name for _, name in asked.asked] == ["turnrouter.turn", "classify", "speak"] * 3
        turn_traces = [trace_id for trace_id, name in asked.asked if name == "turnrouter.turn"]
        assert len(set(turn_traces)) == 3
        for trace_id in turn_traces:
            assert asked.names(trace_id) == ["turnrouter.turn", "classify", "speak"]
        assert traced.exemplar_traces() == set()
        assert traced.count("turnrouter_turns_total", route="weather", outcome="answer") == 3
        assert trace.get_current_span() is caller  # every turn restored it
    finally:
        await traced.close()


async def test_a_sampler_keeping_children_of_dropped_turns_gets_no_turnrouter_child() -> None:
    """The documented exception: a sampler that is not parent-based and keeps spans
    whose turn span it dropped is not asked about turnrouter's route, admission and
    invoke_agent spans (they would be orphans, their parent never exported); the
    application's own spans are its to decide, and keep the dropped turn as parent."""
    traced = Traced(Asked(DropTurnsKeepTheRest()))
    try:
        await traced.turns(2)
        names = sorted(span.name for span in traced.spans())
        assert names == ["classify", "classify", "speak", "speak"]
        assert _tree(traced.spans()) == {("classify", "?"), ("speak", "?")}
        assert traced.count("turnrouter_turns_total", route="weather", outcome="answer") == 2
    finally:
        await traced.close()
