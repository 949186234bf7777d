"""Fuzz: routing policies loaded from junk, huge, deeply nested and non-UTF-8 JSON,
files and environment variables.

Rule: a valid `DictRoutingPolicy` or `PolicyError` (a ValueError) / `TypeError` for a
document that is not an object; never RecursionError, UnicodeDecodeError or OSError.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnrouter import PolicyError
from turnrouter.decisions import DictRoutingPolicy

from .fuzz import ANY_TEXT, HUGE_TEXT, JUNK, NON_UTF8, SCALARS, nested_json, valid_text

FUZZ = settings(max_examples=120, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example])

JSON_VALUES = st.recursive(
    st.one_of(SCALARS.filter(lambda v: not isinstance(v, int) or abs(v) < 10**300), ANY_TEXT),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(ANY_TEXT, inner, max_size=3)),
    max_leaves=10,
)
DOCUMENTS = st.one_of(
    st.dictionaries(ANY_TEXT, st.one_of(st.none(), ANY_TEXT, JSON_VALUES), max_size=5)
    .map(json.dumps),
    JSON_VALUES.map(json.dumps),
    st.builds(nested_json, st.sampled_from([10, 900, 5_000, 200_000]),
              st.sampled_from(["list", "dict"])),
    st.builds(lambda doc: '{"p": ' + doc + "}", st.builds(
        nested_json, st.sampled_from([5, 5_000]), st.sampled_from(["list", "dict"]))),
    HUGE_TEXT.map(lambda text: json.dumps({"p": text})),
    ANY_TEXT,
)
RAW = st.one_of(DOCUMENTS, DOCUMENTS.map(lambda d: d.encode("utf-8", "surrogatepass")),
                NON_UTF8, st.binary(max_size=64))


def load(factory: Any, *args: Any, **kwargs: Any) -> DictRoutingPolicy | None:
    """The policy, or None after a documented error."""
    try:
        policy: DictRoutingPolicy = factory(*args, **kwargs)
    except (PolicyError, TypeError):
        return None
    for key, value in policy.mapping.items():
        names = value if isinstance(value, tuple) else (value,)  # a list choice: routes
        assert valid_text(key) and (value is None or all(
            isinstance(name, str) and valid_text(name) and name for name in names))
    return policy


@FUZZ
@given(RAW)
def test_from_json(payload: str | bytes) -> None:
    """from_json: a valid policy, PolicyError or TypeError for any text or bytes."""
    load(DictRoutingPolicy.from_json, payload)


@FUZZ
@given(JUNK)
def test_from_json_with_junk_objects(payload: Any) -> None:
    """from_json given something that is not text or bytes: TypeError or PolicyError."""
    load(DictRoutingPolicy.from_json, payload)


@FUZZ
@given(st.one_of(RAW.map(lambda r: r if isinstance(r, bytes)
                         else r.encode("utf-8", "surrogatepass")),
                 st.binary(max_size=256)))
def test_from_json_file(raw: bytes) -> None:
    """from_json_file: any file content gives a policy or a documented error."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "policy.json"
        path.write_bytes(raw)
        load(DictRoutingPolicy.from_json_file, path)


@FUZZ
@given(st.one_of(DOCUMENTS, NON_UTF8.map(lambda raw: raw.decode("utf-8", "surrogateescape")))
       .filter(lambda text: "\x00" not in text))
def test_from_env(value: str) -> None:
    """from_env: any environment value (undecodable bytes included) gives a policy or a
    documented error."""
    name = "TURNROUTER_FUZZ_POLICY"
    with pytest.MonkeyPatch.context() as patch:
        try:
            patch.setenv(name, value)
        except UnicodeEncodeError:  # a surrogate that is not an escaped byte: not settable
            return
        assert name in os.environ
        load(DictRoutingPolicy.from_env, name)


@FUZZ
@given(st.one_of(ANY_TEXT, JUNK))
def test_from_env_with_any_name(name: Any) -> None:
    """from_env given any name (lone surrogates, NUL, junk objects): a policy, KeyError
    for an unset variable, or a documented error; never os.environ's UnicodeEncodeError."""
    with contextlib.suppress(KeyError, TypeError, PolicyError):
        DictRoutingPolicy.from_env(name)


def test_from_env_names_a_name_os_environ_cannot_hold() -> None:
    with pytest.raises(PolicyError, match=r"name .* is not valid UTF-8"):
        DictRoutingPolicy.from_env("TURNROUTER_\ud800")


@FUZZ
@given(st.one_of(st.dictionaries(st.one_of(ANY_TEXT, SCALARS), st.one_of(ANY_TEXT, JUNK),
                                 max_size=4), JUNK))
def test_mapping(mapping: Any) -> None:
    """The constructor and update_mapping accept only str -> route/None mappings."""
    load(DictRoutingPolicy, mapping)
    policy = DictRoutingPolicy({})
    try:
        policy.update_mapping(mapping)
    except (PolicyError, TypeError):
        assert policy.mapping == {}
