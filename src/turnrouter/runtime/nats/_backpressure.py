"""Backpressure: a saturated router takes no new message from a partition until it is
ready again, and a held query already followed by a newer one is dropped unrun."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from ..._exceptions import ConfigurationError, LifecycleError
from ..._router import AgentRouter
from ._metrics import RuntimeMetrics
from ._setup import api_request
from ._wire import NatsConfig, Rejected, ack_sequences, parse_input

__all__ = ["backpressure"]


async def backpressure(nc: Client, config: NatsConfig, router: AgentRouter,
                       metrics: RuntimeMetrics | None, msg: Msg) -> bool:
    """The router is saturated: take no new message until it is ready again (the
    partition's next messages wait in the stream, `max_ack_pending=1`), for at most
    `pull_expires`. True when the held message is a query a newer query of the same
    participant already follows in the stream: it is acknowledged and counted
    (`rejected{reason=superseded}`) without any work, as the router would have
    superseded it anyway."""
    if metrics is not None:
        metrics.backpressure.labels("paused").inc()
    # Bounded by pull_expires, well inside ack_wait (no redelivery); the partition keeps
    # its pin meanwhile (the worker's keep-alive pulls).
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(config.pull_expires):
            await router.wait_ready()
    if not msg.subject.endswith(".query") or not msg.reply:
        return False
    try:
        last = await api_request(nc, f"$JS.API.STREAM.MSG.GET.{config.stream}",
                                 {"last_by_subj": msg.subject})
        stored = last["message"]
        newest = int(stored["seq"])
    except (LifecycleError, ConfigurationError, KeyError, TypeError, ValueError):
        return False  # none newer (404) or unknown: run it
    if newest <= _stream_sequence(msg.reply) or not _a_query(config, msg.subject, stored):
        return False
    await nc.publish(msg.reply, b"+ACK")
    router.report_rejected("nats_input", "superseded")
    if metrics is not None:
        metrics.backpressure.labels("superseded").inc()
    return True


def _a_query(config: NatsConfig, subject: str, stored: Any) -> bool:
    """Whether the newer message stored on `subject` is a query the worker would run:
    junk (or another's decoy) published on a participant's subject supersedes nothing,
    or anyone could make a busy worker drop their real query unrun (redteam22 F5)."""
    try:
        data = base64.b64decode(stored.get("data") or "", validate=True)
        head = base64.b64decode(stored.get("hdrs") or "", validate=True)
    except (AttributeError, TypeError, ValueError, binascii.Error):
        return False
    msg_id = ""  # as nats-py reads it: the last one given, stripped
    for line in head.decode("utf-8", "replace").split("\r\n")[1:]:
        name, _, value = line.partition(":")
        if name == "Nats-Msg-Id":
            msg_id = value.strip()
    try:
        return parse_input(config, subject, data, msg_id)[2] == "query"
    except Rejected:
        return False


def _stream_sequence(reply: str) -> int:
    """The stream sequence in a JetStream ack subject (`ack_sequences`); a huge number
    when unreadable, so nothing counts as newer."""
    sequences = ack_sequences(reply)
    return 2**63 if sequences is None else sequences[0]
