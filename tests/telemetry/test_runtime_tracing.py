"""Runtime messages carry W3C trace context through the router, with a real SDK."""

from __future__ import annotations

import pytest

from turnrouter import AgentRouter
from turnrouter.runtime import ResponseOutput, Topic, UserQuery
from turnrouter.testing import ScriptedAgent, ScriptedDecisions

from ..kit import publish_and_drain
from .conftest import Rig

pytestmark = pytest.mark.anyio

QUERY = Topic("q", UserQuery)
OUTPUT = Topic("o", ResponseOutput)
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"


async def test_published_turn_continues_the_publishers_trace() -> None:
    """A query's traceparent makes the turn span a child of the publisher's span, and the
    router's control output carries the turn's trace context onward."""
    rig = Rig()
    router = AgentRouter({"conversation": ScriptedAgent("conversation")},
                         ScriptedDecisions("clarify"), telemetry=rig.telemetry,
                         query_topic=QUERY, output_topic=OUTPUT)
    outputs = await publish_and_drain(router, OUTPUT, (QUERY, UserQuery(
        participant_id="p1", text="hmm", traceparent=f"00-{TRACE_ID}-{PARENT_ID}-01")))
    turn = rig.span("turnrouter.turn")
    assert format(turn.context.trace_id, "032x") == TRACE_ID
    assert turn.parent is not None
    assert format(turn.parent.span_id, "016x") == PARENT_ID
    assert outputs
    assert outputs[0].traceparent is not None
    assert TRACE_ID in outputs[0].traceparent
    rig.close()


async def test_query_without_trace_context_starts_a_new_trace() -> None:
    """A query without traceparent gets a root turn span."""
    rig = Rig()
    router = AgentRouter({"conversation": ScriptedAgent("conversation")},
                         ScriptedDecisions("conversation"), telemetry=rig.telemetry,
                         query_topic=QUERY, output_topic=OUTPUT)
    await publish_and_drain(router, OUTPUT, (QUERY, UserQuery(participant_id="p1", text="hi")))
    assert rig.span("turnrouter.turn").parent is None
    rig.close()
