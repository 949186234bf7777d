"""Hypothesis state machine: random turns, dispositions, eligibility changes, interrupts,
departures and stops for several participants, checked against a small reference model.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from turnrouter import (
    Admission,
    AgentExchange,
    AgentRouter,
    AgentTurn,
    DestinationResult,
    RouteDecision,
    RouteRequest,
    RoutingAid,
    TurnInterrupted,
)
from turnrouter.testing import OutputRecorder, RecordingObserver

ROUTES = ("a", "b", "conversation")
DEFAULT = "conversation"
PARTICIPANTS = ("p1", "p2", "p3")
BUDGET = 40

dispositions = st.sampled_from(["accept", "accept", "accept", "decline", "decline", "clarify",
                                "release"])
results = st.sampled_from(["answer", "focus", "focus", "release"])
choices = st.one_of(st.sampled_from([*ROUTES, *ROUTES, "clarify", "ghost"]),
                    st.dictionaries(st.sampled_from([*ROUTES, "ghost"]),
                                    st.floats(0, 1), min_size=1, max_size=3))


class ModelAgent:
    """A destination driven by the state machine: per-turn admission and result."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.eligible = True
        self.admission = "accept"
        self.result = "answer"
        self.releases: Counter[str] = Counter()
        self.gate: anyio.Event | None = None
        self.entered: anyio.Event | None = None

    def routing_aid(self, participant_id: str) -> RoutingAid:
        return RoutingAid(self.name, f"{self.name} things", eligible=self.eligible)

    async def admit(self, turn: AgentTurn, *, focused: bool) -> Admission:
        return Admission(self.admission, text=f"{self.name} says")  # type: ignore[arg-type]

    async def answer(
        self, turn: AgentTurn, *, started: Callable[[], Awaitable[None]]
    ) -> DestinationResult:
        if self.entered is not None:
            self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        await started()
        return DestinationResult(self.result, text=f"{self.name}:{turn.query}")  # type: ignore[arg-type]

    async def release(self, participant_id: str) -> None:
        self.releases[participant_id] += 1


@dataclass
class Expected:
    disposition: str
    answered_by: str | None = None
    releases: list[str] = field(default_factory=list)


class RouterMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.agents = {name: ModelAgent(name) for name in ROUTES}
        self.script: list[str | dict[str, float]] = []
        self.router = self.run(self._make_router())
        self.focus: dict[str, str | None] = {}
        self.history: dict[str, list[AgentExchange]] = {}
        self.used: dict[str, set[str]] = {}
        self.releases: Counter[tuple[str, str]] = Counter()
        self.count = 0

    async def _make_router(self) -> AgentRouter:
        async def decide(request: RouteRequest) -> RouteDecision:
            spec = self.script.pop(0)
            if isinstance(spec, dict):
                return RouteDecision("clarify", scores=spec)
            return RouteDecision(spec)

        class Decisions:
            async def decide(self, request: RouteRequest) -> RouteDecision:
                return await decide(request)

        return AgentRouter(self.agents, Decisions(), output=OutputRecorder(),
                           default_destination=DEFAULT, context_budget_bytes=BUDGET,
                           telemetry=RecordingObserver(),
                           # (no admission control: on a loaded machine its lag sampler
                           # shed a turn the model expected, RouterBusyError)
                           overload=None)

    def run(self, coro: Awaitable[AgentRouter] | Awaitable[None]) -> AgentRouter:
        return self.loop.run_until_complete(coro)  # type: ignore[return-value]

    def teardown(self) -> None:
        self.loop.run_until_complete(self.router.stop())
        self.loop.close()

    # ------------------------------------------------------------ the reference model

    def model_turn(self, pid: str, picks: list[str | dict[str, float]],
                   upto_answer: bool = False) -> Expected:
        """Apply the contract's rules to the model; returns what should happen."""
        agents = self.agents
        used = self.used.setdefault(pid, set())
        excluded: set[str] = set()
        releases: list[str] = []
        owner = self.focus.get(pid)

        def answer(route: str) -> Expected:
            used.add(route)
            if upto_answer:
                return Expected("interrupted", route, releases)
            result = agents[route].result
            exchange = AgentExchange(query, f"{route}:{query}")
            self.history[pid] = _trim([*self.history.get(pid, []), exchange])
            if result == "focus" and self.focus.get(pid) != route:
                previous = self.focus.get(pid)
                self.focus[pid] = route
                if previous is not None:
                    releases.append(previous)
            elif result == "release" and self.focus.get(pid) is not None:
                # "consumes this turn and clears focus", whoever held it
                releases.append(self.focus[pid])  # type: ignore[arg-type]
                self.focus[pid] = None
            return Expected(result, route, releases)

        query = self.query
        if owner is not None:
            if not agents[owner].eligible:
                self.focus[pid] = None
                releases.append(owner)
            else:
                used.add(owner)
                disposition = agents[owner].admission
                if disposition == "accept":
                    return answer(owner)
                if disposition == "clarify":
                    return Expected("clarify", None, releases)
                excluded.add(owner)
                if disposition == "release":
                    self.focus[pid] = None
                    releases.append(owner)
        attempts = 0
        declined = False  # a routed choice declined: nothing chosen after it -> default
        for spec in picks[:2]:
            candidates = [r for r in ROUTES if agents[r].eligible and r not in excluded]
            if not candidates:
                break
            attempts += 1
            self.script.append(spec)
            chosen = _resolve(spec, candidates)
            if chosen is None:
                if declined:
                    break
                return Expected("clarify", None, releases)
            used.add(chosen)
            disposition = agents[chosen].admission
            if disposition == "accept":
                return answer(chosen)
            if disposition == "clarify":
                return Expected("clarify", None, releases)
            excluded.add(chosen)
            declined = declined or disposition == "decline"
            if disposition == "release":
                if self.focus.get(pid) == chosen:
                    self.focus[pid] = None
                releases.append(chosen)
        if attempts and agents[DEFAULT].eligible and DEFAULT not in excluded:
            return answer(DEFAULT)
        return Expected("clarify", None, releases)

    # ------------------------------------------------------------ rules

    def _configure(self, admissions: list[str], outcomes: list[str]) -> None:
        for agent, admission, result in zip(self.agents.values(), admissions, outcomes,
                                            strict=True):
            agent.admission, agent.result = admission, result

    @rule(pid=st.sampled_from(PARTICIPANTS), query=st.text("xyz", min_size=1, max_size=12),
          admissions=st.lists(dispositions, min_size=3, max_size=3),
          outcomes=st.lists(results, min_size=3, max_size=3),
          picks=st.lists(choices, min_size=2, max_size=2))
    def turn(self, pid: str, query: str, admissions: list[str], outcomes: list[str],
             picks: list[str | dict[str, float]]) -> None:
        self._configure(admissions, outcomes)
        self.query = query
        self.script.clear()
        expected = self.model_turn(pid, picks)
        for route in expected.releases:
            self.releases[(route, pid)] += 1
        self.count += 1
        result = self.loop.run_until_complete(
            self.router.handle(AgentTurn(pid, f"t{self.count}", query)))
        assert result.disposition == expected.disposition
        assert self.script == []  # the router asked exactly as often as the model

    @rule(pid=st.sampled_from(PARTICIPANTS), query=st.text("xyz", min_size=1, max_size=12),
          admissions=st.lists(st.sampled_from(["accept", "decline", "release"]),
                              min_size=3, max_size=3),
          picks=st.lists(choices, min_size=2, max_size=2))
    def interrupted_turn(self, pid: str, query: str, admissions: list[str],
                         picks: list[str | dict[str, float]]) -> None:
        self._configure(admissions, ["answer"] * 3)
        self.query = query
        self.script.clear()
        expected = self.model_turn(pid, picks, upto_answer=True)
        for route in expected.releases:
            self.releases[(route, pid)] += 1
        self.count += 1
        turn = AgentTurn(pid, f"t{self.count}", query)
        if expected.answered_by is None:  # nothing to interrupt: the turn clarifies
            self.loop.run_until_complete(self.router.handle(turn))
            return
        agent = self.agents[expected.answered_by]

        async def scenario() -> BaseException | None:
            agent.gate, agent.entered = anyio.Event(), anyio.Event()
            outcome: list[BaseException | None] = []

            async def call() -> None:
                try:
                    await self.router.handle(turn)
                    outcome.append(None)
                except TurnInterrupted as exc:
                    outcome.append(exc)

            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(call)
                    await agent.entered.wait()
                    await self.router.interrupt(pid)
            finally:
                agent.gate = agent.entered = None
            return outcome[0]

        assert isinstance(self.loop.run_until_complete(scenario()), TurnInterrupted)

    @rule(route=st.sampled_from(ROUTES), eligible=st.booleans())
    def set_eligibility(self, route: str, eligible: bool) -> None:
        self.agents[route].eligible = eligible

    @precondition(lambda self: bool(self.used))
    @rule(data=st.data())
    def participant_leaves(self, data: st.DataObject) -> None:
        pid = data.draw(st.sampled_from(sorted(self.used)))
        for route in self.used.pop(pid):
            self.releases[(route, pid)] += 1
        self.focus.pop(pid, None)
        self.history.pop(pid, None)
        self.loop.run_until_complete(self.router.participant_left(pid))

    @rule()
    def stop(self) -> None:
        for pid, routes in self.used.items():
            for route in routes:
                self.releases[(route, pid)] += 1
        self.used.clear()
        self.focus.clear()
        self.history.clear()
        self.loop.run_until_complete(self.router.stop())
        pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
        assert pending == []

    # ------------------------------------------------------------ invariants

    @invariant()
    def focus_matches_model(self) -> None:
        for pid in PARTICIPANTS:
            owner = self.router.focus_of(pid)
            assert owner == self.focus.get(pid)
            assert owner is None or owner in ROUTES

    @invariant()
    def history_is_budgeted_suffix(self) -> None:
        for pid in PARTICIPANTS:
            history = list(self.router.history_of(pid))
            assert history == self.history.get(pid, [])
            assert sum(e.size_bytes() for e in history) <= BUDGET

    @invariant()
    def releases_match_contract(self) -> None:
        actual = Counter({(agent.name, pid): n for agent in self.agents.values()
                          for pid, n in agent.releases.items() if n})
        expected = Counter({key: n for key, n in self.releases.items() if n})
        assert actual == expected


def _resolve(spec: str | dict[str, float], candidates: list[str]) -> str | None:
    if isinstance(spec, str):
        if spec in candidates:
            return spec
        return None
    best: str | None = None
    for route in candidates:  # equal priority: the first of the highest wins
        if route in spec and (best is None or spec[route] > spec[best]):
            best = route
    return best


def _trim(history: list[AgentExchange]) -> list[AgentExchange]:
    while sum(e.size_bytes() for e in history) > BUDGET:
        history = history[1:]
    return history


RouterMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=30,
                                           deadline=None)
TestRouterStateMachine = RouterMachine.TestCase
