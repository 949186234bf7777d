"""Routers in job processes (LiveKit's model) export through prometheus_client's
multiprocess mode: real spawned processes, each with a real `AgentRouter` and
`Telemetry()`, and a `MultiProcessCollector` over their files, as a LiveKit worker's
`/metrics` reads them with `WorkerOptions(prometheus_multiproc_dir=...)`."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from multiprocessing.context import SpawnProcess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.openmetrics.exposition import generate_latest

from turnrouter.telemetry import METRICS, MULTIPROCESS_GAUGE_MODES

from .multiprocess_jobs import BOUND_SECS, Job, Ready, run

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
