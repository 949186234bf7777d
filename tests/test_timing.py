"""Timing: the decayed per-route predictor and its change detector, JSON-lines samples,
LLM-assisted prediction, clocks."""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import sys
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnrouter import (
    AgentTurn,
    ConfigurationError,
    JsonLinesSink,
    LLMTimingPredictor,
    RouteTimingPredictor,
    SystemClock,
    TimingPredictor,
    TimingSample,
    load_samples,
)
from turnrouter.testing import ManualClock, ScriptedLLM

from . import fuzz


def test_median_and_bounds_follow_the_samples() -> None:
    """Quantiles of a steady route land within a bin width of the true values."""
    predictor = RouteTimingPredictor()
    for i in range(200):
        predictor.record(TimingSample("search", 1.0 + (i % 10) * 0.2))  # 1.0 .. 2.8
    prediction = predictor.predict("search")
    assert prediction is not None and prediction.confident
    assert prediction.seconds == pytest.approx(1.9, rel=0.1)
    assert predictor.quantile("search", 0.1) == pytest.approx(1.1, rel=0.12)
    assert prediction.upper == pytest.approx(2.7, rel=0.12)
    assert prediction.lower == pytest.approx(predictor.quantile("search", 0.1))


def test_unknown_route_has_no_prediction() -> None:
    """A route without samples predicts nothing and has no estimate."""
    predictor = RouteTimingPredictor()
    assert predictor.predict("x") is None
    assert predictor.estimate("x") is None
    assert predictor.samples("x") == 0.0


def test_confidence_needs_enough_samples() -> None:
    """Fewer effective (decayed) samples than min_samples is not confident."""
    predictor = RouteTimingPredictor(min_samples=20)
    for _ in range(20):
        predictor.record(TimingSample("r", 2.0))
    prediction = predictor.predict("r")
    assert prediction is not None and not prediction.confident
    assert prediction.samples == pytest.approx(18.7, abs=0.1)
    for _ in range(2):
        predictor.record(TimingSample("r", 2.0))
    prediction = predictor.predict("r")
    assert prediction is not None and prediction.confident


def test_confidence_needs_a_narrow_spread() -> None:
    """A p90/p10 ratio above max_spread is not confident, however many samples."""
    predictor = RouteTimingPredictor(max_spread=5.0)
    for i in range(100):
        predictor.record(TimingSample("r", 0.1 if i % 2 else 5.0))
    prediction = predictor.predict("r")
    assert prediction is not None and not prediction.confident


def test_recent_samples_outweigh_old_ones() -> None:
    """Without change detection, the estimate follows a drift within a few half-lives."""
    predictor = RouteTimingPredictor(half_life_samples=50, change_threshold=None)
    for _ in range(500):
        predictor.record(TimingSample("r", 0.3))
    for _ in range(250):
        predictor.record(TimingSample("r", 3.0))
    prediction = predictor.predict("r")
    assert prediction is not None
    assert prediction.seconds == pytest.approx(3.0, rel=0.1)
    assert prediction.lower > 1.0
    assert predictor.samples("r") == pytest.approx(1 / (1 - 2 ** (-1 / 50)), rel=0.02)
    assert predictor.changes("r") == 0


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(rng.gauss(0.0, sigma))


def _confident_slow(predictor: RouteTimingPredictor, delay: float = 1.0) -> bool:
    """The trigger acknowledges early at `delay`."""
    prediction = predictor.predict("r", delay_secs=delay)
    return prediction is not None and prediction.early is True


@pytest.mark.parametrize("seed", range(20))
def test_step_change_fast_to_slow_is_confident_slow_within_10_samples(seed: int) -> None:
    """A route turning from 0.4 s to 2.5 s is detected in a few samples and acknowledged
    early at a 1 s delay within N = 10 slow samples (typically 5-6: 4 to detect a new
    regime, then its trigger), not ~330 as by decay (22 before regimes)."""
    rng = random.Random(seed)
    predictor = RouteTimingPredictor()
    for _ in range(300):
        predictor.record(TimingSample("r", _lognormal(rng, 0.4, 0.3)))
        assert not _confident_slow(predictor)
    needed = 0
    while not _confident_slow(predictor):
        predictor.record(TimingSample("r", _lognormal(rng, 2.5, 0.3)))
        needed += 1
        assert needed <= 10
    assert predictor.changes("r") == 1
    waits = 0
    for _ in range(300):  # and it stays there
        predictor.record(TimingSample("r", _lognormal(rng, 2.5, 0.3)))
        waits += not _confident_slow(predictor)
    # A sample 3.7 sd below the slow median (0.8 s: seed 6) is 70x likelier under the
    # fast regime: the next turn hedges (waits) once; the regime is not switched.
    assert waits <= 1
    assert predictor.changes("r") == 1


@pytest.mark.parametrize("seed", range(10))
def test_step_change_slow_to_fast_stops_early_acknowledgments_within_5_samples(
        seed: int) -> None:
    """A slow route turning fast stops early acknowledgments within 5 fast samples (each
    would be a needless early acknowledgment; typically 1), then learns the fast regime."""
    rng = random.Random(seed)
    predictor = RouteTimingPredictor()
    for _ in range(300):
        predictor.record(TimingSample("r", _lognormal(rng, 2.5, 0.3)))
    assert _confident_slow(predictor)
    for _ in range(5):
        predictor.record(TimingSample("r", _lognormal(rng, 0.4, 0.3)))
    assert not _confident_slow(predictor)
    assert predictor.changes("r") == 1
    for _ in range(30):
        predictor.record(TimingSample("r", _lognormal(rng, 0.4, 0.3)))
    prediction = predictor.predict("r")
    assert prediction is not None and prediction.confident
    assert prediction.seconds == pytest.approx(0.4, rel=0.25)  # 34 samples: noisy median


def test_no_flapping_under_noise_without_a_change() -> None:
    """Steady noisy routes (lognormal spread 0.35 and 1.0, bimodal, rare 5x outliers)
    never trigger the change detector in 20 000 samples each, and a steady slow route
    stays confident-slow on every turn after its warm-up."""
    rng = random.Random(11)
    draws: dict[str, Callable[[], float]] = {
        "spread035": lambda: _lognormal(rng, 2.5, 0.35),
        "spread1": lambda: _lognormal(rng, 1.0, 1.0),
        "bimodal": lambda: (_lognormal(rng, 0.3, 0.3) if rng.random() < 0.55
                            else _lognormal(rng, 3.0, 0.3)),
        "outliers": lambda: _lognormal(rng, 2.5, 0.3) * (5.0 if rng.random() < 0.05 else 1.0),
    }
    for route, draw in draws.items():
        predictor = RouteTimingPredictor()
        for i in range(20_000):
            predictor.record(TimingSample("r", draw()))
            if route == "spread035" and i >= 25:
                assert _confident_slow(predictor)
        assert predictor.changes("r") == 0, route


def test_a_run_held_by_the_detector_is_learned_when_it_breaks() -> None:
    """No sample is lost to the change detector: a steady noisy route learns every sample
    once a run pushing a sum breaks, exactly as with detection off."""
    rng = random.Random(3)
    detecting, plain = RouteTimingPredictor(), RouteTimingPredictor(change_threshold=None)
    for seconds in [_lognormal(rng, 1.0, 0.5) for _ in range(500)] + [1.0]:
        detecting.record(TimingSample("r", seconds))
        plain.record(TimingSample("r", seconds))
    assert detecting.changes("r") == 0
    assert detecting.samples("r") == pytest.approx(plain.samples("r"))
    assert detecting.quantile("r", 0.5) == pytest.approx(plain.quantile("r", 0.5))


def test_at_most_31_samples_are_held() -> None:
    """A run pushing the detector's sum that neither breaks nor raises the alarm is held
    in the route's 32-sample ring: from the 32nd sample on, the oldest is learned."""
    predictor = RouteTimingPredictor(change_threshold=1000.0, feature=None)
    rng = random.Random(5)
    for _ in range(100):
        predictor.record(TimingSample("r", _lognormal(rng, 1.0, 0.3)))
    before = predictor.samples("r")
    counts = []
    for _ in range(40):
        predictor.record(TimingSample("r", 2.0))  # 2.3 sd above: every sample pushes
        counts.append(predictor.samples("r"))
    assert counts[30] == pytest.approx(before)  # 31 held
    assert all(b > a for a, b in itertools.pairwise(counts[30:]))  # then one learned each


def test_a_new_regime_starts_from_the_shifted_samples_only() -> None:
    """A shift detected after a few merely slower samples starts the new regime from the
    samples of the new level (its p10 is above 2 s), within four of them: the run is
    held out of the old regime's reference, which it would otherwise widen."""
    rng = random.Random(3)
    predictor = RouteTimingPredictor(feature=None)
    for _ in range(200):
        predictor.record(TimingSample("r", _lognormal(rng, 0.4, 0.3)))
    for seconds in (0.85, 0.51, 0.83):
        predictor.record(TimingSample("r", seconds))
    needed = 0
    while predictor.changes("r") == 0:
        predictor.record(TimingSample("r", 2.6))
        needed += 1
        assert needed <= 4
    low = predictor.quantile("r", 0.1)
    assert low is not None and low > 2.0


def test_short_outlier_bursts_do_not_restart_a_route() -> None:
    """Clipped z-scores: three consecutive 30 s outliers on a 1 s route are not a change."""
    rng = random.Random(5)
    predictor = RouteTimingPredictor()
    for _ in range(200):
        predictor.record(TimingSample("r", _lognormal(rng, 1.0, 0.3)))
    for _ in range(3):
        predictor.record(TimingSample("r", 30.0))
    assert predictor.changes("r") == 0
    for _ in range(200):
        predictor.record(TimingSample("r", _lognormal(rng, 1.0, 0.3)))
    assert predictor.changes("r") == 0
    prediction = predictor.predict("r")
    assert prediction is not None and prediction.confident


def test_censored_samples_never_signal_a_faster_route() -> None:
    """Early interrupts (short censored samples) are not evidence of a faster route;
    long censored samples are evidence of a slower one."""
    rng = random.Random(2)
    predictor = RouteTimingPredictor()
    for _ in range(100):
        predictor.record(TimingSample("r", _lognormal(rng, 2.5, 0.3)))
    for _ in range(100):
        predictor.record(TimingSample("r", 0.1, censored=True))
    assert predictor.changes("r") == 0
    for _ in range(10):
        predictor.record(TimingSample("r", 20.0, censored=True))
    assert predictor.changes("r") == 1
    median = predictor.estimate("r")
    assert median is not None and median >= 20.0


def test_change_detection_replays_identically_from_exported_samples(tmp_path: Path) -> None:
    """Loading exported samples reproduces the detected changes and the estimate."""
    rng = random.Random(4)
    path = tmp_path / "s.jsonl"
    live = RouteTimingPredictor()
    with JsonLinesSink(path) as sink:
        for i in range(400):
            sample = TimingSample("r", _lognormal(rng, 0.4 if i < 200 else 2.5, 0.3))
            live.record(sample)
            sink.record(sample)
    loaded = RouteTimingPredictor()
    loaded.load(load_samples(path))
    assert loaded.changes("r") == live.changes("r") == 1
    assert loaded.estimate("r") == pytest.approx(live.estimate("r"), rel=1e-3)


def test_memory_is_bounded() -> None:
    """Per-route state has a fixed size however many samples and changes (under 6 KB:
    at most 4 regimes of a 96-bin histogram, a 32-sample ring buffer, a few floats),
    and routes are capped."""
    predictor = RouteTimingPredictor(max_routes=3)
    for i in range(50_000):
        predictor.record(TimingSample("r", 0.01 + (i % 997) * 0.01))
    rng = random.Random(9)
    for i in range(20_000):  # six regimes in turn, each for 400 samples: 49 changes
        median = (0.05, 0.3, 1.0, 3.0, 10.0, 30.0)[(i // 400) % 6]
        predictor.record(TimingSample("r", _lognormal(rng, median, 0.3)))
    assert predictor.changes("r") >= 45
    assert predictor.regimes("r") == 4
    assert predictor.memory_bytes("r") < 6144
    for name in ("a", "b", "c", "d"):
        predictor.record(TimingSample(name, 1.0))
    assert set(predictor.routes) == {"r", "a", "b"}
    assert predictor.overflow == {"routes": 2, "classes": 0, "invalid": 0}
    assert predictor.regimes("a") == 1 and predictor.memory_bytes("a") < 2048
    assert predictor.memory_bytes("d") == 0


def test_censored_samples_are_lower_bounds() -> None:
    """Censored samples shift mass above their value, never below."""
    plain, censored = RouteTimingPredictor(), RouteTimingPredictor()
    for i in range(100):
        sample = TimingSample("r", 0.5 + (i % 5))  # 0.5 .. 4.5
        plain.record(sample)
        censored.record(sample)
    for _ in range(50):
        censored.record(TimingSample("r", 2.0, censored=True))
    p50_plain, p50_censored = plain.estimate("r"), censored.estimate("r")
    assert p50_plain is not None and p50_censored is not None
    assert p50_censored > p50_plain
    low_plain, low_censored = plain.quantile("r", 0.1), censored.quantile("r", 0.1)
    assert low_plain is not None and low_censored is not None
    assert low_censored >= low_plain * 0.999


def test_predictor_settings_are_validated() -> None:
    """Invalid predictor settings raise ConfigurationError naming the setting."""
    with pytest.raises(ConfigurationError, match="half_life_samples"):
        RouteTimingPredictor(half_life_samples=0)
    with pytest.raises(ConfigurationError, match="lower_quantile"):
        RouteTimingPredictor(lower_quantile=0.7)
    with pytest.raises(ConfigurationError, match="change_threshold"):
        RouteTimingPredictor(change_threshold=0)
    with pytest.raises(ConfigurationError, match="change_threshold"):
        RouteTimingPredictor(change_threshold=math.inf)


def test_default_predictor_satisfies_the_protocol() -> None:
    """RouteTimingPredictor and LLMTimingPredictor are TimingPredictors."""
    assert isinstance(RouteTimingPredictor(), TimingPredictor)
    assert isinstance(LLMTimingPredictor(ScriptedLLM("seconds: 1")), TimingPredictor)


# ---------------------------------------------------------------- JSON lines


def test_sample_json_round_trip() -> None:
    """A sample survives to_json/from_json unchanged."""
    sample = TimingSample("calendar", 1.234567, True, 1700000000.5)
    assert TimingSample.from_json(sample.to_json()) == sample


def test_load_samples_names_the_bad_line(tmp_path: Path) -> None:
    """An invalid line raises ConfigurationError with file and line number."""
    path = tmp_path / "s.jsonl"
    path.write_text('{"route":"a","seconds":1}\n\n{"route":"a","seconds":-1}\n')
    with pytest.raises(ConfigurationError, match=r"s\.jsonl:3: .*seconds"):
        load_samples(path)


@pytest.mark.parametrize(("line", "field"), [
    ('{"route":"a","seconds":1%s}' % ("0" * 400), "'seconds'"),
    ('{"route":"a","seconds":1,"at":1%s}' % ("0" * 400), "'at'"),
    ('{"route":"a","seconds":1,"at":"now"}', "'at'"),
])
def test_sample_numbers_too_large_for_a_float_are_refused(line: str, field: str) -> None:
    """A sample whose seconds or time is an integer too large for a float is a ValueError
    naming the field, not an OverflowError."""
    with pytest.raises(ValueError, match=field):
        TimingSample.from_json(line)


def test_sink_appends_and_flushes(tmp_path: Path) -> None:
    """JsonLinesSink appends one line per sample and reopens after close()."""
    path = tmp_path / "s.jsonl"
    sink = JsonLinesSink(path, flush_every=2)
    sink.record(TimingSample("a", 1.0))
    sink.record(TimingSample("a", 2.0))
    assert len(path.read_text().splitlines()) == 2
    sink.close()
    sink.record(TimingSample("b", 3.0, censored=True))
    sink.close()
    assert [(s.route, s.seconds, s.censored) for s in load_samples(path)] == [
        ("a", 1.0, False), ("a", 2.0, False), ("b", 3.0, True)]


# ---------------------------------------------------------------- LLM-assisted


@pytest.mark.anyio
async def test_llm_prediction_uses_timing_examples() -> None:
    """The LLM gets recent timing examples and the query; its seconds become a prediction."""
    llm = ScriptedLLM("seconds: 4.5")
    predictor = LLMTimingPredictor(llm, min_examples=2, descriptions={"trip": "plans trips"})
    turn = AgentTurn("p", "t", "plan a week in Rome")
    assert await predictor.predict("trip", turn) is None  # too few examples yet
    predictor.record(TimingSample("trip", 3.0), AgentTurn("p", "a", "book Paris"))
    predictor.record(TimingSample("trip", 5.0), AgentTurn("p", "b", "plan Japan"))
    predictor.record(TimingSample("trip", 9.0, censored=True), AgentTurn("p", "c", "hidden"))
    prediction = await predictor.predict("trip", turn)
    assert prediction is not None and prediction.confident
    assert prediction.seconds == 4.5
    [(prompt, max_tokens, reasoning)] = llm.prompts
    assert "'book Paris': 3.00" in prompt and "'plan Japan': 5.00" in prompt
    assert "hidden" not in prompt and "plans trips" in prompt and "Rome" in prompt
    assert reasoning is False and max_tokens <= 16
    assert predictor.estimate("trip") is not None


@pytest.mark.anyio
async def test_unparseable_or_failed_llm_prediction_is_no_prediction() -> None:
    """A reply without seconds, or an LLM error, yields None, never an exception."""
    for reply in ("I think it takes a while", RuntimeError("down")):
        predictor = LLMTimingPredictor(ScriptedLLM(reply), min_examples=1)
        predictor.record(TimingSample("r", 1.0), AgentTurn("p", "a", "q"))
        assert await predictor.predict("r", AgentTurn("p", "t", "q")) is None


async def _llm_seconds(reply: str) -> float | None:
    """The seconds LLMTimingPredictor predicts when its LLM replies `reply` (None: none)."""
    predictor = LLMTimingPredictor(ScriptedLLM(reply), min_examples=1)
    predictor.record(TimingSample("r", 1.0), AgentTurn("p", "a", "q"))
    prediction = await predictor.predict("r", AgentTurn("p", "t", "q"))
    return None if prediction is None else prediction.seconds


@pytest.mark.anyio
async def test_llm_reply_seconds_must_be_plausible() -> None:
    """Only a plausible positive `seconds: N` in the LLM's reply becomes a prediction."""
    assert await _llm_seconds("Seconds = 2.5") == 2.5
    assert await _llm_seconds("seconds: 0") is None
    assert await _llm_seconds("seconds: 10000") is None
    assert await _llm_seconds("about 3") is None


@pytest.mark.anyio
@pytest.mark.parametrize(("reply", "seconds"), [
    ("seconds: 1e999", None), ("seconds: 5e-324", None), ("seconds: 10**9", None),
    ("seconds: 3 minutes", None), ("seconds: 2.5.3", None),
    ("<think>seconds: 1</think>seconds: 2", 2.0), ("seconds: 2.", 2.0),
    ("seconds: 2.5s", 2.5), ("seconds: 4 seconds", 4.0),
])
async def test_an_llm_number_is_read_whole_or_not_at_all(reply: str,
                                                         seconds: float | None) -> None:
    """The number is read whole, in seconds, outside reasoning: `5e-324` was a confident
    5 s, `1e999` 1 s, `3 minutes` 3 s, and a number inside `<think>` was taken (each
    moved that turn's acknowledgment); now they are no prediction, or the visible one."""
    assert await _llm_seconds(reply) == seconds


# ---------------------------------------------------------------- clocks


@pytest.mark.anyio
async def test_manual_clock_wakes_sleepers_in_deadline_order() -> None:
    """advance() wakes due sleepers in deadline order and leaves later ones asleep."""
    clock = ManualClock()
    woke: list[str] = []

    async def sleeper(name: str, deadline: float) -> None:
        await clock.sleep_until(deadline)
        woke.append(name)

    async with anyio.create_task_group() as tg:
        tg.start_soon(sleeper, "late", 2.0)
        tg.start_soon(sleeper, "early", 1.0)
        await clock.wait_for_sleepers(2)
        assert clock.next_deadline == 1.0
        clock.advance(1.5)
        await clock.settle()
        assert woke == ["early"] and clock.sleepers == 1
        clock.advance(0.5)
    assert woke == ["early", "late"]
    assert clock.now() == 2.0


@pytest.mark.anyio
async def test_manual_clock_forgets_cancelled_sleepers() -> None:
    """A cancelled sleep no longer counts as a sleeper or a deadline."""
    clock = ManualClock()
    with anyio.move_on_after(0):
        await clock.sleep(5.0)
    assert clock.sleepers == 0 and clock.next_deadline is None
    with pytest.raises(ValueError, match="backwards"):
        clock.advance(-1)


@pytest.mark.anyio
async def test_system_clock_is_the_event_loop_clock() -> None:
    """SystemClock reads the loop's monotonic clock and sleep_until a past deadline returns."""
    clock = SystemClock()
    assert abs(clock.now() - anyio.current_time()) < 0.5
    await clock.sleep_until(clock.now() - 1.0)
    assert "SystemClock" in repr(clock) and sys.version_info >= (3, 11)


@pytest.mark.anyio
async def test_system_clock_sleeps_until_its_deadline_and_is_cancellable() -> None:
    """sleep_until (asyncio's own sleep under asyncio) returns once now() reaches the
    deadline, a cancelled sleep ends at once, and a deadline that is not a number is
    refused as anyio.sleep_until refuses it."""
    clock = SystemClock()
    deadline = clock.now() + 0.02
    with anyio.fail_after(10):
        await clock.sleep_until(deadline)
    assert clock.now() >= deadline
    with anyio.fail_after(10):
        with anyio.move_on_after(0.01) as scope:
            await clock.sleep_until(clock.now() + 3600.0)
    assert scope.cancelled_caught
    with pytest.raises(ValueError, match="number"):
        await clock.sleep_until(math.nan)
    await clock.sleep_until(-math.inf)  # long past: returns at once


def _sample_line(field: str, value: str) -> str:
    fields = {"route": '"r"', "seconds": "1.5", "censored": "false", "at": "0"}
    fields[field] = value
    return "{" + ",".join(f'"{key}":{raw}' for key, raw in fields.items()) + "}"


HOSTILE_VALUES = st.one_of(
    st.sampled_from(["1" + "0" * 400, "-1" + "0" * 400, "1e400", "NaN", "-Infinity",
                     "9" * 5000, '"\\ud800"', '"a\\udfffb"', "[" * 3000 + "]" * 3000,
                     '"' + "x" * 70_000 + '"', "[" + "0," * 20_000 + "0]", "null", "true",
                     '"' + "é" * 30 + '"', '{"a": [1, 2]}']),
    st.text(fuzz.ANY_CHAR, max_size=20).map(json.dumps),
    st.floats(allow_nan=True, allow_infinity=True).map(repr), st.integers().map(str),
)


@pytest.mark.parametrize("field", ["route", "seconds", "censored", "at", "feature"])
@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(HOSTILE_VALUES, st.sampled_from([b"", b"\xff\xfe", b"\x00"]))
def test_hostile_sample_lines_warm_start_or_name_the_line(
        tmp_path: Path, field: str, value: str, tail: bytes) -> None:
    """Huge, nested, non-finite or unencodable values: a predictor or a short
    ConfigurationError naming file:line."""
    path = tmp_path / "hostile.jsonl"
    path.write_bytes(_sample_line(field, value).encode("utf-8", "surrogatepass") + tail
                     + b"\n")
    try:
        predictor = RouteTimingPredictor.from_samples(path)
    except ConfigurationError as exc:
        message = str(exc)
        assert f"{path}:1:" in message and len(message) < 600, message[:300]
        return
    assert all(fuzz.valid_text(route) for route in predictor.routes)


@settings(max_examples=300)
@given(route=st.text(max_size=30) | st.integers(), seconds=st.floats() | st.integers(),
       censored=st.booleans() | st.integers(0, 2),
       at=st.floats() | st.integers(-10**20, 10**20),
       feature=st.none() | st.text(max_size=20) | st.integers())
def test_sample_lines_are_what_the_json_module_writes(
        route: object, seconds: object, censored: object, at: object,
        feature: object) -> None:
    """`TimingSample.to_json` writes, whatever the field values (huge or integral
    numbers, non-ASCII or junk-typed fields), exactly the line the json module writes
    for them, so a samples file reads the same however it was written; NaN or an
    infinity is refused (ValueError naming both), never written: one such line made the
    whole file unloadable by `load_samples` and `turnrouter tune`."""
    sample = TimingSample(route, seconds, censored, at, feature)  # type: ignore[arg-type]
    data: dict[str, object] = {"route": route, "seconds": round(seconds, 6),  # type: ignore[call-overload]
                               "censored": censored, "at": round(at, 3)}  # type: ignore[call-overload]
    if feature is not None:
        data["feature"] = feature
    if not (math.isfinite(seconds) and math.isfinite(at)):  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="seconds and at must be finite"):
            sample.to_json()
        return
    assert sample.to_json() == json.dumps(data, separators=(",", ":"))


@pytest.mark.parametrize("flush_every", [0, -1, math.nan, 1.5, "3", True, None])
def test_json_lines_sink_refuses_a_flush_period_that_is_no_count(flush_every: object,
                                                                 tmp_path: Path) -> None:
    """flush_every is a count of samples: anything else (NaN never compared >= and the
    sink never flushed; a str raised TypeError) is a ConfigurationError naming it."""
    with pytest.raises(ConfigurationError, match="flush_every"):
        JsonLinesSink(tmp_path / "samples.jsonl", flush_every=flush_every)  # type: ignore[arg-type]


def test_load_samples_names_a_file_it_cannot_read(tmp_path: Path) -> None:
    """A missing file, a directory: `ConfigurationError` naming it, as for a bad line
    (it raised a bare OSError while `from_samples` raised ConfigurationError)."""
    for path in (tmp_path / "missing.jsonl", tmp_path, tmp_path / "nul\x00.jsonl"):
        with pytest.raises(ConfigurationError, match="cannot read timing samples from"):
            load_samples(path)
    with pytest.raises(ConfigurationError, match=r"missing\.jsonl"):
        RouteTimingPredictor.from_samples(tmp_path / "missing.jsonl")


@pytest.mark.parametrize("seconds", [math.nan, math.inf, -math.inf, -0.5, 10**400])
def test_the_predictor_learns_no_sample_that_is_not_a_finite_duration(
        seconds: float) -> None:
    """`TimingSample` does not check its fields; the predictor does: a NaN, infinite,
    negative or float-overflowing sample is not learned, counted as "invalid" (a NaN
    once failed `record()` with a ValueError and spoiled the route's model)."""
    predictor = RouteTimingPredictor()
    for _ in range(20):
        predictor.record(TimingSample("weather", 0.4))
    before = predictor.predict("weather", AgentTurn("p", "t", "hi"))
    predictor.record(TimingSample("weather", seconds))
    assert predictor.overflow["invalid"] == 1
    assert predictor.predict("weather", AgentTurn("p", "t", "hi")) == before
    assert predictor.routes == ("weather",)


def test_a_fifo_is_refused_as_a_samples_file_not_waited_on(tmp_path: Path) -> None:
    """A FIFO as the sink's file, or as the file a warm start reads, is refused at once
    naming it: opened for writing on the event loop, a FIFO nobody read froze the whole
    router for ever, beyond any `wait_for` (bounds17 H3); read, one nobody wrote blocked
    the start."""
    fifo = tmp_path / "samples.fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigurationError, match="not a regular file"):
        JsonLinesSink(fifo)
    with pytest.raises(ConfigurationError, match=r"samples\.fifo.*not a regular file"):
        load_samples(fifo)
    with pytest.raises(ConfigurationError, match="not a regular file"):
        RouteTimingPredictor.from_samples(fifo)
    sink = JsonLinesSink(tmp_path / "later.jsonl")  # the path becomes a FIFO after
    os.mkfifo(tmp_path / "later.jsonl")
    with pytest.raises(OSError, match=r"No such device|not a regular file"):
        sink.record(TimingSample("weather", 0.4))
    sink.close()


def test_the_sink_writes_to_a_character_device(tmp_path: Path) -> None:
    """/dev/null (a character device) is a usable sink: samples switched off by path."""
    with JsonLinesSink(os.devnull) as sink:
        sink.record(TimingSample("weather", 0.4))
        sink.flush()
