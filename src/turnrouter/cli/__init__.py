"""The `turnrouter` command: `demo` (the main job), `tune` (acknowledgment delay) and
`worker` (one replica on NATS JetStream).

Usage errors (a bad flag, a value out of range, an address that cannot be served) exit 2
with one line on stderr and no traceback.
"""

from __future__ import annotations

import argparse
import errno
import logging
import math
import os
import stat
import sys
import urllib.parse
from collections.abc import Sequence

from .._config import MAX_ACKNOWLEDGMENT_DELAY_SECS
from .._redact import redact_url
from ._parser import OneLineParser, option_name
from ._worker import worker_parser

__all__ = ["OneLineParser", "demo_parser", "main", "worker_parser"]

#: Upper bounds of the demo's numeric flags (beyond them the run is pointless or unsafe).
MAX_DURATION = 365 * 86400.0
#: Shorter than this, a run is no run (`1e-320` ran 0 s and exited 0: redteam14).
MIN_DURATION = 0.1
MAX_SPEED = 1000.0
#: Slower than this, a run of any length says and measures nothing (a typo, mostly).
MIN_SPEED = 0.01
MAX_PARTICIPANTS = 10_000
MAX_ACK_DELAY = MAX_ACKNOWLEDGMENT_DELAY_SECS


def _route_name(value: str) -> str:
    if not 1 <= len(value) <= 100 or not value.isprintable():
        raise argparse.ArgumentTypeError(f"not a route name: {value[:100]!r}")
    return value


def _number(value: str, *, low: float, high: float, low_open: bool) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not math.isfinite(number) or number > high or (
            number <= low if low_open else number < low):
        bound = f"{'>' if low_open else '>='} {low:g} and <= {high:g}"
        raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {value!r}")
    return number


def _duration(value: str) -> float:
    return _number(value, low=MIN_DURATION, high=MAX_DURATION, low_open=False)


def _speed(value: str) -> float:
    return _number(value, low=MIN_SPEED, high=MAX_SPEED, low_open=False)


def _ack_delay(value: str) -> float | None:
    if value.strip().lower() == "off":
        return None
    try:
        return _number(value, low=0.0, high=MAX_ACK_DELAY, low_open=True)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (seconds, or off)") from None


def _integer(value: str, low: int, high: int) -> int:
    try:
        number = int(value, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
    if not low <= number <= high:
        raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {value!r}")
    return number


def _participants(value: str) -> int:
    return _integer(value, 1, MAX_PARTICIPANTS)


def _port(value: str) -> int:
    return _integer(value, 0, 65535)


def _seed(value: str) -> int:
    return _integer(value, -(2**63), 2**63 - 1)


def _host(value: str) -> str:
    if not value or len(value) > 253 or not value.isprintable() or any(
            c.isspace() for c in value):
        raise argparse.ArgumentTypeError(f"not a host name or address: {value!r}")
    return value


def _endpoint(value: str) -> str:
    """An http(s) URL with a host and a valid port, as OTEL_EXPORTER_OTLP_ENDPOINT is
    checked: `http://[::1`, `http://` or port 99999 ran the demo with every span batch
    failing, one ERROR line each (bounds17 M5)."""
    if (not value.startswith(("http://", "https://")) or len(value) > 2000
            or not value.isprintable() or any(c.isspace() for c in value)):
        raise argparse.ArgumentTypeError(f"must be an http(s) URL, got {value[:200]!r}")
    try:
        parts = urllib.parse.urlsplit(value)
        parts.port  # noqa: B018 (parses it: a bad port raises ValueError)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"is not a URL ({exc}): {redact_url(value)[:200]!r}") from None
    if not parts.hostname:
        raise argparse.ArgumentTypeError(
            f"must be an http(s) URL with a host, got {redact_url(value)[:200]!r}")
    return value


def demo_parser() -> argparse.ArgumentParser:
    """The `turnrouter demo` flags (deployment files are tested against it)."""
    from ..demo import DEFAULT_ACK_DELAY, OTLP_PROTOCOLS

    parser = OneLineParser(
        prog="turnrouter demo",
        description="Run a simulated voice-assistant deployment on the embedded defaults. "
                    "Tracing: spans go to --otlp-endpoint (or OTEL_EXPORTER_OTLP_ENDPOINT); "
                    "OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER and "
                    "OTEL_TRACES_SAMPLER_ARG are honoured.",
    )
    parser.add_argument("--duration", type=_duration, default=_DEFAULT_DURATION,
                        help="seconds to run (default 30; not with --serve)")
    parser.add_argument("--serve", action="store_true",
                        help="keep running until Ctrl-C or SIGTERM, then report (for "
                             "dashboards and alert rehearsals: add --metrics-port, or "
                             "nothing is scraped)")
    parser.add_argument("--participants", type=_participants, default=40,
                        help=f"concurrent participants, 1-{MAX_PARTICIPANTS} (default 40)")
    parser.add_argument("--seed", type=_seed, default=7, help="random seed (default 7)")
    parser.add_argument("--clarify-heavy", action="store_true",
                        help="scenario for alert testing: the general agent is down")
    parser.add_argument("--fail-route", action="append", default=[], type=_route_name,
                        metavar="ROUTE",
                        help="alert rehearsal: every answer of ROUTE fails (repeatable)")
    parser.add_argument("--slow-route", action="append", default=[], type=_route_name,
                        metavar="ROUTE",
                        help="alert rehearsal: ROUTE takes about 3 s to start answering "
                             "(repeatable)")
    parser.add_argument("--metrics-port", type=_port, default=None,
                        help="serve Prometheus /metrics on this port (0 picks a free one)")
    parser.add_argument("--metrics-host", type=_host, default="127.0.0.1",
                        help="address to serve /metrics on (0.0.0.0 in containers)")
    parser.add_argument("--speed", type=_speed, default=1.0,
                        help=f"time compression of the simulated conversations "
                             f"({MIN_SPEED:g} to {MAX_SPEED:g})")
    parser.add_argument("--ack-delay", type=_ack_delay, default=DEFAULT_ACK_DELAY,
                        metavar="SECONDS",
                        help=f"fallback acknowledgment delay in simulated seconds, or 'off' "
                             f"(default {DEFAULT_ACK_DELAY:g})")
    parser.add_argument("--samples", metavar="FILE",
                        help="append first-response timing samples (JSON lines, for "
                             "`turnrouter tune --samples`) to FILE")
    parser.add_argument("--otlp-endpoint", type=_endpoint, metavar="URL",
                        help="export spans over OTLP to URL (default: "
                             "OTEL_EXPORTER_OTLP_ENDPOINT; unset: no export)")
    parser.add_argument("--otlp-protocol", choices=OTLP_PROTOCOLS,
                        help="OTLP protocol (default: OTEL_EXPORTER_OTLP_PROTOCOL or "
                             "http/protobuf; grpc needs opentelemetry-exporter-otlp-proto-grpc)")
    parser.add_argument("--no-shedding", action="store_true",
                        help="turn admission control off (a saturated router then keeps "
                             "taking every turn; see docs/limits.md)")
    parser.add_argument("--quiet", action="store_true", help="no live progress line")
    return parser


class _DefaultDuration(float):
    """The demo's default run time: the one object, told apart from `--duration 30`."""


_DEFAULT_DURATION: float = _DefaultDuration(30.0)


def _demo(argv: Sequence[str]) -> int:
    parser = demo_parser()
    args = parser.parse_args(list(argv))
    if args.serve and args.duration is not _DEFAULT_DURATION:  # (ignored: newcomer18 F12)
        parser.error("--duration does not apply with --serve, which runs until stopped")

    import anyio

    from .._exceptions import ConfigurationError
    from ..demo import DemoConfig, run_demo

    if args.samples is not None:
        try:
            _writable_file(args.samples)
        except (OSError, ValueError) as exc:  # ValueError: a NUL or a lone surrogate
            print(f"turnrouter demo: error: --samples: cannot write {args.samples!r}: "
                  f"{getattr(exc, 'strerror', None) or exc}", file=sys.stderr)
            return 2
    config = DemoConfig(duration=args.duration, serve=args.serve,
                        participants=args.participants, seed=args.seed,
                        clarify_heavy=args.clarify_heavy, metrics_port=args.metrics_port,
                        metrics_host=args.metrics_host,
                        speed=args.speed, progress=not args.quiet,
                        acknowledgment_delay=args.ack_delay, samples_path=args.samples,
                        otlp_endpoint=args.otlp_endpoint, otlp_protocol=args.otlp_protocol,
                        failing_routes=tuple(args.fail_route),
                        slow_routes=tuple(args.slow_route),
                        shedding=not args.no_shedding)
    try:
        report = anyio.run(run_demo, config)
    except KeyboardInterrupt:
        # A timed run stopped early has no report (`--serve` runs until Ctrl-C, then
        # drains and reports): said, not a silent exit (newcomer22).
        print("turnrouter demo: interrupted before the end of the run: no report "
              "(--serve runs until Ctrl-C, then reports)", file=sys.stderr)
        return 130
    except ConfigurationError as exc:
        print(f"turnrouter demo: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. the samples file's disk filled up during the run
        print(f"turnrouter demo: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    return 0 if report.lost_turns == 0 else 1


def _tune_command(argv: Sequence[str]) -> int:
    # Not named `_tune`: importing the submodule `._tune` binds that name in this module.
    from ._tune import tune_main

    return tune_main(list(argv))


def _worker_command(argv: Sequence[str]) -> int:
    from ._worker import worker_main

    return worker_main(argv)


USAGE = """usage: turnrouter [--version] [--help] {demo,tune,worker} [options]

  demo   run a simulated deployment (the main job)
  tune   what-if analysis of the acknowledgment delay
  worker one router replica on NATS JetStream

`turnrouter COMMAND --help` describes a command's options."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `turnrouter` command; returns the exit status.

    `--help` prints the usage on stdout (status 0), `--version` the version; a missing or
    unknown command is a usage error: its name and the usage on stderr, status 2.
    """
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except BrokenPipeError:
        # The reader left (`turnrouter tune ... | head`): stop quietly, as Unix tools do.
        # Python flushes stdout at exit: point it at /dev/null so that does not fail too.
        _silence_stdout()
        return 128 + 13  # what a shell reports for a process ended by SIGPIPE


def _writable_file(path: str) -> None:
    """Open `path` for appending without waiting (a FIFO with no reader would block the
    demo before it starts): `OSError` unless it is a file (or a character device such as
    /dev/null) it can write."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o644)
    try:
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISCHR(mode)):
            raise OSError(errno.EINVAL, "not a regular file")
    finally:
        os.close(fd)


def _silence_stdout() -> None:
    try:
        fileno = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (a test's capture)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fileno)
    finally:
        os.close(devnull)


def _main(args: list[str]) -> int:
    commands = {"demo": _demo, "tune": _tune_command, "worker": _worker_command}
    if args and args[0] in {"-h", "--help"}:
        print(USAGE)
        return 0
    if args and args[0] in {"-V", "--version"}:
        from .. import __version__

        print(f"turnrouter {__version__}")
        return 0
    if not args or args[0] not in commands:
        word = args[0][:100] if args else ""  # repr: one line, whatever it holds
        problem = ("no command given" if not args else
                   f"unknown option {option_name(word)!r}" if word.startswith("-") else
                   f"unknown command {word!r}")
        print(f"turnrouter: error: {problem} (choose from demo, tune, worker)\n{USAGE}",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return commands[args[0]](args[1:])
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2, already printed)
        return exc.code if isinstance(exc.code, int) else 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
