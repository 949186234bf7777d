"""Participant records in the key-value bucket: claims, revision-checked writes, fencing.

Each participant's record (`<partition>.<token>`) holds the router snapshot, the ids of
its turns in flight and the answers not yet known to be published. A replica claims a
record on first contact (a write that moves the revision), so every later write of the
previous owner is refused: that owner stops serving the participant (fencing).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import operator
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as _json_str
from typing import TYPE_CHECKING, Any, TypeVar

from nats.errors import Error as NatsError
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from ..._exceptions import ContractValueError, LifecycleError, PatchNotSavedError
from ..._frontend import MAX_SESSION_TURNS, ParticipantSnapshot
from ..._limits import is_logged
from ..._redact import one_line, preview
from ..._router import AgentRouter, prepared_import
from ._link import Link, NoResponders, Replaced, RequestFailed, pub_ack
from ._metrics import RuntimeMetrics
from ._records import sound_endings
from ._setup import HEADER_ROOM
from ._wire import (
    MAX_ENDED,
    MAX_STATE_BYTES,
    MAX_STATE_INFLIGHT,
    MAX_STATE_OUTBOX,
    Ending,
    NatsConfig,
    StateRecord,
    encode_token,
    parse_record,
    record_json,
)

if TYPE_CHECKING:  # (its module imports this one)
    from ._inputs import _Running

__all__ = ["Ledger", "Participant", "SaveOutcome", "await_last_writer",
           "await_previous_owner", "change_made", "fitted_record", "recorded", "said",
           "still_ours", "unclaimed", "unsaved"]

logger = logging.getLogger("turnrouter.runtime.nats")

_MAX_INFLIGHT = MAX_STATE_INFLIGHT  # bound of one participant's in-flight ids in its record
_MAX_OUTBOX = MAX_STATE_OUTBOX  # bound of one participant's unconfirmed endings in its record
_MAX_UNSURE = 4096  # bound of the participants whose unfinished turns await an end
_NONE: frozenset[str] = frozenset()
_turn_of = operator.itemgetter(0)  # an ending's turn id
#: Records larger than this are parsed and validated in a thread, off the event loop.
_READ_OFF_LOOP_BYTES = 64 * 1024
_T = TypeVar("_T")
#: JetStream's "wrong last sequence" errors: a newer revision exists (fencing).
_WRONG_LAST = (10071, 10164)


def _any_before(outbox: list[Ending], horizon: float) -> bool:
    """`any(e[3] < horizon for e in outbox)` without a generator (every write asks)."""
    for ending in outbox:  # noqa: SIM110 (see above)
        if ending[3] < horizon:
            return True
    return False


#: Seconds between the tries of a record write that got no reply or found no stream
#: answering, and the longest it keeps trying from its first try (a graceful stop
#: waits for it too).
_REWRITE_WAIT = 0.25
_REWRITE_FOR = 10.0


async def _settled_write(link: Link, kv: Any, key: str, subject: str, data: bytes,
                         revision: int, config: NatsConfig, failed: Exception | None,
                         since: float, replica: str
                         ) -> tuple[int | None, Any, Exception | None, bool]:
    """The rest of a revision-checked record write whose first try `failed` (None: it
    was refused because the record is gone, so this writes it anew, `revision` 0, or
    for an older revision, `revision` being the one it expected):
    `(revision, error, failure, remade)`; `failure` is the last error when no try got a
    reply in time, `remade` says the record was found gone and written anew.

    One loop on one deadline, `_REWRITE_FOR` seconds (or `reconnect_for` if shorter)
    after the first try (`since`, `time.perf_counter()`); the participant's lock is
    held meanwhile. Each try expects the same revision:
    - no reply (a frozen or restarting server): sent again. It may have been stored all
      the same, so a later try refused for a newer revision reads the record back:
      holding exactly these bytes, that revision is this write's. (Before, the first
      timeout, 5 s, dropped the participant and ended their turns with the failure
      text, also when the write had landed as the server resumed.)
    - no stream answering (503: nothing stored): the bucket was deleted, the server is
      back on an empty store (the worker's deployment check is making it again), or a
      cluster is electing the bucket's leader after losing a server. Sent again once it
      answers.
    - refused because no record is there at all (`_vanished`; another replica's claim,
      write or delete leaves a newer revision, not none): written anew from what this
      replica holds, so the participant keeps their history and the turn its answer.
    - refused because the record went back to an older revision that this replica
      wrote (`_went_back`: a server back on an older copy of its store; nobody claimed
      it since): written again over that revision, as above (chaos17 F1: the write was
      taken for fenced, and the turn's answer dropped with no ending at all).
    A refusal for a newer revision not this write's is returned as the server's error
    (fenced); a reply that is not a JetStream acknowledgement ends the write as failed."""
    deadline = since + min(_REWRITE_FOR, config.reconnect_for)
    resent = remade = False
    while True:
        if failed is not None:
            if not isinstance(failed, RequestFailed) or (
                    time.perf_counter() + 2 * _REWRITE_WAIT >= deadline):
                return None, None, failed, False
            if not isinstance(failed, Replaced):  # (the server is back: at once)
                await asyncio.sleep(_REWRITE_WAIT)
            # Only a try without a reply may have been stored; a 503 stored nothing.
            resent = resent or not isinstance(failed, NoResponders)
        elif revision == 0:
            remade = True
        try:
            seq, error = pub_ack(await link.request(
                subject, data, {"Nats-Expected-Last-Subject-Sequence": str(revision)},
                wait=max(0.1, min(5.0, deadline - time.perf_counter()))))
        except (RequestFailed, ValueError) as exc:
            failed = exc
            continue
        if seq is not None or not (isinstance(error, dict)
                                   and error.get("err_code") in _WRONG_LAST):
            return seq, error, None, remade and seq is not None
        if revision and _vanished(error):  # no record at all: none of our tries landed
            if time.perf_counter() >= deadline:
                return None, error, None, False
            revision, failed = 0, None
            continue
        if resent:  # an earlier try may be that newer revision
            try:
                entry = await kv.get(key)
            except KeyNotFoundError:
                entry = None
            except NatsError as exc:
                return None, None, exc, False
            if entry is not None and (entry.value or b"") == data:
                return entry.revision, None, None, remade
        back = await _went_back(kv, key, replica, error, revision)
        if back and time.perf_counter() < deadline:
            revision, failed, remade = back, None, True
            continue
        return None, error, None, False


def _last_sequence(error: object) -> int | None:
    """The record's last sequence a `wrong last sequence` refusal names (None: another
    error, or none named)."""
    if not (isinstance(error, dict) and error.get("err_code") in _WRONG_LAST):
        return None
    description = error.get("description")
    if not isinstance(description, str):
        return None
    tail = description.rstrip().rpartition(":")[2].strip()
    return int(tail) if tail.isdigit() and len(tail) < 20 else None


def _older(error: object, revision: int) -> bool:
    """Whether a write expecting `revision` was refused for an older one (not 0)."""
    last = _last_sequence(error)
    return last is not None and 0 < last < revision


async def _went_back(kv: Any, key: str, replica: str, error: object,
                     revision: int) -> int | None:
    """The older revision record `key` went back to, when a write expecting `revision`
    was refused for it and that revision is this replica's own (a server back on an
    older copy of its store): the record was not claimed since, so this replica may
    write over it. None otherwise: a newer revision, or another replica's (fenced; on
    a store gone back, sequences may run below this replica's revision too)."""
    if not _older(error, revision):
        return None
    try:
        entry = await kv.get(key)
        record = parse_record(entry.value or b"")
    except (NatsError, ValueError):
        return None
    if entry.revision is None or entry.revision >= revision or record.owner != replica:
        return None
    return int(entry.revision)


def _vanished(error: object) -> bool:
    """Whether a refused write found no record at all (`wrong last sequence: 0`): not
    a newer revision, as another replica's claim, write or delete would leave."""
    return (isinstance(error, dict) and error.get("err_code") in _WRONG_LAST
            and isinstance(error.get("description"), str)
            and error["description"].rstrip().endswith(": 0"))


@dataclass
class Participant:
    """What this replica knows of one participant it serves."""

    partition: int
    revision: int = 0
    inflight: list[str] = field(default_factory=list)
    outbox: list[Ending] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    fenced: bool = False
    ended: dict[str, str] = field(default_factory=dict)
    """The last `MAX_ENDED` turns that ended (in order, each with its id as a JSON
    string, as the record holds them): the claimed record's, those it left in flight or
    answered, and those ended here since. A query whose id is here never runs again,
    whatever its delivery count."""
    recorded: frozenset[str] = frozenset()
    """Turn ids of the outbox entries the last record written holds: only these may be
    published again after a reconnect (an entry whose write got no reply may not be in
    the record, and its participant is claimed again from what the record holds)."""
    saving: bool = False
    """A save after an out-of-turn change (a context patch) is scheduled."""
    changes: int = 0
    """Changes made outside turns (context patches: `Inputs.changed`) so far."""
    exported: int = 0
    """How many of `changes` the snapshot last exported holds."""
    saved: int = 0
    """How many of `changes` the last record written holds."""
    waiting: list[tuple[int, asyncio.Future[str | None]]] | None = None
    """The patch calls waiting for their change to be written: its count in `changes`,
    and its outcome (None once written, else why not: `SaveOutcome`)."""
    key_subject: str = ""
    """The subject of its record's writes (`$KV.<bucket>.<partition>.<token>`), made at
    its first write (it is written every turn)."""
    snapshot: bytes | None = None
    """The snapshot JSON of the last record written or claimed (an in-flight mark
    reuses it: nothing but turns and patches change it, and they write a fresh one)."""
    answered: bool = False
    """An answer joined the outbox since `snapshot` was exported: its exchange is in
    the router's history, not in `snapshot`, so the next write exports afresh, an
    in-flight mark too. A record holding an answer always holds its exchange: a mark
    queued behind a write the server had not answered (an outage) and built once its
    turn had finished wrote the answer beside the snapshot of before, and a new owner
    claiming that record said the answer and ran the next turns without it (chaos17
    F2: the history missing an answer that was heard)."""
    answering: _Running | None = None
    """The running or finishing turn (`_inputs._Running`) holding the participant's
    latest answer until its record is written: the participant's outputs of later turns
    wait until it is handed to the connection (`Inputs.publish_output`), as the next
    turn starts while that write waits for its reply."""
    active: float = field(default_factory=time.monotonic)
    """When its last input arrived (`time.monotonic()`): idle past
    `NatsConfig.idle_after`, it is let go (`_idle`)."""

    def end(self, turn_id: str) -> None:
        """Remember that turn `turn_id` ended (written with the next record)."""
        ended = self.ended
        ended[turn_id] = ended.pop(turn_id, "") or _json_str(turn_id)
        if len(ended) > MAX_ENDED:
            del ended[next(iter(ended))]


def saved_until(state: Participant, count: int) -> None:
    """A record holding the first `count` changes landed: their callers hear so."""
    state.saved = max(state.saved, count)
    waiting = state.waiting
    if waiting:
        for need, future in waiting:
            if need <= count and not future.done():
                future.set_result(None)
        state.waiting = [item for item in waiting if item[0] > count] or None


_unsaved = [0]  # changes outside turns never written, in this process


def unsaved(state: Participant, why: str) -> None:
    """`state` leaves this replica with changes no record written holds: each caller
    still waiting hears `why` (`PatchNotSavedError`); logged at the 1st, 10th, 100th...
    (chaos13 D1: such a change was lost without a word, its caller told it applied)."""
    waiting, state.waiting = state.waiting, None
    told = 0
    for _, future in waiting or ():
        if not future.done():
            future.set_result(why)
            told += 1
    if told:
        _unsaved[0] += 1
        if is_logged(_unsaved[0]):
            logger.warning("turnrouter: a change made outside a turn (a context patch) "
                           "could not be saved, or is not known to be (%d so far; its "
                           "caller gets PatchNotSavedError unless the record read back "
                           "holds it): %s", _unsaved[0], why)


#: The longest a patch call waits for its change's record write (`SaveOutcome`): the
#: write's own tries end within `_REWRITE_FOR` plus a try's wait, behind at most one
#: other write of the participant, and a lost participant's `let_go`; this only bounds
#: a path that never settles.
SAVE_WAIT = 60.0


class SaveOutcome:
    """What a NATS worker's `Inputs.changed` returns to the router: awaited (by the
    patch call that made the change) it returns once a record holding the change is
    written, or raises `PatchNotSavedError` naming why it was not. The wait is bounded
    (`SAVE_WAIT`) and shielded: a caller cancelled meanwhile leaves the write and the
    other callers' waits alone. Never awaited (the change made by something that does
    not wait), it costs nothing.

    A write refused for a newer revision, or without a reply, may have landed all the
    same (a try sent as the connection went, stored when it came back, its reply lost:
    then another replica's claim read it): before raising, `recheck` reads the record
    (`_landed`), and one that holds what this replica last tried to write, with the
    change, counts as saved."""

    __slots__ = ("_future", "_pid", "_recheck")

    def __init__(self, pid: str, future: asyncio.Future[str | None],
                 recheck: Callable[[], Awaitable[bool]] | None = None) -> None:
        self._pid, self._future, self._recheck = pid, future, recheck

    def __await__(self) -> Any:
        return self._wait().__await__()

    async def _wait(self) -> None:
        try:
            async with asyncio.timeout(SAVE_WAIT):
                why = await asyncio.shield(self._future)
                if why is not None and self._recheck is not None and (
                        await self._recheck()):
                    return
        except TimeoutError:
            why = f"no record write ended within {SAVE_WAIT:g} s"
        if why is not None:
            raise PatchNotSavedError(
                f"the context change for participant {preview(self._pid)} was made on "
                f"this replica but not saved: {why}; they continue from their record, "
                "which may not hold it, wherever they are served next (apply the "
                "result again there, e.g. at their next turn)")


def change_made(ledger: Ledger, pid: str) -> SaveOutcome:
    """A change of `pid` outside its turns: counted, and its outcome, settled by the
    first record written holding it (`saved_until`: a save's, a turn's, `lose`'s) or
    the participant leaving this replica (`unsaved`; then `_landed`)."""
    future: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
    state = ledger.people.get(pid)
    if state is None or state.fenced:  # (leaving: its turns drain, then it is gone)
        future.set_result(_NOT_HELD)
        return SaveOutcome(pid, future)
    state.changes += 1
    if state.waiting is None:
        state.waiting = []
    state.waiting.append((state.changes, future))
    return SaveOutcome(pid, future, functools.partial(
        _landed, ledger, pid, state, state.changes))


#: The longest `_landed` waits for its read of the record.
_RECHECK_WAIT = 5.0


async def _landed(ledger: Ledger, pid: str, state: Participant, need: int) -> bool:
    """Whether `pid`'s record holds what this replica last tried to write (`state`, no
    longer served here), a snapshot holding change `need`: a try of that write landed
    though its outcome was not known here (`SaveOutcome`). The record's snapshot holds
    it when it holds that snapshot's newest exchange (each is unique: a patch's id, a
    turn's id and time; every write made since that exchange holds the change, or the
    change added no exchange) and the same held patches (their ids: a hold or a
    rejection changes only them); another replica's turns since only add exchanges."""
    snapshot = state.snapshot
    if need > state.exported or snapshot is None:
        return False  # (never tried: it waited behind a write and found it fenced)
    try:
        async with asyncio.timeout(_RECHECK_WAIT):
            record = await recorded(ledger, pid, state.partition)
        if record is None or record.snapshot is None:
            return False
        ours = ParticipantSnapshot.from_json(snapshot)
        theirs = ParticipantSnapshot.from_json(record.snapshot)
    except (NatsError, ValueError, TimeoutError):  # (ContractValueError: a ValueError)
        return False
    return (not ours.history or ours.history[-1] in theirs.history) and (
        {held.patch_id for held in ours.pending}
        == {held.patch_id for held in theirs.pending})


#: Why a change was not saved, by how its participant left this replica.
_NOT_HELD = ("this replica no longer holds the participant (let go when idle, or served "
            "by another replica)")
_CLAIMED = ("another replica claimed the participant's record first (its partition "
            "moved, e.g. while the NATS server was unreachable)")
_NO_ANSWER = "the participant's record write failed or got no answer from the server"
_MOVED = ("the participant's partition moved to another replica, which claimed the "
          "record before this replica could write the change")
_HANDED = "the participant was handed over before the change was written"


def fitted_record(replica: str, inflight: list[str], snapshot: str | bytes | None,
                  outbox: list[Ending], ended_json: str, limit: int
                  ) -> tuple[bytes, list[Ending], bool]:
    """`record_json` within `limit` bytes, the outbox it holds, and whether it left
    anything out. A record too big for one NATS message is never stored, and its input
    would come back for ever, holding its whole partition: it leaves the snapshot out
    (the participant keeps its state while it stays on this replica; a next owner starts
    it clean), and then the endings to republish (their turns stay ended)."""
    data = record_json(replica, inflight, snapshot, outbox, ended_json)
    if len(data) <= limit or (snapshot is None and not outbox):
        return data, outbox, False
    data = record_json(replica, inflight, None, outbox, ended_json)
    if len(data) <= limit:
        return data, outbox, True
    return record_json(replica, inflight, None, [], ended_json), [], True


def said(outbox: list[Ending], router: AgentRouter) -> list[Ending]:
    """The endings of a record's outbox that may be said (`sound_endings`); the others
    are dropped, counted (`nats_state`, `invalid_ending`) and logged."""
    if not outbox:
        return outbox
    sound = sound_endings(outbox, router.destinations)
    for _ in range(len(outbox) - len(sound)):
        with contextlib.suppress(Exception):
            router.report_rejected("nats_state", "invalid_ending")
    return sound


def _unfinished(inflight: list[str], outbox: list[Ending], config: NatsConfig,
                metrics: RuntimeMetrics | None) -> list[Ending]:
    """The endings a claimed record asks for: its outbox's answers (younger than half
    the deduplication window: maybe never published, the owner having died between its
    write and its publish, and a duplicate is dropped; older ones were published long
    ago and could be heard twice), and the failure text for each turn it left in
    flight."""
    horizon = time.time() - config.dedup_window / 2
    endings = [ending for ending in outbox if ending[3] >= horizon]
    answered = {ending[0] for ending in outbox}
    now = time.time()
    for turn_id in inflight:
        if turn_id in answered:
            continue
        if metrics is not None:
            metrics.inflight_failed.inc()
        endings.append((turn_id, "none", config.failure_text, now))
    return endings


def _with_turns(snapshot: ParticipantSnapshot, inflight: list[str]) -> ParticipantSnapshot:
    """`snapshot` with the turns its record holds in flight among its session's turns.

    An in-flight mark reuses the snapshot of the write before it, so a turn running
    when its owner crashed is in the record's `inflight`, not in the snapshot's
    session: it is one of that session's turns all the same, and a context patch it
    spawned, delivered at a later turn, is not from an earlier session.
    """
    turns = snapshot.session_turns
    if turns is None or not inflight:
        return snapshot
    merged = tuple(dict.fromkeys((*turns, *inflight)))
    return snapshot.model_copy(update={
        "session_turns": merged if len(merged) <= MAX_SESSION_TURNS else None})


def _read(value: bytes, pid: str, router: AgentRouter) -> tuple[
        StateRecord, ParticipantSnapshot | ContractValueError | None]:
    """A record and its snapshot, parsed and checked against the key's participant
    (ValueError for the record; the snapshot's ContractValueError returned, so the
    record's unfinished turns still end when only its snapshot is bad), the snapshot
    prepared for `router`'s import (`prepared_import`: its checks and read-back, what
    the import costs beyond installing it, done here, off the event loop for a big
    record)."""
    record = parse_record(value)
    if record.snapshot is None:
        return record, None
    try:
        parsed = ParticipantSnapshot.from_json(record.snapshot)
        if parsed.participant_id != pid:  # alice's snapshot in mallory's record
            raise ContractValueError("the snapshot's participant_id is not the record's "
                                     "participant")
        # (the session's turns completed before the preparation: a copy made after it
        # would not be the prepared snapshot, and its import would redo every step)
        parsed = prepared_import(router, _with_turns(parsed, record.inflight))
    except ContractValueError as exc:
        return record, exc
    return record, parsed


async def _off_loop(ledger: Ledger, parse: Callable[..., _T], *args: Any) -> _T:
    """`parse(*args)` for a big record, in a thread and one at a time per replica: the
    parse and validation hold the GIL (json and pydantic run in C: ~15 ms for a 1 MB
    record, each C call holding it throughout), so several at once took turns starving
    the event loop (30 read together stalled it ~1 s); one at a time, the loop runs
    between them. The Python parts (the import's NaN walk) let the loop in every
    switch interval (5 ms)."""
    async with ledger.big_reads:
        return await asyncio.to_thread(parse, *args)


async def recorded(ledger: Ledger, pid: str, n: int) -> StateRecord | None:
    """`pid`'s record (partition `n`) as `parse_record` reads it, its snapshot left
    unread, without claiming it; None when there is none. Raises `NatsError` when the
    server cannot say, `ValueError` for a record of junk (a claim quarantines it)."""
    try:
        entry = await ledger._kv.get(f"{n}.{encode_token(pid)}")
    except KeyNotFoundError:
        return None
    return await _parsed(ledger, entry.value or b"")


async def _parsed(ledger: Ledger, data: bytes) -> StateRecord:
    """`parse_record(data)`, off the event loop for a big record (`_off_loop`)."""
    if len(data) > _READ_OFF_LOOP_BYTES:
        return await _off_loop(ledger, parse_record, data)
    return parse_record(data)


def arrived_lately(ledger: Ledger, n: int) -> bool:
    """Whether partition `n` was taken over here within the grace a previous owner's
    writes get (`failover_timeout` plus two probe periods)."""
    config = ledger._config
    return (asyncio.get_running_loop().time() - ledger.arrived.get(n, -math.inf)
            < config.failover_timeout + 2 * config.probe_interval)


async def unclaimed(ledger: Ledger, pid: str, n: int, message_id: str) -> str:
    """Whether an expired query of `pid` may be refused without a claim ("refuse"),
    ended already ("ended": its record says so; it gets no output, as any turn
    published again after the stream's window), or takes the claim ("claim"): its
    record holds a turn left unended by a replica gone (its failure text comes first)
    or endings maybe unheard, or cannot be read now. A participant served here is
    known without a read."""
    if pid in ledger.people:
        return "refuse"
    key = f"{n}.{encode_token(pid)}"
    for look in range(2):
        try:
            entry = await ledger._kv.get(key)
            data = bytes(entry.value or b"")
            record = await _parsed(ledger, data)
        except KeyNotFoundError:
            return "refuse"
        except (NatsError, ValueError):
            return "claim"
        if record.inflight or record.outbox:
            return "claim"
        if message_id in record.ended:
            return "ended"
        if look or not record.owner or record.owner == ledger.replica or not (
                arrived_lately(ledger, n)):
            break
        # The partition just arrived: its previous owner, alive, may be writing this
        # query's answer (`let_go`, answers it held): the busy text would race it, and
        # the participant hear it while the history holds the answer (review10 L1).
        await await_last_writer(ledger, key, data, record.owner, n)
    return "refuse"


PublishEnding = Callable[[str, "Participant", Ending], Awaitable[None]]


#: Seconds of state writes that all failed after which a replica stops saying it serves
#: (`WriteHealth`).
WRITES_FAILING_SECS = 10.0


class WriteHealth:
    """Whether the bucket takes this replica's writes. Once writes kept failing for
    `WRITES_FAILING_SECS` (a JetStream store that stopped storing: a full disk, say,
    which the server does not recover from until restarted), `report` is told why
    (the worker's readiness then drops: /ready 503 naming it, the ready file removed,
    `turnrouter_nats_serving` 0); a write that lands, or as long again without a
    failure, tells it None. Failures further apart than that are not an outage."""

    def __init__(self) -> None:
        self.report: Callable[[str | None], None] = lambda why: None
        self._since: float | None = None
        self._last = 0.0
        self._quiet: asyncio.TimerHandle | None = None  # clears it without traffic

    def failed(self, what: object) -> None:
        now = time.monotonic()
        if self._since is None or now - self._last > WRITES_FAILING_SECS:
            self._since = now  # (a failure long after the previous one starts afresh)
        self._last = now
        if self._quiet is not None:
            self._quiet.cancel()
            self._quiet = asyncio.get_running_loop().call_later(
                WRITES_FAILING_SECS, self.ok)
        elif now - self._since >= WRITES_FAILING_SECS:
            self.report(f"state writes failing for {now - self._since:.0f} s "
                        f"(last: {preview(what)})")
            self._quiet = asyncio.get_running_loop().call_later(
                WRITES_FAILING_SECS, self.ok)

    def ok(self) -> None:
        self._since = None
        if self._quiet is not None:
            self._quiet.cancel()
            self._quiet = None
            self.report(None)


class Ledger:
    """The records of the participants this replica serves."""

    def __init__(self, kv: Any, link: Link, config: NatsConfig, replica: str,
                 router: Callable[[], AgentRouter], publish_ending: PublishEnding,
                 metrics: RuntimeMetrics | None) -> None:
        self._kv, self._link, self._config, self._replica = kv, link, config, replica
        self._router, self._publish_ending, self._metrics = router, publish_ending, metrics
        self._subject = f"$KV.{config.bucket}."
        self.people: dict[str, Participant] = {}
        self.health = WriteHealth()
        self.big_reads = asyncio.Semaphore(1)  # big records parsed one at a time
        self._claiming: dict[str, list[Any]] = {}  # pid -> [lock, claims waiting]
        #: Times this replica stopped serving each partition (`partition_lost`): a claim
        #: that outlived its partition here must not leave a state nobody fences.
        self._losses: dict[int, int] = {}
        self.unsure: dict[str, int] = {}
        """Participants dropped after a write got no reply, by partition: their
        unfinished turns are ended (`settle_unsure`), as their record may hold a turn
        no input will come back for."""
        self.on_unsure: Callable[[str, int], None] = lambda pid, n: None
        #: Participants `lose` is ending: `settle_unsure` leaves them to it (both would
        #: end the same record, and its failure text could beat `lose`'s held answer).
        self._losing: set[str] = set()
        #: Whether a replica is alive (presence), and per partition when the wait for
        #: its live previous owners' writes ends (`await_last_writer`).
        self.alive: Callable[[str], Awaitable[bool]] | None = None
        self.heard: Callable[[str], bool | None] = lambda replica: None  # (its verdict now)
        self.grace: dict[int, float] = {}
        self.arrived: dict[int, float] = {}  # (loop time each partition was taken over)
        self.unheard: dict[str, Participant] = {}
        """Participants not served here whose endings were published (`say_again`,
        `let_go`) and not acknowledged by the stream yet, their outboxes emptying as
        they are: published again after a reconnect or a stream back from 503
        (`Inputs.republish`). Else a stream without a leader lost them for good while
        their participant, waiting for that answer, sent nothing that would claim them."""
        #: Writes that got no answer (an outage fails one per participant writing): the
        #: log shows the first, then every power of ten, each with the count so far.
        self.write_failures = 0
        #: Records found gone without a trace and written again (`write`): logged the
        #: first time and at every power of ten.
        self.records_remade = 0
        #: Claims that failed (no reply, a refusal other than a newer write): logged
        #: the first time and at every power of ten, since a takeover tries again.
        self.claim_failures = 0
        #: Records too big for one NATS message, written without their snapshot
        #: (`fitted_record`): logged the first time and at every power of ten.
        self.oversized = 0
        #: Participants past `unsure`'s bound, and endings said once only, `unheard`
        #: being full (each logged at powers of ten).
        self.unsure_overflows = self.unheard_overflows = 0

    def partition_lost(self, n: int) -> None:
        """This replica stops serving partition `n` (its pin moved, or it hands it over):
        a claim under way in it is fenced when it completes (`claim`)."""
        self._losses[n] = self._losses.get(n, 0) + 1

    def of_partition(self, n: int) -> list[str]:
        return [pid for pid, state in self.people.items() if state.partition == n]

    async def fence(self, pid: str, *, refused: bool) -> ParticipantSnapshot | None:
        """Stop serving `pid` here: cancel its turns, drop its state (no release).
        Returns what the router held of it once its turns were drained (None: nothing)."""
        state = self.people.pop(pid, None)
        if state is not None:
            state.fenced = True
            run = state.answering  # answers this replica will not publish: nobody waits
            while run is not None:
                prior = run.prior
                run.said()
                run = prior
            if state.waiting and pid not in self._losing:  # (`lose` may still write it)
                unsaved(state, _CLAIMED if refused else _NO_ANSWER)
        if refused and self._metrics is not None:
            self._metrics.state_refused.inc()
        try:
            return await self._router().evict_participant(pid)
        except LifecycleError:
            return None
        except Exception:  # (its state is gone either way: the others still dropped)
            logger.exception("turnrouter: handing a participant over failed")
            return None

    async def lose(self, pid: str) -> None:
        """Stop serving `pid`, its partition's pin having moved away: as `fence`, then
        end what this replica's last record of it left unfinished (`let_go`), since the
        new owner's takeover may have read the record before that write (a turn marked
        in flight and acknowledged here would end for nobody)."""
        state = self.people.get(pid)
        unfinished = state is not None and bool(
            state.inflight or state.outbox or state.lock.locked()
            or state.changes != state.saved)
        inflight = list(state.inflight) if state is not None else []  # (the fence ends them)
        if state is None or not unfinished:
            await self.fence(pid, refused=False)
            return
        self._losing.add(pid)
        try:
            kept = await self.fence(pid, refused=False)  # (its history, turns drained)
            async with state.lock:  # a write under way has landed (or failed) by now
                pass
            # What it held: the turns in flight when the pin moved, and the endings
            # (answers held by those cut short included) not yet acknowledged; the
            # history they go with, for answers not recorded yet (`let_go`).
            done = await let_go(self, pid, state.partition, Participant(
                partition=state.partition, revision=state.revision, inflight=inflight,
                outbox=list(state.outbox),
                changes=state.changes, saved=state.saved, waiting=state.waiting), kept)
        except Exception as exc:  # the other participants are still dropped
            logger.warning("turnrouter: ending a lost participant's turns failed: %r", exc)
            done = False
        finally:
            self._losing.discard(pid)
            unsaved(state, _MOVED)  # (those `let_go` wrote have heard so)
        if done:
            self.unsure.pop(pid, None)  # (a write that gave up meanwhile: ended here)
        else:
            self._unsure(pid, state.partition)

    def _unsure(self, pid: str, n: int) -> None:
        """Remember `pid` (partition `n`) to end what its record holds later."""
        if len(self.unsure) < _MAX_UNSURE or pid in self.unsure:
            self.unsure[pid] = n
            self.on_unsure(pid, n)
        else:
            self.unsure_overflows += 1
            if is_logged(self.unsure_overflows):
                logger.warning("turnrouter: %d participants await the end of their "
                               "unfinished turns; past that they are claimed at their "
                               "next input (%d so far)", len(self.unsure),
                               self.unsure_overflows)

    async def drop(self, pid: str) -> None:
        """Hand `pid` over: no more writes from here, state dropped without release."""
        state = self.people.get(pid)
        if state is not None and state.changes != state.saved and not state.fenced:
            await self.write(pid, state)  # a patch's change no record holds yet: first
        state = self.people.pop(pid, None)
        if state is not None:
            async with state.lock:
                state.fenced = True
            unsaved(state, _HANDED)
        with contextlib.suppress(LifecycleError):
            await self._router().evict_participant(pid)

    def losses(self, n: int) -> int:
        """How many times this replica stopped serving partition `n` (`partition_lost`)."""
        return self._losses.get(n, 0)

    @property
    def replica(self) -> str:
        """This replica's name, as its records' `owner` holds it."""
        return self._replica

    def serves(self, pid: str) -> bool:
        """Whether `pid` is served, or being claimed, here."""
        return pid in self.people or pid in self._claiming

    async def say_again(self, pid: str, n: int, outbox: list[Ending]) -> None:
        """Publish again the recent endings a record holds, as recorded (no write; the
        stream drops those it already holds), for a participant not served here."""
        await _say_unserved(self, pid, n, _unfinished([], outbox, self._config, self._metrics))

    async def claim(self, pid: str, n: int) -> Participant | None:
        """This replica's state of `pid`, claiming the record on first contact and
        publishing what the previous owner left unfinished. None when refused. One
        claim of a participant at a time (two inputs may ask together)."""
        state = self.people.get(pid)
        if state is not None:
            return state
        entry = self._claiming.get(pid)
        if entry is None:
            entry = self._claiming[pid] = [asyncio.Lock(), 0]
        lock: asyncio.Lock = entry[0]
        entry[1] += 1
        losses = self._losses.get(n, 0)
        try:
            async with lock:
                state = self.people.get(pid)
                if state is None:
                    state = await self._claim(pid, n, losses)
                if state is not None and self._losses.get(n, 0) != losses:
                    # The partition moved away during the claim, after its participants
                    # were dropped: a state kept now would be served, stale, when the
                    # partition comes back (a turn its record says ended could run again).
                    await self.fence(pid, refused=False)
                    return None
                return state
        finally:
            entry[1] -= 1
            if not entry[1]:
                del self._claiming[pid]

    async def settle_unsure(self, pid: str, n: int) -> None:
        """End what this replica's last record of `pid` left unfinished (a turn marked
        in flight, an answer in the outbox) after a write whose outcome is unknown or a
        lost pin (`unsure`), now rather than at the participant's next input: `let_go`,
        which touches the record only while this replica is still its last writer.

        Never a claim: right after a reconnect this replica's pins date from before the
        outage, and a claim that stalled while the server pinned the partition elsewhere
        would land after the new owner's, fence it and end its running turn with the
        failure text. Tried again after the next reconnect when the server cannot be
        asked now."""
        if pid in self._losing:
            return  # `lose` ends it, with the answers it held (or makes it unsure again)
        try:
            if await let_go(self, pid, n):
                self.unsure.pop(pid, None)
        except Exception:
            logger.exception("turnrouter: ending a participant's unfinished turns failed")

    async def _claim(self, pid: str, n: int, losses: int) -> Participant | None:
        key = f"{n}.{encode_token(pid)}"
        for _attempt in range(3):
            revision, snapshot = 0, None
            inflight: list[str] = []
            outbox: list[Ending] = []
            ended: list[str] = []
            try:
                entry = await self._kv.get(key)
            except NatsError:
                entry = None
            parsed: ParticipantSnapshot | ContractValueError | None = None
            if entry is not None:
                # The revision even of an empty record (nats-py reads an empty value as
                # None): the claim's write must expect it, or it is refused every time.
                revision = entry.revision or 0
                value, router = entry.value or b"", self._router()
                try:
                    if len(value) > _READ_OFF_LOOP_BYTES:
                        # A big record is parsed and validated off the event loop, one
                        # at a time (the containers bound keeps each parse short).
                        record, parsed = await _off_loop(self, _read, value, pid, router)
                    else:
                        record, parsed = _read(value, pid, router)
                except ValueError as exc:
                    await self._quarantine(key, value, "invalid", exc)
                else:
                    inflight, snapshot = record.inflight, record.snapshot
                    outbox, ended = self.sound(record.outbox), record.ended
            if self._losses.get(n, 0) != losses:
                # The partition moved away while the record was read (a read that stalled
                # on a server coming back): a claim written now would land after the new
                # owner's, fence it and end its running turn.
                return None
            # The claim keeps what the previous owner left, until it is published.
            claim, outbox, cut = fitted_record(
                self._replica, inflight, snapshot, outbox,
                ",".join(map(_json_str, ended[-MAX_ENDED:])),
                self._link.max_payload - HEADER_ROOM)
            if cut:  # too big to write back
                await self._quarantine(key, value, "oversized", ValueError(
                    "a record past the server's max_payload"))
                snapshot = parsed = None
            try:
                revision = await self._kv.update(key, claim, last=revision)
            except KeyWrongLastSequenceError:
                if self._metrics is not None:
                    self._metrics.state_refused.inc()
                continue  # the previous owner wrote meanwhile: read again
            except NatsError as exc:
                self.health.failed(exc)
                self.claim_failures += 1
                if is_logged(self.claim_failures):
                    logger.warning("turnrouter: participant claim failed (%d so far): %r",
                                   self.claim_failures, exc)
                self._link.no_responders()  # the bucket may be gone: check
                return None
            break
        else:
            logger.warning("turnrouter: partition %d: a participant's record was claimed "
                           "by a newer write three times in a row; its input is retried", n)
            return None
        self.health.ok()
        state = Participant(partition=n, revision=revision)
        for turn_id in [*ended, *(e[0] for e in outbox), *inflight]:
            state.end(turn_id)  # ended now (in flight: its failure text, below)
        self.people[pid] = state
        if snapshot is not None:
            try:
                if not isinstance(parsed, ParticipantSnapshot):
                    raise parsed or ContractValueError("the snapshot was not read")
                self._router().import_participant(parsed)
            except (ContractValueError, LifecycleError) as exc:
                await self._quarantine(key, snapshot.encode("utf-8", "replace"),
                                       "invalid_snapshot", exc)
            else:
                state.snapshot = snapshot.encode()
        unfinished = _unfinished(inflight, outbox, self._config, self._metrics)
        # Recorded before they are published (as a turn's answer is), and kept in the
        # outbox until the stream acknowledges them: a server crash loses none.
        state.outbox.extend(unfinished)
        if (inflight or outbox) and not await self.write(pid, state):
            return None
        for ending in unfinished:
            await self._publish_ending(pid, state, ending)
        return state

    async def _quarantine(self, key: str, data: bytes, reason: str,
                          exc: BaseException) -> None:
        """A record (or its snapshot) that cannot be trusted: kept aside under
        `quarantine.<key>` for an operator (one per participant, best effort), counted
        as `turnrouter_runtime_rejected_messages_total{topic="nats_state"}`; the
        participant starts clean. The log line names the problem, not the content."""
        logger.warning("turnrouter: a participant's record was quarantined (%s): %s",
                       reason, one_line(str(exc)))
        with contextlib.suppress(Exception):
            self._router().report_rejected("nats_state", reason)
        with contextlib.suppress(Exception):
            await self._kv.put(f"quarantine.{key}", data[:min(
                MAX_STATE_BYTES, self._link.max_payload - HEADER_ROOM)])

    def sound(self, outbox: list[Ending]) -> list[Ending]:
        return said(outbox, self._router())

    async def write(self, pid: str, state: Participant, *, fresh: bool = True) -> bool:
        """Revision-checked write of `pid`'s record; False (and fenced) when refused.

        `fresh=False` (an in-flight mark) writes the snapshot of the previous write
        instead of exporting the participant again, unless an answer joined the outbox
        since (`Participant.answered`)."""
        async with state.lock:
            if state.fenced:
                return False
            if fresh or state.snapshot is None or state.answered:
                state.exported = state.changes  # (before the export: changes are sync)
                state.answered = False
                state.snapshot = self._router().export_participant_json(pid)
            outbox = state.outbox
            if outbox:
                # Endings past the horizon are never republished (_end_unfinished).
                horizon = time.time() - self._config.dedup_window / 2
                if len(outbox) > _MAX_OUTBOX or _any_before(outbox, horizon):
                    outbox[:] = [e for e in outbox if e[3] >= horizon][-_MAX_OUTBOX:]
            data, outbox, cut = fitted_record(
                self._replica, state.inflight[-_MAX_INFLIGHT:], state.snapshot, outbox,
                ",".join(state.ended.values()), self._link.max_payload - HEADER_ROOM)
            if cut:
                _oversized(self)
            written = frozenset(map(_turn_of, outbox)) if outbox else _NONE
            t0 = time.perf_counter()
            uncertain, failure, failed = False, None, None
            subject = state.key_subject
            if not subject:
                subject = state.key_subject = (
                    f"{self._subject}{state.partition}.{encode_token(pid)}")
            try:
                seq, error = pub_ack(await self._link.request(
                    subject, data,
                    {"Nats-Expected-Last-Subject-Sequence": str(state.revision)}))
            except (RequestFailed, ValueError) as exc:
                seq, error, failed = None, None, exc
            vanished = seq is None and bool(state.revision) and _vanished(error)
            if failed is not None or vanished or (
                    seq is None and _older(error, state.revision)):
                # No reply (sent again), or the record is gone without a trace (another
                # replica's claim, write or delete leaves one: the bucket was made
                # again) or back at an older revision of this replica's (a store gone
                # back), written again from what this replica holds, not dropping the
                # participant.
                seq, error, failure, remade = await _settled_write(
                    self._link, self._kv, subject[len(self._subject):], subject, data,
                    0 if vanished else state.revision, self._config, failed, t0,
                    self._replica)
                if remade:
                    _remade(self)
            if failure is not None:
                _write_failed(self, "failed (%d so far; the participant starts again from "
                                    "its record): %r", failure)
                uncertain = True
            if seq is not None:
                state.revision, state.recorded = seq, written
                if state.exported != state.saved:  # a patch's change: its caller hears
                    saved_until(state, state.exported)
                self.health.ok()
            elif not uncertain and not (isinstance(error, dict)
                                        and error.get("err_code") in _WRONG_LAST):
                # (logged rarely: a full bucket refuses every write)
                _write_failed(self, "refused by the server (%d failed so far): %s", error)
                uncertain = True
            if seq is not None and self._metrics is not None:
                self._metrics.state_write.observe(time.perf_counter() - t0)
        if uncertain:
            # Whether the record holds this write is unknown (no reply: the server may
            # have stored it and crashed), or it does not: the record, not this replica's
            # memory, says what the participant heard. Drop the participant here; its next
            # input claims the record again (what that write left unfinished is ended
            # then, and the input that caused it comes back unacknowledged; a turn
            # marked in flight has no input coming back: `settle_unsure` ends it).
            await self.fence(pid, refused=False)
            self._unsure(pid, state.partition)
            return False
        if error is not None:
            await self.fence(pid, refused=True)
            return False
        return True


def _write_failed(ledger: Ledger, what: str, error: object) -> None:
    """A state write that failed or was refused: health told, counted, logged the
    first time and at every power of ten (`what` takes the count and the error)."""
    ledger.health.failed(error)
    ledger.write_failures += 1
    if is_logged(ledger.write_failures):
        logger.warning("turnrouter: state write " + what, ledger.write_failures, error)


def _remade(ledger: Ledger) -> None:
    """A record found gone and written again (`Ledger.write`): counted and logged at
    the 1st, 10th, 100th..."""
    ledger.records_remade += 1
    if ledger._metrics is not None:
        ledger._metrics.deployment_missing.labels("record").inc()
    if is_logged(ledger.records_remade):
        logger.warning("turnrouter: a participant's record was gone from bucket %s, or "
                       "back at an older revision of this replica's (deleted and made "
                       "again? a server back on an older copy of its store?): written "
                       "again from this replica's state (%d so far)",
                       ledger._config.bucket, ledger.records_remade)


def _oversized(ledger: Ledger) -> None:
    """A record written without what did not fit (`fitted_record`): counted
    (`nats_state`, `oversized`) and logged at the 1st, 10th, 100th..."""
    ledger.oversized += 1
    with contextlib.suppress(Exception):
        ledger._router().report_rejected("nats_state", "oversized")
    if is_logged(ledger.oversized):
        logger.warning("turnrouter: a participant's record does not fit the NATS "
                       "server's max_payload (%d bytes): written without its snapshot "
                       "(%d so far; raise max_payload or lower the context budget)",
                       ledger._link.max_payload, ledger.oversized)


#: How often `await_last_writer` reads the record again: at first soon (a resent
#: write lands within a reconnect), then less often, since a takeover of many records
#: polls each one of them of a live owner (review10 L5: up to 40k reads in 2 s).
_LAST_WRITER_POLL, _LAST_WRITER_POLL_MAX = 0.05, 0.4


async def await_last_writer(ledger: Ledger, key: str, value: bytes, owner: str | None,
                            n: int, deadline: float | None = None) -> None:
    """Before a claim that would fence another replica still alive, the last writer
    (`owner`) of record `key` (read as `value`): wait until the record changes, at
    most until partition `n`'s grace ends, `failover_timeout` plus two probe periods
    after the first such wait since the partition came here (shared by its records),
    or `deadline` (loop time). Both replicas reconnect to a server back from a freeze
    within a reconnect period (0.1 s) of each other, and the previous owner sends its
    write again a moment after its reconnect: the grace covers that with room to spare.

    A server frozen or away past `failover_timeout` pins partitions afresh when it is
    back, and a new owner's claim could land before the previous owner's resent write
    of a turn's answer (its reconnect takes longer): that turn ended with the failure
    text although its answer was ready (chaos9 D1), whether the turn was marked in
    flight (a takeover ends it) or not (its query comes back as a redelivery). A
    change that leaves turns in flight under the same owner is not the end of the wait."""
    if not owner or owner == ledger._replica or ledger.alive is None:
        return
    loop = asyncio.get_running_loop()
    if loop.time() >= ledger.grace.get(n, math.inf):
        return  # the partition's grace is over: no wait, not even to ask
    if not await ledger.alive(owner):
        return  # gone: nothing of it will land
    config = ledger._config
    until = ledger.grace.setdefault(
        n, loop.time() + config.failover_timeout + 2 * config.probe_interval)
    if deadline is not None:
        until = min(until, deadline)
    pause = _LAST_WRITER_POLL
    while loop.time() < until:
        await asyncio.sleep(min(pause, max(0.0, until - loop.time())))
        pause = min(pause * 2, _LAST_WRITER_POLL_MAX)
        if ledger.heard(owner) is False:
            return  # gone meanwhile (killed just before the move): nothing will land
        try:
            entry = await ledger._kv.get(key)
        except KeyNotFoundError:
            return
        except NatsError:
            continue  # the server busy: asked again until the grace ends
        data = bytes(entry.value or b"")
        if data == value:
            continue
        try:
            record = await _parsed(ledger, data)
        except ValueError:
            return  # junk: the claim quarantines it
        if record.owner != owner or not record.inflight:
            return  # written: the claim reads what it wrote
        # Its turns still in flight: a resent in-flight mark landed first (the server
        # back from a crash), their answers' writes follow it (chaos11 D2: the claim
        # read the mark and ended the turn whose answer landed a moment later).
        value, pause = data, _LAST_WRITER_POLL


async def await_previous_owner(ledger: Ledger, pid: str, n: int, message_id: str,
                               again: bool) -> None:
    """`await_last_writer` for `pid`'s record, not served here, before the claim a query
    (`message_id`) makes when it was delivered `again` (its previous owner received it
    and may be writing its answer: the query then ends as a duplicate, not with the
    failure text), or when the record marks turns in flight (after a server crash a
    query taken and not acknowledged comes back as delivery 1, and its claim ended the
    turn whose answer landed a moment later: chaos11 D2). No wait when the record says
    that turn ended already, nor a read unless delivered again or the partition just
    arrived (`arrived_lately`). The caller checks that `pid` is not served here."""
    if not (again or arrived_lately(ledger, n)):
        return
    key = f"{n}.{encode_token(pid)}"
    try:
        entry = await ledger._kv.get(key)
    except NatsError:  # (none, or the server cannot say: the claim finds out)
        return
    data = bytes(entry.value or b"")
    try:
        record = await _parsed(ledger, data)
    except ValueError:
        return  # junk: the claim quarantines it
    if message_id not in record.ended and (again or record.inflight):
        await await_last_writer(ledger, key, data, record.owner, n)


async def still_ours(ledger: Ledger, pid: str, n: int) -> bool:
    """Whether `pid`'s record (partition `n`) is still this replica's: no other replica
    wrote it since (each write names its writer: a claim, a write, a departure's
    delete leave another owner or a tombstone), so what this replica holds of the
    participant is what the record holds, and it may serve them on. False when the
    server cannot say, and for a record not found at all: a server back on an empty
    store lost the outputs of the turns this replica holds as ended too, and their
    queries, sent again, must run (a claim of the empty record forgets them)."""
    try:
        entry = await ledger._kv.get(f"{n}.{encode_token(pid)}")
    except NatsError:
        return False
    try:
        record = await _parsed(ledger, entry.value or b"")
    except ValueError:
        return False
    return record.owner == ledger._replica


async def let_go(ledger: Ledger, pid: str, n: int, held: Participant | None = None,
                 kept: ParticipantSnapshot | None = None) -> bool:
    """End what `pid`'s record left unfinished when this replica wrote it last and
    no longer serves the participant: a new owner that claimed the record ended it
    (its claim is a newer write), but one whose takeover read the record before this
    replica's last write never will. The turns it holds in flight are ended (the
    failure text recorded in the outbox, a revision-checked write of the revision
    read, then published) and its recorded answers published again; refused, a
    claim came first and ended them. False when the server cannot be asked now.

    Answers this replica `held` and had not recorded (their write was fenced when the
    pin moved) are written and said instead of the failure text, with the history
    drained by the fence (`kept`), when it holds their exchange (an answer said by a
    destination cut before it returned has none, and its turn ends with the failure
    text, as the history says). chaos9 D1: an answer
    given during a server freeze was lost so, about once per three freezes.

    With no record at all (a server back on an empty store, the bucket deleted), what
    this replica `held` in flight or unacknowledged is said from here: nobody else
    knows of it (its input was acknowledged, the store that held it is gone)."""
    if pid in ledger.people or pid in ledger._claiming:
        return True  # served here again: that claim ends what the record holds
    key = f"{n}.{encode_token(pid)}"
    try:
        entry = await ledger._kv.get(key)
    except KeyNotFoundError:
        if held is not None and (held.inflight or held.outbox):
            await _say_unserved(ledger, pid, n, _unfinished(
                held.inflight, held.outbox, ledger._config, ledger._metrics))
        return True
    except NatsError:
        return False
    try:
        record = await _parsed(ledger, entry.value or b"")
    except ValueError:
        return True  # junk: the next claim quarantines it
    # Answers this replica held and had not recorded (their write was fenced by the
    # move): said rather than the failure text, their exchanges in the held history.
    fresh: list[Ending] = []
    known = {*record.ended, *(e[0] for e in record.outbox)}
    if held is not None and held.outbox and kept is not None:
        exchanges = {item.turn_id for item in kept.history}
        fresh = [e for e in held.outbox if e[0] not in known and e[0] in exchanges]
    # Changes made outside turns (context patches) that no record holds: written with
    # the held history, while this replica is still the record's last writer.
    changed = held is not None and kept is not None and held.changes != held.saved
    # The record went back to an older revision of this replica's (a server back on an
    # older copy of its store): the turns it held in flight are in no record, and
    # nobody else ends them (chaos17 F1: they never ended). Ended here, with the
    # history it held.
    back = held is not None and record.owner == ledger._replica and (
        0 < (entry.revision or 0) < held.revision)
    lost = [turn for turn in held.inflight if turn not in known
            and turn not in record.inflight and turn not in {e[0] for e in fresh}] if (
        back and held is not None) else []
    changed = changed or (back and kept is not None)
    if record.owner != ledger._replica or not (
            record.inflight or record.outbox or fresh or changed or lost):
        return True  # claimed since (the claim ended them), or nothing left
    if pid in ledger.people or pid in ledger._claiming:
        return True
    outbox = ledger.sound([*record.outbox, *fresh])
    if not record.inflight and not fresh and not changed and not lost:
        await ledger.say_again(pid, n, outbox)  # nothing to end, endings maybe unheard
        return True
    unfinished = _unfinished([*record.inflight, *lost], outbox, ledger._config,
                             ledger._metrics)
    ended = dict.fromkeys([*record.ended, *(e[0] for e in outbox),
                           *record.inflight, *lost])
    snapshot = kept.to_json() if (fresh or changed) and kept is not None else (
        record.snapshot)
    value, unfinished, _cut = fitted_record(
        ledger._replica, [], snapshot, unfinished,
        ",".join(map(_json_str, list(ended)[-MAX_ENDED:])),
        ledger._link.max_payload - HEADER_ROOM)
    try:
        await ledger._kv.update(key, value, last=entry.revision)
    except KeyWrongLastSequenceError:
        if ledger._metrics is not None:
            ledger._metrics.state_refused.inc()
        return True  # a claim came first: it ended them
    except NatsError:
        return False
    if changed and held is not None:
        saved_until(held, held.changes)
    # Served by no one here: the endings stay in the record's outbox for the next
    # claim (which publishes them again; the stream drops the duplicates).
    await _say_unserved(ledger, pid, n, unfinished)
    return True


async def _say_unserved(ledger: Ledger, pid: str, n: int, endings: list[Ending]) -> None:
    """Publish `endings` of `pid`, served by no one here, remembered in `unheard`
    until the stream acknowledged them (at most `_MAX_UNSURE` participants: past
    that, said once, logged)."""
    released = Participant(partition=n, outbox=list(endings), fenced=True)
    unheard = ledger.unheard
    if len(unheard) >= _MAX_UNSURE and pid not in unheard:
        # Full: those acknowledged, or too old to be said again, make room.
        horizon = time.time() - ledger._config.dedup_window / 2
        for other in [p for p, state in unheard.items()
                      if all(ending[3] < horizon for ending in state.outbox)]:
            del unheard[other]
    if len(unheard) < _MAX_UNSURE or pid in unheard:
        unheard[pid] = released
    else:
        ledger.unheard_overflows += 1
        if is_logged(ledger.unheard_overflows):
            logger.warning("turnrouter: %d participants not served here await the "
                           "stream's acknowledgment of their endings; endings past that "
                           "are said once (%d so far)", len(unheard),
                           ledger.unheard_overflows)
    for ending in endings:
        await ledger._publish_ending(pid, released, ending)
