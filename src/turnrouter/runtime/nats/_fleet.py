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
import functools
import hashlib
import json
import logging
import math
import re
import secrets
import time
from collections import deque
from collections.abc import Callable, Container, Coroutine, Mapping
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from ... import _strict_json as strict_json
from ..._limits import is_logged
from ..._timing import TimingPredictor, TimingSample
from ._connection import RECONNECT_WAIT
from ._metrics import RuntimeMetrics
from ._setup import api_request
from ._wire import NatsConfig, Rejected, parse_samples, samples_body

__all__ = ["FLEET_PENDING_BYTES", "SAMPLE_BATCH", "SAMPLE_FLUSH_SECS", "Fleet",
           "fleet_limits", "fleet_topic", "hang_up", "owner_heard",
           "previous_owner_alive"]

logger = logging.getLogger("turnrouter.runtime.nats")

_MAX_PEERS = 1024  # bound of the presence table (more peers are ignored for balance)

#: A partition this replica handed over and got back within SHED_VERIFY_FACTOR x
#: failover_timeout (plus three presence periods) went to no replica: balance then
#: waits SHED_BACKOFF_SECS before it hands one over again, doubling up to the maximum;
#: but, if peers said they own no partition during it, at most SHED_BACKOFF_SECS after
#: the last handover that came back or the last such word of a doubted name (the names
#: that lured the handovers stopped).
SHED_VERIFY_FACTOR = 4
SHED_BACKOFF_SECS = 10.0
SHED_BACKOFF_MAX_SECS = 300.0
#: Seconds balance waits for an owned partition with no turn running before it hands a
#: busy one over (waiting at most `pull_expires` for its turns, doubled after each
#: handover its turns outlasted, up to `SHED_WAIT_MAX_SECS`: a fleet whose turns take
#: seconds still rebalances, one partition's inputs, a barge-in too, held that long).
SHED_PATIENCE_SECS = 5.0
SHED_WAIT_MAX_SECS = 3.2

#: Bytes a fleet subject's subscription (control, presence, timing) may hold unread,
#: beside `NatsConfig.fleet_backlog` messages; past either nats-py drops what comes,
#: counted `dropped` (a flood's bound: no backlog of 100,000 messages for the garbage
#: collector to walk).
FLEET_PENDING_BYTES = 8 * 1024 * 1024


def fleet_topic(config: NatsConfig, subject: str) -> str:
    """The rejected-messages topic of a fleet subject (`nats_other` for any other)."""
    return {config.interrupt_all_subject: "nats_control",
            f"{config.prefix}.presence": "nats_presence",
            config.timing_subject: "nats_timing"}.get(subject, "nats_other")


def fleet_limits(config: NatsConfig) -> dict[str, Any]:
    """The pending limits of a fleet subject's subscription."""
    return {"pending_msgs_limit": config.fleet_backlog,
            "pending_bytes_limit": FLEET_PENDING_BYTES}

#: Timing samples per fleet message at most, and how long a sample waits for others.
SAMPLE_BATCH = 64
SAMPLE_FLUSH_SECS = 0.05

#: A fleet sample's `seconds` must be in (0, MAX_SAMPLE_SECS]: a first response slower
#: than ten minutes is no latency a prediction should learn.
MAX_SAMPLE_SECS = 600.0
#: and its `at` (Unix time) in [0, now + MAX_SAMPLE_AHEAD_SECS]: 0 is a sample without
#: a time; an hour ahead is more than any clock skew explains (nothing depends on `at`
#: live, but a forged 1e300 would sort past every real sample in a file merged later).
MAX_SAMPLE_AHEAD_SECS = 3600.0
#: One publisher's share of a route's samples (this replica's own included) within a
#: window of SAMPLE_WINDOW_SECS is at most SAMPLE_SHARE, past SAMPLE_FLOOR samples: one
#: replica, or one forged publisher, cannot outvote the rest of the fleet.
SAMPLE_WINDOW_SECS = 10.0
SAMPLE_SHARE = 0.5
SAMPLE_FLOOR = 8
#: Distinct sample publishers tracked per window (more are refused as `overflow`).
MAX_SAMPLE_PUBLISHERS = 64
#: A publisher's name is only what it says (`Turnrouter-Replica`), so these hold
#: whatever names a worker-credentialed liar uses: per route and window, the fleet's
#: samples (every publisher together) stay below this replica's own plus SAMPLE_FLOOR;
#: and a fleet sample farther than ANCHOR_FACTOR times from the median of this replica's
#: own recent first responses of the route (its last ANCHOR_SAMPLES, younger than
#: ANCHOR_SECS, once it has ANCHOR_MIN) is refused, so the fleet cannot move what a
#: replica measures itself.
ANCHOR_FACTOR = 8.0
ANCHOR_SAMPLES = 16
ANCHOR_MIN = 4
ANCHOR_SECS = 60.0
#: Both the anchor and a sample compared with it count as at least this: first responses
#: faster than 10 ms are all alike to the predictor's histogram.
ANCHOR_FLOOR_SECS = 0.01
#: Timing message bytes parsed per window: from one publisher, and from all of them. A
#: 64 KiB message costs ~3.5 ms to parse; past these a flood is refused unparsed
#: (`overflow`), so it costs this replica at most ~0.25 s of CPU per 10 s window. An
#: honest replica sends ~86 bytes per sample: 1 MiB is ~12,000 samples per window.
SAMPLE_BYTES_PER_PUBLISHER = 1024 * 1024
SAMPLE_BYTES_PER_WINDOW = 4 * 1024 * 1024
#: Presence messages longer than this are refused; replica names are 1..64 characters.
MAX_PRESENCE_BYTES = 256
_REPLICA_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def valid_replica(name: object) -> bool:
    """Whether `name` is a usable replica name (1..64 of `A-Za-z0-9_.:-`)."""
    return isinstance(name, str) and _REPLICA_NAME.fullmatch(name) is not None


def hold_off(fleet: Fleet, seconds: float) -> None:
    """Hand nothing else over for `seconds` (a busy handover under way)."""
    fleet._shed_after = max(fleet._shed_after, time.monotonic() + seconds)


def _wait_longer(fleet: Fleet, now: float) -> None:
    """After an aborted handover: the next try in SHED_BACKOFF_SECS, waiting twice as
    long for the partition's turns, up to SHED_WAIT_MAX_SECS; one that waited that long
    already backs off doubling (10 s up to 5 min), so turns longer than it stall a
    partition's inputs rarely, not every 10 s (`_backing_off` says when it may end
    early)."""
    if fleet.shed_wait >= SHED_WAIT_MAX_SECS:
        fleet._aborted_until = fleet._back_off(now)
        return
    if now >= fleet._backoff_until:
        fleet._backoff_since = now
    fleet._backoff_until = max(fleet._backoff_until, now + SHED_BACKOFF_SECS)
    fleet._aborted_until = fleet._backoff_until
    fleet.shed_wait = min(2 * fleet.shed_wait, SHED_WAIT_MAX_SECS)


def _backing_off(fleet: Fleet, now: float) -> bool:
    """Whether balance backs off now: until the backoff ends, or, when peers said they
    own no partition during it (or just before), until SHED_BACKOFF_SECS after the last
    handover that came back or the last such word of a name doubted for the whole
    backoff (it missed a second chance, `_doubt`: `_lured_seen`). A
    replica pulls, so it owns partitions (barring one just started, or more replicas
    than partitions): names claiming none lured the handovers that came back (each
    doubles the backoff, up to 5 min), and once they stop the backoff has done its
    work. Only doubted names set the end: a replica (re)started during the backoff says
    it owns none until balance hands it a partition, and, when any name's word counted,
    kept the doubled backoff going to its end (2.5 to 5 minutes without a partition
    after 40 names stopped: redteam16 F2). A backoff after an aborted handover (turns
    outlasted its wait; no name lured it) ends early only once no peer said it owns no
    partition for SHED_BACKOFF_SECS."""
    if now >= fleet._backoff_until:
        return False
    if fleet._zero_seen >= fleet._backoff_since - 3 * fleet._config.probe_interval:
        lured = fleet._zero_seen if now < fleet._aborted_until else fleet._lured_seen
        return now < lured + SHED_BACKOFF_SECS
    return True


def _doubt(fleet: Fleet, below: frozenset[str], now: float, until: float,
           handed: float) -> None:
    """The names `below` their share when a handover (made at `handed`) came back are
    doubted, counted `unverified`. A name still remembered from an earlier doubt (as
    long after it ended as it lasted, and 10 s more) that missed a handover made after
    that doubt began is doubted until the backoff's end `until`: names that keep luring
    handovers stay out as long as balance backs off, and their word keeps the backoff
    going (`_backing_off`). Any other name is doubted SHED_BACKOFF_SECS after the
    handovers of one wave came back, and its word keeps nothing going: a replica that
    missed them (just started, slow under load) is out 10 s, not for a backoff their
    burst doubled up to 5 min, which its own `owned: 0` then kept going; it is handed
    one partition at a time then (`may_shed`), so names that take none lure one more.
    Bounded by the peer table: past it, the names no longer remembered are forgotten."""
    doubts = fleet._unverified
    if len(doubts) >= _MAX_PEERS:
        for name in [name for name, (end, length, _, _) in doubts.items()
                     if now >= end + length + SHED_BACKOFF_SECS]:
            del doubts[name]
    fleet._lured_seen = now
    for name in below:
        old = doubts.get(name)
        if old is None or now >= old[0] + old[1] + SHED_BACKOFF_SECS:  # a first doubt
            end, began, lured = min(until, now + SHED_BACKOFF_SECS), now, False
        elif handed > old[2]:  # it had its second chance, and missed it too
            end, began, lured = max(until, old[0]), now, True
        else:  # one more handover of the wave its doubt began with
            end, began = max(old[0], min(until, now + SHED_BACKOFF_SECS)), old[2]
            lured = old[3]
        if old is not None or len(doubts) < _MAX_PEERS:
            doubts[name] = (end, end - now, began, lured)
        fleet._reject("nats_presence", "unverified")


def _settle(fleet: Fleet, now: float) -> None:
    """A handover made for names all remembered from a doubt then (a second chance:
    `may_shed` hands them one partition at a time) that did not come back within the
    verify window went to some other replica if none of them says by then that it owns
    a partition: they missed it, as if it came back (40 names beside a second replica:
    that one took each such partition and handed it back towards the names, partitions
    moving every few seconds)."""
    window = fleet._verify_window()
    for n, (when, below, reconnects) in list(fleet._shed.items()):
        if (now - when > window and below and reconnects == fleet._reconnects()
                and all(name in fleet._unverified
                        and when > fleet._unverified[name][2] for name in below)):
            del fleet._shed[n]
            _doubt(fleet, below, now, fleet._back_off(now), when)


def _report_fleet(metrics: RuntimeMetrics, owned: int, live: Mapping[str, int],
                  partitions: int) -> None:
    """The fleet as this replica hears it: replicas and partitions owned, its own too
    (at most the partitions: presence says how many a replica owns, not which, so names
    claiming partitions summed to 32 or 13,000 of 16, redteam16 F1; a worker credential
    can still claim a gap away, see docs/distributed.md, "Trust")."""
    metrics.fleet_replicas.set(1 + len(live))
    metrics.fleet_owned.set(min(partitions, owned + sum(live.values())))


def parse_presence(data: bytes, partitions: int) -> tuple[str, int]:
    """(replica, partitions owned) of one presence message; `Rejected` (`oversized`,
    `invalid`) for anything else: no traceback for Infinity, NaN or deep nesting."""
    if len(data) > MAX_PRESENCE_BYTES:
        raise Rejected("oversized", f"{len(data)} bytes > {MAX_PRESENCE_BYTES}")
    try:
        body = strict_json.loads(data)
    except (ValueError, RecursionError):
        raise Rejected("invalid", "presence is not a JSON object") from None
    if not isinstance(body, dict) or set(body) != {"replica", "owned"}:
        raise Rejected("invalid", "presence must be {replica, owned}")
    replica, owned = body["replica"], body["owned"]
    if not valid_replica(replica):
        raise Rejected("invalid", "presence 'replica' is not a replica name")
    if not (isinstance(owned, int) and not isinstance(owned, bool)
            and 0 <= owned <= partitions):
        raise Rejected("invalid", "presence 'owned' is not a partition count")
    return replica, owned


def _keyless_probe(config: NatsConfig, partition: int, window: int) -> tuple[str, str]:
    """A probe's subject and id without the fleet's key (`Connection.probe` has it)."""
    subject = config.probe_subject(partition)
    return subject, f"{subject}.{window}"


#: The header of a presence message naming the process that sent it (a random id per
#: worker): older replicas ignore it, as they ignore every header of presence.
INSTANCE_HEADER = "Turnrouter-Instance"
#: How often a twin (another process with this replica's name) is logged again.
_TWIN_LOG_SECS = 600.0


class _OwnName:
    """This replica's name on presence: since when, and last when, its own presence was
    heard without a gap, and another process announcing the same name, warned of (a
    second worker given a running replica's `--replica` sat idle without a word:
    redteam22 N1). A twin's presence is not heard as this replica's own."""

    def __init__(self, replica: str) -> None:
        self.replica, self.heard = replica, (0.0, 0.0)
        self.header = {INSTANCE_HEADER: secrets.token_hex(8)}
        self._warned = -math.inf

    def hear(self, msg: Msg, now: float, gap: float) -> None:
        sender = (msg.headers or {}).get(INSTANCE_HEADER)
        if sender is not None and sender != self.header[INSTANCE_HEADER]:
            if now - self._warned >= _TWIN_LOG_SECS:
                self._warned = now
                logger.warning(
                    "turnrouter: another worker announces this replica's name %r "
                    "(--replica): the fleet takes the two for one, and one of them sits "
                    "idle; give each worker its own name (a pod's name, say)", self.replica)
            return
        since, last = self.heard
        self.heard = (now, now) if now - last > gap else (since, now)  # a gap: an outage


class Fleet:
    """This replica's view of the others, and what it tells them."""

    def __init__(self, nc: Client, config: NatsConfig, replica: str,
                 owned: Callable[[], Container[int]], count: Callable[[], int],
                 metrics: RuntimeMetrics | None,
                 spawn: Callable[[Coroutine[Any, Any, Any], str], Any],
                 reject: Callable[[str, str], None], *,
                 listen: Client | None = None,
                 probe: Callable[[int, int], tuple[str, str]] | None = None) -> None:
        self._nc, self._config, self._replica = nc, config, replica
        self.probe = probe or functools.partial(_keyless_probe, config)  # (`Connection`'s)
        self._probe_secs = config.probe_interval
        self.listen = listen or nc  # what presence, timing are read on (`hang_up`)
        self._owned, self._count, self._metrics = owned, count, metrics
        self._spawn, self._reject = spawn, reject
        self._peers: dict[str, tuple[float, int]] = {}
        self.own = _OwnName(replica)  # its own presence heard, and a twin's
        self._pruned = 0.0  # when `_peers` last forgot the names gone from presence
        self._shed_after = time.monotonic() + 2 * config.failover_timeout
        #: Balance hands nothing over from `_backoff_since` until `_backoff_until` (a
        #: handover came back or was aborted); `_zero_seen`: when a peer last said it
        #: owns no partition; `_lured_seen`: when a doubted one did, or a handover came
        #: back (see `_backing_off`).
        self._backoff_since = self._backoff_until = 0.0
        self._zero_seen = self._lured_seen = 0.0
        self._aborted_until = 0.0  # the end of a backoff after an aborted handover
        #: Peers below their share when a partition was handed over that did not take
        #: it (it came back here), ignored for balance until a time or until they say
        #: they own a partition (a name on presence is no replica; a real one gets
        #: another chance then): name -> (until, the doubt's length, since when the
        #: wave of handovers it missed came back, whether it missed a second chance
        #: too), see `_doubt`.
        self._unverified: dict[str, tuple[float, float, float, bool]] = {}
        #: partition -> (when, to whom, the connection's reconnects then)
        self._shed: dict[int, tuple[float, frozenset[str], int]] = {}
        self._backoff = SHED_BACKOFF_SECS
        self.shed_wait = config.pull_expires  # a busy handover's wait: SHED_PATIENCE_SECS
        self._busy_since: float | None = None  # since when every partition was busy
        self._seen_reconnects = 0  # the connection's reconnects balance has seen
        self._probe_all_until = 0.0  # probe owned partitions too until then
        self.predictors: list[TimingPredictor] = []
        self._samples: list[str] = []
        self._sample_bytes = 0
        self._flush: asyncio.TimerHandle | None = None
        self._publishing: set[asyncio.Future[Any]] = set()
        self._closed = False
        #: The routes fleet samples may name (the router's destinations).
        self.routes: Callable[[], Mapping[str, Any] | Container[str]] = dict
        self._window = _SampleWindow(replica)
        sent = received = dropped = None
        if metrics is not None:
            samples = metrics.timing_samples
            sent, received, dropped = (samples.labels("sent"), samples.labels("received"),
                                       samples.labels("dropped"))
        self._sent, self._received, self._dropped = sent, received, dropped

    async def start(self) -> list[asyncio.Task[None]]:
        """Subscribe and start the presence and probe loops (returned, to cancel)."""
        limits = fleet_limits(self._config)
        await self.listen.subscribe(f"{self._config.prefix}.presence",
                                    cb=self._on_presence, **limits)
        await self.listen.subscribe(self._config.timing_subject, cb=self._on_sample,
                                    **limits)
        return [asyncio.create_task(self._presence_loop(), name="presence"),
                asyncio.create_task(self._probe_loop(), name="probes")]

    # ------------------------------------------------------------------ balance
    def _live(self, horizon: float) -> dict[str, int]:
        """Each live peer that balance believes in, and the partitions it owns."""
        return {name: owned for name, (seen, owned) in self._peers.items()
                if seen >= horizon and not self._doubted(name)}

    def _doubted(self, name: str) -> bool:
        doubt = self._unverified.get(name)
        if doubt is None:
            return False
        now = time.monotonic()
        if doubt[0] > now:
            return True
        if now >= doubt[0] + doubt[1] + SHED_BACKOFF_SECS:  # remembered (`_doubt`)
            del self._unverified[name]
        return False

    def fair_share(self) -> int:
        """Partitions per live replica (rounded up): balance, not ownership."""
        live = 1 + len(self._live(time.monotonic() - 3 * self._config.probe_interval))
        return -(-self._config.partitions // live)

    def may_shed(self, busy: bool = False) -> bool:
        """Hand one surplus partition over when a live peer holds less than its share
        (not while a handover that came back is being backed off). A handover waits for
        the partition's turns, and its next input (a barge-in, say) as long: a `busy`
        partition (a turn running) goes only once none was idle for
        `SHED_PATIENCE_SECS` (and then waits at most `pull_expires` for its turns)."""
        self._after_reconnect()
        now = time.monotonic()
        if not busy:
            self._busy_since = None  # an idle partition: no busy one needs to go
        elif self._busy_since is None or now - self._busy_since < SHED_PATIENCE_SECS:
            if self._busy_since is None:
                self._busy_since = now
            return False
        _settle(self, now)
        if now < self._shed_after or _backing_off(self, now):
            return False
        share = self.fair_share()
        below = [name for name, owned in self._live(
            now - 3 * self._config.probe_interval).items() if owned < share]
        if not below or (all(name in self._unverified for name in below) and any(
                now - when <= self._verify_window() for when, _, _ in self._shed.values())):
            return False  # names doubted before get one handover at a time (`_doubt`)
        self._shed_after = now + self._config.probe_interval / 2
        return True

    def handed_over(self, n: int) -> None:
        """Partition `n` was handed over for balance: the peers below their share then
        are who should take it (`taken_back` tells when none did)."""
        now = time.monotonic()
        window = self._verify_window()
        for old, (when, _, _) in list(self._shed.items()):
            if now - when > window:  # not taken back: it went to a replica
                del self._shed[old]
                self._backoff = SHED_BACKOFF_SECS
        horizon, share = now - 3 * self._config.probe_interval, self.fair_share()
        below = frozenset(name for name, owned in self._live(horizon).items()
                          if owned < share)
        self._shed[n] = (now, below, self._reconnects())
        if len(self._shed) > self._config.partitions:  # bounded: one entry per partition
            del self._shed[next(iter(self._shed))]

    def taken_back(self, n: int) -> None:
        """This replica got partition `n` again. Soon after handing it over, no peer
        took it: the peers that were below their share are not replicas (or could not
        pull in time); they are counted (`nats_presence`, `unverified`) and ignored for
        balance for the backoff (10 s, doubling up to `SHED_BACKOFF_MAX_SECS`) or until
        they own a partition, and balance hands nothing over meanwhile, so names on the
        presence subject cannot keep partitions moving."""
        shed = self._shed.pop(n, None)
        if shed is None:
            return
        when, below, reconnects = shed
        now = time.monotonic()
        if now - when > self._verify_window() or reconnects != self._reconnects():
            # Long ago: a peer took it and gave it back, or died. Or the server was
            # lost since: a restarted server pins afresh, whoever asks first.
            return
        _doubt(self, below, now, self._back_off(now), when)

    def handover_aborted(self) -> None:
        """A busy partition's turns outlasted the handover's wait: it stays here, counted
        (`nats_presence`, `handover_aborted`); the next try waits longer (`_wait_longer`:
        chaos12 D1, replicas added under long turns got no partition)."""
        self._reject("nats_presence", "handover_aborted")
        _wait_longer(self, time.monotonic())

    def _back_off(self, now: float) -> float:
        """Hand nothing over for the backoff, doubling the next one; returns until when."""
        if now >= self._backoff_until:
            self._backoff_since = now
        until = self._backoff_until = now + self._backoff
        self._backoff = min(2 * self._backoff, SHED_BACKOFF_MAX_SECS)
        return until

    def _verify_window(self) -> float:
        """How soon after a handover getting the partition back means nobody took it."""
        return (SHED_VERIFY_FACTOR * self._config.failover_timeout
                + 3 * self._config.probe_interval)

    async def leave_alone(self, n: int, owned: int) -> bool:
        """Whether this replica (owning `owned` partitions, not `n`) should not pull `n`
        now: it handed `n` over less than `_hold_off()` ago (pulling raced the peer below
        its share, pinned by the next probe: a real replica taken for a name that is
        none backed balance off), the connection came back three probe periods ago or
        less (a restarted server pins afresh: previous owners, turns running, ask first,
        `_repin`), or it is at its share and `n` has a pinned client."""
        self._after_reconnect()
        shed, now = self._shed.get(n), time.monotonic()
        if now < self._probe_all_until or (shed and now - shed[0] < self._hold_off()):
            return True
        return owned >= self.fair_share() and await pinned_elsewhere(self, n)

    def _after_reconnect(self) -> None:
        """Once the connection came back (a server restart pins afresh, so the pins
        this replica holds may be stale, and a peer may hold the same partitions in its
        own view): probe every partition, owned ones too, for three probe periods, so
        each gets its one pinned client again (the others are told `423`), and hand
        nothing over until then."""
        reconnects = self._reconnects()
        if reconnects == self._seen_reconnects:
            return
        self._seen_reconnects = reconnects
        now = time.monotonic()
        self._probe_all_until = now + 3 * self._config.probe_interval
        self._shed_after = max(self._shed_after, now + 2 * self._config.failover_timeout
                               + 3 * self._config.probe_interval)

    def _reconnects(self) -> int:
        return n if isinstance(n := self._nc.stats.get("reconnects", 0), int) else 0

    def _hold_off(self) -> float:
        """How long a handed-over partition is left to the peers (a probe pins it)."""
        return self._config.failover_timeout + 2 * self._config.probe_interval

    async def _presence_loop(self) -> None:
        while True:
            owned = self._count()
            with contextlib.suppress(NatsError):
                await self._nc.publish(
                    f"{self._config.prefix}.presence",
                    json.dumps({"replica": self._replica, "owned": owned}).encode(),
                    headers=self.own.header)
            if self.listen is not self._nc:
                await _echo(self._nc, self._config.probe_interval / 2)
            if self._metrics is not None:  # the fleet as heard: what scrapes may miss
                _report_fleet(self._metrics, owned, self._live(
                    time.monotonic() - 3 * self._config.probe_interval),
                    self._config.partitions)
            await asyncio.sleep(self._config.probe_interval)

    async def _on_presence(self, msg: Msg) -> None:
        try:
            replica, owned = parse_presence(msg.data, self._config.partitions)
        except Rejected as exc:
            self._reject("nats_presence", exc.reason)
            return
        now = time.monotonic()
        if replica == self._replica:  # its own, back: this replica hears the bus
            self.own.hear(msg, now, 2 * self._config.probe_interval)
        else:
            if owned:  # it pulls: balance trusts it again, and a doubt later is its first
                self._unverified.pop(replica, None)
            else:
                self._zero_seen = now
                if self._doubted(replica) and self._unverified[replica][3]:
                    self._lured_seen = now  # a name that keeps luring handovers speaks
            if replica not in self._peers and len(self._peers) >= _MAX_PEERS:
                self._prune()
            if replica not in self._peers and len(self._peers) >= _MAX_PEERS:
                self._reject("nats_presence", "overflow")
                return
            self._peers[replica] = (now, owned)

    def _prune(self) -> None:
        """Forget the peers gone from presence (at most once per probe period): names
        announced once must not keep a replica started later out of the table for
        good (doubts are kept apart, in `_unverified`)."""
        now = time.monotonic()
        if now - self._pruned < self._config.probe_interval:
            return
        self._pruned, horizon = now, now - 3 * self._config.probe_interval
        for name in [name for name, (seen, _) in self._peers.items() if seen < horizon]:
            del self._peers[name]

    async def _probe_loop(self) -> None:
        """Probe the partitions not owned here (all of them just after a reconnect), so a
        dead owner's partitions get a new pinned client (and their unfinished turns
        their ending) even when idle."""
        while True:
            await asyncio.sleep(self._config.probe_interval)
            self._after_reconnect()
            owned = () if time.monotonic() < self._probe_all_until else self._owned()
            for n in range(self._config.partitions):
                if n in owned:
                    continue
                with contextlib.suppress(NatsError, TimeoutError):
                    # One per partition, subject form and window across the fleet (by
                    # id), unconfirmed: a refused or lost one must not hold up the others.
                    to, msg_id = self.probe(n, int(time.time() / self._probe_secs))
                    await self._nc.publish(to, b"", headers={"Nats-Msg-Id": msg_id})

    # ------------------------------------------------------------------ timing samples
    def send_sample(self, sample: TimingSample) -> None:
        """Queue one local first-response sample for the other replicas (sent within
        `SAMPLE_FLUSH_SECS`, or at once when a batch is full)."""
        if self._closed or self._nc.is_closed:
            if self._dropped is not None:
                self._dropped.inc()
            return
        now = time.monotonic()
        self._window.admit(self._replica, sample.route, now)  # our own share
        self._window.measured(sample.route, now, sample.seconds)
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
            await self._nc.publish(self._config.timing_subject,
                                   self._window.sent(samples_body(lines)),
                                   headers={"Turnrouter-Replica": self._replica})
        except NatsError as exc:  # closed or over the client's buffer: counted, not raised
            logger.warning("turnrouter: %d timing samples not sent: %r", len(lines), exc)
            if self._dropped is not None:
                self._dropped.inc(len(lines))
        else:
            if self._sent is not None:
                self._sent.inc(len(lines))

    async def _on_sample(self, msg: Msg) -> None:
        publisher = (msg.headers or {}).get("Turnrouter-Replica")
        if publisher == self._replica and self._window.echo(msg.data):
            return  # its own samples, back from the server (learned when measured)
        if publisher == self._replica or not valid_replica(publisher):
            self._reject("nats_timing", "invalid")  # who sent it decides its weight
            return
        assert isinstance(publisher, str)
        if not self._announced(publisher):
            self._reject("nats_timing", "unknown_publisher")  # before parsing: cheap
            return
        if not self._window.budget(publisher, len(msg.data), time.monotonic()):
            self._reject("nats_timing", "overflow")
            return
        try:
            samples, errors = parse_samples(self._config, msg.data)
        except Rejected as exc:
            _refused(self._window, f"a timing samples message: {exc}")
            self._reject("nats_timing", exc.reason)
            return
        if errors:
            _refused(self._window, f"{len(errors)} timing sample(s): {errors[0]}")
            for _ in errors:
                self._reject("nats_timing", "invalid")
        routes, now = self.routes(), time.monotonic()
        latest = time.time() + MAX_SAMPLE_AHEAD_SECS
        anchors: dict[str, float | None] = {}
        kept = []
        for sample in samples:
            route = sample.route
            if route not in routes:
                reason = "unknown_route"  # the route table holds this fleet's routes only
            elif not (0 < sample.seconds <= MAX_SAMPLE_SECS and 0 <= sample.at <= latest):
                reason = "out_of_range"
            else:
                if route not in anchors:
                    anchors[route] = self._window.anchor(route, now)
                anchor = anchors[route]
                seconds = max(sample.seconds, ANCHOR_FLOOR_SECS)
                if anchor is not None and not (anchor / ANCHOR_FACTOR <= seconds
                                               <= anchor * ANCHOR_FACTOR):
                    reason = "outlier"
                else:
                    reason = self._window.admit(publisher, route, now)
            if reason:
                self._reject("nats_timing", reason)
            else:
                kept.append(sample)
        if self._received is not None and kept:
            self._received.inc(len(kept))
        for sample in kept:
            for predictor in self.predictors:
                predictor.record(sample)

    def _announced(self, publisher: str) -> bool:
        """Whether `publisher` is a replica seen on presence within the liveness
        horizon and not doubted (as `fair_share` counts them): a name no live replica
        announces is no publisher, so rotating names buys nothing without presence too."""
        seen = self._peers.get(publisher)
        return seen is not None and seen[0] >= (
            time.monotonic() - 3 * self._config.probe_interval) and not self._doubted(
                publisher)


#: Timing messages a replica sent whose echo it still expects (a reconnect may lose
#: some: the oldest are forgotten).
MAX_UNECHOED = 64


class _SampleWindow:
    """What a replica counts of fleet timing samples per `SAMPLE_WINDOW_SECS` window
    (each publisher's share of each route, the bytes parsed) and its own recent samples
    per route (the anchor fleet samples are compared with)."""

    def __init__(self, replica: str) -> None:
        self._replica = replica
        self._window_start = time.monotonic()
        self._shares: dict[str, dict[str, int]] = {}
        self._parsed: dict[str, int] = {}  # bytes parsed per publisher in the window
        self._parsed_total = 0  # and from all of them
        self.refused = 0  # timing messages refused after parsing (`_refused` logs them)
        #: Per route, this replica's own recent samples: (monotonic time, seconds).
        self._own: dict[str, deque[tuple[float, float]]] = {}
        #: Digests of the timing messages this replica sent whose echo has not come
        #: back: a message in its name that is none of them is a forger's.
        self._sent: deque[bytes] = deque(maxlen=MAX_UNECHOED)

    def sent(self, body: bytes) -> bytes:
        """`body` goes out in this replica's name: its echo is expected (returned)."""
        self._sent.append(hashlib.blake2b(body, digest_size=16).digest())
        return body

    def echo(self, body: bytes) -> bool:
        """Whether `body`, in this replica's name, is one it sent (then forgotten)."""
        digest = hashlib.blake2b(body, digest_size=16).digest()
        try:
            self._sent.remove(digest)
        except ValueError:
            return False
        return True

    def measured(self, route: str, now: float, seconds: float) -> None:
        """One of this replica's own samples of `route` (bounded routes and samples)."""
        own = self._own.get(route)
        if own is None and len(self._own) < 4 * MAX_SAMPLE_PUBLISHERS:
            own = self._own[route] = deque(maxlen=ANCHOR_SAMPLES)
        if own is not None:
            own.append((now, seconds))

    def admit(self, publisher: str, route: str, now: float) -> str:
        """Count one sample of `publisher` for `route` in the current window; the reason
        to refuse it ('' to keep it): past `SAMPLE_FLOOR`, no publisher holds more than
        `SAMPLE_SHARE` of a route's samples in the window."""
        self._roll(now)
        counts = self._shares.get(route)
        if counts is None:
            if len(self._shares) >= 4 * MAX_SAMPLE_PUBLISHERS:
                return "overflow"
            counts = self._shares[route] = {}
        mine = counts.get(publisher, 0)
        if publisher not in counts and len(counts) >= MAX_SAMPLE_PUBLISHERS:
            return "overflow"
        if publisher != self._replica:  # (this replica's own samples: every turn)
            total = sum(counts.values())
            if mine >= max(SAMPLE_FLOOR, SAMPLE_SHARE * (total + 1)):
                return "over_share"
            own = counts.get(self._replica, 0)
            if total - own >= own + SAMPLE_FLOOR:
                return "fleet_share"
        counts[publisher] = mine + 1
        return ""

    def _roll(self, now: float) -> None:
        """Start a new window every `SAMPLE_WINDOW_SECS`: shares and budgets reset."""
        if now - self._window_start >= SAMPLE_WINDOW_SECS:
            self._window_start, self._shares, self._parsed = now, {}, {}
            self._parsed_total = 0

    def budget(self, publisher: str, size: int, now: float) -> bool:
        """Whether a message of `size` bytes from `publisher` may be parsed in this
        window (`SAMPLE_BYTES_PER_PUBLISHER`, `SAMPLE_BYTES_PER_WINDOW`); counted if so."""
        self._roll(now)
        parsed = self._parsed
        mine = parsed.get(publisher, 0)
        if (mine + size > SAMPLE_BYTES_PER_PUBLISHER
                or self._parsed_total + size > SAMPLE_BYTES_PER_WINDOW
                or (not mine and len(parsed) >= MAX_SAMPLE_PUBLISHERS)):
            return False
        parsed[publisher] = mine + size
        self._parsed_total += size
        return True

    def anchor(self, route: str, now: float) -> float | None:
        """The median of this replica's own recent samples of `route`, at least
        `ANCHOR_FLOOR_SECS` (None: fewer than `ANCHOR_MIN` younger than `ANCHOR_SECS`)."""
        own = self._own.get(route)
        if own is None:
            return None
        recent = sorted(seconds for at, seconds in own if now - at <= ANCHOR_SECS)
        if len(recent) < ANCHOR_MIN:
            return None
        return max(recent[len(recent) // 2], ANCHOR_FLOOR_SECS)


async def _echo(nc: Client, wait: float) -> None:
    """One message for the worker's own connection to hear (the smallest JetStream API
    request, answered by the server even without JetStream). Its own presence, which
    proved every probe period that the connection was not frozen (`_Hearing` in
    _worker.py), is read on the fleet connection (`Connection.connect_fleet`): without
    this, a worker owning every partition heard nothing while a pull waited (no probe
    replies either) and stopped pulling, taking its server for frozen."""
    with contextlib.suppress(NatsError, TimeoutError):
        await nc.request("$JS.API.INFO", b"", timeout=wait)


async def hang_up(fleet: Fleet) -> None:
    """Close the connection `fleet` reads presence and timing on, when it is not the
    worker's own (`Connection.connect_fleet`: a flood there holds back nothing of the
    connection that pulls, writes and publishes)."""
    if fleet.listen is not fleet._nc:
        with contextlib.suppress(Exception):
            await fleet.listen.close()


def _refused(window: _SampleWindow, what: str) -> None:
    """A timing message (or samples of one) refused after parsing: logged the first
    time and at every power of ten, with the count (one line per message let a
    publisher with the workers' credentials write thousands a second); each is counted
    in `turnrouter_runtime_rejected_messages_total{topic="nats_timing"}`."""
    window.refused += 1
    if is_logged(window.refused):
        logger.warning("turnrouter: rejected %s (%d so far)", what, window.refused)


def forget_shed(fleet: Fleet, n: int) -> None:
    """Forget that this replica handed partition `n` over (it may pull it at once)."""
    fleet._shed.pop(n, None)


def unowned(fleet: Fleet) -> int:
    """How many partitions neither this replica nor a peer heard on presence lately
    says it owns (0 once the fleet's ownership covers them all)."""
    config = fleet._config
    live = fleet._live(time.monotonic() - 3 * config.probe_interval)
    return max(0, config.partitions - fleet._count() - sum(live.values()))


async def pinned_elsewhere(fleet: Fleet, n: int) -> bool:
    """Whether partition `n` has a pinned client (a replica at its share leaves it
    alone); an unpinned one is pulled, so an orphan finds an owner. Also True when the
    connection came back while the server was asked (`leave_alone`: an answer from the
    server just restarted, or none, is no reason to pull before its previous owner)."""
    try:
        info = await api_request(
            fleet._nc, f"$JS.API.CONSUMER.INFO.{fleet._config.stream}."
            f"{fleet._config.consumer(n)}", wait=2.0)
    except Exception:
        info = {}
    fleet._after_reconnect()
    if time.monotonic() < fleet._probe_all_until:
        return True
    groups = info.get("priority_groups") or []
    return any(isinstance(g, dict) and g.get("pinned_client_id") for g in groups)


async def previous_owner_alive(fleet: Fleet, replica: str) -> bool:
    """Whether `replica`, the last writer of a record this replica takes over, is alive
    (True) or gone (False), by presence: alive when it spoke within two probe periods;
    gone when it stayed silent that long while this replica heard its own presence
    throughout. Right after an outage of its own (a server frozen or restarted: no
    presence came through), this replica cannot tell yet: the peer is heard only once
    it reconnected too (up to a reconnect period later) and spoke (within a probe
    period), so its silence counts from then; at most `failover_timeout` plus that
    settling time, then it is taken as gone. (Judged on two probe periods, a peer
    reconnecting half a second later was taken as gone, and its answer written a
    moment after was fenced: the turn ended with the failure text.)"""
    config = fleet._config
    deadline = time.monotonic() + config.failover_timeout + _settling(config)
    while True:
        heard = owner_heard(fleet, replica)
        if heard is not None:
            return heard
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(config.probe_interval / 5)  # bounded by the deadline above


def owner_heard(fleet: Fleet, replica: str) -> bool | None:
    """`previous_owner_alive`'s verdict now: True (it spoke within two probe periods),
    False (silent that long, and after the settling time of an outage of this
    replica's own, while this replica heard itself), None (cannot tell yet). Of this
    replica itself: whether it heard its own presence within two probe periods (False
    after a freeze or an outage of its own: its pins may have moved meanwhile)."""
    config = fleet._config
    window = 2 * config.probe_interval
    now = time.monotonic()
    if replica == fleet._replica:  # itself: whether it hears the bus (not cut off)
        return now - fleet.own.heard[1] <= window
    peer = fleet._peers.get(replica)
    if peer is not None and now - peer[0] <= window:
        return True
    since, last = fleet.own.heard
    if now - last <= window and now - since >= _settling(config):
        return False
    return None


def _settling(config: NatsConfig) -> float:
    """How long this replica hears itself after an outage of its own before a peer's
    silence counts: two probe periods, and the peer's reconnect (up to a reconnect
    period later) and first presence (within a probe period) on top."""
    return 3 * config.probe_interval + RECONNECT_WAIT
