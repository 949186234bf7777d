"""The benchmarks compare like with like: their baselines make the router's spans."""

from __future__ import annotations

import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from turnrouter import AgentTurn, DestinationResult
from turnrouter.telemetry import Telemetry

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_telemetry_overhead as bench

Shape = list[tuple[str, str | None, frozenset[str], tuple[str, ...]]]


def _shape(spans: tuple[ReadableSpan, ...]) -> Shape:
    """Name, parent name, attribute keys and event names of each span, in end order."""
    names = {span.context.span_id: span.name for span in spans if span.context}
    return [(span.name, names.get(span.parent.span_id) if span.parent else None,
             frozenset(span.attributes or {}), tuple(event.name for event in span.events))
            for span in spans]


def _recording() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


@pytest.mark.anyio
async def test_the_traced_loops_make_the_router_spans() -> None:
    """The hand-written loops' raw spans, and those made by hand after a turn, are the
    router's for the same turns (first and later turns of each participant): names,
    parents, attribute keys and events."""
    provider, exporter = _recording()
    telemetry = Telemetry(tracer_provider=provider, registry=CollectorRegistry())
    turns = bench.turns(6, participants=2)
    await bench.router_turns(telemetry, bench.agents(), bench.FirstCandidate(), turns)
    routed = tuple(span for span in exporter.get_finished_spans()
                   if span.name != "turnrouter.release")  # the shutdown's, not the turns'
    assert len(routed) == 6 * bench.SPANS_PER_TURN
    tracer = provider.get_tracer("bench")
    caller = trace.get_current_span()
    for loop in (bench.loop_with_spans, bench.loop_with_current_spans):
        exporter.clear()
        await loop(bench.agents(), bench.FirstCandidate(), turns, tracer)
        assert _shape(exporter.get_finished_spans()) == _shape(routed)
        assert trace.get_current_span() is caller  # each turn restored it
    exporter.clear()
    for turn in turns:  # the spans metrics+spans makes after each turn
        bench.hand_spans(tracer, turn, bench.ROUTES, "weather")
    assert _shape(exporter.get_finished_spans()) == _shape(routed)
    provider.shutdown()


class _Noting(bench.SpeakingAgent):
    """Notes the id of the span current while it answers, in `current`."""

    def __init__(self, name: str, current: list[int]) -> None:
        super().__init__(name, _silent)
        self.current = current

    async def answer(self, turn: AgentTurn, *, started: Callable[[], Awaitable[None]]
                     ) -> DestinationResult:
        self.current.append(trace.get_current_span().get_span_context().span_id)
        return await super().answer(turn, started=started)


async def _silent(turn: AgentTurn, route: str, text: str) -> None:
    return None


@pytest.mark.anyio
async def test_the_loop_with_current_spans_keeps_the_router_span_contract() -> None:
    """loop+current makes `invoke_agent` current while the agent answers, as the router
    does (so the agent's own spans nest under it); loop+spans does not."""
    provider, exporter = _recording()
    current: list[int] = []
    agents: dict[str, bench.SpeakingAgent] = {name: _Noting(name, current)
                                              for name in bench.ROUTES}
    await bench.loop_with_current_spans(agents, bench.FirstCandidate(), bench.turns(2),
                                        provider.get_tracer("bench"))
    invoked = [span.context.span_id for span in exporter.get_finished_spans()
               if span.name.startswith("invoke_agent") and span.context]
    assert current == invoked and len(invoked) == 2
    current.clear()
    await bench.loop_with_spans(agents, bench.FirstCandidate(), bench.turns(2),
                                provider.get_tracer("bench"))
    assert current == [trace.get_current_span().get_span_context().span_id] * 2
    provider.shutdown()


@pytest.mark.anyio
async def test_the_loops_answer_and_speak_every_turn() -> None:
    """The loops decide, admit and answer every turn, the agent speaking its answer."""
    spoken: list[str] = []

    async def output(turn: AgentTurn, route: str, text: str) -> None:
        spoken.append(turn.turn_id)

    agents = {name: bench.SpeakingAgent(name, output) for name in bench.ROUTES}
    provider, _ = _recording()
    await bench.loop(agents, bench.FirstCandidate(), bench.turns(3))
    for traced_loop in (bench.loop_with_spans, bench.loop_with_current_spans):
        await traced_loop(agents, bench.FirstCandidate(), bench.turns(3),
                          provider.get_tracer("bench"))
    assert spoken == ["t0", "t1", "t2"] * 3
    provider.shutdown()


@pytest.mark.anyio
async def test_every_variant_is_measured_and_sampling_thins_the_spans() -> None:
    """measure() times every variant and counts its bytecodes; the raw loop exports four
    spans a turn, the 0% sampler none."""
    figures = await bench.measure(20, 1, bytecodes=10, chunk=7)  # chunks of 7, 7, 6
    assert set(bench.VARIANTS) <= set(figures)
    assert all(figures[variant] > 0 for variant in bench.VARIANTS)
    # Each loop runs its own code; the router's spans cost more bytecodes than none.
    assert figures["bytecodes/loop+spans"] > figures["bytecodes/loop"] > 0
    assert figures["bytecodes/traced"] > figures["bytecodes/metrics"]
    assert figures["spans/loop+spans"] == bench.SPANS_PER_TURN
    assert figures["spans/traced"] >= bench.SPANS_PER_TURN
    assert figures["spans/sampled0"] == 0
    assert figures["spans/metrics+root0"] == 0
    assert figures["traced_share/traced"] == 1
    assert figures["traced_share/sampled0"] == 0
    assert 0 <= figures["traced_share/sampled10"] <= 1
    assert set(bench.GOALS) <= set(bench.ratios(figures))


def test_telemetry_comparison_runs_each_tree_in_a_process_of_its_own() -> None:
    """bench_telemetry_overhead --baseline measures each tree in a fresh process and
    reports both trees' figures and ratios; a folder without turnrouter is refused."""
    root = Path(__file__).resolve().parents[1]
    report = bench.compare(root, 1, ["--turns=20", "--repeats=1"])
    for tree in ("baseline", "this"):
        entry = report[tree]
        assert isinstance(entry, dict)
        assert set(bench.VARIANTS) <= set(entry["per_turn"])
        assert set(bench.GOALS) == set(entry["ratios_by_round"])
    with pytest.raises(SystemExit, match="no src/turnrouter"):
        bench.compare(root / "docs", 1, [])


def test_the_nats_floor_answers_outputs_the_distributed_load_counts() -> None:
    """The bare nats-py replica's answer is a final output the load generator counts."""
    import bench_distributed

    from turnrouter.runtime import ResponseOutput

    body = bench_distributed.floor_answer("c7", "turn-1", "floor 12 0", "floor-1", 5)
    output = ResponseOutput.model_validate_json(body)
    assert (output.participant_id, output.request_id, output.route, output.text) == (
        "c7", "turn-1", "instant", "floor 12 0")


def test_scale_comparison_runs_each_tree_in_a_process_of_its_own(
        capsys: pytest.CaptureFixture[str]) -> None:
    """bench_scale --baseline times each tree in a fresh process and prints the rounds and
    their ratio (this tree against itself here); a folder without turnrouter is refused."""
    import bench_scale

    root = Path(__file__).resolve().parents[1]
    bench_scale.compare(root, 1, ["--participants=20", "--turns=1"])
    report = json.loads(capsys.readouterr().out)
    assert [len(v) for v in report["one_core_holds_turns_per_s"].values()] == [1, 1]
    assert report["ratio_by_round"][0] > 0
    with pytest.raises(SystemExit, match="no src/turnrouter"):
        bench_scale.compare(root / "docs", 1, [])


def test_scale_batch_sweep_reports_each_batch_by_phase(
        capsys: pytest.CaptureFixture[str]) -> None:
    """bench_scale --publish-batches times this tree under each publish batch and
    reports what one core holds, the ratio to the first batch and µs per phase item."""
    import bench_scale

    bench_scale.sweep_batches([1, 64], 1, ["--participants=20", "--turns=1"])
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"publish_batch=1", "publish_batch=64", "load_average"}
    assert report["publish_batch=1"]["ratio_to_first"] == 1.0
    for name in ("publish_batch=1", "publish_batch=64"):
        assert report[name]["one_core_holds_turns_per_s"] > 0
        assert set(report[name]["us_each_by_phase"]) == {"joins", "turns", "departures"}


def test_routing_benchmarks_read_the_shipped_clinc150_splits() -> None:
    """bench_decisions.py (and compare_lexical.py, sweep_decisions.py) need no data from
    outside the checkout: the splits ship under benchmarks/data/clinc150 with their licence."""
    import bench_decisions

    data = bench_decisions.DEFAULT_DATA
    assert data.is_relative_to(Path(__file__).resolve().parents[1])
    assert "Attribution 3.0" in (data / "LICENSE").read_text(encoding="utf-8")
    assert "CC BY 3.0" in (data / "NOTICE.md").read_text(encoding="utf-8")
    domains = list(json.loads((data / "domains.json").read_text(encoding="utf-8")))
    sizes = {name: len(bench_decisions._load(data / f"{name}.jsonl"))
             for name in ("train", "val", "oos_train", "oos_val")}
    assert sizes == {"train": 15_000, "val": 3_000, "oos_train": 100, "oos_val": 100}
    rows = bench_decisions._load(data / "val.jsonl")
    assert {row["domain"] for row in rows} == set(domains)


def test_the_overload_step_runs_the_demo_on_its_own_cpu_clock() -> None:
    """bench_overload --cpu-clock runs a step's demo in a fresh process on a clock of its
    own CPU time and idle waits: the run lasts its duration on that clock, and every
    published query is accounted for."""
    import bench_overload

    root = Path(__file__).resolve().parents[1]
    figures = bench_overload.run_step(root, 20, 5.0, 1.0, "cpu")
    assert figures["elapsed"] >= 1.0
    assert figures["turns"] > 0 and figures["answered"] > 0
    assert figures["lost"] == 0
