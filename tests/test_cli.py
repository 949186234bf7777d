"""The `turnrouter` command: usage, demo flags, and the deployment files' commands."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import io
import json
import logging
import math
import re
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import turnrouter
from turnrouter import ConfigurationError
from turnrouter.cli import demo_parser, main, worker_parser

ROOT = Path(__file__).resolve().parents[1]


def test_usage_without_a_command(capsys: pytest.CaptureFixture[str]) -> None:
    """No command prints usage on stderr and exits 2."""
    assert main([]) == 2
    captured = capsys.readouterr()
    assert "turnrouter: error: no command given" in captured.err
    assert "usage: turnrouter" in captured.err
    assert captured.out == ""


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_goes_to_stdout(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([flag]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("usage: turnrouter")
    assert "demo" in captured.out and "worker" in captured.out
    assert captured.err == ""


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([flag]) == 0
    assert capsys.readouterr().out == f"turnrouter {turnrouter.__version__}\n"


def test_version_matches_the_package_metadata() -> None:
    assert turnrouter.__version__ == importlib.metadata.version("turnrouter")


@pytest.mark.parametrize(("argv", "named"), [
    (["dmeo"], "unknown command 'dmeo'"),
    (["--verbose", "demo"], "unknown option '--verbose'"),
    (["bad\nname"], "unknown command 'bad\\nname'"),
])
def test_an_unknown_command_is_named(argv: list[str], named: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    first = err.splitlines()[0]
    assert first.startswith("turnrouter: error: ") and named in first
    assert "choose from demo, tune, worker" in first


@given(st.lists(st.text(max_size=300), min_size=1, max_size=3))
def test_junk_commands_are_a_one_line_usage_error(argv: list[str]) -> None:
    assume(argv[0] not in {"demo", "tune", "worker", "-h", "--help", "-V", "--version"})
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(argv) == 2
    first = err.getvalue().splitlines()[0]
    assert first.startswith("turnrouter: error: ") and len(first) < 400


_SECRET_ARGS = [
    (["--nats-token", "S3CRET-tok"], "--nats-token"),
    (["--nats-pass=S3CRET-pw"], "--nats-pass=..."),
    (["--nats-password", "S3CRET-pw", "--foo"], "--nats-password --foo"),
    (["--tls=S3CRET-key"], "--tls=..."),  # ambiguous: --tls-ca, --tls-cert, --tls-key
    (["nats://svc:S3CRET-pw@nats:4222"], "unrecognized arguments: ..."),
    # review23: a value starting with "-", a short option's attached value, a colon.
    (["--nats-token", "-S3CRET-tok"], "--nats-token -..."),
    (["-pS3CRET-pw"], "unrecognized arguments: -..."),
    (["--nats-token:S3CRET-tok"], "unrecognized arguments: -..."),
    (["--=S3CRET-tok"], "--=..."),
]


@pytest.mark.parametrize("command", [
    ["worker", "--nats", "nats://127.0.0.1:1", "--app", "a:b"], ["demo"],
    ["tune", "--samples", "s.jsonl"]])
@pytest.mark.parametrize(("extra", "shown"), _SECRET_ARGS)
def test_a_usage_error_never_echoes_an_argument_value(
        command: list[str], extra: list[str], shown: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A guessed secret flag (`--nats-token S3CRET`) is not one of ours: the usage error
    names the flag but not its value, which may be a password."""
    assert main([*command, *extra]) == 2
    err = capsys.readouterr().err
    assert "S3CRET" not in err
    assert len(err.splitlines()) == 1 and shown in err


@pytest.mark.parametrize("word", ["--nats-token=S3CRET", "-pS3CRET", "--x:S3CRET"])
def test_an_unknown_option_before_the_command_is_named_without_its_value(
        word: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([word, "demo"]) == 2
    err = capsys.readouterr().err
    assert "S3CRET" not in err and "unknown option" in err.splitlines()[0]


@given(st.sampled_from(["worker", "demo", "tune"]),
       st.sampled_from(["--nats-token", "--password", "--nats-p", "--tls", "-x", ""]),
       st.text(st.characters(blacklist_categories=("Cs", "Zs", "Cc")), min_size=1,
               max_size=40),
       st.booleans())
def test_no_unrecognized_value_reaches_a_usage_error(
        command: str, flag: str, value: str, joined: bool) -> None:
    secret = "Zq7" + value
    argv = ([f"{flag}={secret}"] if joined and flag else [flag, secret] if flag
            else [secret])
    prefix = ["--nats", "nats://127.0.0.1:1", "--app", "a:b"] if command == "worker" else []
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main([command, *prefix, *argv])
    assume(code == 2)  # a value argparse took as a known flag's is not this test's
    assert secret not in err.getvalue()


def test_subcommand_help_goes_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--help"]) == 0
    captured = capsys.readouterr()
    assert "usage: turnrouter demo" in captured.out and captured.err == ""


@pytest.mark.parametrize(("flags", "named"), [
    (["--duration", "0"], "--duration"),
    (["--duration", "nan"], "--duration"),
    (["--duration", "1e-320"], "--duration"),
    (["--participants", "0"], "--participants"),
    (["--participants", "10001"], "--participants"),
    (["--speed", "inf"], "--speed"),
    (["--speed", "-1"], "--speed"),
    (["--speed", "1e-9"], "--speed"),  # a run of any length would say nothing
    (["--metrics-port", "99999"], "--metrics-port"),
    (["--metrics-port", "-1"], "--metrics-port"),
    (["--metrics-port", "1e3"], "--metrics-port"),
    (["--metrics-host", "a b"], "--metrics-host"),
    (["--ack-delay", "-0.5"], "--ack-delay"),
    (["--ack-delay", "inf"], "--ack-delay"),
    (["--ack-delay", "never"], "not a number: 'never' (seconds, or off)"),
    (["--otlp-endpoint", "file:///etc/passwd"], "--otlp-endpoint"),
    # Ran with every span batch failing, one ERROR line each (bounds17 M5):
    (["--otlp-endpoint", "http://[::1"], "--otlp-endpoint: is not a URL"),
    (["--otlp-endpoint", "http://"], "--otlp-endpoint: must be an http(s) URL with a host"),
    (["--otlp-endpoint", "http://127.0.0.1:99999"], "Port out of range"),
    (["--otlp-protocol", "udp"], "--otlp-protocol"),
    (["--seed", "x"], "--seed"),
    (["--fail-route", ""], "--fail-route"),
    (["--slow-route", "x" * 101], "--slow-route"),
    (["--duration", "1", "--fail-route", "nope"], "--fail-route: unknown demo route 'nope'"),
    (["--duration", "1", "--slow-route", "nan"], "--slow-route: unknown demo route 'nan'"),
    (["--no-such-flag"], "unrecognized"),
])
def test_demo_usage_errors_exit_2_with_one_line(
        capsys: pytest.CaptureFixture[str], flags: list[str], named: str) -> None:
    """Out-of-range or malformed flags: exit 2, one stderr line naming the flag."""
    assert main(["demo", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("turnrouter demo: error: ") and named in err


def test_demo_unknown_metrics_host_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """An address that cannot be served ends in one line, exit 2, before the demo runs."""
    assert main(["demo", "--metrics-port", "0", "--metrics-host", "no-such-host.invalid",
                 "--duration", "1", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot serve metrics on 'no-such-host.invalid'" in err


def test_demo_unwritable_samples_file_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A samples file that cannot be written ends in one line, exit 2."""
    assert main(["demo", "--samples", str(tmp_path / "missing" / "s.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--samples" in err


def test_demo_help_names_tracing_flags_and_environment(
        capsys: pytest.CaptureFixture[str]) -> None:
    """--help exits 0 and documents the tracing flags and OTEL variables."""
    assert main(["demo", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for text in ("--ack-delay", "--samples", "--otlp-endpoint", "--otlp-protocol",
                 "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_TRACES_SAMPLER"):
        assert text in out


FLAGS = ["--duration", "--participants", "--seed", "--metrics-port", "--metrics-host",
         "--speed", "--ack-delay", "--otlp-endpoint", "--otlp-protocol", "--samples",
         "--fail-route", "--slow-route"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(FLAGS) | st.text(max_size=12), max_size=6),
       st.lists(st.text(max_size=30) | st.floats().map(repr) | st.integers().map(str),
                max_size=6))
def test_demo_flag_junk_never_tracebacks(flags: list[str], values: list[str]) -> None:
    """Any flags and values: parsing either succeeds with values in range, or is a usage
    error (SystemExit 2), never another exception."""
    argv = [item for pair in zip(flags, values, strict=False) for item in pair]
    try:
        args = demo_parser().parse_args(argv)
    except SystemExit as exc:
        code = exc.code
        args = None
    else:
        code = None
    if args is None:
        assert code in (0, 2)
        return
    assert 0 < args.duration < float("inf") and 1 <= args.participants <= 10_000
    assert 0 < args.speed <= 1000
    assert args.metrics_port is None or 0 <= args.metrics_port <= 65535
    assert args.ack_delay is None or 0 < args.ack_delay <= 60


def _deployed_demo_commands() -> list[list[str]]:
    compose = yaml.safe_load((ROOT / "deploy/compose/compose.yaml").read_text())
    deployment = yaml.safe_load((ROOT / "deploy/k8s/base/deployment.yaml").read_text())
    dockerfile = (ROOT / "deploy/compose/Dockerfile").read_text()
    cmd = re.search(r"^CMD (\[.*\])$", dockerfile, re.MULTILINE)
    assert cmd is not None
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return [
        compose["services"]["turnrouter"]["command"][1:],
        ["turnrouter", *container["args"]][1:],
        json.loads(cmd.group(1))[1:],
    ]


@pytest.mark.parametrize("command", _deployed_demo_commands())
def test_deployment_files_use_real_demo_flags(command: list[str]) -> None:
    """Compose, Kubernetes and the Dockerfile run `turnrouter demo` with flags it accepts,
    serving metrics on all interfaces so Prometheus can scrape the container."""
    assert command[0] == "demo"
    args = demo_parser().parse_args(command[1:])
    assert args.serve
    assert args.metrics_host == "0.0.0.0"
    assert args.metrics_port == 9464


def test_demo_grpc_without_its_exporter_is_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """--otlp-protocol grpc without the gRPC exporter installed: exit 2, one line naming
    the package, before the demo runs."""
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
                        None)
    assert main(["demo", "--otlp-endpoint", "http://127.0.0.1:4317", "--otlp-protocol",
                 "grpc", "--duration", "1", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "opentelemetry-exporter-otlp-proto-grpc" in err
    assert "pip install opentelemetry-exporter-otlp-proto-grpc" in err


def test_demo_http_without_its_exporter_says_how_to_install_it(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """--otlp-endpoint without the otlp extra: one line naming the package and how to
    install it (newcomer22: it named only the package)."""
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter",
                        None)
    assert main(["demo", "--otlp-endpoint", "http://127.0.0.1:4318", "--duration", "1",
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install -e '.[otlp]'" in err


def test_demo_write_failure_during_the_run_is_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A samples file that fails while the demo runs (a full disk: /dev/full) ends in one
    line and exit 1, not a traceback."""
    if not Path("/dev/full").exists():
        pytest.fail("this test needs /dev/full (Linux)")
    quiet_filters = [list(logging.getLogger(n).filters) for n in ("turnrouter",
                                                                   "turnrouter.runtime")]
    assert main(["demo", "--samples", "/dev/full", "--duration", "1", "--speed", "10",
                 "--participants", "5", "--quiet", "--metrics-port", "0"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err
    assert "--samples '/dev/full': samples not written" in err  # named (ops7 D5)
    if Path("/proc/version").exists():  # a file that opens but takes no writes
        assert main(["demo", "--samples", "/proc/version", "--duration", "1", "--speed",
                     "10", "--participants", "5", "--quiet", "--metrics-port", "0"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--samples '/proc/version'" in err
    # Cleanup ran past the failure: the demo's log filters are gone again.
    assert [list(logging.getLogger(n).filters) for n in ("turnrouter",
                                                         "turnrouter.runtime")] == quiet_filters


#: Flag values an operator (or a script) can pass: any code point (lone surrogates, NUL),
#: numbers too large for a float or an int parse, NaN and infinities, huge texts.
ARG_JUNK = st.one_of(
    st.text(st.characters(exclude_categories=()), max_size=30),
    st.sampled_from(["1e400", "-1e400", "nan", "inf", "-0", "0x10", "1_000", "\x00", "\ud800",
                     "9" * 5000, "off", "OFF "]),
    st.builds(lambda char, size: char * size, st.sampled_from(["9", "é", "\ud800", " "]),
              st.sampled_from([10_000, 100_000])),
)


def parsed_or_usage_error(parser: argparse.ArgumentParser,
                          argv: list[str]) -> argparse.Namespace | None:
    """The parsed flags, or None after a usage error (which must exit 2)."""
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        code = exc.code
        assert code == 2
        return None


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(FLAGS), ARG_JUNK), max_size=4))
def test_demo_flags_take_any_code_point_and_huge_values(pairs: list[tuple[str, str]]) -> None:
    """Junk, huge and unencodable flag values parse into range or are a usage error (2)."""
    args = parsed_or_usage_error(demo_parser(), [item for pair in pairs for item in pair])
    if args is None:
        return
    assert 0 < args.duration <= 365 * 86400 and 1 <= args.participants <= 10_000
    assert 0 < args.speed <= 1000 and -(2**63) <= args.seed < 2**63
    assert args.ack_delay is None or 0 < args.ack_delay <= 60
    assert args.metrics_host.isprintable() and len(args.metrics_host) <= 253
    for route in [*args.fail_route, *args.slow_route]:
        assert route.isprintable() and 1 <= len(route) <= 100


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=20), st.sampled_from(["\x00", "\ud800", "\udbff"]), st.text(max_size=20))
def test_demo_unopenable_samples_paths_are_one_line(head: str, bad: str, tail: str) -> None:
    """A --samples path with a NUL or a high lone surrogate (no file name can hold it)
    exits 2 with one line naming the flag, before any demo runs."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        # `--samples=PATH`: a path starting with "-" is still the flag's value.
        status = main(["demo", f"--samples={head + bad + tail}", "--quiet"])
    assert status == 2
    message = err.getvalue()
    assert message.count("\n") == 1 and message.startswith("turnrouter demo: error: --samples")


def test_each_command_runs_twice_in_one_process(capsys: pytest.CaptureFixture[str]) -> None:
    """main() dispatches tune and worker the same way on every call, not only the first."""
    for _ in range(2):
        assert main(["tune", "--samples", "/nonexistent/samples.jsonl"]) == 2
        assert "samples.jsonl" in capsys.readouterr().err
        assert main(["worker", "--app", "x:y"]) == 2
        assert "--nats" in capsys.readouterr().err


WORKER_FLAGS = ["--nats", "--app", "--prefix", "--partitions", "--failover-timeout",
                "--ack-wait", "--drain-timeout", "--mark-after", "--replica", "--metrics-port",
                "--metrics-host", "--max-input-wait"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(WORKER_FLAGS), ARG_JUNK), max_size=5))
def test_worker_flags_are_a_config_or_a_usage_error(pairs: list[tuple[str, str]]) -> None:
    """Junk worker flag values: a usage error (2), or a NatsConfig (or its documented
    ConfigurationError) built from them, as `turnrouter worker` builds it."""
    from turnrouter.runtime.nats import NatsConfig

    argv = ["--nats", "nats://127.0.0.1:1", "--app", "os:getcwd",
            *[item for pair in pairs for item in pair]]
    args = parsed_or_usage_error(worker_parser(), argv)
    if args is None:
        return
    assert args.metrics_port is None or 0 <= args.metrics_port <= 65535
    try:
        config = NatsConfig(url=args.nats, prefix=args.prefix, partitions=args.partitions,
                            failover_timeout=args.failover_timeout, ack_wait=args.ack_wait,
                            drain_timeout=args.drain_timeout, mark_after=args.mark_after,
                            max_input_wait=args.max_input_wait)
    except ConfigurationError:
        return
    assert 1 <= config.partitions <= 1000 and math.isfinite(config.failover_timeout)
    assert 0 < config.max_input_wait <= 366 * 86400


def test_demo_duration_with_serve_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """--serve runs until stopped: a --duration beside it is refused (exit 2, one line)
    rather than silently ignored (newcomer18 F12: the run went on until killed)."""
    assert main(["demo", "--serve", "--duration", "1"]) == 2
    assert main(["demo", "--serve", "--duration", "30"]) == 2
    err = capsys.readouterr().err
    assert "--duration does not apply with --serve" in err and "Traceback" not in err
