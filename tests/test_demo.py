"""The demo: shipped sample, simulated destinations, report arithmetic, a short real run."""

from __future__ import annotations

import asyncio
import gc
import io
import logging
import math
import os
import queue
import random
import re
import signal
import statistics
import sys
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnrouter import AgentTurn, ConfigurationError, load_samples
from turnrouter.demo import (
    DEFAULT_ACK_DELAY,
    DESCRIPTIONS,
    LATENCIES,
    DemoConfig,
    DemoReport,
    build_agents,
    demo_resource,
    demo_tracer_provider,
    histogram_quantile,
    load_sample,
    otlp_settings,
    run_demo,
)

from .kit import run_cli

pytestmark = pytest.mark.anyio


def test_sample_covers_ten_domains_and_out_of_scope() -> None:
    """The shipped CLINC150 sample has examples for ten domains and oos queries."""
    sample = load_sample()
    assert len(sample.domains) == 10
    assert set(sample.domains) | {"conversation"} == set(DESCRIPTIONS)
    assert sum(1 for _, domain, _ in sample.queries if domain == "oos") == 60
    assert all(len(texts) == 75 for texts in sample.examples.values())


def test_histogram_quantile_matches_prometheus() -> None:
    """Quantiles interpolate within buckets like Prometheus; empty is NaN."""
    buckets = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (math.inf, 40.0)]
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.3)
    assert histogram_quantile(0.99, [(1.0, 1.0), (math.inf, 2.0)]) == 1.0
    assert math.isnan(histogram_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]))


async def _published(_: AgentTurn, route: str, text: str) -> None:
    return None


async def test_simulated_destinations_decline_outside_their_domain() -> None:
    """A simulated destination declines queries of other domains; the default accepts."""
    sample = load_sample()
    agents = build_agents(sample, rng=random.Random(1), publish=_published, speed=100.0,
                          clarify_heavy=False)
    weather = next(text for text, domain, _ in sample.queries if domain == "utility")
    turn = AgentTurn("p1", "t1", weather)
    assert (await agents["utility"].admit(turn, focused=False)).disposition in {
        "accept", "decline"}
    assert (await agents["banking"].admit(turn, focused=False)).disposition == "decline"
    assert (await agents["conversation"].admit(turn, focused=False)).disposition == "accept"


async def test_clarify_heavy_makes_the_default_ineligible() -> None:
    """The alert scenario takes the general agent out of routing."""
    agents = build_agents(load_sample(), rng=random.Random(1), publish=_published,
                          speed=100.0, clarify_heavy=True)
    assert agents["conversation"].routing_aid("p1").eligible is False


async def test_guests_cannot_reach_the_settings_agent() -> None:
    """A tenth of the seats are guests (seats ending in 7, whatever their session): the
    settings agent (`meta`) is ineligible for them, so the demo's "Ineligible routes"
    panel has data. Before, the id's last digit (the session count) decided."""
    agents = build_agents(load_sample(), rng=random.Random(1), publish=_published,
                          speed=100.0, clarify_heavy=False)
    meta = agents["meta"]
    assert [meta.routing_aid(pid).eligible for pid in (
        "user-00007-0", "user-00017-12", "user-00018-7", "user-00020-0")] == [
        False, False, True, True]


async def test_short_demo_run_loses_no_turn(caplog: pytest.LogCaptureFixture) -> None:
    """A short, fast demo run routes turns to many destinations and loses none; its own
    injected faults (malformed queries, simulated outages) stay out of the log."""
    out = io.StringIO()
    with caplog.at_level(logging.WARNING):
        report = await run_demo(DemoConfig(duration=2.0, participants=30, speed=10.0,
                                           progress=False, seed=3), out=out)
    assert [r.getMessage() for r in caplog.records
            if "(rejected)" in r.getMessage() or "SimulatedOutage" in r.getMessage()
            or "history_exchanges" in r.getMessage()] == []
    assert report.lost_turns == 0
    assert report.total_turns > 50
    answered = {route for (route, outcome), n in report.turns.items()
                if outcome == "answer" and n}
    assert len(answered) >= 6
    assert "lost 0" in out.getvalue()


def test_report_counts_the_bounds_that_overflowed() -> None:
    """The report lists each overflowed bound with its count (the demo's short history
    overflows by design, so it is reported there rather than logged)."""
    assert "bounds overflowed: none" in DemoReport(elapsed=1.0).render()
    report = DemoReport(elapsed=1.0, overflows={"history_exchanges": 3.0, "participants": 1.0})
    assert "bounds overflowed: history_exchanges 3, participants 1" in report.render()


def test_each_route_row_adds_up_to_its_turns() -> None:
    """Every outcome has a column (busy and refused too): a route's row adds up to its
    turns, and the `none` row of a run that shed turns shows them (newcomer18 F11: the
    columns added up to 21 of 24 turns, the `none` row read all zeros)."""
    turns = {("none", "busy"): 3.0, ("none", "clarify"): 1.0, ("weather", "answer"): 18.0,
             ("weather", "interrupted"): 1.0, ("none", "refused"): 1.0}
    text = DemoReport(elapsed=1.0, turns=turns).render()
    rows = {line.split()[0]: [int(n) for n in line.split()[1:9]]
            for line in text.splitlines() if line.startswith(("none ", "weather "))}
    assert rows == {"none": [0, 0, 0, 1, 0, 0, 3, 1], "weather": [18, 0, 0, 0, 0, 1, 0, 0]}
    assert "turns: 24 " in text
    assert sum(map(sum, rows.values())) == 24


def test_a_report_without_samples_says_so_not_nan() -> None:
    """A run whose turns were all still running at the end has no first-response or
    silence samples: the report says so (it printed `p50 nan s`)."""
    text = DemoReport(elapsed=1.0).render()
    assert "nan" not in text
    assert "first response (all routes) no samples" in text
    assert "silence no samples" in text


async def test_samples_flag_writes_first_response_samples_in_simulated_seconds(
        tmp_path: Path) -> None:
    """`samples_path` gets one JSON line per first response, readable by tune, in
    seconds of the simulated conversations (the demo's speed undone)."""
    path = tmp_path / "samples.jsonl"
    await run_demo(DemoConfig(duration=1.5, participants=20, speed=10.0, progress=False,
                              seed=4, samples_path=str(path)), out=io.StringIO())
    samples = load_samples(path)
    assert len(samples) > 20
    # The demo's first responses have a median near 0.45 s of simulated time, 0.045 s of
    # wall time at speed 10 (a loaded machine only makes them longer).
    assert statistics.median(s.seconds for s in samples if not s.censored) > 0.25


def test_ack_delay_off_and_default() -> None:
    """The default acknowledgment delay is DEFAULT_ACK_DELAY; None switches it off."""
    assert DemoConfig().acknowledgment_delay == DEFAULT_ACK_DELAY
    assert DemoConfig(acknowledgment_delay=None).acknowledgment_delay is None


def test_otlp_settings_prefer_flags_then_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flags win over OTEL_EXPORTER_OTLP_* variables; traces-specific variables win over
    the general ones; HTTP is the default protocol; an unknown protocol is an error."""
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        monkeypatch.delenv(name, raising=False)
    assert otlp_settings(DemoConfig()) == (None, "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://general:4318")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    assert otlp_settings(DemoConfig()) == ("http://general:4318", "grpc")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4318/v1/traces")
    assert otlp_settings(DemoConfig())[0] == "http://traces:4318/v1/traces"
    assert otlp_settings(DemoConfig(otlp_endpoint="http://flag:4318",
                                    otlp_protocol="http/protobuf")) == (
        "http://flag:4318", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    with pytest.raises(ConfigurationError, match="http/json"):
        otlp_settings(DemoConfig())


@pytest.mark.parametrize(("endpoint", "problem"), [
    ("notaurl", "http(s) URL"), ("ftp://collector:4318", "http(s) URL"),
    ("http://user:pw-secret@[::1", "not a URL"), ("http://collector:99999", "not a URL"),
    ("http://collector :4318", "spaces"), ("http://", "http(s) URL"),
])
@pytest.mark.parametrize("command", ["demo", "worker"])
def test_a_malformed_otlp_endpoint_variable_is_a_usage_error(
        monkeypatch: pytest.MonkeyPatch, endpoint: str, problem: str, command: str) -> None:
    """OTEL_EXPORTER_OTLP_ENDPOINT is checked as --otlp-endpoint is: exit 2 naming the
    variable, its password masked. It used to reach the exporter, which logged an ERROR
    per batch while the run went on exporting nothing."""
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL",
                 "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    argv = (["demo", "--duration", "1", "--quiet"] if command == "demo" else
            ["worker", "--nats", "nats://127.0.0.1:1",
             "--app", "turnrouter.runtime.nats.example:make_router"])
    code, out, err = run_cli(argv)
    assert code == 2 and out == ""
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in err and problem in err
    assert "secret" not in err


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(endpoint=st.one_of(
    st.text(max_size=60),
    st.builds("http://user:pw-secret@{}".format, st.text(max_size=30)),
    st.builds("https://{}:{}".format, st.text(max_size=20), st.integers(-5, 10**6))))
def test_any_otlp_endpoint_variable_is_taken_or_refused_by_name(
        monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    """Whatever OTEL_EXPORTER_OTLP_ENDPOINT holds: an http(s) URL with a host is taken
    as given, anything else is a ConfigurationError naming the variable, password
    masked; never another exception."""
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    if "\x00" in endpoint:
        return  # an environment variable cannot hold NUL
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    refused: ConfigurationError | None = None
    try:
        taken, _ = otlp_settings(DemoConfig())
    except ConfigurationError as exc:
        refused, taken = exc, None
    if refused is not None:
        assert "OTEL_EXPORTER_OTLP_ENDPOINT" in str(refused)
        assert "pw-secret" not in str(refused)
    elif taken is not None:  # blank is "no export"
        assert taken == endpoint.strip()
        assert taken.startswith(("http://", "https://"))


def test_an_otlp_endpoint_variable_for_grpc_may_be_host_and_port(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """gRPC exporters take `host:port` as well as a URL: both pass the check."""
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    for endpoint in ("collector:4317", "http://collector:4317"):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        assert otlp_settings(DemoConfig()) == (endpoint, "grpc")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "collector :4317")
    with pytest.raises(ConfigurationError, match="OTEL_EXPORTER_OTLP_ENDPOINT"):
        otlp_settings(DemoConfig())


def test_resource_honours_otel_service_name_and_attributes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES set the resource; without them the
    service is turnrouter-demo."""
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    assert demo_resource().attributes["service.name"] == "turnrouter-demo"
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=staging,"
                                                   "service.name=from-attributes")
    resource = demo_resource().attributes
    assert resource["service.name"] == "from-attributes"
    assert resource["deployment.environment"] == "staging"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "voice-router")
    assert demo_resource().attributes["service.name"] == "voice-router"


@pytest.mark.parametrize(("sampler", "arg", "description"), [
    (None, None, "ParentBased{root:AlwaysOnSampler"),
    ("always_off", None, "AlwaysOffSampler"),
    ("traceidratio", "0.25", "TraceIdRatioBased{0.25}"),
])
def test_tracer_provider_honours_the_sampler_environment(
        monkeypatch: pytest.MonkeyPatch, sampler: str | None, arg: str | None,
        description: str) -> None:
    """OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG choose the demo's sampler."""
    for name, value in (("OTEL_TRACES_SAMPLER", sampler), ("OTEL_TRACES_SAMPLER_ARG", arg)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    out = io.StringIO()
    provider = demo_tracer_provider(DemoConfig(), out)
    try:
        assert provider.sampler.get_description().startswith(description)
        # Nothing is exported when nothing is sampled: no "exporting spans" line then.
        assert ("exporting spans to" in out.getvalue()) == (sampler != "always_off")
    finally:
        provider.shutdown()


@pytest.fixture
def otel_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """A clean OpenTelemetry environment with an OTLP endpoint set."""
    for name in ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_TRACES_SAMPLER",
                 "OTEL_TRACES_SAMPLER_ARG", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    return monkeypatch


@pytest.mark.parametrize(("name", "value", "said"), [
    ("OTEL_TRACES_EXPORTER", "none", ""),
    ("OTEL_TRACES_EXPORTER", "zipkin-ish", "unknown OTEL_TRACES_EXPORTER 'zipkin-ish'"),
    ("OTEL_SDK_DISABLED", "true", "OTEL_SDK_DISABLED"),
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "", ""),
])
def test_no_provider_when_nothing_is_exported(otel_env: pytest.MonkeyPatch, name: str,
                                              value: str, said: str) -> None:
    """OTEL_TRACES_EXPORTER=none, an unknown exporter alone, OTEL_SDK_DISABLED or no
    endpoint: no provider (no spans, no exemplars linking to unexported traces), and no
    "exporting spans" line."""
    otel_env.setenv(name, value)
    out = io.StringIO()
    assert demo_tracer_provider(DemoConfig(), out) is None
    assert "exporting spans" not in out.getvalue()
    assert said in out.getvalue()


def test_an_unknown_sampler_is_warned_about(otel_env: pytest.MonkeyPatch) -> None:
    """An unknown OTEL_TRACES_SAMPLER is named in a warning and the SDK's default,
    parentbased_always_on, is used (not a silent fallback)."""
    otel_env.setenv("OTEL_TRACES_SAMPLER", "sometimes")
    out = io.StringIO()
    provider = demo_tracer_provider(DemoConfig(), out)
    try:
        assert "unknown OTEL_TRACES_SAMPLER 'sometimes'" in out.getvalue()
        assert provider.sampler.get_description().startswith(
            "ParentBased{root:AlwaysOnSampler")
    finally:
        provider.shutdown()


def test_the_worker_setup_installs_the_global_provider_from_the_environment() -> None:
    """`install_env_tracing` (what `turnrouter worker` calls) installs the provider the
    environment asks for as the global one, and installs nothing for
    OTEL_TRACES_EXPORTER=none (run in fresh interpreters: the global provider is set once)."""
    import os
    import subprocess
    import sys

    script = ("import sys\n"
              "from opentelemetry import trace\n"
              "from turnrouter.demo import install_env_tracing\n"
              "provider = install_env_tracing('turnrouter-worker', sys.stdout)\n"
              "print('installed', provider is not None "
              "and trace.get_tracer_provider() is provider)\n"
              "if provider is not None:\n"
              "    print(provider.resource.attributes['service.name'])\n"
              "    provider.shutdown()\n")
    base = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    for exporter, expected in (("console", "installed True"), ("none", "installed False")):
        result = subprocess.run([sys.executable, "-c", script], capture_output=True,
                                text=True, timeout=60, check=False,
                                env={**base, "OTEL_TRACES_EXPORTER": exporter})
        assert result.returncode == 0, result.stderr
        assert expected in result.stdout
        if exporter == "console":
            assert "exporting spans to the console" in result.stdout
            assert "turnrouter-worker" in result.stdout


async def test_the_demo_freezes_its_start_up_heap_while_it_runs_and_gives_it_back() -> None:
    """Full collections skip the start-up heap during the run (as `turnrouter worker`
    does); afterwards the process' collector is as it was."""
    assert gc.get_freeze_count() == 0
    frozen_at_collections: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            frozen_at_collections.append(gc.get_freeze_count())

    gc.callbacks.append(seen)
    try:
        await run_demo(DemoConfig(duration=1.0, participants=20, speed=10.0,
                                  progress=False, seed=5), out=io.StringIO())
    finally:
        gc.callbacks.remove(seen)
    assert frozen_at_collections and max(frozen_at_collections) > 0
    assert gc.get_freeze_count() == 0


async def test_the_demo_drives_its_callers_without_a_task_each() -> None:
    """The simulated callers share one task: a task and a timer per caller would cost
    the router's core more than refusing a caller's turn does. While 400 callers
    arrive, far fewer tasks are alive than there are callers."""
    loop = asyncio.get_running_loop()
    alive: set[asyncio.Future[Any]] = set()
    peak = 0

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> Any:
        nonlocal peak
        task = asyncio.Task(coro, loop=loop, **kwargs)
        alive.add(task)
        task.add_done_callback(alive.discard)
        peak = max(peak, len(alive))
        return task

    previous = loop.get_task_factory()
    loop.set_task_factory(factory)
    try:
        with anyio.fail_after(60):
            report = await run_demo(DemoConfig(duration=0.3, participants=400, speed=0.5,
                                               progress=False, seed=6), out=io.StringIO())
    finally:
        loop.set_task_factory(previous)
    assert report.published > 0 and report.lost_turns == 0
    assert 0 < peak < 400, peak


async def test_rehearsal_routes_fail_or_answer_slowly() -> None:
    """`failing_routes` answers all fail, `slow_routes` start answering after about 3 s
    (past every first-response threshold of the shipped rules); others are untouched;
    an unknown route is a configuration error naming it."""
    sample = load_sample()
    agents = build_agents(sample, rng=random.Random(1), publish=_published, speed=1000.0,
                          clarify_heavy=False, failing_routes=("home",),
                          slow_routes=("utility",))

    async def started() -> None:
        return None

    with pytest.raises(RuntimeError, match="home back end timed out"):
        await agents["home"].answer(AgentTurn("p1", "t1", "lights on"), started=started)
    rng = random.Random(2)
    slow = sorted(agents["utility"].latency.draw(rng) for _ in range(200))
    # p95 past 4 s, the most any route is allowed in the shipped rules (overrides included)
    assert slow[100] > 2.0 and slow[190] > 4.0
    assert agents["work"].latency == LATENCIES["work"]
    with pytest.raises(ConfigurationError, match="'nope'"):
        build_agents(sample, rng=random.Random(1), publish=_published, speed=1.0,
                     clarify_heavy=False, slow_routes=("nope",))


async def test_a_failing_route_shows_as_failed_turns_of_that_route() -> None:
    """A short run with a failing route: its turns end `failed`, and nothing is lost."""
    report = await run_demo(DemoConfig(duration=1.5, participants=30, speed=10.0,
                                       progress=False, seed=3,
                                       failing_routes=("conversation",)), out=io.StringIO())
    assert report.turns.get(("conversation", "answer"), 0) == 0
    assert report.lost_turns == 0
    failed = sum(n for (route, outcome), n in report.turns.items() if outcome == "failed")
    assert failed > 5


def test_the_tracing_line_masks_the_endpoints_password(monkeypatch: pytest.MonkeyPatch) -> None:
    """"exporting spans to ..." shows the OTLP endpoint with its password and secret
    query values masked (it goes to the demo's standard output)."""
    for name in ("OTEL_TRACES_SAMPLER", "OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED",
                 "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    out = io.StringIO()
    provider = demo_tracer_provider(DemoConfig(
        otlp_endpoint="http://user:hunter2secret@127.0.0.1:9/?api_key=keysecret9"), out)
    try:
        assert "exporting spans to http://user:***@127.0.0.1:9/?api_key=***" in out.getvalue()
        assert "secret" not in out.getvalue()
    finally:
        provider.shutdown()


@pytest.mark.parametrize(("sig", "early"), [(signal.SIGINT, False), (signal.SIGTERM, False),
                                           (signal.SIGTERM, True)])
def test_a_served_demo_stopped_by_a_signal_prints_its_report(sig: signal.Signals,
                                                             early: bool) -> None:
    """`turnrouter demo --serve` runs until Ctrl-C (or SIGTERM, as a container stops),
    then drains and prints its report with its lost-turn check, exit 0, as a timed run
    does: before, Ctrl-C ended it with status 130 and no report. `early`: the signal
    comes as soon as the `metrics:` line is read, as a script that waits for the
    endpoint and stops it would send it (newcomer16: exit 143, no report)."""
    under_way = r"^metrics: " if early else r"turns\s+[1-9]"
    status, out, err = _signalled(["--serve", "--metrics-port", "0"], under_way, sig)
    assert status == 0, err
    assert "lost 0" in out and "Traceback" not in err


def test_a_timed_demo_stopped_by_ctrl_c_says_it_has_no_report() -> None:
    """Ctrl-C during a timed run (`make demo`, impatient) exited 130 with nothing said;
    now one line saying there is no report and that `--serve` reports (newcomer22)."""
    status, _, err = _signalled(["--duration", "120"], r"turns\s+[1-9]", signal.SIGINT)
    assert status == 130
    assert err.strip().splitlines() == [
        "turnrouter demo: interrupted before the end of the run: no report (--serve runs "
        "until Ctrl-C, then reports)"]


def _signalled(args: list[str], under_way: str,
               sig: signal.Signals) -> tuple[int, str, str]:
    """Run the demo with `args` until a progress line matches `under_way`, send `sig`:
    its exit status, stdout and stderr (every wait bounded)."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "turnrouter", "demo", *args,
         "--participants", "20", "--speed", "10"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    output: list[str] = []

    def read() -> None:  # a blocking read, off the test's thread: every wait bounded
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put("")

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        # Progress lines come every 5 s off a terminal; the first one with turns says
        # the run is under way.
        while not output or not re.search(under_way, output[-1]):
            output.append(lines.get(timeout=60))
            assert output[-1], f"the demo ended early: {output}"
        proc.send_signal(sig)
        proc.wait(timeout=60)
        reader.join(timeout=10)
        while not lines.empty():
            output.append(lines.get_nowait())
        assert proc.stderr is not None
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        reader.join(timeout=10)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    return proc.returncode, "".join(output), err


def test_an_unknown_sampler_is_named_without_an_endpoint(
        otel_env: pytest.MonkeyPatch) -> None:
    """A misspelt OTEL_TRACES_SAMPLER is named even when nothing is exported yet (no
    endpoint): it showed only once an endpoint was set, in production (newcomer9 D3)."""
    otel_env.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")
    otel_env.setenv("OTEL_TRACES_SAMPLER", "sometimes")
    out = io.StringIO()
    assert demo_tracer_provider(DemoConfig(), out) is None
    assert "unknown OTEL_TRACES_SAMPLER 'sometimes'" in out.getvalue()


@pytest.mark.parametrize("flag", [True, False])
def test_spans_asked_for_without_the_sdk_name_the_extra(
        otel_env: pytest.MonkeyPatch, flag: bool) -> None:
    """Without opentelemetry-sdk (its import fails), `--otlp-endpoint` on the command
    line is a usage error naming the `otlp` extra (it ran on and exited 0); an endpoint
    from the environment only turns spans off, saying what to install."""
    otel_env.setitem(sys.modules, "opentelemetry.sdk.resources", None)
    out = io.StringIO()
    if flag:
        with pytest.raises(ConfigurationError, match=r"turnrouter\[otlp\]"):
            demo_tracer_provider(DemoConfig(otlp_endpoint="http://127.0.0.1:9"), out)
    else:
        assert demo_tracer_provider(DemoConfig(), out) is None
        assert "turnrouter[otlp]" in out.getvalue()
