"""asyncio's `returning true from eof_received() has no effect when using ssl`, printed
at every TLS close or reconnect of a NATS connection (redteam18 F8), is silenced by the
worker CLI and by `NatsFrontEnd.connect`, and no other asyncio message is."""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator

import pytest

from turnrouter.cli import main
from turnrouter.runtime.nats import NatsConfig, NatsFrontEnd

from .conftest import NatsServer

pytestmark = pytest.mark.anyio

TEXT = "returning true from eof_received() has no effect when using ssl"


@contextlib.contextmanager
def bare_asyncio_logger() -> Iterator[logging.Logger]:
    """The `asyncio` logger without filters for the block (restored after)."""
    target = logging.getLogger("asyncio")
    before = list(target.filters)
    target.filters.clear()
    try:
        yield target
    finally:
        target.filters[:] = before


def said(target: logging.Logger, caplog: pytest.LogCaptureFixture) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncio"):
        target.warning(TEXT)
        target.warning("something else: %s", "kept")
    return [record.getMessage() for record in caplog.records]


async def test_the_front_end_silences_that_warning_only(
        nats_server: NatsServer, caplog: pytest.LogCaptureFixture) -> None:
    with bare_asyncio_logger() as target:
        assert said(target, caplog) == [TEXT, "something else: kept"]
        front = await NatsFrontEnd.connect(NatsConfig(url=nats_server.url))
        await front.close()
        assert said(target, caplog) == ["something else: kept"]


def test_the_worker_cli_silences_that_warning_only(
        caplog: pytest.LogCaptureFixture) -> None:
    with bare_asyncio_logger() as target:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.suppress(SystemExit):
            main(["worker", "--nats", "nats://127.0.0.1:1", "--app", "no_such_module:f"])
        assert said(target, caplog) == ["something else: kept"]
