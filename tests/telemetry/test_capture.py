"""`turnrouter.testing.TelemetryCapture`: a router's real telemetry, recorded in memory."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from opentelemetry import trace

from turnrouter import AgentRouter, AgentTurn, ConfigurationError
from turnrouter.testing import OutputRecorder, ScriptedAgent, ScriptedDecisions, TelemetryCapture

pytestmark = pytest.mark.anyio


def _router(capture: TelemetryCapture) -> AgentRouter:
    agents = {"weather": ScriptedAgent("weather", answer_text="sunny"),
              "conversation": ScriptedAgent("conversation")}
    return AgentRouter(agents, ScriptedDecisions("weather"), output=OutputRecorder(),
                       telemetry=capture.telemetry)


async def test_capture_records_a_routed_turns_spans_and_metrics() -> None:
    """Spans and metric samples of a handled turn are readable right after it ends."""
    with TelemetryCapture() as capture:
        router = _router(capture)
        await router.handle(AgentTurn("alice", "t1", "will it rain?"))
        await router.stop()
        turn = capture.span("turnrouter.turn")
        assert turn.attributes is not None
        assert turn.attributes["turnrouter.route"] == "weather"
        assert [span.name for span in capture.spans()][:4] == [
            "turnrouter.route", "turnrouter.admission", "invoke_agent weather",
            "turnrouter.turn"]
        assert capture.value("turnrouter_turns_total", route="weather", outcome="answer") == 1
        assert capture.value("turnrouter_turns_total", route="calendar",
                             outcome="answer") is None
        assert 'trace_id="' in capture.openmetrics()


async def test_capture_does_not_touch_global_tracing() -> None:
    """The capture's provider is its own: the global provider is left as it was."""
    before = trace.get_tracer_provider()
    with TelemetryCapture() as capture:
        assert capture.tracer_provider is not before
        assert capture.telemetry.registry is capture.registry
    assert trace.get_tracer_provider() is before


async def test_span_names_what_ended_when_not_exactly_one() -> None:
    """span() fails with the names of the spans that did end."""
    with TelemetryCapture() as capture:
        router = _router(capture)
        await router.handle(AgentTurn("alice", "t1", "will it rain?"))
        with pytest.raises(AssertionError, match=r"found 0: \['turnrouter.route'"):
            capture.span("turnrouter.acknowledgment")


async def test_clear_forgets_spans_but_keeps_metrics() -> None:
    """clear() empties the span list; cumulative metric values stay."""
    with TelemetryCapture() as capture:
        router = _router(capture)
        await router.handle(AgentTurn("alice", "t1", "will it rain?"))
        capture.clear()
        assert capture.spans() == []
        assert capture.value("turnrouter_turns_total", route="weather", outcome="answer") == 1


async def test_content_capture_is_opt_in() -> None:
    """The query text is on the turn span only with capture_content=True."""
    for capture_content in (False, True):
        with TelemetryCapture(capture_content=capture_content) as capture:
            router = _router(capture)
            await router.handle(AgentTurn("alice", "t1", "will it rain?"))
            attributes = capture.span("turnrouter.turn").attributes or {}
            assert ("will it rain?" in attributes.values()) is capture_content


async def test_pytest_fixture_is_registered(turnrouter_telemetry: TelemetryCapture) -> None:
    """pytest provides a fresh TelemetryCapture as the turnrouter_telemetry fixture."""
    router = _router(turnrouter_telemetry)
    await router.handle(AgentTurn("alice", "t1", "will it rain?"))
    assert turnrouter_telemetry.value("turnrouter_turns_total", route="weather",
                                      outcome="answer") == 1
    assert turnrouter_telemetry.spans("turnrouter.turn")


async def test_capture_samples_every_turn_whatever_the_environment_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """OTEL_TRACES_SAMPLER=always_off (common in CI) does not hide the captured spans."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    with TelemetryCapture() as capture:
        router = _router(capture)
        await router.handle(AgentTurn("alice", "t1", "will it rain?"))
        assert capture.span("turnrouter.turn").context.trace_flags.sampled


def test_a_disabled_sdk_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """With OTEL_SDK_DISABLED=true nothing could be captured: a clear error says why."""
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    with pytest.raises(ConfigurationError, match="OTEL_SDK_DISABLED"):
        TelemetryCapture()


def test_the_documented_pytest_file_passes_under_plain_pytest(tmp_path: Path) -> None:
    """telemetry.md's test file, as a user's project holds it, passes when plain pytest
    runs it outside this repository (no conftest of ours): the fixture comes from the
    installed plugin, the async test from anyio's mark (newcomer18 F3: the documented
    test, without the mark, failed with "async def functions are not natively
    supported")."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "telemetry.md").read_text()
    [block] = [block for block in re.findall(r"```python\n(.*?)```", page, re.DOTALL)
               if "def test_weather_is_traced(turnrouter_telemetry)" in block]
    (tmp_path / "test_my_agents.py").write_text(block)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
         "test_my_agents.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
        check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "1 passed" in done.stdout
