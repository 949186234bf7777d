"""`Destination`: a destination in one class, with the defaults the router relies on."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnrouter import (
    AgentRouter,
    AgentTurn,
    ConfigurationError,
    ContractTypeError,
    ContractValueError,
    Destination,
    DestinationResult,
    RoutableAgent,
    RouteRequest,
    RoutingAid,
)
from turnrouter.testing import OutputRecorder, ScriptedDecisions

pytestmark = pytest.mark.anyio


class Weather(Destination):
    description = "forecasts, rain, temperature"

    def __init__(self) -> None:
        super().__init__()
        self.heard: list[str] = []

    async def answer(
        self, turn: AgentTurn, *, started: Callable[[], Awaitable[None]]
    ) -> DestinationResult:
        await started()
        self.heard.append(turn.query)
        return DestinationResult(text="Sunny all day.")


class MembersOnly(Destination):
    def is_eligible(self, participant_id: str) -> bool:
        return not participant_id.startswith("guest")

    async def answer(
        self, turn: AgentTurn, *, started: Callable[[], Awaitable[None]]
    ) -> DestinationResult:
        await started()
        return DestinationResult(text="members area")


def test_routing_aid_comes_from_class_attributes_or_arguments() -> None:
    aid = Weather().routing_aid("alice")
    assert (aid.name, aid.description, aid.priority, aid.eligible) == (
        "weather", "forecasts, rain, temperature", 0, True)
    aid = MembersOnly("the members' area", name="members", priority=3).routing_aid("alice")
    assert (aid.name, aid.description, aid.priority, aid.eligible) == (
        "members", "the members' area", 3, True)


def test_is_eligible_makes_the_aid_ineligible() -> None:
    aid = MembersOnly("members").routing_aid("guest-1")
    assert aid.eligible is False
    assert aid.eligibility == "ineligible"


def test_a_destination_is_a_routable_agent() -> None:
    assert isinstance(Weather(), RoutableAgent)


async def test_defaults_accept_and_release_nothing() -> None:
    weather = Weather()
    turn = AgentTurn("alice", "t1", "rain?")
    assert (await weather.admit(turn, focused=True)).disposition == "accept"
    await weather.release("alice")
    assert (await weather.admit(turn, focused=False)).disposition == "accept"


async def test_answer_must_be_implemented() -> None:
    class Empty(Destination):
        pass

    async def started() -> None:
        return None

    with pytest.raises(NotImplementedError, match="Empty must implement answer"):
        await Empty("nothing").answer(AgentTurn("alice", "t1", "hi"), started=started)
    # The router refuses it when built, not at the first turn routed there (newcomer14).
    with pytest.raises(ContractTypeError, match=r"'empty' \(.*Empty\) does not implement"):
        AgentRouter({"empty": Empty("nothing"), "conversation": Weather()},
                    ScriptedDecisions("empty"))


async def test_routed_through_the_router_and_ineligible_routes_hidden() -> None:
    weather, members = Weather(), MembersOnly("members area")
    seen: list[RouteRequest] = []

    def choose(request: RouteRequest) -> str:
        seen.append(request)
        return "weather"

    output = OutputRecorder()
    router = AgentRouter({"weather": weather, "members": members}, ScriptedDecisions(choose),
                         output=output, default_destination="weather")
    result = await router.handle(AgentTurn("guest-1", "t1", "will it rain?"))
    assert result.text == "Sunny all day."
    assert weather.heard == ["will it rain?"]
    assert [aid.name for aid in seen[0].candidates] == ["weather"]
    await router.stop()


@given(description=st.one_of(st.none(), st.integers(), st.binary(), st.text(max_size=50),
                             st.text(min_size=5000, max_size=6000)),
       name=st.one_of(st.none(), st.integers(), st.text(max_size=50)),
       priority=st.one_of(st.none(), st.booleans(), st.floats(), st.integers()))
def test_junk_arguments_raise_a_contract_error_naming_the_field(
        description: object, name: object, priority: object) -> None:
    agent = Weather.__new__(Weather)
    error: Exception | None = None
    try:
        Destination.__init__(agent, description, name=name,  # type: ignore[arg-type]
                             priority=priority)  # type: ignore[arg-type]
    except (ContractTypeError, ContractValueError) as exc:
        error = exc
    if error is not None:
        assert any(field in str(error) for field in ("name", "description", "priority"))
    else:
        aid = agent.routing_aid("alice")
        assert isinstance(aid.description, str) and aid.name
        assert isinstance(aid.priority, int) and not isinstance(aid.priority, bool)


def test_name_returns_the_name_given_else_the_class_default() -> None:
    """`destination.name` is the route name its routing aid carries."""
    class Reply(Destination):
        pass

    class Music(Destination):
        name = "music"

    assert Destination("d", name="billing").name == "billing"
    assert Destination("d", name="billing").routing_aid("p").name == "billing"
    assert Reply("d").name == "reply" and Reply("d", name="weather").name == "weather"
    assert Music.name == "music" and Music("d").name == "music"
    assert Music("d", name="jazz").name == "jazz"
    assert Music("d", name="jazz").routing_aid("p").name == "jazz"


def test_a_subclass_that_skips_the_base_init_is_named_at_construction() -> None:
    """An `__init__` that forgets `super().__init__(description)` leaves no routing aid:
    the router says so when it is built, instead of every turn failing with
    "'Music' object has no attribute '_aid'"."""

    class Music(Destination):
        def __init__(self, playlist: str) -> None:
            self.playlist = playlist

        async def answer(self, turn: AgentTurn, *, started: Callable[[], Awaitable[None]]
                         ) -> DestinationResult:
            await started()
            return DestinationResult(text=self.playlist)

    with pytest.raises(ContractTypeError, match=r"destination 'music' \(.*Music\) was never "
                       r"initialised as a Destination: its __init__ must call "
                       r"super\(\)\.__init__\(description\)"):
        AgentRouter({"music": Music("jazz")}, ScriptedDecisions("music"),
                    output=OutputRecorder())


async def test_a_subclass_with_its_own_routing_aid_needs_no_base_init() -> None:
    """A subclass that describes itself (its own `routing_aid`) uses nothing the base
    `__init__` sets, so skipping it is not refused: the router builds and routes."""

    class Lights(Destination):
        def __init__(self) -> None:
            self.rooms = ("kitchen",)

        def routing_aid(self, participant_id: str) -> RoutingAid:
            return RoutingAid("lights", "turn the lights on or off")

        async def answer(self, turn: AgentTurn, *, started: Callable[[], Awaitable[None]]
                         ) -> DestinationResult:
            await started()
            return DestinationResult(text=f"{self.rooms[0]} lights on")

    router = AgentRouter({"lights": Lights()}, ScriptedDecisions("lights"),
                         output=OutputRecorder())
    result = await router.handle(AgentTurn("alice", "t1", "lights on"))
    assert result.text == "kitchen lights on"
    await router.stop()


def test_the_attributes_say_what_the_routing_aid_carries() -> None:
    """`.description` and `.priority` are the routing aid's, as `.name` is: given to
    `__init__`, else the class attribute; the class keeps its declared default. Before,
    `.description` showed the class attribute while the aid had the argument
    (newcomer14)."""
    given_one = MembersOnly("the members' area", priority=2)
    assert (given_one.description, given_one.priority) == ("the members' area", 2)
    assert (Weather().description, Weather.description) == (
        "forecasts, rain, temperature", "forecasts, rain, temperature")
    assert (MembersOnly.description, MembersOnly.priority, MembersOnly.name) == ("", 0, "")


def test_set_after_init_the_attributes_change_the_routing_aid() -> None:
    """A description (name, priority) set after `super().__init__()` reaches the routing
    aid, validated; set before it, the error says where to set it. Before, a late
    description reached nothing and the route was scored by its name alone."""
    class Late(Destination):
        def __init__(self) -> None:
            super().__init__()
            self.description = "weather forecast, rain"
            self.priority = 4

    aid = Late().routing_aid("alice")
    assert (aid.name, aid.description, aid.priority) == ("late", "weather forecast, rain", 4)
    late = Late()
    late.name = "forecasts"
    assert late.routing_aid("alice").name == late.name == "forecasts"
    with pytest.raises(ContractValueError):
        late.description = "lone \ud800"  # no lone surrogates in a routing aid
    with pytest.raises(ContractTypeError, match="name must be a str"):
        late.name = 3  # type: ignore[assignment]
    assert late.routing_aid("alice").priority == 4  # unchanged by the refusals

    class Derived(Destination):  # reads the class's values before its own init
        description = "forecasts"
        priority = 1

        def __init__(self, region: str) -> None:
            super().__init__(f"{self.description} for {region}", priority=self.priority + 1)

    derived = Derived("Lyon").routing_aid("alice")
    assert (derived.description, derived.priority) == ("forecasts for Lyon", 2)

    class Early(Destination):
        def __init__(self) -> None:
            self.description = "too early"
            super().__init__()

    with pytest.raises(ConfigurationError, match="set description after super"):
        Early()
