"""Idle participants let go: a participant with no input for `NatsConfig.idle_after`
leaves the replica's memory (and the router's `max_participants`), its record keeping
its state for its next input, as when its partition moves.

A session that ends without `left` (an app closed, a network gone, a front end that
crashed, or made-up participants) would otherwise hold a router slot and its history
for as long as the replica runs: past `max_participants` every new participant heard
the failure text (redteam12 F4). A background sweep finds the idle participants; each
partition's loop lets its own go between two messages, so no input of theirs is
handled meanwhile (a claim racing the eviction would lose what it imported).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from ..._limits import is_logged
from ._ledger import Ledger, Participant

__all__ = ["IdleSweep"]

logger = logging.getLogger("turnrouter.runtime.nats")

#: Participants a partition's loop lets go at once (the rest the next time round), so
#: a sweep that found thousands does not hold the partition's inputs up.
MAX_PER_PASS = 128
#: The longest between two sweeps, whatever `idle_after`.
MAX_SWEEP_SECS = 60.0


class IdleSweep:
    """Finds the participants idle past `idle_after` (`run`) and lets them go in their
    partition's loop (`let_go`)."""

    def __init__(self, ledger: Ledger, idle_after: float, stale_after: float,
                 busy: Callable[[str], bool], export: Callable[[str], bytes | None],
                 save: Callable[[str], None], counted: Callable[[], None]) -> None:
        self._ledger = ledger
        self._idle_after = idle_after
        #: Outbox entries this old are never published again (half `dedup_window`):
        #: they do not keep a participant here (a write drops them).
        self._stale_after = stale_after
        self._busy = busy  # a turn of theirs runs, or they are departing
        self._export = export  # the router's snapshot JSON of a participant
        self._save = save  # schedule a record write (`save_soon`)
        self._counted = counted
        #: Candidates by partition, found by the last sweep.
        self.due: dict[int, list[str]] = {}
        self.evicted = 0

    async def run(self) -> None:
        """Sweep every quarter of `idle_after` (at most every `MAX_SWEEP_SECS`), and
        again a second later while a partition had more than `MAX_PER_PASS` to let go."""
        every = min(self._idle_after / 4, MAX_SWEEP_SECS)
        more = False
        while True:
            await asyncio.sleep(1.0 if more else every)
            more = self.sweep()

    def sweep(self) -> bool:
        """Note each partition's participants idle past `idle_after` (at most
        `MAX_PER_PASS` each); whether some partition had more."""
        before = time.monotonic() - self._idle_after
        stale = time.time() - self._stale_after
        due: dict[int, list[str]] = {}
        more = False
        for pid, state in self._ledger.people.items():
            if state.active < before and _clean(state, stale):
                found = due.setdefault(state.partition, [])
                if len(found) < MAX_PER_PASS:
                    found.append(pid)
                else:
                    more = True
        self.due = due
        return more

    async def let_go(self, n: int) -> None:
        """In partition `n`'s loop: let its idle participants go, each checked again
        (an input may have come since the sweep); one whose state changed since its
        last record write is saved first, and let go at a later sweep."""
        pids = self.due.pop(n, None)
        if not pids:
            return
        ledger = self._ledger
        before = time.monotonic() - self._idle_after
        stale = time.time() - self._stale_after
        for pid in pids:
            state = ledger.people.get(pid)
            if (state is None or state.partition != n or state.active >= before
                    or not _clean(state, stale) or self._busy(pid) or pid in ledger.unsure):
                continue
            if state.outbox or self._export(pid) != state.snapshot:
                # A change no save has written yet, or endings too old to say again
                # (an output refused for longer): written first (the write drops
                # those), let go at a later sweep.
                self._save(pid)
                continue
            await ledger.drop(pid)
            self.evicted += 1
            self._counted()
            if is_logged(self.evicted):
                logger.info("turnrouter: let go of %d participants idle for %g s (their "
                            "records keep their state)", self.evicted, self._idle_after)


def _clean(state: Participant, stale: float) -> bool:
    """Nothing of the participant's waits to be written or said here (outbox entries
    stamped before `stale` are never said again)."""
    if state.inflight or state.saving or state.fenced or state.lock.locked():
        return False
    return all(ending[3] < stale for ending in state.outbox)
