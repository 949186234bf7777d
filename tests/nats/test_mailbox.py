"""The mailbox between a subscription's callback and its reader (`_mailbox.Mailbox`):
order, and idle heartbeats that a reader who stopped reading holds one of."""

from __future__ import annotations

import asyncio

from hypothesis import given
from hypothesis import strategies as st

from turnrouter.runtime.nats._mailbox import Mailbox


def beat(item: str) -> bool:
    return item.startswith("beat")


def collapsed(items: list[str]) -> list[str]:
    """`items` with each run of heartbeats in a row kept as its last one."""
    kept: list[str] = []
    for item in items:
        if kept and beat(item) and beat(kept[-1]):
            kept[-1] = item
        else:
            kept.append(item)
    return kept


@given(st.lists(st.sampled_from(["data", "beat"]), max_size=200))
def test_a_reader_that_stopped_holds_one_heartbeat_per_run(kinds: list[str]) -> None:
    """Whatever arrives while nobody reads, data in order, each once, and each run of
    heartbeats as its latest: an abandoned reader's mailbox grows with what it must
    read (bounded by flow control), not by two heartbeats a second for ever."""
    items = [f"{kind}{k}" for k, kind in enumerate(kinds)]

    async def main() -> list[str]:
        box: Mailbox[str] = Mailbox()
        for item in items:
            if beat(item):
                box.put_latest(item, beat)
            else:
                box.put(item)
        got: list[str] = []
        while (next_item := await box.get(0)) is not None:
            got.append(next_item)
        return got

    assert asyncio.run(main()) == collapsed(items)
