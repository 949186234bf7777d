"""A flood of a fleet subject against two `turnrouter worker`s, before and after.

Per round: a real nats-server (TLS with a throwaway CA made by openssl, or plain with
`--plain`), two `turnrouter worker` processes of one tree (the router of
`tests/nats/app.py`), a `NatsFrontEnd` asking `--queries` (40) queries, one every 50 ms,
while a child process floods one subject as fast as nats-py sends (a flush every 50
messages; `--publishers` such processes). Scenarios (`--scenario`, repeat):

- `timing`: `--count` (20,000) messages of 65,000 bytes on `turnrouter.timing` in the
  name of a replica nobody announced (`Turnrouter-Replica: w9`), redteam18 F2;
- `interrupt`: as many on `turnrouter.ctl.interrupt` (junk: refused `oversized`);
- `presence`: 10 x `--count` messages of 1,000 bytes on `turnrouter.presence`;
- `control`: the `timing` volume on `turnrouter.probe.99`, which no worker reads.

Reported per tree and round: queries answered within 20 s of the last one and their
p50 / max latency; the workers' RSS (MB) at the start and at its peak; the server's
`slow_consumers` (/varz); the workers' "lost the connection" (the turns') and "lost the
fleet connection" log lines; fleet messages counted by the workers
(`turnrouter_runtime_rejected_messages_total` of the subject's topic, any reason) and
how many of them `dropped`; loop-lag samples over 100 ms. Trees run interleaved, so the
figures compare trees measured side by side on one noisy machine:

    PYTHONPATH=src .venv/bin/python benchmarks/bench_nats_fleet_flood.py \\
        --tree new=src --tree old=/tmp/base/src --rounds 2 --scenario timing
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = {"timing": ("turnrouter.timing", 65_000, 1, "nats_timing"),
             "interrupt": ("turnrouter.ctl.interrupt", 65_000, 1, "nats_control"),
             "presence": ("turnrouter.presence", 1_000, 10, "nats_presence"),
             "control": ("turnrouter.probe.99", 65_000, 1, "")}


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def _certificates(folder: Path) -> None:
    """A throwaway CA and a server certificate for 127.0.0.1 in `folder`."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
             "/CN=bench CA", "-keyout", str(folder / "ca-key.pem"), "-out",
             str(folder / "ca.pem"))
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout",
             str(folder / "server-key.pem"), "-out", str(folder / "server.csr"))
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", str(folder / "server.csr"), "-CA",
             str(folder / "ca.pem"), "-CAkey", str(folder / "ca-key.pem"),
             "-CAcreateserial", "-days", "2", "-extfile", str(folder / "san.ext"), "-out",
             str(folder / "server.pem"))


async def _flood(url: str, ca: str | None, subject: str, count: int, size: int) -> None:
    """The child: `count` messages of `size` bytes on `subject`, as fast as sent."""
    import nats
    tls = ssl.create_default_context(cafile=ca) if ca else None
    nc = await nats.connect(url, tls=tls, pending_size=2**30)
    body = b"x" * size
    headers = {"Turnrouter-Replica": "w9"} if subject.endswith(".timing") else None
    started = time.monotonic()
    for i in range(count):
        await nc.publish(subject, body, headers=headers)
        if i % 50 == 49:
            await nc.flush(timeout=60)
    await nc.flush(timeout=60)
    took = time.monotonic() - started
    print(json.dumps({"secs": round(took, 1), "MBps": round(count * size / took / 1e6, 1)}))
    await nc.close()


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    return 0


async def _ask(front: Any, count: int) -> dict[str, Any]:
    from turnrouter.runtime import UserQuery
    ready, done = asyncio.Event(), asyncio.Event()
    waiting: dict[str, float] = {}
    took: list[float] = []

    async def listen() -> None:
        async for out in front.outputs(subscribed=ready):
            asked = waiting.pop(out.request_id, None) if out.final else None
            if asked is not None:
                took.append(time.monotonic() - asked)
                if len(took) == count:
                    done.set()

    task = asyncio.create_task(listen())
    await asyncio.wait_for(ready.wait(), 15)
    for i in range(count):
        query = UserQuery(participant_id=f"p{i % 20}", text=f"fast q{i}")
        waiting[query.message_id] = time.monotonic()
        await front.publish(query)
        await asyncio.sleep(0.05)
    with contextlib.suppress(TimeoutError):  # 20 s after the last query at most
        await asyncio.wait_for(done.wait(), 20)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return {"answered": f"{len(took)}/{count}",
            "p50_s": round(statistics.median(took), 2) if took else None,
            "max_s": round(max(took), 2) if took else None}


def _varz(monitor: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/varz", timeout=5) as reply:
        varz: dict[str, Any] = json.loads(reply.read())
    return varz


def _counted(text: str, topic: str) -> tuple[float, float, float]:
    """(fleet messages counted on `topic`, of which dropped, loop-lag samples > 0.1 s)."""
    counted = dropped = under = total = 0.0
    for line in text.splitlines():
        value = line.rsplit(" ", 1)[-1]
        if (line.startswith("turnrouter_runtime_rejected_messages_total{") and topic
                and f'topic="{topic}"' in line):
            counted += float(value)
            dropped += float(value) if 'reason="dropped"' in line else 0.0
        elif line.startswith("turnrouter_event_loop_lag_seconds_bucket{"):
            under += float(value) if 'le="0.1"' in line else 0.0
            total += float(value) if 'le="+Inf"' in line else 0.0
    return counted, dropped, total - under


async def _round(tree: Path, scenario: str, count: int, queries: int,
                 certs: Path | None, publishers: int) -> dict[str, Any]:
    from tests.nats.conftest import NatsServer, Worker

    from turnrouter.runtime.nats import NatsConfig, NatsFrontEnd
    subject, size, times, topic = SCENARIOS[scenario]
    count = count * times // publishers * publishers
    ca = str(certs / "ca.pem") if certs else None
    server = (NatsServer(scheme="tls", args=["--tls", "--tlscert", str(certs / "server.pem"),
                                             "--tlskey", str(certs / "server-key.pem")])
              if certs else NatsServer())
    env = {"PYTHONPATH": f"{tree}{os.pathsep}{ROOT}",
           **({"TURNROUTER_NATS_TLS_CA": ca} if ca else {})}
    workers: list[Worker] = []
    try:
        workers = [Worker(server.url, f"w{i}", env=env) for i in (1, 2)]
        front = await NatsFrontEnd.connect(NatsConfig(url=server.url, tls_ca_file=ca))
        base = [_rss(w.proc.pid) for w in workers]
        peak = list(base)

        async def watch() -> None:
            while True:
                for i, w in enumerate(workers):
                    peak[i] = max(peak[i], _rss(w.proc.pid))
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        flooders = [await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--child", server.url, "--ca", ca or "",
            "--subject", subject, "--count", str(count // publishers), "--size",
            str(size), stdout=subprocess.PIPE) for _ in range(publishers)]
        asked = await _ask(front, queries)
        outs = [(await asyncio.wait_for(f.communicate(), 600))[0] for f in flooders]
        await asyncio.sleep(2.0)  # (what the workers still read of the flood)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        varz = await asyncio.to_thread(_varz, server.monitor)
        counts = [_counted(await asyncio.to_thread(w.metrics), topic) for w in workers]
        await front.close()
    finally:
        for w in workers:
            w.close()
        server.close()
    logs = [w.stderr() for w in workers]
    return {"flood": [json.loads(out or b"{}") for out in outs], **asked,
            "rss_base": base, "rss_peak": peak,
            "slow_consumers": varz.get("slow_consumers"),
            "turns_conn_lost": [log.count("lost the connection to NATS") for log in logs],
            "fleet_conn_lost": [log.count("lost the fleet connection") for log in logs],
            "counted": [int(c[0]) for c in counts], "dropped": [int(c[1]) for c in counts],
            "lag_over_100ms": [int(c[2]) for c in counts], "of": count}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tree", action="append", default=[],
                        help="NAME=PATH of a source tree (repeat); default new=src")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--count", type=int, default=20_000)
    parser.add_argument("--queries", type=int, default=40)
    parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS))
    parser.add_argument("--plain", action="store_true", help="no TLS")
    parser.add_argument("--publishers", type=int, default=1,
                        help="flooding processes, each sending its share of --count")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--ca", help=argparse.SUPPRESS)
    parser.add_argument("--subject", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        asyncio.run(_flood(args.child, args.ca or None, args.subject, args.count,
                           args.size))
        return
    sys.path.insert(0, str(ROOT))
    trees = [(name, Path(path).resolve()) for name, path in
             (spec.split("=", 1) for spec in args.tree or ["new=src"])]
    folder = Path(tempfile.mkdtemp(prefix="bench-tls-"))
    try:
        if not args.plain:
            _certificates(folder)
        for scenario in args.scenario or ["timing"]:
            for _ in range(args.rounds):
                for name, tree in trees:  # interleaved: the same noise for every tree
                    result = asyncio.run(_round(tree, scenario, args.count, args.queries,
                                                None if args.plain else folder,
                                                args.publishers))
                    print(json.dumps({"scenario": scenario, "tree": name, **result}),
                          flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
