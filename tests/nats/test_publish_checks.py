"""`NatsFrontEnd.publish` validates again what skipped validation (redteam18 F5: a
`model_construct()` or `model_copy(update=...)` message was sent, every worker refused
it, and its turn never ended), and refuses wrong argument types by name."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

import nats
from turnrouter import ContractTypeError, ContractValueError, LifecycleError
from turnrouter.runtime import UserQuery
from turnrouter.runtime.nats import NatsConfig, NatsFrontEnd, encode_token

from .conftest import NatsServer

pytestmark = pytest.mark.anyio

BASE: dict[str, Any] = {"traceparent": None, "tracestate": None,
                        "timestamp_us": 1_700_000_000_000_000}


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


async def test_an_id_taken_by_another_publisher_is_raised_not_dropped_silently(
        nats_server: NatsServer, caplog: pytest.LogCaptureFixture) -> None:
    """A publisher on its own participant's subject sends the `Nats-Msg-Id` of another
    participant's known next id (`<token>.turn-1`): the stream then drops that
    participant's `turn-1` as a duplicate. `publish` says so (`ContractValueError`,
    logged and counted) instead of returning as if it was stored (redteam18 F7); the
    same message with a new id goes, and a retry of it returns normally."""
    front = await NatsFrontEnd.connect(NatsConfig(url=nats_server.url))
    try:
        nc = await nats.connect(nats_server.url)
        try:
            decoy = UserQuery(participant_id="mallory", text="decoy")
            await nc.jetstream().publish(
                f"turnrouter.in.{encode_token('mallory')}.query",
                decoy.model_dump_json().encode(),
                headers={"Nats-Msg-Id": f"{encode_token('vic')}.turn-1"})
        finally:
            await nc.close()
        victim = UserQuery(participant_id="vic", text="mine", message_id="turn-1")
        with caplog.at_level(logging.WARNING, logger="turnrouter.runtime.nats"), \
                pytest.raises(ContractValueError, match=r"'turn-1'.*did not publish"):
            await front.publish(victim)
        assert front.inputs_duplicated == 1
        renamed = victim.model_copy(update={"message_id": "turn-1b"})
        await front.publish(renamed)
        await front.publish(renamed)  # a retry of this front end's own message
        assert front.inputs_duplicated == 1
    finally:
        await front.close()


async def test_a_front_end_whose_server_never_answers_at_start_says_so(
        caplog: pytest.LogCaptureFixture) -> None:
    """newcomer22: a front end given a port where nothing listens (a typo, a server not
    started) retried for ever, a hang logging errors at 1, 2, 4, 8... Now its first
    connection is bounded by `reconnect_for`, as a worker's start is: `LifecycleError`
    saying so, the lines asking whether a server listens there."""
    with caplog.at_level(logging.WARNING, logger="turnrouter"), \
            pytest.raises(LifecycleError, match="unreachable for"):
        async with asyncio.timeout(30):  # (it hung for ever before)
            await NatsFrontEnd.connect(NatsConfig(url="nats://127.0.0.1:1", reconnect_for=1))
    lines = [r.getMessage() for r in caplog.records if "connect attempt" in r.getMessage()]
    assert lines and "is a nats-server listening at that address?" in lines[0]


async def test_a_url_where_a_configuration_goes_is_a_type_error() -> None:
    """`NatsFrontEnd.connect("nats://...")` (what `--nats` takes) was an AttributeError
    from deep inside; now a ContractTypeError saying what it needs."""
    with pytest.raises(ContractTypeError, match=r"needs a NatsConfig \(NatsConfig\(url="):
        await NatsFrontEnd.connect("nats://127.0.0.1:1")  # type: ignore[arg-type]


def test_the_example_front_end_without_a_worker_says_what_is_missing(
        nats_server: NatsServer) -> None:
    """newcomer22: `examples/nats_front.py` with no worker serving (it failed to start,
    another --prefix) ended in a 27-line TimeoutError traceback after 10 s; now one line
    asking whether a worker serves that server."""
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "nats_front.py"
    done = subprocess.run([sys.executable, str(example), nats_server.url],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [
        "nats_front: no answer within 10 s: is a `turnrouter worker` serving this server "
        "(with the same --prefix)?"]


async def test_a_bound_shorter_than_one_attempt_is_not_called_unreachable() -> None:
    """redteam22 N2: a `reconnect_for` shorter than one connection attempt (here a
    server that takes the connection and never greets it) said `unreachable for 0.0 s
    (0 attempts)`; now it says no attempt finished within the bound."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"nats://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(LifecycleError, match=r"no attempt finished within "
                                                 r"reconnect_for \(0\.5 s\)"):
            async with asyncio.timeout(30):
                await NatsFrontEnd.connect(NatsConfig(url=url, reconnect_for=0.5))
