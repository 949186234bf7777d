"""Route-aware intention acknowledgments, timed by a fallback delay or a prediction.

Used by `AgentRouter` only when `acknowledgment_llm` and `acknowledgment_delay_secs` are
configured (or a timing predictor/sink is given, for samples only). Per turn, the router
calls the destination's `answer()` at once; beside it, in an anyio task group, runs one
`AcknowledgmentSidecar`:

1. asks the timing predictor for a prediction of this route's first response;
2. picks the trigger: ``prediction`` when the predictor decides so (`Prediction.early`;
   `RouteTimingPredictor` is told the delay and the expected generation time), or, for
   a predictor that does not decide, when the prediction is confident and its lower
   bound is above the delay - then the acknowledgment is *heard* at
   `AcknowledgmentPolicy.early_secs` (at most the delay), its generation starting that
   much earlier than the expected generation time; otherwise ``delay``:
   generation starts when the fallback delay has passed, and the text is spoken as soon
   as it is ready;
3. generates the text (an `Acknowledger`'s structured path, else `LLMService.complete`
   with the documented prompt, non-reasoning, bounded `max_tokens`), bounded in time;
4. commits: calls `output(turn, route, text)`.

`started()` before the commit suppresses it; after the commit, `started()` waits until
the output call returned. Interrupts cancel it. A generation error or timeout means no
acknowledgment (outcome ``failed``, failure stage ``acknowledgment``); the answer is
never affected.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

import anyio

from ._clock import Clock
from ._contracts import AgentTurn, RoutingAid, say_through
from ._exceptions import ConfigurationError
from ._limits import is_logged
from ._llm import LLMService
from ._logging import log_failure
from ._numbers import finite
from ._observer import (
    AcknowledgmentFinished,
    AcknowledgmentGenerated,
    AcknowledgmentOutcome,
    AcknowledgmentTrigger,
    AnswerAfterAcknowledgment,
    EstimateChanged,
    RouterObserver,
    TurnObserver,
)
from ._redact import strip_reasoning, strip_surrogates
from ._timing import (
    Prediction,
    RouteTimingPredictor,
    TimingPredictor,
    TimingSample,
    TimingSink,
)

if TYPE_CHECKING:
    from ._contracts import RoutableAgent

__all__ = [
    "Acknowledger",
    "AcknowledgmentPolicy",
    "AcknowledgmentRequest",
    "acknowledgment_prompt",
    "clean_acknowledgment",
]

logger = logging.getLogger("turnrouter")
T = TypeVar("T")
Emit = Callable[[AgentTurn, str, str], Awaitable[None]]

#: Prompt line prefixes; `turnrouter.llm.TemplateAcknowledger` parses them back.
PROMPT_ROUTE = "Helper: "
PROMPT_DESCRIPTION = "Helper description: "
PROMPT_QUERY = "User request: "
_PROMPT_LABELS = (PROMPT_ROUTE, PROMPT_DESCRIPTION, PROMPT_QUERY)


@dataclass(frozen=True, slots=True)
class AcknowledgmentPolicy:
    """How acknowledgments are generated and timed (defaults suit a voice assistant).

    - `max_tokens`: output-token budget of each generation (bounded, default 32).
    - `max_chars`: the spoken text is cut at a word boundary to this length.
    - `timeout_secs`: a generation slower than this is abandoned (outcome failed).
    - `early_secs`: when a confident prediction says the answer is slower than the delay,
      the acknowledgment is heard this long after the answer starts (at most the delay).
    - `expected_generation_secs`: initial guess of the generation time, refined by a
      moving average of measured generations; an early acknowledgment starts generating
      this much before it should be heard.
    - `prediction_timeout_secs`: bound on an awaitable (LLM-assisted) prediction.
    """

    max_tokens: int = 32
    max_chars: int = 160
    timeout_secs: float = 3.0
    early_secs: float = 0.25
    expected_generation_secs: float = 0.3
    prediction_timeout_secs: float = 0.5

    def __post_init__(self) -> None:
        for name in ("max_tokens", "max_chars"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigurationError(f"AcknowledgmentPolicy {name} must be an int >= 1, "
                                         f"got {value!r}")
        for name in ("timeout_secs", "prediction_timeout_secs"):
            value = getattr(self, name)
            if not finite(value) or value <= 0:
                raise ConfigurationError(f"AcknowledgmentPolicy {name} must be finite and "
                                         f"positive, got {value!r}")
        for name in ("early_secs", "expected_generation_secs"):
            value = getattr(self, name)
            if not finite(value) or value < 0:
                raise ConfigurationError(f"AcknowledgmentPolicy {name} must be finite and "
                                         f">= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class AcknowledgmentRequest:
    """What a structured `Acknowledger` receives: the route's aid, the turn, the budget."""

    route: RoutingAid
    """The routing aid of the route that is answering."""
    turn: AgentTurn
    """The turn being answered."""
    max_tokens: int
    """Output-token budget of the acknowledgment (`AcknowledgmentPolicy.max_tokens`)."""


@runtime_checkable
class Acknowledger(Protocol):
    """The structured acknowledgment path: used instead of `complete()` when present."""

    async def acknowledge(self, request: AcknowledgmentRequest) -> str:
        """Return the short text to speak for `request` (no promise of a result)."""
        ...


def acknowledgment_prompt(route: RoutingAid, query: str) -> str:
    """The prompt sent to `LLMService.complete` for an acknowledgment."""
    lines = [
        "You are the voice of a realtime assistant. The user's request was handed to a "
        "helper that is now working on it.",
        "Say one short spoken sentence (at most 10 words) telling the user what you are "
        "doing now, e.g. 'Let me check your calendar.'",
        "Do not answer the request, do not promise or guess a result, no greeting, no "
        "quotes. Reply with the sentence only.",
        f"{PROMPT_ROUTE}{route.name}",
    ]
    if route.description:
        lines.append(f"{PROMPT_DESCRIPTION}{' '.join(route.description.split())}")
    lines.append(f"{PROMPT_QUERY}{' '.join(query.split())[:500]}")
    return "\n".join(lines)


#: What a speakable line may not hold: terminal escape sequences, then any control or
#: format character (zero-width spaces, a BOM, bidi controls) and markdown emphasis.
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-_]")
_UNSPOKEN = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f"
                       r"\u202a-\u202e\u2060-\u206f\ufeff\ufff9-\ufffb*_#]")


#: The most of a reply `clean_acknowledgment` reads (as `OpenAIChatClient`'s default
#: `max_reply_bytes`): a reasoning block longer than this, opened by the chat template,
#: is not told from an answer.
MAX_CLEANED_CHARS = 1 << 20


def clean_acknowledgment(text: str, max_chars: int) -> str:
    """The first speakable line of a reply, unquoted, whitespace-normalized, cut at a
    word boundary ("" when there is none: no acknowledgment is said).

    Reasoning is removed first (`<think>` blocks, closed, nested or not: as
    `OpenAIChatClient` does for any `LLMService`), then escape sequences, control and
    invisible characters and markdown emphasis. A line is speakable when it holds a
    letter or digit and is neither the model's own lead-in (ending with ":"), an echo of
    the prompt's labelled lines (`User request: ...`), nor JSON or markup. Lone
    surrogates (not storable as UTF-8) become U+FFFD."""
    # Reasoning first, over the whole reply (bounded: `MAX_CLEANED_CHARS`), then the
    # cut: cut first, a long block lost its closing tag and was spoken.
    text = strip_reasoning(strip_surrogates(text[:MAX_CLEANED_CHARS]))[: max_chars * 4]
    for raw in _UNSPOKEN.sub("", _ESCAPES.sub("", text)).splitlines():
        line = " ".join(raw.split()).strip().strip("\"'“”‘’`").strip()
        if (line and any(c.isalnum() for c in line) and not line.endswith(":")
                and line[0] not in "{[<" and not line.startswith(_PROMPT_LABELS)):
            break
    else:
        return ""
    if len(line) > max_chars:
        cut = line[:max_chars].rsplit(" ", 1)[0]
        line = (cut or line[:max_chars]).rstrip(",;:-")
    return line


async def within(clock: Clock, deadline: float, call: Callable[[], Awaitable[T]]) -> T:
    """`await call()`, or TimeoutError once `clock` reaches `deadline`."""
    results: list[T] = []
    errors: list[Exception] = []
    async with anyio.create_task_group() as tg:
        async def watchdog() -> None:
            await clock.sleep_until(deadline)
            tg.cancel_scope.cancel()

        tg.start_soon(watchdog)
        try:
            results.append(await call())
        except Exception as exc:
            errors.append(exc)
        tg.cancel_scope.cancel()
    if results:
        return results[0]
    if errors:
        raise errors[0]
    raise TimeoutError(f"no reply within {deadline - clock.now():.3f}s of the deadline")


#: Seconds between two checks of a route's first-response estimate after its samples
#: (the `predicted_first_response` gauge follows within this time).
ESTIMATE_CHECK_SECS = 1.0


class TimingEngine:
    """Router-wide timing state: predictor, sink, generation-time estimate, clock."""

    __slots__ = ("_checked", "_failures", "_published", "acknowledger", "agents", "clock",
                 "decides", "delay",
                 "expected_generation", "feature_of", "llm", "observer", "policy",
                 "predictor", "route_delays", "sink")

    def __init__(
        self, *, llm: LLMService | None, delay: float | None, policy: AcknowledgmentPolicy,
        predictor: TimingPredictor | None, sink: TimingSink | None, clock: Clock,
        observer: RouterObserver, agents: Mapping[str, RoutableAgent],
        route_delays: Mapping[str, float] | None = None,
    ) -> None:
        self.agents = agents
        #: Routes with their own fallback delay (`acknowledgment_route_delays`).
        self.route_delays = dict(route_delays or {})
        self.llm = llm
        self.acknowledger: Acknowledger | None = (
            llm if llm is not None and callable(getattr(llm, "acknowledge", None))
            else None  # type: ignore[assignment]
        )
        self.delay = delay
        self.policy = policy
        self.predictor = predictor
        #: The predictor takes the delay and decides itself (`Prediction.early`).
        self.decides = isinstance(predictor, RouteTimingPredictor)
        #: The predictor's per-turn feature class, recorded with each sample.
        feature_of = getattr(predictor, "feature_of", None)
        self.feature_of: Callable[[AgentTurn], str | None] | None = (
            feature_of if callable(feature_of) else None)
        self.sink = sink
        self.clock = clock
        self.observer = observer
        self.expected_generation = policy.expected_generation_secs
        self._published: dict[str, float] = {}
        #: Per route, when its estimate was last checked for a change (router clock).
        self._checked: dict[str, float] = {}
        #: Failures of each per-turn callback (predictor, feature_of, sink) so far.
        self._failures: dict[str, int] = {}

    def _failed(self, what: str, exc: Exception) -> None:
        """A per-turn callback failed: logged the 1st time and at every power of ten, with
        the count (a sink whose disk is full fails on every turn)."""
        count = self._failures[what] = self._failures.get(what, 0) + 1
        if is_logged(count):
            log_failure("%s (%d so far)", exc, what, count)

    def delay_for(self, route: str) -> float | None:
        """The fallback delay of `route`: its own, else the router-wide one."""
        return self.route_delays.get(route, self.delay)

    def publish_estimates(self, routes: tuple[str, ...]) -> None:
        """Publish the predictor's current estimates (e.g. after loading samples)."""
        for route in routes:
            self._publish(route)

    def _publish(self, route: str) -> None:
        predictor = self.predictor
        if predictor is None:
            return
        try:
            estimate = predictor.estimate(route)
        except Exception as exc:
            log_failure("timing predictor estimate(%r)", exc, route)
            return
        if estimate is None:
            return
        last = self._published.get(route)
        if last is None or abs(estimate - last) > 0.01 * last:
            self._published[route] = estimate
            self.observer.predicted_first_response(EstimateChanged(route, estimate))

    def record(self, route: str, seconds: float, censored: bool, turn: AgentTurn) -> None:
        """One first-response sample: to the predictor, the sink, and the gauge."""
        feature = None
        if self.feature_of is not None:
            try:
                feature = self.feature_of(turn)
            except Exception as exc:
                self._failed("timing predictor feature_of()", exc)
        sample = TimingSample(route, seconds, censored, time.time(), feature)
        if self.predictor is not None:
            try:
                self.predictor.record(sample, turn)
            except Exception as exc:
                self._failed("timing predictor record()", exc)
            if self.observer.enabled:
                # The estimate (a quantile of the route's whole model) is checked at a
                # route's first sample, then at most every ESTIMATE_CHECK_SECS: not on
                # every turn of a busy route.
                now = self.clock.now()
                last = self._checked.get(route)
                if last is None or now - last >= ESTIMATE_CHECK_SECS:
                    self._checked[route] = now
                    self._publish(route)
        if self.sink is not None:
            try:
                self.sink.record(sample)
            except Exception as exc:
                self._failed("timing sink record()", exc)

    def generation_observed(self, seconds: float) -> None:
        self.expected_generation += 0.2 * (seconds - self.expected_generation)

    def sidecar(self, answer: Answering) -> AcknowledgmentSidecar | None:
        """The acknowledgment to run beside one answer (None without an LLM)."""
        if self.llm is None:
            return None
        return AcknowledgmentSidecar(self, answer)

    def aid(self, route: str, turn: AgentTurn) -> RoutingAid:
        """The route's routing aid, named by its registration key: one `Destination`
        class registered under "billing" and "weather" would otherwise be acknowledged
        by its class name ("reply") on both routes."""
        aid = self.agents[route].routing_aid(turn.participant_id)
        return aid if aid.name == route else dataclasses.replace(aid, name=route)


_PENDING, _SUPPRESSED, _FAILED, _COMMITTED, _DONE = range(5)


class Answering(Protocol):
    """What the sidecar needs of the answer it runs beside."""

    @property
    def route(self) -> str: ...
    @property
    def turn(self) -> AgentTurn: ...
    @property
    def obs(self) -> TurnObserver: ...
    @property
    def emit(self) -> Emit: ...

    def hear(self, at: float) -> None:
        """A committed acknowledgment was delivered at `at` (the answer, which owns the
        silence measurement, decides whether that ended the silence)."""


class AcknowledgmentSidecar:
    """One answer's acknowledgment, run beside the destination's `answer()`.

    The router starts `run()` in a task group next to `answer()` and tells the sidecar
    when the answer starts (`answer_started`) and when it returned (`answer_finished`):
    a pending acknowledgment is then suppressed, a committed one is awaited.
    """

    __slots__ = ("_answer", "_delay_used", "_delivered", "_emit", "_engine", "_heard_at",
                 "_obs", "_predicted", "_probability", "_scope", "_started_at", "_state",
                 "_t0", "_trigger", "route", "turn")

    def __init__(self, engine: TimingEngine, answer: Answering) -> None:
        self._engine, self._answer = engine, answer
        self._obs = answer.obs
        self.route, self.turn, self._emit = answer.route, answer.turn, answer.emit
        self._t0 = engine.clock.now()
        self._state = _PENDING
        self._scope: anyio.CancelScope | None = None
        self._delivered: anyio.Event | None = None
        self._trigger: AcknowledgmentTrigger = "delay"
        self._predicted: float | None = None
        self._probability: float | None = None
        delay = engine.delay_for(answer.route)
        self._delay_used = delay if delay is not None else 0.0
        self._started_at: float | None = None
        #: When the spoken acknowledgment was heard (its delivery began).
        self._heard_at: float | None = None

    @property
    def committed(self) -> bool:
        """An acknowledgment is being delivered: the answer's output waits for it."""
        return self._state == _COMMITTED

    def answer_started(self, now: float) -> None:
        """The destination called `started()`: suppress a pending acknowledgment."""
        self._started_at = now
        if self._state == _PENDING:
            self._suppress()
        elif self._heard_at is not None:  # the acknowledgment was spoken before
            self._answered_after(now)

    def _answered_after(self, now: float) -> None:
        heard_at = self._heard_at
        assert heard_at is not None
        self._obs.answer_after_acknowledgment(
            AnswerAfterAcknowledgment(self.route, self._trigger, max(0.0, now - heard_at)))

    def answer_finished(self) -> None:
        """`answer()` returned or raised: a pending acknowledgment is no longer useful."""
        if self._state == _PENDING:
            self._suppress()

    async def wait_delivered(self) -> None:
        """Wait for a committed acknowledgment's delivery (at once if there is none)."""
        if self._state == _COMMITTED and self._delivered is not None:
            await self._delivered.wait()

    def _report(self, outcome: AcknowledgmentOutcome, text: str = "",
                error: BaseException | None = None) -> None:
        self._obs.acknowledgment(AcknowledgmentFinished(
            self.route, outcome, self._trigger, self._delay_used, self._predicted,
            self._t0, self._engine.clock.now(), text, error, self._probability,
        ))

    def _suppress(self) -> None:
        self._state = _SUPPRESSED
        if self._scope is not None:
            self._scope.cancel()
        self._report("suppressed")

    def _fail(self, error: BaseException, what: str = "none spoken") -> None:
        self._state = _FAILED
        log_failure(f"acknowledgment for %s ({what})", error, self.route)
        self._report("failed", error=error)

    async def run(self) -> None:
        """Predict, wait, generate and deliver the acknowledgment (or be suppressed)."""
        if self._state != _PENDING:
            return
        try:
            with anyio.CancelScope() as scope:
                self._scope = scope
                await self._run()
        except BaseException:
            # Cancelled from outside (an interrupt): a pending acknowledgment is dropped.
            if self._state == _PENDING:
                self._state = _SUPPRESSED
                self._report("suppressed")
            raise

    async def _predict(self) -> Prediction | None:
        engine = self._engine
        predictor = engine.predictor
        if predictor is None:
            return None
        try:
            prediction: Prediction | Awaitable[Prediction | None] | None
            if engine.decides:
                assert isinstance(predictor, RouteTimingPredictor)
                prediction = predictor.predict(
                    self.route, self.turn, delay_secs=self._delay_used,
                    generation_secs=engine.expected_generation)
            else:
                prediction = predictor.predict(self.route, self.turn)
            if inspect.isawaitable(prediction):
                waiting = prediction

                async def wait() -> Prediction | None:
                    return await waiting

                deadline = engine.clock.now() + engine.policy.prediction_timeout_secs
                prediction = await within(engine.clock, deadline, wait)
        except Exception as exc:
            logger.info("turnrouter: timing prediction for %s failed: %r", self.route, exc)
            return None
        return prediction if isinstance(prediction, Prediction) else None

    async def _generate(self) -> str:
        engine = self._engine
        max_tokens = engine.policy.max_tokens
        aid = engine.aid(self.route, self.turn)
        if engine.acknowledger is not None:
            return await engine.acknowledger.acknowledge(
                AcknowledgmentRequest(aid, self.turn, max_tokens))
        assert engine.llm is not None
        return await engine.llm.complete(acknowledgment_prompt(aid, self.turn.query),
                                         max_tokens=max_tokens, reasoning=False)

    async def _run(self) -> None:
        engine = self._engine
        clock, policy = engine.clock, engine.policy
        delay = self._delay_used
        prediction = await self._predict()
        if prediction is not None:
            self._predicted = prediction.seconds
            self._probability = prediction.probability_late
        if prediction is not None and (
            prediction.early if prediction.early is not None
            else prediction.confident and prediction.lower > delay
        ):
            self._trigger = "prediction"
            heard = min(policy.early_secs, delay)
            self._delay_used = heard
            start_at = self._t0 + max(0.0, heard - engine.expected_generation)
            emit_at = self._t0 + heard
        else:
            start_at = emit_at = self._t0 + delay
        if clock.now() < start_at:
            await clock.sleep_until(start_at)
        began = clock.now()
        try:
            text = await within(clock, began + policy.timeout_secs, self._generate)
            if not isinstance(text, str):
                raise TypeError(f"acknowledgment generator returned {type(text).__name__}")
            text = clean_acknowledgment(text, policy.max_chars)
            if not text:
                raise ValueError("acknowledgment generator returned no text")
        except Exception as exc:
            self._fail(exc)
            return
        generated = clock.now() - began
        engine.generation_observed(generated)
        self._obs.acknowledgment_generated(AcknowledgmentGenerated(self.route, generated))
        if clock.now() < emit_at:
            await clock.sleep_until(emit_at)
        if self._state != _PENDING:
            return
        # Commit: from here on started() waits for this delivery instead of suppressing.
        self._state = _COMMITTED
        self._delivered = anyio.Event()
        committed_at = clock.now()
        try:
            await say_through(self._emit, self.turn, self.route, text)
        except Exception as exc:
            self._fail(exc, "handed to output, which failed")
            if self._started_at is not None:
                self._answer.hear(self._started_at)  # the answer, not the acknowledgment
        except BaseException:
            # Interrupted while delivering: the router suppresses interrupted control text.
            self._state = _DONE
            self._report("suppressed", text)
            raise
        else:
            self._state = _DONE
            self._heard_at = committed_at
            self._answer.hear(committed_at)
            self._report("emitted", text)
            if self._started_at is not None:  # the answer started during the delivery
                self._answered_after(self._started_at)
        finally:
            self._delivered.set()
