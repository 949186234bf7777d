"""The mirror watch (`_mirror.py`) against any reply the server could send, or junk.

Every worker reads two STREAM.INFO replies a second and, on what they say, may delete
and create the front ends' mirror of the output stream. Whatever a reply holds (bytes
that are not JSON, JSON of another type at any field the watch reads, numbers past 2**64,
NaN, megabytes, deep nesting, missing fields, errors with odd codes), the watch goes on
without a traceback, deletes and creates nothing, never starts a mirror before sequence
1, past 2**64 - 1 or at a time the server's clock has not reached, and waits between
looks stay bounded. The decision is driven directly (`decide`), through `api_request`'s
parsing with a stand-in connection (`heal_mirror`), and through the loop itself
(`watch_mirror`); test_trust.py runs the watch against a real nats-server.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.errors import NoRespondersError

import nats
from turnrouter import LifecycleError, TurnrouterError
from turnrouter.runtime.nats import NatsConfig

# Private module: the watch's decision and its memory between looks.
from turnrouter.runtime.nats._mirror import (
    CLAIM_KEY,
    MirrorWatch,
    claim_restart,
    decide,
    heal_mirror,
    watch_mirror,
)
from turnrouter.runtime.nats._setup import api_request, ensure_deployment

from ..fuzz import ANY_TEXT, HUGE_TEXT
from .conftest import NatsServer
from .test_trust import DEPLOY, PASSWORDS

pytestmark = pytest.mark.anyio
NAME = "TURNROUTER_OUT"
CONFIG = NatsConfig()
MAX_SEQ = 2**64 - 1
FRONT_INFO = f"$JS.FRONT.API.STREAM.INFO.{NAME}"
SOURCE_INFO = f"$JS.API.STREAM.INFO.{NAME}"
NOT_FOUND = {"error": {"code": 404, "err_code": 10059, "description": "stream not found"}}


def mirror_reply(kind: str = "stalled") -> dict[str, Any]:
    """A STREAM.INFO reply of FRONT's mirror as nats-server 2.11+ writes it: stalled
    on "stream not found" for ten minutes (a restart from sequence 6 is due)."""
    return {
        "type": "io.nats.jetstream.api.v1.stream_info_response",
        "total": 0, "offset": 0, "limit": 0,
        "created": "2024-05-01T12:00:00.123456789Z",
        "ts": "2024-05-01T12:10:00.5Z",
        "config": {"name": NAME, "retention": "limits", "storage": "file",
                   "mirror": {"name": NAME, "opt_start_seq": 3,
                              "external": {"api": "$JS.TURNROUTER.API",
                                           "deliver": "turnrouter.mirror"}}},
        "state": {"messages": 3, "bytes": 300, "first_seq": 3,
                  "first_ts": "2024-05-01T12:00:30Z", "last_seq": 5,
                  "last_ts": "2024-05-01T12:01:00.25Z", "num_subjects": 1,
                  "consumer_count": 0},
        "mirror": {"name": NAME, "lag": 0, "active": -1,
                   **({"error": {"code": 404, "err_code": 10059,
                                 "description": "stream not found"}}
                      if kind == "stalled" else {})},
    }


def source_reply(kind: str = "stalled") -> dict[str, Any]:
    """The output stream's STREAM.INFO: in step with `mirror_reply` ("stalled": it
    holds up to 7, made before the mirror's last output) or made again since
    ("recreated": it holds 2 outputs, a restart from its start is due)."""
    recreated = kind == "recreated"
    return {
        "type": "io.nats.jetstream.api.v1.stream_info_response",
        "created": "2024-05-01T12:05:00Z" if recreated else "2024-05-01T11:00:00Z",
        "ts": "2024-05-01T12:10:00.6Z",
        "config": {"name": NAME, "subjects": ["turnrouter.out.*"]},
        "state": {"messages": 2 if recreated else 7, "bytes": 200, "first_seq": 1,
                  "first_ts": "2024-05-01T12:05:01Z", "last_seq": 2 if recreated else 7,
                  "last_ts": "2024-05-01T12:06:00Z", "consumer_count": 0},
    }


def test_the_sample_replies_call_for_restarts() -> None:
    """What the properties below spoil: a stalled mirror restarts after its last
    sequence, one out of step with a recreated stream from the outputs stored after its
    last one, and a missing one is made after what the stream holds."""
    assert decide(mirror_reply(), source_reply(), NAME).start == (6, None)
    assert decide(mirror_reply("recreated"), source_reply("recreated"), NAME).start == (
        1, "2024-05-01T12:01:00.25Z")
    missing = decide(None, source_reply(), NAME)
    assert (missing.action, missing.start) == ("missing", (8, None))
    assert decide(mirror_reply("recreated"), source_reply(), NAME).action == "well"


# ---------------------------------------------------------------- junk at every field
_JSON_LEAF = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
_JSON_SHALLOW = _JSON_LEAF | st.lists(_JSON_LEAF, max_size=4) | st.dictionaries(
    st.text(max_size=8), _JSON_LEAF, max_size=4)
#: JSON values two levels deep (deeper nesting: `JUNK_BYTES`).
JSON_JUNK = _JSON_SHALLOW | st.lists(_JSON_SHALLOW, max_size=4) | st.dictionaries(
    st.text(max_size=8), _JSON_SHALLOW, max_size=4)
NOT_INT = st.one_of(st.none(), st.booleans(), st.floats(), ANY_TEXT,
                    st.lists(st.integers(), max_size=3),
                    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
                    st.sampled_from(["5", "1e3", 5.0, 10059.0]))
#: Not a JetStream sequence: another type, negative, past 2**64 - 1.
BAD_SEQ = st.one_of(NOT_INT, st.integers(max_value=-1), st.integers(min_value=MAX_SEQ + 1),
                    st.sampled_from([-1, 2**64, 2**100, 10**4000]))
#: Not a time as the server writes it (RFC 3339, UTC, "Z", at most 9 fraction digits).
BAD_TIME = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), ANY_TEXT, HUGE_TEXT,
    st.lists(st.text(max_size=5), max_size=2),
    st.sampled_from([
        "", "Z", "T", "2024-05-01T12:00:00", "2024-05-01T12:00:00+00:00",
        "2024-05-01T12:00:00+05:00Z", "2024-05-01 12:00:00Z", "2024-13-01T00:00:00Z",
        "2024-02-30T00:00:00Z", "2024-05-01T25:00:00Z", "2024-05-01T12:00:00.Z",
        "2024-05-01T12:00:00.1234567891Z", "2024-05-01T12:00:00.-5Z",
        "2024-05-01T12:00:00._5Z", "2024-05-01T12:00:00.5.5Z", "0000-01-01T00:00:00Z",
        "\u0662\u0660\u0662\u0664-05-01T12:00:00Z", "2024-05-01T12:00:00.\u0665Z",
        "2024-05-01T12:00:00.5\ud800Z", "+2024-05-01T12:00:00Z", "2024-05-01t12:00:00z",
        "20240501T120000Z", "2024-W18-3T12:00:00Z", "2024-05-01T12:00Z",
    ]))
NOT_DICT = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), ANY_TEXT,
                     st.lists(JSON_JUNK, max_size=3))
NOT_TEXT = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                     st.lists(st.text(max_size=5), max_size=2),
                     st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2))
#: Every field the watch reads, and what is not of its type.
FIELDS: dict[tuple[str, ...], st.SearchStrategy[Any]] = {
    ("created",): BAD_TIME, ("ts",): BAD_TIME,
    ("config",): NOT_DICT, ("config", "mirror"): NOT_DICT,
    ("config", "mirror", "name"): NOT_TEXT, ("config", "mirror", "opt_start_seq"): BAD_SEQ,
    ("state",): NOT_DICT, ("state", "messages"): BAD_SEQ, ("state", "first_seq"): BAD_SEQ,
    ("state", "last_seq"): BAD_SEQ, ("state", "last_ts"): BAD_TIME,
    ("mirror",): NOT_DICT, ("mirror", "error"): NOT_DICT,
    ("mirror", "error", "err_code"): BAD_SEQ,
}


def spoiled(reply: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    """`reply` with `value` at `path` (objects on the way made where missing)."""
    reply = copy.deepcopy(reply)
    holder = reply
    for key in path[:-1]:
        holder = holder.setdefault(key, {})
    holder[path[-1]] = value
    return reply


def without(reply: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    reply = copy.deepcopy(reply)
    holder = reply
    for key in path[:-1]:
        holder = holder[key]
    holder.pop(path[-1], None)
    return reply


@st.composite
def spoiled_pairs(draw: st.DrawFn) -> tuple[Any, Any]:
    """A (mirror, source) pair that called for a restart or a make-again, with one
    field of one reply of the wrong type."""
    kind = draw(st.sampled_from(["stalled", "recreated", "missing"]))
    path = draw(st.sampled_from(sorted(FIELDS)))
    value = draw(FIELDS[path])
    mirror: Any = None if kind == "missing" else mirror_reply(kind)
    source: Any = source_reply("stalled" if kind == "missing" else kind)
    if mirror is None or draw(st.booleans()):
        return mirror, spoiled(source, path, value)
    return spoiled(mirror, path, value), source


@given(spoiled_pairs())
def test_a_wrong_type_at_any_field_read_restarts_nothing(pair: tuple[Any, Any]) -> None:
    """Any field the watch reads, in either reply, of another type than the server's
    (or a sequence out of 0..2**64 - 1, a time the server does not write): the look
    does nothing, where the same replies unspoiled restart or make the mirror."""
    look = decide(*pair, NAME)
    assert look.action == "unread", (look, pair)


REQUIRED = [("created",), ("ts",), ("state",), ("state", "messages"),
            ("state", "first_seq"), ("state", "last_seq"), ("state", "last_ts")]


@pytest.mark.parametrize("path", REQUIRED, ids="/".join)
@pytest.mark.parametrize("kind", ["stalled", "recreated"])
def test_a_missing_field_restarts_nothing(path: tuple[str, ...], kind: str) -> None:
    """A field every STREAM.INFO reply holds, missing from either: nothing done."""
    assert decide(without(mirror_reply(kind), path), source_reply(kind),
                  NAME).action == "unread"
    assert decide(mirror_reply(kind), without(source_reply(kind), path),
                  NAME).action == "unread"
    assert decide(None, without(source_reply(), path), NAME).action == "unread"


@pytest.mark.parametrize("reply", [None, 0, 1.5, "x", [], [1], True, float("nan")],
                         ids=repr)
def test_a_reply_that_is_no_object_does_nothing(reply: object) -> None:
    """A reply (as `api_request` passes it on: whatever JSON it was) that is no object."""
    assert decide(reply, source_reply(), NAME).action == ("missing" if reply is None
                                                          else "unread")
    assert decide(mirror_reply(), reply, NAME).action == ("absent" if reply is None
                                                          else "unread")


# ---------------------------------------------------------------- sound starts
MAX_SKEW = datetime.timedelta(seconds=60)


@st.composite
def stamps(draw: st.DrawFn) -> str:
    """A time as the server writes it, from year 1 (its zero time) to 9999."""
    when = draw(st.datetimes(min_value=datetime.datetime(1, 1, 1),
                             max_value=datetime.datetime(9999, 12, 31)))
    digits = draw(st.integers(0, 9))
    fraction = draw(st.integers(0, 10**digits - 1)) if digits else 0
    return when.replace(microsecond=0).isoformat() + (
        f".{fraction:0{digits}d}" if digits else "") + "Z"


def sometimes(valid: st.SearchStrategy[Any], junk: st.SearchStrategy[Any]
              ) -> st.SearchStrategy[Any]:
    return st.one_of(valid, valid, valid, junk)


SEQS = sometimes(st.one_of(st.integers(0, 10), st.integers(0, MAX_SEQ),
                           st.sampled_from([MAX_SEQ, MAX_SEQ - 1])), BAD_SEQ)
TIMES = sometimes(st.one_of(stamps(), st.sampled_from([
    "2024-05-01T12:00:00Z", "2024-05-01T12:10:00Z", "0001-01-01T00:00:00Z",
    "9999-12-31T23:59:59.999999999Z", "1970-01-01T00:00:00Z"])), BAD_TIME)


@st.composite
def replies(draw: st.DrawFn, mirror: bool) -> Any:
    """A STREAM.INFO reply whose every field read is drawn: mostly of its type, with
    any value (huge, zero, far past or future), sometimes junk, sometimes missing."""
    if draw(st.integers(0, 20)) == 0:
        return draw(JSON_JUNK)
    reply: dict[str, Any] = {}
    for path in sorted(FIELDS, key=len):
        if draw(st.integers(0, 15)) == 0:
            continue  # missing
        holder: Any = reply
        for key in path[:-1]:
            holder = holder.get(key) if isinstance(holder, dict) else None
        if not isinstance(holder, dict):
            continue
        last = path[-1]
        if last in ("config", "state", "mirror", "error"):
            holder[last] = draw(sometimes(st.just({}), NOT_DICT))
        elif last == "name":
            holder[last] = draw(sometimes(st.just(NAME), NOT_TEXT)) if mirror else "x"
        elif last == "err_code":
            holder[last] = draw(sometimes(st.sampled_from([10059, 10059, 0, 1]), BAD_SEQ))
        elif last in ("created", "ts", "last_ts"):
            holder[last] = draw(TIMES)
        else:
            holder[last] = draw(SEQS)
    return reply


def seconds(stamp: str) -> datetime.datetime:
    """A time as the server writes it (the test's own reading, to the microsecond)."""
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}"
                        r"(\.[0-9]{1,9})?Z", stamp, re.ASCII), stamp
    return datetime.datetime.fromisoformat(stamp)


@settings(max_examples=400)
@given(st.one_of(st.none(), replies(mirror=True)), st.one_of(st.none(), replies(False)))
def test_any_replies_decide_a_sound_start(mirror: Any, source: Any) -> None:
    """Any pair of replies: `decide` returns, and a mirror it makes or restarts starts
    at a sequence from 1 to 2**64 - 1, or at a time the server writes, from 1970 on and
    not after the server's clock when it answered (with a minute for a cluster's
    clocks): a start in the future would copy nothing for ever, and the watch would
    find that mirror well."""
    look = decide(mirror, source, NAME)
    assert look.action in ("absent", "unread", "missing", "well", "restart")
    if look.action not in ("missing", "restart"):
        return
    assert look.start is not None
    seq, since = look.start
    assert type(seq) is int and 1 <= seq <= MAX_SEQ
    if since is not None:
        assert look.action == "restart" and seq == 1
        assert since in (mirror["created"], mirror["state"]["last_ts"])
        assert datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC) <= seconds(since)
        assert seconds(since) <= seconds(mirror["ts"]) + MAX_SKEW


@pytest.mark.parametrize(("kind", "fields"), [
    # After the last sequence JetStream has.
    ("stalled", {("state", "last_seq"): MAX_SEQ}),
    ("stalled", {("config", "mirror", "opt_start_seq"): MAX_SEQ + 1}),
    # After the server's clock: would copy nothing for ever (and look well).
    ("recreated", {("state", "last_ts"): "9999-12-31T23:59:59Z"}),
    ("recreated", {("state", "last_ts"): "2024-05-01T12:11:00.6Z"}),
    ("recreated", {("state", "messages"): 0, ("created",): "2999-01-01T00:00:00Z"}),
    # Before 1970 (the server's zero time, with outputs held): everything again.
    ("recreated", {("state", "last_ts"): "0001-01-01T00:00:00Z"}),
    ("recreated", {("state", "last_ts"): "1969-12-31T23:59:59.999999999Z"}),
], ids=str)
def test_an_absurd_start_is_never_made(kind: str, fields: dict[tuple[str, ...], Any]
                                       ) -> None:
    """Replies of the right types whose restart would start past the last sequence
    JetStream has, after the server's clock, or before 1970: nothing done (a minute
    after the server's clock is still a start, for a cluster's clocks)."""
    mirror, source = mirror_reply(kind), source_reply(kind)
    for path, value in fields.items():
        mirror = spoiled(mirror, path, value)
        if path == ("state", "last_seq"):  # a source holding as much: in step
            source = spoiled(source, path, value)
    assert decide(mirror, source, NAME).action == "unread"
    assert decide(None, spoiled(source_reply(), ("state", "last_seq"), MAX_SEQ),
                  NAME).action == "unread"
    late = spoiled(mirror_reply(kind), ("state", "last_ts"), "2024-05-01T12:11:00.4Z")
    assert decide(late, source_reply(kind), NAME).action == "restart"


# ---------------------------------------------------------------- replies as bytes
class Server:
    """A stand-in connection: each subject answers with the next of its replies (the
    last one for ever), as bytes; anything else is answered `{}`. What was asked is
    kept in `asked`."""

    is_connected = True

    def __init__(self, replies: dict[str, list[Any]]) -> None:
        self.replies = replies
        self.asked: list[str] = []
        self.bodies: list[Any] = []
        #: Set at the third look at the mirror.
        self.thrice = asyncio.Event()

    async def request(self, subject: str, payload: bytes,
                      timeout: float) -> Any:  # noqa: ASYNC109 (nats-py's signature)
        self.asked.append(subject)
        self.bodies.append(json.loads(payload))
        if self.asked.count(FRONT_INFO) >= 3:
            self.thrice.set()
        queue = self.replies.get(subject, [{}])
        reply = queue.pop(0) if len(queue) > 1 else queue[0]
        if isinstance(reply, BaseException):
            raise reply
        data = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
        return type("Msg", (), {"data": data})()

    def changed(self) -> list[str]:
        """The DELETE and CREATE requests asked."""
        return [s for s in self.asked if ".STREAM.DELETE." in s or ".STREAM.CREATE." in s]


def client(server: Server) -> Client:
    return cast(Client, server)


JUNK_BYTES = st.one_of(
    st.binary(max_size=64), st.just(b""), st.just(b"\xff\xfe{"),
    st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"null", b"true", b"1e400",
                     b"18446744073709551616", b'"error"', b'"stream not found"', b"[]",
                     b'["error"]', b'{"error": null}', b'{"error": "x"}',
                     b'{"error": {"code": 404}}', b'{"error": {"code": 404.0, "err_code": '
                     b'10059.0}}', b'{"error": {"code": "404", "err_code": "10059"}}',
                     b'{"error": {"code": 404, "err_code": 10058}}',
                     b'{"error": {"code": 503, "err_code": 10059}}',
                     b'{"error": {"code": 200}}', b'{"error": {"err_code": 10059}}',
                     b'{"state": {"last_seq": NaN}}', b'{"state": {"last_seq": Infinity}}',
                     b'{"state": {"last_seq": 1e400}}', b'{"created": -Infinity}']),
    st.builds(lambda depth: b"[" * depth + b"]" * depth, st.sampled_from([900, 5_000, 100_000])),
    st.builds(lambda depth: b'{"k":' * depth + b"1" + b"}" * depth,
              st.sampled_from([900, 100_000])),
    st.builds(lambda size: b'{"state": {"last_ts": "' + b"9" * size + b'"}}',
              st.sampled_from([1_000_000, 4_000_000])),
    st.builds(lambda digits: b'{"state": {"last_seq": ' + b"9" * digits + b"}}",
              st.sampled_from([20, 4_300, 4_301, 100_000])),
    JSON_JUNK.map(lambda v: json.dumps(v).encode()),
    spoiled_pairs().map(lambda pair: json.dumps(
        pair[1] if pair[0] in (None, mirror_reply("stalled"), mirror_reply("recreated"))
        else pair[0]).encode()),
)


async def looks(server: Server, watch: MirrorWatch, count: int) -> list[object]:
    """`count` looks (`heal_mirror`), each's result or what it raised."""
    results: list[object] = []
    for _ in range(count):
        try:
            results.append(await heal_mirror(client(server), CONFIG, watch))
        except Exception as exc:  # what `watch_mirror` catches
            results.append(exc)
    return results


@contextlib.contextmanager
def logged() -> Iterator[list[logging.LogRecord]]:
    """The records the runtime's logger emits meanwhile."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    logger = logging.getLogger("turnrouter.runtime.nats")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def readable(records: list[logging.LogRecord]) -> None:
    """Log lines without a traceback, bounded, that a UTF-8 log file can hold."""
    for record in records:
        assert record.exc_info is None
        message = record.getMessage()
        assert len(message) <= 1_000, message[:200]
        message.encode("utf-8")


@settings(max_examples=150, deadline=None)
@given(JUNK_BYTES, st.sampled_from(["mirror", "source", "second mirror",
                                    "second source"]), st.sampled_from(["stalled",
                                                                        "recreated"]))
def test_junk_reply_bytes_delete_and_create_nothing(junk: bytes, where: str,
                                                    kind: str) -> None:
    """Junk bytes as the reply of either STREAM.INFO, at the first look or at the
    restart's second one, with the other replies those of a due restart: each look
    returns or raises an `Exception` (counted by the watch, which goes on), no DELETE
    or CREATE is sent, and what is logged is bounded and has no traceback."""
    mirror, source = mirror_reply(kind), source_reply(kind)
    first, second = (1, 2) if where.startswith("second") else (0, 1)
    replies: dict[str, list[Any]] = {FRONT_INFO: [mirror] * 3, SOURCE_INFO: [source] * 3}
    replies[FRONT_INFO if where.endswith("mirror") else SOURCE_INFO][first:second] = [junk]
    server = Server(replies)
    with logged() as records:
        results = asyncio.run(looks(server, MirrorWatch(patience=0.0, jitter=0.0), 1))
    assert server.changed() == [], (results, server.asked)
    assert all(r is None or isinstance(r, Exception) for r in results)
    readable(records)


@settings(max_examples=200, deadline=None)
@given(replies(mirror=True), replies(mirror=False))
def test_any_replies_restart_soundly_through_the_connection(mirror: Any,
                                                            source: Any) -> None:
    """Any pair of drawn replies, sent as JSON: whatever the look sends is one DELETE
    then one CREATE, or one CREATE, with a start `decide` finds sound, and logs stay
    bounded."""
    server = Server({FRONT_INFO: [mirror], SOURCE_INFO: [source]})
    with logged() as records:
        asyncio.run(looks(server, MirrorWatch(patience=0.0, jitter=0.0), 1))
    changed = [s.split(".")[-2] for s in server.changed()]
    assert changed in ([], ["CREATE"], ["DELETE", "CREATE"])
    if changed:
        assert decide(mirror, source, NAME).action == (
            "restart" if changed[0] == "DELETE" else "missing")
    readable(records)


async def test_a_stalled_mirror_is_restarted_through_the_connection() -> None:
    """The stand-in itself: the sample replies, as bytes, restart the mirror from the
    sequence after its last one, a missing mirror is made after what the stream holds
    (`api_request`'s 404 with "stream not found"), and a recreated stream's mirror
    copies the outputs stored after its last one."""
    for mirror, source, sent in [
            (mirror_reply(), source_reply(), {"opt_start_seq": 6}),
            (NOT_FOUND, source_reply(), {"opt_start_seq": 8}),
            (mirror_reply("recreated"), source_reply("recreated"),
             {"opt_start_time": "2024-05-01T12:01:00.25Z"})]:
        server = Server({FRONT_INFO: [mirror], SOURCE_INFO: [source]})
        await heal_mirror(client(server), CONFIG, MirrorWatch(patience=0.0, jitter=0.0))
        creates = [body["mirror"] for subject, body in zip(server.asked, server.bodies,
                                                           strict=True)
                   if ".STREAM.CREATE." in subject]
        assert len(creates) == 1
        assert {k: v for k, v in creates[0].items() if k.startswith("opt_")} == sent


@pytest.mark.parametrize("lost", [TimeoutError(), b"\xff", b'{"error": {"code": 500}}'],
                         ids=["timeout", "junk", "refused"])
async def test_a_restart_whose_delete_reply_is_lost_keeps_its_start(lost: object) -> None:
    """A restart's DELETE whose reply never came, was junk or an odd refusal (the
    server may have deleted the mirror all the same): the mirror found missing at the
    next look is made again at once from where the restart meant to start (6, after
    the stalled mirror's last sequence), not later from after what the output stream
    holds (8: outputs 6 and 7 would never reach the front ends)."""
    server = Server({FRONT_INFO: [mirror_reply(), mirror_reply(), NOT_FOUND],
                     SOURCE_INFO: [source_reply()],
                     f"$JS.FRONT.API.STREAM.DELETE.{NAME}": [lost]})
    watch = MirrorWatch(patience=60.0, jitter=0.0)
    watch.ripe(f"{mirror_reply()['created']}/6", -60.0)  # found due a minute ago
    results = await looks(server, watch, 2)
    assert isinstance(results[0], Exception)
    assert results[1] == 6
    creates = [body["mirror"] for subject, body in zip(server.asked, server.bodies,
                                                       strict=True)
               if ".STREAM.CREATE." in subject]
    assert [c.get("opt_start_seq") for c in creates] == [6]


# ---------------------------------------------------------------- the loop
FAILURES = st.one_of(
    st.builds(lambda: LifecycleError("x").with_traceback(None)),
    st.just(TimeoutError()), st.just(NoRespondersError()),
    st.builds(lambda: _caused(TimeoutError())), st.builds(lambda: _caused(NoRespondersError())),
    st.builds(ValueError, HUGE_TEXT), st.builds(RecursionError, ANY_TEXT),
    st.builds(KeyError, JSON_JUNK), st.builds(TypeError, st.just("\ud800" * 5000)),
)


def _caused(cause: Exception) -> LifecycleError:
    try:
        raise LifecycleError("JetStream API failed") from cause
    except LifecycleError as exc:
        return exc


@given(st.lists(st.one_of(st.none(), FAILURES), max_size=300))
def test_the_pause_between_looks_stays_bounded(outcomes: list[Exception | None]) -> None:
    """Any run of looks answered, unanswered, refused or failing on junk: every pause
    is at least half a look's and at most `_QUIET` (30 s) apart, and every failure
    logged is one bounded line without a traceback."""
    watch = MirrorWatch()
    with logged() as records:
        for outcome in outcomes:
            pause = 1.5
            if outcome is None:
                watch.unanswered = 0
            else:
                pause = watch.failed(outcome, pause, NAME)
            assert 0.5 <= pause <= 30.0
    assert len(records) <= 3 + len(outcomes) // 10
    for record in records:
        assert record.exc_info is None
        assert len(record.getMessage()) <= 500


async def test_the_watch_goes_on_through_junk_replies() -> None:
    """The loop itself, fed junk for a few looks (about one a second): still running,
    nothing deleted or created, one line logged without a traceback."""
    server = Server({FRONT_INFO: [b"\xff" * 100], SOURCE_INFO: [b"[" * 100_000]})
    with logged() as records:
        task = asyncio.create_task(watch_mirror(client(server), CONFIG))
        try:
            async with asyncio.timeout(10):
                await server.thrice.wait()
            assert not task.done()
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    assert server.changed() == []
    readable(records)
    assert [r.getMessage()[:49] for r in records] == [
        "turnrouter: looking at the front ends' mirror of "]


class Held(Server):
    """A stand-in whose replies to `held` wait for `release` (`arrived` is set when the
    request came)."""

    def __init__(self, replies: dict[str, list[Any]], held: str) -> None:
        super().__init__(replies)
        self.held, self.arrived, self.release = held, asyncio.Event(), asyncio.Event()

    async def request(self, subject: str, payload: bytes,
                      timeout: float) -> Any:  # noqa: ASYNC109 (nats-py's signature)
        if subject == self.held:
            self.arrived.set()
            async with asyncio.timeout(10):
                await self.release.wait()
        return await super().request(subject, payload, timeout)


@pytest.mark.parametrize("create", [{}, {"error": {"code": 500, "description": "no"}}],
                         ids=["made", "refused"])
async def test_a_worker_stopping_during_a_restart_makes_the_mirror_before_it_ends(
        create: dict[str, Any]) -> None:
    """The watch cancelled (the worker stops) while a restart's DELETE is on its way:
    the restart runs to its end, its CREATE sent from where it meant to start (6, after
    the stalled mirror's last sequence), and only then does the cancellation end the
    look. A refused CREATE is logged, one line, and never left unretrieved. Before, a
    stop during the DELETE sent no CREATE: another worker made the mirror 2 s later,
    after the output stream's last output (outputs 6 and 7 never reached front ends)."""
    delete = f"$JS.FRONT.API.STREAM.DELETE.{NAME}"
    server = Held({FRONT_INFO: [mirror_reply()], SOURCE_INFO: [source_reply()],
                   f"$JS.FRONT.API.STREAM.CREATE.{NAME}": [create]}, delete)
    watch = MirrorWatch(patience=60.0, jitter=0.0)
    watch.ripe(f"{mirror_reply()['created']}/6", -60.0)  # found due a minute ago
    with logged() as records:
        look = asyncio.create_task(heal_mirror(client(server), CONFIG, watch))
        async with asyncio.timeout(10):
            await server.arrived.wait()
        look.cancel()  # reaches the look first: its DELETE waits for the release
        server.release.set()
        with pytest.raises(asyncio.CancelledError):
            async with asyncio.timeout(10):
                await look
    creates = [body["mirror"] for subject, body in zip(server.asked, server.bodies,
                                                       strict=True)
               if ".STREAM.CREATE." in subject]
    assert [c.get("opt_start_seq") for c in creates] == [6]
    readable(records)
    if create:
        assert any("creating the front ends' mirror" in r.getMessage() for r in records)


@settings(max_examples=150, deadline=None)
@given(JUNK_BYTES)
def test_a_jetstream_api_reply_of_junk_is_a_value_error_or_a_refusal(junk: bytes) -> None:
    """Whatever bytes the JetStream API answers, `api_request` returns a JSON object or
    raises what its callers handle: `ValueError` (junk, JSON that is no object, nested
    too deep), `LifecycleError` (unavailable) or a refusal (a `TurnrouterError`), but
    never a `TypeError` or a `RecursionError` past its callers' `except` clauses."""
    server = Server({"$JS.API.STREAM.INFO.X": [junk]})
    try:
        reply = asyncio.run(api_request(client(server), "$JS.API.STREAM.INFO.X"))
    except (ValueError, TurnrouterError):
        return
    assert isinstance(reply, dict) and "error" not in reply


# ------------------------------------------------- two workers, one stall (real server)
async def _worker_connection(url: str) -> Client:
    return await nats.connect(url, user="worker",
                              password=PASSWORDS["TURNROUTER_WORKER_PASSWORD"],
                              inbox_prefix="_INBOX_turnrouter_worker")


async def _out_of_step(nc: Client, config: NatsConfig) -> None:
    """FRONT's mirror holding five outputs of an output stream since deleted and made
    again with one: a restart is due at once (out of step: no error, no patience)."""
    js = nc.jetstream()
    for k in range(5):
        await js.publish("turnrouter.out.x", f"{k}".encode(), stream=NAME)
    deadline = asyncio.get_running_loop().time() + 20
    while json.loads((await nc.request(FRONT_INFO, b"", timeout=5)).data).get(
            "state", {}).get("last_seq") != 5:
        assert asyncio.get_running_loop().time() < deadline, "mirror never held 5"
        await asyncio.sleep(0.05)
    await api_request(nc, f"$JS.API.STREAM.DELETE.{NAME}")
    await ensure_deployment(nc, config)
    await js.publish("turnrouter.out.x", b"new", stream=NAME)


async def test_two_workers_finding_one_stall_restart_the_mirror_once() -> None:
    """Two workers whose restarts of the same out-of-step mirror come due together, with
    no patience and no random wait (the race the second look cannot close: both look
    again before either deletes), restart it once. The claim in the state bucket lets
    one through; before it, both deleted and created, and readers of the first new
    mirror lost what they had not read of it."""
    server = NatsServer(config=DEPLOY / "nats-server.conf", env=PASSWORDS)
    config = NatsConfig(url=server.url, front_api="$JS.FRONT.API")
    first = second = None
    try:
        first, second = await _worker_connection(server.url), await _worker_connection(server.url)
        kv = (await ensure_deployment(first, config)).bucket
        await _out_of_step(first, config)
        stalled = json.loads((await first.request(FRONT_INFO, b"", timeout=5)).data)
        kvs = (kv, await second.jetstream().key_value(config.bucket))

        def claim(k: int) -> Callable[[str], Awaitable[bool]]:
            return lambda stall: claim_restart(kvs[k], stall)

        async with asyncio.timeout(30):
            starts = await asyncio.gather(*(
                heal_mirror(nc, config, MirrorWatch(patience=0.0, jitter=0.0), claim(k))
                for k, nc in enumerate((first, second))))
        assert sorted(start is None for start in starts) == [False, True], starts
        restarted = json.loads((await first.request(FRONT_INFO, b"", timeout=5)).data)
        assert restarted["created"] != stalled["created"]
        # The loser, looking again, finds the new mirror well: nothing more to do.
        again = MirrorWatch(patience=0.0, jitter=0.0)
        assert await heal_mirror(second, config, again, claim(1)) is None
        after = json.loads((await first.request(FRONT_INFO, b"", timeout=5)).data)
        assert after["created"] == restarted["created"]
    finally:
        for nc in (first, second):
            if nc is not None:
                await nc.close()
        server.close()


async def test_a_restart_claim_is_taken_once_per_stall_and_again_when_stale() -> None:
    """`claim_restart` on a real state bucket: the first claim of a stall wins, a second
    of the same stall loses while the first is younger than 30 s, a claim of another
    stall, an old claim (its worker died before restarting) and junk under the key are
    taken over."""
    server = NatsServer(config=DEPLOY / "nats-server.conf", env=PASSWORDS)
    nc = None
    try:
        nc = await _worker_connection(server.url)
        kv = (await ensure_deployment(nc, NatsConfig(url=server.url))).bucket
        assert await claim_restart(kv, "A/1/None")
        assert not await claim_restart(kv, "A/1/None")
        assert await claim_restart(kv, "B/1/None")
        await kv.put(CLAIM_KEY, json.dumps({"stall": "B/1/None",
                                            "at": time.time() - 31}).encode())
        assert await claim_restart(kv, "B/1/None")
        for junk in (b"", b"\xff", b"[]", b'{"stall": 1, "at": 2}', b'{"at": NaN}',
                     b"x" * 5000):
            await kv.put(CLAIM_KEY, junk)
            assert await claim_restart(kv, "C/1/None"), junk
        await kv.delete(CLAIM_KEY)
        assert await claim_restart(kv, "C/1/None")
    finally:
        if nc is not None:
            await nc.close()
        server.close()
