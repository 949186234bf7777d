"""JSON from other processes, parsed without the standard library's leniencies.

`json.loads` keeps the last of two equal keys (`{"replica": "a", "replica": "b"}` is
"b") and reads `NaN` and `Infinity`: two readers of one message could then disagree on
what it says, and a non-finite number slips past checks that compare. `loads` refuses
both with a `ValueError` naming the problem. It costs about twice `json.loads` (a Python
call per object), so it reads what is rare and decides identity (presence, records), not
the fleet's timing samples (one line per turn, range-checked field by field).
"""

from __future__ import annotations

import json
from typing import Any

from ._redact import preview

__all__ = ["loads"]


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data = dict(pairs)
    if len(data) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {preview(key)} in a JSON object")
            seen.add(key)
    return data


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads(data: str | bytes) -> Any:
    """`json.loads` refusing duplicate keys and NaN/Infinity (`ValueError`; deep
    nesting still raises `RecursionError`, which callers bound or catch)."""
    return json.loads(data, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
