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


def test_each_wait_ends_at_its_own_bound_with_one_timer() -> None:
    """A wait ends with None after its own bound, whatever waits came before: a short
    wait after a long one is not held to the long one's timer, and a long wait after a
    short one is not cut short by the short one's (the mailbox keeps one timer, armed
    again when it fires before the current wait's end)."""

    async def main() -> list[str | None]:
        box: Mailbox[str] = Mailbox()
        got: list[str | None] = []
        box.put("first")
        got.append(await box.get(60))  # an item at once: the wait never began
        reader = asyncio.create_task(box.get(60))
        await asyncio.sleep(0)
        box.put("second")  # a long wait ended by an item: its timer stays armed
        got.append(await reader)
        # A short wait after it: ends by its own bound (the hang guard is far longer).
        got.append(await asyncio.wait_for(box.get(0.01), 30))
        # A long wait after a short one: the short one's timer fires first and must not
        # end it; the item put after that time is what it returns.
        reader = asyncio.create_task(box.get(0.01))
        await asyncio.sleep(0)
        box.put("third")  # ends the short wait before its bound: its timer stays armed
        got.append(await reader)
        reader = asyncio.create_task(box.get(60))
        await asyncio.sleep(0.05)  # past the 0.01 s timer armed just before
        assert not reader.done()
        box.put("fourth")
        got.append(await asyncio.wait_for(reader, 30))
        box.wake()  # no reader: nothing to end
        reader = asyncio.create_task(box.get(60))
        await asyncio.sleep(0)
        box.wake()
        got.append(await asyncio.wait_for(reader, 30))
        return got

    assert asyncio.run(main()) == ["first", "second", None, "third", "fourth", None]
