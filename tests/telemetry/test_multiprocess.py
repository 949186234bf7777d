"""Routers in job processes (LiveKit's model) export through prometheus_client's
multiprocess mode: real spawned processes, each with a real `AgentRouter` and
`Telemetry()`, and a `MultiProcessCollector` over their files, as a LiveKit worker's
`/metrics` reads them with `WorkerOptions(prometheus_multiproc_dir=...)`."""

from __future__ import annotations

import json
import multiprocessing
import struct
from collections.abc import Iterator
from multiprocessing.context import SpawnProcess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.openmetrics.exposition import generate_latest

from turnrouter.telemetry import METRICS, MULTIPROCESS_GAUGE_MODES

from .multiprocess_jobs import (
    BOUND_SECS,
    KINDS,
    Job,
    Ready,
    forks,
    run,
    telemetry_error,
)

CONTEXT = multiprocessing.get_context("spawn")  # as LiveKit starts job processes


class Jobs:
    """Job processes writing to one multiprocess directory, and the scrape over it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._running: list[tuple[SpawnProcess, object]] = []

    def start(self, job: Job) -> tuple[SpawnProcess, object, Ready]:
        """Start `job`; return once its turns are answered or running."""
        ready, release = CONTEXT.Event(), CONTEXT.Event()
        results: multiprocessing.Queue[Ready] = CONTEXT.Queue()
        process = CONTEXT.Process(target=run, args=(job, ready, release, results))
        process.start()
        self._running.append((process, release))
        assert ready.wait(BOUND_SECS), "the job did not get ready"
        return process, release, results.get(timeout=BOUND_SECS)

    @staticmethod
    def finish(process: SpawnProcess, release: object) -> None:
        """Release a job and wait for its process to exit."""
        release.set()  # type: ignore[attr-defined]
        process.join(BOUND_SECS)
        assert process.exitcode == 0

    def registry(self) -> CollectorRegistry:
        """What a LiveKit worker's `/metrics` would serve now."""
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(self.path))  # type: ignore[no-untyped-call]
        return registry

    def value(self, name: str, **labels: str) -> float | None:
        return self.registry().get_sample_value(name, labels)

    def close(self) -> None:
        for process, release in self._running:
            if process.exitcode is not None:
                # Not set for a killed job: notifying its dead waiter would block.
                continue
            release.set()  # type: ignore[attr-defined]
            process.join(BOUND_SECS)
            if process.is_alive():
                process.kill()
                process.join(BOUND_SECS)


@pytest.fixture
def jobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Jobs]:
    """Job processes started with PROMETHEUS_MULTIPROC_DIR set (as LiveKit sets it)."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    made = Jobs(tmp_path)
    yield made
    made.close()


def test_every_gauge_has_a_multiprocess_mode() -> None:
    """A gauge added to METRICS must say how job processes' values add up."""
    gauges = {spec.name for spec in METRICS if spec.type == "gauge"}
    assert set(MULTIPROCESS_GAUGE_MODES) == gauges


def test_counters_and_histograms_of_job_processes_add_up(jobs: Jobs) -> None:
    """Two jobs' turns (3 and 5) are 8 turns at the worker's endpoint, with one series per
    label set (no pid label), and exemplars are dropped there without failing."""
    for turns in (3, 5):
        process, release, ready = jobs.start(Job(turns=turns, traced=True))
        assert ready.exemplars > 0  # the job's own registry keeps them
        jobs.finish(process, release)
    route = {"route": "conversation"}
    assert jobs.value("turnrouter_turns_total", outcome="answer", **route) == 8
    assert jobs.value("turnrouter_turn_duration_seconds_count", outcome="answer",
                      **route) == 8
    assert jobs.value("turnrouter_turn_duration_seconds_bucket", outcome="answer",
                      le="+Inf", **route) == 8
    assert jobs.value("turnrouter_admissions_total", disposition="accept", focused="false",
                      **route) == 8
    assert jobs.value("turnrouter_first_response_seconds_count", **route) == 8
    assert jobs.value("turnrouter_decision_duration_seconds_count") == 8
    registry = jobs.registry()
    names = {sample.name for family in registry.collect() for sample in family.samples
             if "pid" in sample.labels and sample.name.startswith("turnrouter_")}
    assert names == set()
    assert b"trace_id" not in generate_latest(registry)  # type: ignore[no-untyped-call]


def test_live_gauges_count_running_jobs_only(jobs: Jobs) -> None:
    """Participants and turns in flight add up over running jobs; a job that exits
    without stopping its router, or is killed, stops counting."""
    first, first_release, _ = jobs.start(Job(turns=2, held=1, stop=False))
    second, _, _ = jobs.start(Job(held=2))
    assert jobs.value("turnrouter_turns_in_flight") == 3
    assert jobs.value("turnrouter_active_participants") == 5  # p0, p1, h0 + h0, h1
    assert jobs.value("turnrouter_window_participants") == 5

    jobs.finish(first, first_release)  # exits with its participants still held
    assert jobs.value("turnrouter_active_participants") == 2
    assert jobs.value("turnrouter_turns_in_flight") == 2

    second.kill()  # no exit hook runs: the next job's Telemetry drops its gauges
    second.join(BOUND_SECS)
    assert jobs.value("turnrouter_active_participants") == 2
    jobs.start(Job(turns=1))
    assert jobs.value("turnrouter_active_participants") == 1
    assert jobs.value("turnrouter_turns_in_flight") == 0
    assert jobs.value("turnrouter_turns_total", route="conversation", outcome="answer") == 3


def test_configured_values_are_the_latest_jobs(jobs: Jobs) -> None:
    """The acknowledgment delay is the one the latest job configured, not a sum or one
    series per process, and it outlives that job."""
    for delay in (0.4, 0.6):
        process, release, _ = jobs.start(Job(turns=1, ack_delay=delay))
        jobs.finish(process, release)
    assert jobs.value("turnrouter_acknowledgment_delay_seconds") == 0.6
    assert jobs.value("turnrouter_acknowledgment_route_delay_seconds",
                      route="conversation") == 0.6


@pytest.mark.parametrize("stray", ["99999999999999999999", "\u00b2\u00b3", "12ab"])
def test_a_stray_file_in_the_directory_does_not_stop_a_job(jobs: Jobs, stray: str) -> None:
    """A file named like a live gauge's with a pid no process can have (too big, not
    ASCII digits) is left alone: the job's router is built and counts (review20 F3:
    it raised OverflowError or ValueError in every job's `Telemetry()`)."""
    odd = jobs.path / f"gauge_livesum_{stray}.db"
    odd.write_bytes(b"")
    process, release, _ = jobs.start(Job(turns=1))
    jobs.finish(process, release)  # (exit code 0: its router was built and stopped)
    assert odd.exists()
    odd.unlink()  # (an empty file is prometheus_client's scrape's problem, not ours)
    assert jobs.value("turnrouter_turns_total", route="conversation", outcome="answer") == 1


# (redteam21 F7) The files themselves: junk under the job's own pid, dead jobs' files,
# a directory that is not one.

def test_junk_files_of_the_jobs_own_pid_do_not_stop_it(jobs: Jobs) -> None:
    """Files under the job's pid that prometheus_client cannot read (a crashed process
    whose pid the job got, junk) are moved aside before it opens them: the job builds its
    router and counts, and the scrape reads the directory (Telemetry() raised
    `struct.error` before)."""
    junk = b"\xff\xff\xff\x7f" + bytes(range(60))  # a used length of 2 GiB
    process, release, ready = jobs.start(Job(turns=2, junk=junk))
    jobs.finish(process, release)
    assert jobs.value("turnrouter_turns_total", route="conversation", outcome="answer") == 2
    aside = sorted(path.name for path in jobs.path.glob("*.unreadable"))
    assert aside == sorted(f"{kind}_{ready.pid}.db.unreadable" for kind in KINDS)
    assert {path.read_bytes() for path in jobs.path.glob("*.unreadable")} == {junk}


def test_dead_jobs_live_gauges_go_and_their_counts_stay(jobs: Jobs) -> None:
    """The next job's Telemetry() removes the live gauge files of every process that no
    longer runs (one pass over the directory, however many there are) and keeps their
    counters and `mostrecent` gauges; other processes' files, junk included, are not its
    to touch."""
    dead = range(999_000_000, 999_000_300)  # above any pid_max: no such process
    for pid in dead:
        for mode in ("livesum", "livemax", "liveall"):
            (jobs.path / f"gauge_{mode}_{pid}.db").write_bytes(b"")
    kept = {f"counter_{dead[0]}.db": b"", f"gauge_mostrecent_{dead[0]}.db": b"",
            "gauge_livesum_0999000001.db": b"", f"histogram_{dead[1]}.db": b"junk"}
    for name, content in kept.items():
        (jobs.path / name).write_bytes(content)
    process, release, _ = jobs.start(Job(turns=1))
    live = {path.name for path in jobs.path.glob("gauge_live*_*99900*.db")}
    assert live == {"gauge_livesum_0999000001.db"}
    assert all((jobs.path / name).read_bytes() == content for name, content in kept.items())
    jobs.finish(process, release)


@pytest.mark.parametrize(("where", "unset", "message", "cause"), [
    ("missing", False, "No such file or directory", "FileNotFoundError"),
    ("file", False, "Not a directory", "NotADirectoryError"),
    ("folder", True, "PROMETHEUS_MULTIPROC_DIR is not set", "NoneType"),
])
def test_a_directory_prometheus_client_cannot_use_is_a_configuration_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, unset: bool,
        message: str, cause: str) -> None:
    """A missing directory, a file given as the directory, or the variable removed after
    prometheus_client was imported with it: `ConfigurationError` naming the variable and
    the path, from the original error (raw FileNotFoundError, NotADirectoryError and
    TypeError from Telemetry() before)."""
    path = tmp_path / where
    if where == "file":
        path.write_bytes(b"")
    elif where == "folder":
        path.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(path))
    results: multiprocessing.Queue[tuple[str, str, str] | None] = CONTEXT.Queue()
    process = CONTEXT.Process(target=telemetry_error, args=(results, unset))
    process.start()
    raised = results.get(timeout=BOUND_SECS)
    process.join(BOUND_SECS)
    assert raised is not None
    kind, text, original = raised
    assert kind == "ConfigurationError" and "PROMETHEUS_MULTIPROC_DIR" in text
    assert message in text and original == cause
    assert unset or repr(str(path)) in text


class Forks:
    """Jobs forked, one per request, from one spawned process in multiprocess mode."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.requests: multiprocessing.Queue[tuple[str, bytes] | None] = CONTEXT.Queue()
        self.results: multiprocessing.Queue[int] = CONTEXT.Queue()
        self.process = CONTEXT.Process(target=forks, args=(self.requests, self.results))
        self.process.start()

    def job(self, shape: str, content: bytes = b"") -> int:
        """A job's exit status: the warnings it logged, or `FAILED`."""
        self.requests.put((shape, content))
        return self.results.get(timeout=BOUND_SECS)

    def close(self) -> None:
        self.requests.put(None)
        self.process.join(BOUND_SECS)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(BOUND_SECS)


@pytest.fixture
def forked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Forks]:
    folder = tmp_path / "metrics"  # (a symlink's target goes beside it)
    folder.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(folder))
    made = Forks(folder)
    yield made
    made.close()


def _scraped_turns(path: Path) -> float | None:
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(path))  # type: ignore[no-untyped-call]
    generate_latest(registry)  # type: ignore[no-untyped-call]
    return registry.get_sample_value("turnrouter_turns_total",
                                     {"route": "conversation", "outcome": "answer"})


@pytest.mark.parametrize("shape", ["fifo", "directory", "symlink"])
def test_no_file_under_the_jobs_pid_is_opened_unless_it_is_one(forked: Forks,
                                                                shape: str) -> None:
    """A pipe (prometheus_client's open would block for ever), a directory, or a link
    (its target, outside the directory, would be written) under the job's pid: moved
    aside, one warning, the target untouched."""
    assert forked.job(shape, b"target") == 1
    assert _scraped_turns(forked.path) == 1
    assert len(list(forked.path.glob("*.unreadable"))) == len(KINDS)
    targets = list(forked.path.parent.glob("target-*"))
    assert {path.read_bytes() for path in targets} == ({b"target"} if targets else set())


def _entry(key: bytes, value: float = 1.0) -> bytes:
    padded = key + b" " * (8 - (len(key) + 4) % 8)
    return struct.pack(f"i{len(padded)}sdd", len(key), padded, value, 0.0)


def _layout(used: int | None, entries: list[bytes]) -> bytes:
    body = b"".join(entries)
    return struct.pack("ii", 8 + len(body) if used is None else used, 0) + body


_KEYS = st.one_of(
    st.binary(max_size=40),
    st.text(max_size=20).map(str.encode),
    st.builds(lambda *fields: json.dumps(list(fields)).encode(),
              st.one_of(st.just("turnrouter_x"), st.text(max_size=8)),
              st.one_of(st.just("turnrouter_x_bucket"), st.text(max_size=8)),
              st.one_of(st.dictionaries(st.sampled_from(["le", "route", ""]),
                                        st.text(max_size=6), max_size=2),
                        st.lists(st.integers(), max_size=2), st.none()),
              st.one_of(st.text(max_size=8), st.integers())))
_CONTENTS = st.one_of(
    st.binary(max_size=200),
    st.builds(_layout, st.one_of(st.none(), st.integers(-(2**31), 2**31 - 1)),
              st.lists(st.builds(_entry, _KEYS, st.floats()), max_size=3)),
)


def test_any_content_under_the_jobs_pid_leaves_the_job_and_the_scrape_working(
        forked: Forks) -> None:
    """Whatever a file under the job's pid holds, the job builds its router and counts
    its turn, and a scrape of the directory succeeds: a file prometheus_client or the
    scrape could not read is moved aside (one warning), one they can is kept."""

    @settings(max_examples=60, deadline=None)
    @given(_CONTENTS)
    def check(content: bytes) -> None:
        status = forked.job("file", content)
        assert status in (0, 1), status  # (FAILED: the router was not built)
        assert _scraped_turns(forked.path) == 1
        for path in forked.path.iterdir():  # (the job has exited: the next starts afresh)
            path.unlink()

    check()
