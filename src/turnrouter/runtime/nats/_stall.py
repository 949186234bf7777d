"""A partition whose consumer stopped delivering, found and restarted by the replicas.

On a cluster, after a server's crash and restart while turns ran, a partition's consumer
was seen to stop delivering for good (docs/distributed.md, "A NATS cluster"): its leader
reported inputs pending, no pull request waiting and no pinned client, its delivered
sequence stuck, while the replicas pulled it. The pulls reached no leader that kept them
(answered by nothing, or by 503 "no responders" from the replica's server, again and
again while the consumer's info answered), so the partition's queries went unanswered
and no replica held its pin; replicas may even each believe they still hold it (their
pins from before the crash, which the new leader does not know).

Each replica checks, every `CHECK_SECS`, the consumers of the partitions someone should
be consuming and may not be (`_suspects`): one this replica pulls whose pulls went
unanswered (or answered 503) for `CHECK_SECS`, and, while the replicas heard on
presence own fewer than all partitions, each one not owned here. A consumer showing
that state in every check for `STALL_SECS` (same leader, same delivered sequence) gets
its leader asked to step down (`$JS.API.CONSUMER.LEADER.STEPDOWN`): the new leader
subscribes to the pulls afresh and starts with an empty wait list and no pin. The
replica also pulls the partition again at once, on a new reply subject when its own
pulls went unanswered (a server without the interest of the old one drops a pull
without a word), and forgets a handover of it that made it leave the partition alone.
Counted in `turnrouter_nats_deployment_missing_total{part="consumer_leader"}`, logged
once per step-down; at most one step-down per partition per `2 * STALL_SECS` from one
replica.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from nats.aio.client import Client

from ..._redact import preview
from ._metrics import RuntimeMetrics
from ._setup import api_request
from ._wire import NatsConfig

__all__ = ["CHECK_SECS", "STALL_SECS", "StallWatch", "stalled"]

logger = logging.getLogger("turnrouter.runtime.nats")

#: How long a consumer must show the stalled state before its leader is asked to step
#: down: longer than a cluster's elections after a lost server (4 to 10 s, during which
#: the consumer may show it for a moment).
STALL_SECS = 10.0
#: How often the suspects are checked.
CHECK_SECS = 2.5


def stalled(info: Mapping[str, Any]) -> tuple[str, int] | None:
    """(leader, delivered stream sequence) of a consumer's info (`$JS.API.CONSUMER.INFO`)
    showing the stalled state: inputs pending, no pull request waiting, no pinned
    client, and a leader; None otherwise."""
    pending, waiting = info.get("num_pending"), info.get("num_waiting")
    leader = (info.get("cluster") or {}).get("leader")
    delivered = (info.get("delivered") or {}).get("stream_seq")
    if not (type(pending) is int and pending > 0 and waiting == 0
            and isinstance(leader, str) and leader and type(delivered) is int):
        return None
    groups = info.get("priority_groups") or []
    if any(isinstance(g, dict) and g.get("pinned_client_id") for g in groups):
        return None
    return leader, delivered


class StallWatch:
    """Finds the stalled partitions' consumers and asks their leaders to step down (see
    the module's docstring). `unanswered()` lists the partitions whose pulls from this
    replica went unanswered lately, `owned()` those pinned here, `unowned()` how many
    partitions no replica heard on presence owns; `nudge(n)` has this replica pull
    partition `n` again at once (on a new reply subject if its pulls went unanswered)
    and says what it saw of it, for the log line."""

    def __init__(self, nc: Client, config: NatsConfig, *,
                 unanswered: Callable[[float], Iterable[int]],
                 owned: Callable[[], Iterable[int]], unowned: Callable[[], int],
                 nudge: Callable[[int], str], metrics: RuntimeMetrics | None) -> None:
        self._nc, self._config, self._metrics = nc, config, metrics
        self._unanswered, self._owned, self._unowned = unanswered, owned, unowned
        self._nudge = nudge
        #: Partition -> (since when, leader, delivered sequence) of the stalled state.
        self._seen: dict[int, tuple[float, str, int]] = {}
        self._stepped: dict[int, float] = {}  # partition -> when its leader stepped down

    async def run(self) -> None:
        while True:
            await asyncio.sleep(CHECK_SECS)
            suspects = self._suspects()
            for n in list(self._seen):
                if n not in suspects:
                    del self._seen[n]
            for n in sorted(suspects):
                await self.check(n)

    def _suspects(self) -> set[int]:
        suspects = set(self._unanswered(CHECK_SECS))
        if self._unowned() > 0:
            owned = set(self._owned())
            suspects.update(n for n in range(self._config.partitions) if n not in owned)
        return suspects

    async def check(self, n: int) -> bool:
        """One look at partition `n`'s consumer; True when its leader was asked to step
        down (the stalled state lasted `STALL_SECS`)."""
        config = self._config
        name = f"{config.stream}.{config.consumer(n)}"
        try:
            info = await api_request(self._nc, f"$JS.API.CONSUMER.INFO.{name}", wait=2.0)
        except Exception:  # no leader yet, a lost connection: nothing to judge
            self._seen.pop(n, None)
            return False
        state = stalled(info)
        now = time.monotonic()
        seen = self._seen.get(n)
        if state is None or seen is None or seen[1:] != state:
            if state is None:
                self._seen.pop(n, None)
            else:
                self._seen[n] = (now, *state)
            return False
        if now - seen[0] < STALL_SECS or now - self._stepped.get(n, -1e9) < 2 * STALL_SECS:
            return False
        del self._seen[n]
        self._stepped[n] = now
        leader, delivered = state
        logger.warning(
            "turnrouter: partition %d stalled for %.0f s: its consumer %s, led by %s, "
            "holds %s pending inputs, no pull waiting and no pinned client (delivered "
            "up to stream sequence %d; %s); asking its leader to step down", n,
            now - seen[0], config.consumer(n), preview(leader), info.get("num_pending"),
            delivered, self._nudge(n))
        if self._metrics is not None:
            self._metrics.deployment_missing.labels("consumer_leader").inc()
        try:
            await api_request(self._nc, f"$JS.API.CONSUMER.LEADER.STEPDOWN.{name}",
                              wait=5.0)
        except Exception as exc:  # (the next check sees whether it stalls still)
            logger.warning("turnrouter: partition %d: the step-down of its consumer's "
                           "leader failed: %s", n, preview(str(exc)))
        return True
