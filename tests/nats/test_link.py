"""The worker's requests (`_link.Link.request`): each ends with its reply, or with
`RequestFailed` once its own `wait` passed, with one timer for them all."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import pytest

import nats
from turnrouter.runtime.nats._link import Link, RequestFailed, deliver_directly


class _Client:
    """What `Link` uses of a connection: publishes are recorded, never answered."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.reply: Any = None  # the callback the link subscribed its replies with

    def new_inbox(self) -> str:
        return "_INBOX.test"

    async def subscribe(self, subject: str, cb: Any) -> None:
        self.reply = cb

    async def publish(self, subject: str, payload: bytes, reply: str = "",
                      headers: dict[str, str] | None = None) -> None:
        self.sent.append(reply)


class _Reply:
    def __init__(self, subject: str, data: bytes) -> None:
        self.subject, self.data, self.headers = subject, data, None


def test_each_request_ends_by_its_own_wait_or_its_reply() -> None:
    async def main() -> None:
        client = _Client()
        link = Link(client, lambda: None)  # type: ignore[arg-type]
        await link.start()
        # Unanswered: ends once its wait passed (the hang guard is far longer).
        with pytest.raises(RequestFailed):
            await asyncio.wait_for(link.request("a", b"", wait=0.01), 30)
        # A long request, then a shorter one behind it: the shorter ends first, by its
        # own bound, while the long one still waits for its reply.
        long = asyncio.create_task(link.request("b", b"", wait=60))
        await asyncio.sleep(0)
        with pytest.raises(RequestFailed):
            await asyncio.wait_for(link.request("c", b"", wait=0.01), 30)
        assert not long.done()
        await client.reply(_Reply(client.sent[1], b"answer"))
        assert await asyncio.wait_for(long, 30) == b"answer"
        # A short request answered at once leaves the timer armed for its end; a long
        # one after it is not cut short when that timer fires.
        short = asyncio.create_task(link.request("d", b"", wait=0.01))
        await asyncio.sleep(0)
        await client.reply(_Reply(client.sent[-1], b"quick"))
        assert await short == b"quick"
        long = asyncio.create_task(link.request("e", b"", wait=60))
        await asyncio.sleep(0)
        late = client.sent[-1]
        with pytest.raises(RequestFailed):  # ends after the short one's end: the timer
            await asyncio.wait_for(link.request("f", b"", wait=0.02), 30)  # fired by then
        assert not long.done()
        await client.reply(_Reply(late, b"late"))
        assert await asyncio.wait_for(long, 30) == b"late"
        # Many at once, none answered: each fails, none is left waiting.
        many = [asyncio.create_task(link.request(f"m{k}", b"", wait=0.01 * (k % 3 + 1)))
                for k in range(20)]
        done = await asyncio.wait_for(asyncio.gather(*many, return_exceptions=True), 30)
        assert all(isinstance(result, RequestFailed) for result in done)
        assert link.waiting == 0

    asyncio.run(main())


async def _direct_delivery(url: str) -> None:
    nc = await nats.connect(url)
    try:
        got: list[bytes] = []
        all_in = asyncio.Event()

        def take(msg: Any) -> None:
            got.append(msg.data)
            if len(got) == 300:
                all_in.set()

        def fail(msg: Any) -> None:
            raise ZeroDivisionError

        queued: list[bytes] = []

        async def callback(msg: Any) -> None:  # what nats-py would call instead
            queued.append(msg.data)

        sub = await nc.subscribe("direct.x", cb=callback)
        assert deliver_directly(sub, take)
        failing = await nc.subscribe("direct.y", cb=callback)
        assert deliver_directly(failing, fail)
        for k in range(300):
            await nc.publish("direct.y", b"boom")  # a failing handler: logged, no harm
            await nc.publish("direct.x", str(k).encode())
        await nc.flush()
        await asyncio.wait_for(all_in.wait(), 30)
        assert got == [str(k).encode() for k in range(300)]  # each once, in order
        assert not queued and sub.pending_msgs == 0 and sub.pending_bytes == 0
        await sub.unsubscribe()
        await nc.publish("direct.x", b"after")
        await nc.flush()
        assert got[-1] == b"299"
        # Something already queued: left to nats-py's own task (nothing lost).
        later = await nc.subscribe("direct.z", cb=callback)
        later._pending_queue.put_nowait(type("M", (), {"data": b"q"})())
        assert not deliver_directly(later, take)
    finally:
        await nc.drain()


def test_unacknowledged_stored_publishes_are_forgotten_a_mark_later() -> None:
    """The callbacks of stored publishes the server never acknowledges (dropped for
    the user's permissions) are dropped by `forget_before`, the oldest first, so they
    stay bounded while their owners publish again; later ones still confirm."""
    async def main() -> None:
        client = _Client()
        link = Link(client, lambda: None)  # type: ignore[arg-type]
        await link.start()
        confirmed: list[int] = []
        for n in range(3):
            await link.publish_stored("out", b"", {},
                                      confirmed=functools.partial(confirmed.append, n))
        mark = link.mark()
        for n in range(3, 5):
            await link.publish_stored("out", b"", {},
                                      confirmed=functools.partial(confirmed.append, n))
        assert link.forget_before(mark) == 3
        assert link.forget_before(mark) == 0
        ack = b'{"stream":"OUT","seq":1}'
        for reply in client.sent:
            await client.reply(_Reply(reply, ack))
        assert confirmed == [3, 4]
        assert link.forget_before(link.mark()) == 0

    asyncio.run(main())


def test_direct_delivery_hands_each_message_over_in_order(nats_server: Any) -> None:
    """`deliver_directly`: nats-py hands the subscription's messages to a plain function
    as it reads them, in order, each once; a failing handler costs only its message; an
    unsubscribed or drained subscription ends as before."""
    asyncio.run(_direct_delivery(nats_server.url))
