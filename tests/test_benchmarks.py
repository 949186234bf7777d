"""The benchmarks compare like with like: their baselines make the router's spans."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from turnrouter.telemetry import Telemetry

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_telemetry_overhead as bench
from bench_router import FirstCandidate, InstantAgent, _turns

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
async def test_interleaved_baseline_makes_the_router_spans_by_hand() -> None:
    """The interleaved baseline's spans come from turn_spans, none from the router."""
    provider, exporter = _recording()
    agents = {name: InstantAgent(name) for name in ("weather", "calendar", "conversation")}
    await bench.metrics_router_with_hand_spans(provider, agents, FirstCandidate(),
                                               _turns(3, 1))
    spans = exporter.get_finished_spans()
    assert len(spans) == 3 * bench.SPANS_PER_TURN
    assert [dict(span.attributes or {}).get("turnrouter.turn.id") for span in spans
            if span.name == "turnrouter.turn"] == [turn.turn_id for turn in _turns(3, 1)]
    provider.shutdown()


@pytest.mark.anyio
async def test_bare_interleaved_baseline_makes_spans_without_attributes() -> None:
    """With bare=True the hand-made spans are the four per turn with no attributes."""
    provider, exporter = _recording()
    agents = {name: InstantAgent(name) for name in ("weather", "calendar", "conversation")}
    await bench.metrics_router_with_hand_spans(provider, agents, FirstCandidate(),
                                               _turns(2, 1), bare=True)
    spans = exporter.get_finished_spans()
    assert len(spans) == 2 * bench.SPANS_PER_TURN
    assert all(not span.attributes for span in spans)
    provider.shutdown()


@pytest.mark.anyio
@pytest.mark.parametrize("current", [False, True])
async def test_raw_span_baseline_carries_what_the_router_records(current: bool) -> None:
    """The raw-span baseline makes the router's spans: names, parents, attributes, events."""
    provider, exporter = _recording()
    agents = {name: InstantAgent(name) for name in ("weather", "calendar", "conversation")}
    telemetry = Telemetry(tracer_provider=provider, registry=CollectorRegistry())
    await bench.timed_router(telemetry, agents, FirstCandidate(), _turns(1, 1))
    routed = [span for span in exporter.get_finished_spans()
              if span.name != "turnrouter.release"]  # the shutdown's, not the turn's
    exporter.clear()
    bench.raw_spans_with_data(provider, 1, current=current)
    assert _shape(exporter.get_finished_spans()) == _shape(tuple(routed))
    provider.shutdown()


def test_bare_span_baseline_makes_as_many_spans_as_a_turn() -> None:
    """The bare baseline makes SPANS_PER_TURN spans per turn: a turn span and its children."""
    provider, exporter = _recording()
    bench.raw_spans(provider, 2)
    spans = exporter.get_finished_spans()
    assert len(spans) == 2 * bench.SPANS_PER_TURN
    assert [name for name, parent, _, _ in _shape(spans)[: bench.SPANS_PER_TURN]] == [
        *bench._CHILDREN, "turnrouter.turn"]
    provider.shutdown()


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
