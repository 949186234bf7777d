"""The base of turnrouter's pydantic contract models (context patches, snapshots).

Built with bad fields, a pydantic model raises pydantic's `ValidationError`, which is no
`TurnrouterError`: `ContractModel` raises `ContractValueError` naming the first bad field
instead, as every other contract object does (still a `ValueError`, as before). Only the
direct construction `Model(...)` is wrapped, by the metaclass's `__call__`: an overridden
`__init__` would make pydantic call it for `model_validate`, `model_validate_json` and
every nested model too (their `strict=` and `context=` ignored, and a snapshot read from
JSON twice as slow: review14). Type checkers see a plain `BaseModel` subclass, so each
model keeps its fields' own constructor signature.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ValidationError

from ._exceptions import ContractValueError
from ._redact import preview

__all__ = ["ContractModel", "contract_error", "error_location"]

#: Longest location `error_location` shows.
_LOCATION_CHARS = 200


def error_location(loc: Iterable[object]) -> str:
    """A validation error's location (`history.0.patch`) for a message: a field name
    or an index as it is; any other part (a snapshot's unknown key, which may be 1 MB
    of terminal escapes) quoted and shortened by `preview`; "(root)" when empty. Never
    longer than 200 characters, so an error naming it can go to a log line."""
    parts = [part if isinstance(part, str) and part.isidentifier() and part.isascii()
             and len(part) <= 64 else str(part) if isinstance(part, int)
             else preview(part) for part in loc]
    where = ".".join(parts) or "(root)"
    return where if len(where) <= _LOCATION_CHARS else where[:_LOCATION_CHARS - 3] + "..."


def contract_error(what: str, exc: ValidationError) -> ContractValueError:
    """`ContractValueError` naming `exc`'s first bad field (never its input: it may be
    user text) and how many there are."""
    errors = exc.errors(include_input=False, include_url=False)
    if not errors:
        return ContractValueError(f"invalid {what}")
    first = errors[0]
    where = error_location(first["loc"])
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return ContractValueError(f"invalid {what}: {where}: {first['msg']}{more}")


if TYPE_CHECKING:
    class ContractModel(BaseModel):
        """A pydantic model whose constructor raises `ContractValueError` for bad fields."""

        _POSITIONAL: ClassVar[tuple[str, ...]] = ()
else:
    class _ContractMeta(type(BaseModel)):  # pydantic's model metaclass
        def __call__(cls, *args: Any, **kwargs: Any) -> Any:
            if args:  # the fields a class takes by position, in order (`_POSITIONAL`)
                args, kwargs = (), _by_position(cls, args, kwargs)
            try:
                return super().__call__(*args, **kwargs)
            except ValidationError as exc:
                raise contract_error(cls.__name__, exc) from exc

    class ContractModel(BaseModel, metaclass=_ContractMeta):
        """A pydantic model whose constructor raises `ContractValueError` for bad fields."""

        #: Field names its constructor takes by position (the reference's dataclass
        #: signature, e.g. `PendingContextPatch`); none by default, as pydantic's.
        _POSITIONAL: ClassVar[tuple[str, ...]] = ()


def _by_position(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with the positional arguments added by the class's `_POSITIONAL` names;
    `TypeError` as a function call gives (too many, or a name given twice)."""
    names: tuple[str, ...] = getattr(cls, "_POSITIONAL", ())
    if len(args) > len(names):
        raise TypeError(f"{cls.__name__}() takes {len(names)} positional arguments but "
                        f"{len(args)} were given")
    given = dict(zip(names, args, strict=False))
    twice = given.keys() & kwargs.keys()
    if twice:
        raise TypeError(f"{cls.__name__}() got multiple values for argument "
                        f"{min(twice)!r}")
    return {**kwargs, **given}
