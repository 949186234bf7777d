"""`turnrouter worker`: one router replica on NATS JetStream (see docs/distributed.md)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import difflib
import gc
import importlib
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

from ._parser import OneLineParser

__all__ = ["load_factory", "worker_main", "worker_parser"]

#: Environment variables read when the matching flag is absent (secrets belong here, not
#: on a command line every process listing shows).
ENV = {
    "nats": "TURNROUTER_NATS_URL",
    "nats_user": "TURNROUTER_NATS_USER",
    "nats_password": "TURNROUTER_NATS_PASSWORD",
    "nats_token": "TURNROUTER_NATS_TOKEN",
    "nats_creds": "TURNROUTER_NATS_CREDS",
    "nats_nkey": "TURNROUTER_NATS_NKEY",
    "tls_ca": "TURNROUTER_NATS_TLS_CA",
    "tls_cert": "TURNROUTER_NATS_TLS_CERT",
    "tls_key": "TURNROUTER_NATS_TLS_KEY",
}


#: How long past `--drain-timeout` a graceful stop may take (its last record writes and
#: hand-overs, the connection's drain) before the worker exits anyway.
STOP_GRACE_SECS = 10.0
#: A second signal this soon after the first is the same stop (`uv run` forwards the
#: terminal's SIGINT that the worker received too): only a later one forces the exit.
SAME_STOP_SECS = 1.0


def _force_exit(text: str) -> NoReturn:
    """End the process now: a graceful stop that cannot finish (a store that times every
    write out, a destination that ignores its cancellation) must not outlive the
    deployment's grace period, which ends with a kill -9 anyway. What the worker held
    goes to the next owner after `ack_wait`, as after a crash."""
    # Said on a best-effort basis: a reader that stopped reading (a full pipe) must not
    # hold the exit, so a timer thread exits anyway.
    threading.Timer(2.0, os._exit, (1,)).start()
    _say(text)
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    os._exit(1)


def _say(text: str) -> None:
    """A status line on standard output. A reader gone (a closed pipe: `| grep -m1
    ready`, a log sidecar that died) must stop neither the worker nor its graceful stop:
    the lines go to /dev/null from then on."""
    try:
        print(text, flush=True)
    except (OSError, ValueError):  # BrokenPipeError; ValueError: stdout closed
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, sys.stdout.fileno())
            finally:
                os.close(devnull)


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
    parser = OneLineParser(
        prog="turnrouter worker",
        description="Run one replica of your router on NATS JetStream.")
    parser.add_argument("--nats", default=None,
                        help="required: the NATS server URL, or a cluster's URLs "
                             "comma-separated (nats://host:4222); env TURNROUTER_NATS_URL")
    parser.add_argument("--app", required=True,
                        help="module:factory; factory(WorkerContext) returns an AgentRouter "
                             "(imported from --app-dir, the current directory by default)")
    parser.add_argument("--app-dir", default=".",
                        help="directory put first on the import path (default .)")
    parser.add_argument("--nats-user", default=None,
                        help="user name (env TURNROUTER_NATS_USER; the password only from "
                             "env TURNROUTER_NATS_PASSWORD)")
    parser.add_argument("--nats-creds", default=None, metavar="FILE",
                        help="a .creds file (user JWT + nkey seed; env TURNROUTER_NATS_CREDS)")
    parser.add_argument("--nats-nkey", default=None, metavar="FILE",
                        help="a file holding an nkey seed (env TURNROUTER_NATS_NKEY); a "
                             "token only from env TURNROUTER_NATS_TOKEN")
    parser.add_argument("--tls-ca", default=None, metavar="FILE",
                        help="CA certificates to verify the server (env TURNROUTER_NATS_TLS_CA)")
    parser.add_argument("--tls-cert", default=None, metavar="FILE",
                        help="client certificate (env TURNROUTER_NATS_TLS_CERT)")
    parser.add_argument("--tls-key", default=None, metavar="FILE",
                        help="client certificate's key (env TURNROUTER_NATS_TLS_KEY)")
    parser.add_argument("--front-api", default=None, metavar="PREFIX",
                        help="where the front ends' own account's JetStream API is imported, "
                             "for the worker to create that account's mirror of the output "
                             "stream (default: where deploy/nats/nats-server.conf imports it, "
                             "'$JS.FRONT.API', if anything answers there)")
    parser.add_argument("--prefix", default="turnrouter",
                        help="subject prefix: 1-64 of a-z, 0-9, - and _ (default turnrouter)")
    parser.add_argument("--partitions", type=int, default=16,
                        help="partitions of the deployment (fixed; default 16)")
    parser.add_argument("--failover-timeout", type=float, default=1.0,
                        help="seconds without pulls before a partition moves (default 1)")
    parser.add_argument("--ack-wait", type=float, default=1.5,
                        help="seconds before an unacknowledged input is redelivered (default 1.5)")
    parser.add_argument("--drain-timeout", type=float, default=20.0,
                        help="seconds a graceful end waits for running turns (default 20)")
    parser.add_argument("--mark-after", type=float, default=0.005,
                        help="seconds a turn may run before it is marked in flight so its "
                             "message can be acknowledged (default 0.005)")
    parser.add_argument("--max-queued-per-participant", type=int, default=1000,
                        metavar="N",
                        help="inputs of one participant and kind the input stream keeps "
                             "queued; past it the oldest is dropped (a flooding client "
                             "holds at most this many ahead of its partition; default 1000)")
    parser.add_argument("--state-max-age", type=float, default=30 * 86400.0,
                        metavar="SECONDS",
                        help="how long a participant's record is kept after its last "
                             "write, when this worker creates the state bucket (default "
                             "30 days)")
    parser.add_argument("--max-input-wait", type=float, default=10.0,
                        help="seconds a query may wait in the input stream and still run; "
                             "one delivered later is answered with the router's busy text "
                             "and counted (rejected, reason expired) instead: size it to "
                             "what a conversation tolerates (default 10; it bounds when a "
                             "turn starts, not when the busy text is heard)")
    parser.add_argument("--reconnect-for", type=float, default=60.0,
                        help="seconds to ride out a lost, frozen or not yet started NATS "
                             "server or a missing stream (retrying every 0.5 s, a lost "
                             "connection every 0.1 s; a log line per failed attempt at most "
                             "every 0.5 s) before exiting with an error (default 60)")
    parser.add_argument("--idle-after", type=float, default=1800.0, metavar="SECS",
                        help="seconds without an input after which a participant is let go "
                             "from this worker's memory (its record keeps its state for its "
                             "next input), so sessions that end without 'left' free their "
                             "slot (default 1800)")
    parser.add_argument("--replicas", type=int, default=1, metavar="N",
                        help="copies a NATS cluster keeps of each stream and of the state "
                             "bucket (JetStream replication factor, 1-5; 3 on a three-server "
                             "cluster rides out the loss of a server; default 1)")
    parser.add_argument("--replica", default=None, help="replica name (default random)")
    parser.add_argument("--metrics-port", type=_port, default=None,
                        help="serve Prometheus /metrics on this port (0 picks a free one)")
    parser.add_argument("--metrics-host", default="127.0.0.1",
                        help="address to serve /metrics on (default 127.0.0.1; 0.0.0.0 in "
                             "containers); with --metrics-port, checked at start-up")
    parser.add_argument("--ready-file", default=None, metavar="PATH",
                        help="written (the replica name) while the worker serves, removed "
                             "while it cannot (NATS lost, a stream missing) and when it "
                             "ends: a readiness probe checks that it exists (its directory "
                             "must exist)")
    parser.add_argument("--debug", action="store_true",
                        help="print tracebacks of start-up errors (one line otherwise)")
    return parser


def load_factory(spec: str) -> Any:
    """The callable named by `module:attribute` (ValueError naming what is wrong)."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"--app must be module:factory, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # missing, malformed, relative, or failing at import
        detail = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        raise ValueError(f"--app: cannot import {module_name!r}: {detail}") from exc
    if not hasattr(module, attribute):
        near = difflib.get_close_matches(attribute, [name for name in dir(module)
                                                     if not name.startswith("_")], n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ValueError(f"--app: module {module_name!r} has no {attribute[:100]!r}{hint}")
    factory = getattr(module, attribute)
    if not callable(factory):
        raise ValueError(f"--app: {module_name}.{attribute} is not a callable "
                         f"({type(factory).__name__})")
    return factory


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The connection settings of the flags, each falling back to its env variable."""
    env = {key: (getattr(args, key, None) or os.environ.get(name) or None)
           for key, name in ENV.items()}
    return {"user": env["nats_user"], "password": env["nats_password"],
            "token": env["nats_token"], "creds_file": env["nats_creds"],
            "nkey_seed_file": env["nats_nkey"], "tls_ca_file": env["tls_ca"],
            "tls_cert_file": env["tls_cert"], "tls_key_file": env["tls_key"],
            "url": env["nats"]}


#: The file flags and their variables: a file that cannot be read is a usage error at
#: start-up (exit 2), not a failed connection a minute later (newcomer18 F4).
_FILES = {"nats_creds": "--nats-creds", "nats_nkey": "--nats-nkey", "tls_ca": "--tls-ca",
          "tls_cert": "--tls-cert", "tls_key": "--tls-key"}


#: The `NatsConfig` field of each file flag.
_FIELDS = {"nats_creds": "creds_file", "nats_nkey": "nkey_seed_file",
           "tls_ca": "tls_ca_file", "tls_cert": "tls_cert_file", "tls_key": "tls_key_file"}


def _check_files(args: argparse.Namespace, config: Any) -> None:
    """`ValueError` naming the flag (or its variable) of a file that cannot be read, or
    that a connection could not use (too big, a seed that is none, a CA bundle or a
    certificate that does not load: redteam20 F5, found only at the connection, after
    the app was imported, exit 1 without the flag), never what it holds."""
    for key, flag in _FILES.items():
        path = getattr(args, key, None) or os.environ.get(ENV[key]) or None
        if path is None:
            continue
        where = flag if getattr(args, key, None) else ENV[key]
        if not os.path.isfile(path):
            raise ValueError(f"{where}: cannot read {path[:200]!r}: "
                             f"{'not a regular file' if os.path.exists(path) else 'no such file'}")
        if not os.access(path, os.R_OK):
            raise ValueError(f"{where}: cannot read {path[:200]!r}: permission denied")
    from ..runtime.nats._security import unusable_file

    problem = unusable_file(config)
    if problem is not None:
        field, detail = problem
        key = next(key for key, name in _FIELDS.items() if name == field)
        where = _FILES[key] if getattr(args, key, None) else ENV[key]
        raise ValueError(f"{where}: {detail[:400]}")


def _check_metrics(args: argparse.Namespace) -> None:
    """`ValueError` naming `--metrics-host`/`--metrics-port` when /metrics could not be
    served there (a host that does not resolve or is not this machine's, a port taken):
    a socket is bound there and closed, before the app is imported (redteam21 F8: found
    only when serving, after the import)."""
    if args.metrics_port is None:
        return
    host, port = args.metrics_host, args.metrics_port
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                    flags=socket.AI_PASSIVE)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as trial:
            trial.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as the server)
            trial.bind((host, port))
    except (OSError, UnicodeError, ValueError, OverflowError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"--metrics-host {host[:200]!r} --metrics-port {port}: cannot "
                         f"serve /metrics there: {' '.join(why.split())[:200]}") from exc


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:500]


def worker_main(argv: Sequence[str]) -> int:
    try:
        return _worker_main(argv)
    finally:
        while _READY_LOCKS:  # (a process that runs it again may take it again)
            _READY_LOCKS.pop().close()


def _worker_main(argv: Sequence[str]) -> int:
    parser = worker_parser()
    args = parser.parse_args(list(argv))
    settings = _settings(args)
    if settings["url"] is None:
        parser.error("--nats (or TURNROUTER_NATS_URL) is required")
    try:
        from ..runtime.nats import NatsConfig, NatsWorker
    except ImportError as exc:
        missing = getattr(exc.__cause__, "name", None) or exc.name or "nats"
        print("turnrouter worker needs the nats extra (from a checkout: "
              f"pip install -e '.[nats]'): {missing} is missing", file=sys.stderr)
        return 2
    from .._exceptions import ConfigurationError, TurnrouterError
    from ..runtime.nats._fleet import valid_replica
    from ..runtime.nats._quiet import quiet_tls_eof

    quiet_tls_eof()  # asyncio's warning at every TLS close or reconnect (redteam18 F8)

    if args.ready_file == "":  # a probe watching nothing: the worker would never say ready
        parser.error("--ready-file: empty path (leave the flag out for no ready file)")
    if args.ready_file:
        # A probe on a file that can never be written would keep the replica unready
        # for good, with a warning as the only clue: a usage error instead.
        folder = os.path.dirname(os.path.abspath(args.ready_file))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            parser.error(f"--ready-file: {folder} is not a writable directory")
        # Two workers on one ready file: each writes and removes it on its own, so it
        # would say one worker's state for both (the one stopping removes it while the
        # other serves). A lock held for the process's life (freed even by kill -9).
        path = args.ready_file
        if os.path.lexists(path) and not os.path.isfile(path):
            # A directory (or a device) is there for good: a probe's `test -e` passed
            # before the worker served and after it ended (redteam20 F4).
            parser.error(f"--ready-file {path[:200]!r}: not a regular file (a directory, "
                         "a pipe or a device): the worker could never write it")
        if not _lock_ready(path):
            parser.error(f"--ready-file {path} is another running worker's "
                         f"(it holds {path}.lock): give each worker its own")
        problem = _ready_problem(path)
        if problem:
            parser.error(f"--ready-file {path[:200]!r}: {problem}")
    app_dir = os.path.abspath(args.app_dir)
    if not args.app_dir or not os.path.isdir(app_dir):  # else "No module named ..."
        parser.error(f"--app-dir {args.app_dir[:200]!r}: not a directory")
    if app_dir not in sys.path:  # as uvicorn: `--app myapp:make` finds ./myapp.py
        sys.path.insert(0, app_dir)
    # The flags first, then the app: a typo in a flag is named at once, not after the app
    # was imported and its router built, nor hidden by an app that fails to import
    # (newcomer18 F6); an empty --replica is refused, not taken as "random" (F7).
    if args.replica is not None and not valid_replica(args.replica):
        parser.error(f"--replica {args.replica[:80]!r}: 1..64 characters of A-Za-z0-9_.:-")
    try:
        config = NatsConfig(prefix=args.prefix, partitions=args.partitions,
                            failover_timeout=args.failover_timeout, ack_wait=args.ack_wait,
                            drain_timeout=args.drain_timeout, mark_after=args.mark_after,
                            reconnect_for=args.reconnect_for, idle_after=args.idle_after,
                            max_input_wait=args.max_input_wait,
                            state_max_age=args.state_max_age,
                            max_queued_per_participant=args.max_queued_per_participant,
                            front_api=args.front_api, replicas=args.replicas, **settings)
        _check_files(args, config)
        _check_metrics(args)
        factory = load_factory(args.app)
    except (ValueError, TurnrouterError) as exc:
        if args.debug:
            traceback.print_exc()
        parser.error(str(exc))
    from prometheus_client import CollectorRegistry

    from ..telemetry import serve_metrics
    from ..telemetry._serve import bind_error

    registry = CollectorRegistry()
    from ..demo import install_env_tracing  # the demo's OpenTelemetry set-up
    try:
        install_env_tracing("turnrouter-worker", sys.stdout)
    except ConfigurationError as exc:  # a malformed OTEL_EXPORTER_OTLP_ENDPOINT
        parser.error(str(exc))
    guarded = _SignalsInFactory(factory)
    try:
        worker = NatsWorker(guarded, config, registry=registry, replica=args.replica)
    except TurnrouterError as exc:
        parser.error(f"--replica: {exc}")
    stopped_early = False
    deadline = _Deadline()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    async def run() -> None:
        nonlocal stopped_early
        loop = asyncio.get_running_loop()
        task = asyncio.create_task(worker.run())

        early = asyncio.Event()

        said = False
        bound = args.drain_timeout + STOP_GRACE_SECS
        late = (f"worker {worker.replica} still stopping after {bound:g} s "
                "(--drain-timeout plus 10 s): exiting now")

        def stop(sig: signal.Signals | None = None) -> None:
            nonlocal stopped_early, said
            if worker.ready.is_set():
                # (A signal handled just before the worker was ready arms it here.)
                deadline.arm(bound, late)
                # Said once, with what it cannot do (NATS unreachable: what it holds
                # goes to the next owner after ack_wait): a stop in an outage read as
                # a crash in the log.
                worker.request_stop()  # first: saying so may fail (a reader gone)
                if not said:
                    said = True
                    readiness = worker.readiness
                    why = "" if readiness.serving else f": {readiness.why_not}"
                    _say(f"worker {worker.replica} stopping "
                         f"({sig.name if sig is not None else 'asked'}){why}")
            else:  # still starting (a factory that hangs): give up the start at once
                stopped_early = True
                early.set()
                task.cancel()

        def on_signal(signum: int, frame: Any) -> None:
            """SIGTERM/SIGINT, handled by the interpreter between two bytecodes of the
            main thread, not by the loop: a destination blocking the loop (`time.sleep`
            on it) held the loop's handler until it returned, so neither the forced
            exit nor a second signal could end the worker (redteam14 D4). The graceful
            part runs on the loop; the deadline is a thread's."""
            sig = signal.Signals(signum)
            if worker.ready.is_set():
                if deadline.first_at is not None:
                    if time.monotonic() - deadline.first_at < SAME_STOP_SECS:
                        return  # the same stop, delivered twice
                    _force_exit(f"worker {worker.replica} stopping again ({sig.name}): "
                                "exiting now, without finishing the graceful stop")
                deadline.arm(bound, late)
            with contextlib.suppress(RuntimeError):  # the loop closed: nothing to stop
                loop.call_soon_threadsafe(stop, sig)

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        guarded.stop = stop
        if args.ready_file:  # there while the worker serves, gone while it cannot
            path = args.ready_file
            # One left by a process killed before it could remove it (kill -9, a restarted
            # container keeping /tmp) would say this one serves while it still starts.
            _remove_ready(path)
            worker.readiness.on_change(
                lambda serving: _write_ready(path, worker.replica) if serving
                else _remove_ready(path))
        _say(f"worker {worker.replica} starting")
        ready = asyncio.create_task(worker.ready.wait())
        stopping = asyncio.create_task(early.wait())
        try:
            await asyncio.wait({task, ready, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if stopped_early:
                await _cancel_start(task)
            if worker.ready.is_set():
                # This process is the worker's: keep its start-up heap (modules, the
                # router) out of full collections, which otherwise scan it all, 20-29 ms
                # each under bench_distributed (2-3 ms after this), stalling every turn.
                gc.freeze()
                _say(f"worker {worker.replica} ready")
            await task
            if worker.ready.is_set():
                _say(f"worker {worker.replica} stopped")
        finally:
            ready.cancel()
            stopping.cancel()

    server = None
    if args.metrics_port is not None:
        try:
            # `/ready` answers 200 while the worker serves (the `--ready-file` signal),
            # so a Kubernetes rollout waits for a new replica that actually serves; a
            # 503 says why not (starting, disconnected from NATS, missing: ..., stopping).
            readiness = worker.readiness
            server = serve_metrics(args.metrics_port, registry=registry,
                                   addr=args.metrics_host, ready=lambda: readiness.serving,
                                   reason=lambda: readiness.why_not)
        except (OSError, OverflowError, ValueError) as exc:
            print(f"turnrouter worker: error: cannot serve /metrics on "
                  f"{args.metrics_host}:{args.metrics_port}: {bind_error(exc)}",
                  file=sys.stderr)
            return 2
        _say(f"metrics: {server.url}")
    try:
        asyncio.run(run())
    except asyncio.CancelledError:
        if not stopped_early:
            raise
        print("turnrouter worker: stopped before it was ready", file=sys.stderr)
        return 0
    except TurnrouterError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"turnrouter worker: {_one_line(exc) if args.debug else exc}",
              file=sys.stderr)
        return 1
    except Exception as exc:  # the factory's (or a destination's start-up) own error
        if args.debug:
            traceback.print_exc()
        print(f"turnrouter worker: error: {_one_line(exc)} (from --app {args.app}; "
              "--debug for the traceback)", file=sys.stderr)
        return 1
    finally:
        # The process goes on (a caller of `main()`, its interpreter's teardown): its
        # signals are its own again, and a stop that finished forces no exit later.
        deadline.cancel()
        for sig, handler in handlers.items():
            if handler is not None:  # (None: set outside Python, nothing to put back)
                signal.signal(sig, handler)
        if server is not None:
            server.close()
        if args.ready_file:
            _remove_ready(args.ready_file)
    return 0


class _Deadline:
    """The forced exit's deadline, armed once at the first stop: a thread's timer, so a
    loop blocked by a destination cannot hold it (redteam14 D4)."""

    def __init__(self) -> None:
        self.first_at: float | None = None  # (time.monotonic() when armed)
        self._timer: threading.Timer | None = None

    def arm(self, bound: float, text: str) -> None:
        if self.first_at is not None:
            return
        self.first_at = time.monotonic()
        self._timer = threading.Timer(bound, _force_exit, (text,))
        self._timer.daemon = True
        self._timer.start()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


#: The open lock files of `--ready-file`s this process holds (kept open for its life).
_READY_LOCKS: list[Any] = []


def _lock_ready(path: str) -> bool:
    """Take `path`.lock for this process (False: another process holds it). Where
    `fcntl` is missing there is no lock, and no refusal."""
    try:
        import fcntl
    except ImportError:  # (not POSIX)
        return True
    try:
        lock = open(f"{path}.lock", "a+b")  # noqa: SIM115 (held open for the process's life)
    except OSError:
        return True  # an unwritable folder is refused above; nothing to lock here
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        return False
    _READY_LOCKS.append(lock)
    return True


def _ready_problem(path: str) -> str:
    """Why the worker could not write and remove its ready file `path` ("" when it can),
    tried at start-up as it will be done: one left by a killed worker removed (as the
    start does anyway), the temporary file beside it written and removed. `access()`
    says yes to root for a file of /proc, whose probe then passed for ever."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        return f"cannot remove the one there: {exc.strerror}"
    temporary = f"{path}.tmp"
    try:
        with open(temporary, "w", encoding="utf-8"):
            pass
        os.unlink(temporary)
    except OSError as exc:
        return f"cannot write beside it: {exc.strerror}"
    return ""


def _remove_ready(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _write_ready(path: str, replica: str) -> None:
    """Write the ready file atomically (a probe never reads half of it)."""
    temporary = f"{path}.tmp"
    try:
        with open(temporary, "w", encoding="utf-8") as out:
            out.write(f"{replica}\n")
        os.replace(temporary, path)
    except OSError as exc:
        print(f"turnrouter worker: warning: cannot write --ready-file {path}: "
              f"{exc.strerror}", file=sys.stderr)


class _SignalsInFactory:
    """Calls the router factory so that SIGTERM and SIGINT stop a start-up even while
    a synchronous factory blocks (a dependency polled with `time.sleep`, a blocking
    client call). It runs on the event loop's thread, so the stop the worker's signal
    handlers hand to the loop could not run before it returned, and the signal was
    ignored until the
    orchestrator's SIGKILL. While the call lasts, a Python-level handler does what the
    loop's would (`stop`) and raises CancelledError in the factory, which ends the start
    as the cancellation of an async factory does. An async factory returns at once (its
    coroutine is awaited under the loop's handlers); a factory spinning in C code that
    never returns to the interpreter still cannot be interrupted."""

    def __init__(self, factory: Any) -> None:
        self.factory = factory
        self.stop: Any = None

    def __call__(self, ctx: Any) -> Any:
        stop = self.stop
        if stop is None or threading.current_thread() is not threading.main_thread():
            return self.factory(ctx)

        def interrupt(signum: int, frame: Any) -> None:
            stop()
            raise asyncio.CancelledError

        previous = {sig: signal.signal(sig, interrupt)
                    for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            return self.factory(ctx)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


async def _cancel_start(task: asyncio.Task[None]) -> None:
    """Cancel a start-up until it ends (bounded: 10 s), then raise CancelledError: a
    cancellation that lands inside the client's connection attempt can be absorbed by
    its retry loop, so one `cancel()` is not always enough."""
    for _ in range(100):
        if task.done():
            break
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
    raise asyncio.CancelledError
