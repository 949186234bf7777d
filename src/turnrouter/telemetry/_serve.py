"""Serve `/metrics` with content negotiation, so Prometheus gets OpenMetrics and exemplars.

Both servers answer `Accept: application/openmetrics-text` with the OpenMetrics format
(which carries trace exemplars) and anything else with the classic text format; that is
prometheus_client's `choose_encoder`, used by its WSGI and ASGI apps.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, MutableMapping
from types import TracebackType
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, CollectorRegistry, make_asgi_app, start_http_server

__all__ = ["ASGIApp", "MetricsServer", "metrics_app", "serve_metrics"]

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


def serve_metrics(
    port: int, registry: CollectorRegistry | None = None, addr: str = "127.0.0.1"
) -> MetricsServer:
    """Serve `registry` (default: prometheus_client's) over HTTP; `port=0` picks a free one."""
    server, thread = start_http_server(
        port, addr=addr, registry=REGISTRY if registry is None else registry)
    return MetricsServer(server, thread)


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
