"""What a worker computes on every turn, against the computation it stands for.

Each shortcut on the turn's path (a check not repeated, a value built without its model)
is compared with the longer way on arbitrary inputs, so a shortcut that drifted from it
fails here.
"""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from turnrouter import AgentTurn, ContractValueError
from turnrouter._contracts import MAX_ID_CHARS, MAX_TIMESTAMP_US
from turnrouter.runtime import UserQuery
from turnrouter.runtime.nats import NatsConfig, Rejected, encode_token
from turnrouter.runtime.nats._inputs import turn_of
from turnrouter.runtime.nats._wire import parse_input

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
    """The worker builds a delivered query's turn unchecked (`route_turn()` checks it):
    every query `parse_input` accepts is one `AgentTurn` accepts, field for field."""
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
    turn.__post_init__()  # what route_turn() runs on it
