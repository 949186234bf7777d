"""Fleet-wide interrupts: an `Interrupted` without a participant, sent to every replica.

A flood cannot start unbounded work: at most one interrupt runs beside the one pending,
and those arriving meanwhile join it (counted as `coalesced`); anything else on the
subject is refused and counted (`nats_control`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.msg import Msg

from ..._router import AgentRouter
from .._messages import Interrupted
from ._wire import NatsConfig

__all__ = ["FleetInterrupts", "interrupt_problem"]

#: Fleet-subject callbacks between two returns to the event loop (a flood's bound).
_YIELD_EVERY = 64


class FleetInterrupts:
    """The subscription callback of `NatsConfig.interrupt_all_subject` on one replica."""

    def __init__(self, config: NatsConfig, router: AgentRouter,
                 spawn: Callable[[Awaitable[Any], str], Any]) -> None:
        self._config, self._router, self._spawn = config, router, spawn
        self._pending = False
        self._seen = 0

    async def on_message(self, msg: Msg) -> None:
        """A fleet-wide interrupt: an `Interrupted` without a participant, else refused
        and counted. A flood starts at most one interrupt beside the one running: those
        arriving while one is pending join it (counted as `coalesced`)."""
        self._seen += 1
        if not self._seen % _YIELD_EVERY:
            # nats-py hands a subscription's queued messages over without returning to
            # the loop: a flood would hold it for as long as the queue is long.
            await asyncio.sleep(0)
        reason = interrupt_problem(self._config, msg.data)
        if reason:
            self._router.report_rejected("nats_control", reason)
        elif self._pending:
            self._router.report_rejected("nats_control", "coalesced")
        else:
            self._pending = True
            self._spawn(self._interrupt_all(), "interrupt all")

    async def _interrupt_all(self) -> None:
        self._pending = False  # from here on, a new request needs a new pass
        await self._router.interrupt(None)


def interrupt_problem(config: NatsConfig, data: bytes) -> str:
    """Why a message on the fleet-wide interrupt subject is refused ('' if it is not)."""
    if len(data) > config.max_message_bytes:
        return "oversized"
    try:
        message = Interrupted.model_validate_json(data)
    except (ValueError, RecursionError):  # pydantic's ValidationError is a ValueError
        return "invalid"
    return "invalid" if message.participant_id is not None else ""
