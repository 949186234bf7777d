"""A worker's patience with its server: outages, a frozen server, a deployment deleted.

A worker rides out a server that is unreachable (refused, killed, restarting, frozen)
for `NatsConfig.reconnect_for` seconds, at start-up as later (a lost connection tried
again every 0.1 s), with a log line per failed attempt at most every half second; past
that it exits saying why. A frozen server (SIGSTOP, a hung host:
its TCP connection stays open, nothing is answered) is noticed by pings: one every
`ping_interval(config)` seconds, the connection counted lost when two go unanswered.
A part of the deployment deleted while the worker runs (an operator deleting the input
or output stream, a consumer or the state bucket) is noticed by its requests finding no
responder: the worker reports it (not serving meanwhile, counted), recreates what its
start-up creates, and exits when that keeps failing for `reconnect_for` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from nats.aio.client import DEFAULT_BUFFER_SIZE, Client
from nats.errors import Error as NatsError
from nats.errors import SlowConsumerError
from nats.js.kv import KeyValue

from ..._exceptions import ConfigurationError, LifecycleError
from ..._limits import is_logged
from ..._redact import preview
from ._metrics import RuntimeMetrics
from ._permissions import Denial, Denials, parse_denial
from ._security import connect, safe_error
from ._setup import FRONT_API, check_payload, ensure_deployment
from ._wire import NatsConfig

__all__ = ["MAX_OUTSTANDING_PINGS", "RECONNECT_EVERY", "RECONNECT_WAIT", "Connection",
           "Readiness", "connect_timeout", "ping_interval"]

logger = logging.getLogger("turnrouter.runtime.nats")

RECONNECT_WAIT = 0.5  # seconds between start-up retries; the longest between reconnects
#: Seconds between the attempts to reconnect a lost connection in an outage's first
#: 5 s: a server restart is noticed within this, and so the turns running through it
#: keep their answers (a record write is retried for 10 s from its first try).
RECONNECT_EVERY = 0.1
#: ... and until 10 s into it; later, `RECONNECT_WAIT`. Every attempt is one log line:
#: at a steady 0.1 s a minute's outage said 600, this way about 170.
RECONNECT_SOON = 0.25
MAX_OUTSTANDING_PINGS = 2  # unanswered pings before the connection counts as lost
#: Bytes of one socket read nats-py parses between two returns to the event loop.
_PARSE_PIECE = 8192
#: How long a partition whose pull failed oddly (no consumer answering) waits before it
#: pulls again, unless the deployment is repaired sooner.
_PULL_PAUSE = 1.0

T = TypeVar("T")


def reconnect_wait(down: float) -> float:
    """Seconds before the next reconnect attempt, `down` seconds into an outage."""
    return RECONNECT_EVERY if down < 5.0 else RECONNECT_SOON if down < 10.0 \
        else RECONNECT_WAIT


def ping_interval(config: NatsConfig) -> float:
    """Seconds between a worker's pings: 2, or a quarter of `reconnect_for` when that is
    shorter (at least 0.1), so a frozen server is noticed within three intervals."""
    return max(0.1, min(2.0, config.reconnect_for / 4))


def connect_timeout(config: NatsConfig) -> float:
    """Seconds one connection attempt may take (a frozen server accepts the TCP
    connection and never sends its INFO): 2, or half of `reconnect_for` when shorter."""
    return max(0.1, min(2.0, config.reconnect_for / 2))


class Readiness:
    """Whether a running worker serves now: started, connected to NATS, and its streams,
    consumers and bucket all there. `turnrouter worker --ready-file` follows it;
    `on_change` listeners are called with the new state at each change.

    Args:
        metrics: the worker's metrics, whose `turnrouter_nats_serving` gauge follows the
            state; `None` (a readiness nobody scrapes) keeps no gauge.
    """

    def __init__(self, metrics: RuntimeMetrics | None = None) -> None:
        self._problems: dict[str, str] = {"start": "starting"}
        self._listeners: list[Callable[[bool], None]] = []
        self._metrics = metrics

    @property
    def serving(self) -> bool:
        return not self._problems

    @property
    def why_not(self) -> str:
        """What keeps the worker from serving ('' when it serves)."""
        return "; ".join(self._problems.values())

    def on_change(self, listener: Callable[[bool], None]) -> None:
        self._listeners.append(listener)

    def update(self, key: str, problem: str | None) -> None:
        """Set (or clear, with None) the problem `key` names."""
        before = self.serving
        if problem is None:
            self._problems.pop(key, None)
        else:
            self._problems[key] = problem
        now = self.serving
        if self._metrics is not None:
            self._metrics.serving.set(1 if now else 0)
        if now != before:
            for listener in self._listeners:
                listener(now)


class Connection:
    """The worker's connection: the first one tried for up to `config.reconnect_for`
    seconds, then a server outage ridden out as long, one log line per attempt; past
    that the connection is closed and the worker exits (`why_lost` says why). It also
    keeps the deployment (`suspect`, `pull_failed`: see the module doc)."""

    def __init__(self, config: NatsConfig, closed: Callable[[], Awaitable[None]],
                 reconnected: Callable[[], None], *,
                 dropped: Callable[[str], None] = lambda subject: None,
                 readiness: Readiness | None = None,
                 metrics: RuntimeMetrics | None = None,
                 spawn: Callable[[Awaitable[None], str], asyncio.Future[Any]] | None = None,
                 recovered: Callable[[], None] = lambda: None) -> None:
        self._config, self._closed, self._reconnected = config, closed, reconnected
        self._recovered = recovered
        self._dropped = dropped
        self.readiness = readiness or Readiness(metrics)
        self._metrics = metrics
        self._spawn = spawn or (lambda work, name: asyncio.ensure_future(work))
        self._drops = 0
        self._nc: Client | None = None
        self._down_since: float | None = None
        self._attempts = 0
        self._gave_up = False
        self._why: str | None = None
        self._checking: asyncio.Future[Any] | None = None
        self._repaired = asyncio.Event()
        self._statuses: dict[str, int] = {}
        #: What the server refused for the connection's permissions.
        self.denials = Denials(config, "worker")
        #: Partitions whose consumer an earlier turnrouter made (`Deployment.legacy`).
        self.legacy: frozenset[int] = frozenset()
        #: The fleet's secret part of every probe id (`Deployment.probe_key`).
        self.probe_key = ""

    async def connect(self, replica: str) -> Client:
        config = self._config
        nc = self._nc = await connect(
            config, "worker", patience=config.reconnect_for, denials=self.denials,
            name=f"turnrouter-{replica}",
            connect_timeout=connect_timeout(config), reconnect_time_wait=RECONNECT_WAIT,
            ping_interval=ping_interval(config),
            max_outstanding_pings=MAX_OUTSTANDING_PINGS,
            closed_cb=self._closed, disconnected_cb=self._disconnected,
            reconnected_cb=self._back)
        # From now on the bound is reconnect_for (checked at each attempt), not a count
        # (nats-py reads this option at every reconnect), and errors go through
        # `_error` (the first connection's callback spots refused credentials; nats-py
        # reads its error callback at every call).
        nc.options["max_reconnect_attempts"] = -1
        nc.options["reconnect_time_wait"] = RECONNECT_EVERY  # (the first: RECONNECT_WAIT)
        nc._error_cb = self._error
        _yield_between_reads(nc)
        _lean_headers(nc)
        return nc

    async def connect_fleet(self, replica: str) -> Client:
        """The worker's second connection, for the fleet subjects it reads (control,
        presence, timing: anyone holding the worker credential may publish there).

        A flood of them then queues behind nothing the turns need: on one shared
        connection it held back pull deliveries, JetStream replies and PONGs (turns
        answered seconds late, the connection dropped for unanswered pings, or cut by
        the server as a slow consumer, partitions lost). A flood faster than this
        connection is read fills the server's buffer for it instead, until the server
        cuts it (its `max_pending`); it is reconnected at once and for as long as the
        worker runs (one log line at the 1st, 10th, 100th, ... loss), and drops on its
        subscriptions are counted as on the other (`dropped`)."""
        config = self._config
        lines = _FleetLine(config, self)
        nc = await connect(
            config, "worker", patience=config.reconnect_for, denials=lines.denials,
            name=f"turnrouter-{replica}-fleet",
            connect_timeout=connect_timeout(config), reconnect_time_wait=RECONNECT_EVERY,
            ping_interval=ping_interval(config),
            max_outstanding_pings=MAX_OUTSTANDING_PINGS,
            disconnected_cb=lines.disconnected)
        nc.options["max_reconnect_attempts"] = -1
        nc._error_cb = lines.error  # (see `connect`)
        lines.nc = nc
        _yield_between_reads(nc)
        _lean_headers(nc)
        return nc

    def count_drop(self, exc: SlowConsumerError) -> None:
        """A fleet subject's queue is full (a flood): the message is dropped and
        counted; logged the 1st, 2nd, 4th, ... time only."""
        self._drops += 1
        self._dropped(exc.subject)
        if not self._drops & (self._drops - 1):
            logger.warning("turnrouter: dropped %d message(s) of a flooded fleet "
                           "subject so far (last on %s)", self._drops,
                           preview(exc.subject[:100]))

    async def set_up(self) -> KeyValue:
        """The deployment made (or found) at start (`ensure_deployment`), the bucket;
        tried again as `settle` says, but a publish or subscription the server refuses
        for the user's permissions ends it at once: a `ConfigurationError` naming what
        was refused (the JetStream API, the worker's replies: credentials of a front
        end, say). A refused `$JS.FRONT.API` where no `front_api` was named is not one:
        that import is optional (`_ensure_front_mirror` logs it and goes on)."""
        config, nc = self._config, self._nc
        assert nc is not None
        optional = FRONT_API.lower() + "."

        def fatal(denial: Denial) -> bool:
            return not (config.front_api is None and denial.kind == "publish"
                        and denial.lowered.startswith(optional))

        deployment = await self.settle("set-up", lambda: self.denials.guard(
            ensure_deployment(nc, config), fatal))
        self.legacy, self.probe_key = deployment.legacy, deployment.probe_key
        return deployment.bucket

    def probe(self, partition: int, window: int) -> tuple[str, str]:
        """Where a probe of `partition` goes (its consumer's own probe subject when an
        earlier turnrouter made it, else the partition's probe input) and its
        `Nats-Msg-Id` in `window`: the fleet's one probe of it, which nobody without
        the fleet's key can publish first."""
        config = self._config
        subject = (config.legacy_probe_subject(partition) if partition in self.legacy
                   else config.probe_subject(partition))
        return subject, f"{subject}.{window}.{self.probe_key}"

    async def settle(self, what: str, attempt: Callable[[], Awaitable[T]]) -> T:
        """`attempt()`, tried again (one log line per failure) while it fails for want of
        a server (`LifecycleError`, a NATS error, no reply in time) for up to
        `reconnect_for` seconds; a `ConfigurationError` (the server refused) at once."""
        first: float | None = None
        failures = 0
        while True:
            started = time.monotonic()
            if self._nc is not None and self._nc.is_closed:
                raise LifecycleError(self.why_lost())
            try:
                return await attempt()
            except ConfigurationError:
                raise
            except (LifecycleError, NatsError, TimeoutError, OSError) as exc:
                failures += 1
                first = started if first is None else first
                down = time.monotonic() - first
                error = safe_error(self._config, exc)[:300]
                logger.warning("turnrouter: %s attempt %d failed (%.1f s of %g s): %s", what,
                               failures, down, self._config.reconnect_for, error)
                if down >= self._config.reconnect_for:
                    raise LifecycleError(
                        f"{what} failed for {down:.1f} s (reconnect_for is "
                        f"{self._config.reconnect_for:g} s, {failures} attempts): {error}; "
                        f"exiting") from None
            await asyncio.sleep(RECONNECT_WAIT)

    def why_lost(self) -> str:
        if self._why is not None:
            return self._why
        if self._gave_up and self._down_since is not None:
            return (f"the NATS server at {self._config.safe_url} stayed unreachable for "
                    f"{time.monotonic() - self._down_since:.1f} s (reconnect_for is "
                    f"{self._config.reconnect_for:g} s, {self._attempts} attempts); "
                    f"exiting")
        return f"lost the connection to NATS at {self._config.safe_url}"

    async def _disconnected(self) -> None:
        self._lost()

    def _lost(self) -> None:
        """The connection is down: readiness drops, one line says so. Called by the
        disconnected callback and by the first failed reconnect attempt, whichever
        nats-py reports first (a reset connection reports the error first)."""
        if self._down_since is None and self._nc is not None and not self._nc.is_closed:
            self._down_since, self._attempts = time.monotonic(), 0
            self.readiness.update("connection", "disconnected from NATS")
            logger.warning("turnrouter: lost the connection to NATS; reconnecting for up "
                           "to %g s", self._config.reconnect_for)

    async def _back(self) -> None:
        down = time.monotonic() - self._down_since if self._down_since is not None else 0.0
        logger.warning("turnrouter: reconnected to NATS after %.1f s (%d attempts)", down,
                       self._attempts)
        self._down_since, self._attempts = None, 0
        if self._nc is not None:
            self._nc.options["reconnect_time_wait"] = reconnect_wait(0.0)
            try:
                # A server back with another configuration (or another server of the
                # URL list) may take less per message than at start: outputs up to
                # max_message_bytes would be dropped unsaid, their turns never ending.
                check_payload(self._nc, self._config)
            except ConfigurationError as exc:
                self._why = f"the NATS server came back taking less: {exc}; exiting"
                await self._closed()
                return
        self.readiness.update("connection", None)
        self._reconnected()

    async def _error(self, exc: Exception) -> None:
        """nats-py's error callback: one line, never a traceback; while reconnecting it
        is called once per failed attempt, which is where the outage bound is kept."""
        nc = self._nc
        denied = parse_denial(exc)
        if denied is not None:  # logged there, once per subject; the connection stays
            self.denials.record(*denied)
            return
        if isinstance(exc, SlowConsumerError):
            self.count_drop(exc)
            return
        what = safe_error(self._config, exc)[:300]
        # A reconnect attempt waiting for the server's INFO (a frozen server accepts
        # the TCP connection) fails while nats-py says "connecting".
        if nc is None or not (nc.is_reconnecting or nc.is_connecting):
            logger.warning("turnrouter: NATS connection error: %s", what)
            return
        self._lost()
        self._attempts += 1
        since = self._down_since
        down = time.monotonic() - since if since is not None else 0.0
        nc.options["reconnect_time_wait"] = reconnect_wait(down)
        logger.warning("turnrouter: NATS reconnect attempt %d failed (%.1f s of %g s): %s",
                       self._attempts, down, self._config.reconnect_for, what)
        if down >= self._config.reconnect_for and not self._gave_up:
            self._gave_up = True
            # nats-py drops a server tried more often than this and, with none left,
            # closes the connection: closed_cb then stops the worker.
            nc.options["max_reconnect_attempts"] = 1

    # ------------------------------------------------------------------ the deployment
    def suspect(self) -> None:
        """A request found no responder (no stream or consumer answering it): check the
        deployment, once at a time."""
        if self._nc is None or self._nc.is_closed:
            return
        if self._checking is None or self._checking.done():
            self._checking = self._spawn(self._check(self._nc), "deployment check")

    async def pull_failed(self, n: int, status: str, *, pause: bool = True) -> None:
        """A pull request on partition `n` ended with an unexpected status: logged the
        first time per status and at every power of ten, then (when `pause`: the
        partition loop's own request) a pause (`_PULL_PAUSE`, or until the deployment is
        repaired) instead of a pull loop at full speed."""
        count = self._statuses[status] = self._statuses.get(status, 0) + 1
        if is_logged(count):
            logger.warning("turnrouter: pull on partition %d: status %s (%d so far)", n,
                           status, count)
        if status == "503":  # no responders: the consumer (or its stream) is gone
            self.suspect()
        if pause:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._repaired.wait(), _PULL_PAUSE)

    async def _check(self, nc: Client) -> None:
        """What is missing is reported and recreated (as at start-up), retried every
        `RECONNECT_WAIT` for up to `reconnect_for` seconds, then the worker stops."""
        config = self._config
        first: float | None = None
        failures = 0
        reported = False  # a failure logged and readiness dropped, maybe before an outage
        recreated = False  # something was missing (not only JetStream slow to answer)
        while not nc.is_closed:
            if not nc.is_connected:  # the connection's own bound applies meanwhile
                # (Its count starts again, for `reconnect_for`; what it reported stays
                # to be cleared: a readiness left dropped after the server's return kept
                # a serving worker "not ready" for good.)
                first, failures = None, 0
                await asyncio.sleep(RECONNECT_WAIT)
                continue
            error = ""
            try:
                missing = await _missing(nc, config)
            except (LifecycleError, NatsError, TimeoutError, ValueError) as exc:
                missing, error = None, safe_error(config, exc)[:300]
            if missing == []:
                if reported:
                    logger.warning("turnrouter: the NATS deployment is whole again")
                    self.readiness.update("deployment", None)
                    self._repaired.set()
                    self._repaired = asyncio.Event()
                if recreated:
                    self._reconnected()  # publish again, claim again, pull at once
                else:
                    # A stream answered "no responders" on a connection that stayed up
                    # (a cluster electing the leader of a stream, or of the bucket,
                    # after losing a server): what it refused meanwhile was not stored,
                    # and no reconnect will publish it again.
                    self._recovered()
                return
            now = time.monotonic()
            first = now if first is None else first
            failures += 1
            reported = True
            if missing:
                names = ", ".join(name for _, name in missing)
                if not recreated:
                    recreated = True
                    logger.warning("turnrouter: missing from the NATS deployment: %s; "
                                   "recreating it", names)
                    self.readiness.update("deployment", f"missing: {names}")
                    if self._metrics is not None:
                        for part, _ in missing:
                            self._metrics.deployment_missing.labels(part).inc()
                try:
                    deployment = await ensure_deployment(nc, config)
                    self.legacy, self.probe_key = deployment.legacy, deployment.probe_key
                except (LifecycleError, ConfigurationError, NatsError) as exc:
                    error = f"missing {names}: {safe_error(config, exc)[:300]}"
                else:
                    if failures == 1:
                        continue  # check again at once
                    error = f"missing {names} again once recreated"
            else:
                self.readiness.update("deployment", "JetStream not answering")
                error = f"JetStream not answering ({error or 'no reply'})"
            down = now - first
            logger.warning("turnrouter: NATS deployment check %d failed (%.1f s of %g s): %s",
                           failures, down, config.reconnect_for, error)
            if down >= config.reconnect_for:
                self._why = (f"the NATS deployment stayed broken for {down:.1f} s "
                             f"(reconnect_for is {config.reconnect_for:g} s, {failures} "
                             f"attempts): {error}; exiting")
                await self._closed()
                return
            await asyncio.sleep(RECONNECT_WAIT)


class _FleetLine:
    """The callbacks of the fleet connection (`Connection.connect_fleet`): its drops
    counted with the worker's, its losses and errors logged sparingly (a flood may get
    it cut again and again; a server outage is reported by the turns' connection)."""

    def __init__(self, config: NatsConfig, connection: Connection) -> None:
        self._config, self._connection = config, connection
        self.denials = Denials(config, "worker")  # (its own: see _permissions.py)
        self.nc: Client | None = None
        self.losses = 0
        self._errors = 0

    def _closing(self) -> bool:
        """Closed by the worker (its end): no loss, no error to tell."""
        return self.nc is not None and self.nc.is_closed

    async def disconnected(self) -> None:
        if self._closing():
            return
        self.losses += 1
        if is_logged(self.losses):
            logger.warning("turnrouter: lost the fleet connection to NATS (%d time(s) "
                           "so far; a flood of a fleet subject, or an outage); "
                           "reconnecting", self.losses)

    async def error(self, exc: Exception) -> None:
        if isinstance(exc, SlowConsumerError):
            self._connection.count_drop(exc)
            return
        denied = parse_denial(exc)
        if denied is not None:  # logged there, once per subject
            self.denials.record(*denied)
            return
        if self._closing():
            return
        self._errors += 1
        if is_logged(self._errors):
            logger.warning("turnrouter: fleet connection error (%d so far): %s",
                           self._errors, safe_error(self._config, exc)[:300])


async def _missing(nc: Client, config: NatsConfig) -> list[tuple[str, str]] | None:
    """The parts of the deployment the server says do not exist, as (part, name); None
    when the server cannot say now (JetStream not answering)."""
    parts: list[tuple[str, str, str]] = [
        ("input_stream", f"stream {config.stream}", f"STREAM.INFO.{config.stream}"),
        ("output_stream", f"stream {config.output_stream}",
         f"STREAM.INFO.{config.output_stream}"),
        ("bucket", f"bucket {config.bucket}", f"STREAM.INFO.KV_{config.bucket}")]
    missing: list[tuple[str, str]] = []
    for part, name, api in parts:
        if await _absent(nc, api):
            missing.append((part, name))
    if not any(part == "input_stream" for part, _ in missing):
        gone = [n for n in range(config.partitions)
                if await _absent(nc, f"CONSUMER.INFO.{config.stream}.{config.consumer(n)}")]
        if gone:
            missing.append(("consumer", f"{len(gone)} consumer(s) of {config.stream}"))
    return missing


async def _absent(nc: Client, api: str) -> bool:
    """Whether the server says the stream or consumer of `api` does not exist (404);
    an error naming anything else raises (LifecycleError)."""
    reply = await nc.request(f"$JS.API.{api}", b"", timeout=2.0)
    data: Any = json.loads(reply.data)
    error = data.get("error") if isinstance(data, dict) else None
    if error is None:
        return False
    if isinstance(error, dict) and error.get("code") == 404:
        return True
    raise LifecycleError(f"JetStream API {api}: {error}")


def _yield_between_reads(nc: Client) -> None:
    """Return to the event loop after every `_PARSE_PIECE` bytes nats-py parses.

    nats-py's read loop parses what the socket holds, read after read, without returning
    to the loop while data is buffered (up to the transport's 256 KiB per wake-up: a
    flood of small messages held the loop for hundreds of milliseconds). A read over
    `_PARSE_PIECE` is now parsed in pieces with a return to the loop between them, and
    after a full read; a reconnect (which resets the parser) ends the feeding of what
    the old connection sent."""
    parser: Any = getattr(nc, "_ps", None)  # nats-py's private parser: skip if it moved
    parse = getattr(parser, "parse", None)
    if parse is None:
        return

    async def parse_in_pieces(data: bytes = b"") -> None:
        if len(data) <= _PARSE_PIECE:
            await parse(data)
        else:
            for start in range(0, len(data), _PARSE_PIECE):
                if start:
                    await asyncio.sleep(0)
                    if nc.is_reconnecting or nc.is_closed:
                        return
                await parse(data[start:start + _PARSE_PIECE])
        if len(data) >= DEFAULT_BUFFER_SIZE:
            # A full read: more may be buffered, which the read loop would take without
            # returning to the loop. A shorter read drained the buffer (the next read
            # waits), so the turns' small reads cost no extra step.
            await asyncio.sleep(0)

    parser.parse = parse_in_pieces


def parse_header_lines(raw: bytes) -> dict[str, str]:
    """nats-py's `Client._parse_header_lines` (2.16), without a generator per header
    name: a name holding whitespace is skipped, as there, when `str.split()` does not
    give it back whole (it splits on exactly what `str.isspace` calls whitespace)."""
    out: dict[str, str] = {}
    for line in raw.split(b"\r\n"):
        if not line:
            continue
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        try:
            key = name.strip().decode("ascii")
        except UnicodeDecodeError:
            continue
        if key and key.split() != [key]:
            continue
        out[key] = value.strip().decode("utf-8", "replace")
    return out


def _lean_headers(nc: Client) -> None:
    """Parse the connection's message headers with `parse_header_lines` (tested equal
    to nats-py's own): nats-py checks each character of each header name in a generator
    of its own, about 500 bytecodes a turn in a worker (a delivered input, the statuses
    of expired pull requests, timing samples). Left alone where nats-py parses headers
    otherwise (another version: its private method moved)."""
    if callable(getattr(type(nc), "_parse_header_lines", None)):
        nc._parse_header_lines = parse_header_lines  # type: ignore[method-assign]
