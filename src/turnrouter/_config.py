"""`AgentRouter`'s constructor arguments, validated once into one settings object.

Every check names the argument it refuses. What the turn path reads (agents, default,
budget, texts, callbacks, the clock, the timing engine) is resolved here, so the router
and the turn never re-check it.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal

import anyio

from ._acknowledgment import AcknowledgmentPolicy, TimingEngine
from ._clock import Clock, SystemClock
from ._contracts import (
    CLARIFY,
    AgentTurn,
    DecisionService,
    DestinationResult,
    RoutableAgent,
    RouteDecision,
    RouteRequest,
)
from ._destination import Destination
from ._exceptions import ConfigurationError, ContractTypeError
from ._limits import Overflows
from ._llm import LLMService
from ._load import LoadMonitor, OverloadPolicy
from ._numbers import finite
from ._observer import Configured, RouterObserver
from ._redact import has_surrogates, preview
from ._timing import RouteTimingPredictor, TimingPredictor, TimingSink

__all__ = [
    "CLARIFY_ROUTE",
    "CONVERSATION",
    "DEFAULT_CLARIFICATION_TEXT",
    "DEFAULT_CONTEXT_BUDGET_BYTES",
    "DEFAULT_FAILURE_TEXT",
    "DEFAULT_MAX_PENDING_PATCHES",
    "PATCH_ROUTE",
    "OutputCallback",
    "ParticipantCallback",
    "ParticipantChange",
    "ResultCheck",
    "RouterConfig",
    "StatusCallback",
    "check_callable",
]

logger = logging.getLogger("turnrouter")

OutputCallback = Callable[[AgentTurn, str, str], Awaitable[None]]
StatusCallback = Callable[[Literal["processing", "idle"], str], Awaitable[None]]
ParticipantCallback = Callable[[str], Awaitable[None]]
ParticipantChange = Callable[[str], object]
#: `route_turn(result_check=...)`: `(turn, route, result)`, raising for a result the
#: caller cannot carry.
ResultCheck = Callable[[AgentTurn, str, DestinationResult], None]

#: The longest destination name (it is a label of every metric of its route).
MAX_ROUTE_CHARS = 100
#: Route names the router gives a meaning of its own: no destination may take them.
RESERVED_ROUTES = {
    "clarify": "a decision of it asks the participant to clarify",
    "none": "the route of text no destination said (failure text) and of turns no "
            "destination answered, in metrics",
    "background": "the route of the router's questions about held context patches",
    "_OTHER": "what spans record for a decision naming no candidate",
}

DEFAULT_CONTEXT_BUDGET_BYTES = 8192
DEFAULT_MAX_PENDING_PATCHES = 8
#: Route name passed to `output` for the router's questions about human-gated patches.
PATCH_ROUTE = "background"
#: Said to a participant whose oldest waiting turn was dropped (`max_waiting_turns`).
DROPPED_TURN_TEXT = "Sorry, I missed part of what you said. Could you repeat it?"
#: Route name passed to `output` for the router's own clarification questions.
CLARIFY_ROUTE = CLARIFY
DEFAULT_CLARIFICATION_TEXT = ("Sorry, I'm not sure I can help with that. "
                               "Could you say it another way?")
DEFAULT_FAILURE_TEXT = "Sorry, something went wrong. Please try again."


class _DefaultRoute(str):
    """The default `default_destination`, recognisable by identity.

    A router whose destinations have no "conversation" route and that was not given a
    default explicitly simply has no default available (the contract's "clarification
    is also used when the configured default is unavailable"); naming an unknown
    default explicitly is a configuration error.
    """

    __slots__ = ()


CONVERSATION: str = _DefaultRoute("conversation")


def check_callable(name: str, value: object, *, optional: bool = True) -> None:
    if value is None and optional:
        return
    if not callable(value):
        raise ContractTypeError(f"AgentRouter {name} must be callable, got {type(value).__name__}")


def check_instance(name: str, value: object) -> None:
    """Refuse a class passed where an instance belongs (`LexicalDecisions` for
    `LexicalDecisions()`): the class has every method the other checks look for, so it
    would pass them and fail only at the first turn, as a logged decision or
    acknowledgment failure that names neither the argument nor the missing call."""
    if isinstance(value, type):
        raise ContractTypeError(
            f"AgentRouter {name} is the class {value.__qualname__}, not an instance: "
            f"call it ({value.__qualname__}(...))")


class _TimedDecisions:
    """A decision service whose `decide()` is cut off after `timeout` seconds
    (`AgentRouter(decision_timeout_secs=)`): a hung classifier becomes a decision failure
    (a `TimeoutError`), and the turn goes to the default as for any other outage."""

    __slots__ = ("_decide", "_timeout")

    def __init__(self, decisions: DecisionService, timeout: float) -> None:
        self._decide = decisions.decide
        self._timeout = timeout

    async def decide(self, request: RouteRequest) -> RouteDecision:
        with anyio.move_on_after(self._timeout) as scope:
            decision = await self._decide(request)
        if scope.cancel_called:  # (a decide() that swallowed the cancel: too late too)
            raise TimeoutError(f"decision service decide() did not return within "
                               f"decision_timeout_secs ({self._timeout:g}s)")
        return decision


def _check_positive(name: str, value: object, *, integer: bool = False) -> None:
    kinds: tuple[type, ...] = (int,) if integer else (int, float)
    if not isinstance(value, int | float) or not isinstance(value, kinds) or isinstance(
        value, bool
    ):
        kind = "an int" if integer else "a number"
        raise ContractTypeError(f"AgentRouter {name} must be {kind}, got {preview(value)}")
    if not (finite(value) and value > 0):
        raise ConfigurationError(
            f"AgentRouter {name} must be finite and positive, got {preview(value)}")


#: The longest acknowledgment delay a router takes, in seconds: an acknowledgment after a
#: minute of silence comes too late to help, and a larger number is almost always
#: milliseconds given as seconds (500 for half a second).
MAX_ACKNOWLEDGMENT_DELAY_SECS = 60.0


def _check_delay(name: str, value: object) -> None:
    """An acknowledgment delay: finite, positive seconds, at most a minute."""
    _check_positive(name, value)
    if isinstance(value, int | float) and value > MAX_ACKNOWLEDGMENT_DELAY_SECS:
        hint = (f"; did you mean {value / 1000:g} (milliseconds given as seconds)?"
                if value / 1000 <= MAX_ACKNOWLEDGMENT_DELAY_SECS else "")
        raise ConfigurationError(
            f"AgentRouter {name} is in seconds and at most "
            f"{MAX_ACKNOWLEDGMENT_DELAY_SECS:g} (an acknowledgment after a minute of silence "
            f"helps nobody), got {preview(value)}{hint}")


def _route_delays(delays: object, agents: Mapping[str, RoutableAgent],
                  default: float | None) -> dict[str, float]:
    """`acknowledgment_route_delays` checked: registered routes to finite positive
    seconds, only with a router-wide `acknowledgment_delay_secs` (the other routes')."""
    if delays is None:
        return {}
    if not isinstance(delays, Mapping):
        raise ContractTypeError(
            f"AgentRouter acknowledgment_route_delays must be a mapping of route name to "
            f"seconds, got {type(delays).__name__}")
    if default is None and delays:
        raise ConfigurationError(
            "AgentRouter acknowledgment_route_delays needs acknowledgment_delay_secs (the "
            "delay of every other route) and acknowledgment_llm")
    out: dict[str, float] = {}
    for route, seconds in delays.items():
        if not isinstance(route, str) or route not in agents:
            raise ConfigurationError(
                f"AgentRouter acknowledgment_route_delays: {str(route)[:100]!r} is not a "
                f"registered destination (registered: {sorted(agents)[:20]})")
        _check_delay(f"acknowledgment_route_delays[{route[:100]!r}]", seconds)
        out[route] = float(seconds)
    return out


def _agents(destinations: object) -> dict[str, RoutableAgent]:
    if not isinstance(destinations, Mapping):
        raise ContractTypeError(
            f"AgentRouter destinations must be a mapping of route name to agent, "
            f"got {type(destinations).__name__}"
        )
    if not destinations:
        raise ConfigurationError("AgentRouter destinations must not be empty")
    agents: dict[str, RoutableAgent] = {}
    for name, agent in destinations.items():
        if not isinstance(name, str) or not name:
            raise ConfigurationError(
                f"AgentRouter destination names must be non-empty str, got {name!r}"
            )
        if (type(name) is not str or len(name) > MAX_ROUTE_CHARS or has_surrogates(name)
                or not name.isprintable()):
            raise ConfigurationError(
                f"AgentRouter destination name {preview(name)} must be a plain str of 1 to "
                f"{MAX_ROUTE_CHARS} printable characters (it labels every metric of its "
                "route)")
        if name in RESERVED_ROUTES:
            raise ConfigurationError(
                f"AgentRouter destination name {name!r} is the router's own: "
                f"{RESERVED_ROUTES[name]}; name the destination otherwise")
        check_instance(f"destination {name!r}", agent)
        if (isinstance(agent, Destination) and not hasattr(agent, "_aid")
                and type(agent).routing_aid is Destination.routing_aid):
            # Else the first turn fails with "'X' object has no attribute '_aid'" (a
            # subclass with its own routing_aid needs no description from the base).
            raise ContractTypeError(
                f"AgentRouter destination {name!r} ({type(agent).__qualname__}) was never "
                "initialised as a Destination: its __init__ must call "
                "super().__init__(description)")
        if isinstance(agent, Destination) and type(agent).answer is Destination.answer:
            # Else every turn routed here fails with NotImplementedError (newcomer14).
            raise ContractTypeError(
                f"AgentRouter destination {name!r} ({type(agent).__qualname__}) does not "
                "implement answer(): a Destination subclass defines "
                "`async def answer(self, turn, *, started)`")
        for method in ("routing_aid", "admit", "answer", "release"):
            if not callable(getattr(agent, method, None)):
                raise ContractTypeError(
                    f"AgentRouter destination {name!r} has no {method}() method: "
                    "it is not a RoutableAgent"
                )
        agents[name] = agent
    return agents


class RouterConfig:
    """The router's validated settings (read-only after construction)."""

    __slots__ = (
        "admission_timeout", "agents", "aid_failures", "budget", "clarification_text",
        "cleanup", "clock", "control_reports",
        "decision_failures", "decisions", "default", "failure_text", "initialize", "load",
        "max_departed_participants",
        "max_history_exchanges", "max_participants", "max_patch_bytes", "max_pending",
        "max_waiting_turns",
        "observer", "output", "overflows", "release_timeout", "routes", "runtime_topics",
        "set_status", "timed", "timer", "timing_sink", "unawaited", "unstarted",
    )

    def __init__(
        self,
        destinations: Mapping[str, RoutableAgent],
        decisions: DecisionService,
        *,
        output: OutputCallback | None,
        default_destination: str,
        context_budget_bytes: int,
        acknowledgment_llm: LLMService | None,
        acknowledgment_delay_secs: float | None,
        topics: dict[str, Any],
        initialize_participant: ParticipantCallback | None,
        cleanup_participant: ParticipantCallback | None,
        set_status: StatusCallback | None,
        timeouts: tuple[float | None, float | None],
        telemetry: RouterObserver | None,
        clarification_text: str,
        failure_text: str,
        acknowledgment_policy: AcknowledgmentPolicy | None,
        timing_predictor: TimingPredictor | None,
        timing_sink: TimingSink | None,
        clock: Clock | None,
        max_pending_patches: int,
        limits: Mapping[str, float | int],
        overload: OverloadPolicy | None,
        acknowledgment_route_delays: Mapping[str, float] | None = None,
    ) -> None:
        agents = _agents(destinations)
        for name, value in (("decisions", decisions), ("acknowledgment_llm", acknowledgment_llm),
                            ("telemetry", telemetry), ("overload", overload),
                            ("acknowledgment_policy", acknowledgment_policy),
                            ("timing_predictor", timing_predictor),
                            ("timing_sink", timing_sink), ("clock", clock)):
            check_instance(name, value)
        if not callable(getattr(decisions, "decide", None)):
            raise ContractTypeError(
                f"AgentRouter decisions must have an async decide(request) method, "
                f"got {type(decisions).__name__}"
            )
        fallback_route = getattr(decisions, "fallback_route", None)
        if isinstance(fallback_route, str) and fallback_route not in agents:
            # A typo here is otherwise silent: the queries no route fits are clarified.
            raise ConfigurationError(
                f"AgentRouter decisions' fallback_route {fallback_route[:100]!r} is not a "
                f"registered destination (registered: {sorted(agents)[:20]}): the queries "
                "no route fits would be clarified instead of reaching it")
        _warn_unknown_example_routes(decisions, agents)
        if not isinstance(default_destination, str):
            raise ContractTypeError("AgentRouter default_destination must be a str")
        if default_destination not in agents and default_destination is not CONVERSATION:
            raise ConfigurationError(
                f"AgentRouter default_destination {default_destination!r} is not a registered "
                f"destination (registered: {sorted(agents)})"
            )
        _check_positive("context_budget_bytes", context_budget_bytes, integer=True)
        _check_positive("max_pending_patches", max_pending_patches, integer=True)
        for limit, bound in limits.items():
            _check_positive(limit, bound, integer=limit != "release_timeout_secs")
        if (acknowledgment_llm is None) != (acknowledgment_delay_secs is None):
            raise ConfigurationError(
                "AgentRouter acknowledgment_llm and acknowledgment_delay_secs must be "
                "supplied together"
            )
        route_delays = _route_delays(acknowledgment_route_delays, agents,
                                     acknowledgment_delay_secs)
        if acknowledgment_delay_secs is not None:
            _check_delay("acknowledgment_delay_secs", acknowledgment_delay_secs)
            if not callable(getattr(acknowledgment_llm, "complete", None)):
                raise ContractTypeError(
                    "AgentRouter acknowledgment_llm must have an async complete() method"
                )
        admission_timeout_secs, decision_timeout_secs = timeouts
        if admission_timeout_secs is not None:
            _check_positive("admission_timeout_secs", admission_timeout_secs)
        if decision_timeout_secs is not None:
            _check_positive("decision_timeout_secs", decision_timeout_secs)
            # Wrapped once here: a router without the bound pays nothing per turn.
            decisions = _TimedDecisions(decisions, decision_timeout_secs)
        check_callable("output", output)
        check_callable("initialize_participant", initialize_participant)
        check_callable("cleanup_participant", cleanup_participant)
        check_callable("set_status", set_status)
        for name, text in (("clarification_text", clarification_text),
                           ("failure_text", failure_text)):
            if not isinstance(text, str) or not text:
                raise ConfigurationError(f"AgentRouter {name} must be a non-empty str")
        #: Decision-service failures so far (the one count kept here, beside `load`):
        #: logged at the 1st, 10th, 100th..., since an outage fails every turn.
        self.decision_failures = 0
        #: `routing_aid()` calls that raised, logged the same way (`_turn._aid_failed`).
        self.aid_failures = 0
        self.runtime_topics: dict[str, Any] | None = None
        if any(topic is not None for topic in topics.values()):
            # The runtime package validates its own topics (the contract's ValueError /
            # TypeError); plain handle() use never imports it.
            runtime = importlib.import_module("turnrouter.runtime")
            self.runtime_topics = runtime.validate_topics(topics)
        if telemetry is None:
            telemetry = importlib.import_module("turnrouter.telemetry").Telemetry()
        elif not isinstance(telemetry, RouterObserver):
            raise ContractTypeError(
                f"AgentRouter telemetry must be a Telemetry or RouterObserver, "
                f"got {type(telemetry).__name__}"
            )
        if overload is not None and not isinstance(overload, OverloadPolicy):
            raise ContractTypeError(
                f"AgentRouter overload must be an OverloadPolicy or None, "
                f"got {type(overload).__name__}")
        if acknowledgment_policy is not None and not isinstance(
            acknowledgment_policy, AcknowledgmentPolicy
        ):
            raise ContractTypeError("AgentRouter acknowledgment_policy must be an "
                                    "AcknowledgmentPolicy")
        for name, value, method in (("timing_predictor", timing_predictor, "predict"),
                                    ("timing_sink", timing_sink, "record"),
                                    ("clock", clock, "sleep_until")):
            if value is not None and not callable(getattr(value, method, None)):
                raise ContractTypeError(
                    f"AgentRouter {name} has no {method}() method, got {type(value).__name__}")

        self.agents = agents
        self.routes = tuple(agents)
        self.decisions = decisions
        self.output = output
        #: None when the implicit "conversation" default is not registered: unavailable.
        self.default: str | None = (
            str(default_destination) if default_destination in agents else None)
        self.budget = context_budget_bytes
        self.initialize = initialize_participant
        self.cleanup = cleanup_participant
        self.set_status = set_status
        self.admission_timeout = admission_timeout_secs
        self.observer: RouterObserver = telemetry
        self.clarification_text = clarification_text
        self.failure_text = failure_text
        self.max_pending = max_pending_patches
        self.max_history_exchanges = int(limits["max_history_exchanges"])
        self.max_waiting_turns = int(limits["max_waiting_turns"])
        self.max_departed_participants = int(limits["max_departed_participants"])
        self.max_participants = int(limits["max_participants"])
        self.max_patch_bytes = int(limits["max_patch_bytes"])
        self.release_timeout = float(limits["release_timeout_secs"])
        self.overflows = Overflows(telemetry)
        #: The clock the router's own timers sleep on (a test's `ManualClock`).
        self.timer: Clock = clock or SystemClock()
        self.load = LoadMonitor(overload, telemetry, self.timer)
        self.timing_sink = timing_sink
        #: A front end reported control text heard (`mark_heard(control=True)`): from
        #: then on, control text not reported heard before its answer was not heard.
        self.control_reports = False
        #: Routes whose answer() returned without calling started() (warned once each).
        self.unstarted: set[str] = set()
        #: Routes whose answer() was told to `await started()` (said once per route).
        self.unawaited: set[str] = set()
        self.clock: Callable[[], float] = time.perf_counter if clock is None else clock.now
        self.timed: TimingEngine | None = None
        if acknowledgment_llm is not None or timing_predictor is not None or (
            timing_sink is not None
        ):
            policy = acknowledgment_policy or AcknowledgmentPolicy()
            if timing_predictor is None and acknowledgment_llm is not None:
                timing_predictor = RouteTimingPredictor(
                    delay_secs=acknowledgment_delay_secs, early_secs=policy.early_secs,
                    generation_secs=policy.expected_generation_secs)
            self.timed = TimingEngine(
                llm=acknowledgment_llm, delay=acknowledgment_delay_secs, policy=policy,
                route_delays=route_delays,
                predictor=timing_predictor, sink=timing_sink, clock=clock or SystemClock(),
                observer=telemetry, agents=agents,
            )
            self.clock = self.timed.clock.now
        telemetry.configured(Configured(self.routes, acknowledgment_delay_secs,
                                        tuple(sorted((route_delays or {}).items()))))
        if self.timed is not None:
            self.timed.publish_estimates(self.routes)

    @property
    def joined_topic(self) -> bool:
        """Whether a participant-joined topic readmits departed participants."""
        return self.runtime_topics is not None and (
            "participant_joined_topic" in self.runtime_topics)


def _warn_unknown_example_routes(decisions: object, agents: Mapping[str, Any]) -> None:
    """A WARNING naming the routes the decision service has examples for that are no
    registered destination: a typo in an example key (`"conversaton"`) silently left
    that route without its examples (voice17 F7); the same for the routes a routing
    policy names (newcomer18 F8: reported only at the first turn that hit one). Not an
    error: one decision service may serve routers with different destinations."""
    for attribute, what, effect in (
            ("example_routes", "has examples for",
             "a typo in an example key leaves that route without its examples"),
            ("policy_routes", "has a routing policy naming",
             "a typo in the policy sends those participants to the fallback service")):
        routes = getattr(decisions, attribute, ())
        if not isinstance(routes, tuple):
            continue
        unknown = [route for route in routes if isinstance(route, str) and route not in agents]
        if unknown:
            logger.warning("turnrouter: the decision service %s %s, which no registered "
                           "destination is (registered: %s): %s", what,
                           [route[:100] for route in unknown[:10]], sorted(agents)[:20],
                           effect)

