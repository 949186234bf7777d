"""`NatsFrontEnd.publish` validates again what skipped validation (redteam18 F5: a
`model_construct()` or `model_copy(update=...)` message was sent, every worker refused
it, and its turn never ended), and refuses wrong argument types by name."""

from __future__ import annotations

from typing import Any

import pytest

from turnrouter import ContractTypeError, ContractValueError
from turnrouter.runtime import UserQuery
from turnrouter.runtime.nats import NatsConfig, NatsFrontEnd

from .conftest import NatsServer

pytestmark = pytest.mark.anyio

BASE = {"traceparent": None, "tracestate": None, "timestamp_us": 1_700_000_000_000_000}


def bypassed() -> list[tuple[Any, type[Exception], str]]:
    """Messages that skipped validation, the error `publish` raises and the field it names."""
    good = UserQuery(participant_id="pat", text="hi")
    return [
        (UserQuery.model_construct(participant_id="pat", text=None, message_id="b1", **BASE),
         ContractTypeError, "text"),
        (UserQuery.model_construct(participant_id="pat", text=42, message_id="b2", **BASE),
         ContractTypeError, "text"),
        (good.model_copy(update={"message_id": "m" * 300}), ContractValueError, "message_id"),
        (good.model_copy(update={"timestamp_us": -1}), ContractValueError, "timestamp_us"),
        (good.model_copy(update={"message_id": ""}), ContractValueError, "message_id"),
        (good.model_copy(update={"participant_id": 5}), ContractTypeError, "participant_id"),
        (good.model_copy(update={"text": "a\ud800b"}), ContractValueError, "text"),
    ]


async def test_publish_refuses_what_skipped_validation(nats_server: NatsServer) -> None:
    """Each refused with the contract error naming the field (never an AttributeError or
    a serializer's error); a list for `headers` names the argument. A valid message
    still goes (its instance is the one published)."""
    front = await NatsFrontEnd.connect(NatsConfig(url=nats_server.url))
    try:
        for message, error, field in bypassed():
            with pytest.raises(error, match=field):
                await front.publish(message)
        good = UserQuery(participant_id="pat", text="hi")
        with pytest.raises(ContractTypeError, match="headers"):
            await front.publish(good, headers=[("a", "b")])  # type: ignore[arg-type]
        await front.publish(good)
        # A bypassed copy that is valid all the same goes too.
        await front.publish(good.model_copy(update={"message_id": "copy-1"}))
    finally:
        await front.close()
