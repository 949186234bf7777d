"""The publishing side: front ends put typed messages on the wire and read outputs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from nats.aio.client import Client
from nats.errors import Error as NatsError

from ..._exceptions import ContractTypeError, LifecycleError, TurnrouterError
from .._messages import Interrupted, ResponseOutput, RuntimeMessage
from ._security import connect
from ._setup import api_request, ensure_deployment
from ._wire import NatsConfig, kind_of

__all__ = ["NatsFrontEnd"]


class NatsFrontEnd:
    """Publishes queries, joins, departures and interrupts; reads deduplicated outputs.

    Inputs go to the input stream (`publish` returns once the server stored them, so a
    returned publish is never lost); a global interrupt (`Interrupted` without a
    participant) goes to every replica at once. Outputs must be read from the output
    stream (`outputs()`), not from a plain subscription: only the stream drops the
    duplicate of a turn's answer that a crashed replica and its successor may both send.
    """

    def __init__(self, nc: Client, config: NatsConfig) -> None:
        self._nc, self._config = nc, config
        self._js = nc.jetstream()

    @classmethod
    async def connect(cls, config: NatsConfig, **options: Any) -> NatsFrontEnd:
        """Connect to `config.url` (options go to `nats.connect`, over the credentials
        and TLS of `config`) and make sure the streams exist, so a front end may start
        before any worker. Streams that exist are left alone: a front end of a locked
        deployment (deploy/nats/) may only look them up, the workers create them."""
        nc = await connect(config, "frontend", **options)
        try:
            if not await _deployment_exists(nc, config):
                await ensure_deployment(nc, config)
        except BaseException:
            await nc.close()
            raise
        return cls(nc, config)

    @property
    def connection(self) -> Client:
        return self._nc

    async def close(self) -> None:
        await self._nc.drain()

    async def publish(self, message: RuntimeMessage,
                      headers: dict[str, str] | None = None) -> None:
        """Publish one input message; W3C trace context travels in the NATS headers."""
        try:
            kind = kind_of(message)
        except TypeError as exc:
            raise ContractTypeError(str(exc)) from exc
        hdrs = {"Nats-Msg-Id": message.message_id, **message.trace_carrier(),
                **(headers or {})}
        data = message.model_dump_json().encode("utf-8")
        try:
            if isinstance(message, Interrupted) and message.participant_id is None:
                await self._nc.publish(self._config.interrupt_all_subject, data, headers=hdrs)
                return
            pid = getattr(message, "participant_id", None)
            assert isinstance(pid, str)
            await self._js.publish(self._config.input_subject(pid, kind), data, headers=hdrs)
        except NatsError as exc:
            raise LifecycleError(f"publishing {kind} failed: {exc!r}") from exc

    async def outputs(self, *, deliver_new: bool = True,
                      subscribed: asyncio.Event | None = None
                      ) -> AsyncGenerator[ResponseOutput, None]:
        """Outputs from the output stream, in stream order (ordered consumer).

        With `deliver_new` (the default) only outputs stored after the subscription are
        read: pass `subscribed` and publish once it is set, or an early answer may be
        stored before the subscription exists and never be read."""
        from nats.js.api import DeliverPolicy

        sub = await self._js.subscribe(
            f"{self._config.prefix}.out.*", ordered_consumer=True,
            deliver_policy=DeliverPolicy.NEW if deliver_new else DeliverPolicy.ALL)
        if subscribed is not None:
            subscribed.set()
        try:
            async for msg in sub.messages:
                yield ResponseOutput.model_validate_json(msg.data)
        finally:
            await sub.unsubscribe()


async def _deployment_exists(nc: Client, config: NatsConfig) -> bool:
    """Whether both streams exist (a look-up a front end's permissions allow)."""
    for name in (config.stream, config.output_stream):
        try:
            await api_request(nc, f"$JS.API.STREAM.INFO.{name}", wait=2.0)
        except TurnrouterError:
            return False
    return True
