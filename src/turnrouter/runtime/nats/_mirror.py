"""Keeping the front ends' account's mirror of the output stream in step with it.

The server keeps a mirror in step by itself, except in two cases it does not recover
from quickly:

- the mirror asked for its source while the source was missing (a server restart that
  restored the front ends' account before the workers', or the output stream deleted):
  the server records "stream not found" (10059) and asks again only after 2 s plus 10 s
  per failure so far, and no create or update of the mirror makes it ask sooner;
- the output stream was deleted and made again (a worker repairing the deployment): its
  sequences start over, while the mirror asks for the sequence after its last one, so
  the new stream's outputs up to that sequence never reach the front ends.

Every worker looks at the mirror about once a second (`watch_mirror`) and, in either
case, with its own output stream there, restarts it: a delete and a create. A mirror
in step with the output stream (the first case) is created to go on from the sequence
after its last one (`opt_start_seq`), so the sequences stay those of the output stream
and a front end's reader resuming after its last sequence neither misses nor repeats an
output; one out of step (the second case) is created to copy the outputs the stream
stored after the mirror's last one (`opt_start_time`): all of a stream made again, and
only the new ones of a stream whose last outputs a crash lost (its sequences then come
again, with other outputs), so no reader hears again what it heard. The front ends'
consumers of the mirror go with it: `NatsFrontEnd.outputs()` notices within about
1.5 s (no heartbeat) and reads the new mirror from its start, which holds only what it
had not read yet.

A worker restarts the mirror only once it found it so at looks `_PATIENCE` seconds
apart: front ends back from the same outage resume reading meanwhile, and what a reader
had not read of the mirror when it is deleted is gone for that reader. The patience
doubles with each restart until the mirror is found well again (up to about 4 min), so
a stall a restart does not cure is not restarted every few seconds.

A delete is always followed by a create, tried again at the next looks when it fails
(a delete and its create run to their end even when the watch is cancelled meanwhile,
and the create is sent again when the delete's reply was lost);
a mirror found missing for `_PATIENCE` seconds is made again from the sequence after
the output stream's last one.

Only replies as the server writes them are acted on (`read_info`): a reply with a field
missing or of another type, a sequence past 2**64 - 1, or a start time before 1970 or
after the server's clock (`_SKEW`) is a look that does nothing (`decide`'s "unread"),
as is any error but the server's 404 "stream not found"; what the watch logs of a reply
is numbers and times it read.

Several workers may find the same stall at once: each waits a random moment and looks
again before it deletes, and does nothing when the mirror changed meanwhile (another
worker restarted it). Then, before it deletes, it claims the stall in the state bucket
(`claim_restart`: the key `mirror.restart`, written revision-checked, so of the workers
that passed the second look together exactly one wins); the others leave it. Without
the claim, a second restart would delete the mirror the first one had just made, and
its readers would lose what they had not read of it. A claim whose worker died before
restarting is taken again after `_CLAIM_SECS`. A mirror younger than `_YOUNG` seconds
is not restarted for an error.

Each worker's look is two STREAM.INFO requests a second (one every 30 s where nothing
answers for the front ends' account).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import logging
import random
import re
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Literal

from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from ..._exceptions import LifecycleError
from ..._limits import is_logged
from ._setup import FRONT_API, _output_mirror, _Refused, api_request
from ._wire import NatsConfig

__all__ = ["Look", "MirrorWatch", "StreamInfo", "claim_restart", "decide", "heal_mirror",
           "read_info", "restart_from", "watch_mirror"]

logger = logging.getLogger("turnrouter.runtime.nats")

_WATCH = 1.0  # seconds between two looks at the mirror (jittered by half)
_QUIET = 30.0  # seconds between looks where nothing answers (no front ends' account)
_JITTER = 0.3  # at most this random wait before a restart's second look
_YOUNG = 5.0  # seconds: a mirror this young is not restarted for an error
_PATIENCE = 2.0  # seconds between the first look that found a restart due and the restart
_MAX_DOUBLINGS = 7  # of the patience after restarts (2 s to 256 s), and of unanswered pauses
#: The state bucket's key a worker claims a restart under, and how long a claim holds
#: (a worker that died between its claim and its restart leaves the stall to others).
CLAIM_KEY = "mirror.restart"
_CLAIM_SECS = 30.0
#: JetStream's "stream not found".
_NOT_FOUND = 10059
#: The last sequence a JetStream stream can have (an unsigned 64-bit integer).
_MAX_SEQ = 2**64 - 1
#: Seconds a mirror's start time may lie after the server's clock when it answered (the
#: clocks of a cluster's servers).
_SKEW = 60.0
#: A time as the server writes it: RFC 3339 in UTC, up to nanoseconds.
_TIME = re.compile(r"([0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2})"
                   r"(?:\.([0-9]{1,9}))?Z")
_NS = 1_000_000_000
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


#: Where a mirror starts: a sequence of the output stream (1: its start), or, with a
#: time, the outputs stored from that time on.
_Start = tuple[int, str | None]


class MirrorWatch:
    """What one worker's watch remembers between looks.

    Args:
        patience: seconds between the first look that found a restart due and the
            restart (`_PATIENCE`; doubled per restart).
        jitter: at most this random wait before a restart's second look (`_JITTER`).
    """

    def __init__(self, patience: float = _PATIENCE, jitter: float = _JITTER) -> None:
        self.patience, self.jitter = patience, jitter
        #: The restart found due (by the mirror's creation and where it would start),
        #: and when it was first found so.
        self.due: tuple[str, float] | None = None
        #: Where the mirror this worker deleted (or sent a delete for) should start,
        #: while its create has not succeeded (made again at the next looks).
        self.pending: _Start | None = None
        #: Restarts since the mirror was last found well: each doubles the patience.
        self.restarts = 0
        #: Looks in a row that got no reply (each doubles the pause, up to `_QUIET`),
        #: and looks that failed otherwise (logged at the 1st, 10th, 100th...).
        self.unanswered = self.failures = 0

    def ripe(self, key: str, now: float) -> bool:
        """Whether the restart `key` was found due at looks far enough apart
        (`patience`, doubled per restart since the mirror was last well)."""
        if self.due is None or self.due[0] != key:
            self.due = (key, now)
        patience: float = self.patience * 2.0 ** min(self.restarts, _MAX_DOUBLINGS)
        return now - self.due[1] >= patience

    def failed(self, exc: Exception, pause: float, name: str) -> float:
        """The pause before the next look after one that raised `exc` (instead of
        `pause`): `_QUIET` where nothing answers, doubled per look in a row without a
        reply (up to `_QUIET`); any other failure is counted and logged (bounded)."""
        # `api_request` says LifecycleError for what nats-py raised.
        cause = exc.__cause__ if isinstance(exc, LifecycleError) else exc
        if isinstance(cause, NoRespondersError):
            return _QUIET
        if isinstance(cause, TimeoutError):
            self.unanswered = min(self.unanswered + 1, _MAX_DOUBLINGS)
            return min(_QUIET, pause * 2.0 ** self.unanswered)
        self.failures += 1  # the watch goes on whatever a reply holds
        if is_logged(self.failures):
            logger.warning("turnrouter: looking at the front ends' mirror of %s failed "
                           "(%d so far): %s", name, self.failures, str(exc)[:300])
        return pause


#: Whether this worker may restart the mirror for a stall (`claim_restart`).
Claim = Callable[[str], Awaitable[bool]]


async def claim_restart(kv: Any, stall: str) -> bool:
    """Whether this worker restarts the mirror for `stall` (the stalled mirror's
    creation time and the restart's start): True when it wrote the claim under
    `CLAIM_KEY` of the state bucket `kv` (nats-py's `KeyValue`), checked against the
    revision it read, so of the workers that found the same stall at once one wins.
    False when another worker's claim of the same stall is younger than `_CLAIM_SECS`
    or its write came first. A value of junk under the key is written over."""
    try:
        entry = await kv.get(CLAIM_KEY)
    except KeyNotFoundError:  # (never claimed, or deleted: `create` takes both)
        entry = None
    now = time.time()
    if entry is not None:
        held = _claim_of(entry.value)
        if held is not None and held[0] == stall and abs(now - held[1]) < _CLAIM_SECS:
            return False
    value = json.dumps({"stall": stall[:500], "at": now}).encode()
    try:
        if entry is None:
            await kv.create(CLAIM_KEY, value)
        else:
            await kv.update(CLAIM_KEY, value, last=entry.revision)
    except KeyWrongLastSequenceError:
        return False  # another worker's claim came first
    return True


def _claim_of(value: object) -> tuple[str, float] | None:
    """The stall and time of a claim's value, None when it is not one."""
    if not isinstance(value, bytes | bytearray) or len(value) > 2048:
        return None
    try:
        claim = json.loads(value)
    except ValueError:
        return None
    if not isinstance(claim, dict):
        return None
    stall, at = claim.get("stall"), claim.get("at")
    if not isinstance(stall, str) or not isinstance(at, int | float) or at != at:
        return None
    return stall, float(at)


async def watch_mirror(nc: Client, config: NatsConfig, kv: Any = None) -> None:
    """Look at the mirror about every `_WATCH` seconds for ever (cancel to stop), and
    restart it when it stalled or fell out of step (`heal_mirror`), claiming each
    restart in the state bucket `kv` first (`claim_restart`; None: no claim, for a
    lone watcher). Where nothing answers (a deployment of one account) it looks again
    only every `_QUIET` seconds; unanswered looks (the subject refused by this user's
    permissions, a server away) space the next ones out, doubling up to `_QUIET`."""
    watch = MirrorWatch()

    async def claim(stall: str) -> bool:
        return await claim_restart(kv, stall)

    while True:
        pause = _WATCH * random.uniform(0.5, 1.5)
        if nc.is_connected:
            try:
                await heal_mirror(nc, config, watch, None if kv is None else claim)
            except Exception as exc:  # (nats-py, a refusal, a reply of junk)
                pause = watch.failed(exc, pause, config.output_stream)
            else:
                watch.unanswered = 0
        await asyncio.sleep(pause)


@dataclasses.dataclass(frozen=True)
class StreamInfo:
    """What the watch reads of a STREAM.INFO reply (`read_info`), each field of the
    type and in the range the server writes it."""

    #: When the stream was made, as the server wrote it, and in ns since the epoch.
    created: str
    created_ns: int
    #: The server's clock when it answered (ns since the epoch).
    ts_ns: int
    #: `state`: messages held, first and last sequence, and when the last one was
    #: stored (the server's zero time, year 1, when it holds none), also in ns.
    messages: int
    first_seq: int
    last_seq: int
    last_ts: str
    last_ns: int
    #: `config.mirror`: the stream it mirrors ("" when none) and the sequence it was
    #: made to start from (0 when none was given).
    mirror_of: str
    opt_start_seq: int
    #: `mirror.error.err_code`: why the mirror stalled (0 when it did not).
    err_code: int


def read_info(reply: object) -> StreamInfo | None:
    """The fields the watch reads of a STREAM.INFO reply, None when any is missing or
    not as the server writes it (another type, a sequence out of 0 to 2**64 - 1, a
    time not in RFC 3339 UTC): such a reply is not acted on."""
    if not isinstance(reply, dict):
        return None
    state, config, mirror = reply.get("state"), reply.get("config", {}), reply.get("mirror", {})
    if not (isinstance(state, dict) and isinstance(config, dict)
            and isinstance(mirror, dict)):
        return None
    source, error = config.get("mirror", {}), mirror.get("error", {})
    if not (isinstance(source, dict) and isinstance(error, dict)):
        return None
    created, last_ts, name = reply.get("created"), state.get("last_ts"), source.get("name", "")
    created_ns, ts_ns, last_ns = _ns(created), _ns(reply.get("ts")), _ns(last_ts)
    messages, first, last = (_seq(state.get(key))
                             for key in ("messages", "first_seq", "last_seq"))
    opt_start_seq, err_code = _seq(source.get("opt_start_seq", 0)), _seq(error.get("err_code", 0))
    if (created_ns is None or ts_ns is None or last_ns is None or messages is None
            or first is None or last is None or opt_start_seq is None or err_code is None
            or not isinstance(created, str) or not isinstance(last_ts, str)
            or not isinstance(name, str)):
        return None
    return StreamInfo(created, created_ns, ts_ns, messages, first, last, last_ts, last_ns,
                      name, opt_start_seq, err_code)


@dataclasses.dataclass(frozen=True)
class Look:
    """What one look at the mirror's and the output stream's STREAM.INFO replies calls
    for (`decide`)."""

    #: "absent": no output stream (the workers' deployment check makes it again);
    #: "unread": a reply not as the server writes it (`read_info`): nothing done;
    #: "missing": no mirror (made again from `start`); "well"; "restart": from `start`.
    action: Literal["absent", "unread", "missing", "well", "restart"]
    #: Where a mirror made again or restarted starts.
    start: _Start | None = None
    #: The mirror's reply (compared between a restart's two looks, logged).
    mirror: StreamInfo | None = None


def decide(mirror: object, source: object, name: str) -> Look:
    """What the STREAM.INFO replies of the mirror and of the output stream `name` call
    for (each None where the server said the stream does not exist, else whatever JSON
    it sent). A mirror is made or restarted only from replies `read_info` reads, at a
    sequence from 1 to 2**64 - 1, or at a time from 1970 on and at most `_SKEW` after
    the server's clock (a start in the future would copy nothing, and the mirror would
    look well): other replies are "unread"."""
    if source is None:
        return Look("absent")
    theirs = read_info(source)
    if theirs is None:
        return Look("unread")
    if mirror is None:
        # Made from after what the output stream holds now (a reader would read a
        # mirror made from the stream's start all over again; what was published while
        # it was missing is not in it).
        after = theirs.last_seq + 1
        return Look("missing", (after, None)) if after <= _MAX_SEQ else Look("unread")
    mine = read_info(mirror)
    if mine is None:
        return Look("unread")
    start = restart_from(mine, theirs, name)
    if start is None:
        return Look("well", None, mine)
    seq, since = start
    at = 0 if since is None else _ns(since)
    if seq > _MAX_SEQ or at is None or not 0 <= at <= mine.ts_ns + _SKEW * _NS:
        return Look("unread", None, mine)
    return Look("restart", start, mine)


async def heal_mirror(nc: Client, config: NatsConfig, watch: MirrorWatch,
                      claim: Claim | None = None) -> int | None:
    """One look at the mirror; when it stalled or fell out of step (or is missing), the
    output stream exists, and an earlier look long enough ago found the same
    (`MirrorWatch.ripe`), restart (or make) it, a restart only once `claim` (if given)
    granted it. Returns the sequence the mirror now starts from (1: the output stream's
    start), None when nothing was done."""
    api = config.front_api or FRONT_API
    name = config.output_stream
    seen = await _look(nc, api, name)
    if seen.action in ("absent", "unread"):
        return None  # (the workers' deployment check makes the output stream again)
    now = asyncio.get_running_loop().time()
    if seen.action == "missing":
        # Deleted and not made again (a create that failed: this worker's, remembered,
        # or another's that died between the two): made from where the restart meant
        # to start, else after what the output stream holds now.
        remade = watch.pending
        if remade is None:
            if not watch.ripe("missing", now) or seen.start is None:
                return None
            remade = seen.start
        await _to_the_end(_create(nc, config, api, remade, watch))
        logger.warning("turnrouter: made the front ends' mirror of %s again, starting "
                       "%s (it was missing)", name, f"from sequence {remade[0]}"
                       if remade[1] is None else f"with the outputs stored from {remade[1]}")
        return remade[0]
    watch.pending = None  # (a create whose reply was lost made it after all)
    if seen.action == "well" or seen.start is None or seen.mirror is None:
        watch.due, watch.restarts = None, 0
        return None
    created = seen.mirror.created
    if not watch.ripe(f"{created}/{seen.start[0]}", now):
        return None
    # Another worker may have seen it too: a random moment, then a second look; a
    # mirror that changed meanwhile was restarted by someone else.
    await asyncio.sleep(random.uniform(0, watch.jitter))
    again = await _look(nc, api, name)
    if (again.action != "restart" or again.start is None or again.mirror is None
            or again.mirror.created != created):
        return None
    start, mirror = again.start, again.mirror
    if claim is not None and not await claim(f"{created}/{start[0]}/{start[1]}"):
        return None  # another worker restarts it
    watch.due, watch.restarts = None, watch.restarts + 1
    # Remembered from before the delete: one whose reply is lost (or junk) may have
    # deleted it all the same, and the next look that finds it missing makes it again
    # from here (a next look that finds it there forgets it).
    watch.pending = start
    await _to_the_end(_replace(nc, config, api, start, watch))
    logger.warning("turnrouter: restarted the front ends' mirror of %s (it %s; it held "
                   "sequences up to %s): it now starts %s", name,
                   f"stalled on error {mirror.err_code}" if mirror.err_code
                   else "was out of step with the stream", mirror.last_seq,
                   f"from sequence {start[0]}" if start[1] is None else
                   f"with the outputs stored from {start[1]}")
    return start[0]


async def _look(nc: Client, api: str, name: str) -> Look:
    """One look: the mirror's STREAM.INFO, then the output stream's (`decide`)."""
    mirror = await _info(nc, f"{api}.STREAM.INFO.{name}")
    source = await _info(nc, f"$JS.API.STREAM.INFO.{name}")
    return decide(mirror, source, name)


async def _to_the_end(work: Coroutine[Any, Any, None]) -> None:
    """`work` run to its end even when the watch is cancelled meanwhile (the worker
    stops): a delete without its create would leave every front end without outputs
    until another worker made the mirror again, from a later start. The cancellation
    is raised once `work` ended (its requests' own timeouts bound the wait); what it
    raised then is logged, not left unretrieved."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait((task,))
        if not task.cancelled() and (exc := task.exception()) is not None:
            logger.warning("turnrouter: the front ends' mirror, finished while the worker "
                           "stops: %s", str(exc)[:300])
        raise


async def _replace(nc: Client, config: NatsConfig, api: str, start: _Start,
                   watch: MirrorWatch) -> None:
    """Delete the mirror and create it again starting at `start`."""
    try:
        await api_request(nc, f"{api}.STREAM.DELETE.{config.output_stream}")
    except _Refused as exc:
        if not (isinstance(exc.error, dict) and exc.error.get("err_code") == _NOT_FOUND):
            raise  # (deleted meanwhile: created below, or by whoever deleted it)
    await _create(nc, config, api, start, watch)


async def _create(nc: Client, config: NatsConfig, api: str, start: _Start,
                  watch: MirrorWatch) -> None:
    """Create the mirror starting at `start` (a sequence, or the outputs stored from a
    time on), remembered (`MirrorWatch.pending`) until it succeeds."""
    stream = _output_mirror(config)
    seq, since = start
    if since is not None:
        stream["mirror"]["opt_start_time"] = since
    elif seq > 1:
        stream["mirror"]["opt_start_seq"] = seq
    watch.pending = start
    try:
        await api_request(nc, f"{api}.STREAM.CREATE.{config.output_stream}", stream)
    except _Refused as exc:
        # Made meanwhile by another worker (or refused: its error is logged).
        logger.warning("turnrouter: creating the front ends' mirror of %s: %s",
                       config.output_stream, str(exc.error)[:200])
    watch.pending = None


def restart_from(mirror: StreamInfo, source: StreamInfo, name: str) -> _Start | None:
    """Where a restart of the mirror (its STREAM.INFO `mirror`) of the output stream
    (`source`) should start, or None when it needs none: from the outputs the stream
    stored after the mirror's last one (after its creation when it holds none) when
    the mirror is out of step with the stream (its sequences go past the stream's, or
    it holds outputs older than the stream: the stream was made again); from the
    sequence after its last one when it stalled on "stream not found" though the
    stream exists now (unless the mirror is younger than `_YOUNG` seconds), never below
    where the mirror itself was made to start (one restarted before it got anything
    says it holds up to 0)."""
    if mirror.mirror_of != name:
        return None  # not a mirror of the output stream: not ours to restart
    last = mirror.last_seq
    if last > source.last_seq or (
            mirror.messages and source.messages and source.first_seq <= last
            and source.created_ns > mirror.last_ns):
        first = 1
    elif mirror.err_code != _NOT_FOUND or (
            mirror.ts_ns - mirror.created_ns < _YOUNG * _NS):
        return None
    else:
        first = max(last + 1, mirror.opt_start_seq, 1)
    # Out of step: the stream's outputs stored after the mirror's last one (all of a
    # stream made again since; only the new ones of a stream whose last outputs a
    # crash lost, so no reader hears again what it already heard).
    return first, (None if first > 1 else
                   mirror.last_ts if mirror.messages else mirror.created)


def _seq(value: object) -> int | None:
    """A JSON integer from 0 to `_MAX_SEQ` (a sequence, a count, an error code), else
    None."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_SEQ:
        return value
    return None


def _ns(stamp: object) -> int | None:
    """Nanoseconds since the epoch of a time as JetStream writes it (RFC 3339 in UTC,
    nanosecond fractions, which `datetime` does not read); None for anything else."""
    match = _TIME.fullmatch(stamp) if isinstance(stamp, str) else None
    if match is None:
        return None
    whole, fraction = match.groups()
    try:
        when = datetime.datetime.fromisoformat(whole).replace(tzinfo=datetime.UTC)
    except ValueError:  # (no such day)
        return None
    seconds = (when - _EPOCH) // datetime.timedelta(seconds=1)
    return seconds * _NS + (int(fraction.ljust(9, "0")) if fraction else 0)


async def _info(nc: Client, subject: str) -> dict[str, Any] | None:
    """STREAM.INFO's reply (`api_request`); None when the stream does not exist (the
    server's 404 "stream not found", nothing else)."""
    try:
        return await api_request(nc, subject, wait=2.0)
    except _Refused as exc:
        error = exc.error if isinstance(exc.error, dict) else {}
        if _seq(error.get("code")) == 404 and _seq(error.get("err_code")) == _NOT_FOUND:
            return None
        raise
