"""Config-driven routing policies that pin or override routes before another service.

A `RoutingPolicy` maps a request to a `PolicyChoice`: None (no opinion, fall through),
a route name (pin it) or "clarify" (force clarification). `DictRoutingPolicy` looks the
choice up in a mapping keyed by `key_getter(request)` (the participant id by default),
loadable from JSON, a file or an environment variable, and hot-reloadable with
`update_mapping`. `PolicyDecisions` applies a policy in front of a fallback service.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

from .._contracts import CLARIFY, DecisionService, RouteDecision, RouteRequest
from .._exceptions import ConfigurationError, ContractTypeError, PolicyError

__all__ = [
    "DictRoutingPolicy",
    "KeyGetter",
    "PolicyChoice",
    "PolicyDecisions",
    "RoutingPolicy",
    "by_participant",
    "by_query_prefix",
]

PolicyChoice = str | None
"""None: no decision (fall through); a route name: pin it; "clarify": force clarification."""

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
        raise ConfigurationError(f"separator must be a non-empty str, got {separator!r}")

    def key(request: RouteRequest) -> str | None:
        head, found, _ = request.turn.query.partition(separator)
        head = head.strip().lower()
        return head if found and head else None

    return key


def _validate_choice(where: str, value: object) -> PolicyChoice:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise PolicyError(
            f"{where} must be a route name, 'clarify' or None, got "
            f"{type(value).__name__} {value!r:.80}"
        )
    return value


def _validate_mapping(mapping: object) -> Mapping[str, PolicyChoice]:
    """A frozen copy of `mapping` after checking every key and value."""
    if not isinstance(mapping, Mapping):
        raise ContractTypeError(
            f"policy mapping must be a mapping of key to route, got {type(mapping).__name__}"
        )
    frozen: dict[str, PolicyChoice] = {}
    for key, value in mapping.items():
        if not isinstance(key, str):
            raise PolicyError(f"policy mapping key must be a str, got {key!r:.80}")
        frozen[key] = _validate_choice(f"policy mapping[{key!r}]", value)
    return MappingProxyType(frozen)


def _decode(payload: str | bytes, source: str) -> object:
    try:
        return json.loads(payload)
    except json.JSONDecodeError as exc:
        raise PolicyError(f"{source} is not valid JSON: {exc}") from exc


class DictRoutingPolicy:
    """Routing policy driven by a mapping loaded from config.

    `select` looks up `key_getter(request)` (by default the participant id; the router's
    `RouteRequest` has no trace id) and returns the mapped choice, or `default` when the
    key is missing, None, or unmapped. A deployment-wide override is an empty mapping
    with `default="route"`. `update_mapping` validates first, then swaps a new frozen
    mapping in one assignment, so concurrent `select` calls see the old or the new
    mapping, never a mix.
    """

    def __init__(
        self,
        mapping: Mapping[str, PolicyChoice],
        *,
        default: PolicyChoice = None,
        key_getter: KeyGetter | None = None,
    ) -> None:
        if key_getter is not None and not callable(key_getter):
            raise ConfigurationError(f"key_getter must be callable, got {key_getter!r:.80}")
        self._mapping = _validate_mapping(mapping)
        self._default = _validate_choice("default", default)
        self._key_getter: KeyGetter = by_participant if key_getter is None else key_getter

    @classmethod
    def from_json(cls, payload: str | bytes, **kwargs: Any) -> DictRoutingPolicy:
        """Build from a JSON object string; TypeError if it is not an object,
        PolicyError (a ValueError) if it is not valid JSON."""
        return cls(_as_mapping(_decode(payload, "policy JSON"), "policy JSON"), **kwargs)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike[str], **kwargs: Any) -> DictRoutingPolicy:
        """Build from a UTF-8 JSON file holding an object (errors as `from_json`)."""
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        source = f"policy file {os.fspath(path)!r}"
        return cls(_as_mapping(_decode(text, source), source), **kwargs)

    @classmethod
    def from_env(
        cls,
        env_var: str,
        *,
        loader: Callable[[str], Mapping[str, PolicyChoice]] | None = None,
        default: PolicyChoice = None,
        key_getter: KeyGetter | None = None,
    ) -> DictRoutingPolicy:
        """Build from environment variable `env_var`, parsed by `loader` (JSON by default).

        KeyError if the variable is not set; TypeError if the parsed data is not a
        mapping; PolicyError if the default JSON loader cannot parse it.
        """
        raw = os.environ.get(env_var)
        if raw is None:
            raise KeyError(env_var)
        source = f"environment variable {env_var!r}"
        data: object = _decode(raw, source) if loader is None else loader(raw)
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
    """

    def __init__(self, policy: RoutingPolicy, fallback: DecisionService) -> None:
        if not callable(getattr(policy, "select", None)):
            raise ConfigurationError(f"policy must have a select() method, got {policy!r:.80}")
        if not callable(getattr(fallback, "decide", None)):
            raise ConfigurationError(
                f"fallback must be a DecisionService, got {fallback!r:.80}"
            )
        self._policy = policy
        self._fallback = fallback

    async def decide(self, request: RouteRequest) -> RouteDecision:
        """The policy's choice when it applies to this request, else the fallback's."""
        selected = self._policy.select(request)
        choice = await selected if inspect.isawaitable(selected) else selected
        if choice is not None and not isinstance(choice, str):
            raise PolicyError(
                f"policy returned {type(choice).__name__} {choice!r:.80}; "
                "expected a route name, 'clarify' or None"
            )
        if not choice:
            return await self._fallback.decide(request)
        lookup = getattr(self._policy, "lookup_key", None)
        key = lookup(request) if callable(lookup) else None
        label = f"policy: key={key} -> {choice}" if key is not None else f"policy: -> {choice}"
        if choice == CLARIFY:
            return RouteDecision(CLARIFY, confidence=1.0, rationale=label)
        if choice in request.candidate_names:
            return RouteDecision(choice, confidence=1.0, scores={choice: 1.0}, rationale=label)
        return await self._fallback.decide(request)
