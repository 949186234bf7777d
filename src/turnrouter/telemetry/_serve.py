"""Serve `/metrics` with content negotiation, so Prometheus gets OpenMetrics and exemplars.

Both servers answer `Accept: application/openmetrics-text` with the OpenMetrics format
(which carries trace exemplars) and anything else with the classic text format; that is
prometheus_client's `choose_encoder`, used by its WSGI and ASGI apps. With a `ready`
callable, `/ready` and `/readyz` answer 200 while it returns True and 503 otherwise (a
Kubernetes readiness probe takes a busy replica out of rotation).
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from socketserver import ThreadingMixIn
from types import TracebackType
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    make_asgi_app,
    make_wsgi_app,
)

from .._exceptions import ContractTypeError, ContractValueError
from .._limits import is_logged

logger = logging.getLogger("turnrouter")

__all__ = ["ASGIApp", "MetricsServer", "bind_error", "metrics_app", "serve_metrics"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class MetricsServer:
    """A running `/metrics` HTTP server on a daemon thread; `close()` stops it.

    Args:
        server: The bound WSGI server (`serve_metrics` builds it).
        thread: The daemon thread serving it.
    """

    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self._closed = False

    @property
    def host(self) -> str:
        """The address the server is bound to."""
        return str(self._server.server_address[0])

    @property
    def port(self) -> int:
        """The bound port (the real one when 0 was asked for)."""
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """`http://host:port/metrics`."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the socket (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


#: The paths of the readiness endpoint.
READY_PATHS = frozenset({"/ready", "/readyz"})


def serve_metrics(
    port: int, registry: CollectorRegistry | None = None, addr: str = "127.0.0.1",
    ready: Callable[[], bool] | None = None, reason: Callable[[], str] | None = None,
) -> MetricsServer:
    """Serve `registry` (default: prometheus_client's) over HTTP; `port=0` picks a free one.

    `ready` (for example `lambda: not router.busy`) adds `/ready` and `/readyz`: 200
    `ready` while it returns True, 503 `busy` otherwise (and when it raises). `reason`,
    when given, says why not instead of `busy` (`turnrouter worker`: "disconnected from
    NATS", "stopping", ...): one line of at most `READY_REASON_CHARS` characters.
    """
    registry = REGISTRY if registry is None else registry
    if not isinstance(port, int) or isinstance(port, bool):  # "9464" from an env variable
        raise ContractTypeError(
            f"serve_metrics port must be an int (0 picks a free port), got "
            f"{type(port).__name__}: pass int(os.environ[...])")
    if not 0 <= port <= 65535:
        raise ContractValueError(f"serve_metrics port must be 0 to 65535, got {port}")
    if ready is not None and not callable(ready):
        raise ContractTypeError(
            f"serve_metrics ready must be callable, got {type(ready).__name__}")
    if reason is not None and not callable(reason):
        raise ContractTypeError(
            f"serve_metrics reason must be callable, got {type(reason).__name__}")
    family = _family(addr, port)

    class Server(_ThreadingServer):
        address_family = family

    app = make_wsgi_app(registry)
    try:
        httpd = make_server(addr, port, app if ready is None
                            else _with_readiness(app, ready, reason),
                            Server, handler_class=_QuietHandler)
    except OSError as exc:  # the same error, naming where (a bare "Address in use")
        raise OSError(exc.errno, f"{_WHERE.format(addr, port)}{exc.strerror or exc}"
                      ) from exc
    thread = threading.Thread(target=httpd.serve_forever, daemon=True,
                              name="turnrouter metrics")
    thread.start()
    return MetricsServer(httpd, thread)


_WHERE = "cannot serve metrics on {} port {}: "


def bind_error(exc: BaseException) -> str:
    """What went wrong when `serve_metrics` could not listen, without the address and
    port it names (for a caller that names them itself)."""
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    if text.startswith("cannot serve metrics on "):
        return text.split(": ", 1)[-1]
    return text


#: Connections served at once (one thread each); one more is closed at once.
MAX_CONNECTIONS = 256
#: Seconds a connection may stay silent before it is closed.
IDLE_SECS = 5.0


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    """One thread per connection, at most `MAX_CONNECTIONS` (idle ones closed after
    `IDLE_SECS`), a listen backlog for bursts of probes: idle connections held one thread
    each without bound (3,000 held 3,000 threads), and the default backlog of 5 refused
    scrapes behind a burst of connects."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        #: Requests that failed other than by their connection (logged at powers of ten).
        self.failures = 0
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # full: closed at once, counted nowhere
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that timed out or broke is closed without a word (the standard
        library printed a 26-line traceback for each: half-sent requests flooded the
        log); anything else is logged, the first time and at every power of ten."""
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            return
        self.failures += 1
        if is_logged(self.failures):
            logger.warning("turnrouter: serving metrics failed (%d so far): %r",
                           self.failures, error)


class _QuietHandler(WSGIRequestHandler):
    timeout = IDLE_SECS  # (the socket's: a silent client is dropped)

    def log_message(self, format: str, *args: Any) -> None:
        """Probes every few seconds: no access log on stderr."""


def _family(addr: str, port: int) -> socket.AddressFamily:
    infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    return infos[0][0]


WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


#: The most characters of a `/ready` body's reason (the rest is cut, marked with "...").
READY_REASON_CHARS = 200


def _why_not(reason: Callable[[], str] | None) -> bytes:
    """The 503 body: `reason()` on one bounded line, `busy` without one (or when it
    raises or says nothing)."""
    text = ""
    if reason is not None:
        try:
            said = reason()
        except Exception:  # a broken reason still answers 503, plainly
            said = ""
        text = " ".join(said.split()) if isinstance(said, str) else ""
        if len(text) > READY_REASON_CHARS:
            text = text[:READY_REASON_CHARS - 3] + "..."
    return ((text or "busy") + "\n").encode("utf-8", "replace")


def _with_readiness(metrics: WSGIApp, ready: Callable[[], bool],
                    reason: Callable[[], str] | None = None) -> WSGIApp:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") not in READY_PATHS:
            return metrics(environ, start_response)
        try:
            ok = bool(ready())
        except Exception:  # a failing check must not say ready
            ok = False
        body = b"ready\n" if ok else _why_not(reason)
        start_response("200 OK" if ok else "503 Service Unavailable",
                       [("Content-Type", "text/plain; charset=utf-8"),
                        ("Content-Length", str(len(body)))])
        return [body]

    return app


def metrics_app(registry: CollectorRegistry | None = None) -> ASGIApp:
    """An ASGI app serving `registry` with OpenMetrics negotiation.

    It also completes the ASGI lifespan protocol, so it can be mounted or run on its own.
    """
    serve: ASGIApp = make_asgi_app(REGISTRY if registry is None else registry)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        await serve(scope, receive, send)

    return app
