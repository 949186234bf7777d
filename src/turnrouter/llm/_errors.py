"""The error of LLM clients (kept here until the lead moves it to `_exceptions.py`)."""

from __future__ import annotations

from .._exceptions import TurnrouterError

__all__ = ["LLMError"]


class LLMError(TurnrouterError):
    """An LLM call failed: HTTP status, unreadable reply, connection error or timeout.

    `status` is the HTTP status (None when no response came back) and `body` the start
    of the response body, both also named in the message.
    """

    def __init__(self, message: str, *, status: int | None = None, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body
