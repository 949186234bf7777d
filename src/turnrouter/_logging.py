"""Logging that keeps user text out of the logs.

Exceptions raised by destinations, decision services, callbacks and parsers can carry
user text (a query echoed in a message, a validation error quoting its input). At
WARNING and above turnrouter logs only the exception's type; the message and traceback
go to DEBUG, which an operator enables deliberately.
"""

from __future__ import annotations

import logging

from ._exceptions import LLMError

__all__ = ["log_failure", "logger"]

logger = logging.getLogger("turnrouter")


def log_failure(what: str, error: BaseException, *args: object,
                log: logging.Logger = logger) -> None:
    """Log that `what % args` failed with `error`: its type at WARNING, details at DEBUG.

    An `LLMError` says more at WARNING: its message is turnrouter's own (the redacted
    URL, the HTTP status, the connection error; never a credential or the prompt), so an
    operator sees why the classifier or the acknowledgments fail (a 401, nothing
    listening) without enabling DEBUG; the reply body it may quote stays at DEBUG. So does
    a misuse turnrouter itself named (`own_message`: a plain `def` output or method)."""
    if log.isEnabledFor(logging.WARNING):
        if isinstance(error, LLMError):
            reason = str(error)
            if error.body:
                reason = reason.replace(error.body, "(the reply's body: at DEBUG)")
            log.warning(f"turnrouter: {what} failed (LLMError: %s)", *args, reason)
        elif getattr(error, "own_message", False):  # a misuse turnrouter named, no user text
            log.warning(f"turnrouter: {what} failed (%s: %s)", *args,
                        type(error).__qualname__, error)
        else:
            log.warning(f"turnrouter: {what} failed ({type(error).__qualname__})", *args)
    if log.isEnabledFor(logging.DEBUG):
        log.debug(f"turnrouter: {what} failed", *args, exc_info=error)
