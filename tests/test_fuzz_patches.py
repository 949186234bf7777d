"""Context patches fed junk: any patch the router accepts keeps the participant movable.

`apply_context_patch` and `approve_patch` are a boundary: a background task builds the
patch, perhaps with `model_construct()`, `model_copy(update=...)` or facts holding values
JSON cannot carry back. Whatever is accepted must export and import again (a front end
that moves participants rewrites their record after every patch); whatever is refused
is refused with a contract error naming the patch, in bounded text, with nothing changed.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from turnrouter import (
    AgentTurn,
    AppliedContextPatch,
    ContextPatch,
    ContractTypeError,
    ContractValueError,
    LifecycleError,
    ParticipantSnapshot,
    PendingContextPatch,
    PendingPatchLimitError,
    TurnrouterError,
    UnknownPatchError,
)
from turnrouter.testing import ScriptedAgent

from . import fuzz
from .kit import Harness

_FIELDS = ["task_id", "spawned_from_event_id", "source_context_version",
           "source_context_hash", "context_diverged", "completed_at", "digest", "facts",
           "artifacts", "sources", "recommended_next_steps", "assumptions"]
#: Junk that pydantic's lenient serializer writes out (with a warning) but no import reads.
_BYPASS_JUNK = st.one_of(
    fuzz.JUNK, st.just(""), st.just(-5), st.just("yesterday"), st.just(None),
    st.just("line one\nline two"), st.just(("a\nb",)), st.just({"k": 10**5000}),
    st.just(datetime(2020, 1, 1)), st.just((1, 2)),
)


def _bypassed(how: str, field: str, junk: Any) -> ContextPatch:
    valid = ContextPatch(task_id="task-1", digest=("done",),
                         completed_at=datetime(2025, 1, 2, tzinfo=UTC))
    if how == "construct":
        return ContextPatch.model_construct(**{**dict(valid), field: junk})
    if how == "copy":
        return valid.model_copy(update={field: junk})
    object.__setattr__(valid, field, junk)
    return valid


async def _apply_then_move(patch: ContextPatch, strategy: str) -> None:
    """Apply `patch`; accepted: the participant still takes turns, exports and imports."""
    h = Harness(ScriptedAgent("conversation"), max_patch_bytes=1 << 20)
    await h.say("hello")
    before = h.router.export_participant_json("p1")
    try:
        with anyio.fail_after(10):
            result = await h.router.apply_context_patch("p1", patch, strategy)
            if isinstance(result, PendingContextPatch):
                result = await h.router.approve_patch(result.patch_id)
    except (ContractValueError, LifecycleError) as exc:  # any other error fails the test
        # (LifecycleError: a bypassed stamp ahead of the session, "an earlier session")
        message = str(exc)
        assert "context patch" in message and len(message) < 1000, message
        assert h.router.export_participant_json("p1") == before  # nothing changed
        assert h.router.pending_patches("p1") == ()
        return
    assert isinstance(result, AppliedContextPatch)
    await h.say("and then?")
    exported = h.router.export_participant_json("p1")
    assert exported is not None
    other = Harness(ScriptedAgent("conversation"))
    other.router.import_participant(ParticipantSnapshot.from_json(exported))
    moved = other.router.context_patches_of("p1")
    assert [applied.task_id for applied in moved] == [result.task_id]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["construct", "copy", "setattr"]), st.sampled_from(_FIELDS),
       _BYPASS_JUNK, st.sampled_from(["append", "replace", "human_gated"]))
def test_bypassed_patches_are_refused_or_stay_movable(how: str, field: str, junk: Any,
                                                      strategy: str) -> None:
    """A patch that skipped validation is refused by name, or kept in a state every
    later export and import carries."""
    anyio.run(_apply_then_move, _bypassed(how, field, junk), strategy)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(fuzz.VALID_TEXT, fuzz.SCALARS | fuzz.VALID_TEXT, max_size=4),
       st.lists(fuzz.ANY_TEXT, max_size=3), st.sampled_from(["append", "human_gated"]))
def test_any_valid_patch_is_refused_or_stays_movable(facts: dict[str, Any],
                                                     digest: list[str], strategy: str) -> None:
    """Facts with huge integers, NaN or infinities, digests with lone surrogates: refused
    by name, or movable."""
    try:
        patch = ContextPatch(task_id="t", facts=facts, digest=tuple(digest))
    except ValueError:  # pydantic refused it at construction: not this boundary's case
        return
    anyio.run(_apply_then_move, patch, strategy)


@pytest.mark.anyio
async def test_a_huge_task_id_is_not_logged_or_raised_whole(
        caplog: pytest.LogCaptureFixture) -> None:
    """The over-size refusal names the task, shortened: not a 100 kB log line."""
    h = Harness(ScriptedAgent("conversation"))
    await h.say("hello")
    with caplog.at_level(logging.WARNING), pytest.raises(ContractValueError) as raised:
        await h.router.apply_context_patch("p1", ContextPatch(task_id="t" * 100_000))
    assert "max_patch_bytes" in str(raised.value) and len(str(raised.value)) < 1000
    assert caplog.records and all(len(r.getMessage()) < 1000 for r in caplog.records)


@pytest.mark.parametrize(("sign", "exponent"), [(1, 5000), (-1, 4400)])
def test_an_import_refuses_a_pending_patch_its_export_could_not_carry(sign: int,
                                                                      exponent: int) -> None:
    """A snapshot built in Python (not read from JSON) holding a pending patch whose JSON
    no import reads back is refused as apply_context_patch refuses it: nothing installed."""
    h = Harness(ScriptedAgent("conversation"))
    held = PendingContextPatch(patch_id="x1", participant_id="p1", task_id="t",
                               patch=ContextPatch(task_id="t", facts={"n": sign * 10**exponent}),
                               created_at=0.0)
    with pytest.raises(ContractValueError, match="pending patch its export could not carry"):
        h.router.import_participant(ParticipantSnapshot(participant_id="p1", pending=(held,)))
    assert h.router.export_participant("p1") is None


@pytest.mark.anyio
async def test_refusals_name_huge_ids_and_strategies_shortened() -> None:
    """Ids and strategies of any length are named in bounded text."""
    h = Harness(ScriptedAgent("conversation"))
    await h.say("hello")
    huge = "x" * 1_000_000
    calls: list[Callable[[], Awaitable[object]]] = [
        lambda: h.router.approve_patch(huge), lambda: h.router.reject_patch(huge),
        lambda: h.router.apply_context_patch(huge, ContextPatch(task_id="t")),
        lambda: h.router.apply_context_patch("p1", ContextPatch(task_id="t"), huge)]
    for call in calls:
        with pytest.raises(TurnrouterError) as raised:
            await call()
        assert "xxx" in str(raised.value) and len(str(raised.value)) < 1000


@settings(max_examples=50, deadline=None)
@given(st.one_of(st.integers(), st.floats(allow_nan=True), st.binary(max_size=20),
                 st.lists(st.text(max_size=3), max_size=2), st.booleans()),
       st.text(max_size=2000), st.booleans())
def test_a_junk_participant_id_settles_no_patch(junk: Any, text: str, approve: bool) -> None:
    """`approve_patch` / `reject_patch` given a `participant_id` that is no str: a
    ContractTypeError naming it; any str but the holder's: UnknownPatchError in bounded
    text. The held patch stays pending either way."""
    h = Harness(ScriptedAgent("conversation"))

    async def run() -> None:
        await h.say("hello")
        held = await h.router.apply_context_patch("p1", ContextPatch(task_id="t"),
                                                  "human_gated")
        settle = h.router.approve_patch if approve else h.router.reject_patch
        with pytest.raises(ContractTypeError, match="participant_id"):
            await settle(held.patch_id, participant_id=junk)
        if text != "p1":
            with pytest.raises(UnknownPatchError) as unknown:
                await settle(held.patch_id, participant_id=text)
            assert len(str(unknown.value)) < 1000
        assert [p.patch_id for p in h.router.pending_patches("p1")] == [held.patch_id]

    anyio.run(run)


def test_an_import_refuses_an_applied_patch_its_export_could_not_carry() -> None:
    """The same for a patch in the snapshot's history: refused, nothing installed (a
    snapshot validated from Python data may hold any int; JSON holds none so big)."""
    h = Harness(ScriptedAgent("conversation"))
    snapshot = ParticipantSnapshot.model_validate({"participant_id": "p1", "history": [
        {"user": "[background: t]", "assistant": "done", "patch": {
            "patch_id": "x1", "task_id": "t", "strategy": "append", "diverged": False,
            "patch": {"task_id": "t", "facts": {"n": 10**5000}}}}]})
    with pytest.raises(ContractValueError, match="applied patch its export could not carry"):
        h.router.import_participant(snapshot)
    assert h.router.export_participant("p1") is None


@pytest.mark.parametrize(("field", "junk"), [("context_diverged", 0),
                                             ("context_diverged", 1)])
def test_a_bypassed_field_equal_to_its_valid_value_is_stored_valid(
        field: str, junk: Any) -> None:
    """A bypassed `context_diverged=0` equals validation's `False`, so the patch was
    kept as it was, and every later export of the participant warned of an int where a
    bool belongs (found by the fuzz test above): the validated copy is stored."""
    anyio.run(_apply_then_move, _bypassed("construct", field, junk), "append")


_NESTED = st.one_of(
    st.recursive(st.none() | st.integers(0, 9) | st.just("{["),
                 lambda inner: st.lists(inner, max_size=40)
                 | st.dictionaries(st.sampled_from("abcdef"), inner, max_size=6),
                 max_leaves=400),
    # many small containers in few bytes (`[]` is 3 bytes of JSON with its comma)
    st.integers(0, 6000).map(lambda n: [[]] * n),
    st.integers(0, 3000).map(lambda n: [{"k": []}] * n))


async def _pile_up(patches: list[tuple[Any, str]], budget: int) -> None:
    h = Harness(ScriptedAgent("conversation"), context_budget_bytes=budget,
                max_patch_bytes=1 << 20)
    await h.say("{[" * 50)
    for n, (facts, strategy) in enumerate(patches):
        refusal = ""
        try:
            await h.router.apply_context_patch(
                "p1", ContextPatch(task_id=f"job{n}", facts={"x": facts}), strategy)
        except (ContractValueError, PendingPatchLimitError) as exc:
            refusal = str(exc)
        assert refusal == "" or "context patch" in refusal
        if n % 3 == 2:
            await h.say("and then?")
        exported = h.router.export_participant_json("p1")
        assert exported is not None
        other = Harness(ScriptedAgent("conversation"), context_budget_bytes=budget,
                        max_patch_bytes=1 << 20)
        other.router.import_participant(ParticipantSnapshot.from_json(exported))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(_NESTED, st.sampled_from(["append", "human_gated"])),
                min_size=1, max_size=12),
       st.sampled_from([8192, 1 << 16, 1 << 20]))
@example([([[]] * 6000, "append")] * 4, 1 << 16)
@example([([[]] * 2500, "human_gated")] * 8, 8192)
def test_accepted_patches_never_make_a_snapshot_no_replica_imports(
        patches: list[tuple[Any, str]], budget: int) -> None:
    """Whatever patches pile up (nested facts of many small containers, brackets in
    their text, held and merged, across budgets): after each, the participant's export
    imports into another router (the patch that would break that is refused)."""
    anyio.run(_pile_up, patches, budget)


#: A participant's life: a turn, a departure, a move to another replica (through the
#: snapshot's JSON), or a patch naming the i-th turn ever taken (any session's).
_LIFE = st.lists(st.one_of(
    st.just(("turn", 0)), st.just(("leave", 0)), st.just(("move", 0)),
    st.tuples(st.just("patch"), st.integers(0, 40))), max_size=40)


async def _live(steps: list[tuple[str, int]]) -> None:
    h = Harness(ScriptedAgent("conversation"))
    turns: list[str] = []  # every turn id ever taken, in order
    session: set[str] = set()  # the current session's
    for step, index in steps:
        if step == "turn":
            turns.append(f"t{len(turns)}")
            session.add(turns[-1])
            await h.router.handle(AgentTurn("p1", turns[-1], "hello"))
        elif step == "leave":
            await h.router.participant_left("p1")
            session = set()
        elif step == "move":
            data = h.router.export_participant_json("p1")
            moved = Harness(ScriptedAgent("conversation"))
            if data is not None:
                moved.router.import_participant(ParticipantSnapshot.from_json(data))
            await h.router.stop()
            h = moved
        elif turns:
            spawned = turns[index % len(turns)]
            patch = ContextPatch(task_id=f"task-{spawned}", spawned_from_event_id=spawned,
                                 digest=("done",))
            if spawned in session:
                assert isinstance(await h.router.apply_context_patch("p1", patch),
                                  AppliedContextPatch)
            else:
                with pytest.raises(LifecycleError, match="refused"):
                    await h.router.apply_context_patch("p1", patch)
    await h.router.stop()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_LIFE)
def test_a_patch_reaches_only_the_session_of_the_turn_that_spawned_it(
        steps: list[tuple[str, int]]) -> None:
    """Whatever turns, departures and moves between replicas come between, a patch
    naming a turn of the participant's current session is merged and one naming a turn
    of an earlier session (or one of a participant the router holds nothing for) is
    refused (chaos17 F3: it was merged into the next session)."""
    anyio.run(_live, steps)
