"""AgentRouter routing rules: focus, admission, bounded reroute, fallback, clarification."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import os
import subprocess
import sys
import warnings
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import MappingProxyType
from typing import Any

import anyio
import pytest

import turnrouter
from turnrouter import (
    Admission,
    AgentExchange,
    AgentRouter,
    AgentTurn,
    ConfigurationError,
    ContractTypeError,
    ContractValueError,
    DestinationContractError,
    DestinationResult,
    JsonLinesSink,
    LifecycleError,
    RouteDecision,
    RouteRequest,
    RoutingAid,
    TurnInterrupted,
    TurnObserver,
    current_turn_context,
)
from turnrouter.decisions import LexicalDecisions
from turnrouter.events import TurnStarted
from turnrouter.llm import TemplateAcknowledger
from turnrouter.telemetry import Telemetry
from turnrouter.testing import (
    ManualClock,
    OutputRecorder,
    RecordingObserver,
    ScriptedAgent,
    ScriptedDecisions,
    ScriptedLLM,
)

from .kit import Harness

FAILURE_TEXT = "Sorry, something went wrong. Please try again."
CLARIFICATION_TEXT = ("Sorry, I'm not sure I can help with that. "
                      "Could you say it another way?")

pytestmark = pytest.mark.anyio


# ---------------------------------------------------------------- ordinary routing


async def test_routes_to_the_chosen_destination_after_admission() -> None:
    """The chosen destination is admitted, then answers; its result is returned."""
    h = Harness(ScriptedAgent("weather"), decisions=ScriptedDecisions("weather"))
    result = await h.say("rain today?")
    assert result == DestinationResult("answer", "weather answer")
    assert h["weather"].methods() == ["admit", "answer"]
    assert h["weather"].calls[0].focused is False
    assert h["conversation"].calls == []


async def test_route_turn_refuses_callbacks_that_are_not_callable() -> None:
    """route_turn() names a non-callable `output` or `ending` before any turn starts;
    callable ones route the turn."""
    h = Harness(ScriptedAgent("weather"), decisions=ScriptedDecisions("weather"))
    with pytest.raises(ContractTypeError, match="route_turn output must be callable, got int"):
        await h.router.route_turn(h.turn("rain?"), output=42)  # type: ignore[arg-type]
    with pytest.raises(ContractTypeError, match="route_turn ending must be callable, got str"):
        await h.router.route_turn(h.turn("rain?"), ending="x")  # type: ignore[arg-type]
    assert h["weather"].calls == []
    routed = await h.router.route_turn(h.turn("rain?"), output=h.output, ending=h.output)
    assert routed.route == "weather" and routed.result.text == "weather answer"


async def test_a_result_check_sees_the_result_before_the_router_records_it() -> None:
    """route_turn(result_check=...) is called with the turn, the route and the result
    before the router records the answer: raising there fails the turn as an exception
    of answer() would (nothing in history, focus unchanged, the failure text only when
    started() was not called, the exception raised); passing changes nothing. A check
    that is not callable is named before any turn starts."""
    h = Harness(ScriptedAgent("weather", results="focus", call_started=False),
                decisions=ScriptedDecisions("weather"))
    with pytest.raises(ContractTypeError, match="route_turn result_check must be callable"):
        await h.router.route_turn(h.turn("x"), output=h.output, result_check=7)  # type: ignore[arg-type]
    seen: list[tuple[str, str, str]] = []

    def refuse(turn: AgentTurn, route: str, result: DestinationResult) -> None:
        seen.append((turn.query, route, result.disposition))
        raise ContractValueError("too long to carry")

    with pytest.raises(ContractValueError, match="too long to carry"):
        await h.router.route_turn(h.turn("rain?"), output=h.output, result_check=refuse)
    assert seen == [("rain?", "weather", "focus")]
    assert h.router.history_of("p1") == () and h.router.focus_of("p1") is None
    assert h.output.texts == [FAILURE_TEXT]

    def accept(turn: AgentTurn, route: str, result: DestinationResult) -> None:
        seen.append((turn.query, route, result.disposition))

    routed = await h.router.route_turn(h.turn("snow?"), output=h.output, result_check=accept)
    assert routed.result.text == "weather answer" and seen[-1] == ("snow?", "weather", "focus")
    assert [x.user for x in h.router.history_of("p1")] == ["snow?"]
    assert h.router.focus_of("p1") == "weather"


async def test_an_async_result_check_is_refused_not_skipped() -> None:
    """An `async def` result check returns a coroutine and would check nothing: the turn
    fails with a DestinationContractError saying to make it a plain function, nothing
    recorded, the coroutine closed (no "never awaited" warning). It used to pass every
    result unchecked (redteam7 D4)."""
    h = Harness(ScriptedAgent("weather", call_started=False),
                decisions=ScriptedDecisions("weather"))
    ran: list[str] = []

    async def refuse(turn: AgentTurn, route: str, result: DestinationResult) -> None:
        ran.append(route)  # never reached: the coroutine is closed unstarted
        raise ContractValueError("too long to carry")

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a coroutine never awaited would warn
        with pytest.raises(DestinationContractError, match="not async def"):
            await h.router.route_turn(h.turn("rain?"), output=h.output,
                                      result_check=refuse)  # type: ignore[arg-type]
        gc.collect()
    assert ran == [] and h.router.history_of("p1") == ()
    assert h.output.texts == [FAILURE_TEXT]


async def test_request_lists_eligible_candidates_in_registration_order() -> None:
    """The decision request holds eligible, non-excluded candidates in order."""
    h = Harness(ScriptedAgent("weather"), ScriptedAgent("calendar", eligible=False),
                ScriptedAgent("music"), decisions=ScriptedDecisions("music"))
    await h.say()
    request = h.decisions.requests[0]
    assert request.candidate_names == ("weather", "music", "conversation")
    assert request.excluded == frozenset()
    assert request.turn.query == "hello"


async def test_preamble_is_spoken_after_acceptance_before_the_answer() -> None:
    """An accepted admission's preamble is delivered before the destination's output."""
    h = Harness(ScriptedAgent("weather", admissions=Admission("accept", "Checking.")),
                decisions=ScriptedDecisions("weather"))
    h["weather"].output = h.output
    await h.say()
    assert h.output.texts == ["Checking.", "weather answer"]


async def test_preamble_of_a_declining_admission_is_never_spoken() -> None:
    """A preamble on a declined admission is not emitted."""
    h = Harness(ScriptedAgent("weather", admissions=Admission("decline", "Checking.")),
                ScriptedAgent("music"), decisions=ScriptedDecisions("weather", "music"))
    await h.say()
    assert "Checking." not in h.output.texts


async def test_decline_reroutes_once_excluding_the_declined_route() -> None:
    """A declined route is excluded from the one bounded reroute."""
    h = Harness(ScriptedAgent("weather", admissions="decline"), ScriptedAgent("music"),
                decisions=ScriptedDecisions("weather", "music"))
    result = await h.say()
    assert result.text == "music answer"
    assert h.decisions.requests[1].excluded == frozenset({"weather"})
    assert "weather" not in h.decisions.requests[1].candidate_names
    assert h["weather"].methods() == ["admit"]


async def test_two_declines_fall_back_to_default_without_admission() -> None:
    """After two declined routed choices the eligible default answers once, unadmitted."""
    h = Harness(ScriptedAgent("weather", admissions="decline"),
                ScriptedAgent("music", admissions="decline"),
                decisions=ScriptedDecisions("weather", "music"))
    result = await h.say()
    assert result.text == "conversation answer"
    assert h["conversation"].methods() == ["answer"]
    assert len(h.decisions.requests) == 2
    assert ("default_fallback", "conversation") in h.observer.turns["t1"]


@pytest.mark.parametrize("reroute", ["weather", "clarify", "ghost"])
async def test_a_decline_the_reroute_finds_nothing_after_falls_back_to_default(
        reroute: str) -> None:
    """The selected destination declined and the reroute chose nothing (a decision
    service naming the declined route again, `clarify` without scores, an unknown
    name): declines are exhausted, so the eligible default answers once without
    admission (the contract: "If selected destinations decline through those
    attempts, the configured eligible default gets one final answer attempt"), instead
    of asking a user whose one domain route declined to rephrase (contract18 F1)."""
    h = Harness(ScriptedAgent("weather", admissions="decline"),
                decisions=ScriptedDecisions("weather", reroute))
    result = await h.say()
    assert result.text == "conversation answer"
    assert h["conversation"].methods() == ["answer"]
    assert h["weather"].methods() == ["admit"]
    assert len(h.decisions.requests) == 2
    assert ("default_fallback", "conversation") in h.observer.turns["t1"]
    assert h.output.texts == []


async def test_nothing_chosen_after_a_release_or_a_focus_owners_decline_is_clarified(
        ) -> None:
    """Only a routed choice's decline makes the default's fallback: a release returns
    the query to ordinary routing, and the focus owner's admission is not a routing
    attempt, so a routing that then chooses nothing asks for clarification."""
    released = Harness(ScriptedAgent("weather", admissions="release"),
                       decisions=ScriptedDecisions("weather", "clarify"))
    assert (await released.say()).disposition == "clarify"
    assert released["conversation"].calls == []
    assert ("clarification", "low_confidence") in released.observer.turns["t1"]
    owner = Harness(ScriptedAgent("booking", admissions=["accept", "decline"],
                                  results="focus"),
                    decisions=ScriptedDecisions("booking", "clarify"))
    await owner.say("book")
    assert owner.router.focus_of("p1") == "booking"
    assert (await owner.say("what?")).disposition == "clarify"
    assert owner["conversation"].calls == []
    assert owner.router.focus_of("p1") == "booking"


async def test_default_that_declined_this_turn_is_not_retried() -> None:
    """If the default already declined this turn, exhausted declines end in clarification."""
    h = Harness(ScriptedAgent("conversation", admissions="decline"),
                ScriptedAgent("music", admissions="decline"),
                decisions=ScriptedDecisions("conversation", "music"))
    result = await h.say()
    assert result.disposition == "clarify"
    assert h["conversation"].methods() == ["admit"]
    assert ("clarification", "default_unavailable") in h.observer.turns["t1"]
    assert h.output.texts == [CLARIFICATION_TEXT]


async def test_ineligible_default_means_clarification_after_declines() -> None:
    """Exhausted declines with an ineligible default end in clarification."""
    h = Harness(ScriptedAgent("weather", admissions="decline"),
                ScriptedAgent("music", admissions="decline"),
                ScriptedAgent("conversation", eligible=False),
                decisions=ScriptedDecisions("weather", "music"))
    assert (await h.say()).disposition == "clarify"
    assert h["conversation"].calls == []


async def test_clarify_choice_with_scores_picks_best_eligible_through_admission() -> None:
    """A clarify decision with usable scores selects the highest-scoring eligible route."""
    decision = RouteDecision("clarify", scores={"weather": 0.2, "music": 0.7,
                                                "calendar": 0.9})
    h = Harness(ScriptedAgent("weather"), ScriptedAgent("music"),
                ScriptedAgent("calendar", eligible=False),
                decisions=ScriptedDecisions(decision))
    result = await h.say()
    assert result.text == "music answer"
    assert h["music"].methods() == ["admit", "answer"]


async def test_score_ties_break_by_priority() -> None:
    """Equal scores prefer the candidate with the higher priority."""
    decision = RouteDecision("clarify", scores={"weather": 0.5, "music": 0.5})
    h = Harness(ScriptedAgent("weather"), ScriptedAgent("music", priority=3),
                decisions=ScriptedDecisions(decision))
    assert (await h.say()).text == "music answer"


async def test_clarify_without_scores_asks_for_clarification() -> None:
    """A clarify decision without scores makes the router ask, with no admission."""
    h = Harness(ScriptedAgent("weather"), decisions=ScriptedDecisions("clarify"))
    result = await h.say()
    assert result == DestinationResult("clarify")
    assert h.output.spoken[0].route == "clarify"
    assert h["weather"].calls == [] and h["conversation"].calls == []
    assert ("clarification", "low_confidence") in h.observer.turns["t1"]


async def test_non_candidate_choice_counts_as_clarify() -> None:
    """A choice naming no candidate is treated as clarify, then the scores rule applies."""
    h = Harness(ScriptedAgent("weather", eligible=False), ScriptedAgent("music"),
                decisions=ScriptedDecisions(
                    RouteDecision("weather", scores={"weather": 1.0, "music": 0.1})))
    assert (await h.say()).text == "music answer"
    assert h["weather"].calls == []
    h2 = Harness(ScriptedAgent("music"), decisions=ScriptedDecisions("nonexistent"))
    assert (await h2.say()).disposition == "clarify"


async def test_scores_only_for_non_candidates_are_not_usable() -> None:
    """Scores naming no eligible candidate, or -inf (a log probability of 0), lead to
    clarification (+inf and NaN are refused by RouteDecision itself)."""
    decision = RouteDecision("clarify", scores={"ghost": 1.0, "weather": -math.inf})
    h = Harness(ScriptedAgent("weather"), decisions=ScriptedDecisions(decision))
    assert (await h.say()).disposition == "clarify"


async def test_failing_decision_service_goes_to_default_through_admission() -> None:
    """A decision service that raises sends the turn to the default, with admission."""
    h = Harness(ScriptedAgent("weather"), decisions=ScriptedDecisions(RuntimeError("down")))
    result = await h.say()
    assert result.text == "conversation answer"
    assert h["conversation"].methods() == ["admit", "answer"]
    assert ("decision", None, "RuntimeError") in h.observer.turns["t1"]


class _BrokenAid(ScriptedAgent):
    """A destination whose `routing_aid()` raises (a bug, a lookup that failed)."""

    def routing_aid(self, participant_id: str) -> RoutingAid:
        raise KeyError(participant_id)


async def test_a_destination_whose_routing_aid_raises_sits_the_turn_out() -> None:
    """One broken destination does not fail every turn: its route is out of the turn's
    choices, the failure counted (stage `decision`, its route), and the turn goes to
    the other routes as usual; holding the focus, it loses it, as an ineligible owner
    does. Before, every turn of every participant ended with the failure text
    (contract11)."""
    h = Harness(ScriptedAgent("weather"), decisions=ScriptedDecisions("weather"))
    broken = _BrokenAid("billing")
    h.agents["billing"] = broken
    h.router = AgentRouter(h.agents, h.service, output=h.output,
                           default_destination="conversation", telemetry=h.observer,
                           overload=None)
    assert (await h.say()).text == "weather answer"
    request = h.decisions.requests[0]
    assert [aid.name for aid in request.candidates] == ["weather", "conversation"]
    assert ("failure", "billing", "decision", "KeyError") in h.observer.turns["t1"]
    assert broken.calls == []


async def test_a_focus_owner_whose_routing_aid_raises_loses_the_focus() -> None:
    """The focus owner's `routing_aid()` raising: focus lost, the owner released
    (`ineligible`), the turn routed among the others."""
    owner = _FocusThenBroken("billing", results="focus")
    h = Harness(owner, ScriptedAgent("weather"),
                decisions=ScriptedDecisions("billing", "weather"))
    assert (await h.say()).disposition == "focus"
    owner.broken = True
    assert (await h.say()).text == "weather answer"
    assert owner.methods() == ["admit", "answer", "release"]
    assert ("failure", "billing", "decision", "KeyError") in h.observer.turns["t2"]


class _FocusThenBroken(ScriptedAgent):
    """Takes focus, then its `routing_aid()` raises once `broken` is set."""

    broken = False

    def routing_aid(self, participant_id: str) -> RoutingAid:
        if self.broken:
            raise KeyError(participant_id)
        return super().routing_aid(participant_id)


async def test_failing_decision_service_without_default_clarifies() -> None:
    """With the default ineligible, a failing decision service ends in clarification."""
    h = Harness(ScriptedAgent("weather"), ScriptedAgent("conversation", eligible=False),
                decisions=ScriptedDecisions(RuntimeError("down")))
    assert (await h.say()).disposition == "clarify"
    assert ("clarification", "decision_failed") in h.observer.turns["t1"]


async def test_failing_reroute_decision_never_readmits_a_default_that_declined() -> None:
    """A decision failure on the reroute does not offer the turn again to the default that
    declined it: the router asks for clarification."""
    h = Harness(ScriptedAgent("weather"), ScriptedAgent("conversation", admissions="decline"),
                decisions=ScriptedDecisions("conversation", RuntimeError("down")))
    assert (await h.say()).disposition == "clarify"
    assert h["conversation"].methods() == ["admit"]
    assert h["weather"].calls == []
    assert ("clarification", "decision_failed") in h.observer.turns["t1"]


async def test_decision_service_returning_garbage_is_a_decision_failure() -> None:
    """A decide() result that is not a RouteDecision is recorded as a failure."""
    h = Harness(ScriptedAgent("weather"),
                decisions=ScriptedDecisions(lambda request: 42))  # type: ignore[arg-type,return-value]
    assert (await h.say()).text == "conversation answer"


async def test_a_plain_def_decide_is_a_failure_that_says_async_def(
        caplog: pytest.LogCaptureFixture) -> None:
    """A decision service written with a plain `def decide` fails each decision (the
    turn reaches the default, as for any outage) with a WARNING saying what to fix;
    before, it said only "failed (TypeError)" (newcomer14). A plain def returning an
    awaitable (a wrapper around an async service) is fine."""
    class Plain:
        def decide(self, request: RouteRequest) -> RouteDecision:
            return RouteDecision("weather")

    class Wrapper:
        def decide(self, request: RouteRequest) -> Awaitable[RouteDecision]:
            return ScriptedDecisions("weather").decide(request)

    plain = Harness(ScriptedAgent("weather"), decisions=Plain())  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="turnrouter"):
        assert (await plain.say()).text == "conversation answer"
    assert ("decision service decide() returned RouteDecision, not an awaitable: it "
            "must be an async method (async def decide(...))") in caplog.text
    wrapped = Harness(ScriptedAgent("weather"), decisions=Wrapper())  # type: ignore[arg-type]
    assert (await wrapped.say()).text == "weather answer"


async def test_admission_clarify_speaks_its_text_and_stops_routing() -> None:
    """A clarify admission emits its question and returns clarify without answering."""
    h = Harness(ScriptedAgent("weather", admissions=Admission("clarify", text="Which city?")),
                decisions=ScriptedDecisions("weather"))
    assert (await h.say()).disposition == "clarify"
    assert h.output.spoken[0].text == "Which city?"
    assert h.output.spoken[0].route == "weather"
    assert h["weather"].methods() == ["admit"]
    assert len(h.decisions.requests) == 1


async def test_unfocused_release_admission_speaks_releases_and_reroutes() -> None:
    """A release admission emits its text, releases that route and reroutes the query."""
    h = Harness(ScriptedAgent("weather", admissions=Admission("release", text="Passing on.")),
                ScriptedAgent("music"), decisions=ScriptedDecisions("weather", "music"))
    assert (await h.say()).text == "music answer"
    assert h.output.texts[0] == "Passing on."
    assert h["weather"].methods() == ["admit", "release"]
    assert h.decisions.requests[1].excluded == {"weather"}


async def test_release_text_is_spoken_before_the_rerouted_destination() -> None:
    """A release admission's text precedes everything the rerouted turn says."""
    h = Harness(ScriptedAgent("weather", admissions=Admission("release", text="Passing on.")),
                ScriptedAgent("music", admissions=Admission("accept", "Queueing it.")),
                decisions=ScriptedDecisions("weather", "music"))
    h["music"].output = h.output
    await h.say()
    assert h.output.texts == ["Passing on.", "Queueing it.", "music answer"]


async def test_no_eligible_route_clarifies_without_deciding() -> None:
    """With no eligible destination, the router asks for clarification directly."""
    h = Harness(ScriptedAgent("weather", eligible=False),
                ScriptedAgent("conversation", eligible=False))
    assert (await h.say()).disposition == "clarify"
    assert h.decisions.requests == []
    assert ("clarification", "no_eligible_route") in h.observer.turns["t1"]


# ---------------------------------------------------------------- focus


async def test_focus_owner_gets_the_next_turn_first() -> None:
    """A destination returning focus receives the next turn, focused, without deciding."""
    h = Harness(ScriptedAgent("booking", results="focus"),
                decisions=ScriptedDecisions("booking"))
    await h.say("book a table")
    assert h.router.focus_of("p1") == "booking"
    await h.say("for two")
    assert len(h.decisions.requests) == 1
    assert [c.focused for c in h["booking"].calls if c.method == "admit"] == [False, True]


async def test_focused_decline_keeps_focus_without_release() -> None:
    """A focused owner that declines keeps focus; release() is not called."""
    h = Harness(ScriptedAgent("booking", admissions=["accept", "decline", "accept"],
                              results="focus"),
                ScriptedAgent("weather"), decisions=ScriptedDecisions("booking", "weather"))
    await h.say("book")
    result = await h.say("weather?")
    assert result.text == "weather answer"
    assert h.router.focus_of("p1") == "booking"
    assert h["booking"].count("release") == 0
    assert h.decisions.requests[1].excluded == {"booking"}
    await h.say("for two")
    assert h["booking"].calls[-2].focused is True


async def test_focus_owner_admission_is_not_a_routing_attempt() -> None:
    """After the focus owner declines, the router still makes two routed choices (the
    first and one reroute) before the default fallback; the turn counts two attempts."""
    h = Harness(ScriptedAgent("booking", admissions=["accept", "decline"], results="focus"),
                ScriptedAgent("weather", admissions="decline"),
                ScriptedAgent("music", admissions="decline"),
                decisions=ScriptedDecisions("booking", "weather", "music"))
    await h.say("book")
    result = await h.say("anything else?")
    assert result.text == "conversation answer"
    assert [r.excluded for r in h.decisions.requests[1:]] == [
        {"booking"}, {"booking", "weather"}]
    assert h["music"].methods() == ["admit"]
    assert h["conversation"].methods() == ["answer"]
    (finished,) = [e for e in h.observer.turns["t2"] if e[0] == "finished"]
    assert finished[5] == 2  # attempts: the routed choices, not the owner's admission


async def test_focused_release_admission_releases_and_reroutes_same_query() -> None:
    """A focused release admission emits text, releases, and reroutes the same query."""
    h = Harness(ScriptedAgent("booking", results="focus",
                              admissions=["accept", Admission("release", text="Done here.")]),
                ScriptedAgent("weather"), decisions=ScriptedDecisions("booking", "weather"))
    await h.say("book")
    result = await h.say("what's the weather")
    assert result.text == "weather answer"
    assert h.output.texts == ["Done here."]
    assert h["booking"].methods() == ["admit", "answer", "admit", "release"]
    assert h.router.focus_of("p1") is None
    assert h.decisions.requests[1].turn.query == "what's the weather"
    assert h.decisions.requests[1].excluded == {"booking"}


async def test_taking_focus_releases_a_different_previous_owner() -> None:
    """Returning focus releases the previous owner when it is a different destination."""
    h = Harness(ScriptedAgent("booking", results="focus", admissions=["accept", "decline"]),
                ScriptedAgent("taxi", results="focus"),
                decisions=ScriptedDecisions("booking", "taxi"))
    await h.say("book")
    await h.say("taxi please")
    assert h.router.focus_of("p1") == "taxi"
    assert h["booking"].count("release") == 1
    assert ("release", "booking", "focus_taken", None) in h.observer.turns["t2"]


async def test_owner_returning_focus_again_is_not_released() -> None:
    """An owner that returns focus again keeps it and is not released."""
    h = Harness(ScriptedAgent("booking", results="focus"), decisions=ScriptedDecisions("booking"))
    await h.say()
    await h.say()
    assert h["booking"].count("release") == 0
    assert h.router.focus_of("p1") == "booking"


async def test_post_answer_release_clears_focus_without_rerouting() -> None:
    """A post-answer release consumes the turn, clears focus and calls release()."""
    h = Harness(ScriptedAgent("booking", results=["focus", "release"]),
                decisions=ScriptedDecisions("booking"))
    await h.say("book")
    result = await h.say("confirm")
    assert result.disposition == "release"
    assert h.router.focus_of("p1") is None
    assert h["booking"].methods() == ["admit", "answer", "admit", "answer", "release"]
    assert len(h.decisions.requests) == 1


async def test_post_answer_release_by_another_destination_clears_the_owners_focus() -> None:
    """The contract's post-answer release clears focus whoever held it: the owner that
    declined this turn is released, and the next turn is routed afresh."""
    h = Harness(ScriptedAgent("booking", results="focus", admissions=["accept", "decline"]),
                ScriptedAgent("taxi", results="release"),
                decisions=ScriptedDecisions("booking", "taxi", "taxi"))
    await h.say("book")
    result = await h.say("taxi please")
    assert result.disposition == "release"
    assert h.router.focus_of("p1") is None
    assert h["booking"].methods() == ["admit", "answer", "admit", "release"]
    assert ("release", "booking", "post_answer", None) in h.observer.turns["t2"]
    assert ("focus", "booking", "released") in h.observer.turns["t2"]
    await h.say("again")
    assert len(h.decisions.requests) == 3  # routed, not offered to booking first


async def test_owner_that_becomes_ineligible_loses_focus() -> None:
    """An ineligible focus owner loses focus, is released, and the turn is routed."""
    h = Harness(ScriptedAgent("booking", results="focus"), ScriptedAgent("weather"),
                decisions=ScriptedDecisions("booking", "weather"))
    await h.say("book")
    h["booking"].eligible = False
    result = await h.say("weather?")
    assert result.text == "weather answer"
    assert h.router.focus_of("p1") is None
    assert h["booking"].methods() == ["admit", "answer", "release"]
    assert ("focus", "booking", "lost") in h.observer.turns["t2"]


async def test_release_failure_during_a_turn_does_not_fail_the_answer() -> None:
    """A failing release() while focus moves is recorded; the turn still succeeds."""
    h = Harness(ScriptedAgent("booking", results="focus", admissions=["accept", "decline"],
                              release_error=RuntimeError("boom")),
                ScriptedAgent("taxi", results="focus"),
                decisions=ScriptedDecisions("booking", "taxi"))
    await h.say()
    result = await h.say()
    assert result.disposition == "focus"
    assert ("release", "booking", "focus_taken", "RuntimeError") in h.observer.turns["t2"]


# ---------------------------------------------------------------- history & context


async def test_history_holds_completed_exchanges_not_the_current_turn() -> None:
    """Destinations see completed exchanges only; the current query stays separate."""
    h = Harness(ScriptedAgent("weather"), decisions=ScriptedDecisions("weather"))
    await h.say("one")
    await h.say("two")
    second = h["weather"].calls[-1]
    assert second.query == "two"
    assert second.history == (AgentExchange("one", "weather answer"),)


async def test_history_keeps_newest_whole_exchanges_within_utf8_budget() -> None:
    """Retained history is the newest whole exchanges within the UTF-8 byte budget."""
    agent = ScriptedAgent("weather", answer_text="é" * 5)  # 10 bytes
    h = Harness(agent, decisions=ScriptedDecisions("weather"), context_budget_bytes=25)
    for query in ("aa", "bb", "cc"):
        await h.say(query)  # each exchange is 12 bytes
    history = h.router.history_of("p1")
    assert [exchange.user for exchange in history] == ["bb", "cc"]
    assert sum(exchange.size_bytes() for exchange in history) <= 25


async def test_exchange_larger_than_budget_is_not_retained() -> None:
    """An exchange bigger than the whole budget is dropped rather than cut."""
    h = Harness(ScriptedAgent("weather", answer_text="x" * 100),
                decisions=ScriptedDecisions("weather"), context_budget_bytes=50)
    await h.say("q")
    assert h.router.history_of("p1") == ()


async def test_caller_history_seeds_only_a_participant_without_history() -> None:
    """Caller-supplied history seeds a new participant; later it is ignored."""
    h = Harness(ScriptedAgent("weather"), decisions=ScriptedDecisions("weather"))
    seed = (AgentExchange("earlier", "reply"),)
    await h.say("one", history=seed)
    assert h["weather"].calls[0].history == seed
    await h.say("two", history=(AgentExchange("other", "thing"),))
    assert h["weather"].calls[-1].history == (*seed, AgentExchange("one", "weather answer"))


async def test_caller_history_is_ignored_once_the_router_completed_an_exchange() -> None:
    """A participant whose completed exchange exceeded the budget (nothing retained)
    still has history of its own: a later caller history does not seed it."""
    h = Harness(ScriptedAgent("weather", answer_text="x" * 100),
                decisions=ScriptedDecisions("weather"), context_budget_bytes=50)
    await h.say("q")
    assert h.router.history_of("p1") == ()
    await h.say("two", history=(AgentExchange("other", "thing"),))
    assert h["weather"].calls[-1].history == ()


async def test_seeded_history_is_trimmed_to_budget() -> None:
    """Seeded history keeps only the newest whole exchanges within the budget."""
    h = Harness(ScriptedAgent("weather"), decisions=ScriptedDecisions("weather"),
                context_budget_bytes=10)
    seed = (AgentExchange("aaaaa", "bbbbb"), AgentExchange("cc", "dd"))
    await h.say("q", history=seed)
    assert h["weather"].calls[0].history == (AgentExchange("cc", "dd"),)


async def test_current_turn_context_inside_a_turn_and_stable_after() -> None:
    """current_turn_context() names the exchange and aligned history, and stays stable."""
    seen: list[Any] = []

    def admit(turn: AgentTurn, focused: bool) -> Admission:
        seen.append(current_turn_context())
        return Admission("accept")

    h = Harness(ScriptedAgent("weather", admissions=admit),
                decisions=ScriptedDecisions("weather"))
    await h.say("one", timestamp_us=111)
    await h.say("two", timestamp_us=222)
    first, second = seen
    assert first.exchange_id == "t1" and first.history_exchange_ids == ()
    assert second.exchange_id == "t2"
    assert second.history_exchange_ids == ("t1",)
    assert second.history_timestamps == (111,)
    assert first.history_exchange_ids == ()  # snapshot unchanged by later turns
    assert current_turn_context().exchange_id is None


async def test_context_reaches_decision_service() -> None:
    """The decision service sees the current turn's context too."""
    contexts: list[object] = []

    def decide(request: RouteRequest) -> str:
        contexts.append(current_turn_context().exchange_id)
        return "weather"

    h = Harness(ScriptedAgent("weather"), decisions=ScriptedDecisions(decide))
    await h.say()
    assert contexts == ["t1"]


async def test_seeded_history_has_unknown_ids_and_timestamps() -> None:
    """Caller-seeded exchanges appear in the context with None ids and timestamps."""
    seen: list[Any] = []

    def admit(turn: AgentTurn, focused: bool) -> Admission:
        seen.append(current_turn_context())
        return Admission("accept")

    h = Harness(ScriptedAgent("weather", admissions=admit),
                decisions=ScriptedDecisions("weather"))
    await h.say("q", history=(AgentExchange("a", "b"),))
    assert seen[0].history_exchange_ids == (None,)
    assert seen[0].history_timestamps == (None,)


# ---------------------------------------------------------------- started() and failures


async def test_started_is_idempotent_and_records_one_first_response() -> None:
    """Repeated started() calls record a single first response."""
    calls: list[str] = []

    class Twice(ScriptedAgent):
        async def answer(self, turn: AgentTurn, *, started: Any) -> DestinationResult:
            await started()
            await started()
            calls.append("done")
            self.leaked = started
            return DestinationResult()

    agent = Twice("weather")
    h = Harness(agent, decisions=ScriptedDecisions("weather"))
    await h.say()
    await agent.leaked()  # after answer() returned: no effect
    assert h.observer.kinds("t1").count("first_response") == 1
    assert calls == ["done"]


async def test_a_started_call_left_unawaited_still_marks_the_first_response(
        caplog: pytest.LogCaptureFixture) -> None:
    """`started()` without `await` (a newcomer's slip): the start is marked at the call,
    so the first response is measured, the failure text is left to the destination, and
    Python warns of no coroutine never awaited."""
    class Unawaited(ScriptedAgent):
        async def answer(self, turn: AgentTurn, *, started: Any) -> DestinationResult:
            started()  # no await
            raise ValueError("broken after its start")

    h = Harness(Unawaited("weather"), decisions=ScriptedDecisions("weather"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "coroutine ... was never awaited" would raise
        with pytest.raises(ValueError, match="broken after its start"):
            await h.say()
        gc.collect()
    assert h.observer.kinds("t1").count("first_response") == 1
    assert h.output.texts == []  # started: the destination owns its failure output
    assert "without calling started()" not in caplog.text


@pytest.mark.parametrize("acknowledgments", [False, True])
async def test_a_started_call_left_unawaited_is_named_once_per_route(
        acknowledgments: bool, caplog: pytest.LogCaptureFixture) -> None:
    """`started()` without `await` in an answer that goes on: turnrouter says once per
    route to await it (it waits for an acknowledgment being said), and Python warns of
    no internal coroutine never awaited, acknowledgments on or off (newcomer20 F6:
    `AcknowledgmentSidecar.wait_delivered` was never awaited). Awaited, nothing is said."""
    class Unawaited(ScriptedAgent):
        async def answer(self, turn: AgentTurn, *, started: Any) -> DestinationResult:
            if self.name == "weather":
                started()  # no await
            else:
                await started()
            return DestinationResult(text=f"{self.name} answer")

    kwargs: dict[str, Any] = ({"acknowledgment_llm": TemplateAcknowledger(),
                               "acknowledgment_delay_secs": 5.0} if acknowledgments else {})
    router = AgentRouter({"weather": Unawaited("weather"), "calendar": Unawaited("calendar")},
                         ScriptedDecisions("weather", "weather", "calendar"),
                         output=OutputRecorder(), telemetry=RecordingObserver(), **kwargs)
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="turnrouter"):
        warnings.simplefilter("error")  # "coroutine ... was never awaited" would raise
        for n in range(3):
            assert (await router.handle(AgentTurn("p", f"t{n}", "hello"))).text
        gc.collect()
    lines = [r.getMessage() for r in caplog.records
             if "without awaiting" in r.getMessage()]
    assert len(lines) == 1 and "'weather'" in lines[0] and "await started()" in lines[0]
    await router.stop()


async def test_an_acknowledgment_said_through_a_plain_def_output_names_it(
        caplog: pytest.LogCaptureFixture) -> None:
    """An acknowledgment handed to a plain-`def` output (it ran, returning no awaitable)
    fails that acknowledgment, named as handed to output (not "none spoken"), and the
    turn goes on to its answer."""
    said: list[str] = []
    clock = ManualClock()

    def plain_output(turn: AgentTurn, route: str, text: str) -> None:
        said.append(text)

    class Slow(ScriptedAgent):
        async def answer(self, turn: AgentTurn, *, started: Any) -> DestinationResult:
            await clock.sleep(2.0)  # past the acknowledgment delay
            await started()
            return DestinationResult(text="slow answer")

    router = AgentRouter({"weather": Slow("weather")}, ScriptedDecisions("weather"),
                         output=plain_output,  # type: ignore[arg-type]  # the slip itself
                         acknowledgment_llm=TemplateAcknowledger(), clock=clock,
                         acknowledgment_delay_secs=1.0, telemetry=RecordingObserver())
    results: list[DestinationResult] = []
    done = anyio.Event()

    async def run() -> None:
        try:
            results.append(await router.handle(AgentTurn("p", "t", "hello")))
        finally:
            done.set()

    with caplog.at_level(logging.WARNING, logger="turnrouter"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await clock.run_until(done)
    assert [r.text for r in results] == ["slow answer"] and len(said) == 1
    lines = [r.getMessage() for r in caplog.records if "acknowledgment for" in r.getMessage()]
    assert lines and "handed to output" in lines[0] and "none spoken" not in lines[0]
    assert "async def output" in lines[0]
    await router.stop()


async def test_an_answer_that_never_calls_started_is_warned_once_per_route(
        caplog: pytest.LogCaptureFixture) -> None:
    """answer() returning a text without started(): nothing measured its first
    response, said at WARNING once per route (not per turn), naming the route; a silent
    answer (no text: a release that says nothing) is not warned."""
    class Silent(ScriptedAgent):
        async def answer(self, turn: AgentTurn, *, started: Any) -> DestinationResult:
            if self.name == "booking":
                return DestinationResult("release")
            return DestinationResult(text="answered without starting")

    h = Harness(Silent("weather"), Silent("calendar"), Silent("booking"),
                decisions=ScriptedDecisions("booking", "weather", "weather", "calendar"))
    with caplog.at_level(logging.WARNING, logger="turnrouter"):
        for _ in range(4):
            await h.say()
    lines = [r.getMessage() for r in caplog.records
             if "without calling started()" in r.getMessage()]
    assert len(lines) == 2
    assert "'weather'" in lines[0] and "'calendar'" in lines[1]
    assert h.observer.kinds("t2").count("first_response") == 0


async def test_failure_before_started_speaks_one_failure_message_and_propagates() -> None:
    """An answer() failing before started() yields one failure message and re-raises."""
    h = Harness(ScriptedAgent("weather", results=ValueError("broken")),
                decisions=ScriptedDecisions("weather"))
    with pytest.raises(ValueError, match="broken"):
        await h.say()
    assert h.output.texts == [FAILURE_TEXT]
    assert h.observer.outcome("t1") == "failed"


async def test_failure_after_started_is_left_to_the_destination() -> None:
    """Once started() was called, the router emits no failure message."""
    h = Harness(ScriptedAgent("weather", results=ValueError("broken"),
                              fail_after_started=True),
                decisions=ScriptedDecisions("weather"))
    with pytest.raises(ValueError, match="broken"):
        await h.say()
    assert h.output.texts == []


async def test_admit_failure_is_reported_once_and_propagates() -> None:
    """An admit() exception yields one failure message and propagates."""
    h = Harness(ScriptedAgent("weather", admissions=KeyError("x")),
                decisions=ScriptedDecisions("weather"))
    with pytest.raises(KeyError):
        await h.say()
    assert h.output.texts == [FAILURE_TEXT]


async def test_failed_turn_keeps_history_and_focus() -> None:
    """A failed answer records no exchange and leaves focus unchanged."""
    h = Harness(ScriptedAgent("booking", results=["focus", RuntimeError("x")]),
                decisions=ScriptedDecisions("booking"))
    await h.say("one")
    with pytest.raises(RuntimeError):
        await h.say("two")
    assert [e.user for e in h.router.history_of("p1")] == ["one"]
    assert h.router.focus_of("p1") == "booking"


async def test_invalid_destination_results_are_contract_errors() -> None:
    """answer() returning a non-result or "clarify" raises DestinationContractError."""
    for bad in (DestinationResult("clarify"), "nonsense"):
        agent = ScriptedAgent("weather", results=bad if not isinstance(bad, str) else "answer")
        if isinstance(bad, str):
            async def answer(turn: AgentTurn, *, started: Any) -> Any:
                return "nonsense"
            agent.answer = answer  # type: ignore[method-assign]
        h = Harness(agent, decisions=ScriptedDecisions("weather"))
        with pytest.raises(DestinationContractError, match="weather"):
            await h.say()


async def test_admit_returning_a_non_admission_is_a_contract_error() -> None:
    """admit() returning something else than an Admission raises a contract error."""
    h = Harness(ScriptedAgent("weather", admissions=lambda turn, focused: "yes"),  # type: ignore[arg-type]
                decisions=ScriptedDecisions("weather"))
    with pytest.raises(DestinationContractError, match="Admission"):
        await h.say()


async def test_admission_timeout_counts_as_decline() -> None:
    """An admit() slower than admission_timeout_secs is cancelled and counted a decline."""
    import anyio

    slow = ScriptedAgent("weather")
    slow.admit_gate = anyio.Event()  # never set: admit() hangs
    h = Harness(slow, ScriptedAgent("music"), decisions=ScriptedDecisions("weather", "music"),
                admission_timeout_secs=0.01)
    assert (await h.say()).text == "music answer"
    assert slow.cancelled == ["admit"]
    assert ("admission", "weather", "decline", False, True, None) in h.observer.turns["t1"]


async def test_output_failure_propagates_without_a_second_message() -> None:
    """If output itself fails, the error propagates and no failure text is attempted."""
    h = Harness(ScriptedAgent("weather"), decisions=ScriptedDecisions("clarify"))
    h.output.error = OSError("speaker gone")
    with pytest.raises(OSError, match="speaker gone"):
        await h.say()


async def test_a_failed_control_text_still_ends_the_turn_through_its_ending() -> None:
    """route_turn with an `ending` of its own (the runtimes publish the turn's final
    output there): the control-text output failing on a preamble fails the turn, and
    the failure message still goes out through `ending`, so the front end learns the
    turn ended. Before, nothing did (contract13 N1)."""
    agent = ScriptedAgent("weather", admissions=Admission("accept", preamble="Sure."))
    h = Harness(agent, decisions=ScriptedDecisions("weather"))
    broken, ending = OutputRecorder(), OutputRecorder()
    broken.error = ConnectionError("speaker gone")
    with pytest.raises(ConnectionError, match="speaker gone"):
        await h.router.route_turn(h.turn("hi"), output=broken, ending=ending)
    assert ending.texts == [h.router.failure_text]
    assert [call.method for call in agent.calls] == ["admit"]


# ---------------------------------------------------------------- construction & boundary


def _agents() -> dict[str, ScriptedAgent]:
    return {"conversation": ScriptedAgent("conversation")}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"default_destination": "nope"}, "default_destination"),
        ({"acknowledgment_llm": ScriptedLLM("ok")}, "together"),
        ({"acknowledgment_delay_secs": 1.0}, "together"),
        ({"acknowledgment_llm": ScriptedLLM("ok"), "acknowledgment_delay_secs": 0},
         "acknowledgment_delay_secs"),
        ({"acknowledgment_llm": ScriptedLLM("ok"), "acknowledgment_delay_secs": math.inf},
         "acknowledgment_delay_secs"),
        # Milliseconds given as seconds: named, with the bound and what was meant.
        ({"acknowledgment_llm": ScriptedLLM("ok"), "acknowledgment_delay_secs": 500},
         r"acknowledgment_delay_secs is in seconds and at most 60 .*did you mean 0\.5"),
        ({"acknowledgment_llm": ScriptedLLM("ok"), "acknowledgment_delay_secs": 60.5},
         "at most 60"),
        ({"acknowledgment_llm": ScriptedLLM("ok"), "acknowledgment_delay_secs": 1.0,
          "acknowledgment_route_delays": {"conversation": 1500}},
         r"acknowledgment_route_delays\['conversation'\] is in seconds.*did you mean 1\.5"),
        ({"context_budget_bytes": 0}, "context_budget_bytes"),
        ({"context_budget_bytes": -5}, "context_budget_bytes"),
        ({"admission_timeout_secs": 0.0}, "admission_timeout_secs"),
        ({"decision_timeout_secs": -1}, "decision_timeout_secs"),
        ({"decision_timeout_secs": math.nan}, "decision_timeout_secs"),
        ({"decision_timeout_secs": 10**400}, "decision_timeout_secs"),
        # Ints too large for a float are not finite (not an OverflowError).
        ({"acknowledgment_llm": ScriptedLLM("ok"), "acknowledgment_delay_secs": 10**400},
         "acknowledgment_delay_secs"),
        ({"admission_timeout_secs": 10**400}, "admission_timeout_secs"),
        ({"release_timeout_secs": 10**400}, "release_timeout_secs"),
        ({"context_budget_bytes": 10**5000}, "context_budget_bytes"),
    ],
)
def test_constructor_rejects_bad_configuration(kwargs: dict[str, Any], match: str) -> None:
    """Invalid configuration raises ValueError naming the argument."""
    with pytest.raises(ConfigurationError, match=match) as info:
        AgentRouter(_agents(), ScriptedDecisions("conversation"), **kwargs)
    assert isinstance(info.value, ValueError)


def test_an_acknowledgment_delay_of_a_minute_is_accepted() -> None:
    """The bound itself is a valid delay, router-wide and per route."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    AgentRouter(_agents(), ScriptedDecisions("conversation"),
                acknowledgment_llm=ScriptedLLM("ok"), acknowledgment_delay_secs=60,
                acknowledgment_route_delays={"conversation": 59.5},
                telemetry=Telemetry(registry=registry))
    assert registry.get_sample_value("turnrouter_acknowledgment_delay_seconds") == 60
    assert registry.get_sample_value("turnrouter_acknowledgment_route_delay_seconds",
                                     {"route": "conversation"}) == 59.5


_DIRECT_HANDLE = """
import asyncio, sys
from turnrouter import AgentRouter, AgentTurn
from turnrouter.testing import OutputRecorder, ScriptedAgent, ScriptedDecisions

async def main() -> None:
    router = AgentRouter({"conversation": ScriptedAgent("conversation")},
                         ScriptedDecisions("conversation"), output=OutputRecorder())
    await router.handle(AgentTurn("p", "t", "hi"))
    await router.stop()

asyncio.run(main())
print(sorted(name for name in sys.modules if name.startswith("turnrouter.runtime")))
"""


def test_direct_handle_never_imports_the_runtime() -> None:
    """Ordinary handle() use imports neither the runtime nor its message classes."""
    src = Path(turnrouter.__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", _DIRECT_HANDLE], capture_output=True,
                          text=True, timeout=120, check=True,
                          env={**os.environ, "PYTHONPATH": str(src)})
    assert done.stdout.strip() == "[]"


def test_constructor_rejects_non_agents_and_non_deciders() -> None:
    """Destinations without the agent methods, or deciders without decide(), are TypeErrors."""
    with pytest.raises(TypeError, match="'conversation' has no routing_aid"):
        AgentRouter({"conversation": object()}, ScriptedDecisions("x"))  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="decide"):
        AgentRouter(_agents(), object())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="empty"):
        AgentRouter({}, ScriptedDecisions("x"))
    with pytest.raises(TypeError, match="context_budget_bytes"):
        AgentRouter(_agents(), ScriptedDecisions("x"), context_budget_bytes=1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("argument", ["destination", "decisions", "acknowledgment_llm",
                                      "telemetry", "timing_sink"])
def test_constructor_names_a_class_passed_for_an_instance(argument: str) -> None:
    """A class where an instance belongs (`LexicalDecisions` for `LexicalDecisions()`)
    has every method the duck checks look for: it is refused at construction, naming the
    argument and the call, instead of failing every turn as a logged TypeError."""
    kwargs: dict[str, Any] = {"decisions": ScriptedDecisions("conversation")}
    agents: dict[str, Any] = _agents()
    if argument == "destination":
        agents["weather"], expected = ScriptedAgent, "destination 'weather'"
    elif argument == "acknowledgment_llm":
        kwargs.update(acknowledgment_llm=TemplateAcknowledger, acknowledgment_delay_secs=1.0)
        expected = argument
    else:
        kwargs[argument] = {"decisions": LexicalDecisions, "telemetry": Telemetry,
                            "timing_sink": JsonLinesSink}[argument]
        expected = argument
    with pytest.raises(ContractTypeError, match=f"AgentRouter {expected} is the class") as info:
        AgentRouter(agents, **kwargs)
    assert "not an instance: call it" in str(info.value)


async def test_a_plain_def_output_is_named_not_awaited_none() -> None:
    """`def output(...)` instead of `async def`: the turn fails with a ContractTypeError
    naming the callback and the fix, not Python's "NoneType can't be used in 'await'
    expression"."""
    said: list[str] = []

    def output(turn: AgentTurn, route: str, text: str) -> None:
        said.append(text)

    router = AgentRouter(_agents(), ScriptedDecisions("clarify"),
                         output=output,  # type: ignore[arg-type]
                         telemetry=RecordingObserver())
    with pytest.raises(ContractTypeError, match=r"output callback .*output returned NoneType, "
                       r"not an awaitable: it must be an async function"):
        await router.handle(AgentTurn("p", "t", "hello"))
    assert said == [CLARIFICATION_TEXT]
    await router.stop()


class _PlainDefAgent(ScriptedAgent):
    """`def answer` / `def admit` where the contract says `async def`."""

    def __init__(self, sync: str) -> None:
        super().__init__("conversation")
        self.sync = sync

    def admit(self, turn: AgentTurn, *, focused: bool) -> Any:
        if self.sync == "admit":
            return Admission("accept")
        return super().admit(turn, focused=focused)

    def answer(self, turn: AgentTurn, *, started: Any) -> Any:
        if self.sync == "answer":
            return DestinationResult("answer", "hi")
        return super().answer(turn, started=started)


@pytest.mark.parametrize("sync", ["admit", "answer"])
@pytest.mark.parametrize("setting", ["plain", "acknowledgments", "admission_timeout"])
async def test_a_plain_def_destination_method_is_named(sync: str, setting: str) -> None:
    """A destination's `def answer` (or `def admit`) returns its result unawaitable: the
    turn fails with a DestinationContractError naming the route, the method and the fix,
    not Python's "object DestinationResult can't be used in 'await' expression"; on
    each path that awaits it (with the acknowledgment sidecar, under a timeout)."""
    settings: dict[str, dict[str, Any]] = {
        "plain": {},
        "acknowledgments": {"acknowledgment_llm": TemplateAcknowledger(),
                            "acknowledgment_delay_secs": 5.0},
        "admission_timeout": {"admission_timeout_secs": 5.0},
    }
    kwargs = settings[setting]
    output = OutputRecorder()
    router = AgentRouter({"conversation": _PlainDefAgent(sync)},
                         ScriptedDecisions("conversation"), output=output,
                         telemetry=RecordingObserver(), **kwargs)
    with pytest.raises(DestinationContractError,
                       match=rf"destination 'conversation' {sync}\(\) returned "
                             rf"{'Admission' if sync == 'admit' else 'DestinationResult'}, "
                             rf"not an awaitable: it must be an async method "
                             rf"\(async def {sync}\(...\)\)"):
        await router.handle(AgentTurn("p", "t", "hello"))
    assert output.texts == [FAILURE_TEXT]
    await router.stop()


async def test_a_type_error_inside_an_async_answer_stays_itself() -> None:
    """Only an unawaitable result is renamed: a TypeError raised by the destination's own
    async code propagates unchanged."""
    agent = ScriptedAgent("conversation", results=TypeError("bad operand"))
    router = AgentRouter({"conversation": agent}, ScriptedDecisions("conversation"),
                         output=OutputRecorder(), telemetry=RecordingObserver())
    with pytest.raises(TypeError, match="bad operand") as info:
        await router.handle(AgentTurn("p", "t", "hello"))
    assert not isinstance(info.value, DestinationContractError)
    await router.stop()


async def test_handle_requires_output_and_an_agent_turn() -> None:
    """handle() without output raises RuntimeError; a non-turn raises TypeError."""
    router = AgentRouter(_agents(), ScriptedDecisions("conversation"),
                         telemetry=Harness().observer)
    with pytest.raises(LifecycleError) as info:
        await router.handle(AgentTurn("p", "t", "q"))
    assert isinstance(info.value, RuntimeError)
    router2 = AgentRouter(_agents(), ScriptedDecisions("conversation"), output=OutputRecorder(),
                          telemetry=Harness().observer)
    with pytest.raises(ContractTypeError, match="AgentTurn"):
        await router2.handle("hello")  # type: ignore[arg-type]


async def test_initialize_participant_runs_once_before_first_turn() -> None:
    """initialize_participant is awaited once, before the participant's first turn."""
    initialized: list[str] = []

    async def initialize(pid: str) -> None:
        initialized.append(pid)

    h = Harness(ScriptedAgent("weather"), decisions=ScriptedDecisions("weather"),
                initialize_participant=initialize)
    await h.say(participant="a")
    await h.say(participant="a")
    await h.say(participant="b")
    assert initialized == ["a", "b"]


async def test_failed_initialization_fails_the_turn_and_runs_again() -> None:
    """A failing initialization fails the turn and is attempted again next turn."""
    attempts: list[str] = []

    async def initialize(pid: str) -> None:
        attempts.append(pid)
        if len(attempts) == 1:
            raise RuntimeError("db down")

    h = Harness(ScriptedAgent("weather"), decisions=ScriptedDecisions("weather"),
                initialize_participant=initialize)
    with pytest.raises(RuntimeError):
        await h.say()
    assert h.output.texts == [FAILURE_TEXT]
    await h.say()
    assert attempts == ["p1", "p1"]


async def test_interrupted_initialization_runs_again_on_the_next_turn() -> None:
    """An initialization interrupted before it finished is awaited again on the next turn."""
    attempts: list[str] = []
    entered = anyio.Event()

    async def initialize(pid: str) -> None:
        attempts.append(pid)
        if len(attempts) == 1:
            entered.set()
            await anyio.Event().wait()  # only an interrupt ends it

    h = Harness(ScriptedAgent("weather"), decisions=ScriptedDecisions("weather"),
                initialize_participant=initialize)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(h.capture, h.turn())
            await entered.wait()
            await h.router.interrupt("p1")
    assert isinstance(h.outcomes["t1"], TurnInterrupted)
    assert h["weather"].calls == [] and h.output.texts == []
    assert (await h.say()).text == "weather answer"
    assert attempts == ["p1", "p1"]


async def test_a_participant_whose_initialization_failed_is_cleaned_up_at_departure() -> None:
    """cleanup_participant is idempotent by contract: it also runs for a participant
    whose initialization began but failed (it may have allocated something first)."""
    cleaned: list[str] = []

    async def initialize(pid: str) -> None:
        raise RuntimeError("db down")

    async def cleanup(pid: str) -> None:
        cleaned.append(pid)

    h = Harness(ScriptedAgent("weather"), decisions=ScriptedDecisions("weather"),
                initialize_participant=initialize, cleanup_participant=cleanup)
    with pytest.raises(RuntimeError):
        await h.say(participant="a")
    await h.router.participant_left("a")
    await h.router.participant_left("never-seen")
    assert cleaned == ["a"]


async def test_a_participant_whose_initialization_was_interrupted_is_cleaned_up() -> None:
    """An initialization interrupted half-way gets the cleanup at departure too."""
    cleaned: list[str] = []
    entered = anyio.Event()

    async def initialize(pid: str) -> None:
        entered.set()
        await anyio.Event().wait()  # only an interrupt ends it

    async def cleanup(pid: str) -> None:
        cleaned.append(pid)

    h = Harness(ScriptedAgent("weather"), decisions=ScriptedDecisions("weather"),
                initialize_participant=initialize, cleanup_participant=cleanup)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(h.capture, h.turn())
            await entered.wait()
            await h.router.interrupt("p1")
        await h.router.participant_left("p1")
    assert isinstance(h.outcomes["t1"], TurnInterrupted)
    assert cleaned == ["p1"]


async def test_without_a_conversation_route_the_default_is_unavailable() -> None:
    """Routers over other route names build fine; exhausted declines then clarify."""
    agents = {"weather": ScriptedAgent("weather", admissions="decline"),
              "music": ScriptedAgent("music", admissions="decline")}
    output = OutputRecorder()
    router = AgentRouter(agents, ScriptedDecisions("weather", "music"), output=output,
                         telemetry=Harness().observer)
    result = await router.handle(AgentTurn("p", "t", "q"))
    assert result.disposition == "clarify"
    assert len(output.spoken) == 1


async def test_routing_aid_names_follow_the_registered_route() -> None:
    """A routing aid named differently from its registration key is routed by the key."""
    class Renamed(ScriptedAgent):
        def routing_aid(self, participant_id: str) -> RoutingAid:
            return RoutingAid("Weather Agent", "forecasts")

    h = Harness(Renamed("weather"), decisions=ScriptedDecisions("weather"))
    assert (await h.say()).text == "weather answer"
    assert h.decisions.requests[0].candidate_names == ("weather", "conversation")


class _SlowStart(ScriptedAgent):
    """Admits with an optional preamble; answer() lets `latency` pass before started()."""

    def __init__(self, clock: ManualClock, latency: float, preamble: str = "") -> None:
        super().__init__("weather", admissions=Admission("accept", preamble=preamble))
        self.clock, self.latency = clock, latency

    async def answer(self, turn: AgentTurn, *, started: Any) -> DestinationResult:
        self.clock.advance(self.latency)
        await started()
        return DestinationResult(text="sunny")


@pytest.mark.parametrize(("preamble", "expected"), [("", 0.7), ("Sure.", 0.0)])
async def test_silence_is_recorded_without_acknowledgments(preamble: str,
                                                           expected: float) -> None:
    """Without acknowledgments, silence runs from admission to the answer's started() or,
    when the admission has a preamble, to that preamble."""
    clock = ManualClock(10.0)
    observer = RecordingObserver()
    router = AgentRouter({"weather": _SlowStart(clock, 0.7, preamble)},
                         ScriptedDecisions("weather"), output=OutputRecorder(),
                         telemetry=observer, clock=clock)
    await router.handle(AgentTurn("p1", "t1", "rain?"))
    silences = [event for event in observer.turns["t1"] if event[0] == "silence"]
    assert silences == [("silence", "weather", pytest.approx(expected))]
    await router.stop()


async def test_silence_of_a_default_fallback_and_none_for_an_interrupted_turn() -> None:
    """Without acknowledgments a fallback answer records its silence from the start of
    the answer; a turn interrupted before started() records none."""
    clock = ManualClock(0.0)
    observer = RecordingObserver()
    fallback = _SlowStart(clock, 0.5)
    router = AgentRouter({"weather": ScriptedAgent("weather", admissions="decline"),
                          "music": ScriptedAgent("music", admissions="decline"),
                          "conversation": fallback},
                         ScriptedDecisions("weather", "music"), output=OutputRecorder(),
                         telemetry=observer, clock=clock)
    await router.handle(AgentTurn("p1", "t1", "rain?"))
    assert ("default_fallback", "conversation") in observer.turns["t1"]
    assert [event for event in observer.turns["t1"] if event[0] == "silence"] == [
        ("silence", "conversation", pytest.approx(0.5))]

    gated = ScriptedAgent("weather", call_started=False)
    gated.answer_gate = anyio.Event()  # never set: the answer hangs until interrupted
    router2 = AgentRouter({"weather": gated}, ScriptedDecisions("weather"),
                          output=OutputRecorder(), telemetry=observer, clock=clock)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_ignore_interrupt, router2.handle(AgentTurn("p1", "t2", "rain?")))
        await gated.answer_entered.wait()
        await router2.interrupt("p1")
    assert observer.outcome("t2") == "interrupted"
    assert [event for event in observer.turns["t2"] if event[0] == "silence"] == []
    await router.stop()
    await router2.stop()


async def _ignore_interrupt(turn: Awaitable[object]) -> None:
    with contextlib.suppress(TurnInterrupted):
        await turn


async def test_ineligible_candidates_are_reported_with_their_reason() -> None:
    """Each ineligible route of a routed turn is reported with its eligibility state."""
    h = Harness(ScriptedAgent("weather"), ScriptedAgent("calendar", eligible=False),
                decisions=ScriptedDecisions("weather"))
    await h.say()
    assert ("route_ineligible", "calendar", "unavailable") in h.observer.turns["t1"]
    assert not any(event[0] == "route_ineligible" and event[1] != "calendar"
                   for event in h.observer.turns["t1"])


# ---------------------------------------------------------------- memory


_CYCLES = """
import asyncio, gc, json, sys
from prometheus_client import CollectorRegistry
from turnrouter import AgentRouter, AgentTurn
from turnrouter.telemetry import Telemetry
from turnrouter.testing import OutputRecorder, RecordingObserver, ScriptedAgent, ScriptedDecisions

async def main() -> list[str]:
    observer = (RecordingObserver() if sys.argv[1] == "recording"
                else Telemetry(registry=CollectorRegistry()))
    router = AgentRouter({"weather": ScriptedAgent("weather")}, ScriptedDecisions("weather"),
                         telemetry=observer, output=OutputRecorder())
    await router.handle(AgentTurn("p", "warm-up", "rain?"))  # caches, first exchange
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # keep what a collection finds, to look at it
    for n in range(20):
        await router.handle(AgentTurn("p", f"t{n}", "rain?"))
    gc.collect()
    return sorted({type(found).__qualname__ for found in gc.garbage
                   if type(found).__module__.startswith("turnrouter")})

print(json.dumps(asyncio.run(main())))
"""


@pytest.mark.parametrize("telemetry", ["recording", "prometheus"])
def test_finished_turns_leave_no_reference_cycles(telemetry: str) -> None:
    """A finished turn is freed by reference counting alone: thousands of turns a
    second must not feed the cyclic garbage collector (checked in a fresh interpreter,
    where no other test leaves garbage behind)."""
    src = Path(turnrouter.__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", _CYCLES, telemetry], capture_output=True,
                          text=True, timeout=120, check=True,
                          env={**os.environ, "PYTHONPATH": str(src)})
    assert done.stdout.strip() == "[]"


class _FailingOnce(RecordingObserver):
    """A telemetry observer whose first `turn_started` raises."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    def turn_started(self, event: TurnStarted) -> TurnObserver:
        if not self.failed:
            self.failed = True
            raise RuntimeError("observer broke")
        return super().turn_started(event)


async def test_a_turn_whose_start_fails_leaves_nothing_behind() -> None:
    """An error raised as the turn starts (here, the observer's) propagates, and the
    turn leaves neither its participant's line (the next turn runs) nor the in-flight
    count."""
    h = Harness(ScriptedAgent("conversation"), telemetry=_FailingOnce())
    with pytest.raises(RuntimeError, match="observer broke"):
        await h.say("first")
    assert h.router.load.turns_in_flight == 0
    with anyio.fail_after(5):
        assert (await h.say("second")).text == "conversation answer"
    assert h.router.load.turns_in_flight == 0
    await h.router.stop()


class _StrayCancel(ScriptedAgent):
    """Its `where` ("admit" or "answer", before or after `started()`) awaits a future
    another task cancels, on its first turn: a `CancelledError` nobody asked for."""

    def __init__(self, where: str) -> None:
        super().__init__("weather")
        self.where = where

    async def _stray(self) -> None:
        self.where = ""  # once
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        loop.call_soon(future.cancel)  # a shared client closing, a sibling's cancel
        await future

    async def admit(self, turn: AgentTurn, *, focused: bool) -> Admission:
        if self.where == "admit":
            await self._stray()
        return await super().admit(turn, focused=focused)

    async def answer(self, turn: AgentTurn, *,
                     started: Callable[[], Awaitable[None]]) -> DestinationResult:
        if self.where == "answer after started":
            await started()
        if self.where.startswith("answer"):
            await self._stray()
        return await super().answer(turn, started=started)


@pytest.mark.parametrize("where", ["admit", "answer", "answer after started"])
async def test_a_stray_cancellation_in_a_destination_is_a_failure_not_an_interrupt(
        where: str) -> None:
    """A destination whose own awaited work was cancelled elsewhere (nothing cancelled the
    turn) fails the turn like any error: `DestinationContractError` saying so, counted
    `failed` (not `interrupted`, which dashboards read as a barge-in), the failure text
    said once unless `started()` was called, and the caller's task goes on (before, it
    ended as cancelled, and the participant heard nothing)."""
    h = Harness(_StrayCancel(where), decisions=ScriptedDecisions("weather"))
    task = asyncio.create_task(h.say("rain?"))
    with pytest.raises(DestinationContractError, match="nothing cancelled the turn"):
        await task
    assert not task.cancelled()
    assert h.observer.outcome("t1") == "failed"
    assert h.output.texts == ([] if where.endswith("started") else [FAILURE_TEXT])
    assert (await h.say("sun?")).text == "weather answer"  # the participant goes on


async def test_a_stray_cancellation_in_the_decision_service_goes_to_the_default() -> None:
    """A decision service raising a CancelledError nobody asked for is a decision failure:
    the default destination answers (a classifier outage must not silence anyone)."""

    h = Harness(ScriptedAgent("weather"),
                decisions=ScriptedDecisions(asyncio.CancelledError("stray")))
    assert (await h.say()).text == "conversation answer"
    assert ("decision", None, "DestinationContractError") in h.observer.turns["t1"]


class _HungDecisions:
    """A decision service whose `decide()` waits until `release` is set."""

    def __init__(self) -> None:
        self.entered = anyio.Event()
        self.release = anyio.Event()
        self.cancelled = 0

    async def decide(self, request: RouteRequest) -> RouteDecision:
        self.entered.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return RouteDecision("weather")


async def test_a_hung_decision_service_is_cut_off_and_the_default_answers() -> None:
    """With `decision_timeout_secs`, a `decide()` that never returns is cancelled and
    counted as a decision failure (a TimeoutError naming the setting): the default answers,
    so a hung classifier does not silence the participant."""
    hung = _HungDecisions()
    h = Harness(ScriptedAgent("weather"), decisions=hung, decision_timeout_secs=0.01)
    with anyio.fail_after(10):
        assert (await h.say()).text == "conversation answer"
    assert hung.cancelled == 1
    assert ("decision", None, "TimeoutError") in h.observer.turns["t1"]
    hung.release.set()  # a decision within the bound routes as usual
    assert (await h.say("again")).text == "weather answer"


async def test_a_decision_that_swallows_the_timeout_is_not_used() -> None:
    """A `decide()` that catches the cancellation and answers anyway, past the bound, is
    still a timeout: its late decision is not used, the default answers (review8: the
    late answer routed the turn, and no failure was counted). Likewise a late `admit()`
    past `admission_timeout_secs` is a decline."""

    class Stubborn:
        async def decide(self, request: RouteRequest) -> RouteDecision:
            try:
                await anyio.Event().wait()
            except asyncio.CancelledError:
                return RouteDecision("weather")  # answered anyway
            raise AssertionError("unreachable")

    h = Harness(ScriptedAgent("weather"), decisions=Stubborn(), decision_timeout_secs=0.01)
    with anyio.fail_after(10):
        assert (await h.say()).text == "conversation answer"
    assert ("decision", None, "TimeoutError") in h.observer.turns["t1"]

    async def late_accept(turn: AgentTurn, focused: bool) -> Admission:
        try:
            await anyio.Event().wait()
        except asyncio.CancelledError:
            return Admission("accept")  # admitted anyway
        raise AssertionError("unreachable")

    slow = ScriptedAgent("weather")
    slow.admit = lambda turn, *, focused: late_accept(turn, focused)  # type: ignore[method-assign]
    h = Harness(slow, ScriptedAgent("music"), decisions=ScriptedDecisions("weather", "music"),
                admission_timeout_secs=0.01)
    with anyio.fail_after(10):
        assert (await h.say()).text == "music answer"


async def test_an_interrupt_during_a_timed_decision_is_an_interrupt_not_a_failure() -> None:
    """The timeout's cancel scope passes the turn's own cancellation through: an
    interrupted turn ends interrupted, with no decision failure and no default answer."""
    hung = _HungDecisions()
    h = Harness(ScriptedAgent("weather"), decisions=hung, decision_timeout_secs=60)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            async def turn() -> None:
                with pytest.raises(TurnInterrupted):
                    await h.say()
            tg.start_soon(turn)
            await hung.entered.wait()
            await h.router.interrupt("p1")
    assert hung.cancelled == 1
    assert not any(event[0] == "decision" and event[2] is not None
                   for event in h.observer.turns["t1"])
    assert h.output.texts == []


async def test_an_outage_of_the_decision_service_is_logged_rarely(
        caplog: pytest.LogCaptureFixture) -> None:
    """A decision service failing on every turn is logged at its 1st, 10th, 100th...
    failure, with the count (each is counted in telemetry): an outage at 100 turns a
    second wrote 100 WARNING lines a second."""
    h = Harness(ScriptedAgent("weather"), decisions=ScriptedDecisions(ConnectionError("down")))
    with caplog.at_level(logging.WARNING, logger="turnrouter"):
        for k in range(25):
            assert (await h.say(f"q{k}")).text == "conversation answer"
    lines = [r.getMessage() for r in caplog.records if "decision service" in r.getMessage()]
    assert lines == [
        "turnrouter: the decision service (1 failures so far) failed (ConnectionError)",
        "turnrouter: the decision service (10 failures so far) failed (ConnectionError)"]


@pytest.mark.parametrize(("name", "problem"), [
    ("clarify", "the router's own"), ("none", "the router's own"),
    ("background", "the router's own"), ("_OTHER", "the router's own"),
    ("a\ud800", "printable"), ("x" * 101, "1 to 100"), ("tab\there", "printable"),
])
def test_destination_names_the_router_gives_a_meaning_or_cannot_label_are_refused(
        name: str, problem: str) -> None:
    """A destination may not take a route name the router gives a meaning of its own
    (`clarify` was answered by that destination instead of asking to clarify; `none`,
    `background` and `_OTHER` made the router's own text and outcomes indistinguishable
    from its), nor one that cannot label metrics (a lone surrogate failed every turn,
    100 kB labelled every metric line): a ConfigurationError at construction."""
    with pytest.raises(ConfigurationError, match=problem):
        AgentRouter({name: ScriptedAgent(name), "conversation": ScriptedAgent("conversation")},
                    ScriptedDecisions("conversation"), output=OutputRecorder())


@pytest.mark.parametrize("where", ["turn", "history", "admission", "result"])
async def test_a_contract_object_built_without_its_fields_is_named(where: str) -> None:
    """An `AgentTurn`, a seeded `AgentExchange`, or a destination's `Admission` or
    `DestinationResult` built with `object.__new__` (no field ever set) is a
    `ContractTypeError` naming the class and the field, as limits.md says of instances
    that skipped validation; before, a bare `AttributeError`."""
    admissions: Any = (object.__new__(Admission) if where == "admission" else "accept")
    results: Any = (object.__new__(DestinationResult) if where == "result" else "answer")
    h = Harness(ScriptedAgent("weather", admissions=admissions, results=results),
                decisions=ScriptedDecisions("weather"))
    turn = (object.__new__(AgentTurn) if where == "turn" else
            h.turn("rain?", history=(object.__new__(AgentExchange),)) if where == "history"
            else h.turn("rain?"))
    name = {"turn": "AgentTurn.participant_id", "history": "AgentExchange.user",
            "admission": "Admission.disposition",
            "result": "DestinationResult.disposition"}[where]
    with pytest.raises(ContractTypeError, match=rf"{name} was never set"):
        await h.router.handle(turn)


class _AidOf(ScriptedAgent):
    """Its routing_aid returns None, or is written `async def` by mistake."""

    def __init__(self, how: str) -> None:
        super().__init__("weather")
        self.how = how

    def routing_aid(self, participant_id: str) -> Any:
        if self.how == "async":
            async def aid() -> RoutingAid:
                return RoutingAid("weather", "d")
            return aid()
        return None


@pytest.mark.parametrize(("how", "named"), [("none", "returned NoneType"),
                                            ("async", "def, not async def")])
async def test_a_routing_aid_that_is_not_one_is_named(how: str, named: str) -> None:
    """A destination whose `routing_aid()` returns None, or a coroutine (written `async
    def`), fails the turn with a `DestinationContractError` naming the destination and
    the method (the coroutine closed, never warned of as not awaited); before, a bare
    `AttributeError: 'NoneType' object has no attribute 'name'`."""
    h = Harness(_AidOf(how), decisions=ScriptedDecisions("weather"))
    with pytest.raises(DestinationContractError, match=rf"'weather' routing_aid\(\).*{named}"):
        await h.say()


class _BypassedAid(ScriptedAgent):
    """Its routing_aid is a `RoutingAid` under its own route name, changed after
    validation (or never validated)."""

    def __init__(self, name: str, field: str, value: object) -> None:
        super().__init__(name)
        self.field, self.value = field, value

    def routing_aid(self, participant_id: str) -> RoutingAid:
        if self.field == "unset":
            aid = object.__new__(RoutingAid)
            object.__setattr__(aid, "name", self.name)
            return aid
        aid = RoutingAid(self.name, "handles weather")
        object.__setattr__(aid, self.field, self.value)
        return aid


@pytest.mark.parametrize(("field", "value"), [
    ("eligible", "no"), ("description", b"\xff"), ("priority", math.nan),
    ("eligibility", ["x"]), ("unset", None)])
async def test_a_routing_aid_changed_after_validation_sits_the_turn_out(
        field: str, value: object) -> None:
    """A `RoutingAid` under its own route name is checked again, as the other contract
    objects entering a turn are: one with junk in a field (`object.__setattr__`) or a
    field never set (`object.__new__`) is that destination's `routing_aid()` failing,
    counted, and it sits the turn out. Before, `eligible="no"` counted as eligible,
    bytes and NaN reached the decision service, and a list or an unset field failed the
    turn with a bare TypeError or AttributeError (bounds17 M1)."""
    h = Harness(_BypassedAid("weather", field, value),
                decisions=ScriptedDecisions(RouteDecision("clarify",
                                                          scores={"conversation": 0.5})))
    assert (await h.say("rain?")).text == "conversation answer"
    failures = [e for e in h.observer.turns["t1"] if e[0] == "failure"]
    assert failures and failures[0][1:3] == ("weather", "decision")
    assert failures[0][3] in {"ContractTypeError", "ContractValueError"}
    assert [aid.name for aid in h.decisions.requests[0].candidates] == ["conversation"]


async def test_a_stray_cancellation_in_routing_aid_sits_the_turn_out() -> None:
    """`routing_aid()` raising a `CancelledError` nothing asked for is that route's
    failure (a `DestinationContractError`, counted), as for `admit()`, `answer()` and
    `decide()`: the route sits the turn out and the caller's task goes on. Before, the
    turn ended silently, counted interrupted, and the caller's task was cancelled
    (bounds17 M3)."""

    class Cancels(ScriptedAgent):
        def routing_aid(self, participant_id: str) -> RoutingAid:
            raise asyncio.CancelledError("stray")

    h = Harness(Cancels("weather"), decisions=ScriptedDecisions("conversation"))
    task = asyncio.create_task(h.say("rain?"))
    assert (await task).text == "conversation answer"
    assert not task.cancelled()
    assert ("failure", "weather", "decision", "DestinationContractError") in (
        h.observer.turns["t1"])


async def test_a_focused_routes_stray_cancellation_in_routing_aid_loses_the_focus() -> None:
    """The focus owner's `routing_aid()` raising a stray `CancelledError`: the focus is
    lost as for any other error, the turn is routed."""

    class Focused(ScriptedAgent):
        broken = False

        def routing_aid(self, participant_id: str) -> RoutingAid:
            if self.broken:
                raise asyncio.CancelledError("stray")
            return super().routing_aid(participant_id)

    weather = Focused("weather", results=[DestinationResult("focus", "Which day?")])
    h = Harness(weather, decisions=ScriptedDecisions("weather", "conversation"))
    assert (await h.say("book")).text == "Which day?"
    weather.broken = True
    assert (await h.say("friday")).text == "conversation answer"
    assert ("failure", "weather", "decision", "DestinationContractError") in (
        h.observer.turns["t2"])


async def test_a_decision_with_junk_scores_in_a_read_only_mapping_is_a_decision_failure(
        ) -> None:
    """A `RouteDecision` whose scores were swapped for any read-only mapping (not the one
    validation made) holding a str score is checked in full: a decision failure, and
    the eligible default answers. Before, it passed the shape test and failed the turn
    with a bare TypeError (bounds17 M2)."""
    decision = RouteDecision("clarify")
    object.__setattr__(decision, "scores", MappingProxyType({"weather": "x"}))
    h = Harness(ScriptedAgent("weather"), decisions=ScriptedDecisions(decision))
    assert (await h.say("rain?")).text == "conversation answer"
    assert h.observer.outcome("t1") == "answer"


async def test_a_decision_with_a_field_never_set_is_named() -> None:
    """A `RouteDecision` built with `object.__new__` is a decision failure naming the
    field (`ContractTypeError`), as for `Admission`; it was a bare AttributeError
    (bounds17 L4). The default answers."""
    h = Harness(ScriptedAgent("weather"),
                decisions=ScriptedDecisions(object.__new__(RouteDecision)))
    assert (await h.say("rain?")).text == "conversation answer"
    assert ("decision", None, "ContractTypeError") in h.observer.turns["t1"]


@pytest.mark.parametrize("call", ["focus_of", "history_of", "trace_int", "trace_str"])
def test_front_end_calls_name_a_wrong_argument(call: str) -> None:
    """`focus_of([])` raised a bare unhashable TypeError, `history_of(5)` answered `()`,
    and `continue_trace` with junk raised TypeError or AttributeError from inside the
    propagator: each is a `ContractTypeError` naming the argument (bounds17 L3)."""
    h = Harness(ScriptedAgent("weather"))
    calls: dict[str, Callable[[], object]] = {
        "focus_of": lambda: h.router.focus_of([]),  # type: ignore[arg-type]
        "history_of": lambda: h.router.history_of(5),  # type: ignore[arg-type]
        "trace_int": lambda: h.router.continue_trace({"traceparent": 5}),  # type: ignore[dict-item]
        "trace_str": lambda: h.router.continue_trace("junk"),  # type: ignore[arg-type]
    }
    with pytest.raises(ContractTypeError, match=r"participant_id|continue_trace"):
        calls[call]()
