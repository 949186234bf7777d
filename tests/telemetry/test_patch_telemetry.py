"""Context patches through `AgentRouter` with a real OpenTelemetry SDK and registry."""

from __future__ import annotations

from typing import Any

import pytest

from turnrouter import (
    AgentRouter,
    AgentTurn,
    ContextPatch,
    LifecycleError,
    PatchNotSavedError,
    PendingContextPatch,
)
from turnrouter.telemetry import ATTR, SPAN_CONTEXT_PATCH, Telemetry
from turnrouter.testing import OutputRecorder, ScriptedAgent, ScriptedDecisions

from .conftest import Rig

pytestmark = pytest.mark.anyio


def _router(telemetry: Telemetry) -> AgentRouter:
    agents = {"booking": ScriptedAgent("booking"), "conversation": ScriptedAgent("conversation")}
    return AgentRouter(agents, ScriptedDecisions("booking"), output=OutputRecorder(),
                       telemetry=telemetry)


async def test_patch_spans_and_counter(rig: Rig) -> None:
    """Each patch event is a span with its attributes and a counted outcome."""
    router = _router(rig.telemetry)
    await router.handle(AgentTurn("alice", "t1", "book a table"))
    state = router.context_state("alice")
    await router.handle(AgentTurn("alice", "t2", "and the weather?"))
    stale = ContextPatch(task_id="book-1", source_context_version=state.version,
                         source_context_hash=state.hash, digest=("Booked",))
    await router.apply_context_patch("alice", stale, "append")
    held = await router.apply_context_patch("alice", ContextPatch(task_id="b"), "human_gated")
    assert isinstance(held, PendingContextPatch)
    await router.approve_patch(held.patch_id)
    with pytest.raises(LifecycleError):
        await router.apply_context_patch("bob", ContextPatch(task_id="c"), "replace")
    await router.stop()

    spans = rig.spans(SPAN_CONTEXT_PATCH)
    attributes: list[dict[str, Any]] = [dict(span.attributes or {}) for span in spans]
    assert [(a[ATTR.PATCH_TASK_ID], a[ATTR.PATCH_STRATEGY], a[ATTR.PATCH_OUTCOME],
             a[ATTR.PATCH_DIVERGED]) for a in attributes] == [
        ("book-1", "append", "diverged", True),
        ("b", "human_gated", "pending", False),
        ("b", "human_gated", "approved", False),
    ]
    assert attributes[1][ATTR.PATCH_ID] == held.patch_id
    assert {a[ATTR.PARTICIPANT_ID] for a in attributes} == {"alice"}
    for strategy, outcome in (("append", "diverged"), ("human_gated", "pending"),
                              ("human_gated", "approved"), ("replace", "refused")):
        assert rig.value("turnrouter_context_patches_total", strategy=strategy,
                         outcome=outcome) == 1.0, (strategy, outcome)
    assert rig.value("turnrouter_context_patches_total", strategy="append",
                     outcome="applied") is None


async def test_a_patch_whose_save_failed_is_counted_unsaved(rig: Rig) -> None:
    """A patch call raising `PatchNotSavedError` (a NATS worker's save that no record is
    known to hold) is counted `unsaved` after the outcome it already counted, for each
    call that waits on a save: apply (merged and held), approve, reject."""
    router = _router(rig.telemetry)
    await router.handle(AgentTurn("alice", "t1", "book a table"))
    held = [await router.apply_context_patch("alice", ContextPatch(task_id=f"h{n}"),
                                             "human_gated") for n in range(2)]

    async def refuse() -> None:
        raise PatchNotSavedError("not saved: another replica claimed the participant")

    router.on_participant_changed(lambda pid: refuse())
    for call in (router.apply_context_patch("alice", ContextPatch(task_id="a"), "append"),
                 router.apply_context_patch("alice", ContextPatch(task_id="g"), "human_gated"),
                 router.approve_patch(held[0].patch_id),
                 router.reject_patch(held[1].patch_id)):
        with pytest.raises(PatchNotSavedError):
            await call
    await router.stop()
    unsaved = [dict(span.attributes or {}) for span in rig.spans(SPAN_CONTEXT_PATCH)
               if (span.attributes or {}).get(ATTR.PATCH_OUTCOME) == "unsaved"]
    assert [a[ATTR.PATCH_TASK_ID] for a in unsaved] == ["a", "g", "h0", "h1"]
    assert rig.value("turnrouter_context_patches_total", strategy="append",
                     outcome="unsaved") == 1.0
    assert rig.value("turnrouter_context_patches_total", strategy="human_gated",
                     outcome="unsaved") == 3.0
    assert rig.value("turnrouter_context_patches_total", strategy="append",
                     outcome="applied") == 1.0


async def test_patch_spans_join_the_participants_trace(rig: Rig) -> None:
    """A patch applied outside any turn (a background task's) is recorded in the
    participant's latest turn's trace, not as a new root."""
    router = _router(rig.telemetry)
    await router.handle(AgentTurn("alice", "t1", "book a table"))
    (turn,) = rig.spans("turnrouter.turn")
    await router.apply_context_patch("alice", ContextPatch(task_id="late"), "append")
    await router.stop()
    (patch,) = rig.spans(SPAN_CONTEXT_PATCH)
    assert patch.parent is not None
    assert patch.context.trace_id == turn.context.trace_id


async def test_patch_counter_without_tracing(rig: Rig) -> None:
    """With a no-op tracer provider patches are still counted, with no span work."""
    from opentelemetry.trace import NoOpTracerProvider

    telemetry = Telemetry(tracer_provider=NoOpTracerProvider(), registry=rig.registry)
    router = _router(telemetry)
    await router.handle(AgentTurn("alice", "t1", "hi"))
    await router.apply_context_patch("alice", ContextPatch(task_id="a"))
    await router.stop()
    assert rig.value("turnrouter_context_patches_total", strategy="append",
                     outcome="applied") == 1.0
    assert rig.spans(SPAN_CONTEXT_PATCH) == []
