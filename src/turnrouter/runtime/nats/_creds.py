"""The shape of a NATS `.creds` file (`NatsConfig.creds_file`, `turnrouter worker
--nats-creds`), checked before a connection uses it.

A creds file (as `nsc` writes it) holds a user JWT and the user's nkey seed, each on the
line after its marker:

    -----BEGIN NATS USER JWT-----
    eyJ0eXAiOiJKV1QiLCJhbGciOiJlZDI1NTE5LW5rZXkifQ.eyJ...In0.WW...Bg
    ------END NATS USER JWT------
    ...
    -----BEGIN USER NKEY SEED-----
    SUAM...
    ------END USER NKEY SEED------

nats-py reads them so (the line after each marker, its last character dropped) only when
it connects, and says nothing a reader can act on when they are not there (an
`Authorization Violation`, or none on a server without authentication): checked here
the same way, the problem named, never what the file holds (redteam21 F8).
"""

from __future__ import annotations

import re

__all__ = ["JWT_MARKER", "SEED_MARKER", "creds_problem"]

JWT_MARKER = b"BEGIN NATS USER JWT"
SEED_MARKER = b"BEGIN USER NKEY SEED"
#: A JWT: three base64url parts (header, claims, signature).
_JWT = re.compile(rb"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+")


def creds_problem(path: str, limit: int) -> str | None:
    """What keeps the creds file `path` (read up to `limit` bytes) from being used, naming
    the file and never its content; None when it holds a JWT and a valid nkey seed."""
    try:
        with open(path, "rb") as file:
            data = bytearray(file.read(limit + 1))
    except OSError as exc:
        return f"cannot read {path[:200]!r}: {exc.strerror or exc}"
    seed = bytearray()
    try:
        jwt = _after(data, JWT_MARKER)
        if jwt is None:
            return (f"{path[:200]!r} is no NATS creds file: no "
                    f"'-----{JWT_MARKER.decode()}-----' line")
        if _JWT.fullmatch(jwt) is None:
            return (f"{path[:200]!r} holds no user JWT on the line after its "
                    f"'-----{JWT_MARKER.decode()}-----' line")
        found = _after(data, SEED_MARKER)
        if found is None:
            return (f"{path[:200]!r} is no NATS creds file: no "
                    f"'-----{SEED_MARKER.decode()}-----' line with a seed after it")
        seed = found
        return None if _is_seed(seed) else (
            f"{path[:200]!r} holds no valid nkey seed on the line after its "
            f"'-----{SEED_MARKER.decode()}-----' line")
    finally:
        # The seed is a secret: no copy stays behind.
        seed[:] = bytes(len(seed))
        data[:] = bytes(len(data))


def _after(data: bytearray, marker: bytes) -> bytearray | None:
    """The line after the first line holding `marker`, its last character dropped (as
    nats-py reads it); None when there is no such line."""
    at = data.find(marker)
    if at < 0:
        return None
    start = data.find(b"\n", at)
    if start < 0 or start + 1 >= len(data):
        return None
    start += 1
    end = data.find(b"\n", start)
    end = len(data) if end < 0 else end + 1
    return data[start:end - 1]


def _is_seed(seed: bytearray) -> bool:
    try:
        import nkeys
    except ImportError:  # (said when the worker connects)
        return True
    try:
        nkeys.from_seed(seed).wipe()
    except Exception:  # nkeys raises its own errors and binascii's; none is shown
        return False
    return True
