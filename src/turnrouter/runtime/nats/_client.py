"""The publishing side: front ends put typed messages on the wire and read outputs.

Outputs are read through an ephemeral push consumer of the output stream that this
module keeps itself (not nats-py's ordered consumer, which lives in the server's memory
and is recreated only after two missed 5 s heartbeats): it is recreated from the last
stream sequence read as soon as the connection comes back, when its 0.5 s heartbeats
stop, or when a consumer sequence is skipped, so a restarted server costs about a
second of outputs, none lost or repeated.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hashlib
import json
import logging
import re
import time
from collections.abc import AsyncGenerator, Awaitable, Mapping
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import MaxPayloadError
from nats.js.api import PubAck
from nats.js.errors import BadRequestError
from pydantic import ValidationError

from ..._exceptions import (
    ContractTypeError,
    ContractValueError,
    LifecycleError,
    TurnrouterError,
)
from ..._headers import HEADER_NAME
from ..._redact import preview
from ...telemetry._telemetry import current_carrier
from .._messages import VALIDATED, Interrupted, ResponseOutput, RuntimeMessage
from .._runtime import describe
from ._confirm import Confirmations
from ._connection import MAX_OUTSTANDING_PINGS
from ._mailbox import Mailbox
from ._permissions import Denials, DeniedError, denials_of
from ._quiet import quiet_tls_eof
from ._security import connect
from ._setup import api_request, check_payload, ensure_streams
from ._wire import (
    NatsConfig,
    ack_consumer,
    ack_sequences,
    input_message_id,
    kind_of,
    server_status,
)

__all__ = ["MAX_PUBLISHED", "MAX_SEEN_FINALS", "NatsFrontEnd"]

logger = logging.getLogger("turnrouter.runtime.nats")

_HEARTBEAT = 0.5  # the output consumer's idle heartbeat (seconds)
_SILENCE = 2.5 * _HEARTBEAT  # no message nor heartbeat for this long: recreate it
_TICK = 0.2  # how often a waiting reader checks for silence and reconnects
_NS = 1_000_000_000
_PUBLISH_TIMEOUT = 5.0  # seconds a publish waits for the server to store it
_PING_INTERVAL = 2.0  # seconds between the front end's pings


#: The most final outputs one `outputs()` reader remembers (per turn, for
#: `NatsConfig.dedup_window` seconds of stream time) to read a turn's final once.
MAX_SEEN_FINALS = 65_536

#: The most inputs one front end remembers as published (for `NatsConfig.dedup_window`
#: seconds), to tell a retry of its own from a new message reusing an id.
MAX_PUBLISHED = 65_536

#: How long `NatsFrontEnd.close()` waits for the server's answer to a ping before it
#: closes without draining.
_CLOSE_PING_SECS = 1  # seconds (nats-py types it an int)


#: The fields of an input that do not make it another message: a retry may be built
#: again (a new time) or carry another trace context.
_NOT_CONTENT: set[str] = {"timestamp_us", "traceparent", "tracestate"}


class _Published:
    """The inputs this front end published within the streams' deduplication window: each
    one's deduplication id and a digest of its body (at most `MAX_PUBLISHED`, the oldest
    forgotten first). The input stream answers "duplicate" both for a retry of the same
    message (stored once: fine) and for another message reusing an id within the window
    (dropped: `publish` must not return as if it was stored)."""

    __slots__ = ("_ids", "_window")

    def __init__(self, window: float) -> None:
        self._ids: dict[str, tuple[bytes, float]] = {}  # oldest first
        self._window = window

    def note(self, msg_id: str, digest: bytes) -> tuple[bytes, float] | None:
        """Remember `msg_id` as published with `digest` now; what it held before."""
        ids, now = self._ids, time.monotonic()
        while ids:
            oldest = next(iter(ids))
            if now - ids[oldest][1] <= self._window and len(ids) < MAX_PUBLISHED:
                break
            del ids[oldest]
        previous = ids.pop(msg_id, None)
        ids[msg_id] = (digest, now)
        return previous

    def undo(self, msg_id: str, previous: tuple[bytes, float] | None) -> None:
        """`msg_id` was not stored after all: remember what it held before."""
        self._ids.pop(msg_id, None)
        if previous is not None:
            self._ids[msg_id] = previous


class NatsFrontEnd:
    """Publishes queries, joins, departures and interrupts; reads deduplicated outputs.

    Inputs go to the input stream (`publish` returns once the server stored them, so a
    returned publish is never lost); a global interrupt (`Interrupted` without a
    participant) goes to every replica at once. Outputs must be read from the output
    stream (`outputs()`), not from a plain subscription: only the stream drops the
    duplicate of a turn's answer that a crashed replica and its successor may both send.
    """

    def __init__(self, nc: Client, config: NatsConfig) -> None:
        self._nc, self._config = nc, config
        # What the server refused for the connection's permissions (`connect` hooks them
        # up; a front end built on a connection of its own sees none).
        self._denials = denials_of(nc) or Denials(config, "frontend")
        self._js = nc.jetstream(timeout=_PUBLISH_TIMEOUT)
        self._confirms = Confirmations(nc)
        self._published = _Published(config.dedup_window)
        self.inputs_duplicated = 0
        """Inputs the stream dropped as duplicates of messages with the same id this
        front end did not publish (or no longer remembers): retries of them, or new
        messages reusing their ids (see `publish`)."""
        self.outputs_skipped = 0
        """Messages on the output subjects that `outputs()` skipped: not a valid
        `ResponseOutput`, or one for another participant than its subject's."""
        self.outputs_repeated = 0
        """Final outputs `outputs()` read again and skipped: a turn's final stored twice
        (a new output stream has no deduplication history, so an ending republished
        after the stream was deleted and made again is stored once more)."""
        self.readers_refused = 0
        """Times the server refused an `outputs()` reader its consumer (tried again
        every 0.2 s; the reason is logged): the stream's consumer limit reached, say."""
        self.readers_starved = 0
        """Times an `outputs()` reader's consumer, idle, left unread an output the
        stream had stored 2 s before (changed by another client of
        the account: a filter that reads nothing, say): made again from the last output
        read, logged (redteam18 F1)."""

    @classmethod
    async def connect(cls, config: NatsConfig, **options: Any) -> NatsFrontEnd:
        """Connect to `config.url` (options go to `nats.connect`, over the credentials
        and TLS of `config`) and make sure the streams exist, so a front end may start
        before any worker. Streams that exist are left alone: a front end of a locked
        deployment (deploy/nats/) may only look them up, the workers create them. Unless
        `options` say otherwise, the connection retries a lost server every 0.25 s for
        ever (`reconnect_time_wait`, `max_reconnect_attempts=-1`), so outputs resume
        within about a second of the server's return, and pings it every 2 s
        (`ping_interval`), counting the connection lost when two go unanswered: a frozen
        server (its connection open, nothing answered) is left within about 6 s for
        another server of the URL list, instead of nats-py's default two minutes.

        A publish or subscription the server refuses for the user's permissions ends
        the start at once: `ConfigurationError` naming the subject when it is one every
        front end needs (its replies, the look-up of the output stream: credentials of
        a worker, say), `LifecycleError` when only the creation of a missing deployment
        was refused (start a worker first). Refusals later (a fleet-wide interrupt,
        say) are logged once per subject."""
        quiet_tls_eof()  # asyncio's warning at every TLS close (redteam18 F8)
        options.setdefault("reconnect_time_wait", 0.25)
        options.setdefault("max_reconnect_attempts", -1)
        options.setdefault("ping_interval", _PING_INTERVAL)
        options.setdefault("max_outstanding_pings", MAX_OUTSTANDING_PINGS)
        if not isinstance(config, NatsConfig):  # a URL string, say: not deep inside
            raise ContractTypeError(
                "NatsFrontEnd.connect needs a NatsConfig (NatsConfig(url='nats://...')), "
                f"got {type(config).__name__}")
        denials = Denials(config, "frontend")
        # A first connection that never succeeds (a wrong port, no server started) ends
        # after `reconnect_for` with a LifecycleError, as a worker's start does; once
        # connected, a lost server is retried for ever (newcomer22).
        options.setdefault("patience", config.reconnect_for)
        nc = await connect(config, "frontend", denials=denials, **options)
        try:
            check_payload(nc, config)
            # A refused look-up (or reply subscription) ends this at once, naming what
            # was refused: credentials of another role (a worker's, say) waited for
            # the requests' timeouts, then said only that.
            if not await denials.guard(_deployment_exists(nc, config)):
                try:
                    await denials.guard(ensure_streams(nc, config))
                except TurnrouterError as exc:
                    if not denials.count:
                        raise
                    # A locked deployment's front end may only look streams up.
                    refused = (exc.denials[0].subject if isinstance(exc, DeniedError)
                               else denials.recent[-1].subject)
                    raise LifecycleError(
                        f"the output stream {config.output_stream} does not exist, and "
                        f"this user may not create the deployment (the server refused "
                        f"{refused!r}): the workers create it; start one first") from exc
        except BaseException:
            await nc.close()
            raise
        return cls(nc, config)

    @property
    def connection(self) -> Client:
        return self._nc

    async def close(self) -> None:
        """Close the connection, flushing what it holds when the server is there (a
        drain); while it is reconnecting (a server down or frozen) there is nothing it
        can flush, so it just closes. A server that froze before the connection noticed
        is found by a ping answered within a second: no answer, no drain (a drain would
        wait 10 s for it). Closing twice is harmless."""
        nc = self._nc
        if nc.is_closed:
            return
        if nc.is_connected:
            with contextlib.suppress(NatsError, asyncio.TimeoutError):
                await nc.flush(timeout=_CLOSE_PING_SECS)  # the server answers: drain
                await nc.drain()
                return
        await nc.close()

    async def publish(self, message: RuntimeMessage,
                      headers: dict[str, str] | None = None) -> None:
        """Publish one input message; W3C trace context travels in the NATS headers.

        Returns once the server stored it. A connection lost while it waits for that
        (the server crashed) sends it again as soon as it is back, within the same
        bound. `LifecycleError` means it did not confirm in time (5 s: a server that is
        down or frozen): the message may still have been stored; while the connection
        is known lost (reconnecting), `LifecycleError` at once and nothing is sent
        (nats-py would hold it and send it on reconnect, when its participant may have
        given up on it). Publishing the same message again is
        safe, as its `Nats-Msg-Id` makes the stream drop a second copy within the
        deduplication window (2 min); another message reusing a participant's message id
        within that window (a new session's `turn-1` right after the last one's, say) is
        dropped by the stream too: `publish` raises `ContractValueError` saying so when
        this front end published that other message (a message built again with the same
        id and content is a retry, not another message); when it cannot tell (another
        front end's, or one older than its memory of `MAX_PUBLISHED`), it logs, counts
        it in `inputs_duplicated` and raises `ContractValueError` too: the stream stores
        nothing of it, and the id may have been taken on purpose (any front end may
        publish any `Nats-Msg-Id` on its own subjects, redteam18 F7); a retry of what
        another front end stored needs nothing more, another message a new id. A
        retry of a message this front end published returns normally. A fleet-wide
        interrupt (`Interrupted` without a participant) is not stored: it returns once
        the server handled it, `LifecycleError` when the server refused it for the
        connection's permissions.

        `ContractValueError`, nothing published: a message over `max_message_bytes` as
        JSON (workers would refuse it), `headers` (extra headers, e.g. your own
        correlation ids) holding a `Nats-*` key, a key that is not a header name
        (`MAX_HEADER_NAME` characters of letters, digits and ``!#$%&'*+-.^_`|~``), a value
        that is not a str or holds a control character, or more than `MAX_EXTRA_HEADERS`
        bytes in all, a message id this front end published for another message of that
        participant within the deduplication window, or a refusal of the server that a
        retry would meet again. A message that skipped validation (`model_construct()`,
        `model_copy(update=...)`, a field changed since) is validated again, as the
        in-process runtime's `publish` does: `ContractTypeError` or `ContractValueError`
        naming the field, nothing published (workers would refuse it, and its turn would
        never end); `headers` that are not a mapping: `ContractTypeError`."""
        try:
            kind = kind_of(message)
        except TypeError as exc:
            raise ContractTypeError(str(exc)) from exc
        message = _validated(message)
        if headers is not None and not isinstance(headers, Mapping):
            raise ContractTypeError(
                f"publish() headers must be a mapping of str to str or None, got "
                f"{type(headers).__name__}")
        if headers:
            _check_headers(headers)
        pid = getattr(message, "participant_id", None)
        # Scoped to the participant: two participants may reuse a message id.
        msg_id = message.message_id if pid is None else input_message_id(pid, message.message_id)
        if msg_id != msg_id.strip() or "\r" in msg_id or "\n" in msg_id:
            # nats-py strips a header value and flattens CR/LF: the workers would read
            # another id than the stream's and refuse the message (redteam22 F2).
            raise ContractValueError(
                f"{kind} message_id {preview(message.message_id[:100])}: a NATS header "
                "cannot carry it as given (whitespace at its end, CR or LF); not published")
        # Trace context: the message's own, else the caller's current span (a trace
        # started by the publisher continues in the replica's turn), unless the caller
        # passed its own headers for it.
        carrier = message.trace_carrier()
        if not carrier and not (headers and "traceparent" in headers):
            carrier = current_carrier()
        hdrs = {**carrier, **(headers or {}), "Nats-Msg-Id": msg_id}
        data = message.model_dump_json().encode("utf-8")
        if len(data) > self._config.max_message_bytes:
            # Workers refuse it unrun: said now, instead of a turn that never ends.
            raise ContractValueError(
                f"{kind} of {len(data)} bytes as JSON is over max_message_bytes "
                f"({self._config.max_message_bytes}): workers refuse it; not published")
        if not self._nc.is_connected:
            raise LifecycleError(
                f"publishing {kind}: not connected to NATS (reconnecting); nothing was "
                "sent: publish it again once reconnected")
        try:
            if isinstance(message, Interrupted) and message.participant_id is None:
                await self._interrupt_all(data, hdrs)
                return
            assert isinstance(pid, str)
            # Noted before it goes out: one that timed out may be stored, and its retry
            # is then a duplicate of this very message. What it says counts, not when it
            # was made or traced: a retry built again from the same id and text is one.
            digest = hashlib.blake2b(message.model_dump_json(exclude=_NOT_CONTENT).encode(),
                                     digest_size=16).digest()
            previous = self._published.note(msg_id, digest)
            subject, js, sends = self._config.input_subject(pid, kind), self._js, [0]

            def send(timeout: float) -> Awaitable[PubAck]:
                sends[0] += 1
                return js.publish(subject, data, timeout=timeout, headers=hdrs)

            # Sent again at once when the connection comes back, should it be lost
            # while the stream's reply is awaited (within the same 5 s).
            ack = await self._confirms.confirmed(send, time.monotonic() + _PUBLISH_TIMEOUT,
                                                 kind)
            if ack.duplicate and sends[0] > 1:
                return  # the copy sent before the connection was lost was stored
            if ack.duplicate and previous is not None and previous[0] != digest:
                self._published.undo(msg_id, previous)
                raise ContractValueError(
                    f"{kind} {preview(message.message_id)} of participant {preview(pid)}: "
                    f"the stream dropped it as a duplicate of another message with that id "
                    f"this front end published within the last dedup_window "
                    f"({self._config.dedup_window:g} s). A new message needs a new id (a "
                    f"new session's turn-1 right after the last one's, say)")
            if ack.duplicate and previous is None:
                self._unknown_duplicate(kind, message.message_id, pid)
                raise ContractValueError(
                    f"{kind} {preview(message.message_id)} of participant {preview(pid)}: "
                    f"the stream dropped it as a duplicate of a message with that id this "
                    f"front end did not publish within dedup_window "
                    f"({self._config.dedup_window:g} s): another front end's (a retry of "
                    f"it is stored already: nothing to do), or one sent to take the id "
                    f"(a front end holding the credential can: publish it with a new id)")
        except (BadRequestError, MaxPayloadError) as exc:
            raise ContractValueError(f"publishing {kind} refused by the server: {exc!r} "
                                     f"(for good: publishing it again is refused too)") from exc
        except NatsError as exc:
            raise LifecycleError(f"publishing {kind} failed: {exc!r}") from exc

    async def _interrupt_all(self, data: bytes, headers: dict[str, str]) -> None:
        """A fleet-wide interrupt: a plain publish (every replica subscribes; no stream
        stores it), followed by a request the server answers after it (one connection's
        commands are handled in order, and a refused publish is reported before that
        answer): `LifecycleError` when the server refused it (this user may not publish
        control messages: the shipped permissions keep them to workers) or did not
        answer in time."""
        subject, before = self._config.interrupt_all_subject, self._denials.count
        await self._nc.publish(subject, data, headers=headers)
        try:
            await self._nc.request(f"$JS.API.STREAM.INFO.{self._config.output_stream}",
                                   b"", timeout=_PUBLISH_TIMEOUT)
        except NatsError as exc:
            raise LifecycleError(f"publishing interrupt was not confirmed: {exc!r}") from exc
        if self._denials.refused("publish", subject, before):
            raise LifecycleError(f"publishing interrupt failed: the server refused "
                                 f"{subject!r} for this connection's permissions (the "
                                 f"shipped permissions let only workers publish it)")

    async def outputs(self, *, deliver_new: bool = True,
                      subscribed: asyncio.Event | None = None
                      ) -> AsyncGenerator[ResponseOutput, None]:
        """Outputs from the output stream, in stream order, each once.

        `ResponseOutput.final` tells a turn's final output (its answer or the failure
        text, one per turn) from control text; a reader yields one final per turn (a
        participant's request id) within `dedup_window` seconds of stream time, even
        when the stream stored it twice (counted in `outputs_repeated`). With
        `deliver_new` (the default) only outputs stored after the subscription are read:
        pass `subscribed` and publish once it is set, or an early answer may be stored
        before the subscription exists and never be read. A server restart or a lost
        connection is ridden out (reading resumes where it stopped, about a second after
        the server is back); a message that is not a valid output is skipped, logged and
        counted in `outputs_skipped`. It ends when the connection is closed (`close()`).
        """
        reader = _OutputReader(self, deliver_new)
        try:
            await reader.open()
            if subscribed is not None:
                subscribed.set()
            while (output := await reader.next()) is not None:
                yield output
        finally:
            await reader.close()

    def _repeated(self, output: ResponseOutput) -> None:
        self.outputs_repeated += 1
        count = self.outputs_repeated
        if count & (count - 1) == 0:
            logger.warning("turnrouter: a turn's final output was stored twice, read once "
                           "(%d so far; route %s)", count, preview(output.route))

    def _unknown_duplicate(self, kind: str, message_id: str, pid: str) -> None:
        """The stream dropped an input as a duplicate of one this front end did not
        publish (another front end's, or one older than its memory): a retry of that
        one, stored already, or a new message reusing its id, dropped. Which, it cannot
        tell: logged (the 1st, 2nd, 4th... time) and counted; `publish` then raises."""
        self.inputs_duplicated += 1
        count = self.inputs_duplicated
        if count & (count - 1) == 0:
            logger.warning("turnrouter: the stream dropped %s %s of participant %s as a "
                           "duplicate of a message with that id published within "
                           "dedup_window by another front end (or before this one's memory): "
                           "a retry is stored already; a new message needs a new id (%d so "
                           "far)", kind, preview(message_id), preview(pid), count)

    def _refused(self, why: str) -> None:
        self.readers_refused += 1
        count = self.readers_refused
        if count & (count - 1) == 0:
            logger.warning("turnrouter: the server refused the output reader's consumer "
                           "(%d so far; retrying): %s", count, why)

    def _starved(self, behind: int, last: int) -> None:
        self.readers_starved += 1
        count = self.readers_starved
        if count & (count - 1) == 0:
            logger.warning("turnrouter: the output reader's consumer left output %d of "
                           "the output stream unread (read up to %d) while idle: changed "
                           "by another client of the account? Made again (%d so far)",
                           behind, last, count)

    def _skipped(self, why: str) -> None:
        self.outputs_skipped += 1
        count = self.outputs_skipped
        if count & (count - 1) == 0:  # the 1st, 2nd, 4th, ...: a flood logs little
            logger.warning("turnrouter: skipped an invalid output (%d so far): %s",
                           count, why)


#: Seconds a new `outputs()` reader asks again for a consumer the server refuses
#: (`readers_refused`) before it raises `LifecycleError` with the server's reason.
READER_PATIENCE = 5.0

#: Seconds between an idle `outputs()` reader's look-ups of the output stream's last
#: sequence: an output stored at one look-up and still unread at the next, the consumer
#: idle, means the consumer no longer delivers what it should (`readers_starved`).
_AUDIT_EVERY = 2.0

#: Messages an output reader handles without returning one before it lets the loop run.
_YIELD_EVERY = 256


class _OutputReader:
    """One `outputs()` reader: its consumer, recreated from the last stream sequence
    read whenever it may be gone (see the module doc)."""

    def __init__(self, front: NatsFrontEnd, deliver_new: bool) -> None:
        self._front, self._nc, self._config = front, front._nc, front._config
        self._deliver_new = deliver_new
        self._last: int | None = None if deliver_new else 0  # last stream sequence read
        self._next_cseq = 1
        self._inbox = ""
        self._sub: Any = None
        self._consumer: str | None = None
        self._delivered_by = ""  # "stream.consumer" its deliveries' ack subjects name
        self._msgs: Mailbox[Msg] = Mailbox()
        self._heard = time.monotonic()
        self._reconnects = 0
        self._generation = 0  # of the consumer: what an earlier one sent is ignored
        self._created: object = None  # the output stream's creation time, when known
        self._finals = _SeenFinals(int(self._config.dedup_window * _NS))
        # The last output read (subject, data) and its stored time: a consumer made
        # again starts *at* it, and one that finds another message there (a store
        # restored from an older copy, or the output trimmed) reads by time instead.
        self._last_msg: tuple[str, bytes] | None = None
        self._last_ns = 0
        self._stream_last: int | None = None  # the stream's last sequence, when asked
        self._check = False  # the next output is the last one read, delivered again
        self._refusal: str | None = None  # the server's reason, when it refused one
        self._audit_at = 0.0  # when an idle reader next looks the stream's end up
        self._unread: int | None = None  # a stream sequence stored, unread at the last
        self._by_time = False  # the next consumer starts after `_last_ns`

    async def open(self) -> None:
        """The first consumer. One the server refuses (the account's or the stream's
        consumer slots taken, say) is asked again every `_HEARTBEAT`, each refusal
        counted, for `READER_PATIENCE` seconds: then `LifecycleError` with the server's
        reason. `LifecycleError` at once when the server cannot make one (no output
        stream, JetStream not answering)."""
        deadline = time.monotonic() + READER_PATIENCE
        while True:
            self._refusal = None
            if await self._create():
                return
            stream = self._config.output_stream
            if self._refusal is None:
                raise LifecycleError(f"cannot read the output stream {stream}: it does "
                                     "not exist, or JetStream did not answer")
            if time.monotonic() >= deadline:
                raise LifecycleError(
                    f"cannot read the output stream {stream}: the server refused the "
                    f"reader's consumer for {READER_PATIENCE:g} s "
                    f"({self._front.readers_refused} refusals so far): {self._refusal} "
                    "(with 'maximum consumers limit reached', other clients hold the "
                    "consumer slots: see docs/distributed.md, \"Trust\")")
            await asyncio.sleep(_HEARTBEAT)

    async def _create(self) -> bool:
        """A fresh consumer from the last sequence read; False when the server cannot
        make one now (retried at the next tick). The stream is asked again once the
        consumer is made: one made again in between (a restarted mirror, a repaired
        output stream) got a consumer starting past what it holds, which skipped its
        first outputs; it is read from its start instead."""
        for _ in range(3):  # (each round needs the stream made again meanwhile)
            if not await self._make():
                return False
            try:
                if not await self._recreated():
                    return True
            except (NatsError, TimeoutError, ValueError, KeyError, TypeError):
                return True  # asked again at the next creation
            self._last, self._last_msg = 0, None  # a new stream: all of it is new
        return True

    async def _make(self) -> bool:
        """One consumer from the last sequence read (see `_create`)."""
        nc, config = self._nc, self._config
        self._reconnects = nc.stats["reconnects"]
        self._heard = time.monotonic()
        self._unread, self._audit_at = None, self._heard + _AUDIT_EVERY  # a new baseline
        await self._drop()
        self._inbox = nc.new_inbox()
        self._msgs.clear()
        self._generation += 1
        self._sub = await nc.subscribe(self._inbox,
                                       cb=functools.partial(self._put, self._generation))
        consumer: dict[str, Any] = {
            "deliver_subject": self._inbox, "filter_subject": f"{config.prefix}.out.*",
            "ack_policy": "none", "max_deliver": 1, "flow_control": True,
            "idle_heartbeat": int(_HEARTBEAT * _NS), "mem_storage": True,
            "num_replicas": 1, "inactive_threshold": 5 * _NS, "replay_policy": "instant"}
        try:
            if await self._recreated() and self._last is not None:
                self._last, self._last_msg = 0, None  # a new stream: all of it is new
                self._by_time = False
        except (NatsError, TimeoutError, ValueError, KeyError, TypeError):
            self._heard = time.monotonic() - _SILENCE
            return False  # again in a tick
        last, stream_last = self._last, self._stream_last
        if last and stream_last is not None and stream_last < last:
            # The stream went back (its store restored from an older copy): what it
            # stored since came after what was read, whatever its sequences.
            self._by_time = self._last_msg is not None
            if not self._by_time:
                self._last = last = stream_last
        self._check = False
        if last is None:
            consumer["deliver_policy"] = "new"
        elif self._by_time:
            consumer["deliver_policy"] = "by_start_time"
            consumer["opt_start_time"] = _stamp(self._last_ns + 1)
        elif last and self._last_msg is not None:
            consumer["deliver_policy"] = "by_start_sequence"
            consumer["opt_start_seq"] = last  # the last one read again: still there?
            self._check = True
        else:
            consumer["deliver_policy"] = "by_start_sequence"
            consumer["opt_start_seq"] = last + 1
        try:
            reply = await self._ask(
                f"$JS.API.CONSUMER.CREATE.{config.output_stream}",
                json.dumps({"stream_name": config.output_stream,
                            "config": consumer}).encode())
            info = json.loads(reply.data)
            error = info.get("error") if isinstance(info, dict) else None
            if isinstance(error, dict):  # e.g. "maximum consumers limit reached"
                self._refusal = preview(error.get("description"))
                self._front._refused(self._refusal)
            name = info["name"]
        except (NatsError, TimeoutError, ValueError, KeyError, TypeError):
            # The server is not ready (JetStream still starting, say): again in a tick.
            self._heard = time.monotonic() - _SILENCE
            return False
        self._consumer, self._next_cseq = str(name), 1
        self._delivered_by = f"{config.output_stream}.{name}"
        if self._last is None:
            # "new": it starts after what the stream held when it was made.
            delivered = info.get("delivered") or {}
            seq = delivered.get("stream_seq")
            self._last = seq if isinstance(seq, int) and seq >= 0 else 0
        return True

    async def _ask(self, subject: str, payload: bytes) -> Msg:
        """One JetStream API request, given up (TimeoutError) after 2 s or as soon as the
        connection is replaced: a request sent on a connection that dropped (a frozen
        server noticed by the pings, say) never gets its reply, and waiting out its
        timeout held the reader up to 2 s after the server was back."""
        nc = self._nc
        reconnects = nc.stats["reconnects"]
        ask = asyncio.ensure_future(nc.request(subject, payload, timeout=2.0))
        try:
            while True:
                done, _ = await asyncio.wait({ask}, timeout=_TICK)
                if done:
                    return ask.result()
                if nc.stats["reconnects"] != reconnects:
                    raise TimeoutError("the connection was replaced before the reply")
        finally:
            if not ask.done():
                ask.cancel()
                await asyncio.gather(ask, return_exceptions=True)

    async def _starving(self) -> bool:
        """Whether the consumer, idle (an idle heartbeat just came), left unread an
        output the stream held at the previous look-up, `_AUDIT_EVERY` seconds or more
        ago: its configuration was changed by another client of the account (a front
        end sharing the credential can learn its name from the shared inbox prefix and
        give it a filter that reads nothing, redteam18 F1). Counted and logged."""
        now = time.monotonic()
        if now < self._audit_at or self._last is None:
            return False
        self._audit_at = now + _AUDIT_EVERY
        try:
            reply = await self._ask(f"$JS.API.STREAM.INFO.{self._config.output_stream}", b"")
            last_seq = json.loads(reply.data)["state"]["last_seq"]
        except (NatsError, TimeoutError, ValueError, KeyError, TypeError):
            return False
        before, last = self._unread, self._last
        self._unread = last_seq if type(last_seq) is int and last_seq > last else None
        if before is None or last >= before:
            return False
        self._unread = None
        self._front._starved(before, last)
        return True

    async def _recreated(self) -> bool:
        """Whether the output stream is another one than when last asked (deleted and
        made again, e.g. by a worker repairing the deployment): its sequences start
        over. LookupError (KeyError) when it does not exist now."""
        reply = await self._ask(f"$JS.API.STREAM.INFO.{self._config.output_stream}", b"")
        info = json.loads(reply.data)
        created = info["created"]
        last = (info.get("state") or {}).get("last_seq")
        self._stream_last = last if type(last) is int else None
        before, self._created = self._created, created
        return before is not None and created != before

    async def _drop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(NatsError):
                await self._sub.unsubscribe()
            self._sub = None

    async def close(self) -> None:
        # Its consumer goes by itself 5 s after nobody reads it (`inactive_threshold`):
        # front ends are not allowed to delete consumers (one could delete another's).
        await self._drop()
        self._consumer = None

    async def _put(self, generation: int, msg: Msg) -> None:
        if generation != self._generation:
            return
        if _idle_heartbeat(msg):  # (the latest says all the earlier ones said)
            self._msgs.put_latest(msg, _idle_heartbeat)
        else:
            self._msgs.put(msg)

    async def _wait(self) -> Msg | None:
        return await self._msgs.get(_TICK)

    async def next(self) -> ResponseOutput | None:
        """The next valid output (waits for it, riding out server restarts); None once
        the connection is closed."""
        nc, front = self._nc, self._front
        passed = 0
        while True:
            msg = await self._wait()
            passed += 1
            if passed % _YIELD_EVERY == 0:
                # The queue hands out what it holds without yielding: a flood of
                # deliveries to skip (another consumer aimed at this inbox) held the
                # loop 488 ms (redteam14 D2).
                await asyncio.sleep(0)
            if msg is None:
                if nc.is_closed:
                    return None
                if (time.monotonic() - self._heard > _SILENCE
                        or nc.stats["reconnects"] != self._reconnects) and nc.is_connected:
                    await self._create()  # gone with the server, or stalled
                continue
            self._heard = time.monotonic()
            status = server_status(msg)
            if status is not None:
                headers = msg.headers
                assert headers is not None
                if status != "100":  # the consumer was deleted or went wrong
                    await self._create()
                elif msg.reply:  # flow control: everything before it was read
                    with contextlib.suppress(NatsError):
                        await nc.publish(msg.reply, b"")
                else:  # an idle heartbeat, naming the last consumer sequence sent
                    stalled = headers.get("Nats-Consumer-Stalled")
                    if stalled:
                        with contextlib.suppress(NatsError):
                            await nc.publish(stalled, b"")
                    if headers.get("Nats-Last-Consumer", str(self._next_cseq - 1)) != str(
                            self._next_cseq - 1):
                        await self._create()  # a message was lost on the way
                    elif not stalled and await self._starving():
                        await self._create()
                continue
            meta = ack_sequences(msg.reply)
            if meta is None:
                front._skipped("not a message of the output stream")
                continue
            stream_seq, consumer_seq, stored_ns = meta
            if ack_consumer(msg.reply) != self._delivered_by:
                # Another consumer delivering to this inbox (one any client of the
                # account can make): not this reader's outputs, whatever it sends.
                front._skipped("delivered by another consumer than the reader's")
                continue
            if consumer_seq != self._next_cseq:
                await self._create()  # a message was lost on the way: read it again
                continue
            self._next_cseq += 1
            if self._check:  # the last output read, again (`_make`)
                self._check = False
                if stream_seq == self._last and (msg.subject, msg.data) == self._last_msg:
                    continue
                # Another output holds its place (a store restored from an older copy)
                # or it is gone (trimmed): read what was stored after it instead.
                logger.warning("turnrouter: the output stream %s no longer holds the "
                               "last output read at sequence %s; reading the outputs "
                               "stored after it", self._config.output_stream, self._last)
                self._by_time = True
                await self._create()
                continue
            self._by_time = False
            self._last, self._last_msg, self._last_ns = stream_seq, (msg.subject, msg.data), (
                stored_ns)
            try:
                output = ResponseOutput.model_validate_json(msg.data)
            except (ValidationError, ValueError, RecursionError) as exc:
                front._skipped(f"{type(exc).__name__} on {msg.subject[:100]!r}")
                continue
            try:
                subject = self._config.output_subject(output.participant_id)
            except ContractValueError:
                subject = ""
            if msg.subject != subject:
                front._skipped("participant_id does not match the subject")
                continue
            if output.final and not self._finals.first(
                    (output.participant_id, output.request_id), stored_ns):
                front._repeated(output)
                continue
            return output


def _stamp(ns: int) -> str:
    """A JetStream time (RFC 3339 in UTC, nanoseconds) of `ns` since the epoch."""
    seconds, fraction = divmod(ns, _NS)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{fraction:09d}Z"


def _idle_heartbeat(msg: Msg) -> bool:
    """Whether `msg` is a consumer's idle heartbeat (status 100, no reply subject: a flow
    control request has one and must be answered, each of them)."""
    headers = msg.headers
    return headers is not None and headers.get("Status") == "100" and not msg.reply


class _SeenFinals:
    """The turns whose final output one reader yielded in the last `window_ns` of stream
    time, at most `MAX_SEEN_FINALS` of them (past that the oldest are forgotten: a
    repeat of those would be read again, never an answer dropped). Stream time, not
    the reader's: a reader catching up on an hour of outputs in a second must still
    read a request id reused after the input stream's deduplication window."""

    def __init__(self, window_ns: int) -> None:
        self._window = window_ns
        # A turn's hash (its ids' strings are not kept: ~100 bytes a turn) -> when its
        # final was stored; the hash is keyed per process, so no sender can aim at
        # another turn's (two of 65,536 turns colliding: about 1 in 2**32).
        self._at: dict[int, int] = {}
        self._order: collections.deque[tuple[int, int]] = collections.deque()

    def first(self, turn: tuple[str, str], stored_ns: int) -> bool:
        """Whether `turn`'s final stored at `stored_ns` is the first within the window."""
        at, order, key = self._at, self._order, hash(turn)
        while order and (stored_ns - order[0][0] > self._window
                         or len(order) >= MAX_SEEN_FINALS):
            when, old = order.popleft()
            if at.get(old) == when:
                del at[old]
        before = at.get(key)
        if before is not None and abs(stored_ns - before) <= self._window:
            return False
        at[key] = stored_ns
        order.append((stored_ns, key))
        return True


async def _deployment_exists(nc: Client, config: NatsConfig) -> bool:
    """Whether the output stream exists (a look-up a front end's permissions allow): the
    workers create it with the input stream. Only it: in a deployment whose front ends
    have an account of their own (`NatsConfig.front_api`), theirs holds a mirror of it,
    and the input stream is the workers' account's (inputs reach it by an import)."""
    try:
        await api_request(nc, f"$JS.API.STREAM.INFO.{config.output_stream}", wait=2.0)
    except TurnrouterError:
        return False
    return True


#: Bounds of `publish()`'s extra headers: a name's length, and all of them (names and
#: values) in bytes, within the 4 KiB a message's headers have beside its body.
MAX_HEADER_NAME = 256
MAX_EXTRA_HEADERS = 2048


#: Control characters past ASCII (C1) and the Unicode line and paragraph separators.
_CONTROL = re.compile("[\u0080-\u009f\u2028\u2029]")


def _validated(message: RuntimeMessage) -> RuntimeMessage:
    """`message`, validated again unless known valid (`VALIDATED`, as the in-process
    runtime's `publish` does): one from `model_construct()` or `model_copy(update=...)`,
    or changed since, could carry what every worker refuses (a text of None, an id of
    300 characters), and its turn would never end (redteam18 F5). `ContractTypeError`
    or `ContractValueError` naming the field, never its value."""
    if message in VALIDATED:
        return message
    name = type(message).__name__
    try:
        valid = type(message).model_validate(dict(message.__dict__))
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False, include_context=False)
        wrong_type = all(error["type"].endswith("_type") or error["type"] == "is_instance_of"
                         for error in errors)
        error_class = ContractTypeError if wrong_type else ContractValueError
        raise error_class(f"published {name} is invalid (built without validation?), "
                          f"nothing published: {describe(exc)}") from None
    except RecursionError:
        raise ContractValueError(f"published {name} is nested too deeply") from None
    VALIDATED.add(valid)
    return valid


def _check_headers(headers: Mapping[str, str]) -> None:
    """`ContractValueError` naming the first header NATS cannot carry as given, or one
    that belongs to the server (`Nats-*`); the value is never shown."""
    size = 0
    for key, value in headers.items():
        if not isinstance(key, str):
            raise ContractValueError(
                f"publish() header names are str, got {type(key).__name__} "
                f"{preview(key)}")
        if key[:5].lower() == "nats-":
            raise ContractValueError(
                f"publish() header {preview(key)}: Nats-* headers belong to the server "
                "and to this front end (its Nats-Msg-Id makes a retry run once); pass "
                "trace context and headers of your own only")
        if len(key) > MAX_HEADER_NAME or not HEADER_NAME.fullmatch(key):
            raise ContractValueError(
                f"publish() header {preview(key)} is not a header name: 1 to "
                f"{MAX_HEADER_NAME} letters, digits or !#$%&'*+-.^_`|~")
        try:
            encoded = value.encode("utf-8") if isinstance(value, str) else None
        except UnicodeEncodeError:  # a lone surrogate
            encoded = None
        if encoded is None or any(c < 32 or c == 127 for c in encoded) or (
                not value.isascii() and _CONTROL.search(value)):  # C1, line separators
            raise ContractValueError(
                f"publish() header {preview(key)}: its value must be a str of text "
                "without control characters")
        size += len(key) + len(encoded) + 4
    if size > MAX_EXTRA_HEADERS:
        raise ContractValueError(
            f"publish() headers are {size} bytes, over {MAX_EXTRA_HEADERS}: a message's "
            "headers have 4 KiB beside its body, trace context and its id included")
