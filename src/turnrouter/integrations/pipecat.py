"""turnrouter inside a Pipecat pipeline (the `pipecat` extra: `pip install -e '.[pipecat]'`).

`TurnRouterProcessor` takes the place of the LLM service: it turns final user turns into
routed turns, speaks the router's control text, maps interruptions and end frames, and
reports when the bot was heard. Destinations push their own frames through
`frame_output(started)`, or subclass `FrameAgent`; `PipecatLLMDestination` wraps a
Pipecat LLM service. See docs/integrations.md.
"""

try:
    import pipecat.frames.frames  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised in a test that hides pipecat
    raise ImportError(
        "turnrouter.integrations.pipecat needs Pipecat: install turnrouter's pipecat extra "
        "(from a checkout: pip install -e '.[pipecat]')"
    ) from exc

from ._pipecat import (
    FrameAgent,
    FrameOutput,
    PipecatLLMDestination,
    TurnRouterProcessor,
    frame_output,
    turn_from_frame,
)

__all__ = [
    "FrameAgent",
    "FrameOutput",
    "PipecatLLMDestination",
    "TurnRouterProcessor",
    "frame_output",
    "turn_from_frame",
]
