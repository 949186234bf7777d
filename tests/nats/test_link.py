"""The worker's requests (`_link.Link.request`): each ends with its reply, or with
`RequestFailed` once its own `wait` passed, with one timer for them all."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from turnrouter.runtime.nats._link import Link, RequestFailed


class _Client:
    """What `Link` uses of a connection: publishes are recorded, never answered."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def new_inbox(self) -> str:
        return "_INBOX.test"

    async def subscribe(self, subject: str, cb: Any) -> None:
        return None

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
        await link._on_reply(_Reply(client.sent[1], b"answer"))  # type: ignore[arg-type]
        assert await asyncio.wait_for(long, 30) == b"answer"
        # A short request answered at once leaves the timer armed for its end; a long
        # one after it is not cut short when that timer fires.
        short = asyncio.create_task(link.request("d", b"", wait=0.01))
        await asyncio.sleep(0)
        await link._on_reply(_Reply(client.sent[-1], b"quick"))  # type: ignore[arg-type]
        assert await short == b"quick"
        long = asyncio.create_task(link.request("e", b"", wait=60))
        await asyncio.sleep(0.05)  # past the short request's end
        assert not long.done()
        await link._on_reply(_Reply(client.sent[-1], b"late"))  # type: ignore[arg-type]
        assert await asyncio.wait_for(long, 30) == b"late"
        # Many at once, none answered: each fails, none is left waiting.
        many = [asyncio.create_task(link.request(f"m{k}", b"", wait=0.01 * (k % 3 + 1)))
                for k in range(20)]
        done = await asyncio.wait_for(asyncio.gather(*many, return_exceptions=True), 30)
        assert all(isinstance(result, RequestFailed) for result in done)
        assert not link._waiting

    asyncio.run(main())
