"""A newcomer's app: a default destination, five examples per route, chit-chat.

Greetings must reach the default destination (with `fallback_route`) or a clarification
(without), never a domain route on a near-zero score; clear domain queries still reach
their domain. Run through the real router, as an application would.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnrouter import (
    CLARIFY,
    AgentRouter,
    AgentTurn,
    ConfigurationError,
    DecisionService,
    RouteRequest,
    RoutingAid,
)
from turnrouter.decisions import DictRoutingPolicy, LexicalDecisions, PolicyDecisions
from turnrouter.testing import OutputRecorder, RecordingObserver, ScriptedAgent

EXAMPLES = {
    "weather": ["what's the weather like today", "will it rain tomorrow",
                "is it going to be sunny this weekend", "how cold is it outside",
                "what's the forecast for tonight"],
    "billing": ["why was I charged twice", "I need a copy of my invoice",
                "update my credit card on file", "what is my current balance",
                "I want a refund for last month"],
    "small_talk": ["hello", "how are you doing", "tell me a joke", "thank you so much",
                   "good night"],
}
CHIT_CHAT = ["hi there", "good morning", "thanks, how are you?", "hey", "what's up",
             "nice to meet you", "good evening"]
DOMAIN = [("will it rain this weekend", "weather"),
          ("what's the weather forecast for tomorrow", "weather"),
          ("is it cold today", "weather"),
          ("I was charged twice on my invoice", "billing"),
          ("I want a refund", "billing"),
          ("what is my balance", "billing")]


class App:
    """Three destinations, `LexicalDecisions`, `default_destination="small_talk"`."""

    def __init__(self, decisions: LexicalDecisions, *, small_talk_eligible: bool = True) -> None:
        self.agents = {
            "weather": ScriptedAgent("weather", "Weather forecasts."),
            "billing": ScriptedAgent("billing", "Invoices, charges and payments."),
            "small_talk": ScriptedAgent("small_talk", "Chit-chat.",
                                        eligible=small_talk_eligible),
        }
        self.observer = RecordingObserver()
        self.router = AgentRouter(self.agents, decisions, output=OutputRecorder(),
                                  default_destination="small_talk", telemetry=self.observer)
        self.turns = 0

    async def say(self, query: str) -> tuple[str, str | None]:
        """(the destination that answered, or "clarify"; the clarification reason)."""
        self.turns += 1
        turn_id = f"t{self.turns}"
        before = {name: agent.count("answer") for name, agent in self.agents.items()}
        result = await self.router.handle(AgentTurn("p1", turn_id, query))
        answered = [name for name, agent in self.agents.items()
                    if agent.count("answer") > before[name]]
        reasons = [event[1] for event in self.observer.turns[turn_id]
                   if event[0] == "clarification"]
        if result.disposition == "clarify":
            assert answered == []
            return CLARIFY, reasons[0]
        assert len(answered) == 1
        return answered[0], None


@pytest.mark.anyio
async def test_chit_chat_reaches_the_fallback_route_and_domain_queries_their_domain() -> None:
    app = App(LexicalDecisions(EXAMPLES, fallback_route="small_talk"))
    try:
        for query in CHIT_CHAT:
            assert await app.say(query) == ("small_talk", None), query
        for query, route in DOMAIN:
            assert await app.say(query) == (route, None), query
    finally:
        await app.router.stop()


@pytest.mark.anyio
async def test_without_a_fallback_route_chit_chat_is_clarified_never_sent_to_a_domain() -> None:
    app = App(LexicalDecisions(EXAMPLES))
    try:
        for query in CHIT_CHAT:
            route, reason = await app.say(query)
            assert route in {"small_talk", CLARIFY}, query
            assert reason in {None, "low_confidence"}
        for query, expected in DOMAIN:
            assert await app.say(query) == (expected, None), query
    finally:
        await app.router.stop()


@pytest.mark.anyio
async def test_an_ineligible_fallback_route_clarifies() -> None:
    """The fallback must be a candidate: an ineligible one leaves "clarify" with no
    usable scores, which the router turns into a clarification question."""
    app = App(LexicalDecisions(EXAMPLES, fallback_route="small_talk"),
              small_talk_eligible=False)
    try:
        assert await app.say("hi there") == (CLARIFY, "low_confidence")
        assert await app.say("will it rain this weekend") == ("weather", None)
    finally:
        await app.router.stop()


@pytest.mark.parametrize("wrap", [False, True], ids=["lexical", "policy"])
def test_a_fallback_route_the_router_does_not_register_is_refused(wrap: bool) -> None:
    """A typo in `fallback_route` would be silent (every greeting clarified): the router
    refuses it at construction, naming it and the registered routes, also through a
    `PolicyDecisions` wrapping the service."""
    decisions: DecisionService = LexicalDecisions(EXAMPLES, fallback_route="smal_talk")
    if wrap:
        decisions = PolicyDecisions(DictRoutingPolicy({}), decisions)
        assert decisions.fallback_route == "smal_talk"
    agents = {name: ScriptedAgent(name) for name in EXAMPLES}
    with pytest.raises(ConfigurationError, match=r"fallback_route 'smal_talk' is not a "
                       r"registered destination \(registered: \['billing', 'small_talk'"):
        AgentRouter(agents, decisions, output=OutputRecorder(), default_destination="small_talk")
    AgentRouter(agents, LexicalDecisions(EXAMPLES, fallback_route="small_talk"),
                output=OutputRecorder(), default_destination="small_talk")


def test_the_fallback_decision_keeps_every_score_and_says_why() -> None:
    service = LexicalDecisions(EXAMPLES, fallback_route="small_talk")
    aids = tuple(RoutingAid(name, "") for name in EXAMPLES)
    decision = service.score(RouteRequest(AgentTurn("p", "t", "hi there"), aids))
    assert decision.choice == "small_talk"
    assert set(decision.scores) == set(EXAMPLES)
    assert decision.confidence == max(decision.scores.values())
    assert decision.confidence < service.min_example_score
    assert decision.rationale.startswith("lexical: fallback small_talk")
    assert service.fallback_route == "small_talk"


@settings(max_examples=60, deadline=None)
@given(value=st.one_of(st.none(), st.text(max_size=40), st.builds(lambda n: "x" * n,
                                                                    st.integers(1, 10**6)),
                       st.integers(), st.floats(allow_nan=True), st.booleans(),
                       st.binary(max_size=5), st.lists(st.text(max_size=3), max_size=2)))
def test_fallback_route_is_a_route_name_or_none(value: object) -> None:
    """Junk is refused naming the argument; any name is accepted (it may be a route
    added later) and only used while it is a candidate."""
    if value is None or (isinstance(value, str) and value):
        service = LexicalDecisions(EXAMPLES, fallback_route=value)
        aids = tuple(RoutingAid(name, "") for name in EXAMPLES)
        decision = service.score(RouteRequest(AgentTurn("p", "t", "hi there"), aids))
        assert decision.choice == (value if value in EXAMPLES else CLARIFY)
        return
    with pytest.raises(ConfigurationError, match="fallback_route"):
        LexicalDecisions(EXAMPLES, fallback_route=value)  # type: ignore[arg-type]


def test_a_clarify_for_a_small_margin_keeps_only_the_usable_scores() -> None:
    """min_margin answers "clarify" above the floor: the scores kept are the candidates
    at or above their floor (the router asks the best of them), none under it."""
    service = LexicalDecisions(EXAMPLES, min_margin=1.0)
    aids = tuple(RoutingAid(name, "") for name in EXAMPLES)
    request = RouteRequest(AgentTurn("p", "t", "will it rain this weekend"), aids)
    decision = service.score(request)
    every = service.score(request, keep_scores=True).scores
    assert decision.choice == CLARIFY
    assert "under 1.00" in decision.rationale
    assert dict(decision.scores) == {name: value for name, value in every.items()
                                     if value >= service.min_example_score}
    assert max(decision.scores, key=decision.scores.__getitem__) == "weather"


def test_with_many_examples_an_uncertain_query_is_asked_of_its_best_route() -> None:
    """With 50+ examples per route (the demo's sample), a query between the usable floor
    and the confidence floor is a "clarify" that keeps its usable scores (the router asks
    the best of them, whose admission decides), while a query sharing nothing with any
    route goes to the fallback route: the demo's domains keep their uncertain traffic."""
    from turnrouter.demo import DESCRIPTIONS, load_sample

    sample = load_sample()
    service = LexicalDecisions(examples=sample.examples, fallback_route="conversation")
    assert service.min_usable_score < service.min_example_score
    aids = tuple(RoutingAid(route, DESCRIPTIONS[route]) for route in
                 [*sample.examples, "conversation"])
    bands = {"confident": 0, "uncertain": 0, "fallback": 0}
    for number, (text, _domain, _) in enumerate(sample.queries):
        decision = service.score(RouteRequest(AgentTurn("p", f"t{number}", text), aids,
                                              frozenset()))
        top = decision.confidence or 0.0
        every = service.score(RouteRequest(AgentTurn("p", f"t{number}", text), aids,
                                           frozenset()), keep_scores=True).scores
        if max(every, key=lambda route: every[route]) == "conversation":
            continue  # scored from its description: one floor, no uncertain band
        if top >= service.min_example_score:
            assert decision.choice != CLARIFY
            bands["confident"] += 1
        elif top >= service.min_usable_score:
            assert decision.choice == CLARIFY
            assert decision.scores
            assert min(decision.scores.values()) >= service.min_usable_score
            bands["uncertain"] += 1
        else:
            assert decision.choice == "conversation"
            bands["fallback"] += 1
    assert all(bands.values()), bands


def test_min_usable_score_is_checked_and_never_above_the_floor() -> None:
    with pytest.raises(ConfigurationError, match="min_usable_score"):
        LexicalDecisions(EXAMPLES, min_usable_score=1.5)
    service = LexicalDecisions(EXAMPLES, min_example_score=0.2, min_usable_score=0.6)
    assert service.min_usable_score == 0.2
    few_shot = LexicalDecisions(EXAMPLES)
    assert few_shot.min_usable_score == few_shot.min_example_score
