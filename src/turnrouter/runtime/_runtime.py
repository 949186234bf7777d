"""An in-process publish/subscribe runtime: topics, typed payloads, owned background tasks."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Coroutine
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import anyio
from anyio.abc import TaskGroup
from pydantic import BaseModel, ValidationError

from .._exceptions import ConfigurationError, ContractTypeError, LifecycleError

__all__ = ["AgentRuntime", "RuntimeAgent", "Topic"]

logger = logging.getLogger("turnrouter.runtime")

M = TypeVar("M", bound=BaseModel)


class Topic(Generic[M]):
    """A named channel carrying one exact payload class."""

    __slots__ = ("name", "payload")

    def __init__(self, name: str, payload: type[M]) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"Topic name must be a non-empty str, got {name!r}")
        if not (isinstance(payload, type) and issubclass(payload, BaseModel)):
            raise ContractTypeError(f"Topic {name!r} payload must be a pydantic model class")
        self.name = name
        self.payload: type[M] = payload

    def __repr__(self) -> str:
        return f"Topic({self.name!r}, {self.payload.__name__})"

    def coerce(self, message: object) -> M:
        """The message as this topic's payload, validated; raises ValueError/TypeError."""
        if type(message) is self.payload:
            return message
        if isinstance(message, dict):
            try:
                return self.payload.model_validate(message)
            except ValidationError as exc:
                raise ValueError(f"malformed {self.payload.__name__}: {exc}") from exc
        raise TypeError(
            f"topic {self.name!r} carries {self.payload.__name__}, got {type(message).__name__}"
        )


@runtime_checkable
class RuntimeAgent(Protocol):
    """A subscriber registered with the runtime."""

    @property
    def subscriptions(self) -> tuple[Topic[Any], ...]:
        """The topics this agent receives."""
        ...

    async def deliver(self, topic: Topic[Any], message: Any, runtime: AgentRuntime) -> None:
        """Handle one message; long work goes to `runtime.start_soon`."""
        ...


class AgentRuntime:
    """Delivers published messages to subscribers, in process, in publication order.

    Use as `async with AgentRuntime() as runtime:`; background work that subscribers
    start with `start_soon` is owned by the runtime's task group and drained on exit.
    """

    def __init__(self) -> None:
        self._subscribers: dict[str, list[tuple[Topic[Any], RuntimeAgent]]] = {}
        self._tg: TaskGroup | None = None
        self._outputs: list[Callable[[Topic[Any], Any], Awaitable[None]]] = []

    def register(self, agent: RuntimeAgent) -> None:
        """Subscribe `agent` to its topics."""
        for topic in agent.subscriptions:
            self._subscribers.setdefault(topic.name, []).append((topic, agent))

    def subscribe(self, topic: Topic[M], callback: Callable[[M], Awaitable[None]]) -> None:
        """Subscribe a plain callback (useful for output sinks and tests)."""

        class _Callback:
            subscriptions = (topic,)

            async def deliver(self, t: Topic[Any], message: Any, runtime: AgentRuntime) -> None:
                await callback(message)

        self.register(_Callback())

    async def __aenter__(self) -> AgentRuntime:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._tg is not None
        tg, self._tg = self._tg, None
        return await tg.__aexit__(exc_type, exc, tb)

    def cancel(self) -> None:
        """Cancel all background work (used on shutdown after the router stopped)."""
        if self._tg is not None:
            self._tg.cancel_scope.cancel()

    def start_soon(
        self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any, name: str = ""
    ) -> None:
        """Run background work owned by the runtime."""
        if self._tg is None:
            raise LifecycleError("AgentRuntime is not running: use `async with AgentRuntime()`")
        self._tg.start_soon(fn, *args, name=name or None)

    async def publish(self, topic: Topic[M], message: M | dict[str, Any]) -> None:
        """Deliver `message` to every subscriber of `topic`'s name.

        Like a networked transport, the runtime does not judge payloads: each subscriber
        validates what it receives against its own topic (see `Topic.coerce`), so one
        malformed message is rejected where it lands and never crashes the publisher.
        """
        for subscribed, agent in self._subscribers.get(topic.name, ()):
            await agent.deliver(subscribed, message, self)
