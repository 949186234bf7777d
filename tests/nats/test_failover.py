"""Crashes, pauses and graceful ends of worker processes on a real nats-server."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest

from turnrouter.runtime import Interrupted, UserQuery
from turnrouter.runtime.nats import NatsConfig, NatsFrontEnd, encode_token

from .conftest import NatsServer, Worker, metric_value, until_true
from .crowd import FAILURE, Crowd, Heard, ask, listen, listening

#: Every turn ends within this: a liveness bound (a turn left hanging for good, or for
#: many failover periods, fails), not a timing claim. The failover gap itself is a
#: figure of benchmarks/bench_distributed.py (docs/distributed.md, 1-2 s); on a loaded
#: 2-core machine, three crashes with 200 talkers took up to 11 s here.
ENDS_WITHIN = 20.0

pytestmark = pytest.mark.anyio


@contextmanager
def fleet(server: NatsServer, count: int, prefix: str = "w") -> Iterator[list[Worker]]:
    workers: list[Worker] = []
    try:
        for i in range(count):
            workers.append(Worker(server.url, f"{prefix}{i}"))
        yield workers
    finally:
        for worker in workers:
            worker.close()


@asynccontextmanager
async def talking(server: NatsServer, participants: int, pause: float,
                  quick: int | None = None, turn_wait: float = 10.0) -> AsyncIterator[Crowd]:
    """A crowd talking until the block ends; then every turn is waited for. `quick` of
    it (half unless given) is answered at once (no in-flight mark), the others after
    the workers' answer time (50 ms unless set: marked in flight)."""
    front = await NatsFrontEnd.connect(NatsConfig(url=server.url))
    crowd = Crowd(front, participants, timeout=turn_wait, pause=pause,
                  quick=participants // 2 if quick is None else quick)
    ready = asyncio.Event()
    listener = asyncio.create_task(crowd.listen(ready))
    await ready.wait()
    talk = asyncio.gather(*(crowd.talk(pid, None) for pid in crowd.pids))
    try:
        yield crowd
    finally:
        crowd.stop()
        async with asyncio.timeout(30):
            await talk
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        await front.close()


def owned(worker: Worker) -> float:
    return metric_value(worker.metrics(), "turnrouter_nats_partitions_owned")


def total(workers: list[Worker], name: str) -> float:
    return sum(metric_value(w.metrics(), name) for w in workers)


async def until_owned(workers: list[Worker], count: int = 16) -> None:
    """Until the workers own `count` partitions between them (bounded)."""
    for _ in range(200):  # polling the workers' /metrics: at most 20 s
        if await asyncio.to_thread(total, workers, "turnrouter_nats_partitions_owned") == count:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the workers never owned {count} partitions")


async def served(crowd: Crowd, turns: int) -> None:
    """Until `turns` more turns ended (bounded)."""
    async with asyncio.timeout(30):
        await crowd.heard.more(turns)


async def test_kill_nine_three_times_loses_nothing(nats_server: NatsServer) -> None:
    """kill -9 of the busiest replica, three times: nothing lost, doubled or reordered;
    history and focus move; every turn ends within the documented gap; both ways of
    acknowledging a query (after its finished record, or after an in-flight mark) were
    taken."""
    with fleet(nats_server, 3) as workers:
        await until_owned(workers)  # start-up is not failover: talk once all are served
        async with talking(nats_server, 200, pause=0.5) as crowd:
            await served(crowd, 400)
            for kill in range(3):
                victim = max(workers, key=owned)
                assert owned(victim) > 0
                victim.signal(signal.SIGKILL)
                survivors = [w for w in workers if w is not victim]
                before = total(survivors, "turnrouter_nats_takeovers_total")
                replacement = await asyncio.to_thread(Worker, nats_server.url, f"r{kill}")
                workers[workers.index(victim)] = replacement
                victim.close()
                await until_owned(workers)
                await served(crowd, 400)
                assert total([*survivors, replacement],
                             "turnrouter_nats_takeovers_total") > before
        figures = crowd.check(ENDS_WITHIN)
        assert figures["answers"] > 1000
        await until_owned(workers)
        marked = total(workers, "turnrouter_nats_inflight_marks_total")
        turns = total(workers, "turnrouter_turns_total")
        assert 0 < marked < turns


async def test_paused_replica_is_fenced_and_catches_up(nats_server: NatsServer) -> None:
    """SIGSTOP past the failover timeout: the paused replica answers nobody that moved,
    and serves again cleanly after SIGCONT."""
    with fleet(nats_server, 2) as workers:
        await until_owned(workers)
        async with talking(nats_server, 60, pause=0.2) as crowd:
            await served(crowd, 200)
            paused = max(workers, key=owned)
            other = workers[1 - workers.index(paused)]
            paused.signal(signal.SIGSTOP)
            try:
                await served(crowd, 200)  # the other replica serves everyone
            finally:
                paused.signal(signal.SIGCONT)
            await until_owned([other])
            await served(crowd, 300)
            text = paused.metrics()
            assert metric_value(text, "turnrouter_nats_partitions_lost_total",
                                'how="lost"') > 0
            # Fencing: Crowd.check() below also reads every publish before the output
            # stream's deduplication: no turn was ever ended with two different texts.
        crowd.check(ENDS_WITHIN)
        await until_owned(workers)


async def long_turn_marked(workers: list[Worker], front: NatsFrontEnd, heard: Heard
                           ) -> tuple[UserQuery, asyncio.Event, Worker]:
    """A query of `slowpoke` (answered in 60 s) published, once marked in flight: the
    query, the event set when its final is heard, and the worker running it."""
    query = UserQuery(participant_id="slowpoke", text="slow")
    event = heard.events.setdefault(query.message_id, asyncio.Event())
    await front.publish(query)
    await until_true(lambda: total(workers, "turnrouter_nats_inflight_marks_total") == 1,
                     "the turn marked in flight")
    runner = max(workers, key=lambda worker: metric_value(
        worker.metrics(), "turnrouter_nats_inflight_marks_total"))
    return query, event, runner


async def test_a_paused_replica_whose_record_is_gone_ends_its_turn(
        nats_server: NatsServer) -> None:
    """A replica paused past the failover timeout while a turn of its runs, the
    participant's record gone meanwhile (a server back on an empty store, an
    operator): on resume it loses the partition and, no record telling anyone else of
    the turn, ends it itself with the failure text. Before, nobody ended it: the
    participant waited for good (review9)."""
    config = NatsConfig(url=nats_server.url)
    with fleet(nats_server, 2) as workers:
        await until_owned(workers)
        async with listening(nats_server.url) as (front, heard):
            query, event, runner = await long_turn_marked(workers, front, heard)
            kv = await front.connection.jetstream().key_value(config.bucket)
            for n in range(config.partitions):  # its record gone
                await kv.purge(f"{n}.{encode_token('slowpoke')}")
            runner.signal(signal.SIGSTOP)
            try:
                await asyncio.sleep(3 * config.failover_timeout)  # the pause itself
            finally:
                runner.signal(signal.SIGCONT)
            async with asyncio.timeout(ENDS_WITHIN):
                await event.wait()
            assert [o.text for o in heard.finals[query.message_id]] == [FAILURE]


async def test_decoys_taking_probe_ids_do_not_hold_off_a_failover(
        nats_server: NatsServer) -> None:
    """A front end publishes, on its own subjects, decoys carrying the id of every probe
    of the next minute as the fleet would make them without its key (`<probe
    subject>.<window>`: the stream deduplicates across subjects, redteam21 F1), then
    a replica is killed while a turn of its runs on a partition nobody talks on: the
    survivor's probes, whose ids hold the fleet's key, still pin it there, and the turn
    ends with the failure text. Before, the real probes were dropped as duplicates and
    the turn never ended. Each decoy is refused and counted."""
    config = NatsConfig(url=nats_server.url)
    with fleet(nats_server, 2) as workers:
        await until_owned(workers)
        async with listening(nats_server.url) as (front, heard):
            query, event, runner = await long_turn_marked(workers, front, heard)
            decoy = Interrupted(participant_id="mallory").model_dump_json().encode()
            window = int(time.time() / config.probe_interval)
            for ahead in range(int(60 / config.probe_interval)):
                for n in range(config.partitions):
                    await front.connection.publish(
                        config.input_subject("mallory", "interrupt"), decoy,
                        headers={"Nats-Msg-Id": f"{config.probe_subject(n)}.{window + ahead}"})
            await front.connection.flush()
            runner.proc.kill()
            async with asyncio.timeout(ENDS_WITHIN):
                await event.wait()
            assert [o.text for o in heard.finals[query.message_id]] == [FAILURE]


async def test_sigterm_hands_over_without_failure_text(nats_server: NatsServer) -> None:
    """SIGTERM: the replica drains and hands its partitions over; nobody hears the
    failure text and the process exits 0."""
    with fleet(nats_server, 3) as workers:
        await until_owned(workers)
        async with talking(nats_server, 60, pause=0.2) as crowd:
            await served(crowd, 200)
            leaving = max(workers, key=owned)
            leaving.signal(signal.SIGTERM)
            code = await asyncio.to_thread(leaving.proc.wait, 30)
            assert code == 0, leaving.stderr()
            stayed = [w for w in workers if w is not leaving]
            await until_owned(stayed)
            await served(crowd, 200)
        figures = crowd.check(ENDS_WITHIN)
        assert figures["failures"] == 0


async def test_a_graceful_stop_longer_than_the_failover_timeout_says_no_failure_text(
        nats_server: NatsServer) -> None:
    """SIGTERM of the replica running eight 3 s turns (three failover timeouts): it keeps
    its partitions (pulls that deliver nothing) until those turns finished and it handed
    the partitions over, so every turn ends with its answer and the participants' next
    turns, with that history, go to the other replica. Before, the stopping replica
    pulled no more while it drained, the server moved its partitions after
    failover_timeout, and their new owner's takeover ended the running turns with the
    failure text (a newcomer's walkthrough: 28 of them with 2 s turns)."""
    slow = {"TR_TEST_ANSWER_SECS": "3"}
    leaving = Worker(nats_server.url, "leaving", env=slow)
    staying: Worker | None = None
    try:
        async with listening(nats_server.url) as (front, heard):
            await until_owned([leaving])
            queries = [UserQuery(participant_id=f"p{i}", text=f"first {i}") for i in range(8)]
            for query in queries:
                await front.publish(query)
            await until_true(lambda: metric_value(
                leaving.metrics(), "turnrouter_nats_inflight_marks_total") >= len(queries),
                "every turn running (marked in flight)")
            staying = await asyncio.to_thread(Worker, nats_server.url, "staying", env=slow)
            leaving.signal(signal.SIGTERM)
            assert await asyncio.to_thread(leaving.proc.wait, 30) == 0, leaving.stderr()
            for query in queries:
                async with asyncio.timeout(15):
                    await heard.events.setdefault(query.message_id, asyncio.Event()).wait()
            assert [[m.text for m in heard.finals[q.message_id]] for q in queries] == [
                [f"first {i}|-|N"] for i in range(8)]
            assert await ask(front, heard, "p0", "next") == "next|first 0|F"
            assert metric_value(staying.metrics(), "turnrouter_nats_inflight_failed_total") == 0
    finally:
        leaving.close()
        if staying is not None:
            staying.close()


async def test_sigterm_hands_idle_partitions_over_at_once_while_a_long_turn_drains(
        nats_server: NatsServer) -> None:
    """SIGTERM of a replica one of whose turns runs long (an LLM answer, a hung tool):
    its other partitions go to the other replica at once, so their participants are
    answered while that turn still drains; only the long turn's partition waits. Before,
    every partition was held until the whole drain ended (up to `drain_timeout`), and
    half a fleet's participants heard the busy text after a rolling restart (chaos12
    D2)."""
    leaving = Worker(nats_server.url, "leaving", "--drain-timeout", "30")
    staying: Worker | None = None
    try:
        async with listening(nats_server.url) as (front, heard):
            await until_owned([leaving])
            pids = [f"a{i}" for i in range(12)]
            for pid in pids:
                assert await ask(front, heard, pid, "hi") == "hi|-|N"
            await front.publish(UserQuery(participant_id="s", text="slow one"))
            await until_true(lambda: metric_value(
                leaving.metrics(), "turnrouter_nats_inflight_marks_total") >= 1,
                "the long turn running (marked in flight)")
            kv = await front.connection.jetstream().key_value(NatsConfig().bucket)
            partition: dict[str, str] = {}
            async with asyncio.timeout(15):  # the mark is counted before its write lands
                while encode_token("s") not in partition:
                    partition = {key.partition(".")[2]: key.partition(".")[0]
                                 for key in await kv.keys()}
                    await asyncio.sleep(0.01)
            others = [p for p in pids if partition[encode_token(p)]
                      != partition[encode_token("s")]]
            assert others  # (12 participants in one of 16 partitions: never all)
            staying = await asyncio.to_thread(Worker, nats_server.url, "staying")
            leaving.signal(signal.SIGTERM)
            for pid in others:
                assert await ask(front, heard, pid, "again") == "again|hi|F"
            assert leaving.proc.poll() is None, "the long turn's drain is still running"
    finally:
        leaving.close()
        if staying is not None:
            staying.close()


@pytest.mark.parametrize(("again", "turn"), [
    ("never", "stubborn"), ("at once", "stubborn"), ("later", "stubborn"),
    ("never", "blocking"), ("later", "blocking")])
async def test_a_graceful_stop_that_cannot_finish_still_ends_the_worker(
        nats_server: NatsServer, again: str, turn: str, tmp_path: Path) -> None:
    """A turn whose destination ignores its cancellation (or a store timing every write
    out) keeps the graceful stop from finishing: the worker still exits (status 1, one
    line saying so) `--drain-timeout` plus 10 s after SIGTERM, or at once on a second
    SIGTERM a second or more later (one right after the first is the same stop: `uv
    run` forwards the terminal's signal the worker got too), instead of running on until
    the deployment's kill -9 (chaos12 D5 took over 30 s). What it held goes to the next
    owner as after a crash. Also when the destination blocks the event loop itself
    (`time.sleep` on it): the loop's own signal handler waited for it to return, so the
    worker exited 0 after the block, ignoring both the deadline and a second signal
    (redteam14 D4)."""
    blocked = tmp_path / "blocked"
    worker = Worker(nats_server.url, "stubborn", "--drain-timeout", "1",
                    env={"TR_TEST_BLOCKING_MARK": str(blocked)})
    try:
        async with listening(nats_server.url) as (front, _):
            await front.publish(UserQuery(participant_id="s", text=f"{turn} one"))
            await until_true(blocked.exists if turn == "blocking" else lambda: metric_value(
                worker.metrics(), "turnrouter_nats_inflight_marks_total") >= 1,
                f"the {turn} turn running")
            worker.signal(signal.SIGTERM)
            if again == "at once":
                worker.signal(signal.SIGTERM)
            elif again == "later" and turn == "blocking":  # (its loop says nothing)
                await asyncio.sleep(1.5)  # (the rule is about time: past SAME_STOP_SECS)
                worker.signal(signal.SIGTERM)
            elif again == "later":
                await until_true(lambda: metric_value(
                    worker.metrics(), "turnrouter_nats_serving") == 0,
                    "the first SIGTERM handled (the worker says it stops)")
                await asyncio.sleep(1.5)  # (the rule is about time: past SAME_STOP_SECS)
                worker.signal(signal.SIGTERM)
            status = await asyncio.to_thread(worker.proc.wait, 60)
        assert worker.proc.stdout is not None
        said = worker.proc.stdout.read()  # (the process ended: up to its end)
        assert status == 1, said
        assert ("stopping again (SIGTERM): exiting now" if again == "later"
                else "still stopping after 11 s (--drain-timeout plus 10 s): exiting now"
                ) in said, said
    finally:
        worker.close()


async def test_a_replica_added_while_every_partition_runs_long_turns_gets_a_share(
        nats_server: NatsServer) -> None:
    """Turns of 2 s (an LLM's answer) back to back, ten participants per partition: no
    partition is ever idle for the 0.4 s a busy handover first waits.
    Each aborted handover waits longer the next time (up to 3.2 s, the partition's
    inputs held meanwhile), so a replica added under that load gets a partition within
    a minute; nothing is lost, doubled or failed. Before, every try was aborted and the
    backoff doubled to 5 minutes: the added replica got no partition at all (chaos12
    D1)."""
    slow = {"TR_TEST_ANSWER_SECS": "2.0"}
    first = Worker(nats_server.url, "first", env=slow)
    added: Worker | None = None
    try:
        await until_owned([first])
        async with talking(nats_server, 160, pause=0.0, quick=0, turn_wait=15.0) as crowd:
            await served(crowd, 160)
            added = await asyncio.to_thread(Worker, nats_server.url, "added", env=slow)
            for _ in range(600):  # polling /metrics: at most 60 s
                if await asyncio.to_thread(owned, added) >= 1:
                    break
                await asyncio.sleep(0.1)
            assert await asyncio.to_thread(owned, added) >= 1, "the added replica got none"
        figures = crowd.check(ENDS_WITHIN)
        assert figures["failures"] == 0
    finally:
        first.close()
        if added is not None:
            added.close()


async def test_a_patch_between_turns_survives_a_crash(nats_server: NatsServer) -> None:
    """A context patch applied after a turn ended is saved to the participant's record
    without waiting for a next turn: kill -9 of the owner, and the new owner's next turn
    has the patch in its history."""
    front = await NatsFrontEnd.connect(NatsConfig(url=nats_server.url))
    heard = Heard()
    ready = asyncio.Event()
    listener = asyncio.create_task(listen(front, heard, ready))
    await ready.wait()
    records: Any = None
    try:
        with fleet(nats_server, 1, prefix="a") as (owner,):
            # The bucket is the workers' (a front end makes only the streams).
            kv = await front.connection.jetstream().key_value(NatsConfig().bucket)
            records = await kv.watch(f"*.{encode_token('pat')}")
            assert await ask(front, heard, "pat", "patch me") == "patch me|-|N"
            async with asyncio.timeout(10):  # the record, rewritten with the patch
                async for entry in records:
                    if entry is not None and b"[background: job-pat]" in (entry.value or b""):
                        break
            owner.signal(signal.SIGKILL)
            with fleet(nats_server, 1, prefix="b"):
                assert await ask(front, heard, "pat", "after") == (
                    "after|[background: job-pat]|F")
    finally:
        if records is not None:
            await records.stop()
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        await front.close()
