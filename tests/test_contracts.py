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
        (lambda: RouteDecision("r", scores={"a": math.inf}), "below infinity"),
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


class _Lying(str):
    """A str whose methods lie: no bytes, equal to everything, hashed as "bob"."""

    __slots__ = ()

    def encode(self, *args: object, **kwargs: object) -> bytes:
        return b""

    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return hash("bob")

    def __len__(self) -> int:
        return 0


class _Agreeable(int):
    """An int whose comparisons always pass."""

    def __le__(self, other: object) -> bool:
        return True

    def __ge__(self, other: object) -> bool:
        return True


def test_subclasses_of_str_and_int_are_kept_as_their_plain_values() -> None:
    """Contracts keep a str or int subclass's value as a plain `str` / `int`: the router
    would otherwise trust the subclass's own `encode` (a history budget of no bytes),
    `__eq__` / `__hash__` (one participant served as another) and comparisons (a
    timestamp out of range accepted, then every export failing)."""
    turn = AgentTurn(_Lying("eve"), _Lying("t1"), _Lying("x" * 100))
    assert [type(v) for v in (turn.participant_id, turn.turn_id, turn.query)] == [str] * 3
    assert turn.participant_id != "bob" and len(turn.query.encode()) == 100
    exchange = AgentExchange(_Lying("q"), _Lying("a" * 10))
    assert exchange.size_bytes() == 11
    result = DestinationResult(_Lying("focus"), _Lying("text"))  # type: ignore[arg-type]
    assert type(result.disposition) is str and result.disposition == "focus"
    aid = RoutingAid(_Lying("weather"), _Lying("d"), priority=_Agreeable(3),
                     eligibility=_Lying("ok"))
    assert [type(v) for v in (aid.name, aid.description, aid.priority)] == [str, str, int]
    decision = RouteDecision(_Lying("made-up"), scores={_Lying("w"): 1.0},
                             rationale=_Lying("r"))
    assert type(decision.choice) is str and decision.choice != "weather"
    assert [type(key) for key in decision.scores] == [str]
    with pytest.raises(ContractValueError, match="timestamp_us"):
        AgentTurn("p", "t", "q", timestamp_us=_Agreeable(-5))
    assert type(AgentTurn("p", "t", "q", timestamp_us=_Agreeable(5)).timestamp_us) is int
    with pytest.raises(ContractValueError, match="must be one of"):
        Admission(_Lying("anything"))
