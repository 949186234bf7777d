"""What a worker computes on every turn, against the computation it stands for.

Each shortcut on the turn's path (a check not repeated, a value built without its model)
is compared with the longer way on arbitrary inputs, so a shortcut that drifted from it
fails here.
"""

from __future__ import annotations

import json
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnrouter import AgentTurn, ContractValueError
from turnrouter._contracts import MAX_ID_CHARS, MAX_TIMESTAMP_US
from turnrouter.runtime import UserQuery
from turnrouter.runtime.nats import NatsConfig, Rejected, _worker, encode_token
from turnrouter.runtime.nats._inputs import input_carrier, turn_of
from turnrouter.runtime.nats._ledger import _any_before
from turnrouter.runtime.nats._wire import (
    Ending,
    output_message_id,
    parse_input,
    token_output_id,
    trace_context,
)

#: Any code point, lone surrogates included (JSON escapes them as \\udxxx).
ANY_TEXT = st.characters(min_codepoint=0, max_codepoint=0x10FFFF, categories=None)
TEXTS = st.one_of(st.text(min_size=1, max_size=20), st.text(ANY_TEXT, max_size=20),
                  st.text(st.sampled_from("ab\ud800"), min_size=MAX_ID_CHARS - 1,
                          max_size=MAX_ID_CHARS + 1))


@settings(max_examples=300)
@given(pid=TEXTS, message_id=TEXTS, text=TEXTS,
       stamp=st.one_of(st.integers(-2, 2), st.integers(MAX_TIMESTAMP_US - 1,
                                                        MAX_TIMESTAMP_US + 1),
                       st.integers(), st.booleans(), st.floats()))
def test_a_delivered_query_is_the_turn_its_constructor_makes(
        pid: str, message_id: str, text: str, stamp: object) -> None:
    """The worker builds and routes a delivered query's turn unchecked
    (`route_validated_turn`): every query `parse_input` accepts is one `AgentTurn`
    accepts, field for field."""
    config = NatsConfig()
    body = json.dumps({"participant_id": pid, "message_id": message_id, "text": text,
                       "timestamp_us": stamp}).encode()
    try:
        subject = f"{config.prefix}.p.0.{encode_token(pid)}.query"
        _, _, _, query = parse_input(config, subject, body)
    except (Rejected, ContractValueError, UnicodeEncodeError):
        return
    assert isinstance(query, UserQuery)
    expected = AgentTurn(pid, message_id, text, timestamp_us=query.timestamp_us)
    turn = turn_of(query)
    assert type(turn) is AgentTurn and turn == expected
    assert [type(getattr(turn, f)) for f in AgentTurn.__slots__] == [
        type(getattr(expected, f)) for f in AgentTurn.__slots__]
    turn.__post_init__()  # what route_turn() would run on it


@settings(max_examples=200)
@given(st.lists(st.one_of(
    st.tuples(st.just("request"), st.sampled_from([None, "pin-a", "pin-b"])),
    st.tuples(st.just("ended"), st.integers(0, 12)),
    st.tuples(st.just("forget"), st.integers(0, 12)),
    st.tuples(st.just("reconnected"), st.none()),
    st.tuples(st.just("wait"), st.floats(0.0, 4.0))), max_size=60))
def test_pull_requests_past_their_time_are_forgotten_as_a_full_scan_would(
        steps: list[tuple[str, object]]) -> None:
    """A partition's live pull requests: after every step, `waiting_for()` (and each new
    request) forgets exactly the requests whose time passed, as a scan of all of them
    does, although it reads only the ones leading `live` (and `live` stays in the order
    of their ends)."""
    clock = [100.0]

    def now() -> float:
        return clock[0]

    with mock.patch("turnrouter.runtime.nats._worker.time.monotonic", now):
        inbox = _worker._Inbox(0, "next", "reply", expires=1.0)
        for op, arg in steps:
            if op == "wait":
                assert isinstance(arg, float)
                clock[0] += arg
            elif op == "request":
                before = dict(inbox.live)
                token, _ = inbox.request(arg)  # type: ignore[arg-type]
                expected = {t: v for t, v in before.items() if v[1] > clock[0]}
                expected[token] = (arg, clock[0] + inbox.lifetime)  # type: ignore[assignment]
                assert inbox.live == expected
            elif op == "ended":
                inbox.ended(f"reply.{arg}")
            elif op == "forget":
                inbox.forget(str(arg))
            else:
                inbox.reconnected()
            ends = [until for _, until in inbox.live.values()]
            assert ends == sorted(ends)
            before = dict(inbox.live)
            left = inbox.waiting_for()
            assert inbox.live == {t: v for t, v in before.items() if v[1] > clock[0]}
            assert left == max((v[1] for v in inbox.live.values()), default=clock[0]) - clock[0]


HEADER_NAMES = st.sampled_from(["traceparent", "tracestate", "Nats-Msg-Id", "Nats-Pin-Id",
                                "TraceParent", "x"])
TRACE_VALUES = st.one_of(
    st.just("00-" + "a" * 32 + "-" + "b" * 16 + "-01"), st.text(max_size=10),
    st.text(st.sampled_from("0123456789abcdef-"), min_size=55, max_size=55),
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=500,
            max_size=520))


@given(st.one_of(st.none(), st.dictionaries(HEADER_NAMES, TRACE_VALUES, max_size=4)),
       st.one_of(st.none(), TRACE_VALUES), st.one_of(st.none(), TRACE_VALUES))
def test_a_turn_continues_the_trace_its_input_carries(
        headers: dict[str, str] | None, traceparent: str | None,
        tracestate: str | None) -> None:
    """`input_carrier` is what the worker computed before: the message's W3C headers
    (only those two) when it has either, else the query's own, through `trace_context`."""
    query = UserQuery(participant_id="p", text="hi", traceparent=traceparent,
                      tracestate=tracestate)
    before = trace_context(
        ({k: v for k, v in headers.items() if k in ("traceparent", "tracestate")}
         if headers else {}) or query.trace_carrier())
    assert input_carrier(headers, query) == before


@given(st.lists(st.tuples(st.just("t"), st.just("r"), st.just("x"),
                          st.floats(allow_nan=True)), max_size=6),
       st.floats(allow_nan=True))
def test_stale_endings_are_found_as_any_finds_them(outbox: list[Ending],
                                                   horizon: float) -> None:
    assert _any_before(outbox, horizon) == any(e[3] < horizon for e in outbox)


@given(pid=st.text(min_size=1, max_size=20), turn_id=TEXTS, route=TEXTS, text=TEXTS,
       final=st.booleans())
def test_an_output_id_from_the_token_is_the_participants_output_id(
        pid: str, turn_id: str, route: str, text: str, final: bool) -> None:
    """The worker makes an output's id from the token it puts in the output's subject
    (`token_output_id`): the id `output_message_id` gives the participant."""
    try:
        token = encode_token(pid)
    except (ContractValueError, UnicodeEncodeError):
        return
    try:
        expected = output_message_id(pid, turn_id, route, text, final=final)
    except UnicodeEncodeError:  # (a lone surrogate in control text: both refuse it)
        with pytest.raises(UnicodeEncodeError):
            token_output_id(token, turn_id, route, text, final)
        return
    assert token_output_id(token, turn_id, route, text, final) == expected
