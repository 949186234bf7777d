"""The simulated deployment: CLINC150 domains as destinations, with realistic habits.

Each destination answers after a route-specific first-response latency (fast small
talk, slow travel booking, a bimodal banking back end), declines queries outside its
domain at admission, sometimes asks to clarify, and the travel agent keeps focus
through a booking's follow-ups.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

import anyio

from .._contracts import Admission, AgentTurn, DestinationResult, RoutingAid
from .._exceptions import ConfigurationError, LifecycleError
from .._patches import ContextPatch

if TYPE_CHECKING:
    from .._router import AgentRouter

__all__ = [
    "DESCRIPTIONS",
    "LATENCIES",
    "Latency",
    "Sample",
    "SimulatedAgent",
    "SimulatedOutage",
    "build_agents",
    "load_sample",
]


class SimulatedOutage(RuntimeError):
    """A back end of a simulated destination failed (the demo expects a few)."""

DESCRIPTIONS: dict[str, str] = {
    "banking": "Bank accounts: balances, transfers, bills, transactions, fraud, PIN and "
               "routing numbers.",
    "credit_cards": "Credit cards: limits, rewards, APR, lost, damaged or declined cards, "
                    "credit score.",
    "kitchen_and_dining": "Cooking and food: recipes, ingredients, substitutes, nutrition, "
                          "restaurant reservations and reviews.",
    "home": "Home and errands: shopping and todo lists, reminders, calendar, smart home "
            "devices.",
    "auto_and_commute": "Cars and commuting: traffic, directions, gas, tires, oil, "
                        "maintenance, insurance, rides.",
    "travel": "Travel: flights, hotels, car rentals, visas, luggage, travel alerts, "
              "exchange rates, translation.",
    "utility": "Everyday utilities: weather, time, date, alarms, timers, calculator, "
               "measurements, spelling, definitions.",
    "work": "Work: meetings, schedules, payday, taxes, PTO, benefits, direct deposit.",
    "small_talk": "Small talk: greetings, jokes, the assistant's name, origin, age and "
                  "hobbies, thanks.",
    "meta": "Assistant settings: change its name, voice, language, accent, repeat, "
            "sync, reset, cancel.",
    "conversation": "General conversation for anything the other destinations do not "
                    "cover.",
}

DEFAULT_ROUTE = "conversation"
BOOKING_INTENTS = frozenset({"book_flight", "book_hotel", "car_rental", "travel_suggestion",
                             "international_visa", "travel_notification"})


@dataclass(frozen=True)
class Sample:
    """The shipped CLINC150 sample: routing examples and demo queries."""

    examples: dict[str, list[str]]
    queries: list[tuple[str, str, str]]  # (text, domain or "oos", intent)

    @property
    def domains(self) -> list[str]:
        return sorted(self.examples)


def load_sample() -> Sample:
    """Read the CLINC150 sample shipped in the package (CC BY 3.0, see NOTICE.md)."""
    text = resources.files("turnrouter.demo").joinpath("data/clinc150_sample.jsonl").read_text(
        encoding="utf-8")
    examples: dict[str, list[str]] = {}
    queries: list[tuple[str, str, str]] = []
    for line in text.splitlines():
        record = json.loads(line)
        if record["split"] == "example":
            examples.setdefault(record["domain"], []).append(record["text"])
        else:
            queries.append((record["text"], record["domain"], record["intent"]))
    return Sample(examples, queries)


@dataclass(frozen=True)
class Latency:
    """First-response latency: log-normal around `median`, optionally bimodal."""

    median: float
    spread: float = 0.35
    slow_share: float = 0.0
    slow_median: float = 0.0

    def draw(self, rng: random.Random) -> float:
        if self.slow_share and rng.random() < self.slow_share:
            return rng.lognormvariate(math.log(self.slow_median), self.spread)
        return rng.lognormvariate(math.log(self.median), self.spread)


LATENCIES: dict[str, Latency] = {
    "small_talk": Latency(0.12, 0.3),
    "meta": Latency(0.15, 0.3),
    "utility": Latency(0.25, 0.35),
    "home": Latency(0.35, 0.35),
    "kitchen_and_dining": Latency(0.6, 0.4),
    "auto_and_commute": Latency(0.5, 0.4),
    "work": Latency(0.45, 0.35),
    "credit_cards": Latency(0.5, 0.3, slow_share=0.3, slow_median=1.6),
    "banking": Latency(0.4, 0.3, slow_share=0.35, slow_median=1.8),
    "travel": Latency(1.6, 0.35),
    "conversation": Latency(0.7, 0.4),
}
"""Each simulated destination's first-response latency model, by route (what the
histogram buckets are checked against: fast, slow and bimodal shapes)."""
#: A route made slow for alert rehearsal (`turnrouter demo --slow-route`): about 3 s to
#: start answering, p95 about 5 s, past every first-response threshold of the shipped rules.
SLOW_LATENCY = Latency(3.0, 0.3)

Publish = Callable[[AgentTurn, str, str], Awaitable[None]]


class SimulatedAgent:
    """A destination that behaves like a real one, at a pace set by `Latency`."""

    def __init__(self, name: str, *, rng: random.Random, truth: dict[str, tuple[str, str]],
                 publish: Publish, speed: float = 1.0, decline_share: float = 0.02,
                 clarify_share: float = 0.0, clarify_text: str = "",
                 failure_share: float = 0.0,
                 eligible: Callable[[str], bool] | None = None,
                 latency: Latency | None = None) -> None:
        self.name = name
        self.description = DESCRIPTIONS[name]
        self._rng = rng
        self._truth = truth
        self._publish = publish
        self._speed = speed
        self._decline_share = decline_share
        self._clarify_share = clarify_share
        self._clarify_text = clarify_text
        self._failure_share = failure_share
        self._eligible = eligible
        self._bookings: dict[str, int] = {}  # participant -> follow-ups left
        self.latency = LATENCIES[name] if latency is None else latency
        #: The two aids this agent ever returns (built once: they are immutable).
        self._aids = {
            True: RoutingAid(name, self.description),
            False: RoutingAid(name, self.description, eligible=False,
                              eligibility="unavailable"),
        }
        #: Set by the demo: where background work runs and which router gets its result.
        self.spawn: Callable[..., None] | None = None
        self.router: AgentRouter | None = None

    def routing_aid(self, participant_id: str) -> RoutingAid:
        eligible = True if self._eligible is None else self._eligible(participant_id)
        return self._aids[eligible]

    def _domain(self, turn: AgentTurn) -> tuple[str, str]:
        return self._truth.get(turn.query, ("oos", "oos"))

    async def admit(self, turn: AgentTurn, *, focused: bool) -> Admission:
        domain, _ = self._domain(turn)
        if self.name == DEFAULT_ROUTE:
            return Admission("accept")
        if focused and domain != self.name:
            if self._bookings.get(turn.participant_id, 0) > 0 and self._rng.random() < 0.5:
                return Admission("decline")  # mid-booking: keep focus, let this one pass
            self._bookings.pop(turn.participant_id, None)
            return Admission("release", text="Okay, I'll put your booking on hold.")
        if domain != self.name or self._rng.random() < self._decline_share:
            return Admission("decline")
        if self._clarify_share and self._rng.random() < self._clarify_share:
            return Admission("clarify", text=self._clarify_text)
        return Admission("accept")

    async def answer(
        self, turn: AgentTurn, *, started: Callable[[], Awaitable[None]]
    ) -> DestinationResult:
        await anyio.sleep(self.latency.draw(self._rng) / self._speed)
        if self._failure_share and self._rng.random() < self._failure_share:
            raise SimulatedOutage(f"{self.name} back end timed out")
        await started()
        _, intent = self._domain(turn)
        text = f"[{self.name}] Here is what I found about {intent.replace('_', ' ')}."
        await self._publish(turn, self.name, text)
        if self.name != "travel":
            return DestinationResult("answer", text=text)
        pid = turn.participant_id
        left = self._bookings.get(pid)
        if left is None and intent in BOOKING_INTENTS:
            self._bookings[pid] = self._rng.randint(1, 3)
            return DestinationResult("focus", text=text)
        if left is not None:
            if left <= 1:
                self._bookings.pop(pid, None)
                self._confirm_in_background(turn, intent)
                return DestinationResult(
                    "release", text=text + " I'll book it and let you know.")
            self._bookings[pid] = left - 1
            return DestinationResult("focus", text=text)
        return DestinationResult("answer", text=text)

    def _confirm_in_background(self, turn: AgentTurn, intent: str) -> None:
        """Start the slow part of a booking; its result comes back as a context patch."""
        router, spawn = self.router, self.spawn
        if router is None or spawn is None:
            return
        state = router.context_state(turn.participant_id)
        roll = self._rng.random()
        strategy = "append" if roll < 0.7 else "replace" if roll < 0.85 else "human_gated"
        patch = ContextPatch(
            task_id=f"booking-{turn.turn_id}", spawned_from_event_id=turn.turn_id,
            source_context_version=state.version, source_context_hash=state.hash,
            digest=(f"Your {intent.replace('_', ' ')} is confirmed.",
                    "The confirmation was sent by email."),
            facts={"intent": intent}, recommended_next_steps=("Add it to the calendar",),
        )
        delay = self._rng.uniform(0.5, 4.0) / self._speed
        spawn(self._deliver_patch, router, turn.participant_id, patch, strategy, delay)

    @staticmethod
    async def _deliver_patch(router: AgentRouter, participant_id: str, patch: ContextPatch,
                             strategy: str, delay: float) -> None:
        await anyio.sleep(delay)
        # The participant may have left meanwhile: refused, and counted by the router.
        with contextlib.suppress(LifecycleError):
            await router.apply_context_patch(participant_id, patch, strategy)

    async def release(self, participant_id: str) -> None:
        self._bookings.pop(participant_id, None)

    async def participant_left(self, participant_id: str) -> None:
        self._bookings.pop(participant_id, None)


def _not_a_guest(participant_id: str) -> bool:
    """Guests (seats ending in 7: `user-00007-<n>`, `user-00017-<n>`, ...) cannot change
    assistant settings. The seat, not the whole id: its last part counts the sessions
    of one seat, so a test of the id's last digit hit almost no one."""
    parts = participant_id.split("-")
    seat = parts[1] if len(parts) == 3 else participant_id
    return not seat.endswith("7")


def _down_for_maintenance(participant_id: str) -> bool:
    """The alert-testing scenario: the general agent is unavailable to everyone."""
    return False


def build_agents(sample: Sample, *, rng: random.Random, publish: Publish, speed: float,
                 clarify_heavy: bool, failing_routes: tuple[str, ...] = (),
                 slow_routes: tuple[str, ...] = ()) -> dict[str, SimulatedAgent]:
    """The ten CLINC150 domains plus the `conversation` default. For alert rehearsal, the
    answers of `failing_routes` all fail and `slow_routes` answer after `SLOW_LATENCY`
    (ConfigurationError naming an unknown route)."""
    truth = {text: (domain, intent) for text, domain, intent in sample.queries}
    agents: dict[str, SimulatedAgent] = {}
    names = [*sample.domains, DEFAULT_ROUTE]
    unknown = sorted((set(failing_routes) | set(slow_routes)) - set(names))
    if unknown:
        flag = "--fail-route" if unknown[0] in failing_routes else "--slow-route"
        raise ConfigurationError(f"{flag}: unknown demo route {unknown[0][:100]!r} "
                                 f"(choose from {', '.join(sorted(names))})")
    for name in names:
        clarify_share, clarify_text = 0.0, ""
        if name == "banking":
            clarify_share, clarify_text = 0.06, "Which account do you mean, checking or savings?"
        elif name == "credit_cards":
            clarify_share, clarify_text = 0.04, "Which card is this about?"
        eligible: Callable[[str], bool] | None = None
        if name == "meta":
            eligible = _not_a_guest
        if name == DEFAULT_ROUTE and clarify_heavy:
            eligible = _down_for_maintenance
        agents[name] = SimulatedAgent(
            name, rng=rng, truth=truth, publish=publish, speed=speed,
            decline_share=0.15 if clarify_heavy else 0.02,
            clarify_share=clarify_share, clarify_text=clarify_text, eligible=eligible,
            # The traffic service behind auto_and_commute times out now and then.
            failure_share=(1.0 if name in failing_routes
                           else 0.03 if name == "auto_and_commute" else 0.0),
            latency=SLOW_LATENCY if name in slow_routes else None,
        )
    return agents
