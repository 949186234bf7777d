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
from itertools import accumulate
from typing import Any

from ._redact import preview

__all__ = ["containers", "items", "loads", "nesting"]


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


def containers(data: str | bytes | bytearray, bound: int) -> int:
    """The objects and arrays `data` holds, as parsing would build them, when over
    `bound` (the `{` and `[` characters outside strings); at most `bound`: the count of
    every such character (cheap, and never below the true count).

    What parsing costs grows with the containers it builds, so their number bounds what
    is parsed; a `{` or `[` inside a string costs nothing (a user who says "{{{" or a
    turn id of brackets: counted raw, a participant's history of them made the next
    replica refuse its snapshot, its state lost at its next move)."""
    return _outside(data, "{[", bound)


def items(data: str | bytes | bytearray, bound: int) -> int:
    """The values `data` holds, as parsing would build them, when over `bound` (the `,`,
    `{` and `[` characters outside strings: every value after a container's first
    follows a comma, every container is one); at most `bound`: the count of every such
    character (never below the true count, less one for a lone scalar).

    What parsing costs grows with the values it builds, also where they build no
    container (4 MiB of `0,` is two million numbers: about 0.1 s of parsing, all of it
    holding the interpreter's lock, so a thread parsing it stalls the event loop too)."""
    return _outside(data, ",{[", bound)


def _outside(data: str | bytes | bytearray, chars: str, bound: int) -> int:
    """How many of `chars` `data` holds outside its JSON strings, when over `bound`
    (at most `bound`: the raw count, never below the true one). Strings are found as
    a parser finds them: escaped backslashes, then escaped quotes, taken out (in that
    order, as escapes read left to right), the rest of the quotes delimit them; all in C
    (a regular expression took 0.4 s on 4 MB of escapes, this under 0.1 s)."""
    if isinstance(data, str):
        raw = sum(data.count(char) for char in chars)
        if raw <= bound:
            return raw
        bare = data.replace("\\\\", "").replace('\\"', "")
        inside = "".join(bare.split('"')[1::2])
        return sum(bare.count(char) - inside.count(char) for char in chars)
    marks = [char.encode() for char in chars]
    raw = sum(data.count(mark) for mark in marks)
    if raw <= bound:
        return raw
    bare_bytes = bytes(data).replace(b"\\\\", b"").replace(b'\\"', b"")
    inside_bytes = b"".join(bare_bytes.split(b'"')[1::2])
    return sum(bare_bytes.count(mark) - inside_bytes.count(mark) for mark in marks)


#: Every byte but the brackets (`bytes.translate` deletes them), and the brackets'
#: steps: +1 opening, -1 closing.
_NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))
_STEP = [0] * 256
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1


def nesting(data: str | bytes, bound: int) -> int:
    """How deep the objects and arrays of JSON `data` nest (`{}` is 1, `{"a":[]}` 2),
    when over `bound`; at most `bound` otherwise (then it may be the count of `{` and
    `[` characters, which is never below the depth).

    A JSON reader refuses past its own depth (pydantic's: about 200 levels), and a
    value read alone sits deeper once wrapped in a bigger document (a context patch in
    a participant's snapshot), so its depth is bounded where it is accepted. Brackets
    inside strings do not nest (found as `containers` finds them); the walk over the
    rest is in C, one step a bracket."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    count = raw.count(b"{") + raw.count(b"[")
    if count <= bound:
        return count
    bare = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = b"".join(bare.split(b'"')[0::2]).translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)
