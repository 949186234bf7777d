"""The small protocol shared by the LLM classifier and the acknowledgment generator."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["LLMService"]


@runtime_checkable
class LLMService(Protocol):
    """A text completion client. Non-reasoning by default; output bounded by `max_tokens`."""

    async def complete(self, prompt: str, *, max_tokens: int, reasoning: bool = False) -> str:
        """Return the completion text for `prompt`."""
        ...
