"""A partition's pin lost, and maybe given back: its running turns are not cut at once.

A replica learns that its pin of a partition is gone from a `423` answering a pull
made with it, or from a message delivered with a pin other than the one it holds. Both
happen after every restart of the server (it pins afresh: the pin a replica held is
unknown to it), also when the partition comes back to the same replica a moment later,
and after a freeze past `failover_timeout`.

The replica used to stop serving the partition's participants at once: their running
turns were cancelled and ended with the failure text (`Ledger.lose`), although the
replica was alive and its answers a moment away (chaos20 O1: every turn running at a
server kill -9 ended so, about 25 per kill at 100 turns/s, the answers computed and
never heard). Now (`lose_pin`):

- The participants stay while their turns run, for `keep_for` (`failover_timeout`
  plus two probe periods: the wait of a new owner for a living previous owner's
  write, `await_last_writer`), no input of the partition being handled here
  meanwhile. A turn finishing then writes its record (revision-checked: a new owner's
  claim came first, and it is fenced, its ending the new owner's) and publishes its
  answer; the new owner, waiting for that write, reads the answer from the record
  instead of saying the failure text. The turns still running after `keep_for` are
  ended as before (`Ledger.lose`).
- When the partition comes back here meanwhile (`repinned`: the usual case after a
  server restart, since the other replicas leave the partitions they did not own
  alone for a moment after a reconnect, `Fleet.leave_alone`), every participant it
  still serves whose record is still this replica's (no other replica wrote it since:
  every write names its writer) is kept, its turn running on; one whose record another
  replica wrote is let go (`Ledger.lose`: that replica's claim ended its turns).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from ._ledger import still_ours
from ._wire import NatsConfig

if TYPE_CHECKING:  # (its module imports this one)
    from ._worker import NatsWorker

__all__ = ["Letting", "keep_for", "lose_pin", "repinned"]

#: Records read at once when a partition comes back (`repinned`).
_READS = 64


def keep_for(config: NatsConfig) -> float:
    """How long a replica keeps the participants of a partition whose pin it lost while
    their turns run: a new owner's wait for its write (`await_last_writer`)."""
    return config.failover_timeout + 2 * config.probe_interval


class Letting:
    """A partition whose pin was lost, its participants kept while their turns run."""

    __slots__ = ("losing", "task")

    def __init__(self) -> None:
        self.task: asyncio.Task[None] | None = None
        self.losing = False  # its participants are being let go (not cancelled then)


async def lose_pin(worker: NatsWorker, n: int, how: str) -> None:
    """The pin of partition `n` moved away (or the server forgot it): its inputs are no
    longer handled here, its participants let go once their turns ended (`keep_for`
    at most), unless the partition comes back first (`repinned`)."""
    worker._pins.pop(n, None)
    worker._set_owned()
    metrics = worker._metrics
    if metrics is not None:
        metrics.partitions_lost.labels(how).inc()
    ledger = worker.ledger
    ledger.partition_lost(n)  # (claims under way in it are fenced)
    if n not in worker._letting_go:
        letting = worker._letting_go[n] = Letting()
        letting.task = worker._spawn(_let_go_later(worker, n, letting), f"letting go {n}")


async def _let_go_later(worker: NatsWorker, n: int, letting: Letting) -> None:
    """Partition `n`'s participants let go once their turns ended (`keep_for` at
    most); meanwhile, and until `keep_for` passed (a partition without participants
    too), this replica pulls it at once, not leaving it to the others (`_pull_once`)."""
    ledger, turns_of = worker.ledger, worker.inputs.turns_of
    loop = asyncio.get_running_loop()
    until = loop.time() + keep_for(worker.config)
    try:
        turns = [t for p in ledger.of_partition(n) for t in turns_of.of(p) if not t.done()]
        if turns:
            await asyncio.wait(turns, timeout=until - loop.time())
        letting.losing = True  # (not cancelled by `repinned` meanwhile: awaited)
        for pid in ledger.of_partition(n):
            await ledger.lose(pid)
        letting.losing = False
        await asyncio.sleep(max(0.0, until - loop.time()))
    finally:
        if worker._letting_go.get(n) is letting:
            del worker._letting_go[n]


async def repinned(worker: NatsWorker, n: int, pin: str) -> None:
    """A message of partition `n` came with `pin`, not the pin held here (if any): the
    partition is this replica's now. Its participants still served here (the pin was
    lost a moment ago, or replaced while held) are kept while their records are still
    this replica's, the others let go; then the takeover ends what other replicas left
    unfinished on it."""
    held = n in worker._pins
    ledger = worker.ledger
    if held:
        ledger.partition_lost(n)  # (claims under way from the old pin are fenced)
    letting = worker._letting_go.pop(n, None)
    if letting is not None and letting.task is not None:
        if not letting.losing:
            letting.task.cancel()
        await asyncio.gather(letting.task, return_exceptions=True)
    worker._pins[n] = pin
    worker._set_owned()
    worker.fleet.taken_back(n)
    pids = ledger.of_partition(n)
    for at in range(0, len(pids), _READS):
        batch = pids[at:at + _READS]
        ours = await asyncio.gather(*(still_ours(ledger, pid, n) for pid in batch))
        for pid, kept in zip(batch, ours, strict=True):
            if not kept:
                await ledger.lose(pid)
    worker._take_over(n)
