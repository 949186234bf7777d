"""The demo's spans, exported over OTLP/HTTP, land in a real trace backend (Arize Phoenix).

`turnrouter demo` runs for a few seconds with `--otlp-endpoint` pointing at a Phoenix
started on loopback; after it exits, every turn it reports is a `turnrouter.turn`
span in Phoenix (so the batch exporter was flushed at exit), and one answered turn's trace,
fetched by its trace id, holds the turn span with its route, admission and `invoke_agent`
children, as docs/telemetry.md describes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .prom import eventually
from .tracebackend import Phoenix, require_phoenix

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DEMO_SECONDS = 4
DEMO_TIMEOUT = 60.0
INGEST_TIMEOUT = 30.0
TRACE_ID = re.compile(r"[0-9a-f]{32}")
#: Children of the turn span (docs/telemetry.md), each parented directly on it.
TURN_CHILDREN = ("turnrouter.route", "turnrouter.admission", "turnrouter.acknowledgment",
                 "invoke_agent ")


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Phoenix]:
    """A Phoenix server on free loopback ports, ready to take OTLP/HTTP."""
    require_phoenix()
    server = Phoenix(tmp_path_factory.mktemp("traces"))
    try:
        server.wait_ready()
        yield server
    except BaseException:
        print(f"phoenix log:\n{server.log_tail()}", file=sys.stderr)
        raise
    finally:
        server.stop()


def demo_executable() -> str:
    """`turnrouter` next to this interpreter (the venv's console script)."""
    script = Path(sys.executable).with_name("turnrouter")
    return str(script) if script.exists() else shutil.which("turnrouter") or "turnrouter"


def run_demo(endpoint: str) -> str:
    """Run the demo exporting to `endpoint` until it exits by itself; its output."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    result = subprocess.run(
        [demo_executable(), "demo", "--duration", str(DEMO_SECONDS), "--participants", "20",
         "--speed", "4", "--seed", "7", "--quiet", "--otlp-endpoint", endpoint,
         "--otlp-protocol", "http/protobuf"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=DEMO_TIMEOUT,
        stdin=subprocess.DEVNULL, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"demo failed ({result.returncode}):\n{output}"
    assert f"tracing: exporting spans to {endpoint}" in output, output
    return output


def reported_turns(output: str) -> int:
    """The turns of the demo's report that have a span: its `turns: N in ...` count less
    those it shed for load (a shed turn is counted but makes no span, docs/telemetry.md;
    a loaded machine can make the demo's router busy for a moment)."""
    match = re.search(r"^turns: (\d+) in ", output, re.MULTILINE)
    assert match is not None, f"no turn count in the demo's report:\n{output}"
    shed = re.search(r"shed for load (\d+) ", output)
    assert shed is not None, f"no shed count in the demo's report:\n{output}"
    return int(match.group(1)) - int(shed.group(1))


@pytest.fixture(scope="module")
def demo_run(phoenix: Phoenix) -> tuple[int, list[dict[str, Any]]]:
    """Run the demo once; (turns it reported, the turn spans Phoenix then holds)."""
    turns = reported_turns(run_demo(phoenix.otlp_endpoint))
    assert turns > 0

    def all_turns_stored() -> list[dict[str, Any]] | None:
        spans = phoenix.spans(name="turnrouter.turn")
        return spans if len(spans) >= turns else None

    # Phoenix inserts what it received in the background: poll until every turn is there.
    try:
        spans = eventually(all_turns_stored, timeout=INGEST_TIMEOUT, interval=0.5,
                           what=f"{turns} turnrouter.turn spans in phoenix")
    except AssertionError as error:
        stored = len(phoenix.spans(name="turnrouter.turn"))
        raise AssertionError(
            f"{error}: phoenix holds {stored} of the {turns} turns the demo reported; "
            "the demo must shut its TracerProvider down (flushing the batch exporter) "
            f"before it exits\n{phoenix.log_tail()}") from None
    return turns, spans


def test_every_turn_reaches_the_backend(demo_run: tuple[int, list[dict[str, Any]]]) -> None:
    """One `turnrouter.turn` span per reported turn, each with its own trace and ids."""
    turns, spans = demo_run
    assert len(spans) == turns
    assert len({span["context"]["span_id"] for span in spans}) == turns
    for span in spans:
        assert TRACE_ID.fullmatch(span["context"]["trace_id"]), span
        attributes = span["attributes"]
        assert attributes.get("turnrouter.participant.id"), span
        assert attributes.get("turnrouter.turn.id"), span
        assert attributes.get("turnrouter.outcome") in {
            "answer", "focus", "release", "clarify", "failed", "interrupted"}, span


def answered_turn(spans: list[dict[str, Any]]) -> dict[str, Any]:
    """A turn span whose turn was answered by a route."""
    answered = [span for span in spans if span["attributes"].get("turnrouter.outcome") == "answer"
                and span["attributes"].get("turnrouter.route")]
    assert answered, "no answered turn among the demo's turn spans"
    return answered[len(answered) // 2]


def test_a_turn_trace_by_trace_id(phoenix: Phoenix,
                                  demo_run: tuple[int, list[dict[str, Any]]]) -> None:
    """The backend returns one turn's whole trace by its trace id, children on the turn."""
    _, turn_spans = demo_run
    turn = answered_turn(turn_spans)
    trace_id = turn["context"]["trace_id"]
    turn_id = turn["context"]["span_id"]
    route = turn["attributes"]["turnrouter.route"]

    trace = phoenix.spans(trace_id=trace_id)

    assert trace, f"phoenix returned nothing for trace {trace_id}"
    assert {span["context"]["trace_id"] for span in trace} == {trace_id}
    names = [span["name"] for span in trace]
    assert names.count("turnrouter.turn") == 1, names
    (stored_turn,) = (span for span in trace if span["name"] == "turnrouter.turn")
    assert stored_turn["context"]["span_id"] == turn_id
    assert stored_turn["attributes"]["turnrouter.participant.id"] == (
        turn["attributes"]["turnrouter.participant.id"])

    children = [span for span in trace if span["name"].startswith(TURN_CHILDREN)]
    for child in children:
        assert child["parent_id"] == turn_id, f"{child['name']} not parented on the turn: {child}"
        assert child["start_time"] >= stored_turn["start_time"], child
    by_name = {span["name"] for span in children}
    assert "turnrouter.route" in by_name, names
    assert f"invoke_agent {route}" in by_name, names
    # Every span of the trace descends from the turn span.
    parents = {span["context"]["span_id"]: span["parent_id"] for span in trace}
    for span_id in parents:
        seen, steps = span_id, 0
        while seen != turn_id:
            assert seen in parents and steps < len(parents), (
                f"span {span_id} does not descend from the turn: {trace}")
            seen, steps = parents[seen], steps + 1

    (agent,) = (span for span in children if span["name"] == f"invoke_agent {route}")
    assert agent["attributes"]["gen_ai.operation.name"] == "invoke_agent"
    assert agent["attributes"]["gen_ai.agent.name"] == route
    decision = next(span for span in children if span["name"] == "turnrouter.route")
    assert "turnrouter.decision.choice" in decision["attributes"], decision
    assert route in decision["attributes"]["turnrouter.decision.candidates"], decision
    for admission in (span for span in children if span["name"] == "turnrouter.admission"):
        assert admission["attributes"]["turnrouter.admission.disposition"], admission

    # The filter really selected one trace: other turns' traces are stored beside it.
    others = {span["context"]["trace_id"] for span in turn_spans} - {trace_id}
    assert others, "only one trace stored: the trace_id filter is not shown to filter"
    assert not others & {span["context"]["trace_id"] for span in trace}


def test_a_worker_exports_its_turns_from_the_otel_variables(phoenix: Phoenix) -> None:
    """`turnrouter worker` traces from the standard `OTEL_*` variables as the demo does:
    a turn asked over NATS is a `turnrouter.turn` span in the backend once the worker
    stopped on SIGTERM (its batch exporter flushed), with its route's `invoke_agent`."""
    import asyncio
    import signal

    from tests.nats.conftest import NatsServer, Worker
    from tests.nats.crowd import ask, listening

    server = NatsServer()
    worker = None
    try:
        worker = Worker(server.url, "traced", env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": phoenix.otlp_endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_SERVICE_NAME": "worker-under-test"})

        async def one_turn() -> str:
            async with asyncio.timeout(60), listening(server.url) as (front, heard):
                return await ask(front, heard, "trace-me", "hello tracing")

        assert asyncio.run(one_turn()).startswith("hello tracing")
        worker.signal(signal.SIGTERM)
        assert worker.proc.wait(60) == 0, worker.stderr()
    finally:
        if worker is not None:
            worker.close()
        server.close()

    def traced_turn() -> list[dict[str, Any]] | None:
        spans = [span for span in phoenix.spans(name="turnrouter.turn")
                 if span["attributes"].get("turnrouter.participant.id") == "trace-me"]
        return spans or None

    turns = eventually(traced_turn, timeout=INGEST_TIMEOUT, interval=0.5,
                       what="the worker's turn span in phoenix")
    assert len(turns) == 1
    trace = phoenix.spans(trace_id=turns[0]["context"]["trace_id"])
    assert any(span["name"].startswith("invoke_agent ") for span in trace), trace
