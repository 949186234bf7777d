"""Keeping the front ends' account's mirror of the output stream in step with it.

The server keeps a mirror in step by itself, except in two cases it does not recover
from quickly:

- the mirror asked for its source while the source was missing (a server restart that
  restored the front ends' account before the workers', or the output stream deleted):
  the server records "stream not found" (10059) and asks again only after 2 s plus 10 s
  per failure so far, and no create or update of the mirror makes it ask sooner;
- the output stream was deleted and made again (a worker repairing the deployment): its
  sequences start over, while the mirror asks for the sequence after its last one, so
  the new stream's outputs up to that sequence never reach the front ends.

Every worker looks at the mirror about once a second (`watch_mirror`) and, in either
case, with its own output stream there, restarts it: a delete and a create. A mirror
in step with the output stream (the first case) is created to go on from the sequence
after its last one (`opt_start_seq`), so the sequences stay those of the output stream
and a front end's reader resuming after its last sequence neither misses nor repeats an
output; one out of step (the second case) is created to copy the new output stream from
its start. The front ends' consumers of the mirror go with it: `NatsFrontEnd.outputs()`
notices within about 1.5 s (no heartbeat) and reads the new mirror from its start, which
holds only what it had not read yet.

A worker restarts the mirror only once it found it so at looks `_PATIENCE` seconds
apart: front ends back from the same outage resume reading meanwhile, and what a reader
had not read of the mirror when it is deleted is gone for that reader.

Several workers may find the same stall at once: each waits a random moment and looks
again before it deletes, and does nothing when the mirror changed meanwhile (another
worker restarted it); a mirror younger than `_YOUNG` seconds is not restarted for an
error, so a restart that does not cure it is not repeated in a loop.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import random
from typing import Any

from nats.aio.client import Client
from nats.errors import NoRespondersError

from ..._exceptions import LifecycleError
from ..._limits import is_logged
from ._setup import FRONT_API, _output_mirror, _Refused, api_request
from ._wire import NatsConfig

__all__ = ["heal_mirror", "watch_mirror"]

logger = logging.getLogger("turnrouter.runtime.nats")

_WATCH = 1.0  # seconds between two looks at the mirror (jittered by half)
_QUIET = 30.0  # seconds between looks where nothing answers (no front ends' account)
_JITTER = 0.3  # at most this random wait before a restart's second look
_YOUNG = 5.0  # seconds: a mirror this young is not restarted for an error
_PATIENCE = 2.0  # seconds between the first look that found a restart due and the restart
#: JetStream's "stream not found".
_NOT_FOUND = 10059


async def watch_mirror(nc: Client, config: NatsConfig) -> None:
    """Look at the mirror about every `_WATCH` seconds for ever (cancel to stop), and
    restart it when it stalled or fell out of step (`heal_mirror`). Where nothing
    answers (a deployment of one account) it looks again only every `_QUIET` seconds;
    unanswered looks (the subject refused by this user's permissions, a server away)
    space the next ones out, doubling up to `_QUIET`."""
    unanswered = failures = 0
    due: dict[str, float] = {}
    while True:
        pause = _WATCH * random.uniform(0.5, 1.5)
        if nc.is_connected:
            try:
                await heal_mirror(nc, config, due)
                unanswered = 0
            except NoRespondersError:
                pause = _QUIET
            except TimeoutError:
                unanswered += 1
                pause = min(_QUIET, pause * 2 ** unanswered)
            except LifecycleError as exc:
                if isinstance(exc.__cause__, NoRespondersError):
                    pause = _QUIET
            except Exception as exc:  # (nats-py, a refusal, a reply of junk)
                failures += 1  # the watch goes on whatever a reply holds
                if is_logged(failures):
                    logger.warning("turnrouter: looking at the front ends' mirror of %s "
                                   "failed (%d so far): %s", config.output_stream,
                                   failures, str(exc)[:300])
        await asyncio.sleep(pause)


async def heal_mirror(nc: Client, config: NatsConfig, due: dict[str, float]) -> int | None:
    """One look at the mirror; when it stalled or fell out of step, the output stream
    exists, and an earlier look at least `_PATIENCE` seconds ago found the same
    (`due`: when, by the mirror's creation and the restart's start), restart it.
    Returns the sequence the restarted mirror starts from (1: the output stream's
    start), None when nothing was done."""
    api = config.front_api or FRONT_API
    name = config.output_stream
    mirror = await _info(nc, f"{api}.STREAM.INFO.{name}")
    source = await _info(nc, f"$JS.API.STREAM.INFO.{name}") if mirror else None
    first = None if mirror is None or source is None else restart_from(mirror, source, name)
    if mirror is None or first is None:
        due.clear()
        return None
    key = f"{mirror.get('created')}/{first}"
    now = asyncio.get_running_loop().time()
    if key not in due:
        due.clear()  # (one entry at most: the restart due now)
        due[key] = now
    if now - due[key] < _PATIENCE:
        return None
    due.clear()
    # Another worker may have seen it too: a random moment, then a second look; a
    # mirror that changed meanwhile was restarted by someone else.
    await asyncio.sleep(random.uniform(0, _JITTER))
    again = await _info(nc, f"{api}.STREAM.INFO.{name}")
    source = await _info(nc, f"$JS.API.STREAM.INFO.{name}")
    if again is None or source is None or again.get("created") != mirror.get("created"):
        return None
    start = restart_from(again, source, name)
    if start is None:
        return None
    state = again.get("state") or {}
    error = (again.get("mirror") or {}).get("error")
    try:
        await api_request(nc, f"{api}.STREAM.DELETE.{name}")
    except _Refused as exc:
        if not (isinstance(exc.error, dict) and exc.error.get("err_code") == _NOT_FOUND):
            raise  # (deleted meanwhile: created below, or by whoever deleted it)
    stream = _output_mirror(config)
    if start > 1:
        stream["mirror"]["opt_start_seq"] = start
    try:
        await api_request(nc, f"{api}.STREAM.CREATE.{name}", stream)
    except _Refused as exc:
        logger.warning("turnrouter: the front ends' mirror of %s was recreated meanwhile "
                       "(%s)", name, str(exc.error)[:200])
        return None
    logger.warning("turnrouter: restarted the front ends' mirror of %s (it %s; it held "
                   "sequences up to %s): it now starts from sequence %d%s", name,
                   f"stalled on {error}" if error else "was out of step with the stream",
                   state.get("last_seq"), start,
                   "" if start > 1 else ", the output stream's start")
    return start


def restart_from(mirror: dict[str, Any], source: dict[str, Any], name: str) -> int | None:
    """Where a restart of the mirror (STREAM.INFO `mirror`) of the output stream
    (STREAM.INFO `source`) should start, or None when it needs none: 1 (the stream's
    start) when the mirror is out of step with the stream (its sequences go past the
    stream's, or it holds outputs older than the stream: the stream was made again),
    the sequence after its last one when it stalled on "stream not found" though the
    stream exists now (unless the mirror is younger than `_YOUNG` seconds)."""
    config = mirror.get("config") or {}
    if (config.get("mirror") or {}).get("name") != name:
        return None  # not a mirror of the output stream: not ours to restart
    mine, theirs = mirror.get("state") or {}, source.get("state") or {}
    last, held = int(mine.get("last_seq") or 0), int(mine.get("messages") or 0)
    if last > int(theirs.get("last_seq") or 0) or (
            held and int(theirs.get("messages") or 0)
            and int(theirs.get("first_seq") or 0) <= last
            and _ns(source.get("created")) > _ns(mine.get("last_ts"))):
        return 1
    error = (mirror.get("mirror") or {}).get("error")
    if not (isinstance(error, dict) and error.get("err_code") == _NOT_FOUND):
        return None
    if _ns(mirror.get("ts")) - _ns(mirror.get("created")) < _YOUNG * 1_000_000_000:
        return None
    return last + 1


def _ns(stamp: object) -> int:
    """Nanoseconds since the epoch of a JetStream RFC 3339 time (nanosecond fractions,
    which `datetime` does not read); 0 for anything else."""
    if not isinstance(stamp, str) or not stamp.endswith("Z") or "T" not in stamp:
        return 0
    whole, _, fraction = stamp[:-1].partition(".")
    try:
        seconds = datetime.datetime.fromisoformat(whole).replace(
            tzinfo=datetime.UTC).timestamp()
        nanos = int((fraction + "000000000")[:9]) if fraction else 0
    except ValueError:
        return 0
    return int(seconds) * 1_000_000_000 + nanos


async def _info(nc: Client, subject: str) -> dict[str, Any] | None:
    """STREAM.INFO's reply; None when the stream does not exist (404)."""
    reply = await nc.request(subject, b"", timeout=2.0)
    data: Any = json.loads(reply.data)
    if not isinstance(data, dict):
        raise ValueError(f"{subject}: not a JSON object")
    error = data.get("error")
    if error is None:
        return data
    if isinstance(error, dict) and error.get("code") == 404:
        return None
    raise LifecycleError(f"JetStream API {subject}: {str(error)[:200]}")
