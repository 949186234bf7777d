"""The error of LLM clients (defined with every other error in `turnrouter._exceptions`)."""

from __future__ import annotations

from .._exceptions import LLMError

__all__ = ["LLMError"]
