"""Logging that keeps user text out of the logs.

Exceptions raised by destinations, decision services, callbacks and parsers can carry
user text (a query echoed in a message, a validation error quoting its input). At
WARNING and above turnrouter logs only the exception's type; the message and traceback
go to DEBUG, which an operator enables deliberately.
"""

from __future__ import annotations

import logging

__all__ = ["log_failure", "logger"]

logger = logging.getLogger("turnrouter")


def log_failure(what: str, error: BaseException, *args: object,
                log: logging.Logger = logger) -> None:
    """Log that `what % args` failed with `error`: its type at WARNING, details at DEBUG."""
    if log.isEnabledFor(logging.WARNING):
        log.warning(f"turnrouter: {what} failed ({type(error).__qualname__})", *args)
    if log.isEnabledFor(logging.DEBUG):
        log.debug(f"turnrouter: {what} failed", *args, exc_info=error)
