"""Per-participant router state, and its snapshot for moving between replicas."""

from __future__ import annotations

import enum
from collections.abc import Collection
from typing import TYPE_CHECKING

from ._contracts import AgentExchange
from ._exceptions import ContractValueError, LifecycleError
from ._frontend import ParticipantSnapshot, SnapshotExchange, SnapshotPatch
from ._history import History
from ._lifecycle import OwnedOperation, TurnQueue
from ._observer import ParticipantChanged, RouterObserver
from ._patches import AppliedContextPatch, PatchExchangeId, PendingContextPatch

if TYPE_CHECKING:
    from ._turn import Answer, Turn

__all__ = ["Participant", "Phase", "Registry", "RouterPhase", "restore", "snapshot_of"]


class Phase(enum.Enum):
    OPEN = "open"
    DEPARTING = "departing"
    FAILED = "cleanup failed"


class Participant:
    """Router-owned state of one participant (kept small: thousands may be active)."""

    __slots__ = (
        "cleanup_pending", "current", "departure", "focus", "history", "initialized",
        "pending", "phase", "pid", "queue", "unheard", "unreleased", "used",
    )

    def __init__(self, pid: str) -> None:
        self.pid = pid
        self.focus: str | None = None
        self.history = History()
        self.used: set[str] = set()
        self.initialized = False
        self.queue = TurnQueue()
        self.phase = Phase.OPEN
        self.departure: OwnedOperation | None = None
        #: Destinations whose departure release failed, to retry (None: not departed yet).
        self.unreleased: set[str] | None = None
        self.cleanup_pending = False
        #: Human-gated patches awaiting approval, oldest first (None: none held yet).
        self.pending: dict[str, PendingContextPatch] | None = None
        #: The running turn, and an answered turn whose first audio is not reported yet.
        self.current: Turn | None = None
        self.unheard: Answer | None = None


class RouterPhase(enum.Enum):
    RUNNING = "running"
    STOPPING = "the router is shutting down"
    STOP_FAILED = "the router's last stop() failed"


class Registry:
    """The participants the router holds state for, and why anyone is closed.

    `refusal()` is the one place that says why a participant (or the whole router)
    takes no turn and no context patch right now.
    """

    __slots__ = ("_observer", "departed", "participants", "phase", "stopping")

    def __init__(self, observer: RouterObserver) -> None:
        self._observer = observer
        self.participants: dict[str, Participant] = {}
        #: With a participant-joined topic, departed participants stay closed until they
        #: rejoin.
        self.departed: set[str] = set()
        self.stopping: OwnedOperation | None = None
        self.phase = RouterPhase.RUNNING

    def get(self, pid: str) -> Participant | None:
        return self.participants.get(pid)

    def router_refusal(self) -> str:
        """Why the router takes nothing now ("" when it is open)."""
        if self.stopping is not None and not self.stopping.done:
            return RouterPhase.STOPPING.value
        if self.phase is RouterPhase.STOP_FAILED:
            return RouterPhase.STOP_FAILED.value
        return ""

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
        state = self.participants[pid] = Participant(pid)
        self._observer.participant_added(ParticipantChanged(pid))
        return state

    def install(
        self, snapshot: ParticipantSnapshot, routes: Collection[str], budget: int
    ) -> Participant | None:
        """Install a participant from a snapshot; return the state it replaced."""
        pid = snapshot.participant_id
        unknown = {route for route in (*snapshot.used, snapshot.focus)
                   if route is not None and route not in routes}
        if unknown:
            raise ContractValueError(
                f"participant snapshot of {pid!r} names unregistered routes {sorted(unknown)}")
        for held in snapshot.pending:
            if held.participant_id != pid:
                raise ContractValueError(
                    f"participant snapshot of {pid!r} holds a patch of {held.participant_id!r}")
        current = self.participants.get(pid)
        if current is not None and (current.queue.runs() or current.phase is not Phase.OPEN):
            raise LifecycleError(
                f"participant {pid!r} has a turn in flight or is departing here; "
                "import_participant() refused")
        if current is None:
            self._observer.participant_added(ParticipantChanged(pid))
        self.participants[pid] = restore(snapshot, budget)
        if snapshot.departed:
            self.departed.add(pid)
        else:
            self.departed.discard(pid)
        return current

    def forget(self, state: Participant) -> None:
        if self.participants.get(state.pid) is state:
            del self.participants[state.pid]
            self._observer.participant_removed(ParticipantChanged(state.pid))


def snapshot_of(state: Participant, departed: bool) -> ParticipantSnapshot:
    """The participant's movable state (see `ParticipantSnapshot`)."""
    history = state.history
    exchanges = []
    for exchange, exchange_id, stamp in zip(
        history.exchanges, history.ids, history.stamps, strict=True
    ):
        patch = None
        turn_id = None
        if isinstance(exchange_id, PatchExchangeId):
            applied = exchange_id.applied
            patch = SnapshotPatch(patch_id=applied.patch_id, task_id=applied.task_id,
                                  strategy=applied.strategy, diverged=applied.diverged,
                                  patch=applied.patch)
        elif exchange_id is not None:
            turn_id = str(exchange_id)
        exchanges.append(SnapshotExchange(user=exchange.user, assistant=exchange.assistant,
                                          turn_id=turn_id, stamp_us=stamp, patch=patch))
    return ParticipantSnapshot(
        participant_id=state.pid, focus=state.focus, history=tuple(exchanges),
        history_version=history.version, used=tuple(sorted(state.used)),
        pending=tuple(state.pending.values()) if state.pending else (),
        initialized=state.initialized, departed=departed,
    )


def restore(snapshot: ParticipantSnapshot, budget: int) -> Participant:
    """Participant state rebuilt from a snapshot, its history trimmed to `budget`."""
    state = Participant(snapshot.participant_id)
    state.focus = snapshot.focus
    state.used = set(snapshot.used)
    state.initialized = snapshot.initialized
    history = state.history
    for item in snapshot.history:
        exchange = AgentExchange(item.user, item.assistant)
        if item.patch is None:
            history.append(exchange, item.turn_id, item.stamp_us, budget)
            continue
        patch = item.patch
        applied = AppliedContextPatch(
            patch_id=patch.patch_id, participant_id=snapshot.participant_id,
            task_id=patch.task_id, strategy=patch.strategy, diverged=patch.diverged,
            patch=patch.patch, exchange_id=f"patch:{patch.task_id}",
        )
        history.add_background(exchange, PatchExchangeId(applied), item.stamp_us, budget,
                               replace=False)
    history.version = snapshot.history_version
    history.prev_exchanges, history.prev_view = history.exchanges, history.view()
    if snapshot.pending:
        state.pending = {held.patch_id: held for held in snapshot.pending}
    return state
