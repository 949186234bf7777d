"""`turnrouter worker`: flags, bad factories, unreachable servers, /metrics."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from turnrouter.cli import main, worker_parser

from .conftest import ROOT, NatsServer, Worker, metric_value


def run_worker(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    return subprocess.run([sys.executable, "-m", "turnrouter", "worker", *args],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)


def worker_usage(*args: str) -> tuple[int, str]:
    """`turnrouter worker ARGS` in this process: exit status and stderr (for usage errors,
    which end before any connection)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main(["worker", *args])
    return status, err.getvalue()


def test_usage_lists_the_worker(capsys: pytest.CaptureFixture[str]) -> None:
    """`turnrouter --help` names the worker command."""
    assert main(["--help"]) == 0
    assert "worker" in capsys.readouterr().out  # --help goes to stdout


@pytest.mark.parametrize(("spec", "message"), [
    ("tests.nats.app", "module:factory"),
    ("no_such_module_xyz:f", "cannot import"),
    ("tests.nats.app:PREAMBLE", "not a callable (str)"),
    # A misspelt factory is named as missing, with the near name (newcomer16: it said
    # "is not a callable").
    ("tests.nats.app:make_routr", "has no 'make_routr' (did you mean 'make_router'?)"),
])
def test_bad_app_specs_name_the_problem(spec: str, message: str) -> None:
    """--app must name an importable callable; the usage error says which part is wrong."""
    status, err = worker_usage("--nats", "nats://127.0.0.1:1", f"--app={spec}")
    assert status == 2
    assert err.startswith("turnrouter worker: error: --app") and message in err


@given(st.text(max_size=60), st.text(max_size=30))
def test_junk_app_specs_are_usage_errors(module: str, attribute: str) -> None:
    """Junk (relative, empty, non-identifier, NUL, huge) --app values are usage errors
    naming --app, nothing else; names that could import real modules are not generated."""
    assume(not all(part.isidentifier() for part in module.split(".")))
    status, err = worker_usage("--nats", "nats://127.0.0.1:1", f"--app={module}:{attribute}")
    assert status == 2
    assert err.startswith("turnrouter worker: error: --app") and "Traceback" not in err


@pytest.mark.parametrize("flags", [
    ["--metrics-port", "70000"], ["--metrics-port", "x"], ["--failover-timeout", "inf"],
    ["--ack-wait", "nan"], ["--drain-timeout", "-1"], ["--partitions", "0"],
    ["--prefix", "a.b"], ["--mark-after", "1"], ["--mark-after", "0"],
    ["--reconnect-for", "0"], ["--reconnect-for", "nan"], ["--reconnect-for", "x"],
    ["--max-input-wait", "0"], ["--max-input-wait", "-5"], ["--max-input-wait", "inf"],
    ["--state-max-age", "0"], ["--state-max-age", "nan"],
    ["--idle-after", "0.5"], ["--idle-after", "nan"], ["--idle-after", "x"],
    ["--idle-after", "1e40"],
    ["--max-queued-per-participant", "0"], ["--max-queued-per-participant", "x"],
    ["--max-queued-per-participant", "2000000"],
])
def test_bad_flags_are_one_line_usage_errors(flags: list[str]) -> None:
    """Out-of-range or malformed flags exit 2 with one line on stderr, no traceback."""
    done = run_worker("--nats", "nats://127.0.0.1:1", "--app",
                      "tests.nats.app:make_router", *flags)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


@pytest.mark.parametrize(("url", "problem"), [
    ("nats://svc:S3CRET@h:notaport", "no valid port"),
    ("nats://svc:S3CRET@[::1", "no valid port"),
    ("nats://svc:S3CRET@h:99999", "no valid port"),
    ("http://svc:S3CRET@h:4222", "scheme 'http'"),
    ("nats://svc:S3CRET@:4222", "names no host"),
    ("nats://svc:S3CRET@a:4222,nats://svc:S3CRET@b:x", "server 2 of 2 has no valid port"),
    # A ',' in the password splits the URL (redteam18 F3: it showed "nats://svc:S3").
    ("nats://svc:S3,CR/ET@127.0.0.1:4222", "percent-encoded as %2C"),
    ("nats://a:4222,nats://svc:S3CRET@b:x", "credentials in the URL differ"),
    ("nats://svc:S3@CR/ET@127.0.0.1:4222", "an '@' after its host"),  # "/" cut the password
    ("nats://svc:S3@CR?ET@127.0.0.1:4222", "an '@' after its host"),
])
def test_a_malformed_nats_url_is_a_usage_error_that_hides_its_password(
        url: str, problem: str) -> None:
    """A URL nats-py cannot use (a port that is not a number, a broken IPv6 address, a
    scheme that is not NATS's) is a usage error at once, masked: it was found only at
    connect time, after start-up had begun, and the worker exited 1."""
    status, err = worker_usage("--nats", url, "--app", "tests.nats.app:make_router")
    assert status == 2
    assert err.startswith("turnrouter worker: error: NatsConfig.url") and problem in err
    assert not [piece for piece in ("S3", "CR", "ET") if piece in err]  # no part of it
    assert err.count("\n") == 1  # one line, no traceback


def test_missing_flags_are_usage_errors() -> None:
    """--nats and --app are required."""
    status, err = worker_usage("--app", "tests.nats.app:make_router")
    assert status == 2 and "--nats" in err
    status, err = worker_usage("--nats", "nats://127.0.0.1:1")
    assert status == 2 and "--app" in err


def test_unreachable_server_exits_with_a_clear_error() -> None:
    """A worker that cannot reach NATS at start-up tries again for `--reconnect-for`
    seconds, logging the 1st, 2nd, 4th... attempt (numbered, asking whether a server
    listens there: a wrong port gave 120 lines a minute, newcomer22), then says so and
    exits 1."""
    done = run_worker("--nats", "nats://127.0.0.1:1", "--app", "tests.nats.app:make_router",
                      "--reconnect-for", "1")
    assert done.returncode == 1
    last = done.stderr.splitlines()[-1]
    assert last.startswith("turnrouter worker: cannot connect to NATS at nats://127.0.0.1:1: "
                           "unreachable for "), last
    assert "reconnect_for is 1 s" in last
    attempts = [line for line in done.stderr.splitlines() if "connect attempt" in line]
    assert len(attempts) >= 2
    assert [f"attempt {2 ** i} failed" in line for i, line in enumerate(attempts)] == (
        [True] * len(attempts))
    assert all("is a nats-server listening at that address?" in line for line in attempts)
    assert "Traceback" not in done.stderr


def test_factory_returning_something_else_is_refused(nats_server: NatsServer) -> None:
    """A factory that does not return an AgentRouter stops the worker with a message."""
    done = run_worker("--nats", nats_server.url, "--app", "tests.nats.app:not_a_router")
    assert done.returncode == 1
    assert "must return an AgentRouter" in done.stderr


def test_worker_serves_its_metric_families(nats_server: NatsServer) -> None:
    """/metrics of a running worker carries the runtime's and the router's families."""
    worker = Worker(nats_server.url, "m0")
    try:
        with urllib.request.urlopen(worker.metrics_url, timeout=5) as reply:
            text = reply.read().decode()
        assert metric_value(text, "turnrouter_nats_partitions") == 16
        for family in ("turnrouter_nats_partitions_owned", "turnrouter_nats_takeovers_total",
                       "turnrouter_nats_state_write_seconds_count",
                       "turnrouter_nats_state_writes_refused_total",
                       "turnrouter_nats_redeliveries_total",
                       "turnrouter_nats_duplicates_dropped_total",
                       "turnrouter_nats_inflight_marks_total",
                       "turnrouter_nats_input_wait_seconds_count"):
            assert family in text
    finally:
        worker.close()


def test_failing_factory_is_one_line(nats_server: NatsServer) -> None:
    """A factory that raises: exit 1, one line naming the error, no traceback; --debug
    adds the traceback."""
    done = run_worker("--nats", nats_server.url, "--app", "tests.nats.app:raising")
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert "KeyError" in done.stderr and "OPENAI_API_KEY" in done.stderr
    assert "from --app tests.nats.app:raising" in done.stderr  # which factory
    debug = run_worker("--nats", nats_server.url, "--app", "tests.nats.app:raising",
                       "--debug")
    assert debug.returncode == 1 and "Traceback" in debug.stderr


@pytest.mark.parametrize(("factory", "shown"), [
    ("exiting", "SystemExit('missing setting FOO')"), ("exiting_zero", "SystemExit(0)"),
    ("interrupted", "KeyboardInterrupt()")])
def test_factory_exiting_is_one_line_and_a_failure(nats_server: NatsServer, factory: str,
                                                    shown: str) -> None:
    """A factory that calls `sys.exit` (a missing setting, its own argparse) or raises
    KeyboardInterrupt: exit 1 (a supervisor restarts it), one line, no traceback."""
    done = run_worker("--nats", nats_server.url, "--app", f"tests.nats.app:{factory}")
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"the router factory raised {shown}" in done.stderr


def test_a_missing_app_dir_is_a_usage_error(tmp_path: Path) -> None:
    """`--app-dir` naming no directory: exit 2 naming it (it read "No module named
    ...", hiding the cause)."""
    missing = tmp_path / "nowhere"
    done = run_worker("--nats", "nats://127.0.0.1:1", "--app", "myapp:make",
                      "--app-dir", str(missing))
    assert done.returncode == 2
    assert f"--app-dir {str(missing)!r}: not a directory" in done.stderr
    for junk in ("", "\x1b[31m"):  # empty was the current directory; ESC went out raw
        done = run_worker("--nats", "nats://127.0.0.1:1", "--app", "myapp:make",
                          "--app-dir", junk)
        assert done.returncode == 2
        assert f"--app-dir {junk!r}: not a directory" in done.stderr
        assert "\x1b" not in done.stderr


def test_ready_file_in_a_missing_directory_is_a_usage_error(tmp_path: Path) -> None:
    """`--ready-file` where it can never be written (a mistyped volume path): exit 2 at
    once, naming the directory, rather than a replica that is never ready."""
    missing = tmp_path / "no" / "such"
    done = run_worker("--nats", "nats://127.0.0.1:1", "--app", "tests.nats.app:raising",
                      "--ready-file", str(missing / "ready"))
    assert done.returncode == 2
    assert f"--ready-file: {missing} is not a writable directory" in done.stderr


def test_a_ready_file_of_another_running_worker_is_a_usage_error(
        nats_server: NatsServer, tmp_path: Path) -> None:
    """Two workers given one `--ready-file`: the second exits 2 at once, naming the
    file, and the first's file stays (before, both wrote and removed it on their own:
    the second's stop removed it while the first served). Once the first is gone, even
    killed with SIGKILL, the file is free for the next worker."""
    ready = tmp_path / "worker.ready"
    first = Worker(nats_server.url, "first", "--ready-file", str(ready))
    try:
        assert ready.read_text(encoding="utf-8") == "first\n"
        done = run_worker("--nats", nats_server.url, "--app", "tests.nats.app:make_router",
                          "--ready-file", str(ready), "--replica", "second")
        assert done.returncode == 2, done.stderr
        assert f"--ready-file {ready} is another running worker's" in done.stderr
        assert ready.read_text(encoding="utf-8") == "first\n"
        first.signal(signal.SIGKILL)
        first.proc.wait(30)
    finally:
        first.close()
    after = Worker(nats_server.url, "after", "--ready-file", str(ready))
    try:
        assert ready.read_text(encoding="utf-8") == "after\n"
    finally:
        after.close()


def test_module_failing_at_import_is_one_line(tmp_path: Path) -> None:
    """An --app module that raises while it is imported: a usage error (exit 2) in one
    line, no traceback."""
    (tmp_path / "broken_app.py").write_text("raise RuntimeError('no config\\nat all')\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-m", "turnrouter", "worker", "--nats",
                           "nats://127.0.0.1:1", "--app", "broken_app:make"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert "RuntimeError: no config at all" in done.stderr


def test_app_is_imported_from_the_current_directory(nats_server: NatsServer,
                                                    tmp_path: Path) -> None:
    """As uvicorn: `--app myapp:make` finds ./myapp.py with nothing on PYTHONPATH but
    turnrouter; the worker serves, writes its --ready-file and removes it at the end,
    saying on stdout that it stops (and why) and that it stopped."""
    (tmp_path / "myapp_here.py").write_text(
        "from tests.nats.app import make_router\n\ndef make(ctx):\n"
        "    return make_router(ctx)\n")
    (tmp_path / "tests").symlink_to(ROOT / "tests")
    ready = tmp_path / "ready"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "turnrouter", "worker", "--nats",
                             nats_server.url, "--app", "myapp_here:make", "--replica", "cwd",
                             "--ready-file", str(ready)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=tmp_path)
    try:
        assert proc.stdout is not None
        assert any(line.startswith("worker cwd ready") for line in proc.stdout)
        assert ready.read_text() == "cwd\n"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0
        assert out.splitlines()[-2:] == ["worker cwd stopping (SIGTERM)", "worker cwd stopped"]
        assert not ready.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)


@pytest.mark.parametrize(("app", "when", "sig"), [
    ("hanging", "worker ", signal.SIGTERM), ("hanging", "factory waiting", signal.SIGTERM),
    ("hanging_sync", "factory waiting", signal.SIGTERM),
    ("hanging_sync", "factory waiting", signal.SIGINT),
])
def test_sigterm_during_start_up_ends_the_worker(nats_server: NatsServer, app: str,
                                                 when: str, sig: signal.Signals) -> None:
    """A factory that hangs: SIGTERM (or Ctrl-C) still ends the worker promptly with
    exit 0 and one line on stderr (no asyncio or nats-py error of a close cut half-way),
    without the ready file ever written; whether it lands as the worker starts (the
    connection or set-up may be under way) or while the factory hangs, async or
    synchronous (blocked in a sleep on the loop's thread, where the loop's own signal
    handlers cannot run: it was ignored until the orchestrator's SIGKILL)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    proc = subprocess.Popen([sys.executable, "-u", "-m", "turnrouter", "worker", "--nats",
                             nats_server.url, "--app", f"tests.nats.app:{app}",
                             "--metrics-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT)
    try:
        assert proc.stdout is not None
        # "worker ... starting" is printed once SIGTERM is handled.
        assert any(line.startswith(when) for line in proc.stdout)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0
        assert err.splitlines() == ["turnrouter worker: stopped before it was ready"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)


def test_sigterm_stops_a_worker_whose_output_reader_is_gone(nats_server: NatsServer) -> None:
    """A worker whose standard output is a pipe nobody reads any more (`| grep -m1
    ready`, a log sidecar that died) still drains and exits 0 on one SIGTERM. Its
    "stopping" line raised BrokenPipeError before the stop was requested, and the worker
    went on serving until a second signal (redteam7 D4)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    proc = subprocess.Popen([sys.executable, "-m", "turnrouter", "worker", "--nats",
                             nats_server.url, "--app", "tests.nats.app:make_router",
                             "--metrics-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT)
    try:
        assert proc.stdout is not None
        assert any(line.startswith("worker ") and " ready" in line for line in proc.stdout)
        proc.stdout.close()  # the reader leaves
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)


def test_a_ready_file_left_by_a_killed_worker_is_removed_at_start(
        nats_server: NatsServer, tmp_path: Path) -> None:
    """A ready file left by a worker killed with -9 (or a restarted container keeping
    /tmp) is removed as the next worker starts: while that one is still starting (here
    its factory hangs), a probe testing the file must not find it ready."""
    ready = tmp_path / "worker.ready"
    ready.write_text("killed-before\n")
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    proc = subprocess.Popen([sys.executable, "-u", "-m", "turnrouter", "worker", "--nats",
                             nats_server.url, "--app", "tests.nats.app:hanging",
                             "--ready-file", str(ready)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT)
    try:
        assert proc.stdout is not None
        assert any(line.startswith("worker ") and "starting" in line for line in proc.stdout)
        assert not ready.exists()
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)


def test_worker_help_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    """Every flag with a default says it in `turnrouter worker --help`."""
    with pytest.raises(SystemExit) as info:
        worker_parser().parse_args(["--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag, default in (("--ack-wait", "1.5"), ("--prefix", "turnrouter"),
                          ("--partitions", "16"), ("--failover-timeout", "1"),
                          ("--drain-timeout", "20"), ("--metrics-host", "127.0.0.1"),
                          ("--max-input-wait", "10"),
                          ("--max-queued-per-participant", "1000")):
        help_text = text.split("options:", 1)[1].split(f"{flag} ", 1)[1].split(" --", 1)[0]
        assert f"default {default}" in help_text, (flag, help_text)


def test_a_stop_during_a_server_outage_says_why(nats_server: NatsServer) -> None:
    """SIGTERM while NATS is unreachable: the worker says it stops and what it waits for
    (what it holds goes to the next owner after `ack_wait`), then that it stopped, and
    exits 0; before, its log ended with a reconnect attempt, read as a crash."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    proc = subprocess.Popen([sys.executable, "-u", "-m", "turnrouter", "worker", "--nats",
                             nats_server.url, "--app", "tests.nats.app:make_router",
                             "--replica", "out", "--metrics-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT)
    try:
        assert proc.stdout is not None
        ready = ""
        for line in proc.stdout:  # "metrics: http://host:port/metrics", then "... ready"
            if line.startswith("metrics: "):
                ready = line.split(" ", 1)[1].strip().rsplit("/", 1)[0] + "/ready"
            if line.startswith("worker out ready"):
                break
        nats_server.crash()
        for _ in range(300):  # `/ready` says 503 once the worker saw it: at most ~30 s
            try:
                with urllib.request.urlopen(ready, timeout=2):
                    pass
            except urllib.error.HTTPError as exc:
                if exc.code == 503:
                    break
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(0.1)
        else:
            raise AssertionError("/ready never said 503 after the server crashed")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        assert out.splitlines()[-2:] == [
            "worker out stopping (SIGTERM): disconnected from NATS", "worker out stopped"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)


def test_the_signal_handlers_are_put_back_when_the_worker_returns(
        nats_server: NatsServer, capsys: pytest.CaptureFixture[str]) -> None:
    """`main(["worker", ...])` in a process that goes on (a caller's, its teardown):
    SIGTERM and SIGINT are the caller's again once it returns. Before, the worker's
    handlers stayed: Ctrl-C no longer raised KeyboardInterrupt, and after a stop by a
    signal a later one called os._exit in the host process (review14)."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    assert main(["worker", "--nats", nats_server.url, "--app",
                 "tests.nats.app:raising"]) == 1
    assert "OPENAI_API_KEY is not set" in capsys.readouterr().err  # (the factory raised)
    assert {sig: signal.getsignal(sig) for sig in before} == before


@pytest.mark.parametrize(("flags", "message"), [
    (["--nats-creds", "/nonexistent/worker.creds"], "--nats-creds: cannot read"),
    (["--nats-nkey", "/nonexistent/seed.nk"], "--nats-nkey: cannot read"),
    (["--tls-ca", "/nonexistent/ca.pem"], "--tls-ca: cannot read"),
    (["--tls-cert", ".", "--tls-key", "."], "--tls-cert: cannot read '.': not a regular file"),
    (["--replica", ""], "--replica '': 1..64 characters"),
    # A flag's typo is named even when the app cannot be imported (and before it is).
    (["--app", "no_such_module_xyz:f", "--prefix", "BAD.PREFIX"], "prefix"),
])
def test_flag_mistakes_are_usage_errors_named_before_the_app_loads(
        flags: list[str], message: str) -> None:
    """A file flag that cannot be read, an empty --replica, a bad flag beside an app
    that does not import: exit 2 with one line naming the flag, at once (newcomer18 F4:
    a missing creds file exited 1 after connecting; F6: an app import error hid every
    other flag's; F7: --replica '' was taken as "random")."""
    app = [] if "--app" in flags else ["--app", "tests.nats.app:make_router"]
    status, err = worker_usage("--nats", "nats://127.0.0.1:1", *app, *flags)
    assert status == 2, err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


@pytest.mark.parametrize(("flag", "content", "message"), [
    ("--nats-creds", b"x" * 2_000_000, "over the 65536 bytes such a file may hold"),
    ("--nats-nkey", b"x" * 2_000_000, "over the 65536 bytes such a file may hold"),
    ("--nats-nkey", b"SUAJUNKJUNKJUNK-sekrit-seed\n", "holds no valid nkey seed"),
    ("--tls-cert", b"x" * 2_000_000, "over the 65536 bytes such a file may hold"),
    ("--tls-ca", b"sekrit: not a certificate\n", "cannot load the CA file"),
    ("--tls-cert", b"sekrit: not a certificate\n", "cannot load the client certificate"),
])
def test_file_flags_that_exist_but_cannot_be_used_are_usage_errors(
        tmp_path: Path, flag: str, content: bytes, message: str) -> None:
    """redteam20 F5: a file that exists but a connection cannot use (too big, a seed
    that is none, a CA bundle or certificate that does not load) was found only when
    connecting: after the app was imported, exit 1, the flag not named. Now: exit 2,
    one line naming the flag, before the app is imported (a broken app's error would
    come first otherwise), never the file's content."""
    path = tmp_path / "file"
    path.write_bytes(content)
    extra = ["--tls-key", str(path)] if flag == "--tls-cert" else []
    status, err = worker_usage("--nats", "nats://127.0.0.1:1", "--app",
                               "no_such_module_xyz:f", flag, str(path), *extra)
    assert status == 2, err
    assert err.count("\n") == 1 and f"{flag}: " in err and message in err, err
    assert "sekrit" not in err and "xxxx" not in err and "no_such_module" not in err


def test_a_ready_file_that_can_never_be_written_is_a_usage_error(tmp_path: Path) -> None:
    """redteam20 F4: `--ready-file` naming a directory (or a file of /proc, which
    `access()` lets root write) only warned and the worker served on, while a probe's
    `test -e` passed before it served and after it ended. Now: exit 2, one line naming
    the flag, before the app is imported."""
    folder = tmp_path / "volume"
    folder.mkdir()
    for path, message in ((tmp_path, "not a regular file"), (folder, "not a regular file"),
                          (Path("/proc/version"), "cannot remove the one there")):
        if not path.exists():
            continue
        status, err = worker_usage("--nats", "nats://127.0.0.1:1", "--app",
                                   "no_such_module_xyz:f", "--ready-file", str(path))
        assert status == 2, err
        assert err.count("\n") == 1 and "--ready-file" in err and message in err, err
    assert folder.is_dir() and list(folder.iterdir()) == []


def test_an_empty_ready_file_is_a_usage_error() -> None:
    """`--ready-file ""` (an unset variable in a manifest, `--ready-file "$READY"`) was
    taken as no ready file: a probe waiting for a file the worker never writes. Now: exit
    2, one line naming the flag."""
    status, err = worker_usage("--nats", "nats://127.0.0.1:1", "--app",
                               "no_such_module_xyz:f", "--ready-file", "")
    assert status == 2, err
    assert err.count("\n") == 1 and "--ready-file: empty path" in err, err
