"""Background results merged into a participant's context: append, replace, human-gated.

The desk holds the human-gated patches awaiting approval, asks the participant about
them through the control output, and merges approved or ungated patches into the
participant's history (see `docs/router.md`, "Background context patches").
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
import uuid
from collections.abc import Callable

from pydantic_core import to_json

from . import _strict_json as strict_json
from ._acknowledgment import clean_acknowledgment
from ._config import (
    PATCH_ROUTE,
    OutputCallback,
    ParticipantChange,
    RouterConfig,
    check_callable,
)
from ._contracts import MAX_TIMESTAMP_US, AgentExchange, AgentTurn, _exchange, say_through
from ._exceptions import (
    ContractTypeError,
    ContractValueError,
    LifecycleError,
    PatchNotSavedError,
)
from ._frontend import (
    MAX_SNAPSHOT_BYTES,
    MAX_SNAPSHOT_CONTAINERS,
    MAX_SNAPSHOT_ITEMS,
    SNAPSHOT_ITEMS_SLACK,
)
from ._history import History, view_items
from ._logging import log_failure
from ._observer import ContextPatchEvent, PatchOutcome
from ._participants import EXCHANGE_ITEMS, SNAPSHOT_SLACK, Participant, Registry
from ._patches import (
    EMPTY_CONTEXT_HASH,
    AppliedContextPatch,
    ContextPatch,
    ContextState,
    MergeStrategy,
    PatchExchangeId,
    PendingContextPatch,
    PendingPatchLimitError,
    UnknownPatchError,
    checked_patch,
    context_hash,
    patch_payload_bytes,
    patch_user_text,
)
from ._redact import preview

__all__ = ["PatchDesk"]

#: The longest digest line a held patch's question speaks (cut at a word boundary).
MAX_QUESTION_DIGEST_CHARS = 160

logger = logging.getLogger("turnrouter")


def _patch_exchange(patch: ContextPatch) -> AgentExchange:
    """The history exchange a merged patch becomes."""
    return _exchange(patch_user_text(patch.task_id, patch.context_diverged),
                     "\n".join(patch.digest))


def _check_fits(state: Participant, patch: ContextPatch) -> None:
    """`ContractValueError` unless the patch's exchange fits the participant's history
    budget: a history appending an exchange larger than its whole budget keeps nothing,
    so merging it would drop the conversation and the patch with it."""
    size = _patch_exchange(patch).size_bytes() + patch_payload_bytes(patch)
    budget = state.history.budget
    if size > budget:
        raise ContractValueError(
            f"context patch {preview(patch.task_id)} needs {size} bytes of history (task id, "
            f"digest, facts and artifacts), over the participant's context budget "
            f"({budget} bytes): merged, it would leave no room for the conversation or "
            "itself; shorten its digest and keep large payloads elsewhere")


#: Objects and arrays a merged patch's exchange (and a held patch's wrapper) adds to a
#: snapshot beyond the patch's own.
_WRAPPING = 8
#: Values (`strict_json.items`) a merged patch's exchange or a held patch's wrapper adds
#: beyond the patch's own.
_WRAPPING_ITEMS = 64
#: Bytes a merged patch's exchange (or a held patch's wrapper) adds to a snapshot beyond
#: the patch's JSON, its task id and its digest: ids, stamps and field names.
_WRAPPING_BYTES = 2048


def _refuse_past(count: Callable[[str | bytes, int], int], name: str, bound: int,
                 sizes: tuple[ContextPatch, str, bytes], room: tuple[int, int, int],
                 words: tuple[str, str]) -> None:
    """`ContractValueError` when the patch (`sizes`: it, its JSON, the participant's
    snapshot as measured), with the participant's own and room for `room[0]` more
    exchanges of `room[1]` each (and `room[2]` for its wrapping), passes `bound` of what
    `count` counts (`words`: what that is, and what to do instead)."""
    patch, patch_json, measured = sizes
    own = count(patch_json, 0)
    limit = bound - own - room[2] - room[0] * room[1]
    held = count(measured, max(limit, 0))
    if held > limit:
        raise ContractValueError(
            f"context patch {preview(patch.task_id)} holds {own} {words[0]}; with the "
            f"participant's {held} and room for {room[0]} more exchanges, its snapshot "
            f"would pass {name} ({bound}) and could not move to another replica: "
            f"{words[1]}, or approve or reject held patches first")


def _check_containers(cfg: RouterConfig, registry: Registry, state: Participant,
                      patch: ContextPatch) -> None:
    """`ContractValueError` unless the participant's snapshot, holding `patch` too, stays
    within `MAX_SNAPSHOT_CONTAINERS`, `MAX_SNAPSHOT_ITEMS` and `MAX_SNAPSHOT_BYTES`:
    past them, no replica imports it (8 held patches of 2,500 empty lists each, or of
    1 MB each under a larger `max_patch_bytes`, within every other bound, made a
    participant's state unmovable; on NATS its record was quarantined and it started
    clean).

    Objects and arrays: on a router whose exports never trim (`Registry.trims_exports`),
    the whole snapshot with room for the rest of a full history of plain exchanges (one
    object each); where an export drops the oldest exchanges to fit, its part besides
    the history (held patches are never dropped). Bytes: its part besides the history.
    Measured without trimming, and counted exactly only past a cheap upper bound."""
    data, besides = registry.measure(state)
    patch_json = patch.model_dump_json(warnings=False)
    if registry.trims_exports:
        measured, room = besides, 64
    else:
        measured = data
        room = max(0, cfg.max_history_exchanges - len(state.history.exchanges))
    _refuse_past(strict_json.containers, "MAX_SNAPSHOT_CONTAINERS", MAX_SNAPSHOT_CONTAINERS,
                 (patch, patch_json, measured), (room, 1, _WRAPPING),
                 ("objects and arrays", "flatten its facts"))
    _refuse_past(strict_json.items, "MAX_SNAPSHOT_ITEMS", MAX_SNAPSHOT_ITEMS,
                 (patch, patch_json, measured),
                 (room, EXCHANGE_ITEMS, _WRAPPING_ITEMS + SNAPSHOT_ITEMS_SLACK),
                 ("values", "keep long lists of values elsewhere"))
    # Its JSON, its task id twice more and its digest once more (a merged patch's
    # exchange says them in its texts), escaped as the snapshot writes them.
    size = (len(patch_json.encode()) + 2 * len(to_json(patch.task_id))
            + len(to_json("\n".join(patch.digest))) + _WRAPPING_BYTES)
    rest = len(besides)
    if rest + size > MAX_SNAPSHOT_BYTES - SNAPSHOT_SLACK:
        raise ContractValueError(
            f"context patch {preview(patch.task_id)} takes up to {size} bytes of the "
            f"participant's snapshot, which holds {rest} bytes besides its history: it "
            f"would pass MAX_SNAPSHOT_BYTES ({MAX_SNAPSHOT_BYTES}) and could not move to "
            "another replica; keep large payloads elsewhere, or approve or reject held "
            "patches first")


class PatchDesk:
    """Applies, holds and settles a router's context patches."""

    __slots__ = ("_cfg", "_changed", "_registry", "control_output", "pending")

    def __init__(self, cfg: RouterConfig, registry: Registry) -> None:
        self._cfg, self._registry = cfg, registry
        #: Every held patch, by id, with the participant states holding it. A patch id is
        #: the participant's: ids the router makes never repeat, but imported snapshots
        #: may hold an id another participant holds too, and neither takes the other's.
        self.pending: dict[str, dict[str, Participant]] = {}
        #: Control text outside turns when the constructor had no `output`.
        self.control_output: OutputCallback | None = None
        self._changed: ParticipantChange | None = None

    def watch(self, callback: ParticipantChange | None) -> None:
        """Who hears of a participant a patch changed (`on_participant_changed`)."""
        check_callable("on_participant_changed callback", callback)
        self._changed = callback

    def _notify(self, pid: str) -> object:
        """Tell the watcher; what it returned (awaited by `_kept` when awaitable)."""
        callback = self._changed
        if callback is not None:
            try:
                return callback(pid)
            except Exception as exc:
                log_failure("on_participant_changed(%r)", exc, pid)
        return None

    def context_state(self, pid: str) -> ContextState:
        state = self._registry.get(pid)
        if state is None:
            return ContextState(0, EMPTY_CONTEXT_HASH)
        history = state.history
        return ContextState(history.version, history.context_hash())

    def pending_of(self, pid: str) -> tuple[PendingContextPatch, ...]:
        state = self._registry.get(pid)
        if state is None or not state.pending:
            return ()
        return tuple(state.pending.values())

    def applied_of(self, pid: str) -> tuple[AppliedContextPatch, ...]:
        state = self._registry.get(pid)
        if state is None:
            return ()
        return tuple(item.applied for item in state.history.ids
                     if isinstance(item, PatchExchangeId))

    async def apply(
        self, pid: str, patch: ContextPatch, strategy: MergeStrategy | str
    ) -> AppliedContextPatch | PendingContextPatch:
        if not isinstance(patch, ContextPatch):
            raise ContractTypeError(
                f"apply_context_patch() takes a ContextPatch, got {type(patch).__name__}")
        limit = self._cfg.max_patch_bytes
        patch, size = checked_patch(patch, limit)
        shown = preview(patch.task_id)  # an id of any length: bounded in messages
        if size > limit:
            self._cfg.overflows.report("patch_bytes", f"context patch {shown} of "
                                       f"{size} bytes refused")
            raise ContractValueError(
                f"context patch {shown} is {size} bytes serialized, over "
                f"max_patch_bytes ({limit}); keep large payloads elsewhere and reference them")
        try:
            strategy = MergeStrategy(strategy)
        except ValueError:
            raise ContractValueError(
                f"apply_context_patch() strategy must be one of "
                f"{[item.value for item in MergeStrategy]}, got {preview(strategy)}") from None
        state, refusal = self._target(pid)
        if state is not None:
            refusal = _earlier_session(state, patch)
            if refusal:
                state = None
        if state is None:
            self._cfg.observer.context_patch(ContextPatchEvent(
                pid, None, patch.task_id, strategy.value, "refused", patch.context_diverged))
            raise LifecycleError(
                f"context patch {shown} refused for participant "
                f"{preview(pid)}: {refusal}")
        diverged = patch.context_diverged or _diverged(state.history, patch)
        if diverged and not patch.context_diverged:
            patch = patch.model_copy(update={"context_diverged": True})
        try:
            _check_fits(state, patch)
            _check_containers(self._cfg, self._registry, state, patch)
        except ContractValueError:
            self._cfg.observer.context_patch(ContextPatchEvent(
                pid, None, patch.task_id, strategy.value, "refused", patch.context_diverged))
            raise
        patch_id = uuid.uuid4().hex
        if strategy is not MergeStrategy.HUMAN_GATED:
            applied = self._merge(state, patch_id, patch, strategy,
                                  "diverged" if diverged else "applied")
            await self._keep(self._notify(pid), pid, patch_id, patch, strategy)
            return applied
        pending = state.pending
        if pending is None:
            pending = state.pending = {}
        limit = self._cfg.max_pending
        if len(pending) >= limit:
            self._cfg.observer.context_patch(ContextPatchEvent(
                pid, None, patch.task_id, strategy.value, "refused", patch.context_diverged))
            raise PendingPatchLimitError(
                f"context patch {shown} refused: participant {pid!r} "
                f"already holds {len(pending)} pending patches (max_pending_patches="
                f"{limit}); approve or reject some first")
        held = PendingContextPatch(
            patch_id=patch_id, participant_id=pid, task_id=patch.task_id,
            patch=patch, strategy=strategy, created_at=time.time(),
        )
        pending[patch_id] = held
        self.pending.setdefault(patch_id, {})[state.pid] = state
        self._event(state.pid, held, "pending")
        saving = self._notify(pid)
        await self._ask(held, pid)
        await self._keep(saving, state.pid, patch_id, patch, strategy)
        return held

    async def approve(self, patch_id: str, pid: str | None) -> AppliedContextPatch:
        state, held = self._take(patch_id, pid, "approve")
        _, refusal = self._target(state.pid)
        if refusal or self._registry.get(state.pid) is not state:
            self._event(state.pid, held, "dropped")
            raise LifecycleError(
                f"context patch {patch_id!r} dropped, not approved: "
                f"{refusal or 'the participant left'}")
        try:  # held from a snapshot of a router with a larger budget, say
            _check_fits(state, held.patch)
        except ContractValueError:
            self._event(state.pid, held, "dropped")
            saving = self._notify(state.pid)
            with contextlib.suppress(LifecycleError):  # (the refusal says more)
                await _kept(saving)
            raise
        applied = self._merge(state, held.patch_id, held.patch,
                              MergeStrategy.HUMAN_GATED, "approved")
        await self._keep(self._notify(state.pid), state.pid, held.patch_id, held.patch,
                         held.strategy)
        return applied

    async def reject(self, patch_id: str, pid: str | None) -> PendingContextPatch:
        state, held = self._take(patch_id, pid, "reject")
        self._event(state.pid, held, "rejected")
        await self._keep(self._notify(state.pid), state.pid, held.patch_id, held.patch,
                         held.strategy)
        return held

    def hold(self, state: Participant) -> None:
        """Index the patches a restored participant holds."""
        for patch_id in state.pending or ():
            self.pending.setdefault(patch_id, {})[state.pid] = state

    def drop(self, state: Participant, outcome: PatchOutcome | None = "dropped") -> None:
        """A departure or shutdown drops the participant's held patches (counted).

        `outcome=None`: the patches moved with the participant (nothing reported).
        """
        pending = state.pending
        if not pending:
            return
        state.pending = None
        for held in pending.values():
            self._unindex(held.patch_id, state.pid)
            if outcome is not None:
                self._event(state.pid, held, outcome)

    def _target(self, pid: str) -> tuple[Participant | None, str]:
        """The open participant a patch may reach, or None and why not."""
        refusal = self._registry.refusal(pid)
        if refusal:
            return None, refusal
        state = self._registry.get(pid)
        if state is None:
            return None, ("the router holds no state for this participant (it never had "
                          "a turn here, it left, or, on a NATS fleet, it is served by "
                          "another replica or was let go when idle: apply the patch "
                          "where it is served, e.g. at its next turn)")
        return state, ""

    def _unindex(self, patch_id: str, pid: str) -> None:
        owners = self.pending.get(patch_id)
        if owners is not None:
            owners.pop(pid, None)
            if not owners:
                del self.pending[patch_id]

    def _take(self, patch_id: str, pid: str | None,
              verb: str) -> tuple[Participant, PendingContextPatch]:
        """The held patch `patch_id` of `pid` (of whoever holds it when None), taken out.

        Without a participant, an id two participants hold (only imported snapshots can
        make one) is refused rather than guessed: the caller names whose it settles."""
        if not isinstance(patch_id, str):
            raise ContractTypeError(f"patch_id must be a str, got {type(patch_id).__name__}")
        if pid is not None and not isinstance(pid, str):
            raise ContractTypeError(f"participant_id must be a str, got {type(pid).__name__}")
        owners = self.pending.get(patch_id) or {}
        if pid is None and len(owners) > 1:
            raise UnknownPatchError(
                f"cannot {verb} context patch {preview(patch_id)}: {len(owners)} participants "
                "hold a pending patch of this id (restored from snapshots); pass "
                "participant_id to say whose")
        state = owners.get(pid) if pid is not None else next(iter(owners.values()), None)
        if state is None or state.pending is None or patch_id not in state.pending:
            whose = "" if pid is None else f" for participant {preview(pid)}"
            raise UnknownPatchError(
                f"cannot {verb} context patch {preview(patch_id)}: no such patch is pending"
                f"{whose} (never held, already approved or rejected, or dropped when its "
                "participant left or the router stopped)")
        self._unindex(patch_id, state.pid)
        return state, state.pending.pop(patch_id)

    def _merge(
        self, state: Participant, patch_id: str, patch: ContextPatch,
        strategy: MergeStrategy, outcome: PatchOutcome,
    ) -> AppliedContextPatch:
        applied = AppliedContextPatch(
            patch_id=patch_id, participant_id=state.pid, task_id=patch.task_id,
            strategy=strategy, diverged=patch.context_diverged, patch=patch,
            exchange_id=f"patch:{patch.task_id}",
        )
        # Within the snapshot's stamp bound: a patch may say it completed up to year
        # 9999, and the next export must still validate.
        stamp = int(patch.completed_at.timestamp() * 1_000_000)
        dropped = state.history.add_background(
            _patch_exchange(patch),
            PatchExchangeId(applied), min(max(stamp, 0), MAX_TIMESTAMP_US),
            patch_payload_bytes(patch),
            replace=strategy is MergeStrategy.REPLACE,
        )
        if dropped:
            self._cfg.overflows.report(
                "history_exchanges", f"{state.pid!r} holds max_history_exchanges exchanges: "
                "the oldest was dropped")
        self._cfg.observer.context_patch(ContextPatchEvent(
            state.pid, patch_id, patch.task_id, strategy.value, outcome,
            patch.context_diverged))
        return applied

    async def _keep(self, saving: object, pid: str, patch_id: str, patch: ContextPatch,
                    strategy: MergeStrategy) -> None:
        """Await the change's save (`_kept`); a `PatchNotSavedError` is counted
        (`unsaved`, after the outcome the call already counted) and re-raised."""
        try:
            await _kept(saving)
        except PatchNotSavedError:
            self._cfg.observer.context_patch(ContextPatchEvent(
                pid, patch_id, patch.task_id, strategy.value, "unsaved",
                patch.context_diverged))
            raise

    def _event(self, pid: str, held: PendingContextPatch, outcome: PatchOutcome) -> None:
        self._cfg.observer.context_patch(ContextPatchEvent(
            pid, held.patch_id, held.patch.task_id, held.strategy.value, outcome,
            held.patch.context_diverged))

    async def _ask(self, held: PendingContextPatch, pid: str) -> None:
        """Ask the participant about a held patch through `output` (failures logged)."""
        output = self._cfg.output or self.control_output
        if output is None:
            logger.info("turnrouter: no output callback; context patch %s waits for "
                        "approval without a question", held.patch_id)
            return
        digest = held.patch.digest
        # Spoken: its first line made speakable and short (or none, if nothing is).
        line = clean_acknowledgment(digest[0], MAX_QUESTION_DIGEST_CHARS) if digest else ""
        what = f"A background task finished: {line}" if line else (
            "A background task finished")
        text = f"{what.rstrip('.')}. Should I add this to our conversation?"
        turn = AgentTurn(pid, f"patch:{held.patch_id}", "")
        try:
            await say_through(output, turn, PATCH_ROUTE, text)
        except Exception as exc:
            log_failure("asking about context patch %s", exc, held.patch_id)


async def _kept(outcome: object) -> None:
    """Await what the `on_participant_changed` callback returned when it is awaitable
    (a NATS worker's: the change's record write), so the patch call returns once the
    change is kept: a `LifecycleError` it raises (`PatchNotSavedError`) reaches the
    caller; other errors are logged, as the callback's own are. Nothing to await (the
    in-process router) costs one check."""
    if outcome is None or not inspect.isawaitable(outcome):
        return
    try:
        await outcome
    except LifecycleError:
        raise
    except Exception as exc:
        log_failure("on_participant_changed's outcome", exc)


def _earlier_session(state: Participant, patch: ContextPatch) -> str:
    """Why `patch` comes from an earlier session of the participant ("" when it may be
    this session's): a participant who left and talks again (a reused id: the same
    caller's next call) is a new session, and a background result of the last call must
    not join the next call's context (chaos17 F3).

    The patch names the turn that spawned it (`spawned_from_event_id`) and the session
    remembers its turns (its first `MAX_SESSION_TURNS`; past them, or restored from a
    snapshot without them, it is not checked); a stamp ahead of the session's version
    cannot be from this session either (versions never go back within one).
    """
    spawned = patch.spawned_from_event_id
    turns = state.session_turns
    if spawned is not None and turns is not None and spawned not in turns:
        return (f"spawned by turn {preview(spawned)}, which is not a turn of the "
                "participant's current session: from an earlier session of theirs")
    version = patch.source_context_version
    if version is not None and version > state.history.version:
        return (f"stamped at context version {version}, ahead of the participant's "
                f"{state.history.version}: from an earlier session of theirs")
    return ""


def _diverged(history: History, patch: ContextPatch) -> bool:
    """Whether the participant's conversation moved on since the patch's stamp.

    Matches when the stamp equals the context now, or equals the context just before the
    newest conversation exchange and that exchange is the turn that spawned the task.
    Fields the patch leaves unset are not compared.
    """
    version, digest = patch.source_context_version, patch.source_context_hash
    if version is None and digest is None:
        return False
    if (version is None or version == history.version) and (
        digest is None or digest == history.context_hash()
    ):
        return False
    spawned = patch.spawned_from_event_id
    if spawned is None or history.version == 0 or history.last_conversation_id() != spawned:
        return True
    return not ((version is None or version == history.version - 1) and (
        digest is None or digest == context_hash(
            history.prev_exchanges, [item[0] for item in view_items(history.prev_view)])
    ))
