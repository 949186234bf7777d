"""`turnrouter tune`: the what-if model, recommendation and plot from samples or
Prometheus, and its boundaries (samples files, Prometheus answers, flags)."""

from __future__ import annotations

import json
import math
import os
import random
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnrouter import JsonLinesSink, RouteTimingPredictor, TimingSample
from turnrouter.cli._tune import (
    MAX_ANSWER_TOKENS,
    MAX_ROUTES,
    BucketDistribution,
    SampleDistribution,
    analyse,
    parse_prometheus_answer,
    printable,
    read_samples,
    replay_splits,
)
from turnrouter.telemetry import RESPONSE_BUCKETS

from .kit import BROKEN_HTTP_REPLIES, RawReplyServer, run_cli


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
    """`turnrouter tune ARGV...`: its status, standard output and standard error."""
    return run_cli(["tune", *argv])


def _row(text: str, route: str, delay: str) -> list[str]:
    """route, delay, turns, fixed ack, needless, p95 silence, then predictive early
    share, ack, needless, p95 silence (and a current mark)."""
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 10 and fields[0] == route and fields[1] == delay:
            return fields
    raise AssertionError(f"no row {route} {delay} in:\n{text}")


def test_table_models_generation_time_and_needless(samples: Path) -> None:
    """Each route gets the fixed delay's ack rate, needless rate and p95 silence per
    candidate delay, the acknowledgment heard at delay + generation time, and the
    predictive policy's beside it."""
    code, out, _ = run(["--samples", str(samples), "--delays", "0.2,1", "--generation-secs",
                        "0.1"])
    assert code == 0
    # a at 1 s: heard at 1.1 s; half the turns answer at 2 s (acknowledged, not needless).
    assert _row(out, "a", "1.00s")[3:6] == ["50.0%", "0.0%", "1.10s"]
    # b at 0.2 s: every answer (0.3 s) would come right behind an early acknowledgment,
    # so the trigger never acknowledges early, and the delay's comes after the answer.
    assert _row(out, "b", "0.20s")[3:10] == ["0.0%", "0.0%", "0.30s", "0.0%", "0.0%",
                                             "0.0%", "0.30s"]
    assert _row(out, "(all)", "1.00s")[3] == "25.0%"
    assert "replayed in order" in out


def test_samples_without_a_generation_time_say_what_is_modelled(samples: Path) -> None:
    """Samples hold first responses only: the modelled generation time (0.3 s) is named
    with how to give one's own (newcomer20 F3: the template acknowledger takes ~0 s, and
    the recommendation moved by 0.3 s); given, nothing is said."""
    code, out, _ = run(["--samples", str(samples), "--delays", "0.2,1"])
    assert code == 0
    assert "generation modelled as 0.3s" in out and "--generation-secs" in out
    code, out, _ = run(["--samples", str(samples), "--delays", "0.2,1",
                        "--generation-secs", "0"])
    assert code == 0 and "generation modelled" not in out


def test_routes_predicted_slow_are_acknowledged_early() -> None:
    """Without turn order (a distribution), a route is approximated as early when the
    trigger would be on its distribution: heard at max(min(early, delay), generation)."""
    slow = SampleDistribution([(2.0 + i / 100, False) for i in range(100)])
    (row, _all) = analyse({"slow": slow}, [0.5], generation=0.3)
    assert row.early == 1.0 and row.ack_rate == 1.0 and not row.replayed
    assert row.p95_silence == pytest.approx(0.3)
    assert row.fixed_p95_silence == pytest.approx(0.8)
    fast = SampleDistribution([(0.1, False)] * 100)
    (row, _all) = analyse({"fast": fast}, [0.5], generation=0.3)
    assert row.early == 0.0 and row.ack_rate == 0.0


def test_needless_counts_answers_just_after_the_acknowledgment() -> None:
    """Answers starting within 0.5 s after the acknowledgment is heard make it needless:
    those at 0.9 s are right behind the delay's (0.6 s), not the early one (0.25 s)."""
    dist = SampleDistribution([(0.05, False)] * 10 + [(0.9, False)] * 45
                              + [(3.0, False)] * 45)
    (row, _all) = analyse({"r": dist}, [0.5], generation=0.1)  # heard at 0.6 s
    assert row.fixed_ack_rate == pytest.approx(0.9)
    assert row.fixed_needless_rate == pytest.approx(0.45)
    assert row.early == 1.0
    assert row.ack_rate == pytest.approx(0.9) and row.needless_rate == pytest.approx(0.0)


def test_samples_are_replayed_through_the_real_trigger(tmp_path: Path) -> None:
    """From samples, each turn's decision is the trigger's replayed in order (cold start
    included): the early share is exactly what `RouteTimingPredictor.replay` decides,
    and only the turns decided early are acknowledged early."""
    rng = random.Random(4)
    recorded = [TimingSample("slow85", 1.02 + 0.45 * math.exp(rng.gauss(0, 0.5))
                             if rng.random() < 0.87 else rng.uniform(0.7, 0.98),
                             at=float(i)) for i in range(300)]
    path = _write(tmp_path / "r.jsonl", recorded)
    decided = [p is not None and p.early is True for _, p in RouteTimingPredictor().replay(
        recorded, delay_secs=1.0, generation_secs=0.3)]
    splits = replay_splits(recorded, [1.0], generation=0.3)
    assert splits["slow85", 1.0].early is not None
    assert splits["slow85", 1.0].early.turns == sum(decided)
    code, out, _ = run(["--samples", str(path), "--delays", "1"])
    assert code == 0
    fields = _row(out, "slow85", "1.00s")
    assert fields[6] == f"{sum(decided) / 300:.1%}"
    fixed_needless, needless = float(fields[4][:-1]), float(fields[8][:-1])
    assert needless < fixed_needless / 4  # the delay's acknowledgment lands right before
    assert float(fields[9][:-1]) < 0.5 < float(fields[5][:-1])  # p95 silence


def test_replay_reads_the_most_recent_samples_only(samples: Path) -> None:
    """--replay-samples bounds the replay to the newest samples, and says so."""
    code, out, _ = run(["--samples", str(samples), "--delays", "1", "--replay-samples", "10"])
    assert code == 0 and "10 samples replayed" in out
    code, _, err = run(["--samples", str(samples), "--replay-samples", "0"])
    assert code == 2 and "--replay-samples" in err


def test_recommends_one_router_wide_delay(samples: Path) -> None:
    """--max-ack-rate picks the shortest candidate whose all-routes rate fits; no
    per-route recommendations for a router-wide setting; --policy fixed reads the fixed
    delay's figures, the default the predictive policy's."""
    code, out, _ = run(["--samples", str(samples), "--max-ack-rate", "0.3", "--policy",
                        "fixed", "--generation-secs", "0", "--delays", "0.1,0.2,0.3,0.5,1"])
    assert code == 0
    assert "recommended acknowledgment_delay_secs=0.3 for acknowledgment rate <= 30.0% " \
           "(fixed)" in out
    assert "over all routes" in out and "\n  a: " not in out
    code, out, _ = run(["--samples", str(samples), "--max-ack-rate", "0.3",
                        "--generation-secs", "0", "--delays", "0.1,0.2,0.3,0.5,1"])
    assert "(predictive)" in out


def test_a_route_of_its_own_gets_a_route_delay(samples: Path) -> None:
    """--route X: the figures and the recommendation speak for that route (its own
    `acknowledgment_route_delays` entry), never "over all routes"."""
    code, out, _ = run(["--samples", str(samples), "--route", "b", "--max-ack-rate", "0.3",
                        "--policy", "fixed", "--generation-secs", "0", "--delays",
                        "0.1,0.2,0.3,0.5,1"])
    assert code == 0
    assert "recommended acknowledgment_route_delays={'b': 0.3}" in out
    assert "for route b (" in out
    assert "over all routes" not in out
    assert "(all)" not in out  # the table's rows are route b's alone
    code, out, _ = run(["--samples", str(samples), "--route", "b", "--route", "a",
                        "--max-ack-rate", "0.3", "--delays", "0.1,0.3,1"])
    assert "acknowledgment_route_delays={'a': " in out and "'b': " in out
    assert "over routes a, b" in out and "(all)" not in out and "(chosen)" in out


def test_prometheus_route_speaks_for_that_route(
    prometheus: tuple[str, list[str], list[Any]]
) -> None:
    """--prometheus --route X: the queries select X, the current delay is X's own (its
    per-route gauge), and no row or line speaks for all routes."""
    url, queries, _ = prometheus
    code, out, _ = run(["--prometheus", url, "--route", "a", "--max-ack-rate", "0.7",
                        "--delays", "0.5,1", "--generation-secs", "0"])
    assert code == 0, out
    assert queries[:2] == [
        'sum by (route, le) (increase(turnrouter_first_response_seconds_bucket'
        '{route="a"}[1d]))',
        'sum by (route, le) (increase(turnrouter_first_response_interrupted_seconds_bucket'
        '{route="a"}[1d]))']
    assert queries[2] == 'max(turnrouter_acknowledgment_route_delay_seconds{route="a"})'
    assert "current delay of route a: 0.5s" in out
    assert _row(out, "a", "0.50s")[-1] == "current"
    assert "recommended acknowledgment_route_delays={'a': 0.5}" in out
    assert "(all)" not in out and "over all routes" not in out and "\nb " not in out


def test_recommends_the_longest_delay_within_a_silence_target(samples: Path) -> None:
    """--max-silence-p95 picks the longest candidate whose all-routes p95 silence fits:
    0.5 s with the fixed delay; 1 s with the predictive policy, whose early
    acknowledgments keep the slow half of route a at 0.3 s at any delay."""
    flags = ["--samples", str(samples), "--max-silence-p95", "0.6", "--generation-secs",
             "0.1", "--delays", "0.2,0.3,0.5,1"]
    code, out, _ = run([*flags, "--policy", "fixed"])
    assert code == 0
    assert "recommended acknowledgment_delay_secs=0.5 " in out
    code, out, _ = run(flags)
    assert code == 0
    assert "recommended acknowledgment_delay_secs=1 " in out


def test_current_delay_is_marked(samples: Path) -> None:
    """--current marks the configured delay's rows."""
    code, out, _ = run(["--samples", str(samples), "--delays", "0.5,1", "--current", "1"])
    assert code == 0
    assert _row(out, "(all)", "1.00s")[-1] == "current"
    assert "current" not in " ".join(_row(out, "(all)", "0.50s"))


def test_unmet_target_exits_1(samples: Path) -> None:
    """A target no candidate meets is reported with exit status 1; with the default
    candidates, where they stop and that --delays offers longer ones (operator15: a slow
    route got no hint)."""
    code, out, _ = run(["--samples", str(samples), "--max-silence-p95", "0.01"])
    assert code == 1 and "no candidate delay meets" in out
    assert "the default candidates stop at" in out and "--delays" in out
    code, out, _ = run(["--samples", str(samples), "--max-silence-p95", "0.01",
                        "--delays", "0.5,1"])
    assert code == 1 and "no candidate delay meets" in out and "--delays" not in out


def test_a_recommendation_over_the_dead_air_alert_says_so(tmp_path: Path) -> None:
    """A recommended delay whose p95 silence is over TurnrouterDeadAir's target warns
    (operator15: 4 s recommended for a slow route, p95 silence 4.3 s, without a word);
    one under it does not."""
    from turnrouter.ops import DEAD_AIR_SECONDS

    path = _write(tmp_path / "slow.jsonl",
                  [TimingSample("a", 3.0)] * 50 + [TimingSample("a", 5.0)] * 50)
    flags = ["--samples", str(path), "--policy", "fixed", "--generation-secs", "0.1"]
    code, out, _ = run([*flags, "--max-ack-rate", "0.5", "--delays", "1,4"])
    assert code == 0 and "recommended acknowledgment_delay_secs=4 " in out
    assert (f"warning: p95 silence 4.10s at that delay is over the TurnrouterDeadAir "
            f"alert's {DEAD_AIR_SECONDS:g}s") in out
    code, out, _ = run([*flags, "--max-ack-rate", "1", "--delays", "1"])
    assert code == 0 and "recommended acknowledgment_delay_secs=1 " in out
    assert "warning" not in out


def test_censored_samples_count_as_slow(tmp_path: Path) -> None:
    """Interrupted turns are lower bounds (Kaplan-Meier), not fast answers."""
    path = _write(tmp_path / "c.jsonl", [TimingSample("a", 0.2)] * 50
                  + [TimingSample("a", 0.5, censored=True)] * 50)
    code, out, _ = run(["--samples", str(path), "--delays", "0.4,1", "--generation-secs", "0"])
    assert code == 0
    assert _row(out, "a", "1.00s")[3] == "50.0%"  # censored beyond 0.5 s: still silent at 1 s


def test_plot_without_matplotlib_still_prints_the_table(
    samples: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without matplotlib, --plot prints a clear message and the table, and exits 1: a
    script asking for the plot learns it is missing."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, out, err = run(["--samples", str(samples), "--plot", str(tmp_path / "p.png")])
    assert code == 1 and "matplotlib" in err and "pip install matplotlib" in err
    assert "ack rate" in out and not (tmp_path / "p.png").exists()


@pytest.mark.parametrize("target", ["missing/p.png", "folder", "fifo"])
def test_a_plot_that_cannot_be_written_is_refused_before_any_work(
        samples: Path, tmp_path: Path, target: str) -> None:
    """--plot into a missing folder, onto a folder or a FIFO is a usage error (exit 2)
    naming it, before the analysis: it used to print the table, fail, and exit 0."""
    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "fifo")
    code, out, err = run(["--samples", str(samples), "--plot", str(tmp_path / target)])
    assert code == 2 and out == ""
    assert "--plot" in err and str(tmp_path / target.split("/")[0]) in err


def test_plot_is_written_with_matplotlib(samples: Path, tmp_path: Path) -> None:
    """With matplotlib installed, --plot writes a PNG."""
    pytest.importorskip("matplotlib")
    code, out, _ = run(["--samples", str(samples), "--max-ack-rate", "0.3",
                        "--plot", str(tmp_path / "p.png")])
    assert code == 0 and "plot written" in out
    assert (tmp_path / "p.png").read_bytes().startswith(b"\x89PNG")


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


def test_interrupted_buckets_are_read_as_censored_samples() -> None:
    """Turns interrupted before a response, in their own histogram, are censored as in
    the samples (the life-table form of Kaplan-Meier: a bucket's censored turns are at
    risk for half of it), never dropped nor taken for answers."""
    events = [(0.5, 10.0), (1.0, 30.0), (math.inf, 40.0)]
    lost = [(0.5, 0.0), (1.0, 20.0), (math.inf, 20.0)]
    buckets = BucketDistribution(events, lost)
    assert buckets.turns == 60.0
    assert buckets.survival(0.5) == pytest.approx(50 / 60)
    # 50 at risk in (0.5, 1]: 20 answered, 20 interrupted (at risk half the bucket).
    assert buckets.survival(1.0) == pytest.approx(50 / 60 * (1 - 20 / 40))
    assert BucketDistribution(events).survival(1.0) == pytest.approx(0.25)  # optimistic
    assert buckets.quantile(0.5) == pytest.approx(0.5 + 0.5 * (1 - 0.5 / (50 / 60)) / (
        1 - 0.5))
    # A route with interrupted turns only: nothing answered, all still silent.
    only = BucketDistribution([], [(1.0, 5.0), (math.inf, 5.0)])
    assert only.turns == 5.0 and only.survival(3.0) == 1.0
    assert only.quantile(0.5) == math.inf


def test_buckets_and_samples_agree_with_interrupted_turns() -> None:
    """The same turns (a slow route, a fifth of them interrupted, mostly while slow)
    give survival within 0.02 at every bucket bound, read from samples (Kaplan-Meier) or
    from the two histograms, and the same recommended delay; dropping the interrupted
    ones (the histogram of answers alone) recommends a shorter delay."""
    rng = random.Random(31)
    turns: list[tuple[float, bool]] = []
    for _ in range(4000):
        seconds = rng.lognormvariate(-0.7, 0.3) if rng.random() < 0.6 else \
            rng.lognormvariate(0.5, 0.2)
        interrupt = rng.expovariate(1 / 3.0)
        turns.append((interrupt, True) if interrupt < seconds else (seconds, False))
    bounds = [*RESPONSE_BUCKETS, math.inf]

    def histogram(values: list[float]) -> list[tuple[float, float]]:
        return [(b, float(sum(1 for v in values if v <= b))) for b in bounds]

    answered = [s for s, censored in turns if not censored]
    interrupted = [s for s, censored in turns if censored]
    assert 0.1 < len(interrupted) / len(turns) < 0.3
    km = SampleDistribution(turns)
    buckets = BucketDistribution(histogram(answered), histogram(interrupted))
    for bound in RESPONSE_BUCKETS:
        assert buckets.survival(bound) == pytest.approx(km.survival(bound), abs=0.02)
    delays = [0.5, 0.8, 1.0, 1.2, 1.5, 1.7, 2.0]

    def recommended(dist: Any) -> float:
        rows = analyse({"slow": dist}, delays)
        return min(r.delay for r in rows if r.route == "(all)" and r.fixed_ack_rate <= 0.1)

    assert recommended(buckets) == recommended(km)
    assert recommended(BucketDistribution(histogram(answered))) < recommended(km)


@given(st.lists(st.tuples(st.sampled_from([0.1, 0.5, 1.0, 2.0, math.inf]),
                          st.floats(0, 1e9), st.floats(0, 1e9)), max_size=12))
def test_any_bucket_counts_give_a_survival_function(
        counts: list[tuple[float, float, float]]) -> None:
    """Any counts, even not monotonic or with censored turns only: survival stays in
    [0, 1] and never rises; quantiles never fall as the level rises."""
    dist = BucketDistribution([(b, e) for b, e, _ in counts], [(b, c) for b, _, c in counts])
    points = [0.0, 0.05, 0.1, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0]
    values = [dist.survival(t) for t in points]
    assert all(0.0 <= v <= 1.0 for v in values)
    assert all(a >= b - 1e-9 for a, b in pairwise(values))
    if dist.turns > 0:
        qs = [dist.quantile(q) for q in (0.1, 0.5, 0.9)]
        assert all(a <= b + 1e-9 for a, b in pairwise(qs))


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(("flags", "named"), [
    (["--generation-secs", "-1"], "--generation-secs"),
    (["--confidence", "0.5"], "--confidence"),
    (["--confidence", "1"], "--confidence"),
    (["--policy", "both"], "--policy"),
    (["--replay-samples", "x"], "--replay-samples"),
    (["--generation-secs", "nan"], "--generation-secs"),
    (["--max-ack-rate", "1.5"], "--max-ack-rate"),
    (["--max-silence-p95", "inf"], "--max-silence-p95"),
    (["--timeout", "0"], "--timeout"),
    (["--window", "1d; drop"], "--window"),
    (["--route", "a\x1bb"], "--route"),
])
def test_flag_errors_exit_2_with_one_line(
        samples: Path, flags: list[str], named: str) -> None:
    """Bad flag values: exit 2 and one stderr line naming the flag."""
    code, _out, err = run(["--samples", str(samples), *flags])
    assert code == 2
    assert err.count("\n") == 1 and named in err and "\x1b" not in err


@pytest.mark.parametrize(("delays", "problem"), [
    ("0,1", "[0.001, 60]"), ("nan", "[0.001, 60]"), ("1e-320", "[0.001, 60]"),
    ("x", "not a number"), ("", "1 to 100")])
def test_bad_delays_exit_2(samples: Path, delays: str, problem: str) -> None:
    """--delays must be 1-100 finite positive numbers."""
    code, _, err = run(["--samples", str(samples), "--delays", delays or ","])
    assert code == 2 and problem in err


def test_bad_samples_files_exit_2_naming_the_line(tmp_path: Path) -> None:
    """Missing files, junk, non-UTF-8, deeply nested and overlong lines: exit 2, the
    file and line named, one line."""
    code, _, err = run(["--samples", str(tmp_path / "missing.jsonl")])
    assert code == 2 and "missing.jsonl" in err
    cases = {
        "junk.jsonl": b"not json\n",
        "bytes.jsonl": b'{"route": "a", "seconds": 1}\n\xff\xfe\n',
        "deep.jsonl": b"[" * 200_000 + b"]" * 200_000 + b"\n",
        "negative.jsonl": b'{"route": "a", "seconds": -1}\n',
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        code, _, err = run(["--samples", str(tmp_path / name)])
        assert code == 2, name
        assert f"{name}:" in err and err.count("\n") == 1, err


def test_more_routes_than_tracked_exit_2_unless_routes_are_named(tmp_path: Path) -> None:
    """A samples file of more routes than one run analyses: one line naming the bound
    and --route, which then narrows the run to the routes named."""
    path = tmp_path / "many.jsonl"
    path.write_text("".join(json.dumps({"route": f"r{i}", "seconds": 0.5, "at": float(i)})
                            + "\n" for i in range(MAX_ROUTES + 1)))
    code, _, err = run(["--samples", str(path)])
    assert code == 2 and f"more than tune analyses in one run ({MAX_ROUTES}" in err
    assert "--route" in err and err.count("\n") == 1
    code, out, _ = run(["--samples", str(path), "--route", "r7", "--delays", "0.5"])
    assert code == 0 and "r7" in out and "r8 " not in out


def test_control_characters_in_route_names_are_escaped(tmp_path: Path) -> None:
    """A route name with terminal escapes is printed escaped."""
    path = _write(tmp_path / "s.jsonl", [TimingSample("evil\x1b[2J\x07", 0.4)] * 10)
    code, out, _ = run(["--samples", str(path), "--delays", "0.5"])
    assert code == 0
    assert "\x1b" not in out and "\x07" not in out
    assert "evil\\x1b[2J\\x07" in out
    assert printable("a\nb\tc\u202e") == "a\\nb\\tc\\u202e"


def test_file_url_is_refused(tmp_path: Path) -> None:
    """--prometheus accepts http(s) only: a file:// URL is not read."""
    secret = tmp_path / "secret"
    secret.write_text('{"status": "success"}')
    code, _, err = run(["--prometheus", f"file://{secret}"])
    assert code == 2 and "http(s)" in err


def test_selector_only_with_prometheus_and_validated(samples: Path) -> None:
    """--selector is Prometheus label matchers, for --prometheus only."""
    code, _, err = run(["--samples", str(samples), "--selector", 'job="x"'])
    assert code == 2 and "--prometheus only" in err
    code, _, err = run(["--prometheus", "http://127.0.0.1:9", "--selector", 'job="x"} or up'])
    assert code == 2 and "--selector" in err


@pytest.mark.parametrize("selector", ["}", "{", ",", "{}", " ", "", "{ , }"])
def test_a_selector_without_a_matcher_is_refused(selector: str) -> None:
    """A --selector given without a label matcher (`"$SEL"` with the variable unset, a
    stray brace) is refused naming the flag: it used to mean no selector, widening the
    analysis to every job of the Prometheus without a word (ops13 D4)."""
    code, _, err = run(["--prometheus", "http://127.0.0.1:9", "--selector", selector])
    assert code == 2 and "--selector" in err and err.count("\n") == 1


def test_an_empty_delays_list_and_a_broken_url_name_their_flag(samples: Path) -> None:
    code, _, err = run(["--samples", str(samples), "--delays", ""])
    assert code == 2 and "--delays" in err
    code, _, err = run(["--prometheus", "http://[::1"])
    assert code == 2 and "--prometheus" in err and err.count("\n") == 1


def _series(route: object, le: object, value: object) -> dict[str, Any]:
    return {"metric": {"route": route, "le": le}, "value": [0, value]}


@pytest.mark.parametrize(("payload", "problem"), [
    ([], "not a JSON object"),
    ({"status": "error", "error": "bad\x1b"}, "query failed: bad\\x1b"),
    ({"status": "success", "data": []}, "no vector"),
    ({"status": "success", "data": {"resultType": "vector", "result": {}}}, "not a list"),
    ({"status": "success", "data": {"resultType": "vector", "result": [1]}}, "not an object"),
    ({"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": [], "value": [0, "1"]}]}}, "'metric'"),
    ({"status": "success", "data": {"resultType": "vector", "result": [
        _series("a", "0.5", "1")["metric"] | {}]}}, "'metric'"),
    ({"status": "success", "data": {"resultType": "vector", "result": [
        _series("a", "NaN", "1")]}}, "bucket bound"),
    ({"status": "success", "data": {"resultType": "vector", "result": [
        _series("a", "0.5", "-3")]}}, "finite number >= 0"),
    ({"status": "success", "data": {"resultType": "vector", "result": [
        _series("a", "0.5", "NaN")]}}, "finite number >= 0"),
    ({"status": "success", "data": {"resultType": "vector", "result": [
        _series("a", "x", "1")]}}, "not a number"),
    ({"status": "success", "data": {"resultType": "vector", "result": [
        _series("a", "0.5", "1e308"), _series("a", "+Inf", "1e308")]}},
     "too large to add up"),
    ({"status": "success", "data": {"resultType": "vector", "result": [
        _series("a", "0.5", "1"), _series("a", "1", "3"), _series("b", "+Inf", "3")]}},
     "no le=\"+Inf\" bucket for route 'a'"),
    ({"status": "success", "data": {"resultType": "vector", "result": [
        _series(1, "0.5", "1")]}}, "string 'route'"),
    ({"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"route": "a", "le": "1"}, "value": "1"}]}}, "[time, value]"),
    ({"status": "success", "data": {"resultType": "vector", "result": [
        _series("r" * 101, "+Inf", "1")]}}, "route label longer than 100 characters"),
])
def test_structurally_wrong_prometheus_answers_are_named(payload: object,
                                                        problem: str) -> None:
    """Every malformed answer is a ValueError saying what is wrong."""
    with pytest.raises(ValueError, match=re.escape(problem)):
        parse_prometheus_answer(payload, None)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=30)
SERIES = st.fixed_dictionaries({
    "metric": st.dictionaries(st.sampled_from(["route", "le", "job"]),
                              st.text(max_size=8) | st.sampled_from(["+Inf", "0.5", "NaN"])
                              | JSON, max_size=3),
    "value": st.lists(JSON | st.sampled_from(["1", "-1", "NaN", "Inf", "1e400", "1e308"]),
                      max_size=3)})


@settings(max_examples=300, deadline=None)
@given(JSON | st.fixed_dictionaries({
    "status": st.sampled_from(["success", "error"]) | JSON,
    "data": st.fixed_dictionaries({"resultType": st.sampled_from(["vector", "matrix"]),
                                   "result": st.lists(SERIES, max_size=6) | JSON})}))
def test_any_prometheus_answer_parses_or_names_the_problem(payload: object) -> None:
    """Any JSON answer: valid finite non-negative buckets, or a ValueError."""
    try:
        buckets = parse_prometheus_answer(payload, None)
    except ValueError as exc:
        buckets, message = {}, str(exc)
    else:
        message = "ok"
    assert message
    assert math.isfinite(sum(c for per_route in buckets.values() for c in per_route.values()))
    assert all(math.inf in per_route for per_route in buckets.values())
    for per_route in buckets.values():
        for bound, count in per_route.items():
            assert bound > 0 and math.isfinite(count) and count >= 0
            BucketDistribution(sorted(per_route.items())).quantile(0.95)


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.binary(max_size=80) | JSON.map(lambda v: json.dumps(v).encode())
                | st.builds(lambda r, s: json.dumps({"route": r, "seconds": s}).encode(),
                            st.text(max_size=6), st.floats()), max_size=8))
def test_any_samples_file_reads_or_names_the_line(tmp_path: Path, lines: list[bytes]) -> None:
    """Any bytes: samples (finite, >= 0) or a ValueError naming file and line."""
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(b"\n".join(line.replace(b"\n", b" ") for line in lines))
    try:
        read = read_samples(str(path), None)
    except ValueError as exc:
        read, message = [], str(exc)
    else:
        message = "fuzz.jsonl"
    assert "fuzz.jsonl" in message
    assert all(math.isfinite(s.seconds) and s.seconds >= 0 for s in read)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["--window", "--timeout", "--route", "--generation-secs",
                                 "--delays", "--max-ack-rate", "--max-silence-p95",
                                 "--selector", "--current", "--policy", "--confidence",
                                 "--replay-samples"]) | st.text(max_size=8),
                max_size=5),
       st.lists(st.text(max_size=20) | st.floats().map(repr), max_size=5))
def test_any_flags_end_in_a_status_never_a_traceback(flags: list[str],
                                                     values: list[str]) -> None:
    """Any flags (with an unreadable samples file): an exit status 0-2, nothing raised."""
    argv = ["--samples", "/nonexistent/samples.jsonl",
            *[item for pair in zip(flags, values, strict=False) for item in pair]]
    assert run(argv)[0] in (0, 1, 2)


# ---------------------------------------------------------------- Prometheus source


#: A selector the fake Prometheus below answers with no series (a typo in --selector).
NOTHING = 'job="voise"'


@pytest.fixture
def prometheus() -> Iterator[tuple[str, list[str], list[Any]]]:
    """A local server answering /api/v1/query (POST) with a bucket vector it is given."""
    queries: list[str] = []
    answer: list[Any] = [None]
    series: list[dict[str, Any]] = []
    for route, counts in (("a", (0, 50, 50, 100)), ("b", (0, 100, 100, 100))):
        for le, count in zip(("0.1", "0.5", "1", "+Inf"), counts, strict=True):
            series.append({"metric": {"route": route, "le": le}, "value": [0, str(count)]})
    answer[0] = {"status": "success", "data": {"resultType": "vector", "result": series}}
    # Route a: 50 more turns interrupted between 1 s and 2 s, before any response.
    interrupted: list[dict[str, Any]] = [
        {"metric": {"route": "a", "le": le}, "value": [0, count]}
        for le, count in (("0.1", "0"), ("0.5", "0"), ("1", "0"), ("2", "50"), ("+Inf", "50"))]

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            from urllib.parse import parse_qs

            length = int(self.headers.get("Content-Length") or 0)
            query = parse_qs(self.rfile.read(length).decode()).get("query", [""])[0]
            queries.append(query)
            if self.path != "/api/v1/query":
                self.send_response(404)
                self.end_headers()
                return
            reply = answer[0]
            if NOTHING in query:  # a selector matching no series
                reply = {"status": "success", "data": {"resultType": "vector", "result": []}}
            elif "turnrouter_first_response_interrupted_seconds_bucket" in query:
                reply = {"status": "success", "data": {"resultType": "vector",
                                                        "result": interrupted}}
            if query.startswith("max(turnrouter_acknowledgment_route_delay_seconds"):
                reply = {"status": "success", "data": {"resultType": "vector", "result": [
                    {"metric": {}, "value": [0, "0.5"]}]}}
            if query.startswith("max(turnrouter_acknowledgment_delay_seconds"):
                reply = {"status": "success", "data": {"resultType": "vector", "result": [
                    {"metric": {}, "value": [0, "1"]}]}}
            if "generation_seconds_sum{job=\"measured\"}" in query:  # a template's 8 ms
                reply = {"status": "success", "data": {"resultType": "vector", "result": [
                    {"metric": {}, "value": [0, "0.008"]}]}}
            if query.startswith("min(turnrouter_acknowledgment_delay_seconds"):
                reply = {"status": "success", "data": {"resultType": "vector", "result": [
                    {"metric": {}, "value": [0, "0.5"]}]}}  # two deployments read together
            body = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
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
        yield f"http://127.0.0.1:{httpd.server_address[1]}", queries, answer
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def test_reads_first_response_buckets_from_prometheus_with_a_selector(
    prometheus: tuple[str, list[str], list[Any]]
) -> None:
    """--prometheus queries the bucket increase by route and le, narrowed by --selector."""
    url, queries, _ = prometheus
    code, out, _ = run(["--prometheus", url, "--window", "6h", "--max-ack-rate", "0.45",
                        "--selector", '{job="voice", env=~"prod.*"}', "--delays", "0.5,1",
                        "--generation-secs", "0"])
    assert code == 0
    assert queries == ['sum by (route, le) (increase(turnrouter_first_response_seconds_bucket'
                       '{job="voice", env=~"prod.*"}[6h]))',
                       'sum by (route, le) (increase('
                       'turnrouter_first_response_interrupted_seconds_bucket'
                       '{job="voice", env=~"prod.*"}[6h]))',
                       'max(turnrouter_acknowledgment_delay_seconds{job="voice", env=~"prod.*"})',
                       'min(turnrouter_acknowledgment_delay_seconds{job="voice", env=~"prod.*"})']
    # The turns interrupted after 1 s without a response were still silent at 1 s: 100 of
    # route a's 150 (without them, 50 of 100).
    assert _row(out, "a", "1.00s")[2] == "150"
    assert _row(out, "a", "1.00s")[3] == "66.7%"
    assert _row(out, "a", "1.00s")[-1] == "current"  # the routers' configured delay
    # The routers read do not agree (ops13 D4): said, not only the highest marked.
    assert "note: the routers read report different fallback delays (0.5s to 1s" in out
    assert _row(out, "b", "0.50s")[3] == "0.0%"
    assert "recommended acknowledgment_delay_secs=" in out
    assert "APPROXIMATION" in out  # no turn order in a histogram


def test_prometheus_errors_exit_2(prometheus: tuple[str, list[str], list[Any]]) -> None:
    """An HTTP error, a deeply nested or a non-JSON answer: exit 2 with one line."""
    url, _, answer = prometheus
    code, _, err = run(["--prometheus", url + "/nope"])
    assert code == 2 and "HTTP 404" in err
    answer[0] = b"[" * 100_000 + b"]" * 100_000
    code, _, err = run(["--prometheus", url])
    assert code == 2 and "nested too deeply" in err and err.count("\n") == 1
    answer[0] = b"\xff not json"
    code, _, err = run(["--prometheus", url])
    assert code == 2 and "not JSON" in err


def test_no_samples_says_where_it_looked(
    prometheus: tuple[str, list[str], list[Any]], samples: Path
) -> None:
    """A --selector, --window or --route that matches nothing exits 2 with one line
    naming the query (or file) and the routes asked for, so the typo shows."""
    url, _, _ = prometheus
    code, _, err = run(["--prometheus", url, "--selector", NOTHING, "--window", "2h"])
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"turnrouter tune: error: no first-response samples found in {url} (")
    assert f"turnrouter_first_response_seconds_bucket{{{NOTHING}}}[2h]" in err
    assert err.endswith("; the window must span at least two scrapes (at a 1-minute "
                        "scrape, --window 2m or more)\n")
    code, _, err = run(["--samples", str(samples), "--route", "c", "--route", "a b"])
    assert code == 2 and err == (f"turnrouter tune: error: no first-response samples of "
                                 f"--route a b, c found in {samples}\n")


def test_an_answer_of_millions_of_tiny_values_is_refused_before_decoding(
    prometheus: tuple[str, list[str], list[Any]]
) -> None:
    """3 MB of `{},` would decode to over a million dicts (64 MiB: gigabytes): refused
    by its count of separators, in one line."""
    url, _, answer = prometheus
    answer[0] = b"[" + b"{}," * (MAX_ANSWER_TOKENS // 2) + b"{}]"
    code, _, err = run(["--prometheus", url])
    assert code == 2 and f"more than {MAX_ANSWER_TOKENS:,} values" in err
    assert err.count("\n") == 1


@pytest.fixture(scope="module")
def raw_prometheus() -> Iterator[RawReplyServer]:
    """One raw TCP 'Prometheus' for every example: it answers whatever bytes it is given."""
    server = RawReplyServer()
    try:
        yield server
    finally:
        server.close()


def _framed(body: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


def _vector(value: str) -> bytes:
    return ('{"status": "success", "data": {"resultType": "vector", "result": '
            '[{"metric": {"route": "a", "le": "+Inf"}, "value": [0, ' + value + ']}]}}'
            ).encode()


REPLY_BODIES = st.one_of(
    st.binary(max_size=200),
    JSON.map(lambda value: json.dumps(value).encode()),
    st.sampled_from(["1" + "0" * 400, "1e400", "-1e400", "NaN", "Infinity", "1" * 5000,
                     '"\\ud800"', '"' + "9" * 100_000 + '"', "[" * 50_000 + "]" * 50_000,
                     '{"k":' * 50_000 + "1" + "}" * 50_000]).map(_vector),
    st.sampled_from([b"[" * 200_000, b"\xff" * 1000, b'"' + "é".encode() * 1_000_000 + b'"']),
)


@settings(max_examples=120, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.one_of(st.sampled_from(BROKEN_HTTP_REPLIES), REPLY_BODIES.map(_framed)))
def test_any_prometheus_reply_on_the_wire_is_a_status(raw_prometheus: RawReplyServer,
                                                     reply: bytes) -> None:
    """Any bytes Prometheus sends (broken framing, huge, nested, NaN): exit 0-2 and at
    most one stderr line, never a traceback."""
    raw_prometheus.reply = reply
    code, _, err = run(["--prometheus", raw_prometheus.url, "--timeout", "5"])
    assert code in (0, 1, 2)
    assert err.count("\n") <= 1 and "Traceback" not in err
    assert code != 2 or err.startswith("turnrouter tune: error: ")


def test_the_recommendation_comes_before_the_table(samples: Path) -> None:
    """The table runs to hundreds of lines: the recommendation is the first line."""
    code, out, _ = run(["--samples", str(samples), "--max-ack-rate", "0.3",
                        "--delays", "0.1,0.2,0.3,0.5,1"])
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith("recommended acknowledgment_delay_secs=")
    assert any(line.startswith("source: ") for line in lines[1:])
    assert _row(out, "(all)", "1.00s")     # the table is still there, after it
    code, out, _ = run(["--samples", str(samples), "--max-silence-p95", "0.01"])
    assert code == 1 and out.splitlines()[0].startswith("no candidate delay meets")


def test_a_reader_that_leaves_early_ends_the_table_quietly(samples: Path) -> None:
    """`turnrouter tune ... | head`: the reader closes the pipe before the table is
    written; the command stops without a traceback, with SIGPIPE's shell status."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line
    try:
        result = subprocess.run(
            [sys.executable, "-m", "turnrouter", "tune", "--samples", str(samples)],
            stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120, check=False,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    finally:
        os.close(write_end)
    assert result.stderr == ""
    assert result.returncode == 141


def test_a_route_name_longer_than_a_routers_is_refused_naming_the_line(
        tmp_path: Path) -> None:
    """Route names in a samples file are at most 100 characters, as a router's: 256
    names of 65,000 characters padded every row of the table (16 MB of samples printed
    218 MB: bounds17 M6). Exit 2, one line naming file:line; 100 characters still run."""
    path = _write(tmp_path / "long.jsonl", [TimingSample("r" * 100, 0.4)] * 3
                  + [TimingSample("x" * 101, 0.4)])
    code, out, err = run(["--samples", str(path)])
    assert code == 2 and out == "" and err.count("\n") == 1
    assert f"{path}:4: route name longer than 100 characters" in err
    code, _, err = run(["--samples", str(_write(tmp_path / "ok.jsonl",
                                                [TimingSample("r" * 100, 0.4)] * 3))])
    assert code == 0, err


def test_a_measured_generation_time_unlike_the_model_is_named(
    prometheus: tuple[str, list[str], list[Any]]
) -> None:
    """operator18 M2: the model's 0.3 s against a template acknowledger's 8 ms more than
    doubled the acknowledgment rate tune predicted. Without --generation-secs, tune reads
    the routers' mean generation time and names it with the flag to pass; with the flag,
    or without a measurement, it says nothing."""
    url, queries, _ = prometheus
    code, out, _ = run(["--prometheus", url, "--selector", 'job="measured"',
                        "--delays", "0.5,1"])
    assert code == 0, out
    assert queries[-1] == (
        'sum(increase(turnrouter_acknowledgment_generation_seconds_sum{job="measured"}[1d]))'
        ' / (sum(increase(turnrouter_acknowledgment_generation_seconds_count'
        '{job="measured"}[1d])) > 0)')
    assert ("note: the routers measured acknowledgment generation at 0.008s on average "
            "over 1d (turnrouter_acknowledgment_generation_seconds), this table models "
            "0.3s: rerun with --generation-secs 0.008") in out
    assert "model: acknowledgment generation 0.3s" in out
    queries.clear()
    code, out, _ = run(["--prometheus", url, "--selector", 'job="measured"',
                        "--delays", "0.5,1", "--generation-secs", "0.01"])
    assert code == 0 and "measured acknowledgment generation" not in out
    assert not any("generation_seconds" in query for query in queries)
    # No single mean (the fake answers the bucket vector): no note.
    code, out, _ = run(["--prometheus", url, "--delays", "0.5,1"])
    assert code == 0 and "measured acknowledgment generation" not in out
