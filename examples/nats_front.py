"""A front end for the fleet: ask three questions, print everything said for each
(docs/distributed.md, "On one machine"). `python examples/nats_front.py nats://HOST:PORT`"""

from __future__ import annotations

import asyncio
import sys

from turnrouter.runtime import UserQuery
from turnrouter.runtime.nats import NatsConfig, NatsFrontEnd

QUERIES = ["will it rain tomorrow?", "I need a refund for my invoice", "hi there"]


async def listen(front: NatsFrontEnd, subscribed: asyncio.Event,
                 waiting: dict[str, asyncio.Future[None]]) -> None:
    """Print every output; a turn's final output resolves its future."""
    async for out in front.outputs(subscribed=subscribed):
        print(f"  [{out.route}] {out.text}" + ("" if out.final else "  (along the way)"))
        done = waiting.pop(out.request_id, None) if out.final else None
        if done is not None:
            done.set_result(None)


async def main(url: str) -> None:
    front = await NatsFrontEnd.connect(NatsConfig(url=url))
    subscribed = asyncio.Event()
    waiting: dict[str, asyncio.Future[None]] = {}
    listener = asyncio.create_task(listen(front, subscribed, waiting))
    try:
        await subscribed.wait()  # publish once the output subscription exists
        for text in QUERIES:
            # message_id (a fresh one unless given) is the turn id outputs carry back
            # as request_id; participant_id keeps one caller's turns in order.
            query = UserQuery(participant_id="alice", text=text)
            ended = waiting[query.message_id] = asyncio.get_running_loop().create_future()
            print(f"> {text}")
            await front.publish(query)
            await asyncio.wait_for(ended, timeout=10)
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        await front.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "nats://127.0.0.1:4222"))
