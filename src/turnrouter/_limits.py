"""Bounds on everything that grows, and how an overflow is reported.

Every bound has a documented default (`docs/limits.md`) and a constructor argument.
An overflow is counted (`turnrouter_limit_overflows_total{limit}` through the observer)
and logged: the first time per limit, then at every power of ten, so a flood of
overflows cannot flood the logs.
"""

from __future__ import annotations

import logging

from ._observer import LimitExceeded, RouterObserver

__all__ = [
    "DEFAULT_MAX_DEPARTED_PARTICIPANTS",
    "DEFAULT_MAX_HISTORY_EXCHANGES",
    "DEFAULT_MAX_PARTICIPANTS",
    "DEFAULT_MAX_PATCH_BYTES",
    "DEFAULT_MAX_WAITING_TURNS",
    "DEFAULT_RELEASE_TIMEOUT_SECS",
    "Overflows",
    "is_logged",
]

logger = logging.getLogger("turnrouter")

#: Retained exchanges per participant, whatever their size (the byte budget applies too).
DEFAULT_MAX_HISTORY_EXCHANGES = 256
#: Turns of one participant waiting behind its running turn.
DEFAULT_MAX_WAITING_TURNS = 8
#: Participants one router holds state for at once (a new one past it is refused).
DEFAULT_MAX_PARTICIPANTS = 100_000
#: Departed participants remembered (closed until they rejoin) per router.
DEFAULT_MAX_DEPARTED_PARTICIPANTS = 100_000
#: Serialized size of one context patch (digest, facts and artifacts).
DEFAULT_MAX_PATCH_BYTES = 64 * 1024
#: How long one `release()` / `participant_left()` call may take before it counts as
#: failed (a departure retries it).
DEFAULT_RELEASE_TIMEOUT_SECS = 10.0


def is_logged(count: int) -> bool:
    """Whether the `count`-th overflow of a limit is logged: the first, then at every
    power of ten (10, 100, 1000, ...)."""
    if count < 1:
        return False
    while count % 10 == 0:
        count //= 10
    return count == 1


class Overflows:
    """Counts and logs the overflows of one router's bounds."""

    __slots__ = ("_counts", "_observer")

    def __init__(self, observer: RouterObserver) -> None:
        self._observer = observer
        self._counts: dict[str, int] = {}

    def report(self, limit: str, detail: str) -> None:
        """`limit` overflowed; `detail` (no user text) says what was dropped."""
        count = self._counts.get(limit, 0) + 1
        self._counts[limit] = count
        self._observer.limit_exceeded(LimitExceeded(limit))
        if is_logged(count):
            logger.warning("turnrouter: limit %s exceeded (%d times so far): %s",
                           limit, count, detail)
