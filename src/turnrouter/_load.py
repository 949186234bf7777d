"""Saturation and admission control: measure the event loop, refuse work past capacity.

A router whose event loop is saturated does not fail loudly: every turn waits longer
for the loop, the participant speaks again before the answer starts, the new turn
supersedes the waiting one, and goodput collapses to zero while every counter balances.
`LoadMonitor` measures the saturation cheaply (one timer task sampling the event-loop
lag, the turns in flight, the longest wait before routing) and, under an
`OverloadPolicy`, turns it into two levels: *busy* (lag past `busy_lag_secs`: new
participants are refused) and *shedding* (lag past `shed_lag_secs`: new turns of
admitted participants are refused too). A refused turn costs a counter, a span and one
short control text, so the participants already admitted keep getting answers.

Lag shows too late for a crowd arriving over seconds: each admitted participant brings
load for a whole conversation, and the loop can run near 100% with a low lag until the
queue builds. With `max_busy_fraction` (off by default) the sampler also measures the
loop's *busy fraction* (the time its thread was running or waiting for a core over each
sample period, `Clock.busy_time`), and from the last `demand_window_secs` of samples the
demand each participant the router holds brought (busy fraction per participant held);
a new participant is admitted only while the participants held plus the newcomers, at
that demand, stay under `max_busy_fraction`, newcomers spread over the window. A sample
counts for at most `STALL_SAMPLES` periods, so one long stall (a collector pause, a
blocking call) weighs as a few busy samples, not as demand.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

from ._clock import Clock
from ._contracts import NO_ROUTE, AgentTurn, say_through
from ._exceptions import ConfigurationError, ContractTypeError, RouterBusyError
from ._logging import log_failure
from ._observer import LoadSampled, RouterObserver, TurnShed

__all__ = [
    "DEFAULT_BUSY_TEXT",
    "LoadMonitor",
    "OverloadPolicy",
    "RouterLoad",
    "ShedReason",
]

#: What a participant refused for load hears.
DEFAULT_BUSY_TEXT = "Sorry, I'm very busy right now. Please try again in a moment."

#: Why a turn was shed: a participant the router holds no state for while busy, any new
#: turn while shedding, or any new turn at `OverloadPolicy.max_turns_in_flight`.
ShedReason = Literal["new_participant", "shedding", "turns_in_flight"]

#: Consecutive idle samples (no turn in flight, not busy) after which the sampler ends;
#: the next turn starts it again.
IDLE_SAMPLES = 50
#: Bounds of the new participants admitted per sample period (`OverloadPolicy`).
MIN_NEW_PER_SAMPLE = 8
MAX_NEW_PER_SAMPLE = 65536
#: The largest `OverloadPolicy.max_turns_in_flight` (a router holds at most 100,000
#: participants by default, each with at most 9 turns in flight and waiting).
MAX_TURNS_IN_FLIGHT = 1_000_000
#: Bound of the samples the demand is estimated over (`demand_window_secs` /
#: `sample_secs`, at least 1).
MAX_DEMAND_SAMPLES = 4096
#: A sample period counts for at most this many periods of the demand's window.
STALL_SAMPLES = 4
#: New participants admitted per sample, at least, while the loop is busy less than half
#: of `OverloadPolicy.max_busy_fraction` whatever the projection (80 a second by default).
IDLE_ROOM = 2


@dataclass(frozen=True, slots=True)
class OverloadPolicy:
    """When the router refuses work to keep answering the work it admitted.

    Pass `overload=None` to `AgentRouter` to turn admission control off (saturation is
    then not measured).

    Args:
        busy_lag_secs: Event-loop lag at which the router turns busy (new participants
            refused, readiness fails) when two samples in a row reach it.
        shed_lag_secs: Lag at which new turns of admitted participants are refused too
            (again until it falls below half).
        sample_secs: How often the lag is sampled.
        busy_text: What a refused participant hears.
        calm_samples: Samples in a row below half of `busy_lag_secs` before the router
            is ready again (every participant admitted adds load for a whole
            conversation, so admission resumes only once calm holds).
        new_per_sample: New participants admitted between two samples, at first:
            between samples the router cannot see what its admissions cost, so a crowd
            arriving at once (that many turns in flight) is admitted that many at a
            time, the rest refused as when busy. Doubled after each calm sample that
            used it all (up to 65,536), halved (down to 8) each time the router turns
            busy.
        max_busy_fraction: The share of the loop's time the participants held may take,
            projected: a new participant is admitted only while the participants held
            plus it, each bringing the demand measured per participant held over
            `demand_window_secs`, stay under it (past it the newcomer is refused as when
            busy, reason `new_participant`), newcomers spread over the window. None (the
            default) turns the projection off: lag and the per-sample budget only. 0.75
            keeps a crowd arriving over seconds from stalling everyone (docs/limits.md
            says when to turn it on). Measured only with a clock that has `busy_time`
            (the default clock and `ManualClock` do).
        demand_window_secs: The window of samples the busy fraction and the demand per
            participant are measured over (at least one sample period's worth; at most
            4,096 samples). Projection starts once a quarter of it was sampled.
        max_turns_in_flight: At most this many turns handled at once (routing, waiting
            behind a participant's running turn, answering); a turn past it is refused
            with `busy_text` (reason `turns_in_flight`), whoever speaks. The lag
            measures only the event loop: destinations waiting on a saturated backend
            (an LLM's rate limit, a pool of 10 connections) leave it idle while their
            waits grow without end. None (the default): no bound. Size it from the
            backend: its concurrency times the answers you accept to queue behind it.
    """

    busy_lag_secs: float = 0.1
    shed_lag_secs: float = 0.25
    sample_secs: float = 0.025
    busy_text: str = DEFAULT_BUSY_TEXT
    calm_samples: int = 4
    new_per_sample: int = 64
    max_busy_fraction: float | None = None
    demand_window_secs: float = 2.0
    max_turns_in_flight: int | None = None

    def __post_init__(self) -> None:
        for name in ("busy_lag_secs", "shed_lag_secs", "sample_secs", "demand_window_secs"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ContractTypeError(
                    f"OverloadPolicy {name} must be a number, got {type(value).__name__}")
            if not (math.isfinite(value) and value > 0):
                raise ConfigurationError(
                    f"OverloadPolicy {name} must be finite and positive, got {value!r}")
        if self.shed_lag_secs < self.busy_lag_secs:
            raise ConfigurationError(
                f"OverloadPolicy shed_lag_secs ({self.shed_lag_secs!r}) must be at least "
                f"busy_lag_secs ({self.busy_lag_secs!r})")
        calm = self.calm_samples
        if not isinstance(calm, int) or isinstance(calm, bool) or not 1 <= calm <= 1000:
            raise ConfigurationError(
                f"OverloadPolicy calm_samples must be an int in 1..1000, got {calm!r}")
        new = self.new_per_sample
        if not isinstance(new, int) or isinstance(new, bool) or not (
                MIN_NEW_PER_SAMPLE <= new <= MAX_NEW_PER_SAMPLE):
            raise ConfigurationError(
                f"OverloadPolicy new_per_sample must be an int in {MIN_NEW_PER_SAMPLE}.."
                f"{MAX_NEW_PER_SAMPLE}, got {new!r}")
        if not isinstance(self.busy_text, str) or not self.busy_text:
            raise ConfigurationError("OverloadPolicy busy_text must be a non-empty str")
        cap = self.max_turns_in_flight
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool)
                                or not 1 <= cap <= MAX_TURNS_IN_FLIGHT):
            raise ConfigurationError(
                f"OverloadPolicy max_turns_in_flight must be None or an int in "
                f"1..{MAX_TURNS_IN_FLIGHT}, got {cap!r}")
        share = self.max_busy_fraction
        if share is not None and (not isinstance(share, int | float) or isinstance(
                share, bool) or not (math.isfinite(share) and 0 < share <= 1)):
            raise ConfigurationError(
                f"OverloadPolicy max_busy_fraction must be None or a number in (0, 1], "
                f"got {share!r}")

    def scaled(self, factor: float) -> OverloadPolicy:
        """The same policy with every duration divided by `factor` (a simulation that
        compresses time, as the demo's `--speed`, scales its thresholds with it)."""
        if not isinstance(factor, int | float) or not (math.isfinite(factor) and factor > 0):
            raise ConfigurationError(f"OverloadPolicy scale must be positive, got {factor!r}")
        return OverloadPolicy(self.busy_lag_secs / factor, self.shed_lag_secs / factor,
                              self.sample_secs / factor, self.busy_text, self.calm_samples,
                              self.new_per_sample, self.max_busy_fraction,
                              self.demand_window_secs / factor, self.max_turns_in_flight)


@dataclass(frozen=True, slots=True)
class RouterLoad:
    """The router's saturation as last sampled (`AgentRouter.load`).

    Args:
        status: "ready", "busy" (new participants refused) or "shedding" (new turns
            refused too).
        lag_secs: The latest event-loop lag sample.
        turns_in_flight: The turns being handled now.
        wait_secs: The longest time a turn waited before its routing began, over the
            latest sample period.
    """

    status: Literal["ready", "busy", "shedding"]
    lag_secs: float
    turns_in_flight: int
    wait_secs: float

    @property
    def busy(self) -> bool:
        """Whether the router refuses new participants (busy or shedding)."""
        return self.status != "ready"


class LoadMonitor:
    """One router's saturation: the lag sampler, turns in flight, busy and shedding.

    The sampler is one task owned by the router: started by the first turn on a running
    loop, ended by `stop()` or by itself after `IDLE_SAMPLES` idle samples (so it never
    outlives the work; the next turn starts it again). Per turn the router pays an
    attribute read (`busy`) and two counter updates; per new participant one more.
    """

    __slots__ = ("_busy_time", "_calm", "_clock", "_idle", "_new", "_observer", "budget",
                 "busy", "busy_fraction", "cap", "gate", "held", "in_flight", "lag",
                 "policy", "room", "shedding", "task", "wait_max")

    def __init__(self, policy: OverloadPolicy | None, observer: RouterObserver,
                 clock: Clock) -> None:
        self.policy = policy
        self._clock = clock
        self._observer = observer
        self.busy = False
        self.shedding = False
        #: Whether a turn is checked for refusal: busy, or this sample period's new
        #: participants admitted up to `budget` (`OverloadPolicy.new_per_sample`).
        self.gate = False
        self.budget = MAX_NEW_PER_SAMPLE if policy is None else policy.new_per_sample
        #: New participants the projected busy fraction leaves room for until the next
        #: sample (`OverloadPolicy.max_busy_fraction`); unbounded while not projected.
        self.room = math.inf
        #: `OverloadPolicy.max_turns_in_flight` (unbounded when None): a turn is checked
        #: for refusal while the gate is closed or this many are in flight.
        self.cap: float = math.inf if policy is None or policy.max_turns_in_flight is None \
            else policy.max_turns_in_flight
        #: The loop's busy fraction over the demand window, as last sampled.
        self.busy_fraction = 0.0
        #: How many participants the router holds (set by the router).
        self.held: Callable[[], int] = _none
        self._busy_time: Callable[[], float] | None = getattr(clock, "busy_time", None)
        self._new = 0
        self.in_flight = 0
        self.lag = 0.0
        self.wait_max = 0.0
        self._idle = 0
        #: Set (and dropped) when the router turns ready again; made by `wait_ready`.
        self._calm: asyncio.Event | None = None
        #: The sampler, while it runs.
        self.task: asyncio.Task[None] | None = None

    @property
    def busy_text(self) -> str:
        """What a turn refused for load hears (the default text with no policy)."""
        return DEFAULT_BUSY_TEXT if self.policy is None else self.policy.busy_text

    def snapshot(self) -> RouterLoad:
        status: Literal["ready", "busy", "shedding"] = (
            "shedding" if self.shedding else "busy" if self.busy else "ready")
        return RouterLoad(status, self.lag, self.in_flight, self.wait_max)

    def ensure_sampling(self) -> None:
        """Start the sampler if a policy asks for it and none runs (called per turn)."""
        if self.task is None and self.policy is not None:
            self._idle = 0
            self.task = asyncio.get_running_loop().create_task(
                self._sample(self.policy), name="turnrouter load sampler")

    def refusal(self, known: bool) -> ShedReason | None:
        """Why a new turn is refused now (None: admitted); `known`: the router holds
        the participant's state."""
        if self.in_flight >= self.cap:
            return "turns_in_flight"
        if self.shedding:
            return "shedding"
        if self.gate and not known:
            return "new_participant"
        return None

    def admitted_new(self) -> None:
        """A new participant was admitted: past this sample period's budget, with as
        many turns in flight (a crowd arriving at once, not turns driven one after the
        other), the gate closes to new participants until the next sample."""
        self._new += 1
        if (self._new >= self.budget and self.in_flight + 1 >= self.budget) or (  # (its own)
                self._new >= self.room):
            self.gate = True

    async def refuse(self, turn: AgentTurn,
                     emit: Callable[[AgentTurn, str, str], Awaitable[None]],
                     known: bool) -> None:
        """Shed `turn` if the load calls for it (`known`: the router holds the
        participant): counted (outcome `busy` and its reason), the participant told
        `busy_text`, `RouterBusyError` raised. Returns when the turn is admitted."""
        reason = self.refusal(known)
        if reason is None:
            return
        await self.shed(turn, emit, reason)
        if reason == "turns_in_flight":
            raise RouterBusyError(
                f"turn {turn.turn_id!r} of {turn.participant_id!r} refused: "
                f"{self.in_flight} turns in flight, OverloadPolicy max_turns_in_flight is "
                f"{self.cap:g}; the turns admitted keep their answers")
        projected = "" if self.busy or self._new < self.room else (
            f", the loop {self.busy_fraction:.0%} busy leaves no room for a participant")
        raise RouterBusyError(
            f"turn {turn.turn_id!r} of {turn.participant_id!r} refused: the router is "
            f"{'shedding' if reason == 'shedding' else 'busy'} (event-loop lag "
            f"{self.lag:.3f}s{projected}); the participants it admitted keep their "
            f"answers")

    async def shed(self, turn: AgentTurn,
                   emit: Callable[[AgentTurn, str, str], Awaitable[None]],
                   reason: ShedReason) -> None:
        """Shed `turn` for `reason`: the participant told `busy_text` through `emit`,
        then counted (outcome `busy` and its reason). No error raised: the in-process
        runtime sheds a query this way in its publisher's call, where raising and
        catching `RouterBusyError` through the turn's frames would cost more than the
        refusal itself."""
        assert self.policy is not None
        try:
            await say_through(emit, turn, NO_ROUTE, self.policy.busy_text)
        except Exception as exc:
            log_failure("telling %r that turn %s was shed", exc, turn.participant_id,
                        turn.turn_id)
        # Counted once told: a caller cancelled meanwhile (the in-process runtime sheds in
        # the publisher's call) took the query back, and it is not counted as a turn.
        self._observer.turn_shed(TurnShed(turn, reason))

    async def wait_ready(self) -> None:
        """Return once the router is not busy (at once when it is not)."""
        while self.busy:
            calm = self._calm
            if calm is None:
                calm = self._calm = asyncio.Event()
            await calm.wait()

    def _calmed(self) -> None:
        calm, self._calm = self._calm, None
        if calm is not None:
            calm.set()

    def waited(self, seconds: float) -> None:
        """A turn waited `seconds` before its routing began."""
        if seconds > self.wait_max:
            self.wait_max = seconds

    async def stop(self) -> None:
        """End the sampler (the router stops) and report the router ready again."""
        task = self.task
        if task is None:
            return
        task.cancel()
        try:
            await asyncio.wait((task,))
        finally:
            self._ended(task)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if self.task is task:
            self.task = None
            self.busy = self.shedding = self.gate = False
            self._new = 0
            self.room = math.inf
            self.lag = self.wait_max = self.busy_fraction = 0.0
            self._calmed()

    async def _sample(self, policy: OverloadPolicy) -> None:
        now, sleep_until, period = self._clock.now, self._clock.sleep_until, policy.sample_secs
        busy_on, shed_on = policy.busy_lag_secs, policy.shed_lag_secs
        calm, calm_needed = 0, policy.calm_samples
        observer = self._observer
        task = asyncio.current_task()
        assert task is not None
        demand = _Demand(policy, self._busy_time, now())
        try:
            while True:
                deadline = now() + period
                await sleep_until(deadline)
                at = now()
                lag = at - deadline
                lag = lag if lag > 0.0 else 0.0
                # On when two samples in a row reach the threshold (one collector pause
                # is not saturation), off below half of it.
                sustained = lag if lag < self.lag else self.lag
                self.lag = lag
                new, self._new = self._new, 0
                if not self.busy:
                    self.busy = sustained >= busy_on
                    calm = 0
                    if self.busy:  # what it admitted was too much: admit fewer at a time
                        self.budget = max(MIN_NEW_PER_SAMPLE, self.budget // 2)
                    elif new >= self.budget and lag < busy_on / 2:
                        self.budget = min(2 * self.budget, MAX_NEW_PER_SAMPLE)
                elif lag < busy_on / 2:
                    calm += 1
                    if calm >= calm_needed:  # admissions resume: new participants add load
                        self.busy = False
                        self._calmed()
                else:
                    calm = 0
                self.shedding = (lag >= shed_on / 2) if self.shedding else (
                    sustained >= shed_on)
                if demand.on:
                    self.room = demand.room(at, self.held(), lag, self.room - new, new)
                    self.busy_fraction = demand.fraction
                self.gate = self.busy or self.room <= 0
                wait, self.wait_max = self.wait_max, 0.0
                if observer.enabled:
                    observer.load_sampled(LoadSampled(
                        lag, self.in_flight, wait,
                        2 if self.shedding else 1 if self.busy else 0))
                if self.in_flight or self.busy:
                    self._idle = 0
                    continue
                self._idle += 1
                if self._idle >= IDLE_SAMPLES:
                    return
        finally:
            self._ended(task)
            if observer.enabled:
                observer.load_sampled(LoadSampled(0.0, self.in_flight, 0.0, 0))


def _none() -> int:
    return 0


class _Demand:
    """The loop's busy time and the participants held over the last `demand_window_secs`
    of samples, and the room they leave for new participants: `room()` once a sample."""

    __slots__ = ("_at", "_busy", "_cap", "_held", "_period", "_samples", "_share",
                 "_used", "_window", "fraction", "on")

    def __init__(self, policy: OverloadPolicy, busy_time: Callable[[], float] | None,
                 at: float) -> None:
        self._share = policy.max_busy_fraction
        self.on = self._share is not None and busy_time is not None
        self._busy: Callable[[], float] = busy_time or float
        self._window, self._period = policy.demand_window_secs, policy.sample_secs
        # A sample counts for at most this long: a stall (a collector pause, a blocking
        # call) weighs as a few busy samples, not as seconds of demand.
        self._cap = STALL_SAMPLES * policy.sample_secs
        #: (time, seconds counted, busy seconds, participant-seconds held) per sample,
        #: oldest first.
        self._samples: deque[tuple[float, float, float, float]] = deque(
            maxlen=MAX_DEMAND_SAMPLES)
        self._at, self._used = at, self._busy()
        self._held = 0
        self.fraction = 0.0

    def room(self, at: float, held: int, lag: float, left: float, new: int) -> float:
        """New participants admissible until the next sample (math.inf: any), after a
        sample `lag` late; `left`: the room the last sample left unused, `new`: the
        participants it admitted."""
        # Those who left since the last sample make room for as many newcomers at once:
        # their demand goes, an average newcomer's comes (churn is not growth).
        gone = self._held + new - held
        self._held = held
        used = self._busy()
        elapsed, spent = at - self._at, used - self._used
        self._at, self._used = at, used
        if not elapsed > 0.0:
            return math.inf
        # The loop was busy for its busy time, and at least for the lag (it was not idle
        # while the timer waited for it: where `busy_time` is CPU time alone, that shows
        # a process others on the machine hold off its core).
        spent = lag if lag > spent else spent
        spent = elapsed if spent > elapsed else spent if spent > 0.0 else 0.0
        if elapsed > self._cap:
            spent, elapsed = spent * self._cap / elapsed, self._cap
        samples = self._samples
        samples.append((at, elapsed, spent, held * elapsed))
        horizon = at - self._window
        while samples[0][0] < horizon:
            samples.popleft()
        span = busy = presence = recent_span = recent = 0.0
        lately = at - self._window / 4
        for when, weight, worked, present in samples:
            span += weight
            busy += worked
            presence += present
            if when > lately:
                recent_span += weight
                recent += worked
        self.fraction = busy / span
        share = self._share
        assert share is not None
        if span < self._window / 4 or not presence or not busy:
            return math.inf  # (too little history: the per-sample budget and lag only)
        # The busy fraction per participant held is what each newcomer is expected to
        # bring: the participants held plus newcomers stay under `share` of the loop.
        # Newcomers come in spread over the window, so that the demand they bring shows
        # before more are admitted on the strength of an estimate without them.
        total = math.floor(share * presence / busy) - held
        paced: float = 0
        if total > 0:
            paced = math.ceil(total * self._period / self._window)
            if left > 0:  # (kept, up to a few samples' worth: arrivals are not even)
                paced = min(paced + left, STALL_SAMPLES * paced)
            paced = min(paced + (gone if gone > 0 else 0), total)
        # Never closed while the loop is mostly idle, over the window and lately (an
        # estimate from little load, or from newcomers whose first turns show before
        # their time held does): a few newcomers a sample still come in.
        idle = self.fraction < share / 2 and recent < recent_span * share / 2
        return IDLE_ROOM if idle and paced < IDLE_ROOM else paced
