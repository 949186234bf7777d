"""Per-participant router state, and its snapshot for moving between replicas."""

from __future__ import annotations

import enum
import sys
import weakref
from collections.abc import Collection
from json.encoder import encode_basestring_ascii as _json_str
from typing import TYPE_CHECKING, Any

from pydantic_core import to_json

from . import _strict_json as strict_json
from ._config import MAX_ROUTE_CHARS
from ._contracts import MAX_HISTORY_VERSION, MAX_ID_CHARS, MAX_TIMESTAMP_US, AgentExchange
from ._exceptions import ContractValueError, LifecycleError
from ._frontend import (
    MAX_SESSION_TURNS,
    MAX_SNAPSHOT_BYTES,
    MAX_SNAPSHOT_CONTAINERS,
    MAX_SNAPSHOT_ITEMS,
    SNAPSHOT_ITEMS_SLACK,
    ParticipantSnapshot,
    SnapshotExchange,
    SnapshotPatch,
    checked_snapshot,
    read_from_json,
    reimported,
)
from ._history import History, Meta, view_items
from ._lifecycle import OwnedOperation, TurnQueue
from ._observer import ParticipantChanged
from ._patches import (
    MAX_IMPORTED_PATCH_DEPTH,
    AppliedContextPatch,
    PatchExchangeId,
    PendingContextPatch,
    checked_patch,
    patch_payload_bytes,
    refuse_non_finite,
)
from ._redact import preview

if TYPE_CHECKING:
    from ._config import RouterConfig
    from ._turn import Answer, Turn

__all__ = [
    "EXCHANGE_ITEMS", "SNAPSHOT_SLACK", "Participant", "Phase", "Registry", "RouterPhase",
    "note_turn", "refuse_lossy", "restore", "snapshot_json", "snapshot_of",
]

#: Bytes an export keeps free under `MAX_SNAPSHOT_BYTES`: an import checks the export of
#: what it installs with every default field written out (a few dozen bytes more).
SNAPSHOT_SLACK = 1024
#: The JSON of an id of `MAX_ID_CHARS` control characters (each escaped as `\u00XX`).
_ID_JSON = 6 * MAX_ID_CHARS + 2
#: The most JSON one retained exchange takes beyond its text (escaped, at most 6 bytes a
#: counted byte; a merged patch's digest and task id are written three times): its turn
#: id and stamp, or a patch's ids, stamp, time and field names.
_EXCHANGE_JSON = 4096
#: The most values (`strict_json.items`) one plain retained exchange holds (7 in an
#: export: its object and fields).
EXCHANGE_ITEMS = 16

#: Snapshots `Registry.prepare` made (weakly held, by identity and the number of
#: exchanges their history was cut to): what an import of theirs would install, read
#: back and checked, so the import skips those steps.
_PREPARED: weakref.WeakValueDictionary[tuple[int, int], ParticipantSnapshot] = (
    weakref.WeakValueDictionary())
#: Snapshots whose patches were found free of NaN and infinity (weakly held).
_FINITE: weakref.WeakValueDictionary[int, ParticipantSnapshot] = weakref.WeakValueDictionary()
#: The payload size (`patch_payload_bytes`) of each exchange an import of a prepared
#: snapshot installs (0 for a conversation exchange), by the snapshot's id while it
#: lives: measured by `Registry.prepare` off the event loop (serializing 256 merged
#: patches' facts again cost the loop ~10 ms of a 14 ms install: redteam20 F2).
_PAYLOADS: dict[int, tuple[int, ...]] = {}


class Phase(enum.Enum):
    OPEN = "open"
    DEPARTING = "is under way"
    FAILED = "cleanup failed"


class Participant:
    """Router-owned state of one participant (kept small: thousands may be active)."""

    __slots__ = (
        "cleanup_pending", "current", "departure", "exported", "exported_head", "focus",
        "history", "initialized", "pending", "phase", "pid", "queue", "reports_heard",
        "session_turns", "unheard", "unreleased", "used",
    )

    def __init__(self, pid: str, history: History) -> None:
        self.pid = pid
        self.focus: str | None = None
        self.history = history
        #: Destinations admitted or answering for this participant, in first-use order
        #: (a tuple: a handful of routes, and the collector does not track it).
        self.used: tuple[str, ...] = ()
        self.initialized = False
        self.queue = TurnQueue()
        self.phase = Phase.OPEN
        self.departure: OwnedOperation | None = None
        #: Destinations whose departure release failed, to retry (None: not departed yet).
        self.unreleased: set[str] | None = None
        self.cleanup_pending = False
        #: Human-gated patches awaiting approval, oldest first (None: none held yet).
        self.pending: dict[str, PendingContextPatch] | None = None
        #: The ids of this session's turns, oldest first, while there are at most
        #: `MAX_SESSION_TURNS` (None: more, or restored from a snapshot without them):
        #: a patch spawned by a turn not here is from an earlier session (`PatchDesk`).
        self.session_turns: dict[str, None] | None = {}
        #: The running turn, and an answered turn whose first audio is not reported yet.
        self.current: Turn | None = None
        self.unheard: Answer | None = None
        #: Whether a heard report ever matched one of its turns: the front end reports,
        #: so an answer unreported when the participant speaks again was not heard yet.
        self.reports_heard = False
        #: The JSON of the exchanges at the latest `export_json` (None: never exported):
        #: (the history's metadata list, the index in it of the first piece, the pieces).
        self.exported: tuple[list[Meta], int, list[bytes]] | None = None
        #: The snapshot's JSON around its history at the latest `export_json`: (what it
        #: was built from, the bytes before `"history":`, the bytes after its version).
        self.exported_head: tuple[tuple[Any, ...], bytes, bytes] | None = None


def note_turn(state: Participant, turn_id: str) -> None:
    """Remember that `turn_id` is a turn of the participant's current session (until
    it has had `MAX_SESSION_TURNS`: then none is remembered)."""
    turns = state.session_turns
    if turns is not None and turn_id not in turns:
        if len(turns) < MAX_SESSION_TURNS:
            turns[turn_id] = None
        else:
            state.session_turns = None


class RouterPhase(enum.Enum):
    RUNNING = "running"
    STOPPING = "the router is shutting down"
    STOP_FAILED = "the router's last stop() failed"


class Registry:
    """The participants the router holds state for, and why anyone is closed.

    `refusal()` is the one place that says why a participant (or the whole router)
    takes no turn and no context patch right now.
    """

    __slots__ = ("_cfg", "_observer", "_outgrows", "departed", "participants", "phase",
                 "stopping")

    def __init__(self, cfg: RouterConfig) -> None:
        self._cfg = cfg
        self._outgrows = may_outgrow(cfg)
        self._observer = cfg.observer
        self.participants: dict[str, Participant] = {}
        # (admission control projects the loop's load per participant held)
        cfg.load.held = self.participants.__len__
        #: With a participant-joined topic, departed participants stay closed until they
        #: rejoin; oldest first (a dict keeps insertion order), at most
        #: `max_departed_participants` of them.
        self.departed: dict[str, None] = {}
        #: The router's one state value; `stopping` is the shutdown to join while STOPPING.
        self.phase = RouterPhase.RUNNING
        self.stopping: OwnedOperation | None = None

    def get(self, pid: str) -> Participant | None:
        return self.participants.get(pid)

    def new_history(self) -> History:
        cfg = self._cfg
        return History(cfg.budget, cfg.max_history_exchanges)

    def close_departed(self, pid: str) -> None:
        """Keep `pid` closed until it rejoins; forget the oldest beyond the bound."""
        departed = self.departed
        departed.pop(pid, None)
        departed[pid] = None
        limit = self._cfg.max_departed_participants
        if len(departed) > limit:
            oldest = next(iter(departed))
            del departed[oldest]
            self._cfg.overflows.report(
                "departed_participants",
                f"more than {limit} departed participants: the oldest may take turns again "
                "without rejoining")

    def router_refusal(self) -> str:
        """Why the router takes nothing now ("" when it is open)."""
        phase = self.phase
        return "" if phase is RouterPhase.RUNNING else phase.value

    def refusal(self, pid: str) -> str:
        """Why `pid` takes no turn now ("" when open)."""
        refusal = self.router_refusal()
        if refusal:
            return refusal
        if pid in self.departed:
            return "the participant left"
        state = self.participants.get(pid)
        if state is not None and state.phase is not Phase.OPEN:
            return f"the participant's departure {state.phase.value}"
        return ""

    def admit(self, pid: str) -> Participant:
        """The participant's state for a new turn (created if new), or `LifecycleError`."""
        refusal = self.refusal(pid)
        if refusal:
            until = ("until stop() ends" if refusal == RouterPhase.STOPPING.value else
                     "until stop() succeeds" if refusal == RouterPhase.STOP_FAILED.value else
                     "until a participant-joined event readmits them"
                     if pid in self.departed else
                     "until participant_left() completes")
            raise LifecycleError(f"participant {pid!r}: {refusal}; handle() is closed {until}")
        state = self.participants.get(pid)
        if state is not None:
            return state
        limit = self._cfg.max_participants
        if len(self.participants) >= limit:
            self._cfg.overflows.report("participants", f"a new participant refused: the "
                                       f"router holds max_participants ({limit})")
            raise LifecycleError(
                f"participant {pid!r} refused: the router already holds {limit} participants "
                "(max_participants); departures make room")
        state = self.participants[pid] = Participant(pid, self.new_history())
        self._observer.participant_added(ParticipantChanged(pid))
        return state

    def install(
        self, snapshot: ParticipantSnapshot, routes: Collection[str]
    ) -> Participant | None:
        """Install a participant from a snapshot; return the state it replaced."""
        pid = snapshot.participant_id
        unknown = {route for route in (*snapshot.used, snapshot.focus)
                   if route is not None and route not in routes}
        if unknown:
            shown = ", ".join(preview(route) for route in sorted(unknown)[:3])
            more = f" (+{len(unknown) - 3} more)" if len(unknown) > 3 else ""
            raise ContractValueError(
                f"participant snapshot of {preview(pid)} names unregistered routes: "
                f"{shown}{more}")
        for held in snapshot.pending:
            if held.participant_id not in (None, pid):
                raise ContractValueError(
                    f"participant snapshot of {preview(pid)} holds a patch of "
                    f"{preview(held.participant_id)}")
        current = self.participants.get(pid)
        if current is not None and (current.queue.runs() or current.phase is not Phase.OPEN):
            raise LifecycleError(
                f"participant {pid!r} has a turn in flight or is departing here; "
                "import_participant() refused")
        limit = self._cfg.max_pending
        if len(snapshot.pending) > limit:
            self._cfg.overflows.report("pending_patches", f"a snapshot holding "
                                       f"{len(snapshot.pending)} patches refused")
            raise ContractValueError(
                f"participant snapshot of {pid!r} holds {len(snapshot.pending)} pending "
                f"patches, over max_pending_patches ({limit}); import_participant() refused")
        keep = self._cfg.max_history_exchanges
        ready = _PREPARED.get((id(snapshot), keep)) is snapshot
        if not ready:  # (`prepare` checked them, off the event loop)
            self._check_pending(snapshot)
        limit = self._cfg.max_participants
        if current is None and len(self.participants) >= limit:
            self._cfg.overflows.report("participants", f"an imported participant refused: "
                                       f"the router holds max_participants ({limit})")
            raise LifecycleError(
                f"participant {pid!r} refused: the router already holds {limit} participants "
                "(max_participants); import_participant() refused")
        fresh = snapshot if ready else self._fresh(snapshot)
        restored = restore(fresh, self.new_history(),  # may raise: nothing changed yet
                           _PAYLOADS.get(id(fresh)) if ready else None)
        if current is None:
            self._observer.participant_added(ParticipantChanged(pid))
        self.participants[pid] = restored
        if snapshot.departed and self._cfg.joined_topic:
            # Closed until a participant-joined event, as this router's own departures
            # close them; a router without that topic admits the next turn anyway.
            self.close_departed(pid)
        else:
            self.departed.pop(pid, None)
        return current

    def _check_pending(self, snapshot: ParticipantSnapshot, *, report: bool = True) -> None:
        """The bounds and checks `apply_context_patch()` holds, of each held patch of
        `snapshot` (`ContractValueError`; an overflow of `max_patch_bytes` counted when
        `report`)."""
        pid, limit = snapshot.participant_id, self._cfg.max_patch_bytes
        for held in snapshot.pending:
            try:
                _, size = checked_patch(held.patch, limit, MAX_IMPORTED_PATCH_DEPTH)
            except ContractValueError as exc:
                raise ContractValueError(
                    f"participant snapshot of {preview(pid)} holds a pending patch its "
                    f"export could not carry: {exc}; import_participant() refused") from None
            if size > limit:
                if report:
                    self._cfg.overflows.report("patch_bytes", f"a snapshot's pending patch "
                                               f"of {size} bytes refused")
                raise ContractValueError(
                    f"participant snapshot of {preview(pid)} holds a pending patch of {size} "
                    f"bytes serialized, over max_patch_bytes ({limit}); "
                    "import_participant() refused")

    def _fresh(self, snapshot: ParticipantSnapshot) -> ParticipantSnapshot:
        """What an import installs of `snapshot` (checked): its newest
        `max_history_exchanges` exchanges (the older ones are not exported and read
        back: 12,000 tiny exchanges cost ~40 ms of the event loop, and a takeover reads
        many records), exported and read back: what is installed is what the next
        replica imports, a field set past validation (object.__setattr__) caught."""
        keep = self._cfg.max_history_exchanges
        if len(snapshot.history) > keep:
            snapshot = snapshot.model_copy(update={"history": snapshot.history[-keep:]})
        try:
            return reimported(snapshot)
        except ContractValueError:
            restore(snapshot, self.new_history())  # names the patch, when one is the cause
            raise

    def prepare(self, snapshot: ParticipantSnapshot) -> ParticipantSnapshot:
        """The steps of an import that touch no router state, for a thread (a NATS
        worker's big record: a patch-heavy 1 MB snapshot cost ~200 ms of them on the
        event loop): `snapshot` validated, checked for NaN and infinity, cut and read
        back (`_fresh`), its held patches checked as `apply_context_patch()` checks
        them. `install` of what it returns skips them; `ContractValueError` as the
        import would raise."""
        snapshot = checked_snapshot(snapshot)
        refuse_lossy(snapshot)
        fresh = self._fresh(snapshot)
        _FINITE[id(fresh)] = fresh  # (read back from a snapshot found finite)
        try:
            # The held patches' checks too (each validated and read back again: 8 of
            # 4,500 keys each held the loop ~25 ms: redteam20 F2). One refused is left
            # to the import, which counts the refusal where the router's counts are.
            self._check_pending(fresh, report=False)
        except ContractValueError:
            return fresh
        keep = self._cfg.max_history_exchanges
        if id(fresh) not in _PAYLOADS:
            _PAYLOADS[id(fresh)] = tuple(
                0 if item.patch is None else patch_payload_bytes(item.patch.patch)
                for item in fresh.history[-keep:])
            weakref.finalize(fresh, _PAYLOADS.pop, id(fresh), None)
        _PREPARED[id(fresh), keep] = fresh
        return fresh

    def export(self, pid: str) -> ParticipantSnapshot | None:
        """The participant's movable state (None when nothing is held for it)."""
        departed = pid in self.departed
        state = self.participants.get(pid)
        if state is None:
            # (a session with no turn yet: the participant's next turn starts it)
            return ParticipantSnapshot(participant_id=pid, departed=True,
                                       session_turns=()) if departed else None
        return self.snapshot(state, departed)

    def snapshot(self, state: Participant, departed: bool) -> ParticipantSnapshot:
        """`snapshot_of(state, departed)`, within the snapshot bounds (`fitted`)."""
        if self._outgrows:
            self.fitted(state, departed)
        return snapshot_of(state, departed)

    def fitted(self, state: Participant, departed: bool) -> bytes:
        """`snapshot_json(state, departed)`, first dropping the participant's oldest
        exchanges while it is over `MAX_SNAPSHOT_BYTES` (less `SNAPSHOT_SLACK`) or
        `MAX_SNAPSHOT_CONTAINERS`: no replica could import it, so a move would lose the
        participant's whole state (on NATS its record quarantined, the participant
        started clean). Only a configuration whose participants may outgrow the bounds
        (`may_outgrow`: a `context_budget_bytes` of hundreds of kB, thousands of
        `max_history_exchanges`) checks, and only when it exports: a router that never
        moves its participants keeps what its budgets keep. Held patches are not dropped:
        `apply_context_patch` refuses one the bounds cannot hold (`PatchDesk`)."""
        data = snapshot_json(state, departed)
        if not self._outgrows:
            return data
        over = len(data) - (MAX_SNAPSHOT_BYTES - SNAPSHOT_SLACK)
        extra = (strict_json.containers(data, MAX_SNAPSHOT_CONTAINERS)
                 - MAX_SNAPSHOT_CONTAINERS if len(data) > 2 * MAX_SNAPSHOT_CONTAINERS else 0)
        roomy = MAX_SNAPSHOT_ITEMS - SNAPSHOT_ITEMS_SLACK
        values = strict_json.items(data, roomy) - roomy if len(data) > roomy else 0
        if (over <= 0 and extra <= 0 and values <= 0) or state.exported is None:
            return data
        pieces = state.exported[2]
        drop = 0
        while drop < len(pieces) and (over > 0 or extra > 0 or values > 0):
            over -= len(pieces[drop])  # (its comma left out: never counted short)
            extra -= strict_json.containers(pieces[drop], 0)
            values -= strict_json.items(pieces[drop], 0)  # (its comma left out, too)
            drop += 1
        state.history.drop_oldest(drop)
        self._cfg.overflows.report(
            "snapshot_history", f"{drop} oldest exchanges of a participant dropped: its "
            "snapshot would pass MAX_SNAPSHOT_BYTES, MAX_SNAPSHOT_CONTAINERS or "
            "MAX_SNAPSHOT_ITEMS")
        return snapshot_json(state, departed)

    @property
    def trims_exports(self) -> bool:
        """Whether an export may drop the oldest exchanges to fit the bounds (`fitted`)."""
        return self._outgrows

    def measure(self, state: Participant) -> tuple[bytes, bytes]:
        """The participant's snapshot JSON as it stands, and its part besides the
        history, trimming nothing (a check of what a change would add: `fitted` trims
        only when the router exports)."""
        data = snapshot_json(state, state.pid in self.departed)
        head = state.exported_head
        if head is None:  # (not the layout the export reuses: all of it, to be safe)
            return data, data
        return data, head[1] + head[2]

    def export_json(self, pid: str) -> bytes | None:
        """`export(pid)` as its JSON (UTF-8), each exchange serialized once (see
        `snapshot_json`)."""
        state = self.participants.get(pid)
        if state is None:
            snapshot = self.export(pid)
            return None if snapshot is None else snapshot.to_json().encode()
        return self.fitted(state, pid in self.departed)

    def heard_answer(self, pid: str, turn_id: str) -> Answer | None:
        """The answer of turn `turn_id` whose heard time a front end may report."""
        state = self.participants.get(pid)
        if state is None:
            return None
        current = state.current
        for answer in (state.unheard, None if current is None else current.answer):
            if (answer is not None and answer.owner.report_heard
                    and answer.owner.turn.turn_id == turn_id):
                return answer
        return None

    def forget(self, state: Participant) -> None:
        if self.participants.get(state.pid) is state:
            del self.participants[state.pid]
            self._observer.participant_removed(ParticipantChanged(state.pid))


def may_outgrow(cfg: RouterConfig) -> bool:
    """Whether a participant's snapshot could pass `MAX_SNAPSHOT_BYTES` or
    `MAX_SNAPSHOT_CONTAINERS` under `cfg`'s bounds, counted at their worst: every text
    escaped (6 bytes a byte), every id as long as allowed, every patch held. A default
    router's worst is about 2.4 MB and 300 plain exchanges' objects (its patches' objects
    are bounded when applied: `PatchDesk`)."""
    held = cfg.max_pending * (2 * cfg.max_patch_bytes + 4 * _ID_JSON)
    routes = (len(cfg.agents) + 1) * (4 * MAX_ROUTE_CHARS + 8)
    size = (18 * cfg.budget + cfg.max_history_exchanges * _EXCHANGE_JSON + held + routes
            + (MAX_SESSION_TURNS + 1) * _ID_JSON + SNAPSHOT_SLACK)
    # Values (`strict_json.items`), two bytes each at least but for containers (bounded
    # on their own): merged patches' in the history, plain exchanges, held patches
    # (refused past the bound when applied, `PatchDesk`, counted so that the rest fits).
    values = (cfg.budget // 2 + cfg.max_history_exchanges * EXCHANGE_ITEMS
              + cfg.max_pending * (cfg.max_patch_bytes // 2) + MAX_SNAPSHOT_CONTAINERS
              + 4096)
    return (size > MAX_SNAPSHOT_BYTES or values + SNAPSHOT_ITEMS_SLACK > MAX_SNAPSHOT_ITEMS
            or cfg.max_history_exchanges + 64 > MAX_SNAPSHOT_CONTAINERS)


def snapshot_of(state: Participant, departed: bool) -> ParticipantSnapshot:
    """The participant's movable state (see `ParticipantSnapshot`)."""
    history = state.history
    exchanges = tuple(_exchange_snapshot(exchange, meta) for exchange, meta in zip(
        history.exchanges, view_items(history.view()), strict=True))
    return _snapshot(state, departed, exchanges)


def snapshot_json(state: Participant, departed: bool) -> bytes:
    """`snapshot_of(state, departed).to_json()` as UTF-8, from each exchange's JSON kept
    since the previous call: a front end saving the participant after every exchange
    pays for the new exchanges, not for the whole history each time.

    The history's metadata list is only ever appended to (trimming advances its start;
    any other change makes a new list, see `History`), and `exchanges[i]` goes with
    `items[start + i]`; so while the list is the same object, the pieces of the
    positions exported before are still right, and only the positions after them are
    new.
    """
    history = state.history
    items, start, end = history.view()
    exported = state.exported
    if exported is not None and exported[0] is items and exported[1] <= start:
        _, first, pieces = exported
        if start > first:
            del pieces[:start - first]
    else:
        pieces = []
    done = start + len(pieces)
    if done < end:
        exchanges = history.exchanges
        pieces += [_exchange_json(exchanges[index - start], items[index])
                   for index in range(done, end)]
    state.exported = (items, start, pieces)
    # The history's pieces are copied once into the snapshot (a participant's history is
    # most of it, and it is exported on every turn of a NATS worker).
    joined = b",".join(pieces)
    version = history.version
    pending = tuple(state.pending.values()) if state.pending else ()
    key = (state.focus, state.used, pending, state.initialized, departed,
           state.cleanup_pending)
    head = state.exported_head
    if head is None or head[0] != key or not 0 <= version <= MAX_HISTORY_VERSION:
        # Built (and validated) by the model while any of its fields but the history,
        # its version and the session's turns changed since the previous call; reused
        # around them otherwise.
        data = _snapshot(state, departed, (), turns=False).to_json().encode()
        # Field values are JSON-escaped strings, so the first `"history":[]` is the field.
        marker = b'"history":[],"history_version":%d,' % version
        at = data.find(marker)
        if at < 0:  # not the layout expected: no reuse
            state.exported_head = None
            return snapshot_of(state, departed).to_json().encode()
        head = state.exported_head = (key, data[:at], data[at + len(marker):])
    turns = state.session_turns
    # (the model's JSON of the field, its last, as `to_json` writes it: pydantic's own
    # writer)
    session = b"" if turns is None else b',"session_turns":%s' % to_json(tuple(turns))
    return b'%s"history":[%s],"history_version":%d,%s%s}' % (
        head[1], joined, version, head[2][:-1], session)


def _exchange_json(exchange: AgentExchange, meta: Meta) -> bytes:
    """`_exchange_snapshot(exchange, meta).model_dump_json()` as UTF-8.

    The router built the exchange and its id and stamp from validated parts, so a
    conversation exchange whose texts are printable ASCII (what the model's JSON writes
    unchanged, `"` and `\\` escaped alike) is written directly, byte for byte the same,
    without a model built and validated again on every turn. Anything else (a patch,
    other text) goes through the model.
    """
    exchange_id, stamp, _ = meta
    user, assistant = exchange.user, exchange.assistant
    if (type(user) is str and type(assistant) is str and user.isascii() and user.isprintable()
            and assistant.isascii() and assistant.isprintable()
            and (exchange_id is None or (type(exchange_id) is str and exchange_id.isascii()
                                         and exchange_id.isprintable()
                                         and len(exchange_id) <= MAX_ID_CHARS))
            and (stamp is None or (type(stamp) is int and 0 <= stamp <= MAX_TIMESTAMP_US))):
        return (f'{{"user":{_json_str(user)},"assistant":{_json_str(assistant)},"turn_id":'
                f'{"null" if exchange_id is None else _json_str(exchange_id)},"stamp_us":'
                f'{"null" if stamp is None else stamp},"patch":null}}').encode()
    return _exchange_snapshot(exchange, meta).model_dump_json().encode()


def _exchange_snapshot(exchange: AgentExchange, meta: Meta) -> SnapshotExchange:
    exchange_id, stamp, _ = meta
    patch = None
    turn_id = None
    if isinstance(exchange_id, PatchExchangeId):
        applied = exchange_id.applied
        patch = SnapshotPatch(patch_id=applied.patch_id, task_id=applied.task_id,
                              strategy=applied.strategy, diverged=applied.diverged,
                              patch=applied.patch)
    elif exchange_id is not None:
        turn_id = str(exchange_id)
    return SnapshotExchange(user=exchange.user, assistant=exchange.assistant,
                            turn_id=turn_id, stamp_us=stamp, patch=patch)


def _snapshot(state: Participant, departed: bool,
              exchanges: tuple[SnapshotExchange, ...], *, turns: bool = True
              ) -> ParticipantSnapshot:
    session = state.session_turns
    return ParticipantSnapshot(
        participant_id=state.pid, focus=state.focus, history=exchanges,
        history_version=state.history.version,
        session_turns=None if session is None or not turns else tuple(session),
        used=tuple(sorted(state.used)),
        pending=tuple(state.pending.values()) if state.pending else (),
        initialized=state.initialized, departed=departed,
        cleanup_pending=state.cleanup_pending,
    )


def restore(snapshot: ParticipantSnapshot, history: History,
            payloads: tuple[int, ...] | None = None) -> Participant:
    """Participant state rebuilt from a snapshot into an empty `history` (its bounds
    apply). Only the newest `history.max_exchanges` exchanges are read: appending
    drops the oldest, so older ones could not be kept anyway, and a snapshot of many
    tiny exchanges costs what the kept ones cost. `payloads`: the payload size of each
    of those exchanges' patches, measured already (`Registry.prepare`)."""
    state = Participant(snapshot.participant_id, history)
    state.focus = snapshot.focus
    state.used = tuple(dict.fromkeys(snapshot.used))
    state.initialized = snapshot.initialized
    state.cleanup_pending = snapshot.cleanup_pending
    turns = snapshot.session_turns
    state.session_turns = None if turns is None else dict.fromkeys(turns)
    # JSON holds no value its export cannot write back but NaN and infinity (`NaN`,
    # `Infinity`, `1e400`: the next export would make them null), which a walk of the
    # patch's data finds; only Python-built snapshots' patches are read back in full
    # (a patch-heavy import costs ~3x with that check).
    check = not read_from_json(snapshot)
    finite = _FINITE.get(id(snapshot)) is snapshot  # (checked already: `prepare`)
    kept = snapshot.history[-history.max_exchanges:]
    if payloads is not None and len(payloads) != len(kept):
        payloads = None
    for index, item in enumerate(kept):
        exchange = AgentExchange(item.user, item.assistant)
        if item.patch is None:
            history.append(exchange, item.turn_id, item.stamp_us)
            continue
        patch = item.patch
        try:  # an export must read it back (a snapshot built in Python may hold any int)
            if check:
                checked_patch(patch.patch, sys.maxsize)
            elif not finite:
                refuse_non_finite(patch.patch)
        except ContractValueError as exc:
            raise ContractValueError(
                f"participant snapshot of {preview(snapshot.participant_id)} holds an applied "
                f"patch its export could not carry: {exc}; import_participant() refused"
            ) from None
        applied = AppliedContextPatch(
            patch_id=patch.patch_id, participant_id=snapshot.participant_id,
            task_id=patch.task_id, strategy=patch.strategy, diverged=patch.diverged,
            patch=patch.patch, exchange_id=f"patch:{patch.task_id}",
        )
        history.add_background(exchange, PatchExchangeId(applied), item.stamp_us,
                               patch_payload_bytes(patch.patch) if payloads is None
                               else payloads[index], replace=False)
    history.version = snapshot.history_version
    history.settle()
    if snapshot.pending:
        state.pending = {held.patch_id: held if held.participant_id is not None else
                         held.model_copy(update={"participant_id": snapshot.participant_id})
                         for held in snapshot.pending}
    return state


def refuse_lossy(snapshot: ParticipantSnapshot) -> None:
    """`ContractValueError` when a patch of `snapshot`, applied or pending, holds a NaN or
    an infinity: its export would carry them as null (an import that reads the export
    back would take the changed value)."""
    if _FINITE.get(id(snapshot)) is snapshot:
        return
    for item in snapshot.history:
        if item.patch is None:
            continue
        try:
            refuse_non_finite(item.patch.patch)
        except ContractValueError as exc:
            raise ContractValueError(
                f"participant snapshot of {preview(snapshot.participant_id)} holds an applied "
                f"patch its export could not carry: {exc}; import_participant() refused"
            ) from None
    for held in snapshot.pending:
        try:
            refuse_non_finite(held.patch)
        except ContractValueError as exc:
            raise ContractValueError(
                f"participant snapshot of {preview(snapshot.participant_id)} holds a pending "
                f"patch its export could not carry: {exc}; import_participant() refused"
            ) from None
