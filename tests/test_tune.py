"""`turnrouter tune`: what-if table, recommendation and plot from samples or Prometheus."""

from __future__ import annotations

import io
import json
import math
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from turnrouter import JsonLinesSink, TimingSample
from turnrouter.cli._tune import BucketDistribution, SampleDistribution, tune_main


def _write(path: Path, samples: list[TimingSample]) -> Path:
    with JsonLinesSink(path) as sink:
        for sample in samples:
            sink.record(sample)
    return path


@pytest.fixture
def samples(tmp_path: Path) -> Path:
    """Route a: half at 0.1 s, half at 2.0 s; route b: all at 0.3 s."""
    return _write(tmp_path / "s.jsonl", [TimingSample("a", 0.1)] * 50
                  + [TimingSample("a", 2.0)] * 50 + [TimingSample("b", 0.3)] * 100)


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = tune_main(argv, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def _row(text: str, route: str, delay: str) -> list[str]:
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[0] == route and fields[1] == delay:
            return fields
    raise AssertionError(f"no row {route} {delay} in:\n{text}")


def test_table_lists_each_route_and_candidate_delay(samples: Path) -> None:
    """Each route gets ack rate and p50/p95 silence per telemetry bucket bound."""
    code, out, _ = run(["--samples", str(samples)])
    assert code == 0
    assert _row(out, "a", "1.00s")[3:6] == ["50.0%", "0.10s", "1.00s"]
    assert _row(out, "a", "0.05s")[3] == "100.0%"
    assert _row(out, "b", "1.00s")[3:6] == ["0.0%", "0.30s", "0.30s"]
    assert _row(out, "(all)", "1.00s")[3] == "25.0%"
    assert len([line for line in out.splitlines() if line.startswith("a ")]) == 14


def test_recommends_the_shortest_delay_within_an_ack_rate(samples: Path) -> None:
    """--max-ack-rate picks the shortest candidate whose overall rate fits."""
    code, out, _ = run(["--samples", str(samples), "--max-ack-rate", "0.3"])
    assert code == 0
    assert "recommended acknowledgment_delay_secs=0.3 " in out
    assert "  a: 2s" in out and "  b: 0.3s" in out


def test_recommends_the_longest_delay_within_a_silence_target(samples: Path) -> None:
    """--max-silence-p95 picks the longest candidate whose overall p95 silence fits."""
    code, out, _ = run(["--samples", str(samples), "--max-silence-p95", "0.6",
                        "--generation-secs", "0.1"])
    assert code == 0
    assert "recommended acknowledgment_delay_secs=0.5 " in out


def test_unmet_target_exits_1(samples: Path) -> None:
    """A target no candidate meets is reported with exit status 1."""
    code, out, _ = run(["--samples", str(samples), "--max-silence-p95", "0.01"])
    assert code == 1 and "no candidate delay meets" in out


def test_censored_samples_count_as_slow(tmp_path: Path) -> None:
    """Interrupted turns are lower bounds (Kaplan-Meier), not fast answers."""
    path = _write(tmp_path / "c.jsonl", [TimingSample("a", 0.2)] * 50
                  + [TimingSample("a", 0.5, censored=True)] * 50)
    code, out, _ = run(["--samples", str(path), "--delays", "0.4,1"])
    assert code == 0
    assert _row(out, "a", "1.00s")[3] == "50.0%"  # censored beyond 0.5 s: still silent at 1 s


def test_plot_without_matplotlib_still_prints_the_table(
    samples: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without matplotlib, --plot prints a clear message and the table, exit 0."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, out, err = run(["--samples", str(samples), "--plot", str(tmp_path / "p.png")])
    assert code == 0 and "matplotlib" in err and "turnrouter[plot]" in err
    assert "ack rate" in out and not (tmp_path / "p.png").exists()


def test_plot_is_written_with_matplotlib(samples: Path, tmp_path: Path) -> None:
    """With matplotlib installed, --plot writes a PNG."""
    pytest.importorskip("matplotlib")
    code, out, _ = run(["--samples", str(samples), "--max-ack-rate", "0.3",
                        "--plot", str(tmp_path / "p.png")])
    assert code == 0 and "plot written" in out
    assert (tmp_path / "p.png").read_bytes().startswith(b"\x89PNG")


def test_plot_drives_matplotlib(
    samples: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--plot draws ack rate and p95 silence per route and saves a PNG (stand-in module)."""
    import types
    from unittest import mock

    figure, top, bottom = mock.MagicMock(), mock.MagicMock(), mock.MagicMock()
    pyplot = types.ModuleType("matplotlib.pyplot")
    pyplot.subplots = mock.MagicMock(return_value=(figure, (top, bottom)))  # type: ignore[attr-defined]
    pyplot.close = mock.MagicMock()  # type: ignore[attr-defined]
    matplotlib = types.ModuleType("matplotlib")
    matplotlib.use = mock.MagicMock()  # type: ignore[attr-defined]
    matplotlib.pyplot = pyplot  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "matplotlib", matplotlib)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", pyplot)
    target = str(tmp_path / "p.png")
    code, out, _ = run(["--samples", str(samples), "--max-ack-rate", "0.3", "--plot", target])
    assert code == 0 and f"plot written to {target}" in out
    matplotlib.use.assert_called_once_with("Agg")
    assert top.plot.call_count == 3 and bottom.plot.call_count == 3  # a, b, (all)
    top.axhline.assert_called_once()
    figure.savefig.assert_called_once_with(target, format="png")


def test_bad_input_exits_2(tmp_path: Path) -> None:
    """A missing or invalid samples file is reported with exit status 2."""
    code, _, err = run(["--samples", str(tmp_path / "missing.jsonl")])
    assert code == 2 and "missing.jsonl" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    code, _, err = run(["--samples", str(bad)])
    assert code == 2 and "bad.jsonl:1" in err


def test_distributions() -> None:
    """Kaplan-Meier and bucket interpolation give the expected survival and quantiles."""
    km = SampleDistribution([(1.0, False), (2.0, False), (3.0, True), (4.0, False)])
    assert km.survival(0.5) == 1.0 and km.survival(1.0) == 0.75
    assert km.survival(3.5) == 0.5 and km.survival(4.0) == 0.0
    assert km.quantile(0.5) == 2.0
    buckets = BucketDistribution([(0.5, 10.0), (1.0, 30.0), (math.inf, 40.0)])
    assert buckets.survival(0.5) == 0.75
    assert buckets.survival(0.75) == pytest.approx(0.5)
    assert buckets.quantile(0.5) == pytest.approx(0.75)
    assert buckets.quantile(0.99) == 1.0


@pytest.fixture
def prometheus() -> Iterator[tuple[str, list[str]]]:
    """A local server answering /api/v1/query with a first-response bucket vector."""
    queries: list[str] = []
    series: list[dict[str, Any]] = []
    for route, counts in (("a", (0, 50, 50, 100)), ("b", (0, 100, 100, 100))):
        for le, count in zip(("0.1", "0.5", "1", "+Inf"), counts, strict=True):
            series.append({"metric": {"route": route, "le": le}, "value": [0, str(count)]})

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            from urllib.parse import parse_qs, urlsplit

            parts = urlsplit(self.path)
            queries.extend(parse_qs(parts.query).get("query", []))
            if parts.path != "/api/v1/query":
                self.send_response(404)
                self.end_headers()
                return
            body = json.dumps({"status": "success",
                               "data": {"resultType": "vector", "result": series}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return None

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", queries
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def test_reads_first_response_buckets_from_prometheus(
    prometheus: tuple[str, list[str]]
) -> None:
    """--prometheus queries the bucket increase by route and le through /api/v1/query."""
    url, queries = prometheus
    code, out, _ = run(["--prometheus", url, "--window", "6h", "--max-ack-rate", "0.3"])
    assert code == 0
    assert queries == [
        "sum by (route, le) (increase(turnrouter_first_response_seconds_bucket[6h]))"]
    assert _row(out, "a", "1.00s")[3] == "50.0%"
    assert _row(out, "b", "0.50s")[3] == "0.0%"
    assert "recommended acknowledgment_delay_secs=" in out


def test_prometheus_errors_exit_2(prometheus: tuple[str, list[str]]) -> None:
    """An HTTP error from Prometheus is reported with exit status 2."""
    url, _ = prometheus
    code, _, err = run(["--prometheus", url + "/nope"])
    assert code == 2 and "HTTP 404" in err
