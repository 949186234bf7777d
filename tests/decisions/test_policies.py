"""Routing policies: DictRoutingPolicy loading, hot reload, and PolicyDecisions composition."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path

import anyio
import pytest

from turnrouter import (
    CLARIFY,
    AgentRouter,
    AgentTurn,
    ConfigurationError,
    PolicyError,
    RouteDecision,
    RouteRequest,
    RoutingAid,
)
from turnrouter.decisions import (
    MAX_NOTED_POLICY_ROUTES,
    MAX_POLICY_SEQUENCE,
    DictRoutingPolicy,
    LexicalDecisions,
    PolicyChoice,
    PolicyDecisions,
    RoutingPolicy,
    by_participant,
    by_query_prefix,
)
from turnrouter.testing import OutputRecorder, RecordingObserver, ScriptedAgent

AIDS = (RoutingAid("billing", "Invoices."), RoutingAid("support", "Outages."))


def request(participant: str = "p1", query: str = "hello",
            aids: tuple[RoutingAid, ...] = AIDS) -> RouteRequest:
    return RouteRequest(AgentTurn(participant, "t1", query), aids)


class FixedDecisions:
    """Fallback service returning one fixed decision and counting calls."""

    def __init__(self, decision: RouteDecision) -> None:
        self.decision = decision
        self.calls = 0

    async def decide(self, request: RouteRequest) -> RouteDecision:
        self.calls += 1
        return self.decision


FALLBACK_DECISION = RouteDecision("support", confidence=0.4, rationale="lexical: x")


def test_select_uses_participant_key_then_default() -> None:
    """The participant id is the default key; unmapped keys get the default."""
    policy = DictRoutingPolicy({"p1": "billing", "p2": None}, default="support")
    assert policy.select(request("p1")) == "billing"
    assert policy.select(request("p2")) == "support"
    assert policy.select(request("p3")) == "support"
    assert DictRoutingPolicy({}).select(request()) is None


def test_deployment_wide_override_is_empty_mapping_with_default() -> None:
    """An empty mapping with a default pins every request."""
    assert DictRoutingPolicy({}, default="billing").select(request("anyone")) == "billing"


def test_key_getters() -> None:
    """by_participant and by_query_prefix derive the expected keys."""
    assert by_participant(request("p9")) == "p9"
    prefix = by_query_prefix()
    assert prefix(request(query="Billing: my invoice")) == "billing"
    assert prefix(request(query="no prefix here")) is None
    policy = DictRoutingPolicy({"billing": "billing"}, key_getter=prefix)
    assert policy.select(request(query="billing: refund")) == "billing"
    assert policy.select(request(query="refund")) is None
    with pytest.raises(ConfigurationError, match="separator"):
        by_query_prefix("")


def test_set_default_validates_and_applies() -> None:
    """set_default changes the fallback choice and rejects non-str values."""
    policy = DictRoutingPolicy({})
    policy.set_default(CLARIFY)
    assert policy.select(request()) == CLARIFY
    with pytest.raises(PolicyError, match="default"):
        policy.set_default(3)  # type: ignore[arg-type]


def test_from_json_builds_policy_with_kwargs() -> None:
    """from_json decodes an object and forwards constructor keywords."""
    policy = DictRoutingPolicy.from_json('{"p1": "billing"}', default="support")
    assert policy.select(request("p1")) == "billing"
    assert policy.select(request("p2")) == "support"


def test_from_json_non_mapping_is_type_error() -> None:
    """A JSON payload that is not an object raises TypeError."""
    with pytest.raises(TypeError, match="mapping"):
        DictRoutingPolicy.from_json('["billing"]')


def test_from_json_invalid_is_policy_error_from_json_error() -> None:
    """Invalid JSON raises PolicyError (a ValueError) chained from the decoder error."""
    with pytest.raises(PolicyError) as caught:
        DictRoutingPolicy.from_json("{not json")
    assert isinstance(caught.value, ValueError)
    assert isinstance(caught.value.__cause__, json.JSONDecodeError)


def test_mapping_value_of_wrong_type_names_the_key() -> None:
    """A mapped value that is not str or None raises PolicyError naming its key."""
    with pytest.raises(PolicyError, match="'p7'"):
        DictRoutingPolicy.from_json('{"p7": 42}')


def test_from_json_file(tmp_path: Path) -> None:
    """from_json_file reads a UTF-8 JSON object file; non-objects raise TypeError."""
    path = tmp_path / "policy.json"
    path.write_text('{"p1": "support"}', encoding="utf-8")
    assert DictRoutingPolicy.from_json_file(path).select(request("p1")) == "support"
    path.write_text("3", encoding="utf-8")
    with pytest.raises(TypeError):
        DictRoutingPolicy.from_json_file(path)
    path.write_text("{", encoding="utf-8")
    with pytest.raises(PolicyError, match=r"policy\.json"):
        DictRoutingPolicy.from_json_file(str(path))


def test_from_env_missing_variable_is_key_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unset environment variable raises KeyError saying it is not set (a bare
    KeyError of the name said nothing of what was looked for, newcomer22)."""
    monkeypatch.delenv("TURNROUTER_TEST_POLICY", raising=False)
    with pytest.raises(KeyError, match="'TURNROUTER_TEST_POLICY' is not set"):
        DictRoutingPolicy.from_env("TURNROUTER_TEST_POLICY")


def test_a_mapping_given_as_the_policy_says_how_to_wrap_it() -> None:
    """`PolicyDecisions({"kiosk": "conversation"}, ...)`: the error says to wrap the
    mapping in DictRoutingPolicy."""
    with pytest.raises(ConfigurationError, match=r"wrap a mapping in DictRoutingPolicy"):
        PolicyDecisions({"kiosk": "conversation"}, LexicalDecisions())  # type: ignore[arg-type]


def test_from_env_json_and_custom_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    """from_env parses JSON by default, or uses the given loader."""
    monkeypatch.setenv("TURNROUTER_TEST_POLICY", '{"p1": "billing"}')
    policy = DictRoutingPolicy.from_env("TURNROUTER_TEST_POLICY", default="support")
    assert policy.select(request("p1")) == "billing"
    assert policy.select(request("p2")) == "support"

    def loader(raw: str) -> Mapping[str, PolicyChoice]:
        return dict(pair.split("=") for pair in raw.split(","))

    monkeypatch.setenv("TURNROUTER_TEST_POLICY", "p1=support,p2=billing")
    custom = DictRoutingPolicy.from_env("TURNROUTER_TEST_POLICY", loader=loader)
    assert custom.select(request("p2")) == "billing"
    monkeypatch.setenv("TURNROUTER_TEST_POLICY", "[1]")
    with pytest.raises(TypeError):
        DictRoutingPolicy.from_env("TURNROUTER_TEST_POLICY")
    with pytest.raises(TypeError):
        DictRoutingPolicy.from_env(
            "TURNROUTER_TEST_POLICY",
            loader=lambda raw: ["x"],  # type: ignore[arg-type,return-value]
        )


def test_update_mapping_validates_before_swapping() -> None:
    """An invalid new mapping is rejected and the old one stays in force."""
    policy = DictRoutingPolicy({"p1": "billing"})
    with pytest.raises(PolicyError):
        policy.update_mapping({"p1": "support", "p2": 5})  # type: ignore[dict-item]
    assert policy.select(request("p1")) == "billing"
    policy.update_mapping({"p1": "support"})
    assert policy.select(request("p1")) == "support"
    assert dict(policy.mapping) == {"p1": "support"}


def test_mapping_is_copied_and_read_only() -> None:
    """Mutating the source dict later does not change the policy."""
    source: dict[str, PolicyChoice] = {"p1": "billing"}
    policy = DictRoutingPolicy(source)
    source["p1"] = "support"
    assert policy.select(request("p1")) == "billing"
    with pytest.raises(TypeError):
        policy.mapping["p1"] = "x"  # type: ignore[index]


def test_constructor_rejects_bad_arguments() -> None:
    """Non-mapping input is a TypeError; a non-callable key_getter a ConfigurationError."""
    with pytest.raises(TypeError):
        DictRoutingPolicy(["p1"])  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="key_getter"):
        DictRoutingPolicy({}, key_getter="participant")  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_hot_reload_under_concurrent_decisions() -> None:
    """Decisions running while the mapping is swapped see the old or the new route only."""
    policy = DictRoutingPolicy({"p1": "billing"})
    fallback = FixedDecisions(FALLBACK_DECISION)
    service = PolicyDecisions(policy, fallback)
    seen: list[str] = []

    async def decide_many() -> None:
        for _ in range(200):
            seen.append((await service.decide(request("p1"))).choice)
            await anyio.lowlevel.checkpoint()

    async def reload_many() -> None:
        for index in range(200):
            policy.update_mapping({"p1": "support" if index % 2 else "billing"})
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as group:
        for _ in range(4):
            group.start_soon(decide_many)
        group.start_soon(reload_many)
    assert len(seen) == 800
    assert set(seen) == {"billing", "support"}
    assert fallback.calls == 0


@pytest.mark.anyio
async def test_policy_pins_candidate_route_with_policy_rationale() -> None:
    """A mapped candidate route is chosen and labelled as a policy choice."""
    fallback = FixedDecisions(FALLBACK_DECISION)
    decision = await PolicyDecisions(DictRoutingPolicy({"p1": "billing"}), fallback).decide(
        request("p1")
    )
    assert decision.choice == "billing"
    assert decision.rationale == "policy: key=p1 -> billing"
    assert decision.confidence == 1.0
    assert dict(decision.scores) == {"billing": 1.0}
    assert fallback.calls == 0


@pytest.mark.anyio
async def test_policy_clarify_forces_clarification() -> None:
    """A policy "clarify" answers clarify without asking the fallback."""
    fallback = FixedDecisions(FALLBACK_DECISION)
    decision = await PolicyDecisions(DictRoutingPolicy({}, default=CLARIFY), fallback).decide(
        request()
    )
    assert decision.choice == CLARIFY
    assert decision.rationale.startswith("policy:")
    assert fallback.calls == 0


@pytest.mark.parametrize("mapping", [{}, {"p1": "weather"}])
@pytest.mark.anyio
async def test_unmapped_or_non_candidate_falls_through_unchanged(
    mapping: dict[str, PolicyChoice],
) -> None:
    """None or a non-candidate route returns the fallback's decision unchanged."""
    fallback = FixedDecisions(FALLBACK_DECISION)
    decision = await PolicyDecisions(DictRoutingPolicy(mapping), fallback).decide(request("p1"))
    assert decision is FALLBACK_DECISION
    assert fallback.calls == 1


@pytest.mark.anyio
async def test_a_pinned_route_that_is_not_a_candidate_is_logged_once_per_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A misspelt (or ineligible) pinned route is logged once per name, with the name; a
    route that declined this turn (excluded) is not; the names logged are bounded."""
    policy = DictRoutingPolicy({"p1": "biling", "p2": "billing"})
    decisions = PolicyDecisions(policy, FixedDecisions(FALLBACK_DECISION))
    with caplog.at_level("WARNING", logger="turnrouter.decisions"):
        for _ in range(3):
            assert await decisions.decide(request("p1")) is FALLBACK_DECISION
        declined = RouteRequest(AgentTurn("p2", "t1", "x"), AIDS[1:], frozenset({"billing"}))
        assert await decisions.decide(declined) is FALLBACK_DECISION
    assert len(caplog.records) == 1
    assert "'biling'" in caplog.records[0].getMessage()
    caplog.clear()
    many = PolicyDecisions(DictRoutingPolicy({f"p{n}": f"route-{n}" for n in range(100)}),
                           FixedDecisions(FALLBACK_DECISION))
    with caplog.at_level("WARNING", logger="turnrouter.decisions"):
        for n in range(100):
            await many.decide(request(f"p{n}"))
    assert len(caplog.records) == MAX_NOTED_POLICY_ROUTES
    # The last one says the names after it go unlogged.
    assert [r for r in caplog.records if "the last name logged" in r.getMessage()] == [
        caplog.records[-1]]


class AsyncPolicy:
    """A policy whose select is a coroutine."""

    def __init__(self, choice: object) -> None:
        self.choice = choice

    async def select(self, request: RouteRequest) -> PolicyChoice:
        return self.choice  # type: ignore[return-value]


@pytest.mark.anyio
async def test_awaitable_policy_is_supported() -> None:
    """A policy returning an awaitable is awaited; its rationale has no key."""
    policy: RoutingPolicy = AsyncPolicy("support")
    decision = await PolicyDecisions(policy, FixedDecisions(FALLBACK_DECISION)).decide(request())
    assert decision.choice == "support"
    assert decision.rationale == "policy: -> support"


@pytest.mark.anyio
async def test_policy_returning_non_str_is_policy_error() -> None:
    """A policy returning something other than str or None raises PolicyError."""
    service = PolicyDecisions(AsyncPolicy(7), FixedDecisions(FALLBACK_DECISION))
    with pytest.raises(PolicyError):
        await service.decide(request())


def test_policy_decisions_rejects_bad_arguments() -> None:
    """A policy without select or a fallback without decide is rejected."""
    with pytest.raises(ConfigurationError, match="policy"):
        PolicyDecisions(object(), FixedDecisions(FALLBACK_DECISION))  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="fallback"):
        PolicyDecisions(DictRoutingPolicy({}), object())  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_policy_in_front_of_lexical_composes() -> None:
    """A policy pins some participants while others get the lexical decision."""
    from turnrouter.decisions import LexicalDecisions

    service = PolicyDecisions(DictRoutingPolicy({"vip": "support"}), LexicalDecisions())
    pinned = await service.decide(request("vip", "my invoice"))
    assert (pinned.choice, pinned.rationale) == ("support", "policy: key=vip -> support")
    other = await service.decide(request("p2", "my invoice"))
    assert other.rationale.startswith("lexical:")


# ---------------------------------------------------------------- bounds and bad input


def test_policy_longer_than_max_bytes_is_a_policy_error(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Documents over max_bytes raise PolicyError from every loader; a larger cap loads them."""
    payload = json.dumps({f"p{i}": "billing" for i in range(100)})
    with pytest.raises(PolicyError, match="max_bytes=100"):
        DictRoutingPolicy.from_json(payload, max_bytes=100)
    assert len(DictRoutingPolicy.from_json(payload, max_bytes=len(payload)).mapping) == 100
    path = tmp_path / "big.json"
    path.write_text(payload, encoding="utf-8")
    with pytest.raises(PolicyError, match="max_bytes=100"):
        DictRoutingPolicy.from_json_file(path, max_bytes=100)
    monkeypatch.setenv("TURNROUTER_TEST_POLICY", payload)
    with pytest.raises(PolicyError, match="max_bytes=100"):
        DictRoutingPolicy.from_env("TURNROUTER_TEST_POLICY", max_bytes=100)
    with pytest.raises(PolicyError, match="max_bytes=100"):
        DictRoutingPolicy.from_env("TURNROUTER_TEST_POLICY", max_bytes=100, loader=json.loads)
    with pytest.raises(ConfigurationError, match="max_bytes"):
        DictRoutingPolicy.from_json("{}", max_bytes=0)


def test_default_cap_is_one_mebibyte() -> None:
    """Without max_bytes, a document just over 1 MiB is refused."""
    payload = '{"p": "billing"}' + " " * (1 << 20)
    with pytest.raises(PolicyError, match="max_bytes=1048576"):
        DictRoutingPolicy.from_json(payload)


def test_non_utf8_policies_are_policy_errors(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Invalid UTF-8 bytes, files and environment values raise PolicyError, chained."""
    with pytest.raises(PolicyError, match="UTF-8") as caught:
        DictRoutingPolicy.from_json(b'{"p1": "bill\xffing"}')
    assert isinstance(caught.value.__cause__, UnicodeDecodeError)
    path = tmp_path / "latin1.json"
    path.write_bytes('{"p1": "caf\u00e9"}'.encode("latin-1"))
    with pytest.raises(PolicyError, match=r"latin1\.json.*UTF-8"):
        DictRoutingPolicy.from_json_file(path)
    monkeypatch.setenv("TURNROUTER_TEST_POLICY", '{"p1": "caf\udce9"}')  # undecodable byte
    with pytest.raises(PolicyError, match="UTF-8"):
        DictRoutingPolicy.from_env("TURNROUTER_TEST_POLICY")


def test_deeply_nested_policy_is_a_policy_error() -> None:
    """JSON nested past the recursion limit raises PolicyError, not RecursionError."""
    with pytest.raises(PolicyError, match="nested too deeply") as caught:
        DictRoutingPolicy.from_json('{"p1": ' + "[" * 100_000)
    assert isinstance(caught.value.__cause__, RecursionError)
    with pytest.raises(PolicyError, match="p1"):
        DictRoutingPolicy.from_json('{"p1": ' + "[" * 500 + "]" * 500 + "}")


def test_escaped_lone_surrogates_are_policy_errors() -> None:
    """Keys or routes holding a JSON-escaped lone surrogate are not valid text."""
    with pytest.raises(PolicyError, match="lone surrogate"):
        DictRoutingPolicy.from_json('{"p\\ud800": "billing"}')
    with pytest.raises(PolicyError, match="lone surrogate"):
        DictRoutingPolicy.from_json('{"p1": "bill\\udc00"}')


def test_unreadable_policy_file_is_a_policy_error(tmp_path: Path) -> None:
    """A missing file or a directory raises PolicyError chained from the OSError, and
    is that OSError too: a caller written from the reference (whose loader opens the
    file itself) catches `FileNotFoundError` (contract18 F8)."""
    with pytest.raises(PolicyError, match="cannot be read") as caught:
        DictRoutingPolicy.from_json_file(tmp_path / "missing.json")
    assert isinstance(caught.value.__cause__, FileNotFoundError)
    with pytest.raises(FileNotFoundError, match=r"missing\.json' cannot be read"):
        DictRoutingPolicy.from_json_file(tmp_path / "missing.json")
    with pytest.raises(PolicyError, match="cannot be read") as directory:
        DictRoutingPolicy.from_json_file(tmp_path)
    assert isinstance(directory.value, OSError) and isinstance(directory.value, ValueError)


def test_over_long_integer_literal_is_a_policy_error() -> None:
    """An integer past Python's int-conversion limit is a PolicyError, not a bare ValueError."""
    with pytest.raises(PolicyError, match="not valid JSON"):
        DictRoutingPolicy.from_json('{"p1": ' + "1" * 10_000 + "}")


# ---------------------------------------------------------------- the reference's contract


def test_key_getter_returning_none_gets_the_default() -> None:
    """A request the key_getter gives no key falls back to the configured default."""
    policy = DictRoutingPolicy({"billing": "billing"}, default="support",
                               key_getter=by_query_prefix())
    assert policy.select(request(query="no prefix here")) == "support"
    assert policy.select(request(query="billing: refund")) == "billing"


def test_loaders_forward_default_and_key_getter(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """from_json, from_json_file and from_env pass default and key_getter to the policy."""
    payload = '{"billing": "billing"}'
    path = tmp_path / "policy.json"
    path.write_text(payload, encoding="utf-8")
    monkeypatch.setenv("TURNROUTER_TEST_POLICY", payload)
    prefix = by_query_prefix()
    policies = [
        DictRoutingPolicy.from_json(payload, default="support", key_getter=prefix),
        DictRoutingPolicy.from_json_file(path, default="support", key_getter=prefix),
        DictRoutingPolicy.from_env("TURNROUTER_TEST_POLICY", default="support",
                                   key_getter=prefix),
    ]
    for policy in policies:
        assert policy.select(request("p1", "billing: refund")) == "billing"
        assert policy.select(request("billing", "no prefix")) == "support"
        assert policy.default == "support"


def test_constructor_default_is_validated() -> None:
    """A default that is not a route name, 'clarify' or None raises PolicyError naming it."""
    with pytest.raises(PolicyError, match="default"):
        DictRoutingPolicy({}, default=3)  # type: ignore[arg-type]
    with pytest.raises(PolicyError, match="default"):
        DictRoutingPolicy({}, default="")


def test_dict_policy_satisfies_the_protocol() -> None:
    """DictRoutingPolicy is a RoutingPolicy (the protocol is runtime-checkable)."""
    assert isinstance(DictRoutingPolicy({}), RoutingPolicy)
    assert not isinstance(object(), RoutingPolicy)


@pytest.mark.anyio
async def test_a_policy_forced_clarification_is_counted_as_policy_not_low_confidence() -> None:
    """Through the router: a policy's "clarify" is reason "policy"; a fallback service's
    clarify without scores stays "low_confidence"."""
    agents = {"billing": ScriptedAgent("billing"), "support": ScriptedAgent("support")}
    observer = RecordingObserver()
    policy = DictRoutingPolicy({"p1": CLARIFY})
    router = AgentRouter(agents, PolicyDecisions(policy, FixedDecisions(
        RouteDecision(CLARIFY, rationale="lexical: clarify"))), output=OutputRecorder(),
        default_destination="support", telemetry=observer)
    try:
        await router.handle(AgentTurn("p1", "t1", "hello"))
        await router.handle(AgentTurn("p2", "t2", "hello"))
    finally:
        await router.stop()
    def reasons(turn_id: str) -> list[str]:
        return [event[1] for event in observer.turns[turn_id] if event[0] == "clarification"]
    assert reasons("t1") == ["policy"]
    assert reasons("t2") == ["low_confidence"]
    assert agents["billing"].count("answer") == agents["support"].count("answer") == 0


def test_a_policy_file_that_is_a_fifo_or_holds_a_nul_is_a_policy_error(tmp_path: Path) -> None:
    """A FIFO nobody writes is refused at once (it blocked the start for ever: bounds17
    H3), and a path holding a NUL is a `PolicyError` naming the file, not a bare
    ValueError."""
    fifo = tmp_path / "policy.fifo"
    os.mkfifo(fifo)
    with pytest.raises(PolicyError, match=r"policy\.fifo.*not a regular file"):
        DictRoutingPolicy.from_json_file(fifo)
    with pytest.raises(PolicyError, match=r"policy file.*cannot be read"):
        DictRoutingPolicy.from_json_file("a\x00b")


@pytest.mark.parametrize(("payload", "problem"), [
    ('{"alice": "billing", "alice": "clarify"}', "duplicate key 'alice'"),
    ('{"alice": "billing"}'.encode("utf-16"), "not valid UTF-8"),
    ('{"alice": "billing"}'.encode("utf-32"), "not valid UTF-8"),
])
def test_a_policy_with_a_participant_twice_or_not_in_utf8_is_refused(
        payload: str | bytes, problem: str) -> None:
    """Two entries for one key are refused naming it (the last one was kept, so a
    policy file's first entry silently lost), and bytes are UTF-8 only, as documented
    (UTF-16 and UTF-32 were decoded too): bounds17 L1."""
    with pytest.raises(PolicyError, match=problem):
        DictRoutingPolicy.from_json(payload)


@pytest.mark.anyio
async def test_a_sequence_choice_takes_its_first_route_that_applies() -> None:
    """The reference's decision may be "a sequence of names to route to": the first
    that is a candidate (or "clarify") is taken; none applying falls through as a
    single unavailable route does; an empty one has no opinion (contract18 F7: a list
    was refused). From JSON too, and from a policy's own `select`."""
    only_support = (AIDS[1],)
    policy = DictRoutingPolicy.from_json(
        '{"p1": ["billing", "support"], "p2": ["weather", "clarify", "billing"], '
        '"p3": [], "p4": ["weather"]}')
    fallback = FixedDecisions(FALLBACK_DECISION)
    service = PolicyDecisions(policy, fallback)
    assert (await service.decide(request("p1"))).choice == "billing"
    pinned = await service.decide(request("p1", aids=only_support))
    assert (pinned.choice, pinned.rationale) == ("support", "policy: key=p1 -> support")
    assert (await service.decide(request("p2"))).choice == CLARIFY
    assert fallback.calls == 0
    assert await service.decide(request("p3")) is FALLBACK_DECISION
    assert await service.decide(request("p4")) is FALLBACK_DECISION
    assert fallback.calls == 2
    assert policy.select(request("p1")) == ("billing", "support")
    awaited = PolicyDecisions(AsyncPolicy(["weather", "support"]), fallback)
    assert (await awaited.decide(request())).choice == "support"


def test_a_sequence_choice_is_validated_by_position_and_bounded() -> None:
    """Each name of a sequence is checked (its index named), and a sequence holds at most
    MAX_POLICY_SEQUENCE names."""
    with pytest.raises(PolicyError, match=r"'p1'\]\[1\] must be a route name"):
        DictRoutingPolicy({"p1": ["billing", 7]})  # type: ignore[list-item]
    with pytest.raises(PolicyError, match="over MAX_POLICY_SEQUENCE"):
        DictRoutingPolicy({"p1": ["billing"] * (MAX_POLICY_SEQUENCE + 1)})
    with pytest.raises(PolicyError, match=r"default\[0\]"):
        DictRoutingPolicy({}, default=[""])


def test_a_router_warns_at_construction_of_policy_routes_it_does_not_have(
        caplog: pytest.LogCaptureFixture) -> None:
    """A route misspelt in the policy (mapped, in a list, or the default) is named when
    the router is built, not only at the first turn that hits it (newcomer18 F8); the
    fallback's example keys are checked through the policy service too. "clarify" and
    registered routes say nothing."""
    policy = DictRoutingPolicy({"p1": "biling", "p2": ["support", "weathr"], "p3": "clarify",
                                "p4": "billing"}, default="suport")
    service = PolicyDecisions(policy, LexicalDecisions(examples={"billng": ["my invoice"]}))
    assert service.policy_routes == ("biling", "support", "weathr", "billing", "suport")
    assert service.example_routes == ("billng",)
    agents = {name: ScriptedAgent(name) for name in ("billing", "support", "conversation")}
    with caplog.at_level(logging.WARNING, logger="turnrouter"):
        AgentRouter(agents, service, output=OutputRecorder())
    messages = [record.getMessage() for record in caplog.records]
    [named] = [m for m in messages if "routing policy naming" in m]
    assert "['biling', 'weathr', 'suport']" in named
    assert any("has examples for ['billng']" in m for m in messages)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="turnrouter"):
        AgentRouter(agents, PolicyDecisions(DictRoutingPolicy({"p1": ["billing", "clarify"]}),
                                            FixedDecisions(FALLBACK_DECISION)),
                    output=OutputRecorder())
    assert caplog.records == []
