"""How soon `NatsFrontEnd.outputs()` reads again after a reconnect that strands its
consumer request (issue #30: outputs resume within 2 s of the server's return).

A front end reads through a proxy; a reset makes it reconnect and recreate its output
consumer; the stream-info request of that recreation is held at the proxy, and a second
reset strands it on the dead connection (as when pings notice a frozen server while the
reader asks). The figure is the time from publishing an output after that to the
reader yielding it. Run it on two trees to compare (each tree's `src` on PYTHONPATH):

    PYTHONPATH=src .venv/bin/python benchmarks/bench_reader_resume.py
    PYTHONPATH=base/src .venv/bin/python benchmarks/bench_reader_resume.py
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.nats.conftest import NatsServer
from tests.nats.proxy import proxied

import nats
from turnrouter.runtime import ResponseOutput
from turnrouter.runtime.nats import NatsConfig, NatsFrontEnd, encode_token


async def once(server: NatsServer) -> float:
    config = NatsConfig(url=server.url)
    direct = await nats.connect(server.url)
    maker = await NatsFrontEnd.connect(config)  # creates the deployment
    try:
        async with proxied(server.port) as proxy:
            front = await NatsFrontEnd.connect(NatsConfig(url=proxy.url))
            got: asyncio.Queue[ResponseOutput] = asyncio.Queue()

            async def read() -> None:
                async for output in front.outputs():
                    await got.put(output)

            reader = asyncio.create_task(read())
            try:
                await asyncio.sleep(0.5)  # the reader's first consumer is made
                hold = proxy.hold(lambda subject, _: subject.startswith("$JS.API.STREAM.INFO"))
                proxy.reset()
                await asyncio.wait_for(hold.event.wait(), 10)  # the recreation's request
                proxy.reset()
                hold.release()  # on a dead connection: dropped
                start = time.monotonic()
                output = ResponseOutput(participant_id="p", request_id="r", route="x",
                                        text="t", final=True)
                await direct.jetstream().publish(f"{config.prefix}.out.{encode_token('p')}",
                                                 output.model_dump_json().encode())
                await asyncio.wait_for(got.get(), 10)
                return time.monotonic() - start
            finally:
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
                await front.close()
    finally:
        await maker.close()
        await direct.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    seconds = []
    for _ in range(args.rounds):
        server = NatsServer()
        try:
            seconds.append(await once(server))
        finally:
            server.close()
    print(f"reader resumed after (s): {' '.join(f'{s:.2f}' for s in seconds)}; "
          f"median {statistics.median(seconds):.2f}")


if __name__ == "__main__":
    asyncio.run(main())
