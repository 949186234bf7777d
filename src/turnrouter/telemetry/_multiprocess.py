"""prometheus_client's multiprocess mode (`PROMETHEUS_MULTIPROC_DIR`), as LiveKit uses it.

A LiveKit worker runs each job (and its router) in a process of its own and serves, with
`WorkerOptions(prometheus_multiproc_dir=...)`, what prometheus_client's
`MultiProcessCollector` reads from the files every process writes in that directory.
Only prometheus_client's own metric values write those files: turnrouter's counters and
histograms (plain numbers read at scrape time, see `_families`) would never reach them.

So, when prometheus_client is in multiprocess mode in this process (the variable was set
when it was imported), every counter and histogram child also writes through to a
process-wide prometheus_client `Counter` / `Histogram` registered nowhere (the files are
the export), gauges get a `multiprocess_mode` (`GAUGE_MODES`), and this process's live
gauges are dropped when it exits (`mark_process_dead`, which LiveKit does not call), or,
when it could not run that (killed), by the next process that builds a `Telemetry`.
Exemplars are not written: prometheus_client's multiprocess files have no place for them.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import threading
from collections.abc import Mapping
from multiprocessing import util as mp_util
from types import MappingProxyType
from typing import Literal

import prometheus_client.values
from prometheus_client import Counter, Histogram
from prometheus_client.multiprocess import mark_process_dead

from ._metrics import MetricSpec

__all__ = ["GAUGE_MODES", "MULTIPROCESS_GAUGE_MODES", "Mirrors", "is_multiprocess", "mirrors"]

GaugeMode = Literal["livesum", "livemax", "mostrecent"]

#: How the processes' values of each gauge add up in multiprocess mode. `live*` modes
#: count live processes only (an exited job's participants and turns are not in flight);
#: `mostrecent` keeps the value set last by any process, an exited one's included (a
#: configured delay or an estimate outlives the job that published it).
GAUGE_MODES: dict[str, GaugeMode] = {
    "turnrouter_acknowledgment_delay_seconds": "mostrecent",
    "turnrouter_acknowledgment_route_delay_seconds": "mostrecent",
    "turnrouter_predicted_first_response_seconds": "mostrecent",
    "turnrouter_active_participants": "livesum",
    "turnrouter_turns_in_flight": "livesum",
    "turnrouter_turn_wait_seconds": "livemax",
    "turnrouter_overload_state": "livemax",
    "turnrouter_window_participants": "livesum",
    "turnrouter_window_clarified_participants": "livesum",
}


#: The public, read-only name of `GAUGE_MODES`.
MULTIPROCESS_GAUGE_MODES: Mapping[str, GaugeMode] = MappingProxyType(GAUGE_MODES)


def is_multiprocess() -> bool:
    """Whether prometheus_client writes this process's values to multiprocess files (it
    chose its value class when imported, from `PROMETHEUS_MULTIPROC_DIR`)."""
    value_class = prometheus_client.values.ValueClass
    flag = getattr(value_class, "_multiprocess", None)
    if flag is None:  # a prometheus_client without the flag: the in-process class is plain
        return value_class is not prometheus_client.values.MutexValue
    return bool(flag)


class Mirrors:
    """This process's prometheus_client counters and histograms, one per family, that
    turnrouter's children write through to (registered on no registry)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._families: dict[str, Counter | Histogram] = {}

    def counter(self, spec: MetricSpec) -> Counter:
        """The process-wide counter of `spec`."""
        with self._lock:
            family = self._families.get(spec.name)
            if family is None:
                family = self._families[spec.name] = Counter(
                    spec.name, spec.documentation, spec.labels, registry=None)
        assert isinstance(family, Counter)
        return family

    def histogram(self, spec: MetricSpec) -> Histogram:
        """The process-wide histogram of `spec`."""
        with self._lock:
            family = self._families.get(spec.name)
            if family is None:
                assert spec.buckets is not None
                family = self._families[spec.name] = Histogram(
                    spec.name, spec.documentation, spec.labels, buckets=spec.buckets,
                    registry=None)
        assert isinstance(family, Histogram)
        return family


_LOCK = threading.Lock()
_MIRRORS: dict[int, Mirrors] = {}


def mirrors() -> Mirrors:
    """This process's mirrors, made on first use; the first use also drops the live
    gauges of processes that died without doing it, and arranges for this process's to
    be dropped when it exits."""
    pid = os.getpid()
    with _LOCK:
        made = _MIRRORS.get(pid)
        if made is None:
            _MIRRORS.clear()  # a forked child: the parent's are not this process's
            made = _MIRRORS[pid] = Mirrors()
            path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
            if path:
                # Run at a multiprocessing child's exit (spawn and forkserver alike:
                # forkserver children skip atexit) and at the main process's.
                mp_util.Finalize(None, _at_exit, args=(pid, path), exitpriority=0)
                _sweep(path)
    return made


def _at_exit(pid: int, path: str) -> None:
    if os.getpid() == pid:
        mark_process_dead(pid, path)  # type: ignore[no-untyped-call]


def _sweep(path: str) -> None:
    """`mark_process_dead` for every process with live gauge files that no longer runs."""
    for name in glob.glob(os.path.join(path, "gauge_live*_*.db")):
        pid = os.path.basename(name)[:-3].rsplit("_", 1)[-1]
        # (ASCII digits of a pid only: a stray file's name must not stop the router)
        if _PID.fullmatch(pid) and not _running(int(pid)):
            with contextlib.suppress(OSError):
                mark_process_dead(int(pid), path)  # type: ignore[no-untyped-call]


_PID = re.compile(r"[0-9]{1,9}")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError, ValueError):  # another user's (EPERM), or odd: kept
        return True
    return True
