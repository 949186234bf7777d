"""Idle participants let go (`_idle.IdleSweep`), with a ledger that only holds state:
who is let go, who stays, and what is written first. The whole path on a real
nats-server: tests/nats/test_worker_inprocess.py."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from turnrouter.runtime.nats._idle import MAX_PER_PASS, IdleSweep
from turnrouter.runtime.nats._ledger import Participant

STALE_AFTER = 60.0


class _Ledger:
    """What `IdleSweep` reads of a `Ledger`: its participants, the unsure ones, `drop`."""

    def __init__(self) -> None:
        self.people: dict[str, Participant] = {}
        self.unsure: dict[str, int] = {}
        self.unheard: dict[str, Participant] = {}  # (served elsewhere: `resend` reads it)
        self.dropped: list[str] = []

    async def drop(self, pid: str) -> None:
        self.dropped.append(pid)
        del self.people[pid]


def _sweep(ledger: _Ledger, *, busy: set[str] | None = None,
           changed: set[str] | None = None) -> tuple[IdleSweep, list[str]]:
    saved: list[str] = []
    snapshot = b"{}"

    def export(pid: str) -> bytes:
        return b"{changed}" if pid in (changed or set()) else snapshot

    sweep = IdleSweep(ledger, 10.0, STALE_AFTER, lambda pid: pid in (busy or set()),  # type: ignore[arg-type]
                      export, saved.append, lambda: None)
    for state in ledger.people.values():
        state.snapshot = snapshot
    return sweep, saved


def _idle(partition: int = 0, **fields: Any) -> Participant:
    return Participant(partition=partition, active=time.monotonic() - 60.0, **fields)


def test_only_participants_with_nothing_left_here_are_let_go() -> None:
    ledger = _Ledger()
    now = time.time()
    ledger.people = {
        "idle": _idle(),
        "recent": Participant(partition=0),  # an input a moment ago
        "running": _idle(),  # a turn of theirs runs
        "marked": _idle(inflight=["t1"]),
        "unsaid": _idle(outbox=[("t1", "echo", "hi", now)]),  # said again soon
        "stale": _idle(outbox=[("t0", "echo", "hi", now - 2 * STALE_AFTER)]),
        "changed": _idle(),  # a change no save wrote yet
        "unsure": _idle(),
    }
    ledger.unsure["unsure"] = 0
    sweep, saved = _sweep(ledger, busy={"running"}, changed={"changed"})
    assert sweep.sweep() is False
    asyncio.run(sweep.let_go(0))
    assert ledger.dropped == ["idle"]
    # Written first (the write drops endings too old to say again), let go later.
    assert sorted(saved) == ["changed", "stale"]
    assert sweep.evicted == 1


def test_a_partition_with_more_idle_participants_than_a_pass_is_swept_again_soon() -> None:
    ledger = _Ledger()
    ledger.people = {f"p{i}": _idle(partition=i % 2) for i in range(2 * MAX_PER_PASS + 2)}
    sweep, _ = _sweep(ledger)
    assert sweep.sweep() is True  # (each partition holds MAX_PER_PASS + 1)
    assert {n: len(pids) for n, pids in sweep.due.items()} == {0: MAX_PER_PASS,
                                                               1: MAX_PER_PASS}
    asyncio.run(sweep.let_go(0))
    assert len(ledger.dropped) == MAX_PER_PASS and 0 not in sweep.due
    asyncio.run(sweep.let_go(1))
    assert sweep.sweep() is False  # the rest, at the next (sooner) sweep
    assert {n: len(pids) for n, pids in sweep.due.items()} == {0: 1, 1: 1}


def test_an_unacknowledged_ending_is_published_again_backing_off() -> None:
    """`resend`: an ending still unacknowledged at two looks in a row is published
    again, then at the 4th and 8th look (a stream that is only slow gets few copies;
    before, every look past 5 s of the ending's age sent one, even right after its
    first publish: review13); one acknowledged meanwhile is not."""
    from turnrouter.runtime.nats._inputs import resend

    class Link:
        looks = 0

        def mark(self) -> int:
            Link.looks += 1
            return Link.looks

        def forget_before(self, mark: int) -> int:
            return 0

    class Inputs:
        def __init__(self) -> None:
            self._link = Link()
            self._config = type("Config", (), {"dedup_window": 3600.0})()
            self._ledger = _Ledger()
            self.published: list[tuple[str, int]] = []
            self.enough = asyncio.Event()

        async def publish_ending(self, pid: str, state: Participant, ending: Any) -> None:
            self.published.append((ending[0], Link.looks - 1))  # (the looks so far)
            if len(self.published) >= 3:
                self.enough.set()

    async def main() -> list[tuple[str, int]]:
        inputs = Inputs()
        now = time.time()
        waiting = ("t1", "echo", "hi", now)
        heard = ("t2", "echo", "hello", now)
        state = Participant(partition=0, outbox=[waiting, heard],
                            recorded=frozenset({"t1", "t2"}))
        inputs._ledger.people["ann"] = state
        task = asyncio.create_task(resend(inputs, every=0.001))  # type: ignore[arg-type]
        try:
            state.outbox.remove(heard)  # acknowledged before the second look
            async with asyncio.timeout(30):
                await inputs.enough.wait()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled()  # (it was still looking: nothing failed in it)
        return inputs.published

    assert asyncio.run(main()) == [("t1", 2), ("t1", 4), ("t1", 8)]
