"""The router the NATS tests run in worker processes (`--app tests.nats.app:make_router`).

One destination, `echo`, takes focus and answers `<query>|<previous user text or ->|<F
when it was admitted focused, else N>` after `TR_TEST_ANSWER_SECS` (default 0.05 s), so
the listener can check order, history and focus after a move from the answers alone.
A query starting with `slow` first says "working on it" and answers after a minute. A
participant whose id starts with `q` is answered at once: its turn ends before the
worker's `mark_after`, so its message is acknowledged after the finished record, with no
in-flight mark (the other participants' turns are marked). A query starting with
`patch` is answered, and 0.3 s later (between turns) a background job's context patch
`job-<participant>` is appended to the participant's history. A query starting with
`lingering` is answered at once and its turn goes on for `TR_TEST_ANSWER_SECS` after (the
participant's next query cuts it, its answer given). With
`TR_TEST_SAY_ANSWERED` set, each answer's turn id goes to stderr (`answered <turn id>`)
once `ctx.answer` returned: the answers the destination gave; and `running <turn id>`
when `answer()` is called: the turns the destination ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from turnrouter import (
    Admission,
    AgentRouter,
    AgentTurn,
    ContextPatch,
    DestinationResult,
    RouteDecision,
    RouteRequest,
    RouteTimingPredictor,
    RoutingAid,
)
from turnrouter.runtime.nats import WorkerContext
from turnrouter.telemetry import Telemetry

PREAMBLE = "working on it"


class Echo:
    """Answers with the query, the previous user text and the focus flag."""

    def __init__(self, ctx: WorkerContext, delay: float) -> None:
        self._ctx, self._delay = ctx, delay
        self._said = bool(os.environ.get("TR_TEST_SAY_ANSWERED"))
        self._focused: dict[str, bool] = {}
        self._jobs: set[asyncio.Task[None]] = set()
        self.router: AgentRouter | None = None

    def routing_aid(self, participant_id: str) -> RoutingAid:
        return RoutingAid("echo", "echoes")

    async def admit(self, turn: AgentTurn, *, focused: bool) -> Admission:
        self._focused[turn.turn_id] = focused
        if turn.query.startswith("slow"):  # says it started, then answers after a minute
            return Admission("accept", preamble=PREAMBLE)
        return Admission("accept")

    async def answer(self, turn: AgentTurn, *,
                     started: Callable[[], Awaitable[None]]) -> DestinationResult:
        if self._said:
            print(f"running {turn.turn_id}", file=sys.stderr, flush=True)
        await started()
        if turn.query.startswith("blocking"):  # blocks the event loop itself
            mark = os.environ.get("TR_TEST_BLOCKING_MARK")
            if mark:  # (the loop answers nothing meanwhile: a file says it blocks)
                Path(mark).write_text(turn.turn_id)  # noqa: ASYNC240 (on purpose)
            time.sleep(3600.0)  # noqa: ASYNC251 (what this turn tests)
        if turn.query.startswith("stubborn"):  # ignores its cancellation: never ends
            while True:
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(3600.0)
        if turn.query.startswith("slow"):
            await asyncio.sleep(60.0)
        elif not turn.participant_id.startswith("q") and not turn.query.startswith("lingering"):
            await asyncio.sleep(self._delay)
        previous = turn.history[-1].user if turn.history else "-"
        flag = "F" if self._focused.pop(turn.turn_id, False) else "N"
        text = f"{turn.query}|{previous}|{flag}"
        await self._ctx.answer(turn, "echo", text)
        if self._said:  # the answer is out of the destination's hands
            print(f"answered {turn.turn_id}", file=sys.stderr, flush=True)
        if turn.query.startswith("lingering"):  # works on after its answer
            await asyncio.sleep(self._delay)
        if turn.query.startswith("patch"):
            job = asyncio.create_task(self._background_job(turn.participant_id))
            self._jobs.add(job)
            job.add_done_callback(self._jobs.discard)
        return DestinationResult("focus", text)

    async def _background_job(self, pid: str) -> None:
        await asyncio.sleep(0.3)  # the job's own duration: it ends after the turn
        assert self.router is not None
        await self.router.apply_context_patch(
            pid, ContextPatch(task_id=f"job-{pid}", digest=("job done",)))

    async def release(self, participant_id: str) -> None:
        return None


class Always:
    """Chooses `echo`."""

    async def decide(self, request: RouteRequest) -> RouteDecision:
        return RouteDecision("echo")


def make_router(ctx: WorkerContext) -> AgentRouter:
    delay = float(os.environ.get("TR_TEST_ANSWER_SECS", "0.05"))
    predictor = RouteTimingPredictor()
    ctx.learn_from_fleet(predictor)  # samples of the other replicas reach this predictor
    telemetry = Telemetry(registry=ctx.registry)
    if os.environ.get("TR_TEST_TRACING"):  # a local SDK provider (never the global one)
        from opentelemetry.sdk.trace import TracerProvider

        telemetry = Telemetry(tracer_provider=TracerProvider(), registry=ctx.registry)
    echo = Echo(ctx, delay)
    echo.router = AgentRouter({"echo": echo}, Always(), default_destination="echo",
                              telemetry=telemetry,
                              timing_predictor=predictor, timing_sink=ctx.timing_sink)
    return echo.router


def not_a_router(ctx: WorkerContext) -> object:
    """A broken factory: the worker must say what is wrong and exit."""
    return object()


async def hanging(ctx: WorkerContext) -> AgentRouter:
    """A factory that never finishes (waiting for a dependency that never comes): the
    worker must still honour SIGTERM. Says on stdout when it started waiting."""
    print("factory waiting", flush=True)
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


def hanging_sync(ctx: WorkerContext) -> AgentRouter:
    """A synchronous factory that blocks (a dependency polled with `time.sleep`, a
    blocking client call): the worker must still honour SIGTERM. Says on stdout when it
    started waiting."""
    print("factory waiting", flush=True)
    time.sleep(3600)
    raise AssertionError("unreachable")


def raising(ctx: WorkerContext) -> AgentRouter:
    """A factory that fails: one line on stderr, exit 1."""
    raise KeyError("OPENAI_API_KEY is not set")


def exiting(ctx: WorkerContext) -> AgentRouter:
    """A factory that gives up as scripts do: `sys.exit` with a message."""
    raise SystemExit("missing setting FOO")


def exiting_zero(ctx: WorkerContext) -> AgentRouter:
    """A factory that exits 0: still a failed start, not a clean exit."""
    raise SystemExit(0)


def interrupted(ctx: WorkerContext) -> AgentRouter:
    """A factory that raises KeyboardInterrupt itself."""
    raise KeyboardInterrupt
