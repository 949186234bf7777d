"""A TCP proxy between NATS clients and a real nats-server that holds back, on request,
the messages clients publish that match a rule: the server gets them late, as over a
congested network, while everything else flows both ways. A test keeps one request of a
worker unanswered this way (a claim's read of a record, say) while the server does
something else (moves a partition's pin), with no access to the worker's internals."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Callable

__all__ = ["Hold", "Match", "NatsProxy", "proxied", "reads_of"]

#: Whether a publish (subject, payload without headers) is to be held.
Match = Callable[[str, bytes], bool]


def reads_of(subject: str) -> Match:
    """A rule matching the JetStream API requests that read the message of `subject` (a
    participant's record, `$KV.<bucket>.<key>`): a direct get names it in its own
    subject, a stream message get in its payload."""
    return lambda api, payload: api.startswith("$JS.API.") and (
        api.endswith(subject) or subject.encode() in payload)


class Hold:
    """The publishes matching `match` that clients sent since the hold began, kept back
    from the server until `release()`. `event` is set at the first one."""

    def __init__(self, match: Match) -> None:
        self.match = match
        self.active = True
        self.event = asyncio.Event()
        self.held: list[tuple[asyncio.StreamWriter, bytes]] = []
        self._more = asyncio.Event()

    def add(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        self.held.append((writer, data))
        self.event.set()
        self._more.set()

    async def holding(self, count: int) -> None:
        """Return once `count` publishes are held (the caller bounds the wait)."""
        while len(self.held) < count:
            self._more.clear()
            await self._more.wait()

    def drop(self, count: int) -> None:
        """Forget the first `count` publishes held: the server never gets them, as
        when they were lost with a connection."""
        del self.held[:count]

    def release(self) -> int:
        """Send what was held to the server, in order, and hold nothing more; how many
        publishes were held (those of a connection closed meanwhile are dropped)."""
        self.active = False
        for writer, data in self.held:
            if not writer.is_closing():
                writer.write(data)
        count, self.held = len(self.held), []
        return count


class NatsProxy:
    """Listens on a free local port (`url`) and forwards each connection to the server
    on `port`; the client's PUB and HPUB commands are read whole and checked against the
    active holds (SUB, PING and the rest always pass)."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._holds: list[Hold] = []
        self._renames: list[tuple[Hold, bytes]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._clients: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self.url = ""
        #: While set, a new connection is reset at once (a server that is down).
        self.refusing = False
        #: Every byte clients sent through the proxy (what a wiretap would see).
        self.uplink = bytearray()
        #: How many client connections the proxy accepted.
        self.accepted = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.url = f"nats://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def rename(self, match: Match, subject: str) -> Hold:
        """Send every publish matching `match` to `subject` instead, from now until its
        `active` is set False (a request to a subject nobody serves is answered 503 by
        the server, as a consumer without a leader answers)."""
        renaming = Hold(match)
        self._renames.append((renaming, subject.encode()))
        return renaming

    def hold(self, match: Match) -> Hold:
        """Hold back every publish matching `match` from now until its `release()`."""
        hold = Hold(match)
        self._holds.append(hold)
        return hold

    def reset(self) -> int:
        """Reset every client connection (TCP RST, as when a server crashes or a
        middlebox drops the flow): the client reads ECONNRESET. How many were reset."""
        clients = [w for w in self._writers if w in self._clients]
        for writer in clients:
            _abort(writer)
        return len(clients)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, client_reader: asyncio.StreamReader,
                      client_writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self.refusing:
            _abort(client_writer)
            return
        self._writers.add(client_writer)
        self._clients.add(client_writer)
        try:
            server_reader, server_writer = await asyncio.open_connection(
                "127.0.0.1", self._port)
        except OSError:
            client_writer.close()
            return
        self._writers.add(server_writer)
        pumps = [asyncio.create_task(self._downlink(server_reader, client_writer)),
                 asyncio.create_task(self._uplink(client_reader, server_writer))]
        self._tasks.update(pumps)
        try:
            # Either side closing ends both.
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            self._tasks.difference_update(pumps)
            for writer in (client_writer, server_writer):
                writer.close()
                self._writers.discard(writer)
                self._clients.discard(writer)

    async def _downlink(self, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()

    async def _uplink(self, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                line = await reader.readuntil(b"\r\n")
                parts = line.split()
                op = parts[0].upper() if parts else b""
                data, subject, payload = line, "", b""
                if op in (b"PUB", b"HPUB"):
                    size = int(parts[-1])
                    body = await reader.readexactly(size + 2)
                    data += body
                    subject = parts[1].decode("utf-8", "replace")
                    payload = body[int(parts[-2]) if op == b"HPUB" else 0:size]
                if op in (b"PUB", b"HPUB"):
                    renamed = next((to for r, to in self._renames
                                    if r.active and r.match(subject, payload)), None)
                    if renamed is not None:
                        head, _, rest = line.partition(b" ")
                        data = b" ".join((head, renamed, rest.split(b" ", 1)[1])) + (
                            data[len(line):])
                self.uplink += data
                hold = None
                if op in (b"PUB", b"HPUB"):
                    hold = next((h for h in self._holds
                                 if h.active and h.match(subject, payload)), None)
                if hold is None:
                    writer.write(data)
                    await writer.drain()
                else:
                    hold.add(writer, data)


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST rather than a FIN (SO_LINGER 0)."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@contextlib.asynccontextmanager
async def proxied(port: int) -> AsyncIterator[NatsProxy]:
    """A started `NatsProxy` to the server on `port`, closed on exit."""
    proxy = NatsProxy(port)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()
