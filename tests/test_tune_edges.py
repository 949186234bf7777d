"""`turnrouter tune --prometheus` against hostile servers: slow replies and URLs that
carry credentials. `--timeout` bounds a whole query, and no password is ever shown."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .kit import LocalTcpServer, RawReplyServer, run_cli

SECRET = "hunter2-secret"


class TricklingServer(LocalTcpServer):
    """Answers every request one byte every 20 ms, forever: the reply `head` first, then
    the body (or the headers themselves, when `head` is empty). Each read the client
    makes succeeds, so only a bound on the whole exchange ends it."""

    def __init__(self, head: bytes) -> None:
        self.head = head
        super().__init__()

    def handle(self, conn: socket.socket) -> None:
        conn.recv(65536)
        conn.sendall(self.head or b"HTTP/1.1 200 OK\r\n")
        filler = b" " if self.head else b"X"
        while not self._stop.wait(0.02):
            conn.sendall(filler)


@pytest.fixture(params=["body", "headers"])
def trickling(request: pytest.FixtureRequest) -> Iterator[TricklingServer]:
    head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000000\r\n\r\n") if request.param == "body" else b""
    server = TricklingServer(head)
    try:
        yield server
    finally:
        server.close()


def test_timeout_bounds_a_whole_slow_reply(trickling: TricklingServer) -> None:
    """A server trickling its reply cannot hold tune past --timeout (each socket read
    succeeding must not restart the clock)."""
    results: list[tuple[int, str, str]] = []
    started = time.monotonic()
    runner = threading.Thread(target=lambda: results.append(run_cli(
        ["tune", "--prometheus", trickling.url, "--timeout", "0.5"])), daemon=True)
    runner.start()
    runner.join(30)
    assert not runner.is_alive(), "tune --timeout 0.5 still reading after 30 s"
    ((code, _out, err),) = results
    assert code == 2
    assert "within --timeout 0.5s" in err and err.count("\n") == 1
    assert time.monotonic() - started < 15


@pytest.mark.parametrize("url", [
    "http://alice:{secret}@127.0.0.1:{port}/",
    "http://{secret}@127.0.0.1:{port}",
    "http://127.0.0.1:{port}/?token={secret}",
    "http://127.0.0.1:{port}/#{secret}",
])
def test_credentials_in_the_url_are_refused_and_never_shown(url: str) -> None:
    """tune sends no credentials: a URL with a user, a password, a query or a fragment
    is refused naming what it holds, the secret itself not shown."""
    server = RawReplyServer()
    try:
        port = server.url.rsplit(":", 1)[1]
        code, out, err = run_cli(["tune", "--prometheus", url.format(secret=SECRET, port=port),
                                  "--timeout", "2"])
    finally:
        server.close()
    assert code == 2
    assert SECRET not in out + err
    assert "--prometheus" in err and err.count("\n") == 1


def _redirecting(location: str) -> RawReplyServer:
    server = RawReplyServer()
    server.reply = (f"HTTP/1.1 302 Found\r\nLocation: {location}\r\n"
                    "Content-Length: 0\r\n\r\n").encode()
    return server


def _tune(url: str) -> tuple[int, str]:
    """`turnrouter tune --prometheus url --timeout 5`: its status and standard error."""
    code, _out, err = run_cli(["tune", "--prometheus", url, "--timeout", "5"])
    return code, err


def test_a_redirect_off_http_is_refused(trickling: TricklingServer) -> None:
    """urllib would follow a redirect to ftp:// (on a connection no deadline watches, to
    a server that may trickle forever): tune refuses it at once, naming it."""
    port = trickling.url.rsplit(":", 1)[1]
    server = _redirecting(f"ftp://127.0.0.1:{port}/metrics")
    try:
        code, err = _tune(server.url)
    finally:
        server.close()
    assert code == 2 and "redirect to a ftp URL refused" in err


def test_a_redirect_to_another_http_server_is_followed() -> None:
    """Redirects between http(s) servers still work (a proxy in front of Prometheus)."""
    target = RawReplyServer()
    target.reply = (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
    server = _redirecting(target.url + "/api/v1/query")
    try:
        code, err = _tune(server.url)
    finally:
        server.close()
        target.close()
    # The redirected query (now a GET) reached the target, whose empty object is no answer.
    assert code == 2 and "Prometheus query failed" in err, err


@pytest.mark.parametrize("command", [["tune", "--samples"], ["demo", "--duration", "1",
                                                               "--samples"]])
def test_a_fifo_as_samples_file_is_refused_at_once(tmp_path: Path, command: list[str]) -> None:
    """`--samples` naming a FIFO (nobody on its other end): one line and status 2, at
    once. Before, opening it blocked tune and the demo for ever."""
    fifo = tmp_path / "samples.jsonl"
    os.mkfifo(fifo)
    results: list[tuple[int, str, str]] = []
    runner = threading.Thread(target=lambda: results.append(run_cli([*command, str(fifo)])),
                              daemon=True)
    runner.start()
    runner.join(30)
    assert not runner.is_alive(), f"{command[0]} --samples FIFO still waiting after 30 s"
    ((code, _out, err),) = results
    assert code == 2 and err.count("\n") == 1 and "samples.jsonl" in err
    # (a FIFO opened for writing with no reader: "No such device or address")
    assert "not a regular file" in err or "No such device" in err


@pytest.mark.parametrize(("flags", "problem"), [
    (["--plot", ""], "--plot needs a file name"),
    (["--window", "1h"], "--window applies to --prometheus only"),
    (["--timeout", "5"], "--timeout applies to --prometheus only"),
    (["--at", "1700000000"], "--at applies to --prometheus only"),
    (["--confidence", "1"], "--confidence: must be a finite number > 0.5 and < 1"),
    (["--replay-samples", "0"], "--replay-samples must be in 1..5,000,000"),
])
def test_flags_that_would_do_nothing_or_mislead_are_usage_errors(
        tmp_path: Path, flags: list[str], problem: str) -> None:
    """A flag `--samples` never reads is refused as `--selector` was (it used to be
    taken and ignored), `--plot ''` is no file name (it wrote nothing and said nothing),
    and `--confidence 1` is refused by the range its own message gives (which said
    "<= 1", and then refused 1 with another message) (ops7 D4)."""
    samples = tmp_path / "s.jsonl"
    samples.write_text('{"route": "a", "seconds": 0.5}\n' * 30)
    code, out, err = run_cli(["tune", "--samples", str(samples), *flags])
    assert code == 2 and out == "" and problem in err, err


@pytest.mark.parametrize("window", ["0s", "0m", "00h"])
def test_a_zero_window_is_refused_before_asking_prometheus(window: str) -> None:
    """`--window 0s` is no range: a usage error naming it, before any query (it reached
    Prometheus and came back as its raw HTTP 400)."""
    code, _out, err = run_cli(["tune", "--prometheus", "http://127.0.0.1:9", "--window",
                              window])
    assert code == 2 and "--window" in err and "positive" in err
