"""A destination written the way README.md teaches, shared by the adapter tests."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio

from turnrouter import AgentTurn, Destination, DestinationResult


class Reply(Destination):
    """`started()`, then the answer printed (here: recorded) and returned as
    `DestinationResult(text=...)`: it says nothing through the adapter itself. Its first
    answer waits for `gate` when given; `outcome` records how each answer ended ("done",
    or the exception's class name)."""

    def __init__(self, reply: str, *, gate: anyio.Event | None = None) -> None:
        super().__init__("forecasts", name="weather")
        self.reply = reply
        self.gate = gate
        self.entered = anyio.Event()
        self.outcome: list[str] = []

    async def answer(self, turn: AgentTurn, *,
                     started: Callable[[], Awaitable[None]]) -> DestinationResult:
        gate, self.gate = self.gate, None
        self.entered.set()
        await started()
        try:
            if gate is not None:
                await gate.wait()
        except BaseException as exc:
            self.outcome.append(type(exc).__name__)
            raise
        self.outcome.append("done")
        return DestinationResult(text=self.reply)
