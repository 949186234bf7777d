"""What replicas share besides ownership: balance hints, probes, timing samples.

Ownership is the server's pin. Replicas announce how many partitions they hold, so one
over its share hands a partition over and one at its share leaves pinned partitions
alone; probes make the server pin a survivor on idle partitions; first-response timing
samples are published so every replica's predictor learns from all of them, in batches:
a sample waits at most `SAMPLE_FLUSH_SECS` for others, so one message carries up to
`SAMPLE_BATCH` of them (every replica receives every message: a message per sample would
cost each replica a delivery per turn of the whole fleet).
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
from ._wire import NatsConfig, Rejected, parse_samples, samples_body

__all__ = ["SAMPLE_BATCH", "SAMPLE_FLUSH_SECS", "Fleet"]

logger = logging.getLogger("turnrouter.runtime.nats")

_MAX_PEERS = 1024  # bound of the presence table (more peers are ignored for balance)

#: Timing samples per fleet message at most, and how long a sample waits for others.
SAMPLE_BATCH = 64
SAMPLE_FLUSH_SECS = 0.05


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
        self._samples: list[str] = []
        self._sample_bytes = 0
        self._flush: asyncio.TimerHandle | None = None
        self._publishing: set[asyncio.Future[Any]] = set()
        self._closed = False
        sent = received = dropped = None
        if metrics is not None:
            samples = metrics.timing_samples
            sent, received, dropped = (samples.labels("sent"), samples.labels("received"),
                                       samples.labels("dropped"))
        self._sent, self._received, self._dropped = sent, received, dropped

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
        """Queue one local first-response sample for the other replicas (sent within
        `SAMPLE_FLUSH_SECS`, or at once when a batch is full)."""
        if self._closed or self._nc.is_closed:
            if self._dropped is not None:
                self._dropped.inc()
            return
        line = sample.to_json()
        size = len(line) + 1
        if self._samples and self._sample_bytes + size > self._config.max_message_bytes:
            self.flush_samples()
        self._samples.append(line)
        self._sample_bytes += size
        if len(self._samples) >= SAMPLE_BATCH:
            self.flush_samples()
        elif self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(SAMPLE_FLUSH_SECS,
                                                                self.flush_samples)

    def flush_samples(self) -> None:
        """Send the queued samples now (in a task of the worker's)."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        if self._samples:
            lines, self._samples, self._sample_bytes = self._samples, [], 0
            task = self._spawn(self._publish_samples(lines), "timing samples")
            self._publishing.add(task)
            task.add_done_callback(self._publishing.discard)

    async def close(self) -> None:
        """Send what is queued before the connection drains (a graceful end loses no
        sample); later samples are dropped and counted."""
        self._closed = True
        self.flush_samples()
        await asyncio.gather(*self._publishing, return_exceptions=True)

    def abandon(self) -> None:
        """The worker ends without a graceful close: no flush is left scheduled, and the
        samples still queued (and any later one) are counted as dropped."""
        self._closed = True
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        if self._dropped is not None and self._samples:
            self._dropped.inc(len(self._samples))
        self._samples, self._sample_bytes = [], 0

    async def _publish_samples(self, lines: list[str]) -> None:
        try:
            await self._nc.publish(self._config.timing_subject, samples_body(lines),
                                   headers={"Turnrouter-Replica": self._replica})
        except NatsError as exc:  # closed or over the client's buffer: counted, not raised
            logger.warning("turnrouter: %d timing samples not sent: %r", len(lines), exc)
            if self._dropped is not None:
                self._dropped.inc(len(lines))
        else:
            if self._sent is not None:
                self._sent.inc(len(lines))

    async def _on_sample(self, msg: Msg) -> None:
        if (msg.headers or {}).get("Turnrouter-Replica") == self._replica:
            return
        try:
            samples, errors = parse_samples(self._config, msg.data)
        except Rejected as exc:
            logger.warning("turnrouter: rejected a timing samples message: %s", exc)
            self._reject("nats_timing", exc.reason)
            return
        if errors:
            logger.warning("turnrouter: rejected %d timing sample(s): %s", len(errors),
                           errors[0])
            for _ in errors:
                self._reject("nats_timing", "invalid")
        if self._received is not None and samples:
            self._received.inc(len(samples))
        for sample in samples:
            for predictor in self.predictors:
                predictor.record(sample)
