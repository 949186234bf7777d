"""Reading participant records beyond one key: a partition's keys and records (what a
takeover reads), and the endings of a record's outbox that may be said.

A takeover must read every record of its partition. nats-py's KV watch signals the end
of its initial values with the first message that reports nothing pending, which came
before the values under concurrent writes to the partition (or with messages still in
flight at its set-up): records were skipped and their turns left without an ending. The
keys are listed instead from the bucket's stream (a subject filter, paged), then each
record is read.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Container
from typing import Any

from nats.errors import Error as NatsError
from nats.js.errors import KeyNotFoundError

from ._link import Link, RequestFailed
from ._wire import Ending

__all__ = ["MAX_CLOCK_SKEW_SECS", "partition_keys", "read_value", "sound_endings"]

logger = logging.getLogger("turnrouter.runtime.nats")

#: How far ahead of this replica's clock a record's ending may be stamped (another
#: host's clock may run ahead); a later stamp would keep the entry republishable for
#: ever, so it is dropped (`sound_endings`).
MAX_CLOCK_SKEW_SECS = 10.0
_RETRY_SECS = 0.25


async def partition_keys(link: Link, bucket: str, n: int, deadline: float) -> list[str]:
    """Every key of partition `n` the bucket holds now: the subjects of its stream
    (`$JS.API.STREAM.INFO` with a subject filter, paged); a write made before the
    request is in, whatever is written meanwhile. A refused or unanswered request (a
    server just back, its JetStream not ready yet) is asked again every 0.25 s until
    `deadline` (loop time; TimeoutError past it)."""
    while True:
        try:
            return await _list(link, bucket, n)
        except (RequestFailed, NatsError, ValueError) as exc:
            if asyncio.get_running_loop().time() + _RETRY_SECS >= deadline:
                raise TimeoutError from exc
            await asyncio.sleep(_RETRY_SECS)


async def _list(link: Link, bucket: str, n: int) -> list[str]:
    root = f"$KV.{bucket}."
    subjects = f"{root}{n}."
    keys: list[str] = []
    offset = 0
    while True:
        reply: Any = json.loads(await link.request(
            f"$JS.API.STREAM.INFO.KV_{bucket}",
            json.dumps({"subjects_filter": f"{subjects}*", "offset": offset}).encode()))
        if not isinstance(reply, dict) or "error" in reply:
            raise ValueError(f"stream info refused: {str(reply)[:200]}")
        state = reply.get("state")
        page = state.get("subjects") if isinstance(state, dict) else None
        if not isinstance(page, dict) or not page:
            return keys
        keys.extend(subject[len(root):] for subject in page
                    if isinstance(subject, str) and subject.startswith(subjects))
        offset += len(page)
        total = reply.get("total")
        if not isinstance(total, int) or offset >= total:
            return keys


async def read_value(kv: Any, key: str) -> bytes | None:
    """The record under `key` (None: deleted or purged since it was listed); asked
    again every 0.25 s while the server does not answer (the caller bounds the wait)."""
    while True:
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            return None
        except NatsError:
            await asyncio.sleep(_RETRY_SECS)
        else:
            return bytes(entry.value or b"")


def sound_endings(outbox: list[Ending], routes: Container[str]) -> list[Ending]:
    """The endings of a record's outbox that may be said: stamped at most
    `MAX_CLOCK_SKEW_SECS` ahead of this replica's clock and on one of `routes` or
    `none` (the failure text's). Dropping the others is logged."""
    latest = time.time() + MAX_CLOCK_SKEW_SECS
    sound = [e for e in outbox if e[3] <= latest and (e[1] == "none" or e[1] in routes)]
    if len(sound) < len(outbox):
        logger.warning("turnrouter: dropped %d ending(s) of a participant's record: "
                       "stamped in the future or on an unknown route",
                       len(outbox) - len(sound))
    return sound
