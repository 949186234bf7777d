"""Departure and shutdown: owned operations that drain turns, release, then clean up.

Both run in a task of their own (`OwnedOperation`) so no caller's cancellation can
abandon them half done, and every concurrent caller joins the same operation.
Release failures stay tracked per participant for a retry.
"""

from __future__ import annotations

import contextlib
import logging

import anyio

from ._config import RouterConfig
from ._frontend import ParticipantSnapshot
from ._lifecycle import OwnedOperation, TurnRun
from ._observer import Failure, FocusChanged, ReleaseFinished, ReleaseReason, ReleaseStarted
from ._participants import Participant, Phase, Registry, RouterPhase
from ._patch_desk import PatchDesk
from ._turn import bounded_release

__all__ = ["Departures"]

logger = logging.getLogger("turnrouter")

#: How long a cancelled turn may take to end before the router names it in a warning:
#: `interrupt()`, departures and `stop()` wait for it (and a front end's barge-in with
#: them), so a destination that does not end on cancellation must be findable.
SLOW_CANCEL_SECS = 1.0


class Departures:
    """Runs participants' departures and the router's shutdown."""

    __slots__ = ("_cfg", "_patches", "_registry")

    def __init__(self, cfg: RouterConfig, registry: Registry, patches: PatchDesk) -> None:
        self._cfg, self._registry, self._patches = cfg, registry, patches

    def close(self, pid: str) -> None:
        """With a participant-joined topic, a departure closes admission until it fires."""
        if self._cfg.joined_topic:
            self._registry.close_departed(pid)

    def start(self, pid: str) -> OwnedOperation | None:
        """Close admission at once and start (or return) the participant's departure.

        Synchronous, so a turn issued right after it is refused, and a participant-joined
        event that follows it is applied after it, not before.
        """
        self.close(pid)
        state = self._registry.get(pid)
        if state is None:
            return None
        if state.departure is None or state.departure.done:
            state.phase = Phase.DEPARTING
            state.departure = OwnedOperation(self._depart(state))
        return state.departure

    async def leave(self, pid: str) -> None:
        """`participant_left()`: wait for a running shutdown, then depart."""
        stopping = self._registry.stopping
        if self._registry.phase is RouterPhase.STOPPING and stopping is not None:
            try:
                await stopping.join()
            except Exception:
                logger.debug("shutdown failed while %s left", pid, exc_info=True)
        departure = self.start(pid)
        if departure is not None:
            await departure.join()

    async def stop(self) -> None:
        registry = self._registry
        operation = registry.stopping
        if operation is None or operation.done:
            registry.phase = RouterPhase.STOPPING  # admission closes now, not when it runs
            operation = registry.stopping = OwnedOperation(self._shutdown())
        await operation.join()

    async def hand_over(self, pid: str) -> ParticipantSnapshot | None:
        """Drain the participant's turns, snapshot and drop it without any release."""
        registry = self._registry
        state = registry.get(pid)
        if state is not None and state.departure is not None and not state.departure.done:
            with contextlib.suppress(Exception):  # reported to the departure's joiners
                await state.departure.join()
            state = registry.get(pid)
        if state is None:
            return registry.export(pid)
        while state.queue.runs():
            await self.drain(state, "handed over to another replica")
        if state.unheard is not None:
            state.unheard.spoken_over()
        snapshot = registry.snapshot(state, pid in registry.departed)
        if registry.get(pid) is state:
            self._patches.drop(state, outcome=None)
            registry.forget(state)
            registry.departed.pop(pid, None)
        return snapshot

    async def wait_idle(self) -> None:
        """Wait, cancelling nothing, until no participant has a turn running or queued."""
        while True:
            runs = [run for state in self._registry.participants.values()
                    for run in state.queue.runs()]
            if not runs:
                return
            for run in runs:
                await run.wait_finished()

    async def interrupt(self, pid: str | None) -> None:
        """Cancel `pid`'s running and waiting turns (everyone's when None); wait until
        they ended."""
        registry = self._registry
        if pid is None:
            states = list(registry.participants.values())
        else:
            state = registry.get(pid)
            states = [] if state is None else [state]
        for state in states:  # an answer not heard yet will not be: a lower bound
            if state.unheard is not None:
                state.unheard.resolve_unheard(self._cfg.clock())
        runs = [run for state in states for run in state.queue.runs()]
        for run in runs:
            run.cancel("interrupted")
        await self._ended(runs)

    async def drain(self, state: Participant, reason: str) -> None:
        """Cancel the participant's running and waiting turns; wait until they ended."""
        runs = state.queue.runs()
        for run in runs:
            run.cancel(reason)
        await self._ended(runs)

    async def _ended(self, runs: list[TurnRun]) -> None:
        """Wait until the cancelled `runs` ended, warning (once each) of one still
        running `SLOW_CANCEL_SECS` after: its destination holds up whoever waits."""
        for run in runs:
            if run.finished:
                continue
            async with anyio.create_task_group() as group:
                group.start_soon(self._warn_slow, run)
                await run.wait_finished()
                group.cancel_scope.cancel()

    async def _warn_slow(self, run: TurnRun) -> None:
        timer = self._cfg.timer
        await timer.sleep_until(timer.now() + SLOW_CANCEL_SECS)
        route = getattr(run, "route", None)
        logger.warning(
            "turnrouter: a turn still runs %g s after it was cancelled (%s)%s: its "
            "interrupt, departure or stop() waits until it ends; a destination should "
            "end promptly on CancelledError (not swallow it, nor clean up for long)",
            SLOW_CANCEL_SECS, run.reason or "cancelled",
            f", in destination {route!r}" if route else "")

    async def _release_all(self, state: Participant, reason: ReleaseReason) -> list[Exception]:
        """Departure-style release of every used destination, then application cleanup."""
        cfg, observer = self._cfg, self._cfg.observer
        pid = state.pid
        if state.unheard is not None:
            state.unheard.spoken_over()
        if state.focus is not None:  # it ends here: "focus held" must come down (voice22 F3)
            observer.focus_transition(FocusChanged(state.focus, "lost"))
            state.focus = None
        if state.unreleased is None:
            state.unreleased = set(state.used)
            state.cleanup_pending = cfg.cleanup is not None and (
                state.cleanup_pending or state.initialized or bool(state.used)
            )
        errors: list[Exception] = []
        for route in [name for name in cfg.routes if name in state.unreleased]:
            agent = cfg.agents[route]
            token = observer.release_started(ReleaseStarted(route, reason, pid))
            try:
                hook = getattr(agent, "participant_left", None)
                await bounded_release(cfg, hook if callable(hook) else agent.release, pid)
            except Exception as exc:
                observer.release_finished(token, ReleaseFinished(route, reason, exc))
                errors.append(exc)
                continue
            observer.release_finished(token, ReleaseFinished(route, reason, None))
            state.unreleased.discard(route)
        if state.cleanup_pending:  # idempotent: runs once turns drained, whatever releases did
            assert cfg.cleanup is not None
            try:
                await cfg.cleanup(pid)
            except Exception as exc:
                observer.failure(Failure(None, "cleanup", exc))
                errors.append(exc)
            else:
                state.cleanup_pending = False
        return errors

    async def _depart(self, state: Participant) -> None:
        state.phase = Phase.DEPARTING
        self._patches.drop(state)
        await self.drain(state, "ended by the participant's departure")
        errors = await self._release_all(state, "departure")
        if errors:
            state.phase = Phase.FAILED
            raise ExceptionGroup(
                f"participant {state.pid!r} departure: {len(errors)} cleanup failure(s); "
                "call participant_left() again to retry",
                errors,
            )
        self._registry.forget(state)

    async def _shutdown(self) -> None:
        registry = self._registry
        try:
            await self._shut_down()
        except BaseException:
            registry.phase = RouterPhase.STOP_FAILED
            raise
        else:
            registry.phase = RouterPhase.RUNNING
        finally:
            registry.stopping = None  # joiners keep their own handle
            await self._cfg.load.stop()  # the load sampler ends with the router

    async def _shut_down(self) -> None:
        registry = self._registry
        for state in list(registry.participants.values()):
            self._patches.drop(state)
        for state in list(registry.participants.values()):
            if state.departure is not None and not state.departure.done:
                with contextlib.suppress(Exception):  # reported to its own joiners
                    await state.departure.join()
        states = list(registry.participants.values())
        for state in states:
            for run in state.queue.runs():
                run.cancel("ended by stop()")
        for state in states:
            await self.drain(state, "ended by stop()")
        errors: list[Exception] = []
        for state in states:
            state.phase = Phase.DEPARTING
            failures = await self._release_all(state, "shutdown")
            if failures:
                state.phase = Phase.FAILED
                errors.extend(failures)
            else:
                registry.forget(state)
        if errors:
            raise ExceptionGroup(
                f"stop(): {len(errors)} cleanup failure(s); call stop() again to retry", errors
            )
        registry.departed.clear()  # a fresh lifecycle for everyone
        flush = getattr(self._cfg.timing_sink, "flush", None)
        if callable(flush):  # a restarted router must find every sample on disk
            flush()
