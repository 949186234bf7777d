"""Trust through NATS's own security: the shipped server configuration (deploy/nats/),
credentials and TLS in `turnrouter worker` and `NatsFrontEnd`, and secrets that never
reach an error, a log line or a repr.

Every test here runs a real nats-server with `deploy/nats/nats-server.conf` (or, for
nkeys and tokens, a configuration including its `permissions.conf`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from prometheus_client import CollectorRegistry

import nats
from turnrouter import ConfigurationError, LifecycleError
from turnrouter.runtime import Interrupted, ParticipantJoined, ParticipantLeft, UserQuery
from turnrouter.runtime.nats import (
    MAX_CA_FILE_BYTES,
    NatsConfig,
    NatsFrontEnd,
    NatsWorker,
    encode_token,
)

from .conftest import (
    READY_WITHIN,
    ROOT,
    NatsServer,
    Worker,
    cancelled,
    free_port,
    metric_value,
    settled,
    until_true,
)
from .crowd import Heard, ask, listen, listening, running
from .operator import Operator
from .proxy import proxied

pytestmark = pytest.mark.anyio

DEPLOY = ROOT / "deploy" / "nats"
PASSWORDS = {"TURNROUTER_WORKER_PASSWORD": "worker-secret-5150",
             "TURNROUTER_FRONTEND_PASSWORD": "frontend-secret-8086"}
WORKER_ENV = {"TURNROUTER_NATS_PASSWORD": PASSWORDS["TURNROUTER_WORKER_PASSWORD"]}
#: Where the shipped configuration imports the front ends' account's API (a worker
#: looks there unless told otherwise).
FRONT_API = ("--front-api", "$JS.FRONT.API")


def frontend_config(url: str, tls_ca_file: str | None = None) -> NatsConfig:
    return NatsConfig(url=url, user="frontend", tls_ca_file=tls_ca_file,
                      password=PASSWORDS["TURNROUTER_FRONTEND_PASSWORD"])


@pytest.fixture
def locked() -> Iterator[NatsServer]:
    """nats-server running the shipped configuration."""
    server = NatsServer(config=DEPLOY / "nats-server.conf", env=PASSWORDS)
    try:
        yield server
    finally:
        server.close()


async def answered_by_fleet(front: NatsFrontEnd, pid: str, text: str) -> str:
    heard = Heard()
    ready = asyncio.Event()
    task = asyncio.create_task(listen(front, heard, ready))
    try:
        async with asyncio.timeout(15):
            await ready.wait()
        return await ask(front, heard, pid, text)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


# ---------------------------------------------------------------- the shipped configuration
async def test_locked_fleet_answers_with_the_right_credentials(locked: NatsServer) -> None:
    """A worker (`--nats-user worker`, password from the environment) and a front end
    (`NatsConfig(user=..., password=...)`) of the shipped configuration work end to end;
    the password is nowhere on the worker's command line."""
    worker = Worker(locked.url, "locked", "--nats-user", "worker", env=WORKER_ENV)
    try:
        front = await NatsFrontEnd.connect(frontend_config(locked.url))
        try:
            assert await answered_by_fleet(front, "ann", "hello") == "hello|-|N"
        finally:
            await front.close()
    finally:
        worker.close()


async def test_front_end_may_not_publish_what_only_workers_publish(
        locked: NatsServer) -> None:
    """A front end's user publishing on control, presence, timing or output subjects, or
    touching participant state or a worker's replies, is refused by the server; a worker
    subscribed to those subjects receives none of it."""
    worker_nc = await nats.connect(locked.url, user="worker",
                                   password=PASSWORDS["TURNROUTER_WORKER_PASSWORD"],
                                   inbox_prefix="_INBOX_turnrouter_worker")
    received: list[str] = []

    async def keep(msg: Msg) -> None:
        received.append(msg.subject)

    for subject in ("turnrouter.ctl.interrupt", "turnrouter.presence", "turnrouter.timing"):
        await worker_nc.subscribe(subject, cb=keep)
    await settled(worker_nc)
    refusals: list[str] = []
    all_refused = asyncio.Event()
    expected = 21  # the nineteen publishes and two subscriptions below

    async def collect(exc: Exception) -> None:
        if "permissions violation" in str(exc).lower():
            refusals.append(str(exc).lower())
            if len(refusals) >= expected:
                all_refused.set()

    front_nc = await nats.connect(locked.url, user="frontend",
                                  password=PASSWORDS["TURNROUTER_FRONTEND_PASSWORD"],
                                  error_cb=collect)
    forbidden = ["turnrouter.ctl.interrupt", "turnrouter.presence", "turnrouter.timing",
                 "turnrouter.out.YWxpY2U", "turnrouter.probe.0",
                 NatsConfig().probe_subject(0),  # an input of kind probe: workers only
                 # No other kind than the four (each its own subject, past the
                 # participant's queue bound: redteam22 F4).
                 f"turnrouter.in.{encode_token('alice')}.k0",
                 f"turnrouter.in.{encode_token('alice')}.Query",
                 "$KV.turnrouter_state.0.YWxpY2U", "$JS.API.STREAM.DELETE.TURNROUTER_IN",
                 "$JS.API.CONSUMER.CREATE.TURNROUTER_IN.p0",
                 "$JS.TURNROUTER.API.CONSUMER.CREATE.TURNROUTER_OUT", "turnrouter.mirror.x",
                 # Only workers restart the mirror.
                 "$JS.API.STREAM.DELETE.TURNROUTER_OUT",
                 "$JS.FRONT.API.STREAM.DELETE.TURNROUTER_OUT",
                 # Named consumers could be another front end's: changed (a filter that
                 # reads nothing), deleted, or looked up (redteam12 F0, F1).
                 "$JS.API.CONSUMER.CREATE.TURNROUTER_OUT.x",
                 "$JS.API.CONSUMER.DELETE.TURNROUTER_OUT.x",
                 "$JS.API.CONSUMER.INFO.TURNROUTER_OUT.x",
                 # The input stream's creation time keys the fleet's probe ids.
                 "$JS.API.STREAM.INFO.TURNROUTER_IN"]
    try:
        for subject in forbidden:
            await front_nc.publish(subject, b'{"replica":"fake","owned":0}')
        await front_nc.subscribe("_INBOX_turnrouter_worker.>", cb=keep)
        await front_nc.subscribe("turnrouter.>", cb=keep)
        await front_nc.flush()
        async with asyncio.timeout(10):
            await all_refused.wait()
        await worker_nc.flush()
        refused = " ".join(refusals)
        for subject in forbidden:
            assert subject.lower() in refused
        assert received == []
    finally:
        await front_nc.close()
        await worker_nc.close()


async def test_a_front_ends_consumer_delivers_nothing_to_the_workers(
        locked: NatsServer) -> None:
    """A front end's user may create (unnamed) consumers of the output stream (it reads
    outputs that way), and the server does not check a consumer's deliver subject
    against its creator's permissions. Pointed at a fleet subject with `deliver_policy: all`, such a
    consumer replayed every stored output into every worker: 20 of them got the workers
    cut off as slow consumers and turns failed. In the shipped configuration front ends
    read their own account's mirror of the output stream, so the replay stays in that
    account, where only the imports lead out: pointed at a fleet subject, at the
    imported API the mirror uses (a literal import would count as a listener and replay
    the outputs into the workers' account's API: it is a wildcard), or at the imported
    inputs, such a consumer has outputs pending and has delivered none (or was removed
    for having no listener); the workers count no control message, and turns are
    answered."""
    worker = Worker(locked.url, "locked", "--nats-user", "worker", env=WORKER_ENV)
    front = await NatsFrontEnd.connect(frontend_config(locked.url))
    nc = await nats.connect(locked.url, user="frontend",
                            password=PASSWORDS["TURNROUTER_FRONTEND_PASSWORD"],
                            inbox_prefix="_INBOX_turnrouter_frontend")
    try:
        assert await answered_by_fleet(front, "ann", "hello") == "hello|-|N"
        targets = ["turnrouter.ctl.interrupt", "turnrouter.presence", "turnrouter.timing",
                   "$JS.TURNROUTER.API.CONSUMER.CREATE.TURNROUTER_OUT",
                   "$JS.TURNROUTER.API.CONSUMER.CREATE.KV_turnrouter_state",
                   f"turnrouter.in.{encode_token('ann')}.query", "turnrouter.mirror.x",
                   "$JS.FC.TURNROUTER_OUT.x"]
        names = {}
        for target in targets:
            config = ConsumerConfig(deliver_subject=target, deliver_policy=DeliverPolicy.ALL,
                                    ack_policy=AckPolicy.NONE, inactive_threshold=60.0)
            reply = await nc.request("$JS.API.CONSUMER.CREATE.TURNROUTER_OUT", json.dumps(
                {"stream_name": "TURNROUTER_OUT", "config": config.as_dict()}).encode(),
                timeout=5)
            names[json.loads(reply.data)["name"]] = target
        assert await answered_by_fleet(front, "ann", "again") == "again|hello|F"
        # (looked up on the server's monitoring port: front ends may not look consumers up)
        jsz = json.loads(await asyncio.to_thread(lambda: urllib.request.urlopen(
            f"http://127.0.0.1:{locked.monitor}/jsz?accounts=true&streams=true"
            "&consumers=true", timeout=5).read()))
        consumers = {c["name"]: c for account in jsz["account_details"]
                     for stream in account.get("stream_detail") or ()
                     for c in stream.get("consumer_detail") or ()}
        for name, target in names.items():
            info = consumers.get(name)
            if info is None:
                continue  # removed: nothing listened to what it would deliver
            assert info["num_pending"] >= 2, target
            assert info["delivered"]["stream_seq"] == 0, target
        assert metric_value(worker.metrics(), "turnrouter_runtime_rejected_messages_total",
                            'topic="nats_control"') == 0
    finally:
        await nc.close()
        await front.close()
        worker.close()


async def test_a_front_end_started_before_any_worker_says_so(locked: NatsServer) -> None:
    """In the shipped configuration a front end may only look the streams up: started
    before any worker created them, it fails with an error saying that (and what the
    server refused), not with the JetStream API's bare timeout."""
    with pytest.raises(LifecycleError, match=r"workers create it; start one first") as err:
        await NatsFrontEnd.connect(frontend_config(locked.url))
    assert "$js.api.stream.create." in str(err.value).lower()
    assert PASSWORDS["TURNROUTER_FRONTEND_PASSWORD"] not in str(err.value)


#: A bound on the wait for a start-up refused for the credentials' permissions: well
#: under the front end's old 7 s (two request timeouts) and the worker's old 60 s
#: (`reconnect_for`), far over the round trip or two it takes.
REFUSED_WITHIN = 4.0


async def test_a_front_end_with_the_workers_credentials_says_so_at_once(
        locked: NatsServer, caplog: pytest.LogCaptureFixture) -> None:
    """The two credentials of the shipped configuration swapped, front end side: the
    server refuses the subscription to the front end's replies (`worker` may subscribe
    to a worker's only). `NatsFrontEnd.connect` ends at once with a `ConfigurationError`
    naming the refused subject and the user a front end should be, in one line without
    the password; before, it waited for two requests' timeouts (7 s) and said
    `JetStream API $JS.API.STREAM.CREATE.TURNROUTER_IN failed: TimeoutError()`."""
    secret = PASSWORDS["TURNROUTER_WORKER_PASSWORD"]
    config = NatsConfig(url=locked.url, user="worker", password=secret)
    with caplog.at_level(logging.DEBUG), pytest.raises(ConfigurationError) as err:
        async with asyncio.timeout(REFUSED_WITHIN):
            await NatsFrontEnd.connect(config)
    message = str(err.value)
    assert message.startswith("NATS refused subscription to '_INBOX_turnrouter_frontend.>' "
                              "(permissions violation for user 'worker'): these "
                              "credentials are not a front end's"), message
    assert "front-end user is `frontend`" in message and "\n" not in message
    assert secret not in message + caplog.text


async def test_an_error_callback_of_the_caller_keeps_refusals_fast(
        locked: NatsServer) -> None:
    """A caller's own `error_cb` (a `nats.connect` option `NatsFrontEnd.connect`
    passes on) is called with the refusal, and does not replace turnrouter's: the
    swapped credentials still end the connect at once, not after a timeout."""
    seen: list[Exception] = []

    async def mine(exc: Exception) -> None:
        seen.append(exc)

    config = NatsConfig(url=locked.url, user="worker",
                        password=PASSWORDS["TURNROUTER_WORKER_PASSWORD"])
    with pytest.raises(ConfigurationError, match="these credentials are not a front end's"):
        async with asyncio.timeout(REFUSED_WITHIN):
            await NatsFrontEnd.connect(config, error_cb=mine)
    assert any("permissions violation" in str(exc).lower() for exc in seen), seen


async def test_a_worker_with_the_front_ends_credentials_exits_at_once(
        locked: NatsServer) -> None:
    """The two credentials swapped, worker side: `turnrouter worker --nats-user
    frontend` is refused the JetStream API (and a worker's replies). It exits 1 at once
    with one line on stderr naming the refused subject and the user a worker should be,
    no password, no traceback; before, it retried the set-up for `--reconnect-for`
    (60 s) and then said `... failed: TimeoutError()`."""
    secret = PASSWORDS["TURNROUTER_FRONTEND_PASSWORD"]
    done = await asyncio.to_thread(
        subprocess.run,
        [*_worker_command(), "--nats", locked.url, "--app", "tests.nats.app:make_router",
         "--nats-user", "frontend"],
        capture_output=True, text=True, cwd=ROOT,
        env={**_env(), "TURNROUTER_NATS_PASSWORD": secret},
        timeout=READY_WITHIN / 2)  # (well under reconnect_for's 60 s; it takes ~1 s)
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines() == [done.stderr.strip()], done.stderr  # one line
    assert done.stderr.startswith(
        "turnrouter worker: NATS refused publish to '$JS.API.STREAM.CREATE.TURNROUTER_IN'"
        " and subscription to '_INBOX_turnrouter_worker.>' (permissions violation for user "
        "'frontend'): these credentials are not a worker's"), done.stderr
    assert "worker user is `worker`" in done.stderr
    for password in PASSWORDS.values():
        assert password not in done.stdout + done.stderr


async def test_a_worker_of_another_prefix_than_the_permissions_says_so(
        locked: NatsServer) -> None:
    """The right user with `--prefix other` under the shipped permissions (which name
    `turnrouter`): it exits 1 at once, one line saying the permissions do not name that
    prefix, not that the credentials are another role's. Before, it retried for 60 s and
    ended on a `TimeoutError`."""
    done = await asyncio.to_thread(
        subprocess.run,
        [*_worker_command(), "--nats", locked.url, "--app", "tests.nats.app:make_router",
         "--nats-user", "worker", "--prefix", "other"],
        capture_output=True, text=True, cwd=ROOT, env={**_env(), **WORKER_ENV},
        timeout=READY_WITHIN / 2)
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines() == [done.stderr.strip()], done.stderr  # one line
    assert "(permissions violation for user 'worker'): this user's permissions do not " \
           "name prefix 'other'" in done.stderr, done.stderr
    assert "not a worker's" not in done.stderr


async def test_a_refusal_while_running_is_logged_once_per_subject(
        locked: NatsServer, caplog: pytest.LogCaptureFixture) -> None:
    """A refusal once started does not end anything: a front end of the shipped
    configuration sending fleet-wide interrupts (a worker's subject) hears
    `LifecycleError` each time, logs one line for the subject however often it is
    refused (before, one per refusal), and goes on publishing inputs."""
    worker = Worker(locked.url, "locked", "--nats-user", "worker", env=WORKER_ENV)
    try:
        with caplog.at_level(logging.WARNING, logger="turnrouter"):
            front = await NatsFrontEnd.connect(frontend_config(locked.url))
            try:
                for _ in range(5):
                    with pytest.raises(LifecycleError, match="permissions"):
                        await front.publish(Interrupted())
                assert await answered_by_fleet(front, "ann", "hello") == "hello|-|N"
            finally:
                await front.close()
        refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(refused) == 1, refused
        assert refused[0].startswith("turnrouter: NATS refused publish to "
                                     "'turnrouter.ctl.interrupt' (permissions violation "
                                     "for user 'frontend')"), refused
    finally:
        worker.close()


def _reloaded(server: NatsServer, permissions: Path, text: str) -> None:
    """Write the server's permissions file and reload it (SIGHUP); returns once the
    server says it loaded its configuration again (`/varz` `config_load_time`)."""

    def loaded() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.monitor}/varz",
                                    timeout=5) as reply:
            return str(json.load(reply)["config_load_time"])

    before = loaded()
    permissions.write_text(text)
    server.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 15
    while loaded() == before:  # bounded poll of the server's own monitoring
        assert time.monotonic() < deadline, "nats-server did not reload"
        time.sleep(0.05)


async def test_an_answer_refused_by_a_permission_reload_is_said_once_allowed_again(
        tmp_path: Path) -> None:
    """A reload that takes the workers' output subject away for a while (an operator's
    mistake, put right): the answer whose publish the server dropped then is published
    again once the subject is allowed, and the participant's next turn follows it.
    Before, it stayed unheard for good while the participant's history held it
    (chaos12 D4)."""
    for name in ("nats-server.conf", "permissions.conf"):
        shutil.copy(DEPLOY / name, tmp_path / name)
    permissions = tmp_path / "permissions.conf"
    shipped = permissions.read_text()
    assert '"turnrouter.out.*", ' in shipped
    server = NatsServer(config=tmp_path / "nats-server.conf", env=PASSWORDS)
    worker = Worker(server.url, "reload", "--nats-user", "worker", env=WORKER_ENV)
    try:
        async with listening(frontend_config(server.url)) as (front, heard):
            assert await ask(front, heard, "ann", "hi") == "hi|-|N"
            await asyncio.to_thread(_reloaded, server, permissions,
                                    shipped.replace('"turnrouter.out.*", ', "", 1))
            query = UserQuery(participant_id="ann", text="refused")
            said = heard.events.setdefault(query.message_id, asyncio.Event())
            await front.publish(query)
            await until_true(lambda: "refused publish to 'turnrouter.out." in worker.stderr(),
                             "the worker's output refused")
            assert not said.is_set()
            await asyncio.to_thread(_reloaded, server, permissions, shipped)
            async with asyncio.timeout(30):
                await said.wait()
            assert [m.text for m in heard.finals[query.message_id]] == ["refused|hi|F"]
            assert await ask(front, heard, "ann", "next") == "next|refused|F"
    finally:
        worker.close()
        server.close()


async def test_a_one_account_deployment_moves_to_the_shipped_accounts(
        tmp_path: Path) -> None:
    """docs/distributed.md, "Trust": a deployment of the earlier one-account
    configuration restarts its server on the shipped one; streams and state stay in
    TURNROUTER, the next worker creates FRONT's mirror (with the outputs given before),
    and the front end, now in FRONT, carries on: the participant's history holds the turn
    answered before the move."""
    shutil.copy(DEPLOY / "permissions.conf", tmp_path / "permissions.conf")
    one = tmp_path / "one-account.conf"
    one.write_text(
        "include ./permissions.conf\n"
        "accounts { TURNROUTER { jetstream: enabled, users: [\n"
        "  {user: worker, password: $TURNROUTER_WORKER_PASSWORD,"
        " permissions: $WORKER_PERMISSIONS}\n"
        "  {user: frontend, password: $TURNROUTER_FRONTEND_PASSWORD,"
        " permissions: $FRONTEND_PERMISSIONS}\n"
        "] } }\n")
    server = NatsServer(config=one, env=PASSWORDS)
    try:
        worker = Worker(server.url, "before", "--nats-user", "worker", env=WORKER_ENV)
        try:
            front = await NatsFrontEnd.connect(frontend_config(server.url))
            try:
                assert await answered_by_fleet(front, "mo", "hello") == "hello|-|N"
            finally:
                await front.close()
        finally:
            worker.close()
        server.crash()
        server.command[server.command.index(str(one))] = str(DEPLOY / "nats-server.conf")
        server.restart()
        worker = Worker(server.url, "after", "--nats-user", "worker", env=WORKER_ENV)
        try:
            front = await NatsFrontEnd.connect(frontend_config(server.url))
            try:
                assert await answered_by_fleet(front, "mo", "next") == "next|hello|F"
                texts = []
                async with asyncio.timeout(15):
                    async for out in front.outputs(deliver_new=False):
                        texts.append(out.text)
                        if out.text == "next|hello|F":
                            break
                assert texts == ["hello|-|N", "next|hello|F"]
            finally:
                await front.close()
        finally:
            worker.close()
    finally:
        server.close()


async def test_unauthenticated_and_wrong_credentials_are_refused(
        locked: NatsServer, caplog: pytest.LogCaptureFixture) -> None:
    """No credentials, or a wrong password, cannot connect; neither the error nor any log
    line shows the password."""
    wrong = "wrong-secret-0451"
    with caplog.at_level(logging.DEBUG):
        for config in (NatsConfig(url=locked.url),
                       NatsConfig(url=locked.url, user="frontend", password=wrong),
                       NatsConfig(url=locked.url.replace("://", f"://frontend:{wrong}@"))):
            with pytest.raises(LifecycleError, match="cannot connect") as caught:
                await NatsFrontEnd.connect(config, max_reconnect_attempts=1)
            assert wrong not in str(caught.value) and wrong not in repr(config)
    assert wrong not in caplog.text and "Traceback" not in caplog.text


async def test_a_refused_first_connection_is_said_once_by_its_error(
        locked: NatsServer, caplog: pytest.LogCaptureFixture) -> None:
    """A front end refused at its first connection logs nothing of its own: the error
    raised says it, once (docs/distributed.md: `nats_front` exits with one line). It
    logged the refusal and then the server's reset of the connection, two more lines, one
    of them a misleading "Connection reset by peer" (newcomer12)."""
    with caplog.at_level(logging.WARNING, logger="turnrouter"):
        with pytest.raises(LifecycleError, match="Authorization Violation") as caught:
            await NatsFrontEnd.connect(NatsConfig(url=locked.url))
    assert caplog.records == []
    # It says where credentials go (newcomer16).
    assert "NatsConfig's user and password, creds_file" in str(caught.value)


# ---------------------------------------------------------------- nkeys and tokens
def nkey_user() -> tuple[str, str]:
    """A fresh user nkey: (seed, public key)."""
    import os

    import nkeys

    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    return seed.decode(), nkeys.from_seed(seed).public_key.decode()


async def test_nkey_users_with_the_shipped_permissions(tmp_path: Path) -> None:
    """Workers and front ends authenticated by nkey seed files (`--nats-nkey`,
    `NatsConfig(nkey_seed_file=...)`) under the shipped accounts and permissions (the
    shipped configuration with nkey users instead of passwords) work end to end."""
    (worker_seed, worker_key), (front_seed, front_key) = nkey_user(), nkey_user()
    shutil.copy(DEPLOY / "permissions.conf", tmp_path / "permissions.conf")
    conf = tmp_path / "nkeys.conf"
    shipped = (DEPLOY / "nats-server.conf").read_text()
    for user, key in (("worker", worker_key), ("frontend", front_key)):
        password = f"{{user: {user}, password: $TURNROUTER_{user.upper()}_PASSWORD,"
        assert password in shipped
        shipped = shipped.replace(password, f"{{nkey: {key},")
    conf.write_text(shipped)  # the ports: the server's flags replace them
    for name, seed in (("worker.nk", worker_seed), ("front.nk", front_seed)):
        (tmp_path / name).write_text(seed + "\n")
    server = NatsServer(config=conf)
    worker = None
    try:
        worker = Worker(server.url, "nkeyed", "--nats-nkey", str(tmp_path / "worker.nk"),
                        *FRONT_API)
        front = await NatsFrontEnd.connect(
            NatsConfig(url=server.url, nkey_seed_file=str(tmp_path / "front.nk")))
        try:
            assert await answered_by_fleet(front, "nia", "hi") == "hi|-|N"
        finally:
            await front.close()
    finally:
        if worker is not None:
            worker.close()
        server.close()


def test_an_nkey_seed_given_where_a_file_goes_is_refused_unshown() -> None:
    """A seed put in `--nats-nkey` / `TURNROUTER_NATS_NKEY` (or `nkey_seed_file`,
    `creds_file`) itself, as from a secret store: a clear error that never shows it."""
    seed, _ = nkey_user()
    with pytest.raises(ConfigurationError, match="holds an nkey seed") as caught:
        NatsConfig(nkey_seed_file=seed)
    assert seed not in str(caught.value)
    with pytest.raises(ConfigurationError, match="holds an nkey seed") as caught:
        NatsConfig(creds_file=seed)
    assert seed not in str(caught.value)
    for how in (["--nats-nkey", seed], []):
        run = subprocess.run(
            [sys.executable, "-m", "turnrouter", "worker", "--nats", "nats://127.0.0.1:1",
             "--app", "tests.nats.app:make_router", *how],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
            env={**os.environ, "TURNROUTER_NATS_NKEY": seed,
                 "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"})
        assert run.returncode == 2, run.stderr
        assert "holds an nkey seed" in run.stderr
        assert seed not in run.stdout + run.stderr


@given(before=st.text(max_size=40), after=st.text(max_size=40),
       field=st.sampled_from(["creds_file", "nkey_seed_file"]))
def test_a_seed_anywhere_in_a_file_field_is_never_shown(before: str, after: str,
                                                        field: str) -> None:
    """Whatever surrounds a seed pasted into a file field (junk, newlines, NUL), the
    configuration is refused and the error never quotes the seed."""
    seed = "SUAMLK2ZNL35WSMW37E7UD4VZ7ELPKW7DHC3BWBSD2GCZ7IUQQXZIORRBU"
    pasted = f"{before} {seed} {after}"
    make = (functools.partial(NatsConfig, creds_file=pasted) if field == "creds_file"
            else functools.partial(NatsConfig, nkey_seed_file=pasted))
    with pytest.raises(ConfigurationError) as caught:
        make()
    assert seed not in str(caught.value)


async def test_creds_files_in_operator_mode(tmp_path: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    """A server in operator mode (accounts and users as JWTs, as NGS or `nsc` deploy
    them): a worker (`--nats-creds`) and a front end (`NatsConfig(creds_file=...)`) with
    `.creds` files work end to end; a user signed by an account the operator does not
    know is refused in one error, and its seed is never shown; a user whose JWT allows
    publishing only its inputs is refused a control subject by the server."""
    operator = Operator(tmp_path)
    server = NatsServer(config=operator.config())
    worker = None
    try:
        worker_creds, worker_seed = operator.creds("worker")
        front_creds, _ = operator.creds("frontend")
        worker = Worker(server.url, "creds", "--nats-creds", str(worker_creds))
        front = await NatsFrontEnd.connect(NatsConfig(url=server.url,
                                                      creds_file=str(front_creds)))
        try:
            assert (await answered_by_fleet(front, "cora", "hi")).startswith("hi|")
        finally:
            await front.close()
        assert worker_seed not in worker.stderr()
        forged, forged_seed = operator.creds("forged", signer=Operator.stranger())
        with caplog.at_level(logging.DEBUG), pytest.raises(LifecycleError) as caught:
            await NatsFrontEnd.connect(NatsConfig(url=server.url, creds_file=str(forged)),
                                       max_reconnect_attempts=1)
        assert forged_seed not in str(caught.value) + caplog.text
        limited, _ = operator.creds("limited", publish=["turnrouter.in.>", "_INBOX.>",
                                                         "$JS.API.>"])
        refused: list[Exception] = []
        done = asyncio.Event()

        async def on_error(exc: Exception) -> None:
            refused.append(exc)
            done.set()

        nc = await nats.connect(server.url, user_credentials=str(limited),
                                allow_reconnect=False, error_cb=on_error)
        try:
            await nc.publish("turnrouter.ctl.interrupt", b"{}")
            await nc.flush()
            async with asyncio.timeout(10):
                await done.wait()
            assert "permissions violation" in str(refused[0]).lower()
        finally:
            await nc.close()
    finally:
        if worker is not None:
            worker.close()
        server.close()


async def test_token_authentication(caplog: pytest.LogCaptureFixture) -> None:
    """`NatsConfig(token=...)` connects to a server requiring that token; a wrong token is
    refused without showing it."""
    server = NatsServer(args=["--auth", "right-token-2112"])
    try:
        front = await NatsFrontEnd.connect(NatsConfig(url=server.url,
                                                      token="right-token-2112"))
        await front.close()
        with caplog.at_level(logging.DEBUG), pytest.raises(LifecycleError) as caught:
            await NatsFrontEnd.connect(NatsConfig(url=server.url, token="bad-token-1984"),
                                       max_reconnect_attempts=1)
        assert "bad-token-1984" not in str(caught.value) + caplog.text
    finally:
        server.close()


async def test_a_worker_authenticates_with_a_token_from_its_environment() -> None:
    """`turnrouter worker` with `TURNROUTER_NATS_TOKEN` serves a server requiring that
    token, end to end; with a wrong one it exits in one line that does not show it."""
    server = NatsServer(args=["--auth", "right-token-2112"])
    worker = None
    try:
        worker = Worker(server.url, "tok", env={"TURNROUTER_NATS_TOKEN": "right-token-2112"})
        front = await NatsFrontEnd.connect(NatsConfig(url=server.url,
                                                      token="right-token-2112"))
        try:
            assert (await answered_by_fleet(front, "toby", "hi")).startswith("hi|")
        finally:
            await front.close()
        refused = await asyncio.to_thread(
            subprocess.run,
            [*_worker_command(), "--nats", server.url, "--app",
             "tests.nats.app:make_router", "--reconnect-for", "2"],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
            env={**_env(), "TURNROUTER_NATS_TOKEN": "bad-token-1984"})
        assert refused.returncode == 1, refused.stderr
        assert "bad-token-1984" not in refused.stderr + refused.stdout
        assert "Traceback" not in refused.stderr
        assert "authorization" in refused.stderr.strip().splitlines()[-1].lower()
    finally:
        if worker is not None:
            worker.close()
        server.close()


async def test_a_percent_encoded_url_password_is_sent_decoded(
        caplog: pytest.LogCaptureFixture) -> None:
    """A password holding `/`, `?`, `#` or `@` goes percent-encoded in a URL, as the docs
    say (`p%2Fw` for `p/w`): the front end and the worker send it decoded, a token too,
    and never show it. nats-py sent the escapes as written, and the server refused it
    (redteam7 D3)."""
    env = {"TURNROUTER_WORKER_PASSWORD": "w/or?ker#9", "TURNROUTER_FRONTEND_PASSWORD": "fr@nt/1"}
    server = NatsServer(config=DEPLOY / "nats-server.conf", env=env)
    host = server.url.partition("//")[2]
    worker = Worker(f"nats://worker:w%2For%3Fker%239@{host}", "encoded", *FRONT_API)
    try:
        front = await NatsFrontEnd.connect(NatsConfig(url=f"nats://frontend:fr%40nt%2F1@{host}"))
        try:
            assert (await answered_by_fleet(front, "pat", "hi")).startswith("hi|")
        finally:
            await front.close()
        # Without a scheme, and a list writing them in either hex case (review8 D4).
        for url in (f"frontend:fr%40nt%2f1@{host}",
                    f"nats://frontend:fr%40nt%2F1@{host},nats://frontend:fr%40nt%2f1@{host}"):
            await (await NatsFrontEnd.connect(NatsConfig(url=url))).close()
        with caplog.at_level(logging.DEBUG), pytest.raises(LifecycleError) as caught:
            await NatsFrontEnd.connect(NatsConfig(url=f"nats://frontend:fr%40nt%2F2@{host}"),
                                       max_reconnect_attempts=1)
        assert "fr@nt" not in str(caught.value) + caplog.text
        assert "fr%40nt" not in str(caught.value) + caplog.text
    finally:
        worker.close()
        server.close()
    token = NatsServer(args=["--auth", "to/ken@2112"])
    try:
        front = await NatsFrontEnd.connect(NatsConfig(url=f"nats://to%2Fken%402112@"
                                                          f"{token.url.partition('//')[2]}"))
        await front.close()
    finally:
        token.close()


# ---------------------------------------------------------------- TLS
def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certificates() -> Iterator[Path]:
    """A throwaway CA and a server certificate for 127.0.0.1 (openssl)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    folder = Path(tempfile.mkdtemp(prefix="tr-tls-"))
    try:
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                "-subj", "/CN=turnrouter test CA", "-keyout", str(folder / "ca-key.pem"),
                "-out", str(folder / "ca.pem"))
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
                "-keyout", str(folder / "server-key.pem"), "-out", str(folder / "server.csr"))
        (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        openssl("x509", "-req", "-in", str(folder / "server.csr"), "-CA",
                str(folder / "ca.pem"), "-CAkey", str(folder / "ca-key.pem"),
                "-CAcreateserial", "-days", "2", "-extfile", str(folder / "san.ext"),
                "-out", str(folder / "server.pem"))
        # A client certificate for mutual TLS (the server verifying its clients).
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=turnrouter client",
                "-keyout", str(folder / "client-key.pem"), "-out", str(folder / "client.csr"))
        openssl("x509", "-req", "-in", str(folder / "client.csr"), "-CA",
                str(folder / "ca.pem"), "-CAkey", str(folder / "ca-key.pem"),
                "-CAcreateserial", "-days", "2", "-out", str(folder / "client.pem"))
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


async def test_end_to_end_over_tls(certificates: Path) -> None:
    """The shipped configuration over TLS: a worker (`--tls-ca`) and a front end
    (`tls_ca_file`) verify the server's certificate and work end to end; a client
    without the CA is refused."""
    server = NatsServer(config=DEPLOY / "nats-server.conf", env=PASSWORDS, scheme="tls",
                        args=["--tls", "--tlscert", str(certificates / "server.pem"),
                              "--tlskey", str(certificates / "server-key.pem")])
    worker = None
    try:
        worker = Worker(server.url, "tls", "--nats-user", "worker", "--tls-ca",
                        str(certificates / "ca.pem"), env=WORKER_ENV)
        front = await NatsFrontEnd.connect(
            frontend_config(server.url, tls_ca_file=str(certificates / "ca.pem")))
        try:
            assert await answered_by_fleet(front, "tia", "secure") == "secure|-|N"
        finally:
            await front.close()
        with pytest.raises(LifecycleError, match="cannot connect"):
            await NatsFrontEnd.connect(frontend_config(server.url),
                                       max_reconnect_attempts=1)
    finally:
        if worker is not None:
            worker.close()
        server.close()


async def test_end_to_end_over_mutual_tls(certificates: Path) -> None:
    """A server verifying its clients' certificates (`--tlsverify`): a worker
    (`--tls-ca --tls-cert --tls-key`) and a front end (`tls_cert_file`, `tls_key_file`)
    work end to end; a front end without a client certificate is refused."""
    ca = str(certificates / "ca.pem")
    cert, key = str(certificates / "client.pem"), str(certificates / "client-key.pem")
    server = NatsServer(config=DEPLOY / "nats-server.conf", env=PASSWORDS, scheme="tls",
                        args=["--tlsverify", "--tlscert", str(certificates / "server.pem"),
                              "--tlskey", str(certificates / "server-key.pem"),
                              "--tlscacert", ca])
    worker = None
    try:
        worker = Worker(server.url, "mtls", "--nats-user", "worker", "--tls-ca", ca,
                        "--tls-cert", cert, "--tls-key", key, *FRONT_API, env=WORKER_ENV)
        config = NatsConfig(url=server.url, user="frontend", tls_ca_file=ca,
                            tls_cert_file=cert, tls_key_file=key,
                            password=PASSWORDS["TURNROUTER_FRONTEND_PASSWORD"])
        front = await NatsFrontEnd.connect(config)
        try:
            assert await answered_by_fleet(front, "mia", "mutual") == "mutual|-|N"
        finally:
            await front.close()
        with pytest.raises(LifecycleError, match="cannot connect"):
            await NatsFrontEnd.connect(frontend_config(server.url, tls_ca_file=ca),
                                       max_reconnect_attempts=1)
    finally:
        if worker is not None:
            worker.close()
        server.close()


async def test_tls_configured_refuses_a_server_without_tls(certificates: Path) -> None:
    """A `tls://` URL with a CA, in front of a server (or a man in the middle) offering
    no TLS: the front end and the worker refuse it in one clear error, and no password
    crosses the wire in clear (nats-py alone would have sent CONNECT in plaintext)."""
    server = NatsServer(config=DEPLOY / "nats-server.conf", env=PASSWORDS)
    ca = str(certificates / "ca.pem")
    try:
        async with proxied(server.port) as tap:
            url = tap.url.replace("nats://", "tls://")
            with pytest.raises(LifecycleError, match="offers no TLS"):
                await NatsFrontEnd.connect(frontend_config(url, tls_ca_file=ca),
                                           max_reconnect_attempts=1)
            # A CA alone asks for TLS too, whatever the URL's scheme.
            with pytest.raises(LifecycleError, match="offers no TLS"):
                await NatsFrontEnd.connect(frontend_config(tap.url, tls_ca_file=ca),
                                           max_reconnect_attempts=1)
            worker = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", "turnrouter", "worker", "--nats", url, "--app",
                 "tests.nats.app:make_router", "--nats-user", "worker", "--tls-ca", ca,
                 "--reconnect-for", "2"],
                capture_output=True, text=True, timeout=60, cwd=ROOT,
                env={**os.environ, **WORKER_ENV,
                     "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"})
            assert worker.returncode == 1, worker.stderr
            last = worker.stderr.strip().splitlines()[-1]
            assert "offers no TLS" in last and "Traceback" not in worker.stderr
            assert tap.accepted >= 3  # each client did reach the plaintext server
            for secret in PASSWORDS.values():
                assert secret.encode() not in tap.uplink
            assert b"CONNECT" not in tap.uplink
    finally:
        server.close()


async def test_unreadable_tls_and_key_files_are_named_not_shown(tmp_path: Path) -> None:
    """A missing or malformed TLS or nkey file is a LifecycleError naming the file;
    nothing of the file's content is shown."""
    junk = tmp_path / "junk.pem"
    junk.write_text("not-a-cert secret-in-file-6502\n")
    for config in (NatsConfig(tls_ca_file=str(tmp_path / "missing.pem")),
                   NatsConfig(tls_ca_file=str(junk)),
                   NatsConfig(nkey_seed_file=str(tmp_path / "missing.nk"))):
        with pytest.raises(LifecycleError) as caught:
            await NatsFrontEnd.connect(config)
        assert "secret-in-file-6502" not in str(caught.value)


@pytest.mark.parametrize("field", ["creds_file", "nkey_seed_file", "tls_ca_file",
                                   "tls_cert_file"])
async def test_a_credentials_file_that_is_not_a_bounded_regular_file_is_refused(
        tmp_path: Path, field: str) -> None:
    """A named pipe, a device, a directory or a huge file as a credentials or TLS file is
    refused at once, naming the file, before anything opens or reads it: a pipe nobody
    writes blocked the worker's start for ever (SIGTERM too), `/dev/zero` as the nkey
    file was read until 18 GB (redteam14)."""
    pipe = tmp_path / "secrets.pipe"
    os.mkfifo(pipe)
    huge = tmp_path / "huge.pem"
    with huge.open("wb") as file:
        file.truncate(MAX_CA_FILE_BYTES + 1)  # sparse: no disk written
    for path, why in ((pipe, "not a regular file"), (Path("/dev/zero"), "not a regular file"),
                      (tmp_path, "not a regular file"), (huge, "bytes, over the")):
        extra = {"tls_key_file": str(path)} if field == "tls_cert_file" else {}
        config = NatsConfig(**{field: str(path), **extra})  # type: ignore[arg-type]
        with pytest.raises(LifecycleError) as caught:
            await asyncio.wait_for(NatsFrontEnd.connect(config, max_reconnect_attempts=0),
                                   10)
        assert str(path) in str(caught.value) and why in str(caught.value)


# ---------------------------------------------------------------- secrets stay hidden
SECRET = st.text(st.characters(codec="ascii", categories=["L", "N"]), min_size=6,
                 max_size=40)


@given(SECRET, SECRET)
def test_repr_never_shows_a_secret(password: str, token: str) -> None:
    """repr() of a configuration with a password (field or URL) or a token shows neither."""
    for config in (NatsConfig(user="svc", password=password),
                   NatsConfig(token=token),
                   NatsConfig(url=f"nats://svc:{password}@host:4222"),
                   NatsConfig(url=f"nats://{token}@host:4222"),
                   NatsConfig(url=f"nats://svc:{password}@h:4222,nats://svc:{password}@host"),
                   NatsConfig(url=f"nats://{token}@h:4222,nats://{token}@host")):
        shown = repr(config) + str(config) + config.safe_url
        # What repr shows anyway: the URL's parts and the field names ("timeou" is in
        # "drain_timeout").
        public = " ".join(["NatsConfig nats svc host 4222",
                           *(item.name for item in dataclasses.fields(NatsConfig))])
        assert password not in shown or password in public
        assert token not in shown or token in public


@pytest.mark.parametrize(("fields", "message"), [
    ({"user": "svc"}, "go together"), ({"password": "pw"}, "go together"),
    ({"user": "svc", "password": "pw", "token": "t"}, "one way"),
    ({"token": "t", "creds_file": "x.creds"}, "one way"),
    ({"url": "nats://svc:pw@host:4222", "token": "t"}, "credentials in the URL"),
    ({"url": "nats://svc:pw@host:4222", "creds_file": "x.creds"}, "credentials in the URL"),
    ({"url": "nats://a:4222,nats://tok@b:4222", "user": "u", "password": "p"},
     "credentials in the URL"),
    ({"tls_cert_file": "c.pem"}, "go together"),
    ({"password": "a\nb", "user": "u"}, "password"), ({"token": ""}, "token"),
    ({"url": ""}, "url"), ({"url": "nats://a b"}, "url"),
    ({"url": "nats://a:4222,"}, "empty server"), ({"url": ",nats://a:4222"}, "empty server"),
])
def test_contradictory_security_settings_name_the_field(fields: dict[str, str],
                                                        message: str) -> None:
    """Impossible credential settings are a ConfigurationError that never shows the
    value."""
    with pytest.raises(ConfigurationError, match=message) as caught:
        NatsConfig(**fields)  # type: ignore[arg-type]
    assert "a\nb" not in str(caught.value)


async def test_worker_cli_never_prints_the_password() -> None:
    """`--nats nats://svc:pw@...` against nothing: one short error, password masked, no
    traceback (nats-py's per-attempt tracebacks are one line each, masked too; attempts
    go on for `--reconnect-for`)."""
    done = await asyncio.to_thread(
        subprocess.run,
        [*_worker_command(), "--nats", "nats://svc:hunter2-0042@127.0.0.1:1",
         "--app", "tests.nats.app:make_router", "--reconnect-for", "1"],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=_env())
    assert done.returncode == 1
    assert "hunter2-0042" not in done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "svc:***@" in done.stderr
    assert len(done.stderr.splitlines()) <= 10


async def test_a_worker_without_credentials_is_told_where_they_go(
        locked: NatsServer) -> None:
    """`turnrouter worker` on a server that wants credentials, given none: exit 1, one
    error line naming the refusal and the flags and variables credentials go in
    (newcomer16: a bare "Authorization Violation")."""
    done = await asyncio.to_thread(
        subprocess.run,
        [*_worker_command(), "--nats", locked.url, "--app", "tests.nats.app:make_router",
         "--reconnect-for", "5"],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=_env())
    assert done.returncode == 1
    (line,) = [line for line in done.stderr.splitlines() if "cannot connect" in line]
    assert "Authorization Violation" in line and "--nats-user" in line
    assert "TURNROUTER_NATS_PASSWORD" in line and "Traceback" not in done.stderr


async def test_a_url_list_fails_over_to_the_server_that_answers(
        nats_server: NatsServer) -> None:
    """`url` may list a cluster's servers, comma-separated: with the first one down, a
    worker and a front end connect to the next, and a turn is answered; the password of
    each server is masked wherever the URL is shown."""
    # (The servers of a list carry the same credentials: this one accepts any.)
    dead = f"nats://svc:hunter3-0043@127.0.0.1:{free_port()}"
    url = f"{dead},nats://svc:hunter3-0043@{nats_server.url.partition('//')[2]}"
    assert "hunter3-0043" not in NatsConfig(url=url).safe_url
    worker = Worker(url, "listed")
    try:
        async with listening(url) as (front, heard):
            assert (await ask(front, heard, "listed", "hi")).startswith("hi|")
    finally:
        worker.close()
    assert "hunter3-0043" not in worker.stderr()


def _worker_command() -> list[str]:
    import sys

    return [sys.executable, "-m", "turnrouter", "worker"]


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}


# ---------------------------------------------------------------- user text stays out
class Failing:
    """A destination whose error quotes the user's text."""

    async def admit(self, turn: object, *, focused: bool) -> object:
        from turnrouter import Admission

        return Admission("accept")

    def routing_aid(self, participant_id: str) -> object:
        from turnrouter import RoutingAid

        return RoutingAid("boom", "fails")

    async def answer(self, turn: object, *, started: object) -> object:
        query = getattr(turn, "query", "")
        raise ValueError(f"cannot handle {query!r}")

    async def release(self, participant_id: str) -> None:
        return None


@pytest.fixture
async def failing_worker(nats_server: NatsServer) -> AsyncIterator[NatsWorker]:
    from turnrouter import AgentRouter

    from .app import Always

    def factory(ctx: object) -> AgentRouter:
        return AgentRouter({"echo": Failing()}, Always(),  # type: ignore[dict-item]
                           default_destination="echo")

    async with running(NatsWorker(factory, NatsConfig(url=nats_server.url),
                                  registry=CollectorRegistry(), replica="failing")) as worker:
        yield worker


async def test_destination_errors_quoting_user_text_stay_out_of_the_logs(
        nats_server: NatsServer, failing_worker: NatsWorker,
        caplog: pytest.LogCaptureFixture) -> None:
    """A destination error that quotes the query: the participant hears the failure
    text; no log record at INFO or above carries the query (only DEBUG, which an
    operator enables on purpose)."""
    front = await NatsFrontEnd.connect(NatsConfig(url=nats_server.url))
    secret_text = "my card is 4111-1111"
    try:
        with caplog.at_level(logging.INFO):
            text = await answered_by_fleet(front, "pat", secret_text)
        assert text == NatsConfig().failure_text
        shown = [r for r in caplog.records if r.levelno >= logging.INFO]
        assert all(secret_text not in r.getMessage() and (
            r.exc_info is None or secret_text not in str(r.exc_info[1])) for r in shown)
    finally:
        await front.close()



async def test_trace_headers_are_bounded_and_never_echoed(
        nats_server: NatsServer, failing_worker: NatsWorker) -> None:
    """A publisher's headers beyond a well-formed W3C context (a malformed traceparent,
    a huge tracestate, any other header) are not echoed into the turn's output. (Sent
    as a hostile publisher would, past `NatsFrontEnd.publish`, which refuses headers
    over 2 KiB itself.)"""
    config = NatsConfig(url=nats_server.url)
    front = await NatsFrontEnd.connect(config)
    huge = "k=" + "v" * 5000
    parent = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    seen: list[tuple[str | None, str | None]] = []
    ready = asyncio.Event()

    async def read(goal: int) -> None:
        async for out in front.outputs(subscribed=ready):
            if out.final:  # the failure text ending the turn
                seen.append((out.traceparent, out.tracestate))
                if len(seen) == goal:
                    return

    reader = asyncio.create_task(read(2))
    try:
        async with asyncio.timeout(15):
            await ready.wait()
            for headers in ({"traceparent": "junk-" + "z" * 300, "tracestate": huge,
                             "X-Internal": "do-not-echo"},
                            {"traceparent": parent, "tracestate": huge}):
                query = UserQuery(participant_id="hal", text="x")
                await front.connection.jetstream().publish(
                    config.input_subject("hal", "query"), query.model_dump_json().encode(),
                    headers={**headers,
                             "Nats-Msg-Id": f"{encode_token('hal')}.{query.message_id}"})
            await reader
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        await front.close()
    for traceparent, tracestate in seen:
        assert traceparent is None or len(traceparent) == 55
        assert tracestate is None or len(tracestate) <= 512
    assert "z" * 300 not in repr(seen) and "do-not-echo" not in repr(seen)


async def test_a_refused_fleet_wide_interrupt_is_raised(locked: NatsServer) -> None:
    """A fleet-wide interrupt (`Interrupted` without a participant) from a front end of
    the shipped configuration, whose permissions keep control messages to workers, is
    refused by the server: `publish` raises `LifecycleError` saying so (before, it
    returned normally and only nats-py's error callback heard of it). A participant's
    interrupt, which goes to the input stream, is still accepted on the same
    connection."""
    worker = Worker(locked.url, "locked", "--nats-user", "worker", env=WORKER_ENV)
    front = await NatsFrontEnd.connect(frontend_config(locked.url))
    try:
        with pytest.raises(LifecycleError, match=r"refused 'turnrouter\.ctl\.interrupt'"):
            await front.publish(Interrupted())
        await front.publish(Interrupted(participant_id="ann"))
        # The other kinds a front end publishes (the permissions list each kind).
        await front.publish(ParticipantJoined(participant_id="ann"))
        await front.publish(ParticipantLeft(participant_id="ann"))
        with pytest.raises(LifecycleError, match="permissions"):
            await front.publish(Interrupted())
    finally:
        await front.close()
        worker.close()


async def test_a_permitted_fleet_wide_interrupt_is_published(
        nats_server: NatsServer) -> None:
    """Where the connection may publish control messages (no permissions configured),
    a fleet-wide interrupt reaches a subscriber of the control subject, and `publish`
    returns normally."""
    config = NatsConfig(url=nats_server.url)
    nc = await nats.connect(nats_server.url)
    got: asyncio.Queue[Msg] = asyncio.Queue()
    await nc.subscribe(config.interrupt_all_subject, cb=got.put)
    await settled(nc)
    front = await NatsFrontEnd.connect(config)
    try:
        await front.publish(Interrupted())
        async with asyncio.timeout(10):
            msg = await got.get()
        assert Interrupted.model_validate_json(msg.data).participant_id is None
    finally:
        await front.close()
        await nc.close()


# ---------------------------------------------------------------- the front ends' mirror
class _Finals:
    """The final outputs a front end's `outputs()` read: (turn id, when), in order."""

    def __init__(self) -> None:
        self.reads: list[tuple[str, float]] = []
        self._got = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None

    async def start(self, front: NatsFrontEnd) -> None:
        """Read `front`'s outputs from now on (`close` stops)."""
        ready = asyncio.Event()
        loop = asyncio.get_running_loop()

        async def read() -> None:
            async for out in front.outputs(subscribed=ready):
                if out.final:
                    self.reads.append((out.request_id, loop.time()))
                    self._got.set()

        self._reader = asyncio.create_task(read())
        async with asyncio.timeout(15):
            await ready.wait()

    async def answered(self, ids: list[str], within: float) -> None:
        """Until the finals of `ids` were read (at most `within` seconds)."""
        async with asyncio.timeout(within):
            while not set(ids) <= {turn for turn, _ in self.reads}:
                await self.next_read(within)

    async def ask(self, front: NatsFrontEnd, queries: list[UserQuery]) -> None:
        """Publish `queries` and wait until their finals were read (at most 30 s)."""
        for query in queries:
            await front.publish(query)
        await self.answered([q.message_id for q in queries], 30)

    async def next_read(self, within: float) -> None:
        """Until the next read, or `within` seconds."""
        self._got.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within):
                await self._got.wait()

    async def close(self) -> None:
        if self._reader is not None:
            await cancelled(self._reader)


async def _mirror_info(nc: Client) -> dict[str, Any]:
    """STREAM.INFO of FRONT's mirror, asked as a worker (its error when there is none)."""
    reply = await nc.request("$JS.FRONT.API.STREAM.INFO.TURNROUTER_OUT", b"", timeout=5)
    info: dict[str, Any] = json.loads(reply.data)
    return info


async def _mirror_until(nc: Client, holds: Callable[[dict[str, Any]], bool], what: str,
                        within: float) -> dict[str, Any]:
    """FRONT's mirror's STREAM.INFO once `holds` says so: the server's state, asked
    every 0.1 s for at most `within` seconds."""
    deadline = time.monotonic() + within
    while not holds(info := await _mirror_info(nc)):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {within:g} s: {str(info)[:300]}")
        await asyncio.sleep(0.1)
    return info


async def test_a_deleted_output_stream_reaches_the_front_ends_again(
        locked: NatsServer) -> None:
    """The output stream deleted (here by a worker's user, which may) and recreated by
    the workers repairing the deployment starts its sequences over, while FRONT's
    mirror asks for the sequence after its last one: the server let the mirror stall
    (it notices the lost source after 10 s, "stream not found" adds 10 s more) and then
    skip the new stream's outputs up to that sequence, so front ends never read them.
    The workers now restart the mirror (delete, create) once it is out of step with the
    output stream: every turn asked after the deletion is read by the front end's
    `outputs()` (never, before), and what the front end read is what the two streams held,
    each turn's final once: the old stream's before the deletion, the new stream's after
    it, less the endings the workers published again into it (not knowing whether the
    server kept them) that the front end had read already (read twice, before)."""
    workers = [Worker(locked.url, f"mirror{k}", "--nats-user", "worker", env=WORKER_ENV)
               for k in range(2)]
    front = await NatsFrontEnd.connect(frontend_config(locked.url))
    nc = await nats.connect(locked.url, user="worker",
                            password=PASSWORDS["TURNROUTER_WORKER_PASSWORD"],
                            inbox_prefix="_INBOX_turnrouter_worker")
    finals = _Finals()
    reads, answered, loop = finals.reads, finals.answered, asyncio.get_running_loop()
    try:
        await finals.start(front)
        before = [UserQuery(participant_id=f"q{k}", text=f"before{k}") for k in range(8)]
        await finals.ask(front, before)
        created = (await _mirror_info(nc))["created"]
        deleted = loop.time()
        await nc.request("$JS.API.STREAM.DELETE.TURNROUTER_OUT", b"", timeout=5)
        after = [UserQuery(participant_id=f"q{k}", text=f"after{k}") for k in range(3)]
        for query in after:
            await front.publish(query)
        await answered([q.message_id for q in after], 30)
        restarted = await _mirror_info(nc)
        assert restarted["created"] != created  # restarted by a worker, with what the
        # stream stored after the mirror's last output (here all of the new stream's)
        assert "opt_start_time" in restarted["config"]["mirror"]
        assert sorted(turn for turn, t in reads if t < deleted) == sorted(
            q.message_id for q in before)  # each once
        # What the front end read since is what the new stream holds, in its order.
        # A worker publishes again into the new stream endings it cannot know the old
        # one kept (seen: a final read before the deletion, stored again after it): the
        # reader yields each turn's final once all the same, and counts the repeats.
        read_before = {turn for turn, t in reads if t < deleted}
        async with asyncio.timeout(15):
            while True:
                held = await _finals(nc)
                once = [turn for turn in dict.fromkeys(held) if turn not in read_before]
                if [turn for turn, t in reads if t > deleted] == once:
                    break
                await finals.next_read(0.5)  # the next read, or another look
        assert {q.message_id for q in after} <= set(held)
        assert front.outputs_repeated == len(held) - len(once)
    finally:
        await finals.close()
        await nc.close()
        await front.close()
        for worker in workers:
            worker.close()


async def _finals(nc: Client) -> list[str]:
    """The turn ids of the final outputs TURNROUTER_OUT holds, in stream order."""
    reply = await nc.request("$JS.API.STREAM.INFO.TURNROUTER_OUT", b"", timeout=5)
    state = json.loads(reply.data)["state"]
    turns = []
    for seq in range(state["first_seq"], state["last_seq"] + 1):
        reply = await nc.request("$JS.API.STREAM.MSG.GET.TURNROUTER_OUT",
                                 json.dumps({"seq": seq}).encode(), timeout=5)
        output = json.loads(base64.b64decode(json.loads(reply.data)["message"]["data"]))
        if output["final"]:
            turns.append(output["request_id"])
    return turns


async def test_a_mirror_stalled_on_stream_not_found_is_restarted_in_step(
        locked: NatsServer) -> None:
    """FRONT's mirror asked for the output stream while it was missing (as after a
    server restart that restored FRONT's streams first): the server records "stream
    not found" and asks again only 10 s later. With the stream back in step (here made
    again from the sequence after the mirror's last one, as a restored stream is), a
    worker restarts the mirror from the sequence after its last one (not waiting for
    the server's own retry), and the turns asked meanwhile are read by the front end's
    `outputs()`, each once, as were the ones before."""
    worker = Worker(locked.url, "stalled", "--nats-user", "worker", env=WORKER_ENV)
    front = await NatsFrontEnd.connect(frontend_config(locked.url))
    nc = await nats.connect(locked.url, user="worker",
                            password=PASSWORDS["TURNROUTER_WORKER_PASSWORD"],
                            inbox_prefix="_INBOX_turnrouter_worker")
    finals = _Finals()
    reads, answered = finals.reads, finals.answered
    try:
        await finals.start(front)
        before = [UserQuery(participant_id=f"q{k}", text=f"before{k}") for k in range(4)]
        await finals.ask(front, before)
        source = json.loads((await nc.request("$JS.API.STREAM.INFO.TURNROUTER_OUT", b"",
                                              timeout=5)).data)
        held = source["state"]["last_seq"]
        await _mirror_until(nc, lambda m: m["state"]["last_seq"] == held,
                            "the mirror holds what the output stream holds", 15)
        await nc.request("$JS.API.STREAM.DELETE.TURNROUTER_OUT", b"", timeout=5)
        # The mirror notices its source gone within 10 to 20 s and asks for it again.
        error = (await _mirror_until(nc, lambda m: bool(m["mirror"].get("error")),
                                     "the mirror's error", 40))["mirror"]["error"]
        assert error["err_code"] == 10059, error
        stream = {**source["config"], "first_seq": held + 1}
        reply = await nc.request("$JS.API.STREAM.CREATE.TURNROUTER_OUT",
                                 json.dumps(stream).encode(), timeout=5)
        assert "error" not in json.loads(reply.data), reply.data
        after = [UserQuery(participant_id=f"q{k}", text=f"after{k}") for k in range(2)]
        for query in after:
            await front.publish(query)
        await answered([q.message_id for q in after], 30)
        # Made again by a worker from the sequence after its last one (the server's
        # own retry, 10 s after its failed request at the earliest, makes no new one).
        mirror = await _mirror_info(nc)
        assert mirror["config"]["mirror"]["opt_start_seq"] == held + 1
        # One more turn: an output read twice would be read before its answer.
        last = UserQuery(participant_id="q0", text="last")
        await front.publish(last)
        await answered([last.message_id], 30)
        assert sorted(turn for turn, _ in reads) == sorted(
            q.message_id for q in [*before, *after, last])
        assert front.outputs_repeated == 0  # the mirror in step copied nothing twice
    finally:
        await finals.close()
        await nc.close()
        await front.close()
        worker.close()


async def test_a_missing_mirror_is_made_again(locked: NatsServer) -> None:
    """FRONT's mirror deleted and not made again (a worker's restart whose create
    failed, or a worker that died between the two): a worker makes it again, from the
    sequence after what the output stream holds (a reader reads a new mirror from its
    start: made from the stream's start, it would hear every output again), and the
    front end's `outputs()` reads the turns asked since. Before, nothing made it again
    until a worker restarted: front ends read nothing."""
    worker = Worker(locked.url, "remake", "--nats-user", "worker", env=WORKER_ENV)
    nc = await nats.connect(locked.url, user="worker",
                            password=PASSWORDS["TURNROUTER_WORKER_PASSWORD"],
                            inbox_prefix="_INBOX_turnrouter_worker")
    try:
        async with listening(frontend_config(locked.url)) as (front, heard):
            assert (await ask(front, heard, "ann", "first")).startswith("first|")
            await nc.request("$JS.FRONT.API.STREAM.DELETE.TURNROUTER_OUT", b"", timeout=5)
            reply = await _mirror_until(nc, lambda m: "error" not in m,
                                        "the mirror made again", 30)
            source = json.loads((await nc.request(
                "$JS.API.STREAM.INFO.TURNROUTER_OUT", b"", timeout=5)).data)
            assert reply["config"]["mirror"]["opt_start_seq"] == (
                source["state"]["last_seq"] + 1)
            assert (await ask(front, heard, "ann", "again")).startswith("again|")
    finally:
        await nc.close()
        worker.close()


@pytest.mark.parametrize("content", [
    b"", b"SECRET-NOT-A-CREDS-FILE\n",
    b"-----BEGIN NATS USER JWT-----\nSECRET.PART.ONLY\n------END NATS USER JWT------\n",
])
async def test_a_front_end_refuses_a_creds_file_without_a_jwt_and_a_seed(
        nats_server: NatsServer, tmp_path: Path, content: bytes) -> None:
    """`NatsConfig(creds_file=)` of a front end holding no user JWT and nkey seed (as
    nats-py reads them) is refused before anything is sent, naming the file and never
    its content: before, a server without authentication took the connection as if the
    file were fine, and one with authentication answered an Authorization Violation
    naming nothing (redteam21 F8, the front end's side)."""
    creds = tmp_path / "front.creds"
    creds.write_bytes(content)
    with pytest.raises(LifecycleError) as caught:
        await NatsFrontEnd.connect(NatsConfig(url=nats_server.url, creds_file=str(creds)))
    message = str(caught.value)
    assert str(creds) in message and "SECRET" not in message, message
