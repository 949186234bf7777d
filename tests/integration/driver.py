"""A metrics source for the integration tests: a real router under continuous traffic.

Stands in for `turnrouter demo --serve` until the demo exists (see `sources.py`). It runs
an `AgentRouter` over agents with route-specific latency, a real `Telemetry` with an SDK
tracer provider (so latency histograms carry trace exemplars) and a private registry
served by `serve_metrics`, and generates normal or clarification-heavy traffic until it
is killed:

    python -m tests.integration.driver --metrics-port 9464 --seed 1 [--clarify-heavy]

The router does not yet report acknowledgments, silence or timing predictions itself;
until it does, `_AcknowledgmentModel` derives them from each turn's first-response time
with the configured delay (and stands aside for any turn where the router reports them).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
from collections.abc import Awaitable, Callable, Sequence

import anyio
import anyio.lowlevel
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from turnrouter import (
    Admission,
    AgentRouter,
    AgentTurn,
    DestinationResult,
    RouteDecision,
    RouteRequest,
    RouterObserver,
    RoutingAid,
    TurnObserver,
)
from turnrouter.telemetry import Telemetry, serve_metrics
from turnrouter.testing import ScriptedLLM

ACK_DELAY_SECONDS = 0.3
QUERIES = ("what's the weather tomorrow", "book a table for two", "tell me a joke",
           "will it rain in Lyon", "move my booking to friday", "how are you")


class LatencyAgent:
    """A destination with a route-specific first-response latency and some bad habits."""

    def __init__(self, name: str, rng: random.Random, *, latency: tuple[float, float],
                 decline: float = 0.0, focus: float = 0.0, fail: float = 0.0) -> None:
        self.name = name
        self._rng = rng
        self._latency = latency
        self._decline = decline
        self._focus = focus
        self._fail = fail

    def routing_aid(self, participant_id: str) -> RoutingAid:
        return RoutingAid(self.name, f"handles {self.name} requests")

    async def admit(self, turn: AgentTurn, *, focused: bool) -> Admission:
        await anyio.sleep(self._rng.uniform(0.001, 0.02))
        if not focused and self._rng.random() < self._decline:
            return Admission("decline")
        return Admission("accept")

    async def answer(
        self, turn: AgentTurn, *, started: Callable[[], Awaitable[None]]
    ) -> DestinationResult:
        await anyio.sleep(self._rng.uniform(*self._latency))
        if self._rng.random() < self._fail:
            raise RuntimeError(f"{self.name} backend unavailable")
        await started()
        await anyio.sleep(0.01)
        if self._rng.random() < self._focus:
            return DestinationResult("focus", f"{self.name} keeps talking")
        return DestinationResult("answer", f"{self.name} answer")

    async def release(self, participant_id: str) -> None:
        await anyio.lowlevel.checkpoint()


class Decisions:
    """Picks a candidate at random; asks to clarify with probability `clarify`."""

    def __init__(self, rng: random.Random, clarify: float) -> None:
        self._rng = rng
        self._clarify = clarify

    async def decide(self, request: RouteRequest) -> RouteDecision:
        await anyio.sleep(self._rng.uniform(0.002, 0.06))
        if self._rng.random() < 0.01:
            raise TimeoutError("classifier timed out")
        if self._rng.random() < self._clarify or not request.candidates:
            return RouteDecision("clarify", confidence=0.2)
        choice = self._rng.choice(request.candidates).name
        return RouteDecision(choice, confidence=0.9)


class _AckTurn(TurnObserver):
    """Forwards a turn's events; reports acknowledgment and silence if the router did not."""

    __slots__ = ("_inner", "_model", "_reported", "_route", "_seconds")

    def __init__(self, inner: TurnObserver, model: _AcknowledgmentModel) -> None:
        self._inner = inner
        self._model = model
        self._reported = False
        self._route: str | None = None
        self._seconds: float | None = None

    def decision_started(self, request: RouteRequest) -> object:
        return self._inner.decision_started(request)

    def decision_finished(self, token: object, request: RouteRequest,
                          decision: RouteDecision | None, error: BaseException | None) -> None:
        self._inner.decision_finished(token, request, decision, error)

    def admission_started(self, route: str, focused: bool) -> object:
        return self._inner.admission_started(route, focused)

    def admission_finished(self, token: object, route: str, focused: bool,
                           disposition: str | None, error: BaseException | None,
                           timed_out: bool = False) -> None:
        self._inner.admission_finished(token, route, focused, disposition, error, timed_out)

    def answer_started(self, route: str, fallback: bool) -> object:
        return self._inner.answer_started(route, fallback)

    def first_response(self, token: object, route: str, seconds: float) -> None:
        self._route, self._seconds = route, seconds
        self._inner.first_response(token, route, seconds)

    def answer_finished(self, token: object, route: str, result: DestinationResult | None,
                        error: BaseException | None, interrupted: bool) -> None:
        self._inner.answer_finished(token, route, result, error, interrupted)

    def release_started(self, route: str, reason: str) -> object:
        return self._inner.release_started(route, reason)  # type: ignore[arg-type]

    def release_finished(self, token: object, route: str, reason: str,
                         error: BaseException | None) -> None:
        self._inner.release_finished(token, route, reason, error)  # type: ignore[arg-type]

    def reroute(self, route: str) -> None:
        self._inner.reroute(route)

    def default_fallback(self, route: str) -> None:
        self._inner.default_fallback(route)

    def clarification(self, reason: str) -> None:
        self._inner.clarification(reason)  # type: ignore[arg-type]

    def focus_transition(self, route: str, transition: str) -> None:
        self._inner.focus_transition(route, transition)  # type: ignore[arg-type]

    def acknowledgment(self, route: str, outcome: str, trigger: str, delay_seconds: float,
                       predicted_first_response: float | None, started_at: float,
                       ended_at: float, text: str, error: BaseException | None) -> None:
        self._reported = True
        self._inner.acknowledgment(
            route, outcome, trigger, delay_seconds,  # type: ignore[arg-type]
            predicted_first_response, started_at, ended_at, text, error)

    def silence(self, route: str, seconds: float) -> None:
        self._reported = True
        self._inner.silence(route, seconds)

    def failure(self, route: str | None, stage: str, error: BaseException) -> None:
        self._inner.failure(route, stage, error)  # type: ignore[arg-type]

    def finished(self, outcome: str, route: str | None, focus_before: str | None,
                 focus_after: str | None, attempts: int, error: BaseException | None) -> None:
        if not self._reported and self._route is not None and self._seconds is not None:
            self._model.report(self._inner, self._route, self._seconds)
        self._model.maybe_patch()
        self._inner.finished(outcome, route, focus_before, focus_after,  # type: ignore[arg-type]
                             attempts, error)


class _AcknowledgmentModel(RouterObserver):
    """Wraps `Telemetry`, adding modelled acknowledgments, silence and predictions."""

    enabled = True

    def __init__(self, inner: Telemetry, delay: float, rng: random.Random) -> None:
        self._inner = inner
        self._delay = delay
        self._rng = rng
        self._predicted: dict[str, float] = {}

    def report(self, turn: TurnObserver, route: str, seconds: float) -> None:
        """What an acknowledgment scheduled `delay` after admission would have done."""
        predicted = self._predicted.get(route)
        early = predicted is not None and predicted > 2 * self._delay
        delay = self._delay / 2 if early else self._delay
        trigger = "prediction" if early else "delay"
        outcome = "emitted" if seconds > delay else "suppressed"
        turn.acknowledgment(route, outcome, trigger, delay, predicted, 0.0,  # type: ignore[arg-type]
                            min(seconds, delay), "one moment", None)
        turn.silence(route, min(seconds, delay + 0.05))
        estimate = seconds if predicted is None else 0.8 * predicted + 0.2 * seconds
        self._predicted[route] = estimate
        self._inner.predicted_first_response(route, estimate)

    def maybe_patch(self) -> None:
        """Model context patches and rejected runtime messages (the driver has neither)."""
        if self._rng.random() < 0.1:
            self._inner.context_patch(self._rng.choice(("append", "replace")),
                                      self._rng.choice(("applied", "applied", "diverged")))
        if self._rng.random() < 0.02:
            self._inner.message_rejected("user_query", self._rng.choice(("invalid", "closed")))

    def turn_started(self, turn: AgentTurn, focus: str | None) -> TurnObserver:
        return _AckTurn(self._inner.turn_started(turn, focus), self)

    def participant_added(self, participant_id: str) -> None:
        self._inner.participant_added(participant_id)

    def participant_removed(self, participant_id: str) -> None:
        self._inner.participant_removed(participant_id)

    def release_started(self, route: str, reason: str) -> object:
        return self._inner.release_started(route, reason)  # type: ignore[arg-type]

    def release_finished(self, token: object, route: str, reason: str,
                         error: BaseException | None) -> None:
        self._inner.release_finished(token, route, reason, error)  # type: ignore[arg-type]

    def failure(self, route: str | None, stage: str, error: BaseException) -> None:
        self._inner.failure(route, stage, error)  # type: ignore[arg-type]

    def configured(self, *, routes: tuple[str, ...],
                   acknowledgment_delay_secs: float | None) -> None:
        self._inner.configured(routes=routes, acknowledgment_delay_secs=acknowledgment_delay_secs)

    def predicted_first_response(self, route: str, seconds: float) -> None:
        self._inner.predicted_first_response(route, seconds)


async def _speak(turn: AgentTurn, route: str, text: str) -> None:
    """The output callback: a voice pipeline would synthesize `text` here."""
    await anyio.lowlevel.checkpoint()


async def _participant(router: AgentRouter, rng: random.Random, index: int) -> None:
    generation = 0
    turn = 0
    while True:
        pid = f"p{index}-{generation}"
        for _ in range(rng.randint(5, 20)):
            turn += 1
            with contextlib.suppress(Exception):  # failures are counted; keep talking
                await router.handle(AgentTurn(pid, f"{pid}-t{turn}", rng.choice(QUERIES)))
            await anyio.sleep(rng.uniform(0.01, 0.1))
        await router.participant_left(pid)
        generation += 1


async def run(participants: int, seed: int, clarify_heavy: bool, port: int) -> None:
    """Serve metrics on `port` and drive traffic until cancelled."""
    rng = random.Random(seed)
    registry = CollectorRegistry()
    telemetry = Telemetry(tracer_provider=TracerProvider(), registry=registry)
    observer = _AcknowledgmentModel(telemetry, ACK_DELAY_SECONDS, rng)
    agents = {
        "weather": LatencyAgent("weather", rng, latency=(0.03, 0.35), decline=0.2, focus=0.1),
        "booking": LatencyAgent("booking", rng, latency=(0.2, 1.2), decline=0.3, fail=0.02),
        "conversation": LatencyAgent("conversation", rng, latency=(0.02, 0.2)),
    }
    router = AgentRouter(
        agents, Decisions(rng, 0.5 if clarify_heavy else 0.02),
        acknowledgment_llm=ScriptedLLM("one moment"),
        acknowledgment_delay_secs=ACK_DELAY_SECONDS, telemetry=observer, output=_speak)
    with serve_metrics(port, registry):
        print(f"serving metrics on 127.0.0.1:{port}", flush=True)
        async with anyio.create_task_group() as tasks:
            for index in range(participants):
                tasks.start_soon(_participant, router, random.Random(rng.random()), index)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--metrics-port", type=int, required=True)
    parser.add_argument("--participants", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--clarify-heavy", action="store_true")
    args = parser.parse_args(argv)
    try:
        anyio.run(run, args.participants, args.seed, args.clarify_heavy, args.metrics_port)
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
