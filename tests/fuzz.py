"""Hypothesis strategies shared by the boundary fuzz tests (not a test module).

Every boundary is fed the same families of bad input: junk of any type, text with lone
surrogates and control characters, huge values (up to 1 MB), deeply nested containers,
and bytes that are not UTF-8.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

#: Any code point, lone surrogates included (hypothesis excludes them by default).
ANY_CHAR = st.characters(exclude_categories=())
#: A lone surrogate: `ANY_CHAR` draws one in about 1 of 500 texts, too rarely to count on.
SURROGATE = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
ANY_TEXT = st.one_of(
    st.text(ANY_CHAR, max_size=40),
    st.builds(lambda head, surrogate, tail: head + surrogate + tail,
              st.text(max_size=15), SURROGATE, st.text(ANY_CHAR, max_size=15)),
)
#: Text that is valid (no surrogates), for fields that should be accepted.
VALID_TEXT = st.text(max_size=40)
HUGE_TEXT = st.builds(lambda char, size: char * size, ANY_CHAR,
                      st.sampled_from([10_000, 300_000, 1_000_000]))
NON_UTF8 = st.binary(min_size=1, max_size=64).map(lambda raw: b"\xff" + raw)
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(),
    st.builds(lambda exponent, sign: sign * 10**exponent, st.sampled_from([400, 5000]),
              st.sampled_from([1, -1])),
    st.floats(allow_nan=True, allow_infinity=True),
)


def nest(depth: int, kind: str) -> Any:
    """A container `depth` levels deep (list, dict or tuple), built without recursion."""
    value: Any = "leaf"
    for _ in range(depth):
        value = [value] if kind == "list" else {"k": value} if kind == "dict" else (value,)
    return value


NESTED = st.builds(nest, st.sampled_from([2, 50, 5_000, 100_000]),
                   st.sampled_from(["list", "dict", "tuple"]))
SMALL_CONTAINERS = st.recursive(
    st.one_of(SCALARS, ANY_TEXT, st.binary(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.tuples(inner, inner),
                            st.dictionaries(ANY_TEXT, inner, max_size=3),
                            st.frozensets(st.text(max_size=5), max_size=3)),
    max_leaves=8,
)
#: Anything at all.
JUNK = st.one_of(SCALARS, ANY_TEXT, HUGE_TEXT, NON_UTF8, NESTED, SMALL_CONTAINERS,
                 st.just(object()), st.just(b""))
#: Junk that is usually, but not always, a plausible value.
MOSTLY_TEXT = st.one_of(VALID_TEXT, VALID_TEXT, ANY_TEXT, JUNK)


def nested_json(depth: int, kind: str = "list") -> str:
    """A JSON document nested `depth` levels deep."""
    if kind == "list":
        return "[" * depth + "]" * depth
    return '{"k":' * depth + "1" + "}" * depth


def valid_text(value: object) -> bool:
    """A str that can be stored as UTF-8."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
