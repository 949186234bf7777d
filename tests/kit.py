"""Builders shared by the router tests (not a test module)."""

from __future__ import annotations

import contextlib
import io
import socket
import threading
from collections.abc import Sequence
from typing import Any

import anyio

from turnrouter import AgentRouter, AgentTurn, DecisionService, DestinationResult
from turnrouter.cli import main as cli_main
from turnrouter.llm import LLMError, OpenAIChatClient
from turnrouter.runtime import AgentRuntime, ResponseOutput, Topic
from turnrouter.testing import OutputRecorder, RecordingObserver, ScriptedAgent, ScriptedDecisions


def run_cli(argv: Sequence[str]) -> tuple[int, str, str]:
    """`turnrouter ARGV...` in this process, as the console script runs it: its exit
    status, standard output and standard error."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(list(argv))
    return code, out.getvalue(), err.getvalue()


class Harness:
    """A router over scripted agents, with its output recorder and observer."""

    def __init__(self, *agents: ScriptedAgent, decisions: DecisionService | None = None,
                 default: str = "conversation", **kwargs: Any) -> None:
        names = [agent.name for agent in agents]
        if default not in names:
            agents = (*agents, ScriptedAgent(default))
        self.agents = {agent.name: agent for agent in agents}
        self.service = decisions or ScriptedDecisions(agents[0].name)
        self.output = OutputRecorder()
        self.observer = RecordingObserver()
        kwargs.setdefault("telemetry", self.observer)
        # No admission control unless a test asks for it (tests/test_overload.py): its
        # lag sampler would shed turns of a test when the machine running it is loaded.
        kwargs.setdefault("overload", None)
        self.router = AgentRouter(self.agents, self.service, output=self.output,
                                  default_destination=default, **kwargs)
        self.outcomes: dict[str, DestinationResult | BaseException] = {}
        self._count = 0

    def __getitem__(self, name: str) -> ScriptedAgent:
        return self.agents[name]

    @property
    def decisions(self) -> ScriptedDecisions:
        """The scripted decision service (the tests that read its requests use one)."""
        assert isinstance(self.service, ScriptedDecisions)
        return self.service

    def turn(self, query: str = "hello", participant: str = "p1", **kwargs: Any) -> AgentTurn:
        self._count += 1
        return AgentTurn(participant, f"t{self._count}", query, **kwargs)

    async def say(self, query: str = "hello", participant: str = "p1",
                  **kwargs: Any) -> DestinationResult:
        return await self.router.handle(self.turn(query, participant, **kwargs))

    async def capture(self, turn: AgentTurn) -> None:
        """Run a turn and keep its result or exception (for use in task groups)."""
        try:
            self.outcomes[turn.turn_id] = await self.router.handle(turn)
        except Exception as exc:  # TurnInterrupted is a TurnrouterError too
            self.outcomes[turn.turn_id] = exc


async def publish_and_drain(router: AgentRouter, output: Topic[ResponseOutput],
                            *messages: tuple[Topic[Any], Any]) -> list[ResponseOutput]:
    """Publish `messages` to `router` through an in-process runtime, wait until every
    runtime task finished, and return what the router published on `output`."""
    outputs: list[ResponseOutput] = []

    async def collect(message: ResponseOutput) -> None:
        outputs.append(message)

    async with AgentRuntime() as runtime:
        runtime.register(router.runtime_subscriber())
        runtime.subscribe(output, collect)
        for topic, message in messages:
            await runtime.publish(topic, message)
    return outputs


def completion(client: OpenAIChatClient, prompt: str) -> str | LLMError:
    """One completion's text, or the LLMError it raised (bounded at 60 s)."""

    async def main() -> str | LLMError:
        with anyio.fail_after(60):
            try:
                return await client.complete(prompt, max_tokens=8)
            except LLMError as exc:
                return exc

    return anyio.run(main)


class LocalTcpServer:
    """A local TCP server on a free port that hands each connection to `handle` in a
    thread of its own; `close()` stops it and joins its threads (bounded)."""

    def __init__(self) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.05)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._serve, daemon=True)]
        self._threads[0].start()

    @property
    def url(self) -> str:
        """http://127.0.0.1:PORT"""
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def handle(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            thread = threading.Thread(target=self._handled, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _handled(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # the client went away
            self.handle(conn)

    def close(self) -> None:
        """Stop serving and wait for the threads (bounded)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(10)
        self._sock.close()


class RawReplyServer(LocalTcpServer):
    """A local TCP server that answers every request with the raw bytes in `reply` (any
    framing: broken status lines, truncated chunks, header floods), then closes."""

    def __init__(self) -> None:
        self.reply = b""
        super().__init__()

    def handle(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        head = b""
        while b"\r\n\r\n" not in head and len(head) < 1 << 20:
            data = conn.recv(65536)
            if not data:
                break
            head += data
        conn.sendall(self.reply)
        conn.shutdown(socket.SHUT_RDWR)


#: Raw HTTP replies whose framing is broken or hostile, with a JSON body `{}` where any.
BROKEN_HTTP_REPLIES = [
    b"",
    b"garbage\r\n\r\n",
    b"HTTP/1.1 999999999999 OK\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\nContent-Length: " + b"9" * 400 + b"\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab",
    b"HTTP/1.1 500 Oops\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffffff\r\nab",
    b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 200 + b"\r\n{}",
    b"HTTP/1.1 200 OK\r\nX: " + b"y" * 70_000 + b"\r\n\r\n{}",
    b"HTTP/1.1 302 Found\r\nLocation: file:///etc/passwd\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 401 No\r\nContent-Length: 5\r\n\r\n\xff\xfe\x00ab",
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n" + b"\x00" * 100,
]
