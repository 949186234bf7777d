"""Per-participant router state, and its snapshot for moving between replicas."""

from __future__ import annotations

import enum

from ._contracts import AgentExchange
from ._frontend import ParticipantSnapshot, SnapshotExchange, SnapshotPatch
from ._history import History
from ._lifecycle import OwnedOperation, TurnQueue
from ._patches import AppliedContextPatch, PatchExchangeId, PendingContextPatch

__all__ = ["Participant", "Phase", "restore", "snapshot_of"]


class Phase(enum.Enum):
    OPEN = "open"
    DEPARTING = "departing"
    FAILED = "cleanup failed"


class Participant:
    """Router-owned state of one participant (kept small: thousands may be active)."""

    __slots__ = (
        "cleanup_pending", "departure", "focus", "history", "initialized", "pending",
        "phase", "pid", "queue", "unreleased", "used",
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
