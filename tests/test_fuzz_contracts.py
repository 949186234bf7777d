"""Fuzz: contract objects get junk, huge, nested, non-UTF-8 and bypassing input.

Rule for every constructor: a valid object whose text is storable as UTF-8, or a
`ContractTypeError` / `ContractValueError` with a short message; never another exception.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from turnrouter import (
    Admission,
    AgentExchange,
    AgentRouter,
    AgentTurn,
    ContextPatch,
    ContractTypeError,
    ContractValueError,
    DestinationResult,
    RouteDecision,
    RouteRequest,
    RoutingAid,
    TurnrouterError,
)
from turnrouter.testing import OutputRecorder, ScriptedAgent, ScriptedDecisions

from .fuzz import ANY_TEXT, JUNK, MOSTLY_TEXT, NESTED, SCALARS, VALID_TEXT, valid_text

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example])
#: An error message stays short whatever the input (no echo of huge values).
MESSAGE_LIMIT = 400


def build(factory: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The object, or None when the documented contract error was raised (and bounded)."""
    try:
        return factory(*args, **kwargs)
    except (ContractTypeError, ContractValueError) as exc:
        message = str(exc)
    assert len(message) < MESSAGE_LIMIT
    return None


def texts_are_valid(obj: object) -> None:
    """Every str field of a built contract object is storable as UTF-8."""
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if isinstance(value, str):
            assert valid_text(value), f.name


@FUZZ
@given(MOSTLY_TEXT, MOSTLY_TEXT, MOSTLY_TEXT)
def test_admission(disposition: Any, preamble: Any, text: Any) -> None:
    """Admission: valid with a known disposition and UTF-8 texts, else a contract error."""
    admission = build(Admission, disposition, preamble, text)
    if admission is not None:
        assert admission.disposition in ("accept", "decline", "clarify", "release")
        texts_are_valid(admission)


@FUZZ
@given(MOSTLY_TEXT, MOSTLY_TEXT)
def test_agent_exchange(user: Any, assistant: Any) -> None:
    """AgentExchange: valid exchanges have a UTF-8 size; anything else is rejected."""
    exchange = build(AgentExchange, user, assistant)
    if exchange is not None:
        texts_are_valid(exchange)
        assert exchange.size_bytes() >= 0


@FUZZ
@given(MOSTLY_TEXT, MOSTLY_TEXT, MOSTLY_TEXT,
       st.one_of(st.lists(st.builds(AgentExchange, VALID_TEXT, VALID_TEXT), max_size=3),
                 JUNK),
       st.one_of(st.none(), st.integers(min_value=0), SCALARS, JUNK))
def test_agent_turn(pid: Any, turn_id: Any, query: Any, history: Any, ts: Any) -> None:
    """AgentTurn: ids non-empty, query storable, history of exchanges, bounded timestamp."""
    turn = build(AgentTurn, pid, turn_id, query, history, ts)
    if turn is not None:
        texts_are_valid(turn)
        assert turn.participant_id and turn.turn_id
        assert all(isinstance(e, AgentExchange) for e in turn.history)
        assert turn.timestamp_us is None or 0 <= turn.timestamp_us < 2**63 // 1000


@FUZZ
@given(MOSTLY_TEXT, MOSTLY_TEXT)
def test_destination_result(disposition: Any, text: Any) -> None:
    """DestinationResult: a known disposition and UTF-8 text, else a contract error."""
    result = build(DestinationResult, disposition, text)
    if result is not None:
        assert result.disposition in ("answer", "focus", "release", "clarify")
        texts_are_valid(result)


@FUZZ
@given(MOSTLY_TEXT, MOSTLY_TEXT, st.one_of(st.integers(), JUNK),
       st.one_of(st.booleans(), JUNK), MOSTLY_TEXT)
def test_routing_aid(name: Any, description: Any, priority: Any, eligible: Any,
                     eligibility: Any) -> None:
    """RoutingAid: a non-empty name, int priority and bool eligibility, else rejected."""
    aid = build(RoutingAid, name, description, priority, eligible, eligibility)
    if aid is not None:
        texts_are_valid(aid)
        assert aid.name and isinstance(aid.eligible, bool)


@FUZZ
@given(MOSTLY_TEXT,
       st.one_of(st.none(), st.floats(), st.integers(), JUNK),
       st.one_of(st.dictionaries(ANY_TEXT, st.one_of(st.floats(), st.integers(), JUNK),
                                 max_size=4), JUNK),
       MOSTLY_TEXT)
def test_route_decision(choice: Any, confidence: Any, scores: Any, rationale: Any) -> None:
    """RouteDecision: confidence in [0, 1], scores str -> float below +inf (not NaN),
    else rejected."""
    decision = build(RouteDecision, choice, confidence, scores, rationale)
    if decision is not None:
        texts_are_valid(decision)
        assert decision.confidence is None or 0.0 <= decision.confidence <= 1.0
        for key, value in decision.scores.items():
            assert valid_text(key) and isinstance(value, float) and value < math.inf


AIDS = st.lists(st.builds(RoutingAid, st.sampled_from(["a", "b", "c"]), VALID_TEXT),
                max_size=4)


@FUZZ
@given(st.one_of(st.builds(AgentTurn, st.just("p"), st.just("t"), VALID_TEXT), JUNK),
       st.one_of(AIDS, JUNK), st.one_of(st.frozensets(st.sampled_from(["a", "b", "x"])),
                                        st.lists(st.sampled_from(["a", "z"])), JUNK))
def test_route_request(turn: Any, candidates: Any, excluded: Any) -> None:
    """RouteRequest: unique candidates, none excluded, else rejected."""
    request = build(RouteRequest, turn, candidates, excluded)
    if request is not None:
        names = request.candidate_names
        assert len(set(names)) == len(names) and not set(names) & request.excluded


@FUZZ
@given(st.sampled_from([Admission("accept"), AgentExchange("u", "a"), AgentTurn("p", "t", "q"),
                        DestinationResult(), RoutingAid("n", "d"), RouteDecision("n")]),
       st.data())
def test_replace_revalidates(obj: Any, data: st.DataObject) -> None:
    """dataclasses.replace with junk runs validation again: a contract error or valid."""
    field = data.draw(st.sampled_from([f.name for f in dataclasses.fields(obj)]))
    value = data.draw(st.one_of(JUNK, ANY_TEXT))
    rebuilt = build(dataclasses.replace, obj, **{field: value})
    if rebuilt is not None:
        texts_are_valid(rebuilt)


@FUZZ
@given(st.dictionaries(
    st.sampled_from(["task_id", "spawned_from_event_id", "source_context_version",
                     "source_context_hash", "context_diverged", "completed_at", "digest",
                     "facts", "artifacts", "sources", "recommended_next_steps",
                     "assumptions", "unknown"]),
    st.one_of(JUNK, NESTED, st.lists(MOSTLY_TEXT, max_size=3)), max_size=6))
def test_context_patch(fields: dict[str, Any]) -> None:
    """ContextPatch validation: a valid patch or a pydantic ValidationError (a ValueError)
    from `model_validate`, a `ContractValueError` naming the field from the constructor."""
    try:
        patch = ContextPatch.model_validate({"task_id": "t", **fields})
    except ValidationError:
        with pytest.raises(ContractValueError, match="invalid ContextPatch: "):
            ContextPatch(**{"task_id": "t", **fields})
        return
    assert isinstance(patch.task_id, str) and patch.task_id
    built = ContextPatch(**{"task_id": "t", **fields})  # (completed_at: now by default)
    assert built.model_copy(update={"completed_at": patch.completed_at}) == patch


def test_lone_surrogates_are_rejected_in_every_text_field() -> None:
    """Each contract text field refuses a lone surrogate, naming the field."""
    bad = "ok\ud83d"
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: AgentTurn("p", "t", bad), "AgentTurn.query"),
        (lambda: AgentTurn(bad, "t", "q"), "AgentTurn.participant_id"),
        (lambda: AgentExchange("u", bad), "AgentExchange.assistant"),
        (lambda: Admission("accept", bad), "Admission.preamble"),
        (lambda: DestinationResult("answer", bad), "DestinationResult.text"),
        (lambda: RoutingAid(bad, "d"), "RoutingAid.name"),
        (lambda: RouteDecision("a", scores={bad: 1.0}), "RouteDecision.scores key"),
        (lambda: RouteDecision("a", rationale=bad), "RouteDecision.rationale"),
    ]
    for make, name in cases:
        with pytest.raises(ContractValueError, match=rf"{name} holds a lone surrogate"):
            make()
    assert AgentTurn("p", "t", "ok \U0001f600").query.endswith("\U0001f600")  # pairs are fine


def test_errors_never_echo_text_values() -> None:
    """A wrong-typed or out-of-domain text value is named by type, never echoed."""
    with pytest.raises(ContractTypeError) as typed:
        AgentTurn("p", "t", b"my secret bank PIN")  # type: ignore[arg-type]
    assert "secret" not in str(typed.value) and "bytes" in str(typed.value)
    with pytest.raises(ContractValueError) as ranged:
        Admission("x" * 1_000_000)  # type: ignore[arg-type]
    assert len(str(ranged.value)) < MESSAGE_LIMIT


def test_huge_numbers_are_contract_errors() -> None:
    """Ints too large for a float or a timestamp raise contract errors, not Overflow/Value."""
    with pytest.raises(ContractValueError, match="too large"):
        RouteDecision("a", scores={"a": 10**400})
    with pytest.raises(ContractValueError, match="timestamp_us"):
        AgentTurn("p", "t", "q", timestamp_us=10**5000)
    with pytest.raises(ContractValueError, match="confidence"):
        RouteDecision("a", confidence=10**5000)


def bypassed(valid: Any, field: str, value: Any) -> Any:
    """A copy of `valid` with `field` set to `value` by object.__new__ (no validation)."""
    obj = object.__new__(type(valid))
    for f in dataclasses.fields(valid):
        object.__setattr__(obj, f.name, value if f.name == field else getattr(valid, f.name))
    return obj


def _route(turn: AgentTurn, agent: ScriptedAgent | None = None,
           decision: Any = "conversation") -> DestinationResult | TurnrouterError:
    """One turn through a fresh router (bounded), then a plain turn must still work."""
    router = AgentRouter({"conversation": agent or ScriptedAgent("conversation")},
                         ScriptedDecisions(decision, "conversation"),
                         output=OutputRecorder(), default_destination="conversation")

    async def main() -> DestinationResult | TurnrouterError:
        with anyio.fail_after(30):
            try:
                outcome: DestinationResult | TurnrouterError = await router.handle(turn)
            except TurnrouterError as exc:
                outcome = exc
            assert len(str(outcome)) < MESSAGE_LIMIT or isinstance(outcome, DestinationResult)
            await router.handle(AgentTurn("p2", "t2", "hello"))  # the router still works
            await router.stop()
            return outcome

    return anyio.run(main)


_VALID_TURN = AgentTurn("p1", "t1", "hello", (AgentExchange("u", "a"),), 5)


@FUZZ
@given(st.sampled_from([f.name for f in dataclasses.fields(AgentTurn)]), JUNK,
       st.sampled_from(["user", "assistant"]), st.one_of(JUNK, VALID_TEXT))
def test_bypassed_turns_are_validated_by_the_router(field: str, junk: Any, exchange_field: str,
                                                    exchange_junk: Any) -> None:
    """handle() of an AgentTurn (or its history) built with object.__new__ and junk:
    the contract error naming the field, or a routed turn; never another exception."""
    outcome = _route(bypassed(_VALID_TURN, field, junk))
    if isinstance(outcome, TurnrouterError):
        assert isinstance(outcome, ContractTypeError | ContractValueError)
        assert f"AgentTurn.{field}" in str(outcome)
    exchange = bypassed(_VALID_TURN.history[0], exchange_field, exchange_junk)
    outcome = _route(AgentTurn("p1", "t1", "hello", (exchange,)))
    if isinstance(outcome, TurnrouterError):
        assert f"AgentExchange.{exchange_field}" in str(outcome)


@FUZZ
@given(st.sampled_from(["result", "admission", "decision"]), st.data())
def test_bypassed_plugin_returns_are_contract_failures(kind: str, data: st.DataObject) -> None:
    """A destination or decision service returning a contract object built with
    object.__new__ and junk: a routed turn or a turnrouter error, never a crash."""
    valid: Any = {"result": DestinationResult("answer", "ok"), "admission": Admission("accept"),
                  "decision": RouteDecision("conversation", 0.9, {"conversation": 0.9})}[kind]
    field = data.draw(st.sampled_from([f.name for f in dataclasses.fields(valid)]))
    junk = bypassed(valid, field, data.draw(JUNK))
    agent = ScriptedAgent(
        "conversation", results=[junk, "answer"] if kind == "result" else "answer",
        admissions=[junk, "accept"] if kind == "admission" else "accept")
    outcome = _route(_VALID_TURN, agent, junk if kind == "decision" else "conversation")
    if isinstance(outcome, DestinationResult):
        texts_are_valid(outcome)
