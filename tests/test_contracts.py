"""Contract objects: fields, defaults, positional forms, immutability and validation."""

from __future__ import annotations

import dataclasses
import math

import pytest

from turnrouter import (
    Admission,
    AgentExchange,
    AgentTurn,
    ContractTypeError,
    ContractValueError,
    DestinationResult,
    RouteDecision,
    RouteRequest,
    RoutingAid,
    RoutingTurnContext,
    current_turn_context,
)


def test_admission_positional_form_and_defaults() -> None:
    """Admission("release") builds positionally with empty preamble and text."""
    admission = Admission("release")
    assert (admission.disposition, admission.preamble, admission.text) == ("release", "", "")
    assert Admission("accept", "On it.").preamble == "On it."


def test_destination_result_defaults_and_positional_form() -> None:
    """DestinationResult() is an answer; DestinationResult("focus", text=...) keeps text."""
    assert DestinationResult() == DestinationResult("answer", "")
    result = DestinationResult("focus", text="booked")
    assert (result.disposition, result.text) == ("focus", "booked")


def test_routing_aid_defaults() -> None:
    """RoutingAid defaults to priority 0, eligible, eligibility "available"."""
    aid = RoutingAid("weather", "forecasts")
    assert (aid.priority, aid.eligible, aid.eligibility) == (0, True, "available")


def test_agent_turn_defaults_and_history_tuple() -> None:
    """AgentTurn history defaults to () and a list is stored as a tuple."""
    turn = AgentTurn("p", "t", "hi")
    assert turn.history == () and turn.timestamp_us is None
    listed = AgentTurn("p", "t", "hi", [AgentExchange("a", "b")])  # type: ignore[arg-type]
    assert listed.history == (AgentExchange("a", "b"),)


@pytest.mark.parametrize(
    "obj",
    [
        Admission("accept"),
        AgentExchange("u", "a"),
        AgentTurn("p", "t", "q"),
        DestinationResult(),
        RoutingAid("n", "d"),
        RouteDecision("n"),
        RoutingTurnContext(),
    ],
)
def test_contracts_are_immutable(obj: object) -> None:
    """Every contract object rejects attribute assignment."""
    field = dataclasses.fields(obj)[0].name  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, field, "x")


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: AgentTurn("", "t", "q"), "participant_id"),
        (lambda: AgentTurn("p", "", "q"), "turn_id"),
        (lambda: Admission("maybe"), "disposition"),  # type: ignore[arg-type]
        (lambda: DestinationResult("done"), "disposition"),  # type: ignore[arg-type]
        (lambda: AgentTurn("p", "t", "q", timestamp_us=-1), "timestamp_us"),
        (lambda: RoutingAid("", "d"), "name"),
        (lambda: RouteDecision("r", confidence=1.5), "confidence"),
        (lambda: RouteDecision("r", scores={"a": math.nan}), "scores"),
        (lambda: RouteDecision(""), "choice"),
    ],
)
def test_bad_values_name_the_field(build: object, field: str) -> None:
    """Out-of-domain values raise ContractValueError (a ValueError) naming the field."""
    with pytest.raises(ContractValueError, match=field) as info:
        build()  # type: ignore[operator]
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: AgentTurn(1, "t", "q"), "participant_id"),  # type: ignore[arg-type]
        (lambda: AgentTurn("p", "t", None), "query"),  # type: ignore[arg-type]
        (lambda: AgentTurn("p", "t", "q", ("x",)), "history"),  # type: ignore[arg-type]
        (lambda: AgentTurn("p", "t", "q", timestamp_us=1.5), "timestamp_us"),  # type: ignore[arg-type]
        (lambda: AgentTurn("p", "t", "q", timestamp_us=True), "timestamp_us"),
        (lambda: Admission("accept", preamble=3), "preamble"),  # type: ignore[arg-type]
        (lambda: AgentExchange("u", None), "assistant"),  # type: ignore[arg-type]
        (lambda: RoutingAid("n", "d", priority="1"), "priority"),  # type: ignore[arg-type]
        (lambda: RoutingAid("n", "d", eligible=1), "eligible"),  # type: ignore[arg-type]
        (lambda: RouteDecision("r", scores=[1]), "scores"),  # type: ignore[arg-type]
        (lambda: RouteDecision("r", confidence="high"), "confidence"),  # type: ignore[arg-type]
        (lambda: RouteRequest("turn", ()), "turn"),  # type: ignore[arg-type]
    ],
)
def test_wrong_types_name_the_field(build: object, field: str) -> None:
    """Wrong types raise ContractTypeError (a TypeError) naming the field."""
    with pytest.raises(ContractTypeError, match=field) as info:
        build()  # type: ignore[operator]
    assert isinstance(info.value, TypeError)


def test_route_decision_scores_are_frozen_copies() -> None:
    """RouteDecision copies its scores into a read-only mapping."""
    source = {"a": 1}
    decision = RouteDecision("a", scores=source)
    source["a"] = 5
    assert decision.scores["a"] == 1.0
    with pytest.raises(TypeError):
        decision.scores["a"] = 2  # type: ignore[index]


def test_route_request_rejects_excluded_candidates() -> None:
    """A RouteRequest whose candidates include an excluded route is invalid."""
    turn = AgentTurn("p", "t", "q")
    with pytest.raises(ContractValueError, match="excluded"):
        RouteRequest(turn, (RoutingAid("a", ""),), frozenset({"a"}))
    with pytest.raises(ContractValueError, match="twice"):
        RouteRequest(turn, (RoutingAid("a", ""), RoutingAid("a", "")))


def test_routing_turn_context_outside_a_turn() -> None:
    """Outside a routed turn, identifiers are None and history tuples empty."""
    context = current_turn_context()
    assert context == RoutingTurnContext(None, (), ())
    with pytest.raises(ContractValueError, match="align"):
        RoutingTurnContext("x", ("a",), ())


def test_exchange_size_is_utf8_bytes() -> None:
    """An exchange's size counts UTF-8 bytes of both sides."""
    assert AgentExchange("é", "ab").size_bytes() == 4
