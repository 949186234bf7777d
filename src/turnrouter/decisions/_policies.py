"""Config-driven routing policies that pin or override routes before another service.

A `RoutingPolicy` maps a request to a `PolicyChoice`: None (no opinion, fall through),
a route name (pin it) or "clarify" (force clarification). `DictRoutingPolicy` looks the
choice up in a mapping keyed by `key_getter(request)` (the participant id by default),
loadable from JSON, a file or an environment variable, and hot-reloadable with
`update_mapping`. `PolicyDecisions` applies a policy in front of a fallback service.

Loading is bounded (docs/limits.md): a document longer than `max_bytes` (1 MiB by
default), text that is not UTF-8, JSON nested past the interpreter's recursion limit,
or keys and values that are not valid text all raise `PolicyError`, never a lower-level
error.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

from .. import _strict_json as strict_json
from .._contracts import (
    CLARIFY,
    POLICY_RATIONALE,
    DecisionService,
    RouteDecision,
    RouteRequest,
)
from .._exceptions import ConfigurationError, ContractTypeError, PolicyError
from .._paths import open_regular
from .._redact import has_surrogates, preview

__all__ = [
    "DEFAULT_MAX_POLICY_BYTES",
    "MAX_POLICY_SEQUENCE",
    "DictRoutingPolicy",
    "KeyGetter",
    "PolicyChoice",
    "PolicyDecisions",
    "RoutingPolicy",
    "by_participant",
    "by_query_prefix",
]

logger = logging.getLogger("turnrouter.decisions")

#: Default cap on a policy document: bytes (or characters, for text) of JSON.
DEFAULT_MAX_POLICY_BYTES = 1 << 20
#: Distinct unavailable route names `PolicyDecisions` logs (once each); past it, silent.
MAX_NOTED_POLICY_ROUTES = 64

PolicyChoice = str | Sequence[str] | None
"""None: no decision (fall through); a route name: pin it; "clarify": force
clarification; a sequence of those (the reference's "sequence of names to route to"):
the first that applies to the request (a candidate, or "clarify") is taken."""

#: Most names one sequence choice may hold (a policy names a few fallbacks in order).
MAX_POLICY_SEQUENCE = 16

KeyGetter = Callable[[RouteRequest], str | None]
"""Derives a policy lookup key from a request; None means "no key" (use the default)."""


@runtime_checkable
class RoutingPolicy(Protocol):
    """Chooses (or declines to choose) a route for a request, synchronously or not."""

    def select(self, request: RouteRequest) -> PolicyChoice | Awaitable[PolicyChoice]:
        """Return None to fall through, a route name to pin it, or "clarify"."""
        ...


def by_participant(request: RouteRequest) -> str:
    """Key by participant id (the default): pin routes for given participants."""
    return request.turn.participant_id


def by_query_prefix(separator: str = ":") -> KeyGetter:
    """Key by the query's leading word before `separator` ("billing: my invoice" -> "billing").

    Lower-cased and stripped; queries without the separator have no key (the default
    applies). Useful for explicit operator or test commands.
    """
    if not isinstance(separator, str) or not separator:
        raise ConfigurationError(f"separator must be a non-empty str, got {preview(separator)}")

    def key(request: RouteRequest) -> str | None:
        head, found, _ = request.turn.query.partition(separator)
        head = head.strip().lower()
        return head if found and head else None

    return key


def _validate_choice(where: str, value: object) -> PolicyChoice:
    if value is None:
        return None
    if isinstance(value, list | tuple):
        return _validate_sequence(where, value)
    return _validate_name(where, value)


def _validate_sequence(where: str, value: Sequence[object]) -> tuple[str, ...]:
    if len(value) > MAX_POLICY_SEQUENCE:
        raise PolicyError(f"{where} names {len(value)} routes, over "
                          f"MAX_POLICY_SEQUENCE ({MAX_POLICY_SEQUENCE})")
    return tuple(_validate_name(f"{where}[{index}]", item) for index, item in enumerate(value))


def _validate_name(where: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise PolicyError(
            f"{where} must be a route name, 'clarify', a list of those or None, got "
            f"{type(value).__name__} {preview(value)}"
        )
    if has_surrogates(value):
        raise PolicyError(f"{where} is not valid text (it holds a lone surrogate)")
    return value


def _validate_mapping(mapping: object) -> Mapping[str, PolicyChoice]:
    """A frozen copy of `mapping` after checking every key and value."""
    if not isinstance(mapping, Mapping):
        raise ContractTypeError(
            f"policy mapping must be a mapping of key to route, got {type(mapping).__name__}"
        )
    frozen: dict[str, PolicyChoice] = {}
    for key, value in mapping.items():
        # Fast path (the common case: ASCII ids and route names); messages are built
        # only for a bad entry, so a 1 MiB policy validates in a few milliseconds.
        if type(key) is str and key.isascii() and (
                value is None or (type(value) is str and value and value.isascii())):
            frozen[key] = value
            continue
        if not isinstance(key, str):
            raise PolicyError(f"policy mapping key must be a str, got {preview(key)}")
        if has_surrogates(key):
            raise PolicyError(f"policy mapping key {preview(key)} is not valid text "
                              "(it holds a lone surrogate)")
        frozen[key] = _validate_choice(f"policy mapping[{preview(key)}]", value)
    return MappingProxyType(frozen)


def _check_max_bytes(max_bytes: object) -> int:
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1:
        raise ConfigurationError(f"max_bytes must be an int >= 1, got {preview(max_bytes)}")
    return max_bytes


def _decode(payload: object, source: str, max_bytes: int) -> object:
    """Parse a JSON policy document; every failure is a PolicyError naming `source`."""
    if not isinstance(payload, str | bytes | bytearray):
        raise ContractTypeError(
            f"{source} must be str or bytes, got {type(payload).__name__}")
    if len(payload) > max_bytes:
        raise PolicyError(
            f"{source} is {len(payload)} long, over max_bytes={max_bytes} "
            "(pass a larger max_bytes to load it)")
    if isinstance(payload, str) and has_surrogates(payload):
        raise PolicyError(f"{source} is not valid UTF-8 text (it holds a lone surrogate)")
    try:
        # UTF-8 only (json.loads took UTF-16 and UTF-32 bytes too), and two entries for
        # one participant refused, not the last one kept (bounds17 L1).
        text = payload if isinstance(payload, str) else bytes(payload).decode("utf-8")
        return strict_json.loads(text)
    except json.JSONDecodeError as exc:
        raise PolicyError(f"{source} is not valid JSON: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise PolicyError(f"{source} is not valid UTF-8: {exc.reason} at byte {exc.start}"
                          ) from exc
    except RecursionError as exc:
        raise PolicyError(f"{source} is nested too deeply (a policy is a flat object)"
                          ) from exc
    except ValueError as exc:  # e.g. an integer literal over the int-conversion limit
        raise PolicyError(f"{source} is not valid JSON: {exc}") from exc


class DictRoutingPolicy:
    """Routing policy driven by a mapping loaded from config.

    `select` looks up `key_getter(request)` (by default the participant id; the router's
    `RouteRequest` has no trace id) and returns the mapped choice, or `default` when the
    key is missing, None, or unmapped. A deployment-wide override is an empty mapping
    with `default="route"`. `update_mapping` validates first, then swaps a new frozen
    mapping in one assignment, so concurrent `select` calls see the old or the new
    mapping, never a mix.

    Args:
        mapping: Key -> a route name, "clarify" or None (no opinion).
        default: The choice for a key that is missing, None or unmapped (default None:
            fall through to the next decision service).
        key_getter: Derives the key from a `RouteRequest` (default `by_participant`;
            `by_query_prefix()` keys "billing: ..." by "billing").
    """

    def __init__(
        self,
        mapping: Mapping[str, PolicyChoice],
        *,
        default: PolicyChoice = None,
        key_getter: KeyGetter | None = None,
    ) -> None:
        if key_getter is not None and not callable(key_getter):
            raise ConfigurationError(f"key_getter must be callable, got {preview(key_getter)}")
        self._mapping = _validate_mapping(mapping)
        self._default = _validate_choice("default", default)
        self._key_getter: KeyGetter = by_participant if key_getter is None else key_getter

    @classmethod
    def from_json(cls, payload: str | bytes, *, max_bytes: int = DEFAULT_MAX_POLICY_BYTES,
                  **kwargs: Any) -> DictRoutingPolicy:
        """Build from a JSON object string; TypeError if it is not an object,
        PolicyError (a ValueError) if it is not valid JSON or UTF-8, longer than
        `max_bytes`, nested too deeply or holds an invalid key or value."""
        source = "policy JSON"
        data = _decode(payload, source, _check_max_bytes(max_bytes))
        return cls(_as_mapping(data, source), **kwargs)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike[str], *,
                       max_bytes: int = DEFAULT_MAX_POLICY_BYTES,
                       **kwargs: Any) -> DictRoutingPolicy:
        """Build from a UTF-8 JSON file holding an object (errors as `from_json`).

        A file that cannot be read (missing, a directory, a FIFO, no permission) raises a
        PolicyError that is also the OSError `open()` gives (`FileNotFoundError`,
        `PermissionError`, ...), chained from it; at most `max_bytes` + 1 bytes are read.
        """
        limit = _check_max_bytes(max_bytes)
        source = f"policy file {preview(os.fspath(path))}"
        try:
            # Without waiting: a FIFO nobody writes blocked the start for ever.
            with open_regular(path, "rb") as handle:
                raw = handle.read(limit + 1)
        except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            kind = _unreadable(type(exc)) if isinstance(exc, OSError) else PolicyError
            raise kind(f"{source} cannot be read: {reason}") from exc
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            if len(raw) > limit:
                text = ""  # the size error below names the real problem
            else:
                raise PolicyError(f"{source} is not valid UTF-8: {exc.reason} at byte "
                                  f"{exc.start}") from exc
        if len(raw) > limit:
            raise PolicyError(f"{source} is longer than max_bytes={limit} "
                              "(pass a larger max_bytes to load it)")
        return cls(_as_mapping(_decode(text, source, limit), source), **kwargs)

    @classmethod
    def from_env(
        cls,
        env_var: str,
        *,
        loader: Callable[[str], Mapping[str, PolicyChoice]] | None = None,
        default: PolicyChoice = None,
        key_getter: KeyGetter | None = None,
        max_bytes: int = DEFAULT_MAX_POLICY_BYTES,
    ) -> DictRoutingPolicy:
        """Build from environment variable `env_var`, parsed by `loader` (JSON by default).

        KeyError if the variable is not set; TypeError if the parsed data is not a
        mapping; PolicyError if the value is longer than `max_bytes`, holds bytes that are
        not UTF-8, or the default JSON loader cannot parse it.
        """
        limit = _check_max_bytes(max_bytes)
        if not isinstance(env_var, str):
            raise TypeError(f"from_env() takes the variable's name as a str, got "
                            f"{type(env_var).__name__}")
        if has_surrogates(env_var):  # os.environ cannot even look it up
            raise PolicyError(f"environment variable name {preview(env_var)} is not valid "
                              "UTF-8 text")
        raw = os.environ.get(env_var)
        if raw is None:  # (a KeyError, as documented, saying which variable)
            raise KeyError(f"environment variable {preview(env_var)} is not set: "
                           "DictRoutingPolicy.from_env() reads the mapping's JSON from it")
        source = f"environment variable {preview(env_var)}"
        if loader is None:
            data: object = _decode(raw, source, limit)
        else:
            if len(raw) > limit:
                raise PolicyError(f"{source} is longer than max_bytes={limit}")
            if has_surrogates(raw):
                raise PolicyError(f"{source} is not valid UTF-8 text")
            data = loader(raw)
        return cls(_as_mapping(data, source), default=default, key_getter=key_getter)

    @property
    def mapping(self) -> Mapping[str, PolicyChoice]:
        """The current (read-only) mapping."""
        return self._mapping

    @property
    def default(self) -> PolicyChoice:
        """The choice for keys that are missing or unmapped."""
        return self._default

    def update_mapping(self, mapping: Mapping[str, PolicyChoice]) -> None:
        """Hot-reload: validate `mapping`, then replace the current one atomically."""
        self._mapping = _validate_mapping(mapping)

    def set_default(self, decision: PolicyChoice) -> None:
        """Set the choice used when the key is missing or unmapped."""
        self._default = _validate_choice("default", decision)

    def select(self, request: RouteRequest) -> PolicyChoice:
        """The mapped choice for the request's key, else the default."""
        key = self._key_getter(request)
        if key is None:
            return self._default
        choice = self._mapping.get(key)
        return self._default if choice is None else choice

    def lookup_key(self, request: RouteRequest) -> str | None:
        """The key `select` uses for `request` (for rationales and debugging)."""
        return self._key_getter(request)


def _as_mapping(data: object, source: str) -> Mapping[str, PolicyChoice]:
    if not isinstance(data, Mapping):
        raise ContractTypeError(
            f"{source} must decode to a mapping of key to route, got {type(data).__name__}"
        )
    return data


class PolicyDecisions:
    """Decision service applying a `RoutingPolicy` before a fallback `DecisionService`.

    A policy route that is a candidate of the request pins the choice (rationale
    "policy: key=... -> route"); "clarify" forces clarification; None, or a pinned route
    that is not a candidate now, falls through to `fallback`, whose decision is returned
    unchanged.

    Args:
        policy: The `RoutingPolicy` consulted first (e.g. a `DictRoutingPolicy`).
        fallback: The `DecisionService` deciding when the policy has no opinion.
    """

    def __init__(self, policy: RoutingPolicy, fallback: DecisionService) -> None:
        if not callable(getattr(policy, "select", None)):
            raise ConfigurationError(
                f"policy must have a select() method, got {preview(policy)}"
                + (" (wrap a mapping in DictRoutingPolicy(...))"
                   if isinstance(policy, Mapping) else ""))
        if not callable(getattr(fallback, "decide", None)):
            raise ConfigurationError(
                f"fallback must be a DecisionService, got {preview(fallback)}"
            )
        self._policy = policy
        self._fallback = fallback
        self._noted: set[str] = set()

    @property
    def example_routes(self) -> tuple[str, ...]:
        """The fallback service's `example_routes` (a `LexicalDecisions`'s), else ()."""
        routes = getattr(self._fallback, "example_routes", ())
        return routes if isinstance(routes, tuple) else ()

    @property
    def policy_routes(self) -> tuple[str, ...]:
        """The routes the policy names now, in order, "clarify" left out (a policy with
        a `mapping` and a `default`, as `DictRoutingPolicy`; else ()): `AgentRouter`
        warns of one it does not have, at construction rather than at the first turn."""
        mapping = getattr(self._policy, "mapping", None)
        if not isinstance(mapping, Mapping):
            return ()
        named: dict[str, None] = {}
        for choice in (*mapping.values(), getattr(self._policy, "default", None)):
            for route in (choice,) if isinstance(choice, str) else (
                    choice if isinstance(choice, tuple) else ()):
                if isinstance(route, str) and route != CLARIFY:
                    named[route] = None
        return tuple(named)

    @property
    def fallback_route(self) -> str | None:
        """The `fallback_route` of the fallback service, when it has one (else None);
        `AgentRouter` checks that it names a registered destination."""
        route = getattr(self._fallback, "fallback_route", None)
        return route if isinstance(route, str) else None

    async def decide(self, request: RouteRequest) -> RouteDecision:
        """The policy's choice when it applies to this request, else the fallback's."""
        selected = self._policy.select(request)
        choice = await selected if inspect.isawaitable(selected) else selected
        if choice is not None and not isinstance(choice, str):
            if not isinstance(choice, list | tuple):
                _validate_name("policy's choice", choice)  # raises, naming what it got
            choice = _first_applying(_validate_sequence("policy's choice", choice), request)
        if not choice:
            return await self._fallback.decide(request)
        lookup = getattr(self._policy, "lookup_key", None)
        key = lookup(request) if callable(lookup) else None
        label = (f"{POLICY_RATIONALE} key={key} -> {choice}" if key is not None
                 else f"{POLICY_RATIONALE} -> {choice}")
        if choice == CLARIFY:
            return RouteDecision(CLARIFY, confidence=1.0, rationale=label)
        if choice in request.candidate_names:
            return RouteDecision(choice, confidence=1.0, scores={choice: 1.0}, rationale=label)
        if choice not in request.excluded:  # (a route that declined this turn says nothing)
            self._unavailable(choice)
        return await self._fallback.decide(request)

    def _unavailable(self, choice: str) -> None:
        """Log, once per route name (at most `MAX_NOTED_POLICY_ROUTES` names), a pinned
        route that is not a candidate: a misspelt route in the policy's config would
        otherwise fall through to the fallback without a word."""
        noted = self._noted
        if choice in noted or len(noted) >= MAX_NOTED_POLICY_ROUTES:
            return
        noted.add(choice)
        last = len(noted) == MAX_NOTED_POLICY_ROUTES
        logger.warning(
            "turnrouter: routing policy chose route %s, which is not a candidate of this "
            "turn (not a destination of this router, or not eligible now); the fallback "
            "decides (logged once per route name%s)", preview(choice),
            f"; the last name logged: {MAX_NOTED_POLICY_ROUTES} are" if last else "")


def _unreadable(kind: type[OSError]) -> type[PolicyError]:
    """A PolicyError that is also `kind` (what `open()` raised): `except PolicyError`
    and `except FileNotFoundError` (what a loader written from the reference, which
    opens the file itself, expects) both catch an unreadable policy file."""
    made = _UNREADABLE.get(kind)
    if made is None:
        made = _UNREADABLE[kind] = type(f"Policy{kind.__name__}", (PolicyError, kind),
                                        {"__module__": __name__})
    return made


#: One class per OSError type seen (a handful: FileNotFoundError, PermissionError, ...).
_UNREADABLE: dict[type[OSError], type[PolicyError]] = {}


def _first_applying(choices: tuple[str, ...], request: RouteRequest) -> str | None:
    """The first of a sequence choice that applies (a candidate or "clarify"), else its
    first name (reported unavailable as a single choice would be); None when empty."""
    names = request.candidate_names
    for name in choices:
        if name == CLARIFY or name in names:
            return name
    return choices[0] if choices else None
