"""The worker's hot path to the server: lean requests and stored publishes.

nats-py's `request()` and `JetStreamContext.publish()` cost a task-less `wait_for`, a
fresh inbox token and a parsed `PubAck` per call. A turn needs one request (its record
write) and one stored publish (its answer), so the worker keeps one wildcard reply
subscription: a request is a publish with a reply token and a future; the answer's
publish does not wait at all, and its acknowledgment is read off the turn's path (to
count duplicates the output stream dropped and to log a refused publish).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections import deque
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from ..._limits import is_logged

__all__ = ["Link", "RequestFailed", "deliver_directly", "pub_ack"]

logger = logging.getLogger("turnrouter.runtime.nats")

_STORED = "s"  # reply token of the stored publishes whose acknowledgment nobody awaits


class RequestFailed(Exception):
    """A request got no reply in time, or the connection refused it."""


class Replaced(RequestFailed):
    """The connection was replaced before the reply came (a server back from a crash
    or a freeze forgot the request): the server answers again, so asking again needs
    no pause."""


class NoResponders(RequestFailed):
    """Nothing answered the request (status 503): no stream takes its subject, so
    nothing was stored (unlike a request without a reply, which may have been)."""


class Link:
    """Requests and stored publishes over one connection and one reply subscription."""

    def __init__(self, nc: Client, on_duplicate: Callable[[], None],
                 on_no_responders: Callable[[], None] = lambda: None) -> None:
        self._nc = nc
        #: Called when a request or stored publish found no responder: its stream (the
        #: bucket's, the output stream) is gone, or JetStream is not answering.
        self._on_no_responders = on_no_responders
        self._refusals = 0
        self._prefix = nc.new_inbox()
        self._waiting: dict[str, asyncio.Future[bytes]] = {}
        self._next = 0
        self._on_duplicate = on_duplicate
        self._stored_reply = f"{self._prefix}.{_STORED}"
        #: Callbacks of stored publishes awaiting their acknowledgment, by reply token
        #: (bounded: dropped at each reconnect, when their owners publish again).
        self._confirming: dict[str, Callable[[], None]] = {}
        #: The waits of requests, in the order of their ends (loop time), for one timer
        #: to end those past their time: no timer per request (a worker sends one per
        #: turn). A request whose end comes before the last one queued (a shorter
        #: `wait`) gets a timer of its own.
        self._ends: deque[tuple[float, asyncio.Future[bytes]]] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    @property
    def max_payload(self) -> int:
        """The most bytes, headers included, the server takes in one message (its
        `max_payload`, 1 MiB by default): it closes the connection of a client past it."""
        return self._nc.max_payload

    @property
    def waiting(self) -> int:
        """Requests waiting for their reply (each ends by it or by its own wait)."""
        return len(self._waiting)

    async def start(self) -> None:
        sub = await self._nc.subscribe(f"{self._prefix}.*", cb=self._on_reply)
        deliver_directly(sub, self._take_reply)

    async def request(self, subject: str, payload: bytes,
                      headers: dict[str, str] | None = None, wait: float = 5.0) -> bytes:
        """Publish with a reply token and wait up to `wait` seconds for the reply's body
        (`RequestFailed` without a reply in time, no responders, or a closed
        connection)."""
        self._next += 1
        token = str(self._next)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bytes] = loop.create_future()
        self._waiting[token] = future
        end = loop.time() + wait
        ends = self._ends
        while ends and ends[0][1].done():  # answered: nothing to end
            ends.popleft()
        timer = None
        if not ends or ends[-1][0] <= end:
            ends.append((end, future))
            first = ends[0][0]
            if self._timer is None or self._timer_at > first:
                if self._timer is not None:  # armed for waits answered since
                    self._timer.cancel()
                self._timer_at = first
                self._timer = loop.call_at(first, self._expire_due)
        else:
            timer = loop.call_at(end, _expire, future)
        try:
            await self._nc.publish(subject, payload, reply=f"{self._prefix}.{token}",
                                   headers=headers)
            return await future
        except NatsError as exc:
            raise RequestFailed(repr(exc)) from exc
        finally:
            if timer is not None:
                timer.cancel()
            del self._waiting[token]

    def _expire_due(self) -> None:
        """The requests' timer: end the waits past their time (`RequestFailed`), then
        arm it for the first wait still running, if any."""
        ends = self._ends
        now = max(self._timer_at, asyncio.get_running_loop().time())
        while ends and (ends[0][0] <= now or ends[0][1].done()):
            _expire(ends.popleft()[1])
        if ends:
            self._timer_at = ends[0][0]
            self._timer = ends[0][1].get_loop().call_at(self._timer_at, self._expire_due)
        else:
            self._timer = None

    async def send(self, subject: str, payload: bytes) -> None:
        """A plain publish (an acknowledgment); a closed connection is ignored (the
        message comes back to whoever owns its partition then)."""
        try:  # noqa: SIM105 (no context manager: every input's acknowledgment comes here)
            await self._nc.publish(subject, payload)
        except NatsError:
            pass

    async def publish_stored(self, subject: str, payload: bytes, headers: dict[str, str],
                             confirmed: Callable[[], None] | None = None) -> None:
        """Publish to a stream without waiting for its acknowledgment; a duplicate the
        stream dropped is counted and a refusal logged when the acknowledgment comes.
        `confirmed` is called once the stream acknowledged it (stored or a duplicate of
        a stored one); never when the acknowledgment is lost (`forget_unconfirmed`)."""
        reply = self._stored_reply
        if confirmed is not None:
            self._next += 1
            token = f"{_STORED}{self._next}"
            self._confirming[token] = confirmed
            reply = f"{self._prefix}.{token}"
        try:
            await self._nc.publish(subject, payload, reply=reply, headers=headers)
        except NatsError as exc:
            logger.warning("turnrouter: output not published: %r", exc)

    def no_responders(self) -> None:
        """Something else found no stream answering (a read of the bucket, say)."""
        self._on_no_responders()

    def fail_waiting(self) -> None:
        """After a reconnect: the replies of requests sent before it never come (a
        restarted server forgot them), so their waits end now (`RequestFailed`)."""
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(Replaced("connection lost before the reply"))

    def forget_unconfirmed(self) -> int:
        """Drop the callbacks of publishes not acknowledged yet (after a reconnect their
        acknowledgment never comes: their owners publish again); how many."""
        count = len(self._confirming)
        self._confirming.clear()
        return count

    def mark(self) -> int:
        """A mark of the stored publishes sent so far, for `forget_before`."""
        return self._next

    def forget_before(self, mark: int) -> int:
        """Drop the callbacks of stored publishes sent before `mark` and still not
        acknowledged (a publish the server dropped, for the user's permissions say, is
        never acknowledged: its owner publishes it again, `resend`); how many."""
        stale = []
        for token in self._confirming:  # in the order sent: the oldest lead
            if int(token[1:]) > mark:
                break
            stale.append(token)
        for token in stale:
            del self._confirming[token]
        return len(stale)

    async def _on_reply(self, msg: Msg) -> None:
        self._take_reply(msg)

    def _take_reply(self, msg: Msg) -> None:
        token = msg.subject[len(self._prefix) + 1:]
        status = msg.headers.get("Status") if msg.headers else None
        if status == "503":
            self._on_no_responders()
        if token[:1] == _STORED:
            confirmed = self._confirming.pop(token, None) if len(token) > 1 else None
            if self._stored_ack(msg.data, status) and confirmed is not None:
                confirmed()
            return
        future = self._waiting.get(token)
        if future is None or future.done():
            return
        if status == "503":
            future.set_exception(NoResponders("no responders (is its stream there?)"))
        else:
            future.set_result(msg.data)

    def _stored_ack(self, data: bytes, status: str | None) -> bool:
        """Whether the stream holds the output (stored now or before); a refusal is
        logged the first time and at every power of ten."""
        if b'"duplicate":true' in data:
            self._on_duplicate()
            return True
        if status is None and data and b'"error"' not in data:
            return True
        self._refusals += 1
        if is_logged(self._refusals):
            why = data[:300].decode("utf-8", "replace") or (
                "no responders (is the output stream there?)" if status == "503"
                else f"status {status}")
            logger.warning("turnrouter: the output stream refused an output (%d so far): "
                           "%s", self._refusals, why)
        return False


class _Direct:
    """Stands in for a nats-py subscription's message queue: each message goes to a
    plain function as nats-py parses it (`deliver_directly`)."""

    __slots__ = ("_deliver", "_sub")

    def __init__(self, sub: Any, deliver: Callable[[Msg], None]) -> None:
        self._sub, self._deliver = sub, deliver

    def put_nowait(self, msg: Msg) -> None:
        self._sub._pending_size -= len(msg.data)  # (nats-py counted it as queued)
        try:
            self._deliver(msg)
        except Exception as exc:  # as nats-py's own task does: logged, never raised
            logger.error("turnrouter: a subscription's handler failed: %r", exc)

    def empty(self) -> bool:
        return True

    def full(self) -> bool:
        return False

    def qsize(self) -> int:
        return 0

    def task_done(self) -> None:
        return None

    async def join(self) -> None:
        return None


def deliver_directly(sub: Any, deliver: Callable[[Msg], None]) -> bool:
    """Have nats-py hand `sub`'s messages to `deliver` (a plain function, quick, that
    never waits) as it reads them, instead of queueing each for the subscription's own
    task, which then awaits the callback: a queue put and get, a task step and a
    coroutine per message, on the three messages of every turn (the input, the record
    write's reply, the answer's acknowledgment). The order is the same (nats-py's
    reading order). Left alone (False: the callback it was made with is used) when
    nats-py keeps its queue otherwise (another version), or something is queued."""
    queue = getattr(sub, "_pending_queue", None)
    task = getattr(sub, "_wait_for_msgs_task", None)
    if not (isinstance(queue, asyncio.Queue) and queue.empty()
            and isinstance(task, asyncio.Task) and isinstance(
                getattr(sub, "_pending_size", None), int)):
        return False
    sub._pending_queue = _Direct(sub, deliver)
    task.cancel()
    return True


def _expire(future: asyncio.Future[bytes]) -> None:
    if not future.done():
        future.set_exception(RequestFailed("no reply in time"))


#: The usual form of a successful acknowledgment, read without the JSON parser (a
#: worker reads one per turn); anything else goes through it.
_NAME = rb'"[\x20\x21\x23-\x5b\x5d-\x7e]{0,256}"'  # printable ASCII, no quote or escape
_PLAIN_ACK = re.compile(rb'\{"stream":' + _NAME + rb',"seq":(0|[1-9][0-9]{0,17})'
                        rb'(?:,"domain":' + _NAME + rb')?(?:,"duplicate":true)?\}')


def pub_ack(data: bytes) -> tuple[int | None, Any]:
    """A JetStream publish acknowledgment: `(seq, None)` for `{"stream":..., "seq":...}`,
    `(None, error)` for `{"error": ...}`; ValueError naming the problem otherwise."""
    plain = _PLAIN_ACK.fullmatch(data)
    if plain is not None:
        return int(plain[1]), None
    try:
        reply = json.loads(data)
    except RecursionError as exc:
        raise ValueError("publish acknowledgment nested too deeply") from exc
    if isinstance(reply, dict):
        error = reply.get("error")
        if error is not None:
            return None, error
        seq = reply.get("seq")
        if isinstance(seq, int) and not isinstance(seq, bool) and seq >= 0:
            return seq, None
    raise ValueError(f"not a publish acknowledgment: {data[:200]!r}")
