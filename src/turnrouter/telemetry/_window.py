"""`ParticipantWindow`: the distinct participants seen in a sliding window, bounded.

The clarification page must tell a broad incident (many participants asked to clarify)
from one loud client (one participant clarified on every turn): a ratio of counters
cannot, since one looping client can make most of the turns. Two gauges can: how many
distinct participants had a turn in the last `PARTICIPANT_WINDOW_SECS`, and how many of
them had their latest turn answered with a clarification question (their share estimates
the clarification ratio *per participant*, whatever each one's turn rate: one loud client
counts once). Participant ids never become labels; only the counts do.

Cost: two dict updates per turn (and one per clarification) on the recording thread, no lock
(each thread's shard has its own windows; a scrape takes the union). Bound:
`MAX_WINDOW_PARTICIPANTS` ids per window and shard; past it the oldest id is dropped
and, if it was still inside the window, `turnrouter_limit_overflows_total
{limit="participant_window"}` counts it (the gauge then under-counts).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

__all__ = ["MAX_WINDOW_PARTICIPANTS", "PARTICIPANT_WINDOW_SECS", "ParticipantWindow"]

#: Seconds a participant stays counted after its latest turn (or clarification).
PARTICIPANT_WINDOW_SECS = 60.0
#: Participant ids one window of one shard holds at most.
MAX_WINDOW_PARTICIPANTS = 10_000


class ParticipantWindow:
    """Distinct participant ids noted in the last `window_secs` (at most
    `max_participants` of them; the oldest is dropped first).

    `note()` is called by one thread (the shard's); `live()` may be called from another
    (a scrape): it reads a copy.

    Args:
        window_secs: How long a noted id counts (default 60 s).
        max_participants: Most ids held; past it the oldest is dropped first.
        clock: Monotonic time source in seconds (tests pass a controlled one).
    """

    __slots__ = ("_clock", "_max", "_seen", "_window")

    def __init__(self, window_secs: float = PARTICIPANT_WINDOW_SECS,
                 max_participants: int = MAX_WINDOW_PARTICIPANTS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not window_secs > 0:
            raise ValueError(f"window_secs must be > 0, got {window_secs!r}")
        if isinstance(max_participants, bool) or not isinstance(max_participants, int) \
                or max_participants < 1:
            raise ValueError(f"max_participants must be an int >= 1, got {max_participants!r}")
        self._window = float(window_secs)
        self._max = max_participants
        self._clock = clock
        #: id -> time last noted, oldest first (a re-noted id moves to the end).
        self._seen: dict[str, float] = {}

    def note(self, participant_id: str) -> bool:
        """Note `participant_id` now; False when the bound dropped an id still inside the
        window (an overflow to count), True otherwise."""
        now = self._clock()
        seen = self._seen
        seen.pop(participant_id, None)
        seen[participant_id] = now
        horizon = now - self._window
        # Drop up to two expired ids from the front: amortised O(1), memory follows traffic.
        for _ in range(2):
            oldest = next(iter(seen))
            if seen[oldest] >= horizon or oldest == participant_id:
                break
            del seen[oldest]
        if len(seen) > self._max:
            oldest = next(iter(seen))
            stamp = seen.pop(oldest)
            return stamp < horizon
        return True

    def discard(self, participant_id: str) -> None:
        """Forget `participant_id` (its latest turn no longer counts)."""
        self._seen.pop(participant_id, None)

    def live(self) -> Iterable[str]:
        """The ids noted inside the window (a snapshot)."""
        horizon = self._clock() - self._window
        return [pid for pid, stamp in self._seen.copy().items() if stamp >= horizon]

    def __len__(self) -> int:
        """How many distinct ids were noted inside the window."""
        return len(list(self.live()))
