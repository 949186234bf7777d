"""The `turnrouter` command: `demo` (the main job) and `tune` (acknowledgment delay)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

__all__ = ["demo_parser", "main"]


def _positive(value: str) -> float:
    number = float(value)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return number


def demo_parser() -> argparse.ArgumentParser:
    """The `turnrouter demo` flags (deployment files are tested against it)."""
    parser = argparse.ArgumentParser(
        prog="turnrouter demo",
        description="Run a simulated voice-assistant deployment on the embedded defaults.",
    )
    parser.add_argument("--duration", type=_positive, default=30.0,
                        help="seconds to run (default 30)")
    parser.add_argument("--serve", action="store_true",
                        help="keep running until interrupted (for dashboards)")
    parser.add_argument("--participants", type=int, default=40,
                        help="concurrent participants (default 40)")
    parser.add_argument("--seed", type=int, default=7, help="random seed (default 7)")
    parser.add_argument("--clarify-heavy", action="store_true",
                        help="scenario for alert testing: the general agent is down")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus /metrics on this port (0 picks a free one)")
    parser.add_argument("--metrics-host", default="127.0.0.1",
                        help="address to serve /metrics on (0.0.0.0 in containers)")
    parser.add_argument("--speed", type=_positive, default=1.0,
                        help="time compression of the simulated conversations")
    parser.add_argument("--quiet", action="store_true", help="no live progress line")
    return parser


def _demo(argv: Sequence[str]) -> int:
    parser = demo_parser()
    args = parser.parse_args(list(argv))
    if args.participants < 1:
        parser.error("--participants must be at least 1")

    import anyio

    from ..demo import DemoConfig, run_demo

    config = DemoConfig(duration=args.duration, serve=args.serve,
                        participants=args.participants, seed=args.seed,
                        clarify_heavy=args.clarify_heavy, metrics_port=args.metrics_port,
                        metrics_host=args.metrics_host,
                        speed=args.speed, progress=not args.quiet)
    try:
        report = anyio.run(run_demo, config)
    except KeyboardInterrupt:
        return 130
    return 0 if report.lost_turns == 0 else 1


def _tune(argv: Sequence[str]) -> int:
    try:
        from ._tune import tune_main
    except ImportError as exc:  # pragma: no cover - lands with acknowledgments
        print(f"turnrouter tune is unavailable: {exc}", file=sys.stderr)
        return 2
    return tune_main(list(argv))


def _worker(argv: Sequence[str]) -> int:
    from ._worker import worker_main

    return worker_main(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `turnrouter` command."""
    args = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": _demo, "tune": _tune, "worker": _worker}
    if not args or args[0] in {"-h", "--help"} or args[0] not in commands:
        print("usage: turnrouter {demo,tune,worker} [options]\n\n"
              "  demo   run a simulated deployment (the main job)\n"
              "  tune   what-if analysis of the acknowledgment delay\n"
              "  worker one router replica on NATS JetStream", file=sys.stderr)
        return 0 if args and args[0] in {"-h", "--help"} else 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return commands[args[0]](args[1:])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
