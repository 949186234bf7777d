"""A front end for the fleet: ask three questions, print everything said for each
(docs/distributed.md, "On one machine" and "Trust").

    python examples/nats_front.py nats://HOST:PORT

Credentials and TLS come from the environment variables `turnrouter worker` reads
(docs/distributed.md, "Trust"), so secrets stay off the command line:
TURNROUTER_NATS_USER with TURNROUTER_NATS_PASSWORD, TURNROUTER_NATS_TOKEN,
TURNROUTER_NATS_CREDS or TURNROUTER_NATS_NKEY, and TURNROUTER_NATS_TLS_CA,
TURNROUTER_NATS_TLS_CERT, TURNROUTER_NATS_TLS_KEY. Without a URL argument,
TURNROUTER_NATS_URL (or nats://127.0.0.1:4222) is used."""

from __future__ import annotations

import asyncio
import os
import sys

from turnrouter import ConfigurationError, LifecycleError
from turnrouter.runtime import UserQuery
from turnrouter.runtime.nats import NatsConfig, NatsFrontEnd

QUERIES = ["will it rain tomorrow?", "I need a refund for my invoice", "hi there"]

def _env(suffix: str) -> str | None:
    return os.environ.get(f"TURNROUTER_NATS_{suffix}") or None


def config_from_env(url: str) -> NatsConfig:
    """The front end's connection settings: `url`, and the credentials and TLS files of
    the environment (the variables `turnrouter worker` reads)."""
    return NatsConfig(url=url, user=_env("USER"), password=_env("PASSWORD"),
                      token=_env("TOKEN"), creds_file=_env("CREDS"),
                      nkey_seed_file=_env("NKEY"), tls_ca_file=_env("TLS_CA"),
                      tls_cert_file=_env("TLS_CERT"), tls_key_file=_env("TLS_KEY"))


async def listen(front: NatsFrontEnd, subscribed: asyncio.Event,
                 waiting: dict[str, asyncio.Future[None]]) -> None:
    """Print every output; a turn's final output resolves its future."""
    async for out in front.outputs(subscribed=subscribed):
        print(f"  [{out.route}] {out.text}" + ("" if out.final else "  (along the way)"))
        done = waiting.pop(out.request_id, None) if out.final else None
        if done is not None:
            done.set_result(None)


async def main(config: NatsConfig) -> None:
    front = await NatsFrontEnd.connect(config)
    subscribed = asyncio.Event()
    waiting: dict[str, asyncio.Future[None]] = {}
    listener = asyncio.create_task(listen(front, subscribed, waiting))
    try:
        # Publish once the output subscription exists; a listener that failed (the
        # server refused its consumer, say) raises its error here instead of a hang.
        ready = asyncio.ensure_future(subscribed.wait())
        await asyncio.wait((ready, listener), return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        if listener.done():
            listener.result()
        for text in QUERIES:
            # message_id (a fresh one unless given) is the turn id outputs carry back
            # as request_id; participant_id keeps one caller's turns in order.
            query = UserQuery(participant_id="alice", text=text)
            ended = waiting[query.message_id] = asyncio.get_running_loop().create_future()
            print(f"> {text}")
            await front.publish(query)
            try:
                await asyncio.wait_for(ended, timeout=10)
            except TimeoutError:
                raise LifecycleError(
                    "no answer within 10 s: is a `turnrouter worker` serving this server "
                    "(with the same --prefix)?") from None
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        await front.close()


if __name__ == "__main__":
    url = (sys.argv[1] if len(sys.argv) > 1
           else os.environ.get("TURNROUTER_NATS_URL") or "nats://127.0.0.1:4222")
    try:
        asyncio.run(main(config_from_env(url)))
    except (ConfigurationError, LifecycleError) as exc:
        # One line, secrets masked (NatsConfig's errors never show a password or token).
        sys.exit(f"nats_front: {exc}")
