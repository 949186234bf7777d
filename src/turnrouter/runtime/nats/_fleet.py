"""What replicas share besides ownership: balance hints, probes, timing samples.

Ownership is the server's pin. Replicas announce how many partitions they hold, so one
over its share hands a partition over and one at its share leaves pinned partitions
alone; probes make the server pin a survivor on idle partitions; first-response timing
samples are published so every replica's predictor learns from all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Container, Coroutine
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from ..._timing import TimingPredictor, TimingSample
from ._metrics import RuntimeMetrics
from ._setup import api_request
from ._wire import NatsConfig

__all__ = ["Fleet"]

logger = logging.getLogger("turnrouter.runtime.nats")

_MAX_PEERS = 1024  # bound of the presence table (more peers are ignored for balance)


class Fleet:
    """This replica's view of the others, and what it tells them."""

    def __init__(self, nc: Client, config: NatsConfig, replica: str,
                 owned: Callable[[], Container[int]], count: Callable[[], int],
                 metrics: RuntimeMetrics | None,
                 spawn: Callable[[Coroutine[Any, Any, Any], str], Any],
                 reject: Callable[[str, str], None]) -> None:
        self._nc, self._config, self._replica = nc, config, replica
        self._owned, self._count, self._metrics = owned, count, metrics
        self._spawn, self._reject = spawn, reject
        self._peers: dict[str, tuple[float, int]] = {}
        self._shed_after = time.monotonic() + 2 * config.failover_timeout
        self.predictors: list[TimingPredictor] = []

    async def start(self) -> list[asyncio.Task[None]]:
        """Subscribe and start the presence and probe loops (returned, to cancel)."""
        await self._nc.subscribe(f"{self._config.prefix}.presence", cb=self._on_presence)
        await self._nc.subscribe(self._config.timing_subject, cb=self._on_sample)
        return [asyncio.create_task(self._presence_loop(), name="presence"),
                asyncio.create_task(self._probe_loop(), name="probes")]

    # ------------------------------------------------------------------ balance
    def fair_share(self) -> int:
        """Partitions per live replica (rounded up): balance, not ownership."""
        horizon = time.monotonic() - 3 * self._config.probe_interval
        live = 1 + sum(1 for seen, _ in self._peers.values() if seen >= horizon)
        return -(-self._config.partitions // live)

    def may_shed(self) -> bool:
        """Hand one surplus partition over when a live peer holds less than its share."""
        now = time.monotonic()
        if now < self._shed_after:
            return False
        horizon = now - 3 * self._config.probe_interval
        share = self.fair_share()
        if any(seen >= horizon and owned < share for seen, owned in self._peers.values()):
            self._shed_after = now + self._config.probe_interval / 2
            return True
        return False

    async def pinned_elsewhere(self, n: int) -> bool:
        """Whether partition `n` has a pinned client (a replica at its share leaves it
        alone); an unpinned one is pulled, so an orphan finds an owner."""
        try:
            info = await api_request(
                self._nc, f"$JS.API.CONSUMER.INFO.{self._config.stream}."
                f"{self._config.consumer(n)}", wait=2.0)
        except Exception:
            return False
        groups = info.get("priority_groups") or []
        return any(isinstance(g, dict) and g.get("pinned_client_id") for g in groups)

    async def _presence_loop(self) -> None:
        while True:
            with contextlib.suppress(NatsError):
                await self._nc.publish(
                    f"{self._config.prefix}.presence",
                    json.dumps({"replica": self._replica, "owned": self._count()}).encode())
            await asyncio.sleep(self._config.probe_interval)

    async def _on_presence(self, msg: Msg) -> None:
        try:
            data = json.loads(msg.data)
            replica, owned = str(data["replica"]), int(data["owned"])
        except (ValueError, KeyError, TypeError):
            return
        if replica != self._replica:
            if replica not in self._peers and len(self._peers) >= _MAX_PEERS:
                return
            self._peers[replica] = (time.monotonic(), owned)

    async def _probe_loop(self) -> None:
        """Probe the partitions not owned here, so a dead owner's partitions get a new
        pinned client (and their unfinished turns their ending) even when idle."""
        js = self._nc.jetstream()
        while True:
            await asyncio.sleep(self._config.probe_interval)
            owned = self._owned()
            for n in range(self._config.partitions):
                if n in owned:
                    continue
                with contextlib.suppress(NatsError, TimeoutError):
                    # One probe per partition and window across the fleet (by id).
                    window = int(time.time() / self._config.probe_interval)
                    await js.publish(self._config.probe_subject(n), b"",
                                     headers={"Nats-Msg-Id": f"probe.{n}.{window}"})

    # ------------------------------------------------------------------ timing samples
    def send_sample(self, sample: TimingSample) -> None:
        """Publish one local first-response sample to the other replicas."""
        if self._nc.is_closed:
            return
        if self._metrics is not None:
            self._metrics.timing_samples.labels("sent").inc()
        self._spawn(self._nc.publish(self._config.timing_subject, sample.to_json().encode(),
                                     headers={"Turnrouter-Replica": self._replica}),
                    "timing sample")

    async def _on_sample(self, msg: Msg) -> None:
        if (msg.headers or {}).get("Turnrouter-Replica") == self._replica:
            return
        try:
            sample = TimingSample.from_json(msg.data.decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            logger.warning("turnrouter: rejected a timing sample: %s", exc)
            self._reject("nats_timing", "invalid")
            return
        if self._metrics is not None:
            self._metrics.timing_samples.labels("received").inc()
        for predictor in self.predictors:
            predictor.record(sample)
