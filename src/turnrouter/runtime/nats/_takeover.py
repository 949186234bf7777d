"""A takeover: what a replica does first when the server gives it a partition.

It ends what the previous owner left unfinished on the partition: every participant
whose record holds a turn in flight is claimed (its failure text is said), and the
recent answers of the others' outboxes are published again without a claim (the stream
drops those it already holds). It runs beside the partition's loop, which keeps pulling
(the pin stays) and serving: an input of a participant being claimed waits only for
that claim. A scan that held the loop, claiming one record after another, outlasted
`failover_timeout` at a few thousand participants per replica, and the server moved the
partition again and again.

A claim that fails (no reply: a server busy right after its restart, or the write lost
with the connection) is made again while the partition stays here, until the scan's
deadline: its participant's turn would otherwise stay in flight, unheard, until they
talk again. Never over another replica's claim: after an outage the server may have
pinned the partition elsewhere before this replica hears so, and a claim written over
the new owner's would end its running turn with the failure text. Nor once the worker
stops (its graceful stop waits for the takeovers).

The takeovers under way on one replica read at most `_SCAN_READS` (64) records at once
together, each its share. Each read 64 at a time on its own before: a replica taking 16
partitions of a populated bucket (at start, say) had ~1,000 reads and tasks under way,
and every step of an input (its own read of a record for a claim or a busy-text
refusal, its writes, its acknowledgment) waited behind their replies, so a flood of new
participants arriving then held a partition's one message past `ack_wait` (delivered
again) and its pin past `failover_timeout` (the partition moved, came back to the same
lone replica, and its takeover read every record again).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Callable
from typing import Any

from ._ledger import Ledger, await_last_writer
from ._link import Link
from ._records import partition_keys, read_value
from ._wire import NatsConfig, decode_token, parse_record

__all__ = ["Takeover"]

logger = logging.getLogger("turnrouter.runtime.nats")

#: A takeover reads a partition's records for at most this long.
_SCAN_SECS = 30.0
#: Records the takeovers under way on a replica read at once, together: each scan
#: reads and ends its share of them at a time (at least one), and every read waits for
#: one of these slots.
_SCAN_READS = 64

#: Pauses between a takeover's attempts to claim a record (then the last one, repeated).
_CLAIM_PAUSES = (0.25, 0.5, 1.0, 2.0)


class Takeover:
    """Ends what partitions' previous owners left unfinished (`scan`)."""

    def __init__(self, kv: Any, link: Link, config: NatsConfig, ledger: Ledger,
                 stopping: Callable[[], bool] = lambda: False) -> None:
        self._kv, self._link, self._config, self._ledger = kv, link, config, ledger
        self._stopping = stopping
        self._scans = 0  # scans under way (they share `_SCAN_READS`)
        self._reads = asyncio.Semaphore(_SCAN_READS)

    def _share(self) -> int:
        """How many records one scan reads and ends at a time now."""
        return max(1, _SCAN_READS // max(1, self._scans))

    async def scan(self, n: int) -> None:
        """End what partition `n`'s records left unfinished, its share of `_SCAN_READS`
        records at a time, reading for at most `_SCAN_SECS`; stop once the partition is
        lost. The claims that failed are made again once every record was read (one
        record that keeps failing holds up no other).

        Its keys are listed by the bucket's stream (`partition_keys`), then each record
        is read: nats-py's KV watch could signal the end of its initial values before
        delivering them (while records of the partition were written), which left a
        dead owner's turns unended until their participant talked again."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _SCAN_SECS
        losses = self._ledger.losses(n)
        read = 0
        again: list[_Left] = []
        self._scans += 1
        try:
            async with asyncio.timeout_at(deadline):
                keys = await partition_keys(self._link, self._config.bucket, n, deadline)
            while read < len(keys):
                if self._ledger.losses(n) != losses:
                    return  # the partition moved away: its new owner scans
                if loop.time() >= deadline:
                    raise TimeoutError
                batch = keys[read:read + self._share()]
                ended = await asyncio.gather(
                    *(self._end_unfinished(key, n, losses, deadline) for key in batch),
                    return_exceptions=True)
                read += len(batch)
                again += [left for left in ended if isinstance(left, _Left)]
                self._check(n, ended)
            await self._claim_again(n, losses, deadline, again)
        except TimeoutError:
            logger.warning("turnrouter: partition %d: read %d records in %g s (%d claims "
                           "failing); the rest end their unfinished turns when their "
                           "participant talks", n, read, _SCAN_SECS, len(again))
        finally:
            self._scans -= 1

    @staticmethod
    def _check(n: int, ended: list[Any]) -> None:
        """TimeoutError when an outcome of a batch is one; the other errors logged."""
        failed = [exc for exc in ended if isinstance(exc, Exception)]
        if any(isinstance(exc, TimeoutError) for exc in failed):
            raise TimeoutError
        if failed:
            logger.warning("turnrouter: partition %d: ending %d records' unfinished "
                           "turns failed: %r", n, len(failed), failed[0])

    async def _end_unfinished(self, key: str, n: int, losses: int,
                              deadline: float) -> _Left | None:
        """What the record of `key` left unfinished, ended: a turn in flight by a claim,
        recent endings of its outbox published again (as `Ledger.let_go` does); the
        record, when its claim failed (made again by `_claim_again`). Only the read is
        bounded by `deadline` (TimeoutError): a claim cut after its write would leave
        its endings recorded and never said."""
        async with asyncio.timeout_at(deadline), self._reads:
            value = await read_value(self._kv, key)
        if value is None:
            return None
        try:
            record = parse_record(value or b"{}")
            pid = decode_token(key.split(".", 1)[1])
        except (ValueError, IndexError):
            return None  # junk: the participant's next claim quarantines it
        ledger = self._ledger
        if ledger.losses(n) != losses:
            return None
        if record.inflight:
            # Its owner may be alive, its write of the turn's answer about to land.
            await await_last_writer(ledger, key, value, record.owner, n, deadline)
            if ledger.losses(n) != losses:
                return None
            if await ledger.claim(pid, n) is None and ledger.losses(n) == losses:
                return _Left(key, pid, record.owner)
        elif record.outbox and not ledger.serves(pid):  # (a claim here publishes them)
            await ledger.say_again(pid, n, ledger.sound(record.outbox))
        return None

    async def _claim_again(self, n: int, losses: int, deadline: float,
                           left: list[_Left]) -> None:
        """The claims in `left` made again, the scan's share at a time as it reads (a
        server that dropped them is likely busy), after a pause (`_CLAIM_PAUSES`)
        while partition `n` stays here and the worker serves on; TimeoutError when the
        next round would start past `deadline`."""
        loop = asyncio.get_running_loop()
        for pause in itertools.chain(_CLAIM_PAUSES, itertools.repeat(_CLAIM_PAUSES[-1])):
            if not left or self._ledger.losses(n) != losses or self._stopping():
                return  # (moved away: its new owner's takeover claims them)
            if loop.time() + pause >= deadline:
                raise TimeoutError
            await asyncio.sleep(pause)
            still: list[_Left] = []
            done = 0
            while done < len(left):
                batch = left[done:done + self._share()]
                ended = await asyncio.gather(
                    *(self._claim_left(one, n, losses, deadline) for one in batch),
                    return_exceptions=True)
                done += len(batch)
                still += [one for one in ended if isinstance(one, _Left)]
                self._check(n, ended)
            left = still

    async def _claim_left(self, left: _Left, n: int, losses: int,
                          deadline: float) -> _Left | None:
        """Claim `left` again while its record holds a turn in flight and is still its
        owner's (the replica that left the turn) or this one's (a claim of ours stored
        late); `left` when the claim failed again. A failed claim's write may have been
        stored or not: the claim reads the record afresh, and one stored late fails the
        next write's revision check, which the claim reads again and retries."""
        async with asyncio.timeout_at(deadline), self._reads:
            value = await read_value(self._kv, left.key)
        ledger = self._ledger
        try:
            record = parse_record(value) if value else None
        except ValueError:
            record = None  # junk since: the participant's next claim quarantines it
        if record is None or not record.inflight or ledger.losses(n) != losses:
            return None
        if record.owner not in (left.owner, ledger.replica):
            # Another replica claimed it: theirs now (after an outage the partition may
            # be pinned there before this replica hears so).
            logger.info("turnrouter: partition %d: a takeover left a record another "
                        "replica claimed meanwhile", n)
            return None
        if await ledger.claim(left.pid, n) is None and ledger.losses(n) == losses:
            return left
        return None


@dataclasses.dataclass(frozen=True, slots=True)
class _Left:
    """A record whose turn in flight a takeover's claim did not end yet."""

    key: str
    pid: str
    owner: str | None  # the replica that left it
