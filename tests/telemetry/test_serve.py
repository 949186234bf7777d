"""`/metrics` over HTTP and ASGI, with OpenMetrics negotiation (exemplars)."""

from __future__ import annotations

import socket
import threading
import urllib.error
import urllib.request
from collections.abc import MutableMapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from turnrouter import ContractTypeError, ContractValueError
from turnrouter.telemetry import READY_REASON_CHARS, metrics_app, serve_metrics

from .conftest import Rig
from .test_spans import answer_turn

OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def fetch(url: str, accept: str | None = None) -> tuple[str, str]:
    """GET `url`; return its content type and body."""
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.headers["Content-Type"], response.read().decode()


def test_serve_metrics_negotiates_openmetrics(rig: Rig) -> None:
    """The HTTP server gives text by default and OpenMetrics with exemplars on request."""
    answer_turn(rig.telemetry)
    with serve_metrics(0, registry=rig.registry) as server:
        assert server.port > 0
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        content_type, body = fetch(server.url)
        assert content_type.startswith("text/plain")
        assert 'turnrouter_turns_total{outcome="focus",route="weather"} 1.0' in body
        assert "trace_id" not in body
        content_type, body = fetch(server.url, OPENMETRICS)
        assert content_type.startswith("application/openmetrics-text")
        assert "turnrouter_first_response_seconds_bucket" in body
        assert '# {span_id="' in body
        assert 'trace_id="' in body
        assert body.endswith("# EOF\n")
    server.close()  # idempotent


def test_serve_metrics_close_frees_the_port(rig: Rig) -> None:
    """After close() the server no longer answers."""
    server = serve_metrics(0, registry=rig.registry)
    url = server.url
    server.close()
    with pytest.raises(urllib.error.URLError):
        fetch(url)


Message = MutableMapping[str, Any]


async def call_asgi(rig: Rig, scope: Message, incoming: list[Message]) -> list[Message]:
    """Run the metrics ASGI app once; return what it sent."""
    sent: list[Message] = []

    async def receive() -> Message:
        return incoming.pop(0)

    async def send(message: Message) -> None:
        sent.append(message)

    await metrics_app(rig.registry)(scope, receive, send)
    return sent


def http_scope(accept: str | None) -> Message:
    """An ASGI HTTP scope for GET /metrics."""
    headers = [(b"accept", accept.encode())] if accept else []
    return {"type": "http", "method": "GET", "path": "/metrics", "query_string": b"",
            "headers": headers}


@pytest.mark.anyio
async def test_asgi_app_negotiates_openmetrics(rig: Rig) -> None:
    """The ASGI app answers text by default and OpenMetrics (with exemplars) on request."""
    answer_turn(rig.telemetry)
    request = [{"type": "http.request", "body": b"", "more_body": False}]
    start, body = await call_asgi(rig, http_scope(None), list(request))
    headers = dict(start["headers"])
    assert start["status"] == 200
    assert headers[b"Content-Type"].startswith(b"text/plain")
    assert b"trace_id" not in body["body"]
    start, body = await call_asgi(rig, http_scope(OPENMETRICS), list(request))
    assert dict(start["headers"])[b"Content-Type"].startswith(b"application/openmetrics-text")
    assert b'trace_id="' in body["body"]


@pytest.mark.anyio
async def test_asgi_app_completes_lifespan(rig: Rig) -> None:
    """The ASGI app acknowledges lifespan startup and shutdown."""
    sent = await call_asgi(rig, {"type": "lifespan"},
                           [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}])
    assert [message["type"] for message in sent] == [
        "lifespan.startup.complete", "lifespan.shutdown.complete"]


def ready_reply(url: str) -> tuple[int, str]:
    """GET a readiness path: its status and body, 503 included."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


def test_a_readiness_reason_says_why_not_ready() -> None:
    """With `reason`, a 503 says why (one line); without it, `busy`; 200 says `ready`."""
    state = {"ready": False, "why": "disconnected from NATS"}
    registry = CollectorRegistry()
    with serve_metrics(0, registry=registry, ready=lambda: bool(state["ready"]),
                       reason=lambda: str(state["why"])) as server:
        base = server.url.removesuffix("/metrics")
        assert ready_reply(base + "/ready") == (503, "disconnected from NATS\n")
        state["why"] = "missing: TURNROUTER_IN,\nTURNROUTER_OUT"
        assert ready_reply(base + "/readyz") == (503, "missing: TURNROUTER_IN, TURNROUTER_OUT\n")
        state["ready"] = True
        assert ready_reply(base + "/ready") == (200, "ready\n")
    with serve_metrics(0, registry=CollectorRegistry(), ready=lambda: False) as server:
        assert ready_reply(server.url.removesuffix("/metrics") + "/ready") == (503, "busy\n")


@settings(max_examples=25, deadline=None)
@given(said=st.one_of(st.text(max_size=3000), st.integers(), st.none(), st.binary(max_size=50),
                      st.just("x" * 100_000), st.just("\ud800 lone"), st.just("\n\t \r")))
def test_a_junk_or_raising_reason_still_answers_503_on_one_bounded_line(said: Any) -> None:
    """Whatever `reason` returns (or raises), a not-ready check answers 503 with one line
    of at most READY_REASON_CHARS characters, never 200 and never a server error."""
    def reason() -> Any:
        if said is None:
            raise RuntimeError("no worker yet")
        return said

    with serve_metrics(0, registry=CollectorRegistry(), ready=lambda: False,
                       reason=reason) as server:
        status, body = ready_reply(server.url.removesuffix("/metrics") + "/ready")
    assert status == 503
    assert body.endswith("\n") and body.count("\n") == 1
    assert 0 < len(body.rstrip("\n")) <= READY_REASON_CHARS
    if not isinstance(said, str) or not said.split():
        assert body == "busy\n"


@given(junk=st.one_of(st.integers(), st.text(max_size=5), st.booleans()))
def test_serve_metrics_refuses_a_reason_that_is_not_callable(junk: Any) -> None:
    with pytest.raises(ContractTypeError, match="reason"):
        serve_metrics(0, registry=CollectorRegistry(), ready=lambda: True, reason=junk)


@pytest.mark.parametrize("with_ready", [False, True])
def test_idle_connections_hold_a_bounded_number_of_threads(with_ready: bool) -> None:
    """300 connections that send nothing hold at most 256 of the server's threads: the
    others are closed at once (before, each held a thread, 3,000 held 3,000), and a
    scrape is answered once they are gone."""
    server = serve_metrics(0, CollectorRegistry(), ready=(lambda: True) if with_ready else None)
    before = threading.active_count()
    idle = []
    try:
        for _ in range(300):
            idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=10))
        closed = 0
        for conn in idle[256:]:  # accepted last (the listen queue is in order): refused
            conn.settimeout(15)  # (refused at once; at worst closed when idle, 5 s)
            closed += conn.recv(1) == b""
        assert closed == 300 - 256
        assert threading.active_count() - before <= 256
    finally:
        for conn in idle:
            conn.close()
    with urllib.request.urlopen(server.url, timeout=10) as reply:
        assert reply.status == 200
    server.close()


def test_half_sent_requests_are_closed_without_a_traceback(
        capfd: pytest.CaptureFixture[str]) -> None:
    """A client sending half a request line then nothing is closed when idle, silently:
    each printed the standard library's 26-line traceback (a log flood for anyone who
    reaches the port), while the server goes on answering scrapes."""
    with serve_metrics(0, CollectorRegistry(), ready=lambda: True) as server:
        half = [socket.create_connection(("127.0.0.1", server.port), timeout=15)
                for _ in range(3)]
        try:
            for conn in half:
                conn.sendall(b"GET /ready HTTP/1.1\r\n")
            for conn in half:  # closed by the server once idle (5 s), bounded by 15 s
                assert conn.recv(1) == b""
        finally:
            for conn in half:
                conn.close()
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/ready", timeout=10) as reply:
            assert reply.status == 200
    err = capfd.readouterr().err
    assert "Traceback" not in err and "TimeoutError" not in err, err


def test_a_port_in_use_is_an_os_error_naming_it() -> None:
    """A port another server holds: the `OSError` names the address and port (it was a
    bare "Address already in use": the quickstart's demo and an app both on 9464)."""
    with serve_metrics(0, registry=CollectorRegistry()) as first:
        port = first.port
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1 port {port}"):
            serve_metrics(port, registry=CollectorRegistry())


@pytest.mark.parametrize("port", ["9464", 9464.0, True, None])
def test_serve_metrics_names_a_port_that_is_not_an_int(rig: Rig, port: object) -> None:
    """A port read from the environment ("9464") is refused naming the port; before, a
    raw TypeError from the socket said nothing of it (newcomer14)."""
    with pytest.raises(ContractTypeError, match="serve_metrics port must be an int"):
        serve_metrics(port, registry=rig.registry)  # type: ignore[arg-type]


@pytest.mark.parametrize("port", [-1, 65536, 10**9])
def test_serve_metrics_names_a_port_out_of_range(rig: Rig, port: int) -> None:
    with pytest.raises(ContractValueError, match="port must be 0 to 65535"):
        serve_metrics(port, registry=rig.registry)
