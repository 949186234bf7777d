"""`turnrouter worker`: flags checked before the app is imported (redteam21 F8): the
creds file's shape, and where /metrics is served."""

from __future__ import annotations

import base64
import contextlib
import io
import os
import re
import socket
import tempfile
from pathlib import Path

import nkeys
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client

from turnrouter.cli import main

#: An app that cannot be imported: a check that passes ends at its import instead.
NO_APP = "no_such_module_xyz:f"


def worker_usage(*args: str) -> tuple[int, str]:
    """`turnrouter worker ARGS` in this process: exit status and stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main(["worker", "--nats", "nats://127.0.0.1:1", "--app", NO_APP, *args])
    return status, err.getvalue()


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def creds(jwt: str, seed: str, newline: str = "\n") -> bytes:
    """A creds file as `nsc` writes it."""
    text = (f"-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n"
            "************************* IMPORTANT *************************\n"
            "NKEY Seed printed below can be used to sign and prove identity.\n\n"
            f"-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n\n"
            "*************************************************************\n")
    return text.replace("\n", newline).encode()


JWT = ".".join(_b64(part) for part in (b'{"typ":"JWT"}', b'{"sub":"U"}', bytes(64)))
SEED = nkeys.encode_seed(bytes(range(32)), nkeys.PREFIX_BYTE_USER).decode()


def test_a_well_formed_creds_file_passes_the_checks(tmp_path: Path) -> None:
    """A JWT and a seed, each after its marker: the worker goes on to import the app."""
    path = tmp_path / "worker.creds"
    path.write_bytes(creds(JWT, SEED))
    status, err = worker_usage("--nats-creds", str(path))
    assert status == 2 and "--app: cannot import" in err, err


@pytest.mark.parametrize(("content", "message"), [
    (b"", "no '-----BEGIN NATS USER JWT-----' line"),
    (b"sekrit: not a creds file\n", "no '-----BEGIN NATS USER JWT-----' line"),
    (creds("sekrit", SEED), "holds no user JWT"),
    (creds(JWT, "SUsekrit"), "holds no valid nkey seed"),
    (creds(JWT, SEED)[:-300], "no '-----BEGIN USER NKEY SEED-----' line"),
    (creds(JWT, SEED, newline="\r\n"), "holds no user JWT"),
])
def test_a_creds_file_without_a_jwt_and_a_seed_is_a_usage_error(
        tmp_path: Path, content: bytes, message: str) -> None:
    """An empty or junk creds file passed the start-up checks (a junk --nats-nkey did
    not): the app was imported, then the connection failed (an Authorization Violation,
    an empty file's worker retrying for ever) or, on a server without authentication,
    went on. Now: exit 2, one line naming the flag and the file, before the app is
    imported, never what the file holds."""
    path = tmp_path / "worker.creds"
    path.write_bytes(content)
    status, err = worker_usage("--nats-creds", str(path))
    assert status == 2, err
    assert err.count("\n") == 1 and "--nats-creds: " in err and message in err, err
    assert repr(str(path)) in err
    assert "sekrit" not in err and SEED not in err and JWT not in err
    assert "no_such_module" not in err


def test_the_creds_variable_is_named_when_it_gave_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "worker.creds"
    path.write_bytes(b"")
    monkeypatch.setenv("TURNROUTER_NATS_CREDS", str(path))
    status, err = worker_usage()
    assert status == 2 and err.startswith("turnrouter worker: error: TURNROUTER_NATS_CREDS: ")


def _nats_py_reads(path: str) -> bool:
    """Whether nats-py, connecting with `path`, would send a JWT and sign with a seed."""
    data = Path(path).read_bytes()
    if b"BEGIN NATS USER JWT" not in data:  # (nats-py's reader would loop for ever)
        return False
    client = Client()
    try:
        jwt = client._read_creds_user_jwt(path)
        seed = client._read_creds_user_nkey(path)  # (ErrInvalidUserCredentials, None)
        nkeys.from_seed(seed)
    except Exception:
        return False
    return re.fullmatch(rb"[\w-]+\.[\w-]+\.[\w-]+", bytes(jwt), re.ASCII) is not None


_PIECES = st.one_of(
    st.sampled_from(["-----BEGIN NATS USER JWT-----", "-----BEGIN USER NKEY SEED-----",
                     JWT, SEED, SEED[:-1], JWT + " ", "", "a.b.c", "x"]),
    st.text(alphabet="AZaz09._-=\r ", max_size=12))
_CONTENTS = st.one_of(
    # Lines in any order, ending with a line break or not.
    st.builds(lambda lines, ending: ("\n".join(lines) + ending).encode(),
              st.lists(_PIECES, max_size=8), st.sampled_from(["\n", "", "\r\n"])),
    # nsc's layout, with a JWT and a seed that may be wrong, or cut short.
    st.builds(lambda jwt, seed, newline, cut: creds(jwt, seed, newline)[:cut],
              st.one_of(st.just(JWT), _PIECES), st.one_of(st.just(SEED), _PIECES),
              st.sampled_from(["\n", "\n", "\r\n"]),
              st.one_of(st.none(), st.integers(0, 400))),
)


@settings(max_examples=300, deadline=None)
@given(_CONTENTS)
def test_the_creds_check_agrees_with_how_nats_py_reads_the_file(content: bytes) -> None:
    """For any file made of marker, JWT and seed lines: the worker refuses it at start-up
    (exit 2, one line naming the flag) exactly when nats-py, connecting with it, would
    find no JWT or no valid seed; otherwise it goes on to import the app."""
    with tempfile.TemporaryDirectory(prefix="turnrouter-creds-") as folder:
        path = os.path.join(folder, "worker.creds")
        Path(path).write_bytes(content)
        status, err = worker_usage("--nats-creds", path)
        usable = _nats_py_reads(path)
    event(f"nats-py can use it: {usable}")
    assert status == 2 and err.count("\n") == 1, err
    assert ("--app: cannot import" in err) == usable, err
    assert usable or "--nats-creds: " in err
    assert SEED not in err and JWT not in err


def test_metrics_host_and_port_are_checked_before_the_app_loads() -> None:
    """A --metrics-host that does not resolve, or is not this machine's, and a
    --metrics-port another process listens on: exit 2, one line naming the flags, before
    the app is imported (the host was found only after the import)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for host, port_flag in (("no such host", "0"), ("203.0.113.7", "0"),
                                ("127.0.0.1", str(port)), ("::zz", "0")):
            status, err = worker_usage("--metrics-host", host, "--metrics-port", port_flag)
            assert status == 2, err
            assert err.count("\n") == 1 and "cannot serve /metrics there" in err, err
            assert f"--metrics-host {host!r} --metrics-port {port_flag}" in err
            assert "no_such_module" not in err
    status, err = worker_usage("--metrics-host", "127.0.0.1", "--metrics-port", "0")
    assert status == 2 and "--app: cannot import" in err, err
