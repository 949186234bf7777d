"""turnrouter inside LiveKit Agents (the `livekit` extra: `pip install -e '.[livekit]'`).

`RouterAgent` is a LiveKit `Agent` whose replies come from an `AgentRouter`;
destinations say their answers with `speak()`; `LLMDestination` wraps a LiveKit LLM,
`HandoffDestination` hands the session to another LiveKit agent; `stop_gracefully()`
drains the router before stopping it. See docs/integrations.md.
"""

try:
    import livekit.agents  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "turnrouter.integrations.livekit needs LiveKit Agents: install turnrouter's "
        "livekit extra (from a checkout: pip install -e '.[livekit]')") from exc

from ._livekit import (
    ROUTED_MESSAGE_MEMORY,
    HandoffDestination,
    LLMDestination,
    RouterAgent,
    TurnEnd,
    speak,
    stop_gracefully,
)

__all__ = [
    "ROUTED_MESSAGE_MEMORY",
    "HandoffDestination",
    "LLMDestination",
    "RouterAgent",
    "TurnEnd",
    "speak",
    "stop_gracefully",
]
