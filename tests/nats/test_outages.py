"""A worker's patience with its server: frozen, not there yet at start-up, without
JetStream, and a deployment an operator deleted parts of (docs/distributed.md)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from nats.js import JetStreamContext
from prometheus_client import CollectorRegistry, generate_latest

import nats
from turnrouter import AgentRouter, ContextPatch, LifecycleError, PatchNotSavedError
from turnrouter.runtime import ParticipantLeft, UserQuery
from turnrouter.runtime.nats import (
    NatsConfig,
    NatsFrontEnd,
    NatsWorker,
    Readiness,
    WorkerContext,
    encode_token,
)

from .app import PREAMBLE, make_router
from .conftest import (
    ROOT,
    NatsServer,
    Worker,
    metric_value,
    nats_server_binary,
    until_counted,
    until_true,
)
from .crowd import FAILURE, Heard, ask, listening, running, serving
from .proxy import NatsProxy, proxied

pytestmark = pytest.mark.anyio

CONFIG = NatsConfig()


def start_worker(url: str, *extra: str) -> subprocess.Popen[str]:
    """A `turnrouter worker` process whose start-up the test follows line by line."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    return subprocess.Popen(
        [sys.executable, "-u", "-m", "turnrouter", "worker", "--nats", url, "--app",
         "tests.nats.app:make_router", "--replica", "patient", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


async def line_with(stream: object, needle: str, within: float = 20.0) -> str:
    """The first line of `stream` holding `needle` (bounded; '' at the end of it)."""
    async with asyncio.timeout(within):
        while True:
            line: str = await asyncio.to_thread(stream.readline)  # type: ignore[attr-defined]
            if not line or needle in line:
                return line


def without_jetstream(binary: str, port: int) -> subprocess.Popen[bytes]:
    """A nats-server on `port` without JetStream (no stream can be made on it)."""
    return subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=10)


async def file_state(path: Path, present: bool, within: float = 15.0) -> None:
    await until_true(lambda: path.exists() == present,
                     f"{path.name} {'written' if present else 'removed'}", within=within)


# ---------------------------------------------------------------- start-up


async def test_a_worker_started_before_its_server_waits_for_it() -> None:
    """No server yet, then one without JetStream, then the real one: the worker logs
    numbered connect attempts, then numbered set-up attempts, and serves once the server
    with JetStream is there (within `--reconnect-for`), instead of exiting."""
    server = NatsServer()
    server.crash()  # its port and store, no process: "the server is restarting"
    binary = nats_server_binary()
    assert binary is not None
    worker = start_worker(server.url, "--reconnect-for", "60")
    bare: subprocess.Popen[bytes] | None = None
    try:
        assert "connect attempt 1 failed" in await line_with(worker.stderr, "attempt")
        bare = without_jetstream(binary, server.port)
        line = await line_with(worker.stderr, "set-up attempt")
        assert "set-up attempt 1 failed" in line
        assert "is JetStream enabled on the server (nats-server -js" in line  # what to do
        bare.terminate()
        bare.wait(10)
        await asyncio.to_thread(server.restart)
        assert await line_with(worker.stdout, "worker patient ready", within=30)
        assert worker.poll() is None
    finally:
        if bare is not None and bare.poll() is None:
            bare.kill()
            bare.wait(10)
        stop(worker)
        server.close()


async def test_sigterm_while_waiting_for_the_server_ends_the_worker() -> None:
    """SIGTERM while the first connection is being retried ends the worker at once,
    exit 0, one line saying it stopped before it was ready."""
    server = NatsServer()
    server.crash()
    worker = start_worker(server.url, "--reconnect-for", "60")
    try:
        assert "connect attempt" in await line_with(worker.stderr, "attempt")
        worker.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(worker.wait, 15)
        assert code == 0
        assert worker.stderr is not None
        rest = worker.stderr.read().splitlines()
        assert rest[-1] == "turnrouter worker: stopped before it was ready"
        assert not any("Traceback" in line for line in rest)
    finally:
        stop(worker)
        server.close()


# ---------------------------------------------------------------- a frozen server


async def test_a_frozen_server_past_the_bound_ends_the_worker(
        nats_server: NatsServer) -> None:
    """A server stopped with SIGSTOP (its connections open, nothing answered) is
    noticed by the worker's pings: one line per reconnect attempt, then exit 1 saying
    why once `--reconnect-for` has passed."""
    worker = Worker(nats_server.url, "frozen", "--reconnect-for", "0.5")
    try:
        nats_server.freeze()
        code = await asyncio.to_thread(worker.proc.wait, 30)
        err = worker.stderr()
        assert code == 1, err
        attempts = [line for line in err.splitlines() if "reconnect attempt" in line]
        assert attempts and "attempt 1 failed" in attempts[0]
        assert "stayed unreachable" in err.splitlines()[-1]
        assert "Traceback" not in err
    finally:
        nats_server.thaw()
        worker.close()


def ready_reply(worker: Worker) -> tuple[int, str]:
    """The status and body of the worker's `/ready` on its metrics port."""
    url = worker.metrics_url.removesuffix("/metrics") + "/ready"
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return int(reply.status), reply.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


def ready_status(worker: Worker) -> int:
    """The status of the worker's `/ready` on its metrics port."""
    return ready_reply(worker)[0]


async def test_the_ready_file_is_there_only_while_the_worker_serves(
        nats_server: NatsServer, tmp_path: Path) -> None:
    """`--ready-file` goes away while the server is frozen and comes back when it
    resumes (within the bound, so the worker rides it out); `/ready` on the metrics port
    answers 503 meanwhile and 200 while it serves."""
    ready = tmp_path / "worker.ready"
    worker = Worker(nats_server.url, "probe", "--reconnect-for", "4",
                    "--ready-file", str(ready))
    try:
        await file_state(ready, True)
        assert ready_status(worker) == 200
        nats_server.freeze()
        await file_state(ready, False)
        # The 503 says why: an operator's `curl .../ready` tells what the worker waits for
        # (whichever noticed the frozen server first: its pings, or a deployment check).
        status, body = ready_reply(worker)
        assert status == 503 and body.endswith("\n") and body.count("\n") == 1, body
        assert set(body.strip().split("; ")) <= {
            "disconnected from NATS", "JetStream not answering"}, body
        nats_server.thaw()
        await file_state(ready, True)
        assert ready_status(worker) == 200
        assert worker.proc.poll() is None
    finally:
        nats_server.thaw()
        worker.close()


async def test_a_reset_connection_drops_readiness_and_says_so(
        nats_server: NatsServer, tmp_path: Path) -> None:
    """A connection reset (a crashed server, a dropped flow: nats-py reports the failed
    reconnect before the disconnection) still drops readiness and logs the line the
    runbook names, once; both come back with the connection."""
    ready = tmp_path / "worker.ready"
    async with proxied(nats_server.port) as proxy:
        # Started in a thread: the proxy runs on this loop.
        worker = await asyncio.to_thread(Worker, proxy.url, "reset", "--reconnect-for",
                                         "60", "--ready-file", str(ready))
        try:
            await file_state(ready, True)
            proxy.refusing = True
            assert proxy.reset() >= 1
            await file_state(ready, False)
            assert await asyncio.to_thread(ready_status, worker) == 503
            assert "turnrouter_nats_serving 0.0" in await asyncio.to_thread(worker.metrics)
            proxy.refusing = False
            await file_state(ready, True, within=30)
            assert await asyncio.to_thread(ready_status, worker) == 200
            worker.signal(signal.SIGTERM)
            await asyncio.to_thread(worker.proc.wait, 30)
            err = worker.stderr()
            assert err.count("lost the connection to NATS") == 1, err
            assert err.count("reconnected to NATS") == 1, err
            assert "Traceback" not in err
        finally:
            worker.close()


def told(lost: asyncio.Event, back: asyncio.Event) -> dict[str, Any]:
    """Connection options whose callbacks set `lost` at a disconnection and `back` at
    a reconnection."""
    async def disconnected() -> None:
        lost.set()

    async def reconnected() -> None:
        back.set()
    return {"disconnected_cb": disconnected, "reconnected_cb": reconnected}


async def test_a_front_end_leaves_a_frozen_server_and_a_retried_publish_runs_once(
        nats_server: NatsServer) -> None:
    """A front end notices a frozen server by its pings (disconnected, then reconnected
    once the server resumes); a publish the server did not confirm raises
    `LifecycleError`, and publishing the same message again is answered exactly once; a
    publish while the connection is known lost fails at once and never runs."""
    worker = Worker(nats_server.url, "steady", "--reconnect-for", "60")
    lost, back = asyncio.Event(), asyncio.Event()
    try:
        async with listening(nats_server.url, **told(lost, back)) as (front, heard):
            assert (await ask(front, heard, "fz", "hello")).startswith("hello|")
            query = UserQuery(participant_id="fz", text="during")
            nats_server.freeze()
            with pytest.raises(LifecycleError, match="publishing query failed"):
                async with asyncio.timeout(20):
                    await front.publish(query)
            async with asyncio.timeout(20):
                await lost.wait()
            # Known lost: refused at once, nothing held to be sent on reconnect (nats-py
            # sent such a publish when the server came back, long after it had failed).
            abandoned = UserQuery(participant_id="fz", text="abandoned")
            with pytest.raises(LifecycleError, match="not connected to NATS"):
                async with asyncio.timeout(3):  # (a publish waits 5 s for the server)
                    await front.publish(abandoned)
            nats_server.thaw()
            async with asyncio.timeout(20):
                await back.wait()
            event = heard.events.setdefault(query.message_id, asyncio.Event())
            await front.publish(query)  # the retry: same message, same Nats-Msg-Id
            async with asyncio.timeout(20):
                await event.wait()
            # The next turn's answer names its previous user text: the retried query's.
            assert await ask(front, heard, "fz", "next") == "next|during|F"
            assert [o.text for o in heard.finals[query.message_id]] == ["during|hello|F"]
            assert abandoned.message_id not in heard.finals
    finally:
        nats_server.thaw()
        worker.close()


async def test_a_publish_waiting_when_the_server_crashes_goes_again_on_its_return(
        nats_server: NatsServer) -> None:
    """A publish sent to a server that dies before confirming it (frozen, then kill -9:
    what it had not read is gone) is sent again as soon as the connection is back,
    instead of raising `LifecycleError` once its 5 s ran out (chaos20 O3): it returns
    normally, its turn is answered exactly once, and the caller's own callbacks still
    run. A caller's cancellation of a waiting publish is still a cancellation."""
    worker = Worker(nats_server.url, "steady", "--reconnect-for", "60")
    lost, back = asyncio.Event(), asyncio.Event()
    try:
        async with listening(nats_server.url, **told(lost, back)) as (front, heard):
            assert (await ask(front, heard, "cr", "hello")).startswith("hello|")
            nc = front.connection
            nats_server.freeze()
            query = UserQuery(participant_id="cr", text="during")
            event = heard.events.setdefault(query.message_id, asyncio.Event())
            sent = nc.stats["out_msgs"]
            publishing = asyncio.create_task(front.publish(query))
            cancelled_one = asyncio.create_task(front.publish(
                UserQuery(participant_id="cx", text="given up")))
            # Both written to the frozen server's socket, then it dies unread.
            await until_true(lambda: nc.stats["out_msgs"] >= sent + 2
                             and nc.pending_data_size == 0, "both publishes sent")
            cancelled_one.cancel()
            nats_server.crash()
            with pytest.raises(asyncio.CancelledError):
                await cancelled_one
            async with asyncio.timeout(20):
                await lost.wait()
            nats_server.restart()
            async with asyncio.timeout(20):
                await back.wait()
                await publishing  # returns normally: stored by the publish sent again
                await event.wait()
            assert [o.text for o in heard.finals[query.message_id]] == ["during|hello|F"]
            assert await ask(front, heard, "cr", "next") == "next|during|F"
    finally:
        nats_server.thaw()
        worker.close()


async def test_a_publish_stored_before_its_connection_was_lost_returns_after_the_resend(
        nats_server: NatsServer) -> None:
    """The first copy of a publish was stored but its confirmation was lost with the
    connection (here: the copy reaches the server by another path, then the front end's
    connection is reset): the copy sent again on the new connection is a duplicate of
    it, and `publish` returns normally, not as if another front end had taken the id.
    The turn runs once."""
    worker = Worker(nats_server.url, "steady")
    try:
        async with proxied(nats_server.port) as proxy, \
                listening(NatsConfig(url=proxy.url)) as (front, heard):
            assert (await ask(front, heard, "st", "hello")).startswith("hello|")
            query = UserQuery(participant_id="st", text="stored")
            event = heard.events.setdefault(query.message_id, asyncio.Event())
            hold = proxy.hold(lambda subject, payload: b'"stored"' in payload)
            publishing = asyncio.create_task(front.publish(query))
            async with asyncio.timeout(15):
                await hold.holding(1)
            nc = await nats.connect(nats_server.url)
            try:  # the first copy, stored
                await nc.jetstream().publish(
                    CONFIG.input_subject("st", "query"), query.model_dump_json().encode(),
                    headers={"Nats-Msg-Id": f"{encode_token('st')}.{query.message_id}"})
            finally:
                await nc.close()
            hold.drop(1)
            hold.release()
            assert proxy.reset() >= 1  # its confirmation lost with the connection
            async with asyncio.timeout(20):
                await publishing
                await event.wait()
            assert await ask(front, heard, "st", "next") == "next|stored|F"
            assert [o.text for o in heard.finals[query.message_id]] == ["stored|hello|F"]
            assert front.inputs_duplicated == 0
    finally:
        worker.close()


async def test_a_publish_whose_server_does_not_return_fails_within_its_bound(
        nats_server: NatsServer) -> None:
    """The server dies while a publish waits and stays away: `LifecycleError` once the
    publish's 5 s ran out, saying the connection was lost and to publish it again."""
    async with listening(nats_server.url) as (front, _):
        nc = front.connection
        nats_server.freeze()
        sent = nc.stats["out_msgs"]
        publishing = asyncio.create_task(
            front.publish(UserQuery(participant_id="gone", text="hello")))
        await until_true(lambda: nc.stats["out_msgs"] > sent and nc.pending_data_size == 0,
                         "the publish sent")
        nats_server.crash()
        with pytest.raises(LifecycleError, match=r"lost while it waited.*publish it again"):
            async with asyncio.timeout(20):
                await publishing


async def test_failed_state_writes_are_logged_rarely(nats_server: NatsServer) -> None:
    """An outage fails one state write per participant writing: the log shows the 1st
    and the 10th, each with the count so far, not one line per participant."""
    worker = Worker(nats_server.url, "quiet", "--reconnect-for", "60",
                    env={"TR_TEST_ANSWER_SECS": "3"})
    try:
        async with listening(nats_server.url) as (front, _):
            for i in range(12):  # answered at 3 s, each then writes its record
                await front.publish(UserQuery(participant_id=f"w{i}", text="hello"))
            await until_true(lambda: metric_value(
                worker.metrics(), "turnrouter_turns_in_flight") == 12, "12 turns running")
        # (The front end closed first: nats-py's reconnects to a frozen server replace
        # their socket without closing it, a ResourceWarning when it is collected.)
        nats_server.freeze()  # the 12 answers' writes get no reply
        try:
            # A write without a reply for 10 s drops its participant from this replica.
            await until_true(lambda: metric_value(
                worker.metrics(), "turnrouter_active_participants") == 0,
                "every participant dropped after its failed write", within=30)
        finally:
            nats_server.thaw()
        worker.signal(signal.SIGTERM)
        await asyncio.to_thread(worker.proc.wait, 30)
        logged = [line for line in worker.stderr().splitlines()
                  if "state write failed" in line]
        assert len(logged) == 2, logged
        assert "1 so far" in logged[0] and "10 so far" in logged[1]
    finally:
        nats_server.thaw()
        worker.close()


async def test_turns_answered_during_a_freeze_past_the_write_timeout_keep_their_answers(
        nats_server: NatsServer) -> None:
    """The server frozen for 6.5 s while 6 turns finish: their record writes get no reply
    in 5 s and are sent again; as the server resumes it stores the first try and refuses
    the second for that newer revision, which the worker reads back as its own. Each
    participant hears their answer (before: the failure text, every participant dropped
    after its write's first timeout) and keeps their history."""
    worker = Worker(nats_server.url, "icy", "--reconnect-for", "60",
                    env={"TR_TEST_ANSWER_SECS": "1"})
    try:
        async with listening(nats_server.url) as (front, heard):
            people = [f"icy{i}" for i in range(6)]
            queries = [UserQuery(participant_id=p, text="during") for p in people]
            for query in queries:
                await front.publish(query)
            await until_true(lambda: metric_value(
                worker.metrics(), "turnrouter_turns_in_flight") == 6, "6 turns running")
            nats_server.freeze()  # the answers' writes (at 1 s) get no reply for 5 s
            try:
                await asyncio.sleep(6.5)  # the freeze under test: past a write's 5 s
            finally:
                nats_server.thaw()
            async with asyncio.timeout(20):
                while len({q.message_id for q in queries} & heard.finals.keys()) < 6:
                    await heard.more(1)
            assert [[o.text for o in heard.finals[q.message_id]] for q in queries] == [
                ["during|-|N"]] * 6
            for p in people:
                assert await ask(front, heard, p, "after") == "after|during|F"
        worker.signal(signal.SIGTERM)
        await asyncio.to_thread(worker.proc.wait, 30)
        assert "state write failed" not in worker.stderr()
    finally:
        nats_server.thaw()
        worker.close()


async def test_the_next_turns_control_text_is_heard_after_the_answer_before_it(
        nats_server: NatsServer) -> None:
    """A turn that outlasted `mark_after` (its message acknowledged) gave its answer; the
    participant's next query cuts it, and its record write (which the answer waits for)
    gets no reply for a while: the next turn starts meanwhile, and its preamble is heard
    after that answer, not before it (chaos15: about 5 rounds in 100 heard the next
    turn's preamble or release text first, without any fault)."""
    async with proxied(nats_server.port) as proxy:
        # Started in a thread: the proxy runs on this loop.
        worker = await asyncio.to_thread(
            Worker, proxy.url, "order", "--reconnect-for", "60",
            env={"TR_TEST_ANSWER_SECS": "30", "TR_TEST_SAY_ANSWERED": "1"})
        try:
            async with listening(nats_server.url) as (front, heard):
                first = UserQuery(participant_id="late", text="lingering first")
                second = UserQuery(participant_id="late", text="slow second")
                await front.publish(first)
                await until_counted(worker, "turnrouter_nats_inflight_marks_total", 1)
                key = f".{encode_token('late')}"
                writes = proxy.hold(lambda subject, data: subject.startswith("$KV.")
                                    and subject.endswith(key)
                                    and b"lingering first|-|N" in data)  # its answer
                await front.publish(second)
                async with asyncio.timeout(15):
                    await writes.holding(1)  # the first turn's finished record
                await until_counted(worker, "turnrouter_admissions_total", 2)  # the second
                await asyncio.sleep(0.3)  # the write held 0.3 s more: the scenario
                writes.release()
                started = heard.events.setdefault(f"started {second.message_id}",
                                                  asyncio.Event())
                async with asyncio.timeout(20):
                    await started.wait()
                assert [(o.request_id, o.text) for o in heard.said["late"]] == [
                    (first.message_id, "lingering first|-|N"), (second.message_id, PREAMBLE)]
        finally:
            await asyncio.to_thread(worker.close)


async def pulls_waiting(nc: Any, config: NatsConfig) -> list[int]:
    """Pull requests of the worker waiting at the server, per partition."""
    counts = []
    for n in range(config.partitions):
        info = json.loads((await nc.request(
            f"$JS.API.CONSUMER.INFO.{config.stream}.{config.consumer(n)}", b"",
            timeout=5)).data)
        counts.append(int(info.get("num_waiting") or 0))
    return counts


@contextlib.asynccontextmanager
async def owning_two(url: str, registry: CollectorRegistry) -> AsyncIterator[NatsWorker]:
    """An in-process worker of a two-partition deployment, once it owns both; stopped
    gracefully (bounded) when the block ends."""
    worker = NatsWorker(make_router, NatsConfig(url=url, partitions=2), replica="solo",
                        registry=registry)
    run = asyncio.create_task(worker.run())
    try:
        async with asyncio.timeout(15):
            await worker.ready.wait()
        await until_true(lambda: worker.owned_partitions == {0, 1},
                         "the worker owns both partitions", within=15)
        yield worker
    finally:
        worker.request_stop()
        async with asyncio.timeout(30):
            await asyncio.gather(run, return_exceptions=True)


async def one_pull_each(nc: Any, config: NatsConfig, after: str) -> None:
    """Until each partition has one pull of the worker waiting, read 20 times in a row
    (over more than two `pull_expires`); AssertionError after ~15 s."""
    steady, counts = 0, [-1] * config.partitions
    for _ in range(300):  # bounded poll of the server's state: at most ~15 s
        counts = await pulls_waiting(nc, config)
        steady = steady + 1 if counts == [1] * config.partitions else 0
        if steady >= 20:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"pulls waiting per partition after {after}: {counts}")


async def test_after_a_servers_return_each_partition_has_one_pull_waiting(
        nats_server: NatsServer) -> None:
    """The server is away longer than a pull waits for its reply, so the worker asks
    again meanwhile (its pulls go out when the server is back): once back, each
    partition has one pull of the worker's waiting at the server, as before the outage.
    Before, every reply that ended one of those pulls (a 408 as it expired) was answered
    with a new one: two or more waited per partition for good, and the extra ones, made
    with a pin the server no longer had, were refused (423) after the partition was
    pinned afresh, which the worker took for the loss of the partition (a turn just
    started there ended with the failure text), or delivered a message after a balance
    handover, left unread until it came back to the next owner as delivery 2 (the
    failure text, unrun)."""
    async with owning_two(nats_server.url, CollectorRegistry()) as worker:
        nats_server.crash()
        await until_true(lambda: not worker.readiness.serving, "the worker saw the outage")
        await asyncio.sleep(3.0)  # the outage under test: past a pull's wait (2.4 s)
        nats_server.restart()
        await until_true(lambda: worker.readiness.serving, "the worker came back", within=15)
        nc = await nats.connect(nats_server.url)
        try:
            await one_pull_each(nc, worker.config, "the outage")
        finally:
            await nc.close()
        assert worker.owned_partitions == {0, 1}


async def test_a_short_freeze_of_the_server_leaves_one_pull_per_partition_and_the_turn(
        nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server frozen (SIGSTOP) for 3 s, longer than a pull waits for its reply
    (2.4 s) but about as long as the pings take to call the connection lost: the pulls
    the worker sent meanwhile reach the server together when it resumes. A turn
    answering during the freeze is still answered (its record written once the server
    resumes), each partition is back to one waiting pull, and the next turn runs."""
    monkeypatch.setenv("TR_TEST_ANSWER_SECS", "1")
    registry = CollectorRegistry()
    async with owning_two(nats_server.url, registry) as worker, \
            listening(nats_server.url) as (front, heard):
        query = UserQuery(participant_id="icy", text="during")
        answered = heard.events.setdefault(query.message_id, asyncio.Event())
        await front.publish(query)
        await until_true(lambda: metric_value(
            generate_latest(registry).decode(), "turnrouter_turns_in_flight") == 1,
            "the turn is running")
        nats_server.freeze()
        try:
            await asyncio.sleep(3.0)  # the freeze under test: past a pull's wait
        finally:
            nats_server.thaw()
        async with asyncio.timeout(20):
            await answered.wait()
        assert [o.text for o in heard.finals[query.message_id]] == ["during|-|N"]
        nc = await nats.connect(nats_server.url)
        try:
            await one_pull_each(nc, worker.config, "the freeze")
        finally:
            await nc.close()
        assert worker.owned_partitions == {0, 1}
        assert await ask(front, heard, "icy", "after") == "after|during|F"


async def test_a_frozen_server_gets_no_pull_after_one_went_unanswered(
        nats_server: NatsServer) -> None:
    """The server frozen (SIGSTOP): the pulls waiting there get no reply. Before, each
    partition asked again once its pull's time had passed (2.4 s), on the connection the
    pings had not given up on yet (4-6 s): that pull waited in the frozen server's
    socket, and on SIGCONT the server read it before the connection's end, while the
    worker was on a new connection. A pull without a pin (a replica below its share
    pulls the partitions it does not own) was then pinned to a connection about to
    close, and the partition's queries, published just after the thaw, waited
    `failover_timeout` for the server to unpin it (chaos15 `server_long_stop`). Now no
    pull goes out on a connection that heard nothing from its server for `pull_expires`
    plus two probe periods (1.4 s; its own presence alone comes every 0.5 s) until it
    hears something or is replaced: nothing goes to the frozen server once its pulls
    went unanswered, and the worker serves again after the thaw."""
    async with proxied(nats_server.port) as proxy:
        async with owning_two(proxy.url, CollectorRegistry()) as worker, \
                listening(nats_server.url) as (front, heard):
            nats_server.freeze()
            try:
                # The scenario: what the worker sent as the server stopped (a pull
                # answering a 408 read just before) is past; a pull's reply is due
                # within pull_expires + 2 s (2.4 s).
                await asyncio.sleep(1.0)
                mark = len(proxy.uplink)
                await until_true(lambda: not worker.readiness.serving,
                                 "the worker saw the freeze", within=15)
                pulls = bytes(proxy.uplink[mark:]).count(b"$JS.API.CONSUMER.MSG.NEXT.")
            finally:
                nats_server.thaw()
            await until_true(lambda: worker.readiness.serving, "the worker came back",
                             within=20)
            assert await ask(front, heard, "thawed", "after") == "after|-|N"
        assert pulls == 0


async def test_a_front_end_closes_while_its_server_is_away(nats_server: NatsServer) -> None:
    """`close()` while the connection is reconnecting (a frozen server) closes at once
    instead of raising nats-py's ConnectionReconnectingError; a second close is a no-op."""
    lost = asyncio.Event()

    async def disconnected() -> None:
        lost.set()

    front = await NatsFrontEnd.connect(NatsConfig(url=nats_server.url),
                                       disconnected_cb=disconnected)
    try:
        nats_server.freeze()
        async with asyncio.timeout(20):
            await lost.wait()
        async with asyncio.timeout(10):
            await front.close()
            await front.close()
        assert front.connection.is_closed
    finally:
        nats_server.thaw()
        await front.close()


async def test_a_front_end_closes_soon_after_its_server_froze(nats_server: NatsServer) -> None:
    """Frozen just now, before the connection's pings noticed: `close()` does not wait
    for a drain the server will never answer (10 s), it closes after an unanswered
    ping."""
    front = await NatsFrontEnd.connect(NatsConfig(url=nats_server.url))
    try:
        await front.publish(UserQuery(participant_id="fz", text="hello"))
        nats_server.freeze()
        assert front.connection.is_connected  # nothing noticed yet
        async with asyncio.timeout(5):
            await front.close()
        assert front.connection.is_closed
    finally:
        nats_server.thaw()
        await front.close()


# ---------------------------------------------------------------- a deployment deleted


@pytest.fixture
async def front(nats_server: NatsServer) -> AsyncIterator[tuple[NatsFrontEnd, Heard]]:
    async with listening(nats_server.url) as pair:
        yield pair


async def published(front: NatsFrontEnd, heard: Heard, pid: str, text: str) -> str:
    """`ask`, once the input stream takes publishes again (bounded: 15 s)."""
    async with asyncio.timeout(15):
        while True:
            try:
                return await ask(front, heard, pid, text)
            except LifecycleError:  # no input stream (yet): the worker recreates it
                await asyncio.sleep(0.1)


DELETIONS: dict[str, Callable[[JetStreamContext], Awaitable[Any]]] = {
    "input_stream": lambda js: js.delete_stream(CONFIG.stream),
    "output_stream": lambda js: js.delete_stream(CONFIG.output_stream),
    "bucket": lambda js: js.delete_key_value(CONFIG.bucket),
}


@pytest.mark.parametrize("part", sorted(DELETIONS))
async def test_a_deleted_part_of_the_deployment_is_recreated(
        nats_server: NatsServer, front: tuple[NatsFrontEnd, Heard], part: str) -> None:
    """An operator deletes the input stream, the output stream or the state bucket
    under a running worker: it says what is missing, recreates it, counts it, and
    answers again; no log line per failed pull."""
    fe, heard = front
    worker = Worker(nats_server.url, "keeper")
    try:
        assert (await ask(fe, heard, "ann", "one")).startswith("one|")
        nc = await nats.connect(nats_server.url)
        try:
            await DELETIONS[part](nc.jetstream())
        finally:
            await nc.close()
        # A turn caught by the outage ends once: answered, or with the failure text
        # (its record could not be written); the next one is answered.
        answer = await published(fe, heard, "bob", "two")
        assert answer.startswith("two|") or answer == FAILURE
        assert (await ask(fe, heard, "bob", "three")).startswith("three|")
        name = "turnrouter_nats_deployment_missing_total"
        await until_true(lambda: metric_value(worker.metrics(), name, f'part="{part}"') == 1,
                         f"{part} counted missing once")
        assert metric_value(worker.metrics(), "turnrouter_nats_serving") == 1
        worker.signal(signal.SIGTERM)
        assert await asyncio.to_thread(worker.proc.wait, 30) == 0
        err = worker.stderr()
        assert "missing from the NATS deployment" in err
        assert len([line for line in err.splitlines() if "status 503" in line]) <= 2, err
        assert "Traceback" not in err
    finally:
        worker.close()


async def test_participants_of_a_deleted_bucket_talk_on_with_their_history(
        nats_server: NatsServer, front: tuple[NatsFrontEnd, Heard]) -> None:
    """The state bucket deleted under a running worker: the participants it serves
    talk on, answered (not the failure text) with the history it holds, their records
    written again and counted (`part="record"`), none of them fenced. Before, each
    write found the record gone, fenced its participant off: every participant's next
    turn ended with the failure text after its input was held `ack_wait`."""
    fe, heard = front
    worker = Worker(nats_server.url, "keeper")
    people = [f"p{k}" for k in range(6)]
    try:
        for pid in people:
            assert (await ask(fe, heard, pid, f"one{pid}")).startswith(f"one{pid}|")
        nc = await nats.connect(nats_server.url)
        try:
            await nc.jetstream().delete_key_value(CONFIG.bucket)
        finally:
            await nc.close()
        # The turn that finds the bucket gone ends once (as any caught by a deletion);
        # the worker makes the bucket again.
        answer = await published(fe, heard, "bob", "caught")
        assert answer.startswith("caught|") or answer == FAILURE
        await until_true(lambda: metric_value(
            worker.metrics(), "turnrouter_nats_deployment_missing_total",
            'part="bucket"') == 1, "the bucket recreated")
        for pid in people:
            assert await ask(fe, heard, pid, "two") == f"two|one{pid}|F"
        metrics = worker.metrics()
        assert metric_value(metrics, "turnrouter_nats_deployment_missing_total",
                            'part="record"') == len(people)
        assert metric_value(metrics, "turnrouter_nats_state_writes_refused_total") == 0
    finally:
        worker.close()


@pytest.mark.parametrize("part", ["bucket", "output_stream"])
async def test_turns_running_when_a_part_goes_end_answered_with_their_history(
        nats_server: NatsServer, front: tuple[NatsFrontEnd, Heard], part: str) -> None:
    """The state bucket (an operator, or a server back on an empty store) or the output
    stream deleted while turns run: each of those turns ends once with its answer, and
    the participants talk on with the history the replica holds, their records written
    again once the worker made the bucket again; answers the missing stream refused
    (503, the connection staying up) are published again once it is made again. Before,
    the finished turn's record write found no bucket, the participant was dropped and
    claimed from the record that was gone: the turn never ended and its history was
    lost (chaos7 D1)."""
    fe, heard = front
    worker = Worker(nats_server.url, "keeper", env={"TR_TEST_ANSWER_SECS": "1.5"})
    people = [f"r{k}" for k in range(4)]
    try:
        answers = await asyncio.gather(*(ask(fe, heard, pid, f"one{pid}") for pid in people))
        assert answers == [f"one{pid}|-|N" for pid in people]
        queries = [UserQuery(participant_id=pid, text=f"two{pid}") for pid in people]
        for query in queries:
            heard.events.setdefault(query.message_id, asyncio.Event())
            await fe.publish(query)
        await until_true(lambda: metric_value(worker.metrics(),
                                              "turnrouter_turns_in_flight") == len(people),
                         "every turn running")
        nc = await nats.connect(nats_server.url)
        try:
            await DELETIONS[part](nc.jetstream())
        finally:
            await nc.close()
        async with asyncio.timeout(30):
            for query in queries:
                await heard.events[query.message_id].wait()
        assert [[o.text for o in heard.finals[q.message_id]] for q in queries] == [
            [f"two{pid}|one{pid}|F"] for pid in people]
        for pid in people:
            assert await ask(fe, heard, pid, "three") == f"three|two{pid}|F"
    finally:
        worker.close()


async def test_a_deployment_that_cannot_be_recreated_ends_the_worker(
        nats_server: NatsServer) -> None:
    """The input stream deleted and its subjects taken by another stream: recreating it
    fails, one line per attempt, and the worker exits 1 naming what is missing once
    `--reconnect-for` has passed."""
    worker = Worker(nats_server.url, "blocked", "--reconnect-for", "1")
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        await js.delete_stream(CONFIG.stream)
        await js.add_stream(name="SQUATTER", subjects=[f"{CONFIG.prefix}.in.*.*"])
        code = await asyncio.to_thread(worker.proc.wait, 30)
        err = worker.stderr()
        assert code == 1, err
        last = err.splitlines()[-1]
        assert last.startswith("turnrouter worker: the NATS deployment stayed broken")
        assert f"stream {CONFIG.stream}" in last
        assert "deployment check 1 failed" in err
        assert "Traceback" not in err
    finally:
        await nc.close()
        worker.close()


# ---------------------------------------------------------------- junk inputs


async def test_junk_inputs_are_logged_rarely(nats_server: NatsServer) -> None:
    """25 malformed inputs of a permitted publisher: all counted, logged the 1st and
    10th time only (a publisher cannot grow the worker's log one line per message)."""
    subject = f"{CONFIG.prefix}.in.{encode_token('ann')}.query"
    text = await rejected_then_stopped(
        nats_server, [(subject, b"{not json %d" % i) for i in range(25)], "invalid")
    logged = [line for line in text.splitlines() if "rejected input" in line]
    assert len(logged) == 2, logged
    assert "1 so far" in logged[0] and "10 so far" in logged[1]


async def test_an_input_subject_is_logged_escaped(nats_server: NatsServer) -> None:
    """A subject may hold any byte but whitespace and `.*>`: one with terminal escape
    sequences is logged quoted, never raw to the operator's terminal (redteam12 F6)."""
    subject = f"{CONFIG.prefix}.in.{encode_token('ann')}.q\x1b[2J\x07"
    text = await rejected_then_stopped(nats_server, [(subject, b"{}")], "unknown_subject")
    assert "\x1b" not in text and "\x07" not in text
    assert any("rejected input on" in line and "\\x1b[2J" in line
               for line in text.splitlines())


async def rejected_then_stopped(server: NatsServer, inputs: list[tuple[str, bytes]],
                                reason: str) -> str:
    """A worker's log once it counted every one of `inputs` rejected for `reason` and
    stopped on SIGTERM (exit 0)."""
    worker = Worker(server.url, "sturdy")
    nc = await nats.connect(server.url)
    try:
        js = nc.jetstream()
        for subject, data in inputs:
            await js.publish(subject, data)
        name = "turnrouter_runtime_rejected_messages_total"
        await until_true(lambda: metric_value(worker.metrics(), name,
                                              f'reason="{reason}"') >= len(inputs),
                         f"{len(inputs)} inputs counted")
        worker.signal(signal.SIGTERM)
        assert await asyncio.to_thread(worker.proc.wait, 30) == 0
        return worker.stderr()
    finally:
        await nc.close()
        worker.close()


def test_readiness_tells_its_listeners_each_change() -> None:
    """`Readiness` serves once no problem is left; listeners hear each change once."""
    seen: list[bool] = []
    readiness = Readiness()
    readiness.on_change(seen.append)
    assert not readiness.serving and readiness.why_not == "starting"
    readiness.update("start", None)
    assert readiness.serving and readiness.why_not == "" and seen == [True]
    readiness.update("connection", "disconnected from NATS")
    readiness.update("deployment", "missing: stream X")
    assert seen == [True, False]
    assert readiness.why_not == "disconnected from NATS; missing: stream X"
    readiness.update("connection", None)
    assert not readiness.serving and seen == [True, False]
    readiness.update("deployment", None)
    assert readiness.serving and seen == [True, False, True]


async def test_readiness_comes_back_after_a_check_that_failed_before_an_outage(
        nats_server: NatsServer) -> None:
    """A deployment check fails (JetStream does not answer: a server shutting down
    answers pulls with 503 first), the connection drops, and the server comes back
    whole: the worker serves again and says so (`readiness`, `turnrouter_nats_serving`).
    Before, the failed check's dropped readiness outlived the outage: the worker
    answered turns while `/ready` said 503 for good (seen after 2 of 5 plain restarts
    of the locked deployment's server).

    Held without touching the worker: its connection goes through a proxy that keeps
    the check's requests from the server, then refuses connections for a while."""
    config = NatsConfig(url=nats_server.url, partitions=1)
    registry = CollectorRegistry()
    admin = await nats.connect(nats_server.url)
    async with proxied(nats_server.port) as proxy:
        worker = NatsWorker(make_router, dataclasses.replace(config, url=proxy.url),
                            registry=registry, replica="ready")
        run = asyncio.create_task(worker.run())
        checks = None
        try:
            async with listening(config) as (front, heard):
                async with asyncio.timeout(15):
                    await worker.ready.wait()
                assert (await ask(front, heard, "ann", "one")).startswith("one|")
                api = f"$JS.API.CONSUMER.%s.{config.stream}.{config.consumer(0)}"
                made = json.loads((await admin.request(api % "INFO", b"", timeout=5)).data)
                checks = proxy.hold(lambda subject, _: subject.startswith("$JS.API.STREAM."))
                await admin.request(api % "DELETE", b"", timeout=5)  # its pull gets 503
                async with asyncio.timeout(15):
                    await checks.event.wait()  # the worker checks its deployment
                await admin.request(api % "CREATE", json.dumps(
                    {"stream_name": config.stream, "config": made["config"]}).encode(),
                    timeout=5)  # whole again, unknown to the worker
                await until_true(lambda: not worker.readiness.serving,
                                 "the failed check dropped readiness")
                proxy.refusing = True
                proxy.reset()
                accepted = proxy.accepted
                await until_true(lambda: proxy.accepted >= accepted + 4,
                                 "reconnect attempts refused while the check waits")
                checks.release()
                proxy.refusing = False
                await until_true(lambda: worker.readiness.serving, "serving again")
                assert metric_value(generate_latest(registry).decode(),
                                    "turnrouter_nats_serving") == 1
                assert (await ask(front, heard, "ann", "two")).startswith("two|")
        finally:
            if checks is not None:
                checks.release()
            proxy.refusing = False
            await admin.close()
            worker.request_stop()
            async with asyncio.timeout(30):
                await asyncio.gather(run, return_exceptions=True)


class _Lines(logging.Handler):
    """The messages of `turnrouter.runtime.nats` from now on; `seen` is set by a
    message holding `mark`."""

    def __init__(self, mark: str) -> None:
        super().__init__(logging.WARNING)
        self.mark, self.lines, self.seen = mark, list[str](), asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        if self.mark in self.lines[-1]:
            self.seen.set()


async def test_a_front_end_logs_an_outage_sparsely(nats_server: NatsServer) -> None:
    """A front end retries a lost server every 0.25 s for ever: its connection errors
    are logged the 1st, 2nd, 4th, 8th... time of an outage (and at least every 30 s),
    not four lines a second."""
    lines = _Lines("(8 errors in a row)")
    logger = logging.getLogger("turnrouter.runtime.nats")
    logger.addHandler(lines)
    front = await NatsFrontEnd.connect(NatsConfig(url=nats_server.url))
    try:
        nats_server.crash()
        async with asyncio.timeout(30):
            await lines.seen.wait()  # (8 attempts: 2 s at least)
        errors = [line for line in lines.lines if "NATS at" in line]
        assert len(errors) == 4, errors  # the 1st, 2nd, 4th and 8th
        assert [e.rpartition(" (")[2] for e in errors[1:]] == [
            "2 errors in a row)", "4 errors in a row)", "8 errors in a row)"]
        assert "127.0.0.1" in errors[0] and "errors in a row" not in errors[0]
    finally:
        logger.removeHandler(lines)
        nats_server.restart()
        await front.close()


async def test_each_outage_of_a_front_end_is_logged_from_its_first_error(
        nats_server: NatsServer) -> None:
    """A second outage soon after the connection came back is an outage of its own:
    its first error is logged as a first (chaos20 F1: errors of outages less than 10 s
    apart were counted as one, and the second outage logged nothing)."""
    lines = _Lines("NATS at")
    logger = logging.getLogger("turnrouter.runtime.nats")
    logger.addHandler(lines)
    front = await NatsFrontEnd.connect(NatsConfig(url=nats_server.url))
    try:
        for outage in range(3):
            lines.seen.clear()
            lines.lines.clear()
            nats_server.crash()
            async with asyncio.timeout(30):
                await lines.seen.wait()
            first = next(line for line in lines.lines if "NATS at" in line)
            assert "errors in a row" not in first, (outage, first)
            nats_server.restart()
            await until_true(lambda: front.connection.is_connected, "reconnected")
    finally:
        logger.removeHandler(lines)
        await front.close()


async def test_a_server_back_taking_less_per_message_ends_the_worker(tmp_path: Path) -> None:
    """A server that comes back (a restart with another configuration, or another server
    of the URL list) taking less in one message than `max_message_bytes` plus headers:
    the worker exits 1 saying so, naming both, as it refuses such a server at start.
    Before, it served on, and an answer over the new bound was dropped unsaid (its turn
    never ended) while its exchange entered the history."""
    config = tmp_path / "nats.conf"
    config.write_text("max_payload: 1048576\n")
    server = NatsServer(config=config)
    worker = start_worker(server.url, "--reconnect-for", "30")
    try:
        assert await line_with(worker.stdout, "worker patient ready", within=30)
        server.crash()
        config.write_text("max_payload: 16384\n")
        await asyncio.to_thread(server.restart)
        last = await line_with(worker.stderr, "came back taking less", within=30)
        assert "max_payload, 16384 bytes" in last and "max_message_bytes 65536" in last
        assert await asyncio.to_thread(worker.wait, 30) == 1
    finally:
        stop(worker)
        server.close()


#: The state bucket's stream.
STATE_STREAM = f"KV_{CONFIG.bucket}"


async def bucket_refusing_writes(admin: Any) -> dict[str, Any]:
    """Make the state bucket refuse every write (a byte limit of 1, new ones
    discarded); its stream info from before, to put it back."""
    info: dict[str, Any] = json.loads((await admin.request(
        f"$JS.API.STREAM.INFO.{STATE_STREAM}", b"", timeout=5)).data)
    full = {**info["config"], "max_bytes": 1, "discard": "new"}
    await admin.request(f"$JS.API.STREAM.UPDATE.{STATE_STREAM}", json.dumps(full).encode(),
                        timeout=5)
    return info


async def test_a_bucket_that_stops_storing_drops_readiness_until_a_write_lands(
        nats_server: NatsServer, tmp_path: Path) -> None:
    """Every state write refused for 10 s (here the bucket's byte limit; in chaos12 a
    full disk, which nats-server does not recover from until restarted): the worker
    stops saying it serves (`/ready` 503 naming the writes, the ready file removed,
    `turnrouter_nats_serving` 0) instead of staying ready while nothing is stored; the
    next write that lands brings it back."""
    ready = tmp_path / "worker.ready"
    worker = Worker(nats_server.url, "storing", "--ready-file", str(ready))
    admin = await nats.connect(nats_server.url)
    try:
        await file_state(ready, True)
        async with listening(nats_server.url) as (front, heard):
            assert await ask(front, heard, "ann", "hello") == "hello|-|N"
            info = await bucket_refusing_writes(admin)
            for asking in range(300):  # a new participant every 0.1 s: at most 30 s
                await front.publish(UserQuery(participant_id=f"n{asking}", text="hi"))
                if not ready.exists():
                    break
                await asyncio.sleep(0.1)
            assert not ready.exists(), "still ready while no write lands"
            status, body = await asyncio.to_thread(ready_reply, worker)
            assert status == 503 and "state writes failing" in body, body
            await admin.request(f"$JS.API.STREAM.UPDATE.{STATE_STREAM}",
                                json.dumps(info["config"]).encode(), timeout=5)
            await ask(front, heard, "ann", "again")
            await file_state(ready, True, within=30)
    finally:
        await admin.close()
        worker.close()


async def test_a_change_outside_turns_that_cannot_be_saved_is_said(
        nats_server: NatsServer, caplog: pytest.LogCaptureFixture) -> None:
    """A context patch applied while its record cannot be written (here the bucket's
    byte limit refusing every write; in chaos13 a server outage, after which another
    replica claimed the participant from the record without it): `apply_context_patch`
    raises `PatchNotSavedError` naming the write, and the worker logs it. Before, it
    returned as if the patch were kept."""
    routers: list[AgentRouter] = []

    def factory(ctx: WorkerContext) -> AgentRouter:
        routers.append(make_router(ctx))
        return routers[-1]

    admin = await nats.connect(nats_server.url)
    try:
        config = NatsConfig(url=nats_server.url)
        async with serving(config, "saving", factory), \
                listening(config) as (front, heard):
            assert await ask(front, heard, "ann", "hello") == "hello|-|N"
            info = await bucket_refusing_writes(admin)
            with caplog.at_level(logging.WARNING, logger="turnrouter"), pytest.raises(
                    PatchNotSavedError, match="record write failed or got no answer"):
                await routers[0].apply_context_patch(
                    "ann", ContextPatch(task_id="job-1", digest=("found it",)))
            assert any("could not be saved" in r.getMessage() for r in caplog.records)
            await admin.request(f"$JS.API.STREAM.UPDATE.{STATE_STREAM}",
                                json.dumps(info["config"]).encode(), timeout=5)
    finally:
        await admin.close()


@contextlib.asynccontextmanager
async def worker_of(config: NatsConfig, replica: str,
                    routers: dict[str, AgentRouter]) -> AsyncIterator[NatsWorker]:
    """An in-process worker (its router in `routers[replica]`) once ready; stopped
    gracefully (bounded) when the block ends."""

    def factory(ctx: WorkerContext) -> AgentRouter:
        routers[replica] = make_router(ctx)
        return routers[replica]

    async with running(NatsWorker(factory, config, replica=replica,
                                  registry=CollectorRegistry())) as worker:
        yield worker


#: What the echo app's answer names as the previous user text once the patch is the
#: history's last exchange.
PATCHED = "[background: job-1]"


@contextlib.asynccontextmanager
async def ann_on_the_first_of_two(nats_server: NatsServer) -> AsyncIterator[tuple[
        NatsProxy, NatsWorker, NatsWorker, NatsFrontEnd, Heard, dict[str, AgentRouter]]]:
    """Two in-process replicas of one partition: the first, reaching the server through
    a proxy, owns it and has answered "ann"; the second has just started. Yields the
    proxy, both workers, a front end and what it heard, and the routers by replica."""
    routers: dict[str, AgentRouter] = {}
    one = dataclasses.replace(CONFIG, url=nats_server.url, partitions=1)
    async with proxied(nats_server.port) as proxy, \
            worker_of(dataclasses.replace(one, url=proxy.url), "first", routers) as first, \
            listening(nats_server.url) as (front, heard):
        await until_true(lambda: first.owned_partitions == {0}, "the first owns it")
        assert await ask(front, heard, "ann", "hello") == "hello|-|N"
        async with worker_of(one, "second", routers) as second:
            assert first.owned_partitions == {0}
            yield proxy, first, second, front, heard, routers


async def test_a_patch_applied_while_the_server_is_away_is_not_said_applied_then_lost(
        nats_server: NatsServer) -> None:
    """chaos13 D1: a context patch applied during a server outage, its participant's
    partition moving to another replica at the server's return (here the first replica
    cannot reconnect until the other one has claimed the participant from their record):
    the patch is not in the next owner's history, and `apply_context_patch` says so,
    raising `PatchNotSavedError` once the first replica learns its write was refused.
    Before, it returned at once, as if the patch were kept, and the patch was lost."""
    async with ann_on_the_first_of_two(nats_server) as (
            proxy, first, second, front, heard, routers):
        proxy.refusing = True  # the first cannot reconnect until told
        nats_server.crash()
        await until_true(lambda: not first.readiness.serving, "the first saw it")
        patching = asyncio.create_task(routers["first"].apply_context_patch(
            "ann", ContextPatch(task_id="job-1", digest=("found it",))))
        nats_server.restart()
        await until_true(lambda: second.owned_partitions == {0}, "the second owns it",
                         within=15)
        answer = await ask(front, heard, "ann", "again")
        proxy.refusing = False
        async with asyncio.timeout(30):
            outcome = (await asyncio.gather(patching, return_exceptions=True))[0]
        assert answer in ("again|hello|F", f"again|{PATCHED}|F"), answer
        kept = answer == f"again|{PATCHED}|F"
        # Never both: reported applied and missing from the next owner's history.
        assert kept or isinstance(outcome, PatchNotSavedError), (answer, outcome)
        assert not kept  # (the first could write nothing before the second's claim)
        assert "was made on this replica but not saved" in str(outcome), outcome


async def test_a_patch_applied_during_a_freeze_is_written_after_it_and_kept(
        nats_server: NatsServer) -> None:
    """A patch applied while the server is frozen (3 s: past `failover_timeout`, so the
    partition is pinned afresh, here to the same replica): `apply_context_patch` returns
    once the record holding it is written, after the thaw, and the next turn sees it. A
    second patch call cancelled while it waits leaves its write alone: that patch is
    kept too."""
    routers: dict[str, AgentRouter] = {}
    config = dataclasses.replace(CONFIG, url=nats_server.url, partitions=1)
    async with worker_of(config, "icy", routers) as worker, \
            listening(nats_server.url) as (front, heard):
        await until_true(lambda: worker.owned_partitions == {0}, "it owns the partition")
        assert await ask(front, heard, "ann", "hello") == "hello|-|N"
        router = routers["icy"]
        nats_server.freeze()
        try:
            patching = asyncio.create_task(router.apply_context_patch(
                "ann", ContextPatch(task_id="job-0", digest=("cancelled",))))
            await asyncio.sleep(0.2)  # (the freeze under test: the call waits meanwhile)
            assert not patching.done()
            patching.cancel()
            applying = asyncio.create_task(router.apply_context_patch(
                "ann", ContextPatch(task_id="job-1", digest=("found it",))))
            await asyncio.sleep(2.8)  # the rest of the freeze: past failover_timeout
            assert not applying.done()
        finally:
            nats_server.thaw()
        async with asyncio.timeout(30):
            applied = await applying
        assert applied.task_id == "job-1"
        assert patching.cancelled()
        assert await ask(front, heard, "ann", "again") == f"again|{PATCHED}|F"
        history = [item.user for item in router.history_of("ann")]
        assert "[background: job-0]" in history, history


async def test_a_patch_whose_write_lands_before_the_next_owners_claim_is_kept(
        nats_server: NatsServer) -> None:
    """The first replica cut off from the server (every publish of its connection held
    back: its pulls, its writes) while a patch is applied there; its partition's pin
    moves to the other replica meanwhile. Once its publishes go through, the patch's
    write lands before the other replica claims the participant (their next query comes
    later): `apply_context_patch` returns, and the next turn, on the other replica, sees
    the patch."""
    async with ann_on_the_first_of_two(nats_server) as (
            proxy, _, second, front, heard, routers):
        cut = proxy.hold(lambda subject, payload: True)
        patching = asyncio.create_task(routers["first"].apply_context_patch(
            "ann", ContextPatch(task_id="job-1", digest=("found it",))))
        await until_true(lambda: second.owned_partitions == {0}, "the second owns it",
                         within=15)
        assert not patching.done()
        cut.release()
        async with asyncio.timeout(30):
            applied = await patching
        assert applied.task_id == "job-1"
        assert await ask(front, heard, "ann", "again") == f"again|{PATCHED}|F"


async def _said_as(front: NatsFrontEnd, heard: Heard, pid: str, turn_id: str,
                   text: str) -> str:
    """Publish `text` as turn `turn_id` of `pid`; its final output's text (bounded)."""
    query = UserQuery(participant_id=pid, text=text, message_id=turn_id)
    event = heard.events.setdefault(query.message_id, asyncio.Event())
    await front.publish(query)
    async with asyncio.timeout(15):
        await event.wait()
    return heard.finals[query.message_id][0].text


async def test_a_patch_of_an_earlier_session_is_refused_on_the_replica_it_moved_to(
        nats_server: NatsServer) -> None:
    """chaos17 F3 on a fleet: ann talks (turn a1), leaves, and calls again (a2) on the
    first replica; the partition then moves to the second, which claims ann from the
    record. A background result of the first call (spawned by a1), delivered there, is
    refused (`LifecycleError`, nothing saved, the next turn does not see it); one of the
    new call (a2) is merged and saved. The session's turns moved in the record's
    snapshot. Before, the first call's result joined the second call's context."""
    routers: dict[str, AgentRouter] = {}
    one = dataclasses.replace(CONFIG, url=nats_server.url, partitions=1)
    async with worker_of(one, "first", routers) as first, \
            listening(nats_server.url) as (front, heard):
        await until_true(lambda: first.owned_partitions == {0}, "the first owns it")
        assert await _said_as(front, heard, "ann", "a1", "card 4242") == "card 4242|-|N"
        await front.publish(ParticipantLeft(participant_id="ann", message_id="bye"))
        assert await _said_as(front, heard, "ann", "a2", "new call") == "new call|-|N"
        assert "ann" in routers["first"].participants
        async with worker_of(one, "second", routers) as second:
            first.request_stop()  # it drains and hands its partition over
            await until_true(lambda: second.owned_partitions == {0}, "the second owns it",
                             within=15)
            assert await _said_as(front, heard, "ann", "a3", "again") == (
                "again|new call|F")
            router = routers["second"]
            with pytest.raises(LifecycleError, match="earlier session"):
                await router.apply_context_patch("ann", ContextPatch(
                    task_id="old-call", spawned_from_event_id="a1",
                    digest=("flight AF123 booked, card ending 4242",)))
            await router.apply_context_patch("ann", ContextPatch(
                task_id="job-1", spawned_from_event_id="a2", digest=("job done",)))
            assert await _said_as(front, heard, "ann", "a4", "and?") == (
                f"and?|{PATCHED}|F")
            assert [e.user for e in router.history_of("ann")] == [
                "new call", "again", PATCHED, "and?"]
