"""An in-process publish/subscribe runtime: topics, typed payloads, owned background tasks."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel, ValidationError

from .._exceptions import (
    ConfigurationError,
    ContractTypeError,
    ContractValueError,
    LifecycleError,
)
from .._redact import preview
from ._messages import VALIDATED

__all__ = ["AgentRuntime", "RuntimeAgent", "Topic"]

logger = logging.getLogger("turnrouter.runtime")

M = TypeVar("M", bound=BaseModel)


class Topic(Generic[M]):
    """A named channel carrying one exact payload class.

    Args:
        name: The topic's non-empty name.
        payload: The pydantic model class its messages are validated as.
    """

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
        """The message as this topic's payload, validated; raises ValueError/TypeError.

        A dict is validated; an instance of the payload class is validated again from
        its fields, because `model_construct()` and `model_copy(update=...)` build
        instances that skipped validation. The error names fields and problems, never
        the values (they may hold user text).
        """
        payload = self.payload
        if type(message) is payload:
            if message in VALIDATED:
                return message
            fields: object = dict(message.__dict__)
        elif isinstance(message, dict):
            fields = message
            known = payload.model_fields
            if len(message) > len(known) or not message.keys() <= known.keys():
                _refuse_unknown(payload.__name__, message, known)
        else:
            raise TypeError(
                f"topic {self.name!r} carries {payload.__name__}, got {type(message).__name__}"
            )
        try:
            valid = payload.model_validate(fields)
        except ValidationError as exc:
            raise ValueError(f"malformed {payload.__name__}: {describe(exc)}") from None
        except RecursionError:
            raise ValueError(f"malformed {payload.__name__}: nested too deeply") from None
        VALIDATED.add(valid)
        return valid


def _refuse_unknown(name: str, message: dict[Any, Any], known: dict[str, Any],
                    limit: int = 5) -> None:
    """ValueError naming the first `limit` unknown keys of `message` (none when all
    are known), found before pydantic lists an error for every one of them: a 1 MB dict
    of 90,000 unknown keys took 200-400 ms to refuse, past the loop's 100 ms bound
    (bounds17 M4). Keys are shown bounded, never values."""
    unknown = [key for key in message if key not in known]
    if not unknown:
        return
    shown = "; ".join(f"{str(key)[:80] or '(empty)'}: Extra inputs are not permitted"
                      for key in unknown[:limit])
    more = f" (+{len(unknown) - limit} more)" if len(unknown) > limit else ""
    raise ValueError(f"malformed {name}: {shown}{more}")


def describe(exc: ValidationError, limit: int = 5) -> str:
    """A pydantic validation error as `field: problem` pairs, without the input values."""
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    shown = [
        f"{'.'.join(str(part) for part in error['loc'])[:80] or '(message)'}: {error['msg']}"
        for error in errors[:limit]
    ]
    more = f" (+{len(errors) - limit} more)" if len(errors) > limit else ""
    return "; ".join(shown) + more


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


#: Publications between two scheduling points of `AgentRuntime.publish` by default.
PUBLISH_BATCH = 64


class AgentRuntime:
    """Delivers published messages to subscribers, in process, in publication order.

    Use as `async with AgentRuntime() as runtime:`; background work that subscribers
    start with `start_soon` is owned by the runtime and drained on exit, with a task
    group's rules: a background failure cancels the rest and is raised (in an
    `ExceptionGroup`) on exit, an error in the body cancels the background work, and a
    cancelled exit still waits for it. Tasks are plain asyncio tasks (an anyio task
    group's `start_soon` costs several times more, and runs once per query).

    Every `publish_batch`-th publication is a scheduling point: the publisher yields to
    the event loop before delivering it, so a burst of messages lets the work it
    started run (and the loop's I/O with it) instead of piling up unstarted tasks.

    Args:
        publish_batch: Publications between two scheduling points (default 64).
    """

    def __init__(self, *, publish_batch: int = PUBLISH_BATCH) -> None:
        if (not isinstance(publish_batch, int) or isinstance(publish_batch, bool)
                or publish_batch < 1):
            raise ConfigurationError(
                f"publish_batch must be an int of at least 1, got {preview(publish_batch)}")
        self._batch = publish_batch
        self._unyielded = 0
        self._subscribers: dict[str, list[tuple[Topic[Any], RuntimeAgent]]] = {}
        self._tasks: set[asyncio.Future[Any]] | None = None
        self._cancelled: weakref.WeakSet[asyncio.Future[Any]] = weakref.WeakSet()
        self._errors: list[BaseException] = []
        self._outputs: list[Callable[[Topic[Any], Any], Awaitable[None]]] = []
        self._rejected = 0
        # Done callbacks made once: per task, neither a bound method nor a copied context.
        self._on_done = self._finished
        self._done_context = contextvars.Context()

    def register(self, agent: RuntimeAgent) -> None:
        """Subscribe `agent` to its topics (once: `ValueError` for an agent, or a router's
        subscriber, registered here already, whose messages would be handled twice)."""
        identity = getattr(agent, "_registers_as", agent)
        if any(getattr(other, "_registers_as", other) is identity
               for subscribed in self._subscribers.values() for _, other in subscribed):
            what, once = (("a subscriber of this router", "runtime_subscriber()")
                          if identity is not agent else ("this agent", "each agent"))
            raise ValueError(
                f"AgentRuntime.register: {what} is registered already: every message "
                f"would be handled twice (a query's destination run twice); register "
                f"{once} once")
        for topic in agent.subscriptions:
            self._subscribers.setdefault(topic.name, []).append((topic, agent))

    @property
    def rejected_messages(self) -> int:
        """Messages that plain `subscribe()` callbacks never saw: invalid for their topic
        (each also logged at WARNING)."""
        return self._rejected

    def subscribe(self, topic: Topic[M], callback: Callable[[M], Awaitable[None]]) -> None:
        """Subscribe a plain callback (useful for output sinks and tests).

        The callback receives only valid payloads of `topic` (see `Topic.coerce`); other
        messages are logged, counted in `rejected_messages` and dropped.
        """

        class _Callback:
            subscriptions = (topic,)

            async def deliver(self, t: Topic[Any], message: Any, runtime: AgentRuntime) -> None:
                try:
                    payload = t.coerce(message)
                except (TypeError, ValueError) as exc:
                    runtime._rejected += 1
                    logger.warning("turnrouter: a subscriber callback of topic %r rejected a "
                                   "message: %s", t.name, exc)
                    return
                await callback(payload)

        self.register(_Callback())

    async def __aenter__(self) -> AgentRuntime:
        if self._tasks is not None:
            raise LifecycleError("AgentRuntime is already running")
        self._tasks, self._errors = set(), []
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        tasks = self._tasks
        assert tasks is not None
        if exc is not None:
            self.cancel()
        cancelled: BaseException | None = None
        while tasks:
            try:
                await asyncio.wait(set(tasks))
            except asyncio.CancelledError as error:  # the exit itself was cancelled
                cancelled = error
                self.cancel()
        self._tasks = None
        if cancelled is not None:
            raise cancelled
        errors, self._errors = self._errors, []
        if errors:
            raise BaseExceptionGroup("AgentRuntime background work failed", errors)
        return None

    def cancel(self) -> None:
        """Cancel all background work (used on shutdown after the router stopped).

        Each task is cancelled once: a task cleaning up under a shielded scope is not
        interrupted again.
        """
        for task in list(self._tasks or ()):
            if task not in self._cancelled:
                self._cancelled.add(task)
                task.cancel()

    def start_soon(
        self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any, name: str = ""
    ) -> None:
        """Run background work owned by the runtime."""
        tasks = self._tasks
        if tasks is None:
            raise LifecycleError("AgentRuntime is not running: use `async with AgentRuntime()`")
        task = asyncio.get_running_loop().create_task(fn(*args), name=name or None)
        tasks.add(task)
        task.add_done_callback(self._on_done, context=self._done_context)

    def track(self, future: asyncio.Future[Any]) -> None:
        """Own `future` like background work: the runtime's exit waits for it (and
        cancels it when the body failed). For work already running elsewhere, such as a
        departure the router runs in its own task, without a task that waits for it."""
        tasks = self._tasks
        if tasks is None:
            raise LifecycleError("AgentRuntime is not running: use `async with AgentRuntime()`")
        tasks.add(future)
        future.add_done_callback(self._on_done, context=self._done_context)

    def _finished(self, task: asyncio.Future[Any]) -> None:
        if self._tasks is not None:
            self._tasks.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            self._errors.append(error)
            self.cancel()  # a task group's rule: one failure cancels the rest

    async def publish(self, topic: Topic[M], message: M | dict[str, Any]) -> None:
        """Deliver `message` to every subscriber of `topic`'s name.

        Like a networked transport, the runtime does not judge foreign payloads: each
        subscriber validates what it receives against its own topic (see `Topic.coerce`),
        so one malformed dict or wrong-type message is rejected (and counted) where it
        lands and never crashes the publisher or anyone else. An instance of the topic's
        own payload class that skipped validation (`model_construct()`,
        `model_copy(update=...)`, a field changed by `object.__setattr__`) is the
        publisher's own bug: it raises
        `ContractValueError` here, before any subscriber sees it.

        Every `publish_batch`-th call first yields to the event loop (see the class):
        the messages published since the last yield have their background work started,
        at most `publish_batch` of them wait to run when a call returns. A publisher
        cancelled at that point delivers nothing.
        """
        if type(message) is topic.payload:
            try:
                message = topic.coerce(message)
            except ValueError as exc:
                raise ContractValueError(
                    f"published {topic.payload.__name__} on topic {topic.name!r} is invalid "
                    f"(built without validation?): {exc}"
                ) from None
        self._unyielded += 1
        if self._unyielded >= self._batch:
            # Not on every call: each yield costs an event-loop pass (a selector poll),
            # which per message costs more than the piled-up tasks it avoids
            # (docs/performance.md, the "publish batches" row of 2026-12-02, day).
            self._unyielded = 0
            await asyncio.sleep(0)
        for subscribed, agent in self._subscribers.get(topic.name, ()):
            await agent.deliver(subscribed, message, self)
