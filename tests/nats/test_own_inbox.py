"""Front ends that must not see each other's outputs get a user and an inbox prefix of
their own, as deploy/nats/permissions.conf shows (redteam18 F1: under the shared
`frontend` user's inbox prefix, one front end read another's deliveries, learnt its
consumer's name and changed it). The shipped example, uncommented: such a front end
reads its answers, and the shared user may not subscribe to its inbox."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

import nats
from turnrouter.runtime.nats import NatsConfig, NatsFrontEnd

from .conftest import NatsServer, Worker
from .test_trust import DEPLOY, PASSWORDS, WORKER_ENV, answered_by_fleet

pytestmark = pytest.mark.anyio

OWN = "frontend-a-secret-2001"


def own_inbox_deployment(folder: Path) -> Path:
    """The shipped configuration with the example front end "a" added as its comments
    say: the permissions block uncommented, the user added to FRONT."""
    permissions = (DEPLOY / "permissions.conf").read_text()
    start = permissions.index("# FRONTEND_A_PERMISSIONS = {")
    block = [line[2:] for line in permissions[start:].splitlines()]
    (folder / "permissions.conf").write_text(permissions + "\n" + "\n".join(block) + "\n")
    server = (DEPLOY / "nats-server.conf").read_text()
    anchor = "permissions: $FRONTEND_PERMISSIONS}"
    assert anchor in server
    server = server.replace(anchor, anchor + "\n      {user: frontend_a, password: "
                            "$TURNROUTER_FRONTEND_A_PASSWORD, permissions: "
                            "$FRONTEND_A_PERMISSIONS}")
    (folder / "nats-server.conf").write_text(server)
    return folder / "nats-server.conf"


async def test_a_front_end_of_its_own_inbox_is_out_of_the_shared_users_sight(
        tmp_path: Path) -> None:
    config_file = own_inbox_deployment(tmp_path)
    server = NatsServer(config=config_file,
                        env={**PASSWORDS, "TURNROUTER_FRONTEND_A_PASSWORD": OWN})
    worker = Worker(server.url, "own", "--nats-user", "worker", env=WORKER_ENV)
    shared: Any = None
    try:
        front = await NatsFrontEnd.connect(
            NatsConfig(url=server.url, user="frontend_a", password=OWN),
            inbox_prefix="_INBOX_turnrouter_frontend_a")
        try:
            assert await answered_by_fleet(front, "ann", "hello") == "hello|-|N"
        finally:
            await front.close()
        refused = asyncio.Event()

        async def errors(exc: Exception) -> None:
            if "permissions violation" in str(exc).lower():
                refused.set()

        shared = await nats.connect(server.url, user="frontend",
                                    password=PASSWORDS["TURNROUTER_FRONTEND_PASSWORD"],
                                    inbox_prefix="_INBOX_turnrouter_frontend",
                                    error_cb=errors)
        await shared.subscribe("_INBOX_turnrouter_frontend_a.>")
        await shared.flush()
        async with asyncio.timeout(5):
            await refused.wait()
    finally:
        if shared is not None:
            await shared.close()
        worker.close()
        server.close()
