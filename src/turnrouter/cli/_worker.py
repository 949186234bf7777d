"""`turnrouter worker`: one router replica on NATS JetStream (see docs/distributed.md)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import signal
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

__all__ = ["load_factory", "worker_main", "worker_parser"]


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line on stderr, exit status 2 (as `turnrouter demo`)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _port(value: str) -> int:
    try:
        number = int(value, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {value!r}")
    return number


def worker_parser() -> argparse.ArgumentParser:
    """The `turnrouter worker` flags (deployment files are tested against it)."""
    parser = _Parser(
        prog="turnrouter worker",
        description="Run one replica of your router on NATS JetStream.")
    parser.add_argument("--nats", required=True, help="NATS server URL (nats://host:4222)")
    parser.add_argument("--app", required=True,
                        help="module:factory; factory(WorkerContext) returns an AgentRouter")
    parser.add_argument("--prefix", default="turnrouter", help="subject prefix")
    parser.add_argument("--partitions", type=int, default=16,
                        help="partitions of the deployment (fixed; default 16)")
    parser.add_argument("--failover-timeout", type=float, default=1.0,
                        help="seconds without pulls before a partition moves (default 1)")
    parser.add_argument("--ack-wait", type=float, default=1.5,
                        help="seconds before an unacknowledged input is redelivered")
    parser.add_argument("--drain-timeout", type=float, default=20.0,
                        help="seconds a graceful end waits for running turns (default 20)")
    parser.add_argument("--mark-after", type=float, default=0.005,
                        help="seconds a turn may run before it is marked in flight so its "
                             "message can be acknowledged (default 0.005)")
    parser.add_argument("--replica", default=None, help="replica name (default random)")
    parser.add_argument("--metrics-port", type=_port, default=None,
                        help="serve Prometheus /metrics on this port (0 picks a free one)")
    parser.add_argument("--metrics-host", default="127.0.0.1",
                        help="address to serve /metrics on (0.0.0.0 in containers)")
    return parser


def load_factory(spec: str) -> Any:
    """The callable named by `module:attribute` (ValueError naming what is wrong)."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"--app must be module:factory, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except (ImportError, ValueError, TypeError) as exc:  # relative or malformed names too
        raise ValueError(f"--app: cannot import {module_name!r}: {exc}") from exc
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ValueError(f"--app: {module_name}.{attribute} is not a callable")
    return factory


def worker_main(argv: Sequence[str]) -> int:
    parser = worker_parser()
    args = parser.parse_args(list(argv))
    try:
        from ..runtime.nats import NatsConfig, NatsWorker
    except ImportError as exc:
        print(f"turnrouter worker needs the nats extra (pip install 'turnrouter[nats]'): "
              f"{exc}", file=sys.stderr)
        return 2
    from .._exceptions import TurnrouterError

    try:
        factory = load_factory(args.app)
        config = NatsConfig(url=args.nats, prefix=args.prefix, partitions=args.partitions,
                            failover_timeout=args.failover_timeout, ack_wait=args.ack_wait,
                            drain_timeout=args.drain_timeout, mark_after=args.mark_after)
    except (ValueError, TurnrouterError) as exc:
        parser.error(str(exc))
    from prometheus_client import CollectorRegistry

    from ..telemetry import serve_metrics

    registry = CollectorRegistry()
    worker = NatsWorker(factory, config, registry=registry, replica=args.replica)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.request_stop)
        task = asyncio.create_task(worker.run())
        ready = asyncio.create_task(worker.ready.wait())
        await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
        if worker.ready.is_set():
            # This process is the worker's: keep its start-up heap (modules, the router)
            # out of full collections, which otherwise scan it all, 20-29 ms each under
            # bench_distributed (2-3 ms after this), stalling every turn in flight.
            gc.freeze()
            print(f"worker {worker.replica} ready", flush=True)
        await task

    server = None
    if args.metrics_port is not None:
        try:
            server = serve_metrics(args.metrics_port, registry=registry,
                                   addr=args.metrics_host)
        except (OSError, OverflowError, ValueError) as exc:
            print(f"turnrouter worker: error: cannot serve /metrics on "
                  f"{args.metrics_host}:{args.metrics_port}: {exc}", file=sys.stderr)
            return 2
        print(f"metrics: {server.url}", flush=True)
    try:
        asyncio.run(run())
    except TurnrouterError as exc:
        print(f"turnrouter worker: {exc}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.close()
    return 0
