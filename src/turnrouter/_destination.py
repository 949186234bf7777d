"""`Destination`: a destination agent written as one class with the obvious defaults.

`RoutableAgent` is the protocol the router calls (four methods); most destinations only
need to answer. Subclass `Destination`, give it a description (the routing aid's hint)
and implement `answer`; admission accepts, release does nothing, and the routing aid is
built from the name, description, priority and `is_eligible`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, ClassVar

from ._contracts import Admission, AgentTurn, DestinationResult, RoutingAid
from ._exceptions import ConfigurationError, ContractTypeError

__all__ = ["Destination"]


#: The routing aid's fields a `Destination` declares as class attributes.
_FIELDS = ("name", "description", "priority")


class _AidField:
    """`Destination.name`, `.description` and `.priority`: on an instance, what its
    routing aid carries (given to `__init__`, else the class attribute); on a class,
    the class attribute a subclass declared. Set on an instance (after
    `super().__init__()`), it changes the routing aid, validated: a description set
    late used to reach nothing, and `.description` showed the class's (newcomer14)."""

    __slots__ = ("field",)

    def __init__(self, field: str) -> None:
        self.field = field

    def __get__(self, instance: Any, owner: type) -> Any:
        aid = None if instance is None else getattr(instance, "_aid", None)
        if aid is None:  # the class, or an instance before super().__init__()
            return getattr(owner, f"_declared_{self.field}")
        return getattr(aid, self.field)

    def __set__(self, instance: Any, value: Any) -> None:
        aid = getattr(instance, "_aid", None)
        if aid is None:
            raise ConfigurationError(
                f"{type(instance).__name__}: set {self.field} after super().__init__(), or "
                f"pass it: super().__init__({self.field}=...)")
        fields = {"name": aid.name, "description": aid.description, "priority": aid.priority}
        fields[self.field] = value
        instance._aid = RoutingAid(**fields)  # validated, naming a bad field


class Destination:
    """Base class of a destination agent: subclass it and implement `answer`.

    Defaults: `admit` accepts every turn, `release` does nothing, `routing_aid` describes
    the route with `name`, `description` and `priority` and asks `is_eligible` whether
    this participant may be routed here. Override any of them when the destination needs
    more (decline out-of-scope turns in `admit`, take focus by returning
    `DestinationResult("focus")`, free resources in `release`).

    Args:
        description: The routing hint a decision service reads (`RoutingAid.description`);
            defaults to the class attribute `description`; `destination.description`
            returns it. `name`, `description` and `priority` set on the instance after
            `super().__init__()` change the routing aid (validated).
        name: The route name in the routing aid; defaults to the class attribute `name`,
            else the class name; `destination.name` returns it. The router reports and
            acknowledges the destination under the key it was registered with in
            `AgentRouter(destinations=...)` whatever this says.
        priority: Tie-breaking preference after relevance, higher wins (default: the
            class attribute `priority`, 0).
    """

    if TYPE_CHECKING:
        name: str
        description: str
        priority: int
    else:
        name = _AidField("name")
        description = _AidField("description")
        priority = _AidField("priority")
    _declared_name: ClassVar[str] = ""
    _declared_description: ClassVar[str] = ""
    _declared_priority: ClassVar[int] = 0

    __slots__ = ("_aid",)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # A subclass's `name = "music"` (description, priority) becomes the class default,
        # and the attribute stays the descriptor, so an instance given `name="jazz"`
        # reports "jazz".
        super().__init_subclass__(**kwargs)
        for field in _FIELDS:
            declared = cls.__dict__.get(field)
            if not isinstance(declared, _AidField):
                if declared is not None:
                    setattr(cls, f"_declared_{field}", declared)
                setattr(cls, field, _AidField(field))

    def __init__(self, description: str | None = None, *, name: str | None = None,
                 priority: int | None = None) -> None:
        cls = type(self)
        aid_name = cls._declared_name if name is None else name
        if not isinstance(aid_name, str):
            raise ContractTypeError(
                f"{cls.__name__}: name must be a str, got {type(aid_name).__name__}")
        # RoutingAid validates every field and names the one that is wrong.
        self._aid = RoutingAid(
            aid_name or cls.__name__.lower(),
            cls._declared_description if description is None else description,
            cls._declared_priority if priority is None else priority,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._aid.description!r}, name={self._aid.name!r})"

    def is_eligible(self, participant_id: str) -> bool:
        """Whether this participant may be routed here now (default: always)."""
        return True

    def routing_aid(self, participant_id: str) -> RoutingAid:
        """The name, description and priority, eligible as `is_eligible` says."""
        if self.is_eligible(participant_id):
            return self._aid
        aid = self._aid
        return RoutingAid(aid.name, aid.description, aid.priority, eligible=False,
                          eligibility="ineligible")

    async def admit(self, turn: AgentTurn, *, focused: bool) -> Admission:
        """Accept every turn (override to decline, clarify or release before output)."""
        return Admission("accept")

    async def answer(
        self, turn: AgentTurn, *, started: Callable[[], Awaitable[None]]
    ) -> DestinationResult:
        """Answer the turn: await `started()` right before the first output, deliver the
        answer, return `DestinationResult(text=...)` (the text kept in history)."""
        raise NotImplementedError(f"{type(self).__name__} must implement answer()")

    async def release(self, participant_id: str) -> None:
        """Nothing to release by default (called when focus is cleared or on departure)."""
