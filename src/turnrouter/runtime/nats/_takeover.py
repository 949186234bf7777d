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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from ._ledger import Ledger
from ._link import Link
from ._records import partition_keys, read_value
from ._wire import NatsConfig, decode_token, parse_record

__all__ = ["Takeover"]

logger = logging.getLogger("turnrouter.runtime.nats")

#: A takeover reads a partition's records for at most this long, and reads and ends
#: this many at a time.
_SCAN_SECS = 30.0
_SCAN_BATCH = 64

#: Pauses between a takeover's attempts to claim a record (then the last one, repeated).
_CLAIM_PAUSES = (0.25, 0.5, 1.0, 2.0)


class Takeover:
    """Ends what partitions' previous owners left unfinished (`scan`)."""

    def __init__(self, kv: Any, link: Link, config: NatsConfig, ledger: Ledger,
                 stopping: Callable[[], bool] = lambda: False) -> None:
        self._kv, self._link, self._config, self._ledger = kv, link, config, ledger
        self._stopping = stopping

    async def scan(self, n: int) -> None:
        """End what partition `n`'s records left unfinished, `_SCAN_BATCH` records at
        a time, reading for at most `_SCAN_SECS`; stop once the partition is lost.

        Its keys are listed by the bucket's stream (`partition_keys`), then each record
        is read: nats-py's KV watch could signal the end of its initial values before
        delivering them (while records of the partition were written), which left a
        dead owner's turns unended until their participant talked again."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _SCAN_SECS
        losses = self._ledger.losses(n)
        read = 0
        try:
            async with asyncio.timeout_at(deadline):
                keys = await partition_keys(self._link, self._config.bucket, n, deadline)
            for start in range(0, len(keys), _SCAN_BATCH):
                if self._ledger.losses(n) != losses:
                    return  # the partition moved away: its new owner scans
                if loop.time() >= deadline:
                    raise TimeoutError
                batch = keys[start:start + _SCAN_BATCH]
                ended = await asyncio.gather(
                    *(self._end_unfinished(key, n, losses, deadline) for key in batch),
                    return_exceptions=True)
                read += len(batch)
                failed = [exc for exc in ended if isinstance(exc, Exception)]
                if any(isinstance(exc, TimeoutError) for exc in failed):
                    raise TimeoutError
                if failed:
                    logger.warning("turnrouter: partition %d: ending %d records' "
                                   "unfinished turns failed: %r", n, len(failed), failed[0])
        except TimeoutError:
            logger.warning("turnrouter: partition %d: read %d records in %g s; the rest "
                           "end their unfinished turns when their participant talks",
                           n, read, _SCAN_SECS)

    async def _end_unfinished(self, key: str, n: int, losses: int, deadline: float) -> None:
        """What the record of `key` left unfinished, ended: a turn in flight by a claim,
        recent endings of its outbox published again (as `Ledger.let_go` does). Only the
        read is bounded by `deadline` (TimeoutError): a claim cut after its write would
        leave its endings recorded and never said."""
        async with asyncio.timeout_at(deadline):
            value = await read_value(self._kv, key)
        if value is None:
            return
        try:
            record = parse_record(value or b"{}")
            pid = decode_token(key.split(".", 1)[1])
        except (ValueError, IndexError):
            return  # junk: the participant's next claim quarantines it
        ledger = self._ledger
        if ledger.losses(n) != losses:
            return
        if record.inflight:
            await self._claim(key, pid, n, losses, deadline, record.owner)
        elif record.outbox and not ledger.serves(pid):  # (a claim here publishes them)
            await ledger.say_again(pid, n, ledger.sound(record.outbox))

    async def _claim(self, key: str, pid: str, n: int, losses: int, deadline: float,
                     owner: str | None) -> None:
        """Claim `pid` (which ends its turn in flight), again after a pause while the
        claim fails, partition `n` stays here, the worker serves on, and the record is
        still `owner`'s (the replica that left the turn) or this one's (a claim of ours
        stored late); TimeoutError when the next attempt would start past `deadline`.
        A failed claim's write may have been stored or not: each attempt reads the
        record afresh, and one stored late fails the next write's revision check, which
        the claim reads again and retries."""
        ledger = self._ledger
        loop = asyncio.get_running_loop()
        attempt = 0
        while await ledger.claim(pid, n) is None:
            if ledger.losses(n) != losses or self._stopping():
                return  # the partition moved away: its new owner's takeover claims it
            pause = _CLAIM_PAUSES[min(attempt, len(_CLAIM_PAUSES) - 1)]
            if loop.time() + pause >= deadline:
                raise TimeoutError
            attempt += 1
            await asyncio.sleep(pause)
            async with asyncio.timeout_at(deadline):
                value = await read_value(self._kv, key)
            try:
                now = parse_record(value).owner if value else None
            except ValueError:
                now = owner  # junk since: the claim quarantines it
            if now not in (owner, ledger.replica) or ledger.losses(n) != losses:
                # Another replica claimed it (or it is gone): theirs now.
                logger.info("turnrouter: partition %d: a takeover left a record another "
                            "replica claimed meanwhile", n)
                return
