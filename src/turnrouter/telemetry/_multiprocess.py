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

Building a `Telemetry` in this mode checks the directory first (`prepare`): one that
prometheus_client could not write is a `ConfigurationError` naming the variable, and
files already named by this process's pid that it could not open or a scrape could not
read (a pid reused after a crash, junk: `struct.error` from prometheus_client) are moved
aside before it opens them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import stat
import struct
import threading
from collections.abc import Iterable, Mapping
from multiprocessing import util as mp_util
from types import MappingProxyType
from typing import Literal

import prometheus_client.values
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

from .._exceptions import ConfigurationError
from ._metrics import MetricSpec

__all__ = [
    "GAUGE_MODES", "MULTIPROCESS_GAUGE_MODES", "VARIABLE", "Mirrors", "directory",
    "is_multiprocess", "mirrors", "prepare", "readable",
]

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
#: The process (pid) whose directory was prepared (`prepare`), if any.
_PREPARED: list[int] = []

#: The variable prometheus_client reads (and its deprecated lower-case spelling).
VARIABLE = "PROMETHEUS_MULTIPROC_DIR"
_LEGACY_VARIABLE = "prometheus_multiproc_dir"

logger = logging.getLogger("turnrouter")


def mirrors() -> Mirrors:
    """This process's mirrors, made on first use (a forked child makes its own)."""
    pid = os.getpid()
    with _LOCK:
        made = _MIRRORS.get(pid)
        if made is None:
            _MIRRORS.clear()  # a forked child: the parent's are not this process's
            made = _MIRRORS[pid] = Mirrors()
    return made


def directory() -> tuple[str, list[str]]:
    """The multiprocess directory, as prometheus_client finds it, and the names in it;
    `ConfigurationError` naming the variable and the path when prometheus_client could
    not write there (raw `TypeError`, `FileNotFoundError`, `NotADirectoryError` from its
    files otherwise)."""
    path = os.environ.get(VARIABLE) or os.environ.get(_LEGACY_VARIABLE)
    if not path:
        raise ConfigurationError(
            f"{VARIABLE} is not set, but it was when prometheus_client was imported "
            "(so it writes every process's metrics to files there): set it again, or "
            "import prometheus_client without it")
    try:
        listing = os.listdir(path)
    except OSError as exc:  # missing, a file, unreadable
        raise ConfigurationError(
            f"{VARIABLE}={path[:200]!r}: {exc.strerror or exc}: prometheus_client's "
            "multiprocess mode needs an existing directory there") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigurationError(
            f"{VARIABLE}={path[:200]!r}: not writable: prometheus_client's multiprocess "
            "mode writes this process's metrics there")
    return path, listing


def prepare() -> None:
    """Check the multiprocess directory (`directory`) and, the first time in this
    process, make it ready for this process's files: files named by this process's pid
    that prometheus_client could not read (a reused pid after a crash, junk) are moved
    aside (`.unreadable`) before it opens them, the live gauges of processes that no
    longer run are dropped (those killed before their exit hook), and this process's own
    are arranged to be dropped when it exits. One listing of the directory."""
    path, names = directory()
    pid = os.getpid()
    with _LOCK:
        if [pid] == _PREPARED:
            return
        moved = _sweep(path, names, pid)
        _PREPARED[:] = [pid]
        # Run at a multiprocessing child's exit (spawn and forkserver alike: forkserver
        # children skip atexit) and at the main process's.
        mp_util.Finalize(None, _at_exit, args=(pid, path), exitpriority=0)
    if moved:
        logger.warning(
            "turnrouter: %d file(s) of this process's pid (%d) in %s=%s held no values "
            "prometheus_client could read (a pid reused after a crash, or junk): moved "
            "aside as %s", len(moved), pid, VARIABLE, path,
            ", ".join(f"{name}.unreadable" for name in moved[:5]))


def _at_exit(pid: int, path: str) -> None:
    if os.getpid() == pid:
        mark_process_dead(pid, path)  # type: ignore[no-untyped-call]


#: The names prometheus_client gives its files: `{counter,histogram,summary}_{pid}.db`
#: and `gauge_{mode}_{pid}.db` (a pid in ASCII digits, written as `str(pid)` writes it).
_FILE = re.compile(r"(counter|histogram|summary|gauge_[a-z]+)_([1-9][0-9]{0,8})\.db")
#: The live gauge files of a process, which `mark_process_dead` removes.
_LIVE = frozenset(f"gauge_{mode}" for mode in Gauge._MULTIPROC_MODES if mode.startswith("live"))


def _sweep(path: str, names: list[str], pid: int) -> list[str]:
    """One pass over the directory: this process's files that do not parse moved aside
    (their names returned), and the live gauge files of processes that no longer run
    removed (what `mark_process_dead` does, without its glob of the directory per pid:
    10,000 dead pids' files took 0.5 s)."""
    moved: list[str] = []
    running: dict[int, bool] = {}
    for name in names:
        match = _FILE.fullmatch(name)
        if match is None:  # (a stray file's name must not stop the router)
            continue
        owner = int(match.group(2))
        if owner == pid:
            if not readable(os.path.join(path, name)):
                _move_aside(path, name)
                moved.append(name)
            continue
        if match.group(1) not in _LIVE:
            continue
        alive = running.get(owner)
        if alive is None:
            alive = running[owner] = _running(owner)
        if not alive:
            with contextlib.suppress(OSError):  # (a directory so named is left)
                os.remove(os.path.join(path, name))
    return moved


def _move_aside(path: str, name: str) -> None:
    full = os.path.join(path, name)
    try:
        os.replace(full, f"{full}.unreadable")
    except OSError:
        try:
            os.remove(full)
        except OSError as exc:
            raise ConfigurationError(
                f"{VARIABLE}={path[:200]!r}: {name!r} is named by this process's pid but "
                "holds nothing prometheus_client can read, and it cannot be moved aside "
                f"({exc.strerror or exc}): remove it") from exc


def readable(path: str) -> bool:
    """Whether prometheus_client can open `path` as one of its files and a
    `MultiProcessCollector` read it: a regular file (not a link, a pipe, a directory),
    empty or with a used length and entries (a length-prefixed JSON key of four fields,
    two doubles) inside it, as `prometheus_client.mmap_dict` lays them out."""
    try:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode):
            return False
        if info.st_size == 0:
            return True  # (prometheus_client sizes it)
        with open(path, "rb") as file:
            head = file.read(8)
            if len(head) < 8:
                return False
            used = _INT.unpack_from(head)[0]
            if used == 0:
                return True  # (never written: prometheus_client starts it)
            if not 8 <= used <= info.st_size:
                return False
            data = head + file.read(used - 8)
    except OSError:
        return False
    return len(data) == used and _entries_parse(data, used) and _collects(path)


class _Merged:
    """What `MultiProcessCollector` makes of some files, as a registry to expose."""

    def __init__(self, metrics: Iterable[Metric]) -> None:
        self.metrics = list(metrics)

    def collect(self) -> Iterable[Metric]:
        return self.metrics


def _collects(path: str) -> bool:
    """Whether a scrape over `path` alone succeeds (`MultiProcessCollector`'s merge and
    both expositions): a layout that parses can still hold keys the scrape refuses."""
    try:
        merged = _Merged(MultiProcessCollector.merge([path]))  # type: ignore[no-untyped-call]
        generate_latest(merged)
        openmetrics_latest(merged)  # type: ignore[no-untyped-call]
    except Exception:  # whatever prometheus_client raises on junk (struct, json, ...)
        return False
    return True


_INT = struct.Struct("i")
_DOUBLES = struct.Struct("dd")


def _entries_parse(data: bytes, used: int) -> bool:
    pos = 8
    while pos < used:
        if pos + 4 > used:
            return False
        length = _INT.unpack_from(data, pos)[0]
        if length < 0:
            return False
        pos += 4
        key = data[pos:pos + length]
        pos += length + (8 - (length + 4) % 8)
        if pos + _DOUBLES.size > used:
            return False
        try:
            fields = json.loads(key.decode("utf-8"))
        except ValueError:  # (UnicodeDecodeError and JSONDecodeError alike)
            return False
        if not _key_fields(fields):
            return False
        pos += _DOUBLES.size
    return True


def _key_fields(fields: object) -> bool:
    """A key as prometheus_client writes it: [metric name, sample name, labels, help]."""
    if not isinstance(fields, list) or len(fields) != 4:
        return False
    metric_name, name, labels, help_text = fields
    return (isinstance(metric_name, str) and isinstance(name, str)
            and isinstance(help_text, str) and isinstance(labels, dict)
            and all(isinstance(value, str) for value in labels.values()))


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError, ValueError):  # another user's (EPERM), or odd: kept
        return True
    return True
