"""`History`: the budgeted exchanges and their append-only metadata views."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

from hypothesis import given, settings
from hypothesis import strategies as st

from turnrouter import AgentExchange
from turnrouter._history import History, Meta, MetaView, view_items
from turnrouter._patches import AppliedContextPatch, PatchExchangeId

BUDGET = 60

#: (kind, user text length, answer text length): kind 0 = conversation append,
#: 1 = background append, 2 = background replace.
Op = tuple[int, int, int]
ops = st.lists(st.tuples(st.sampled_from([0, 0, 0, 1, 2]), st.integers(5, 40),
                         st.integers(0, 40)), min_size=150, max_size=300)  # compacts


def _patch_id(n: int) -> PatchExchangeId:
    applied = cast(AppliedContextPatch, SimpleNamespace(exchange_id=f"patch:{n}"))
    return PatchExchangeId(applied)


@settings(max_examples=60, deadline=None)
@given(ops, st.integers(0, 12))
def test_history_matches_a_plain_model_and_views_never_change(sequence: list[Op],
                                                              seed: int) -> None:
    """Exchanges, ids, stamps and total follow a list model of the budget rule (after a
    caller seed), the previous state is kept for background appends, and every view taken
    earlier still shows what it showed (compaction and replace included)."""
    history = History(BUDGET, 10**6)
    seeded = [AgentExchange("s" * 7, "x" * (n % 11)) for n in range(seed)]
    history.seed(seeded)
    model: list[tuple[AgentExchange, object, int | None, int]] = []
    for exchange in seeded:
        model.append((exchange, None, None, len(exchange.user) + len(exchange.assistant)))
        while sum(entry[3] for entry in model) > BUDGET:
            model.pop(0)
    views: list[tuple[MetaView, list[Meta]]] = []
    version = seed
    for n, (kind, user, answer) in enumerate(sequence):
        exchange = AgentExchange("u" * user, "a" * answer)
        size = user + answer
        before = (history.view(), list(view_items(history.view())))
        prev = (history.prev_exchanges, list(view_items(history.prev_view)))
        exchanges_before = history.exchanges
        if kind == 0:
            exchange_id: object = f"t{n}"
            history.append(exchange, exchange_id, n)
            version += 1
        else:
            exchange_id = _patch_id(n)
            history.add_background(exchange, exchange_id, n, 0, replace=kind == 2)
            if kind == 2:
                model = [entry for entry in model if not isinstance(entry[1], PatchExchangeId)]
        model.append((exchange, exchange_id, n, size))
        while sum(entry[3] for entry in model) > BUDGET:
            model.pop(0)
        assert history.exchanges == tuple(entry[0] for entry in model)
        assert history.ids == tuple(entry[1] for entry in model)
        assert history.stamps == tuple(entry[2] for entry in model)
        assert history.total == sum(entry[3] for entry in model) <= BUDGET
        assert history.version == version
        if kind == 0:  # the state before this conversation exchange
            assert view_items(history.prev_view) == before[1]
            assert history.prev_exchanges == exchanges_before
        else:  # a background exchange leaves the previous state as it was
            assert (history.prev_exchanges, view_items(history.prev_view)) == prev
        views.append((history.view(), list(view_items(history.view()))))
    for view, seen in views:
        assert view_items(view) == seen


def test_long_conversations_compact_the_metadata_list() -> None:
    """Trimmed metadata does not accumulate: the list is renewed, earlier views intact."""
    history = History(BUDGET, 10**6)
    exchange = AgentExchange("q" * 10, "a" * 10)  # 20 bytes: three fit in 60
    first = None
    for n in range(1000):
        history.append(exchange, n, n)
        if n == 10:
            first = history.view()
    assert len(history.ids) == 3
    assert history.ids == (997, 998, 999)
    items, start, end = history.view()
    assert end - start == 3
    assert len(items) <= 3 * 2 + 70  # at most the compaction threshold behind
    assert first is not None
    assert [item[0] for item in view_items(first)] == [8, 9, 10]


def test_an_exchange_over_the_budget_empties_the_history() -> None:
    """An exchange larger than the whole budget leaves nothing retained."""
    history = History(BUDGET, 10**6)
    history.append(AgentExchange("q", "a"), "t1", 1)
    history.append(AgentExchange("q" * BUDGET, "a"), "t2", 2)
    assert (history.exchanges, history.ids, history.total) == ((), (), 0)
    history.append(AgentExchange("q", "a"), "t3", 3)
    assert history.ids == ("t3",)


def test_last_conversation_id_skips_background_exchanges() -> None:
    """The newest retained conversation id is found behind background entries."""
    history = History(BUDGET, 10**6)
    assert history.last_conversation_id() is None
    history.append(AgentExchange("q", "a"), "t1", 1)
    history.add_background(AgentExchange("bg", "x"), _patch_id(2), 2, 0, replace=False)
    assert history.last_conversation_id() == "t1"
