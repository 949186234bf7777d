"""Fuzz: runtime messages from dicts, foreign objects and validation-bypassing instances.

Rule: `Topic.coerce` returns a valid payload or raises TypeError/ValueError (what the
subscriber counts), with a bounded message that never echoes values; `publish` raises
`ContractValueError` for the publisher's own bypassed instance and never disturbs others.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnrouter import ConfigurationError, ContractValueError
from turnrouter.runtime import (
    AgentRuntime,
    Interrupted,
    ParticipantJoined,
    ParticipantLeft,
    ResponseOutput,
    RuntimeMessage,
    Topic,
    UserQuery,
)

from .fuzz import ANY_TEXT, JUNK, MOSTLY_TEXT, NESTED, valid_text

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example])
PAYLOADS: list[type[RuntimeMessage]] = [UserQuery, ResponseOutput, ParticipantJoined,
                                        ParticipantLeft, Interrupted]
FIELDS = ["message_id", "timestamp_us", "traceparent", "tracestate", "participant_id",
          "text", "request_id", "route", "extra"]
#: Drawn text values are tagged with this marker; errors must never contain it.
MARKER = "SECRET-USER-TEXT"

VALUES = st.one_of(MOSTLY_TEXT.map(lambda v: MARKER + v if isinstance(v, str) else v),
                   st.integers(min_value=-5, max_value=2**64), JUNK, NESTED)
FIELD_DICTS = st.dictionaries(st.one_of(st.sampled_from(FIELDS), ANY_TEXT), VALUES,
                              max_size=6)


def check_valid(message: RuntimeMessage) -> None:
    """A coerced message is a real, fully valid instance of its class."""
    assert type(message).model_validate(message.model_dump()) == message
    for name, value in message.__dict__.items():
        if isinstance(value, str):
            assert valid_text(value), name


def coerce(topic: Topic[Any], message: object) -> RuntimeMessage | None:
    """The coerced payload, or None after the documented rejection (checked)."""
    try:
        result: RuntimeMessage = topic.coerce(message)
    except (TypeError, ValueError) as exc:
        error = str(exc)
    else:
        check_valid(result)
        return result
    assert MARKER not in error
    assert len(error) < 2000
    return None


@FUZZ
@given(st.sampled_from(PAYLOADS), FIELD_DICTS)
def test_dicts(payload: type[RuntimeMessage], fields: dict[str, Any]) -> None:
    """A dict of junk fields: a valid payload or TypeError/ValueError, values not echoed."""
    coerce(Topic("t", payload), fields)


@FUZZ
@given(st.sampled_from(PAYLOADS), st.one_of(JUNK, st.sampled_from(PAYLOADS).map(
    lambda cls: cls.model_construct())))
def test_foreign_objects(payload: type[RuntimeMessage], message: Any) -> None:
    """Any object that is not a dict or the payload class is a TypeError."""
    if isinstance(message, dict) or type(message) is payload:
        return
    with pytest.raises(TypeError):
        Topic("t", payload).coerce(message)


@FUZZ
@given(st.sampled_from(PAYLOADS), FIELD_DICTS)
def test_model_construct_bypass(payload: type[RuntimeMessage], fields: dict[str, Any]) -> None:
    """model_construct() with junk fields is validated again when coerced."""
    coerce(Topic("t", payload), payload.model_construct(**fields))


VALID = {
    UserQuery: {"participant_id": "p", "text": "hi"},
    ResponseOutput: {"participant_id": "p", "request_id": "r", "route": "a", "text": "t"},
    ParticipantJoined: {"participant_id": "p"},
    ParticipantLeft: {"participant_id": "p"},
    Interrupted: {},
}


@FUZZ
@given(st.sampled_from(PAYLOADS), FIELD_DICTS)
def test_model_copy_bypass(payload: type[RuntimeMessage], update: dict[str, Any]) -> None:
    """model_copy(update=junk) of a valid message is validated again when coerced."""
    original = payload.model_validate(VALID[payload])
    coerce(Topic("t", payload), original.model_copy(update=update))


@FUZZ
@given(st.sampled_from(PAYLOADS), FIELD_DICTS)
def test_publish_own_bypassed_instance(payload: type[RuntimeMessage],
                                       update: dict[str, Any]) -> None:
    """publish() delivers a valid copy or raises ContractValueError; subscribers only
    ever receive valid payloads."""
    topic: Topic[Any] = Topic("t", payload)
    message = payload.model_validate(VALID[payload]).model_copy(update=update)
    received: list[RuntimeMessage] = []

    async def sink(item: RuntimeMessage) -> None:
        received.append(item)

    async def main() -> None:
        with anyio.fail_after(10):
            await publish(topic, message, sink, received)

    anyio.run(main)


async def publish(topic: Topic[Any], message: RuntimeMessage, sink: Any,
                  received: list[RuntimeMessage]) -> None:
    """Publish one message to a runtime with one plain subscriber; check the outcome."""
    async with AgentRuntime() as runtime:
        runtime.subscribe(topic, sink)
        error = ""
        try:
            await runtime.publish(topic, message)
        except ContractValueError as exc:
            error = str(exc)
    if error:
        assert MARKER not in error
        assert received == []
    else:
        assert len(received) == 1
        check_valid(received[0])


@FUZZ
@given(st.one_of(JUNK, st.integers(max_value=0), st.integers(min_value=2**64)))
def test_runtime_publish_batch(value: Any) -> None:
    """AgentRuntime(publish_batch=...) takes an int of at least 1; anything else is a
    ConfigurationError naming the parameter, with the value shown short."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        assert AgentRuntime(publish_batch=value) is not None
        return
    with pytest.raises(ConfigurationError, match="publish_batch") as caught:
        AgentRuntime(publish_batch=value)
    assert len(str(caught.value)) < 200
