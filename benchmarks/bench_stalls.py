"""Event-loop stalls at the boundaries: the longest loop block caused by one big input.

Each row of `BOUNDARIES` feeds one boundary its largest single input (about 1 MB by
default) while a heartbeat task wakes every millisecond; the longest gap between two
heartbeats, minus the interval, is the longest time the event loop was blocked. The
target (issue 13) is under 100 ms for any input up to 1 MB. Inputs are adversarial for
the old code paths (unclosed `<think>` tags, runs of spaces, deep nesting, endless
bodies). LLM rows use a real HTTP server on a free local port.

    .venv/bin/python benchmarks/bench_stalls.py [--size BYTES] [--repeats N] [--reference]

`--reference` adds the pre-fix `<think>` regex on a 32 kB reply, for comparison. To add
a boundary, append a `Boundary` to `BOUNDARIES` (name, input, coroutine factory).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from turnrouter import AgentExchange, AgentTurn, RouteDecision, RouteRequest, RoutingAid
from turnrouter.decisions import ClassifierDecisions, DictRoutingPolicy
from turnrouter.llm import OpenAIChatClient, TemplateAcknowledger
from turnrouter.runtime import AgentRuntime, Topic, UserQuery
from turnrouter.testing import ScriptedLLM

HEARTBEAT_SECS = 0.001
TARGET_MS = 100.0


Feed = Callable[[], Awaitable[str]]
"""Feeds the prepared input once; returns the outcome ("ok" or the error's type name)."""


@dataclass(frozen=True)
class Boundary:
    """One row: a boundary, a description of its input, and how to prepare a feed.

    `prepare(size)` builds an input of about `size` bytes outside the measurement and
    returns the feed that is timed.
    """

    area: str
    name: str
    input: str
    prepare: Callable[[int], Feed]


@dataclass
class Row:
    boundary: Boundary
    block_ms: float
    wall_ms: float
    outcome: str


async def measure(boundary: Boundary, size: int) -> Row:
    """Run one boundary under a heartbeat; the longest heartbeat gap is the loop block."""
    feed = boundary.prepare(size)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    worst = 0.0

    async def heartbeat() -> None:
        nonlocal worst
        last = loop.time()
        while not stop.is_set():
            await asyncio.sleep(HEARTBEAT_SECS)
            now = loop.time()
            worst = max(worst, now - last - HEARTBEAT_SECS)
            last = now

    beat = asyncio.create_task(heartbeat())
    await asyncio.sleep(HEARTBEAT_SECS * 3)  # the heartbeat is running
    started = time.perf_counter()
    try:
        outcome = await feed()
    except Exception as exc:  # an undocumented error is a finding: show it
        outcome = f"UNEXPECTED {type(exc).__name__}"
    wall = time.perf_counter() - started
    await asyncio.sleep(HEARTBEAT_SECS * 3)  # let a block at the very end be seen
    stop.set()
    await beat
    return Row(boundary, worst * 1000, wall * 1000, outcome)


# ---------------------------------------------------------------- a local LLM server


class _Server:
    """A chat-completions server on a free port answering `body` (or endless chunks)."""

    def __init__(self) -> None:
        self.body: bytes = b""
        self.endless = False
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Connection", "close")
                    if server.endless:
                        self.send_header("Transfer-Encoding", "chunked")
                        self.end_headers()
                        for chunk in itertools.repeat(b"[" * 65536, 16 * 1024):  # <= 1 GiB
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        return
                    self.send_header("Content-Length", str(len(server.body)))
                    self.end_headers()
                    self.wfile.write(server.body)
                except OSError:
                    pass  # the client cut the reply off

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.01,),
                                       daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


SERVER: _Server | None = None


def _reply(content: str) -> bytes:
    return json.dumps({"choices": [{"message": {"content": content}}]}).encode()


def _fill(unit: str, size: int) -> str:
    return unit * max(1, size // len(unit.encode()))


def _named(fn: Callable[[], object]) -> str:
    """Run a synchronous boundary (on the loop, as callers do) and name its outcome."""
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__
    return "ok"


def _sync(fn: Callable[[], object]) -> Feed:
    async def feed() -> str:
        return _named(fn)
    return feed


def _complete(body: bytes | None, prompt: str = "hi") -> Feed:
    """A call of the client against the local server answering `body` (None: endless)."""
    assert SERVER is not None
    server = SERVER
    client = OpenAIChatClient("m", base_url=server.url, timeout_secs=60)

    async def feed() -> str:
        server.endless = body is None
        server.body = body or b""
        try:
            await client.complete(prompt, max_tokens=8)
        except Exception as exc:
            return type(exc).__name__
        return "ok"

    return feed


def _policy_json(size: int) -> str:
    entry = len(json.dumps({"participant-00000000": "billing"})) - 1  # with ", "
    return json.dumps({f"participant-{i:08d}": "billing" for i in range(size // entry - 1)})


def _policy_file(size: int) -> Feed:
    directory = tempfile.mkdtemp()
    path = os.path.join(directory, "policy.json")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(_policy_json(size))

    async def feed() -> str:
        try:
            return _named(lambda: DictRoutingPolicy.from_json_file(path))
        finally:
            os.remove(path)
            os.rmdir(directory)

    return feed


def _policy_env(size: int) -> Feed:
    name = "TURNROUTER_BENCH_POLICY"
    value = _policy_json(size)

    async def feed() -> str:
        os.environ[name] = value
        try:
            return _named(lambda: DictRoutingPolicy.from_env(name))
        finally:
            del os.environ[name]

    return feed


def _classifier(size: int, pad: str = " ", expected: str = "billing") -> Feed:
    service = ClassifierDecisions(ScriptedLLM(pad * size + "route: billing\nconfidence: 0.9"))
    request = RouteRequest(AgentTurn("p", "t", "q"), (RoutingAid("billing", "Invoices."),))

    async def feed() -> str:
        decision = await service.decide(request)
        return "ok" if decision.choice == expected else "WRONG"

    return feed


def _template(size: int) -> Feed:
    prompt = ("Helper: calendar\nHelper description: " + _fill("a", size // 2)
              + "\nUser: " + _fill("x", size // 2))
    acknowledger = TemplateAcknowledger()

    async def feed() -> str:
        await acknowledger.complete(prompt, max_tokens=16)
        return "ok"

    return feed


def _acknowledge(prompt: str) -> Feed:
    acknowledger = TemplateAcknowledger()

    async def feed() -> str:
        await acknowledger.complete(prompt, max_tokens=16)
        return "ok"

    return feed


def _publish(size: int) -> Feed:
    topic = Topic("q", UserQuery)
    text = _fill("é", size)
    valid = UserQuery(participant_id="p", text=text)
    surrogate = {"participant_id": "p", "text": text + "\ud800"}
    bypassed = UserQuery.model_construct(participant_id="p", text=text)

    async def feed() -> str:
        received: list[UserQuery] = []

        async def sink(message: UserQuery) -> None:
            received.append(message)

        runtime = AgentRuntime()
        runtime.subscribe(topic, sink)
        for message in (valid, surrogate, bypassed):
            await runtime.publish(topic, message)
        return "ok" if len(received) == 2 and runtime.rejected_messages == 1 else "WRONG"

    return feed


def _seeded_turn(size: int) -> Feed:
    """A first turn carrying a caller history of ~`size` bytes in 5-byte exchanges."""
    from turnrouter import AgentRouter
    from turnrouter.testing import OutputRecorder, ScriptedAgent, ScriptedDecisions

    history = tuple(AgentExchange("q", "abcd") for _ in range(size // 5))
    count = itertools.count()

    async def feed() -> str:
        router = AgentRouter({"conversation": ScriptedAgent("conversation")},
                             ScriptedDecisions("conversation"), output=OutputRecorder())
        result = await router.handle(AgentTurn("p", f"t{next(count)}", "hi", history))
        return "ok" if result.disposition == "answer" else "WRONG"

    return feed


def _lexical_turn(size: int) -> Feed:
    """A turn whose 1 MB query goes through the embedded decision service."""
    from turnrouter import AgentRouter
    from turnrouter.decisions import LexicalDecisions
    from turnrouter.testing import OutputRecorder, ScriptedAgent

    agents = {name: ScriptedAgent(name, f"{name} requests and questions")
              for name in ("weather", "calendar", "music", "conversation")}
    query = " ".join(itertools.islice(itertools.cycle(
        ["will", "it", "rain", "tomorrow", "play", "jazz", "meeting"]), size // 5))
    count = itertools.count()

    async def feed() -> str:
        router = AgentRouter(agents, LexicalDecisions(), output=OutputRecorder())
        await router.handle(AgentTurn("p", f"t{next(count)}", query))
        return "ok"

    return feed


def _snapshot(size: int) -> Feed:
    from turnrouter import ParticipantSnapshot

    data = json.dumps({"participant_id": "p", "history": [
        {"user": "q" * 40, "assistant": "a" * 40} for _ in range(size // 100)]})
    return _sync(lambda: ParticipantSnapshot.from_json(data))


class _Inputs(dict[int, str]):
    """Inputs built once per size, before any measurement."""

    def __init__(self, build: Callable[[int], str]) -> None:
        super().__init__()
        self._build = build

    def __missing__(self, size: int) -> str:
        self[size] = value = self._build(size)
        return value


_POLICY = _Inputs(_policy_json)
_TEXT = _Inputs(lambda size: _fill("é", size))
_SCORES = {f"r{i}": 0.5 for i in range(10_000)}


_OLD_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)


def _old_regex(size: int) -> Feed:
    reply = "<think>" * (32_000 // 7)
    return _sync(lambda: _OLD_THINK.sub("", reply))


async def _nothing() -> str:
    await asyncio.sleep(0.02)
    return "ok"


BOUNDARIES: list[Boundary] = [
    # The noise floor: heartbeat gaps with no input at all (other processes, the OS).
    Boundary("(baseline)", "no input, 20 ms idle", "-", lambda size: _nothing),
    Boundary("LLM client", "reply: unclosed <think> tags", "<think> x ~1 MB (JSON body)",
             lambda size: _complete(_reply(_fill("<think>", size - 64)))),
    Boundary("LLM client", "reply: closed <think> blocks", "<think>a</think>b x ~1 MB",
             lambda size: _complete(_reply(_fill("<think>a</think>b", size - 64)))),
    Boundary("LLM client", "reply: nested JSON", "[ x 1 MB",
             lambda size: _complete(b"[" * size)),
    Boundary("LLM client", "reply: not UTF-8", "0xff x 1 MB",
             lambda size: _complete(b"\xff" * size)),
    Boundary("LLM client", "reply: endless chunked body", "64 kB chunks, no end",
             lambda size: _complete(None)),
    Boundary("LLM client", "request: big prompt", "prompt of é x 1 MB",
             lambda size: _complete(_reply("ok"), _fill("é", size))),
    Boundary("Classifier", "reply parsing", "1 MB of spaces, then route/confidence",
             _classifier),
    Boundary("Classifier", "reply parsing", "1 MB of line breaks, then route",
             lambda size: _classifier(size, "\n", "clarify")),
    Boundary("Template acknowledger", "complete(prompt)", "1 MB description + query",
             _template),
    Boundary("Template acknowledger", "complete(prompt)", "1 MB route name (é)",
             lambda size: _acknowledge("Helper: " + _fill("é", size))),
    Boundary("Policies", "DictRoutingPolicy.from_json", "~1 MB object (~28k entries)",
             lambda size: _sync(lambda: DictRoutingPolicy.from_json(_POLICY[size]))),
    Boundary("Policies", "DictRoutingPolicy.from_json", "[ x 1 MB (nested)",
             lambda size: _sync(lambda: DictRoutingPolicy.from_json("[" * size))),
    Boundary("Policies", "DictRoutingPolicy.from_json", "0xff x 1 MB",
             lambda size: _sync(lambda: DictRoutingPolicy.from_json(b"\xff" * size))),
    Boundary("Policies", "DictRoutingPolicy.from_json_file", "~1 MB file", _policy_file),
    Boundary("Policies", "DictRoutingPolicy.from_env", "~1 MB variable", _policy_env),
    Boundary("Runtime messages", "publish + coerce (3 messages)",
             "1 MB text: valid, lone surrogate, model_construct", _publish),
    Boundary("Router", "handle(): caller-seeded history", "200,000 exchanges (~1 MB)",
             _seeded_turn),
    Boundary("Router", "handle(): query to LexicalDecisions", "1 MB of words",
             _lexical_turn),
    Boundary("Router", "ParticipantSnapshot.from_json", "~1 MB history",
             _snapshot),
    Boundary("Contracts", "AgentTurn", "query of é x 1 MB",
             lambda size: _sync(lambda: AgentTurn("p", "t", _TEXT[size]))),
    Boundary("Contracts", "AgentExchange", "user + assistant, 1 MB",
             lambda size: _sync(lambda: AgentExchange(_TEXT[size // 2], _TEXT[size // 2]))),
    Boundary("Contracts", "RouteDecision", "1 MB rationale, 10k score keys",
             lambda size: _sync(lambda: RouteDecision(
                 "a", rationale=_TEXT[size], scores=_SCORES))),
]
REFERENCE = Boundary("LLM client (before the fix)", "old <think> regex", "<think> x 32 kB",
                     _old_regex)


def table(rows: list[Row]) -> Iterator[str]:
    yield "| area | boundary | input | longest loop block (ms) | wall (ms) | outcome |"
    yield "|---|---|---|---:|---:|---|"
    for row in rows:
        b = row.boundary
        yield (f"| {b.area} | {b.name} | {b.input} | {row.block_ms:.1f} | "
               f"{row.wall_ms:.1f} | {row.outcome} |")


async def main(size: int, repeats: int, reference: bool) -> list[Row]:
    global SERVER
    SERVER = _Server()
    try:
        rows: list[Row] = []
        for boundary in [*BOUNDARIES, *([REFERENCE] if reference else [])]:
            _ = (_POLICY[size], _TEXT[size], _TEXT[size // 2])  # built before timing
            runs = [await measure(boundary, size) for _ in range(repeats)]
            worst = max(runs, key=lambda row: row.block_ms)
            rows.append(Row(boundary, worst.block_ms,
                            sorted(r.wall_ms for r in runs)[len(runs) // 2], worst.outcome))
        return rows
    finally:
        SERVER.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1_000_000, help="input size in bytes")
    parser.add_argument("--repeats", type=int, default=3, help="runs per row (worst kept)")
    parser.add_argument("--reference", action="store_true",
                        help="also time the pre-fix <think> regex on 32 kB")
    args = parser.parse_args()
    logging.getLogger("turnrouter").setLevel(logging.ERROR)  # rejections are expected here
    results = asyncio.run(main(args.size, args.repeats, args.reference))
    print("\n".join(table(results)))
    over = [r for r in results if r.block_ms > TARGET_MS and r.boundary is not REFERENCE]
    print(f"\nworst block: {max(r.block_ms for r in results):.1f} ms; "
          f"rows over {TARGET_MS:.0f} ms: {len(over)}")
