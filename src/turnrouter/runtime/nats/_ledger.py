"""Participant records in the key-value bucket: claims, revision-checked writes, fencing.

Each participant's record (`<partition>.<token>`) holds the router snapshot, the ids of
its turns in flight and the answers not yet known to be published. A replica claims a
record on first contact (a write that moves the revision), so every later write of the
previous owner is refused: that owner stops serving the participant (fencing).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from nats.errors import Error as NatsError
from nats.js.errors import KeyWrongLastSequenceError

from ..._exceptions import ContractValueError, LifecycleError
from ..._frontend import ParticipantSnapshot
from ..._router import AgentRouter
from ._link import Link, RequestFailed, pub_ack
from ._metrics import RuntimeMetrics
from ._wire import (
    MAX_STATE_BYTES,
    MAX_STATE_HISTORY_VERSION,
    MAX_STATE_INFLIGHT,
    MAX_STATE_OUTBOX,
    Ending,
    NatsConfig,
    decode_token,
    encode_token,
    parse_state,
    state_json,
)

__all__ = ["Ledger", "Participant"]

logger = logging.getLogger("turnrouter.runtime.nats")

_MAX_INFLIGHT = MAX_STATE_INFLIGHT  # bound of one participant's in-flight ids in its record
#: JetStream's "wrong last sequence" errors: a newer revision exists (fencing).
_WRONG_LAST = (10071, 10164)


@dataclass
class Participant:
    """What this replica knows of one participant it serves."""

    partition: int
    revision: int = 0
    inflight: list[str] = field(default_factory=list)
    outbox: list[Ending] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    fenced: bool = False
    ended: frozenset[str] = frozenset()
    """Turns the claimed record had already ended (in flight: failure text; held answer)."""
    saving: bool = False
    """A save after an out-of-turn change (a context patch) is scheduled."""
    snapshot: bytes | None = None
    """The snapshot JSON of the last record written or claimed (an in-flight mark
    reuses it: nothing but turns and patches change it, and they write a fresh one)."""


class Publish(Protocol):
    def __call__(self, pid: str, turn_id: str, route: str, text: str, *,
                 final: bool) -> Awaitable[None]: ...


class Ledger:
    """The records of the participants this replica serves."""

    def __init__(self, kv: Any, link: Link, config: NatsConfig, replica: str,
                 router: Callable[[], AgentRouter], publish: Publish,
                 metrics: RuntimeMetrics | None) -> None:
        self._kv, self._link, self._config, self._replica = kv, link, config, replica
        self._router, self._publish, self._metrics = router, publish, metrics
        self._subject = f"$KV.{config.bucket}."
        self.people: dict[str, Participant] = {}

    def of_partition(self, n: int) -> list[str]:
        return [pid for pid, state in self.people.items() if state.partition == n]

    async def fence(self, pid: str, *, refused: bool) -> None:
        """Stop serving `pid` here: cancel its turns, drop its state (no release)."""
        state = self.people.pop(pid, None)
        if state is not None:
            state.fenced = True
        if refused and self._metrics is not None:
            self._metrics.state_refused.inc()
        with contextlib.suppress(LifecycleError):
            await self._router().evict_participant(pid)

    async def drop(self, pid: str) -> None:
        """Hand `pid` over: no more writes from here, state dropped without release."""
        state = self.people.pop(pid, None)
        if state is not None:
            async with state.lock:
                state.fenced = True
        with contextlib.suppress(LifecycleError):
            await self._router().evict_participant(pid)

    async def scan(self, n: int) -> None:
        """Claim every participant of partition `n` whose record holds unfinished turns,
        so their endings are published now (a takeover)."""
        watcher = await self._kv.watch(f"{n}.*", ignore_deletes=True)
        entries = []
        try:
            async with asyncio.timeout(10.0):  # bounded: the initial values, then None
                async for entry in watcher:
                    if entry is None:
                        break
                    entries.append(entry)
        except TimeoutError:
            logger.warning("turnrouter: partition %d: read %d records in 10 s; the rest "
                           "end their unfinished turns when their participant talks",
                           n, len(entries))
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()
        for entry in entries:
            try:
                inflight, _, outbox = parse_state(entry.value or b"{}")
                pid = decode_token(entry.key.split(".", 1)[1])
            except (ValueError, IndexError):
                continue
            if inflight or outbox:
                await self.claim(pid, n)

    async def claim(self, pid: str, n: int) -> Participant | None:
        """This replica's state of `pid`, claiming the record on first contact and
        publishing what the previous owner left unfinished. None when refused."""
        state = self.people.get(pid)
        if state is not None:
            return state
        key = f"{n}.{encode_token(pid)}"
        for _attempt in range(3):
            revision, snapshot = 0, None
            inflight: list[str] = []
            outbox: list[Ending] = []
            try:
                entry = await self._kv.get(key)
            except NatsError:
                entry = None
            if entry is not None:
                # The revision even of an empty record (nats-py reads an empty value as
                # None): the claim's write must expect it, or it is refused every time.
                revision = entry.revision or 0
                try:
                    inflight, snapshot, outbox = parse_state(entry.value or b"")
                except ValueError as exc:
                    await self._quarantine(key, entry.value or b"", "invalid", exc)
            # The claim keeps what the previous owner left, until it is published.
            claim = state_json(self._replica, inflight, snapshot, outbox)
            try:
                revision = await self._kv.update(key, claim, last=revision)
            except KeyWrongLastSequenceError:
                if self._metrics is not None:
                    self._metrics.state_refused.inc()
                continue  # the previous owner wrote meanwhile: read again
            except NatsError as exc:
                logger.warning("turnrouter: participant claim failed: %r", exc)
                return None
            break
        else:
            logger.warning("turnrouter: partition %d: a participant's record was claimed "
                           "by a newer write three times in a row; its input is retried", n)
            return None
        state = Participant(partition=n, revision=revision,
                            ended=frozenset(inflight) | {e[0] for e in outbox})
        self.people[pid] = state
        if snapshot is not None:
            try:
                parsed = ParticipantSnapshot.from_json(snapshot)
                if parsed.participant_id != pid:  # alice's snapshot in mallory's record
                    raise ContractValueError("the snapshot's participant_id is not the "
                                             "record's participant")
                if parsed.history_version > MAX_STATE_HISTORY_VERSION:
                    raise ContractValueError("the snapshot's history_version is over "
                                             "MAX_STATE_HISTORY_VERSION")
                self._router().import_participant(parsed)
            except (ContractValueError, LifecycleError) as exc:
                await self._quarantine(key, snapshot.encode("utf-8", "replace"),
                                       "invalid_snapshot", exc)
            else:
                state.snapshot = snapshot.encode()
        await self._end_unfinished(pid, inflight, outbox)
        if (inflight or outbox) and not await self.write(pid, state):
            return None
        return state

    async def _quarantine(self, key: str, data: bytes, reason: str,
                          exc: BaseException) -> None:
        """A record (or its snapshot) that cannot be trusted: kept aside under
        `quarantine.<key>` for an operator (one per participant, best effort), counted
        as `turnrouter_runtime_rejected_messages_total{topic="nats_state"}`; the
        participant starts clean. The log line names the problem, not the content."""
        logger.warning("turnrouter: a participant's record was quarantined (%s): %s",
                       reason, str(exc)[:200])
        with contextlib.suppress(Exception):
            self._router().report_rejected("nats_state", reason)
        with contextlib.suppress(Exception):
            await self._kv.put(f"quarantine.{key}", data[:MAX_STATE_BYTES])

    async def _end_unfinished(self, pid: str, inflight: list[str],
                              outbox: list[Ending]) -> None:
        horizon = time.time() - self._config.dedup_window / 2
        for turn_id, route, text, at in outbox:
            # Younger than half the deduplication window: maybe never published (the
            # owner died between the write and the publish); a duplicate is dropped.
            # Older ones were published long ago: republishing could be heard twice.
            if at >= horizon:
                await self._publish(pid, turn_id, route, text, final=True)
        answered = {ending[0] for ending in outbox}
        for turn_id in inflight:
            if turn_id in answered:
                continue
            if self._metrics is not None:
                self._metrics.inflight_failed.inc()
            await self._publish(pid, turn_id, "none", self._config.failure_text,
                                final=True)

    async def write(self, pid: str, state: Participant, *, fresh: bool = True) -> bool:
        """Revision-checked write of `pid`'s record; False (and fenced) when refused.

        `fresh=False` (an in-flight mark) writes the snapshot of the previous write
        instead of exporting the participant again."""
        async with state.lock:
            if state.fenced:
                return False
            if fresh or state.snapshot is None:
                state.snapshot = self._router().export_participant_json(pid)
            data = state_json(self._replica, state.inflight[-_MAX_INFLIGHT:],
                              state.snapshot, state.outbox[-MAX_STATE_OUTBOX:])
            t0 = time.perf_counter()
            try:
                seq, error = pub_ack(await self._link.request(
                    f"{self._subject}{state.partition}.{encode_token(pid)}", data,
                    {"Nats-Expected-Last-Subject-Sequence": str(state.revision)}))
            except (RequestFailed, ValueError) as exc:
                logger.warning("turnrouter: state write failed: %r", exc)
                return True
            if seq is not None:
                state.revision = seq
            elif not (isinstance(error, dict) and error.get("err_code") in _WRONG_LAST):
                logger.warning("turnrouter: state write refused by the server: %s", error)
                return True
            if self._metrics is not None:
                self._metrics.state_write.observe(time.perf_counter() - t0)
        if error is not None:
            await self.fence(pid, refused=True)
            return False
        return True
