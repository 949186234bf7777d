"""Per-route alert overrides, the traffic floors, and `python -m turnrouter.ops` edges."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnrouter.ops import (
    ALERTS,
    MAX_OVERRIDES_BYTES,
    MIN_TURNS,
    RouteOverride,
    load_overrides,
    main,
    read_overrides,
    rule_groups,
)

from .conftest import DEPLOY

PER_ROUTE = sorted({alert.alert for alert in ALERTS if alert.per_route})


def _expr(alert: str, overrides: tuple[RouteOverride, ...]) -> str:
    rules = rule_groups(overrides=overrides)["groups"][1]["rules"]
    (rule,) = [r for r in rules if r.get("alert") == alert]
    expr: str = rule["expr"]
    return expr


def test_every_alert_is_gated_on_a_count_of_turns_in_its_window() -> None:
    """Each traffic alert requires a recorded traffic count (increase over its window)
    >= a floor; the page, a count of distinct clarified participants."""
    for alert in ALERTS:
        if alert.raw:
            continue
        assert f"{alert.volume} >= {alert.min_turns}" in alert.expr
        if alert.volume == "turnrouter:window_clarified_participants:sum":
            assert alert.min_turns >= 2
            continue
        assert ":increase" in alert.volume, alert.alert
        assert alert.min_turns >= 30


def test_override_replaces_threshold_and_excludes_route_from_default() -> None:
    """An overridden route leaves the default branch and gets its own threshold/floor."""
    expr = _expr("TurnrouterSlowFirstResponse", (
        RouteOverride("travel", "TurnrouterSlowFirstResponse", threshold=4.0, min_turns=20),))
    assert 'turnrouter:first_response_seconds:p95_5m{route!~"travel"} > 1.5' in expr
    assert 'turnrouter:first_response_seconds:p95_5m{route="travel"} > 4' in expr
    assert 'turnrouter:first_responses:increase5m{route="travel"} >= 20' in expr
    assert f'turnrouter:first_responses:increase5m{{route!~"travel"}} >= {MIN_TURNS}' in expr


def test_disabled_override_drops_the_route_and_leaves_other_alerts_alone() -> None:
    """`disabled` removes the route from that alert only."""
    overrides = (RouteOverride("travel", "TurnrouterAcknowledgmentOveruse", disabled=True),)
    expr = _expr("TurnrouterAcknowledgmentOveruse", overrides)
    assert 'route!~"travel"' in expr
    assert 'route="travel"' not in expr
    assert "travel" not in _expr("TurnrouterSlowFirstResponse", overrides)


def test_route_names_with_regex_characters_are_matched_literally() -> None:
    """A route with regex metacharacters is escaped in the `!~` matcher."""
    expr = _expr("TurnrouterSlowFirstResponse",
                 (RouteOverride("a.b(c)", "TurnrouterSlowFirstResponse", threshold=2.0),))
    assert 'route!~"a\\\\.b\\\\(c\\\\)"' in expr
    assert 'route="a.b(c)"' in expr


@pytest.mark.parametrize(("entry", "problem"), [
    ({"route": "", "alert": PER_ROUTE[0], "disabled": True}, "route"),
    ({"route": 'a"b', "alert": PER_ROUTE[0], "disabled": True}, "route"),
    ({"route": "a\nb", "alert": PER_ROUTE[0], "disabled": True}, "route"),
    ({"route": "a", "alert": "TurnrouterDeadAir", "disabled": True}, "alert must be one of"),
    ({"route": "a", "alert": PER_ROUTE[0], "threshold": float("nan")}, "threshold"),
    ({"route": "a", "alert": PER_ROUTE[0], "threshold": -1}, "threshold"),
    ({"route": "a", "alert": PER_ROUTE[0], "threshold": True}, "threshold"),
    ({"route": "a", "alert": PER_ROUTE[0], "threshold": 10**400}, "threshold"),
    ({"route": "a", "alert": PER_ROUTE[0], "min_turns": 1.5}, "min_turns"),
    # the traffic floor cannot go: one unlucky turn would raise the alert
    ({"route": "a", "alert": PER_ROUTE[0], "min_turns": 0}, "min_turns"),
    # an entry that changes nothing is a mistake, not a no-op (a key left out)
    ({"route": "a", "alert": PER_ROUTE[0]}, "changes nothing"),
    ({"route": "a", "alert": PER_ROUTE[0], "disabled": False}, "changes nothing"),
    ({"route": "a", "alert": PER_ROUTE[0], "disabled": "yes"}, "disabled"),
    ({"route": "a", "alert": PER_ROUTE[0], "colour": 1}, "unknown keys"),
])
def test_bad_override_entries_are_named(entry: dict[str, object], problem: str) -> None:
    """Each invalid entry is a ValueError naming its index and the problem."""
    with pytest.raises(ValueError, match=r"overrides\[0\]") as info:
        load_overrides({"overrides": [entry]})
    assert problem in str(info.value)


def test_duplicate_override_is_rejected() -> None:
    """Two overrides of one alert for one route are an error, not a silent pick."""
    entry = {"route": "a", "alert": PER_ROUTE[0], "threshold": 1.0}
    with pytest.raises(ValueError, match="second override"):
        load_overrides({"overrides": [entry, entry]})


def test_shipped_demo_overrides_load() -> None:
    """deploy/prometheus/overrides.demo.yml is valid."""
    overrides = read_overrides(DEPLOY / "prometheus/overrides.demo.yml")
    assert {(o.route, o.alert) for o in overrides} >= {
        ("travel", "TurnrouterSlowFirstResponse"), ("travel", "TurnrouterAcknowledgmentOveruse")}
    # The path as a str reads the same (it raised a bare AttributeError: bounds17 L3).
    assert read_overrides(str(DEPLOY / "prometheus/overrides.demo.yml")) == overrides


JUNK = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                 max_size=4),
    max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(JUNK | st.fixed_dictionaries({"overrides": st.lists(
    st.dictionaries(st.sampled_from(["route", "alert", "threshold", "min_turns", "disabled",
                                     "x"]), JUNK, max_size=5), max_size=3)}))
def test_load_overrides_accepts_or_names_the_problem(data: object) -> None:
    """Any parsed YAML either loads into valid overrides or raises ValueError."""
    try:
        overrides = load_overrides(data)
    except ValueError as exc:
        message = str(exc)
        overrides = ()
    else:
        message = "ok"
    assert message
    rule_groups(overrides=overrides)  # and renders


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=300))
def test_overrides_file_junk_bytes_exit_2_with_one_line(tmp_path_factory: pytest.TempPathFactory,
                                                        data: bytes) -> None:
    """Any file content: the generator writes or exits 2 with one line, no traceback."""
    root = tmp_path_factory.mktemp("root")
    path = root / "overrides.yml"
    path.write_bytes(data)
    try:
        code = main(["--root", str(root / "out"), "--overrides", str(path)])
    except SystemExit as exc:
        code = exc.code  # type: ignore[assignment]
    assert code in (0, 2)


@pytest.mark.parametrize("where", ["--overrides", "alertmanager --out"])
def test_a_fifo_given_as_a_file_is_a_usage_error_not_a_hang(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str) -> None:
    """A FIFO (or any other non-regular file) as `--overrides` or as the Alertmanager
    configuration's `--out` exits 2 with one line naming it; it used to block for ever
    (ops7 D3)."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    argv = (["--root", str(tmp_path / "out"), "--overrides", str(fifo)]
            if where == "--overrides" else ["alertmanager", "--out", str(fifo)])
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "not a regular file" in err


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_an_empty_receiver_address_is_a_usage_error(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], how: str) -> None:
    """`--pager-url "$PAGER_URL"` with the variable unset (or the variable set empty) is
    refused, naming the receiver: it silently shipped the placeholder pager (ops7 D2)."""
    monkeypatch.delenv("TURNROUTER_ALERT_PAGER_URL", raising=False)
    argv = ["alertmanager", "--tickets-url", "http://t.example/", "--watchdog-url",
            "http://w.example/"]
    if how == "flag":
        argv += ["--pager-url", ""]
    else:
        monkeypatch.setenv("TURNROUTER_ALERT_PAGER_URL", " ")
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "pager receiver" in capsys.readouterr().err


def test_deeply_nested_overrides_file_is_a_usage_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A deeply nested YAML document ends in one error line, exit 2."""
    path = tmp_path / "deep.yml"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(SystemExit) as info:
        main(["--root", str(tmp_path / "out"), "--overrides", str(path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--overrides" in err


def test_root_that_is_a_file_is_a_usage_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--root FILE` exits 2 with one line naming the flag."""
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(SystemExit) as info:
        main(["--root", str(file)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--root must be a directory" in err


def test_root_under_a_file_fails_with_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A root that cannot be created (its parent is a file) exits 1 with one line."""
    file = tmp_path / "file"
    file.write_text("x")
    assert main(["--root", str(file / "sub")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write" in err


def test_generation_with_overrides_writes_them(tmp_path: Path) -> None:
    """`--overrides` lands in the rule file and the PrometheusRule."""
    path = tmp_path / "o.json"
    path.write_text(json.dumps({"overrides": [
        {"route": "travel", "alert": "TurnrouterSlowFirstResponse", "threshold": 9}]}))
    assert main(["--root", str(tmp_path / "out"), "--overrides", str(path)]) == 0
    for name in ("deploy/prometheus/rules/turnrouter.rules.yml",
                 "deploy/k8s/base/prometheusrule.yaml"):
        assert 'route="travel"} > 9' in (tmp_path / "out" / name).read_text()


def _alias_bomb(levels: int) -> str:
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


HOSTILE_FILES = st.one_of(
    st.sampled_from([
        b"#" + "\u00e9".encode() * (MAX_OVERRIDES_BYTES // 2 + 1),  # over the bound in bytes
        b" " * (MAX_OVERRIDES_BYTES + 1),
        _alias_bomb(9).encode(),
        ("overrides: [" + ", ".join(["*e"] * 2000) + "]\n").encode(),
        b"overrides:\n- {route: a, threshold: 1" + b"0" * 5000 + b"}\n",
        b"overrides:\n- {route: a, threshold: .nan}\n- {route: b, threshold: -.inf}\n",
        ("overrides:\n- {" + ", ".join(f"k{i}{'x' * 200}: 1" for i in range(2000))
         + "}\n").encode(),
        b"overrides:\n- {route: \"\\ud800\", threshold: 1}\n",
        b"[" * 50_000,
    ]),
    st.builds(lambda key, value: f"overrides:\n- {{{key}: {value}}}\n".encode(
        "utf-8", "surrogatepass"), st.text(max_size=10), st.text(max_size=10)),
)


@settings(max_examples=100, deadline=None)
@given(HOSTILE_FILES)
def test_hostile_overrides_files_exit_2_with_one_short_line(
        tmp_path_factory: pytest.TempPathFactory, data: bytes) -> None:
    """Oversized (in bytes), alias bombs, huge ints, NaN, thousands of keys, surrogates:
    the generator writes or exits 2 with one short line naming --overrides."""
    root = tmp_path_factory.mktemp("root")
    path = root / "overrides.yml"
    path.write_bytes(data)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
        main(["--root", str(root / "out"), "--overrides", str(path)])
    message = err.getvalue()
    assert message == "" or (message.count("\n") == 1 and "--overrides" in message
                             and len(message) < 2000), message[:300]
    if len(data) > MAX_OVERRIDES_BYTES:  # refused by size, never parsed truncated
        assert "larger than" in message


def test_an_endless_or_huge_overrides_file_is_refused(tmp_path: Path) -> None:
    """A file that never ends (/dev/zero) is no regular file: refused unread; a regular
    file past the bound is read only up to it, then refused."""
    with pytest.raises(ValueError, match="not a regular file"):
        read_overrides(Path("/dev/zero"))
    huge = tmp_path / "huge.yml"
    huge.write_bytes(b"#" * (MAX_OVERRIDES_BYTES + 1))
    with pytest.raises(ValueError, match="larger than"):
        read_overrides(huge)


def test_generation_says_which_overrides_it_applied(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A fresh root has no demo overrides: the rules carry none, and the command says so
    (and how to give yours); a root holding the demo's file, or `--overrides`, is named
    with its count."""
    assert main(["--root", str(tmp_path / "fresh")]) == 0
    out = capsys.readouterr().out
    assert "per-route overrides: none (the root has no deploy/prometheus/overrides.demo.yml" \
        in out and "--overrides FILE" in out
    assert "travel" not in (tmp_path / "fresh/deploy/prometheus/rules/turnrouter.rules.yml"
                            ).read_text()
    demo = DEPLOY / "prometheus/overrides.demo.yml"
    count = len(read_overrides(demo))
    assert main(["--root", str(tmp_path / "given"), "--overrides", str(demo)]) == 0
    assert f"per-route overrides: {count} from {demo}" in capsys.readouterr().out
    (tmp_path / "fresh/deploy/prometheus/overrides.demo.yml").write_text(demo.read_text())
    assert main(["--root", str(tmp_path / "fresh")]) == 0
    assert (f"per-route overrides: {count} from deploy/prometheus/overrides.demo.yml"
            in capsys.readouterr().out)


@pytest.mark.parametrize("given", [[], ["--pager-url", "http://p.example/"]])
def test_a_receiver_left_without_an_address_is_a_usage_error(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        given: list[str]) -> None:
    """No address for a receiver (no flag, its variable unset or misspelt) is refused in
    one line naming each receiver left and its variable: it wrote a valid-looking file
    whose `.invalid` receivers page nobody (newcomer9 D1). `--placeholders` writes
    them on purpose."""
    for variable in ("TURNROUTER_ALERT_PAGER_URL", "TURNROUTER_ALERT_TICKETS_URL",
                     "TURNROUTER_ALERT_WATCHDOG_URL"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("TURNROUTER_ALERTS_PAGER_URL", "http://typo.example/")
    with pytest.raises(SystemExit) as exited:
        main(["alertmanager", *given])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "TURNROUTER_ALERT_TICKETS_URL" in err and "TURNROUTER_ALERT_WATCHDOG_URL" in err
    assert ("TURNROUTER_ALERT_PAGER_URL" in err) == (not given)
    assert main(["alertmanager", *given, "--placeholders"]) == 0
    assert ".invalid" in capsys.readouterr().out
