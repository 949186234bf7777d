"""The base of turnrouter's pydantic contract models (context patches, snapshots).

Built with bad fields, a pydantic model raises pydantic's `ValidationError`, which is no
`TurnrouterError`: `ContractModel` raises `ContractValueError` naming the first bad field
instead, as every other contract object does (still a `ValueError`, as before). Type
checkers keep the fields' own constructor signature: the wrapper exists at run time only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from ._exceptions import ContractValueError

__all__ = ["ContractModel", "contract_error"]


def contract_error(what: str, exc: ValidationError) -> ContractValueError:
    """`ContractValueError` naming `exc`'s first bad field (never its input: it may be
    user text) and how many there are."""
    errors = exc.errors(include_input=False, include_url=False)
    if not errors:
        return ContractValueError(f"invalid {what}")
    first = errors[0]
    where = ".".join(str(part) for part in first["loc"]) or "(root)"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return ContractValueError(f"invalid {what}: {where}: {first['msg']}{more}")


class ContractModel(BaseModel):
    """A pydantic model whose constructor raises `ContractValueError` for bad fields."""

    if not TYPE_CHECKING:
        def __init__(self, /, **data: Any) -> None:
            try:
                super().__init__(**data)
            except ValidationError as exc:
                raise contract_error(type(self).__name__, exc) from exc
