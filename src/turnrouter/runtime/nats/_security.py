"""How workers and front ends connect: credentials, TLS, inboxes, and quiet errors.

Trust is NATS's own (accounts, users, subject permissions, TLS; see deploy/nats/ and
docs/distributed.md): this module only turns a `NatsConfig` into `nats.connect` options.
Each role gets its own inbox prefix (`_INBOX_<prefix>_worker`, `_INBOX_<prefix>_frontend`)
so a server configuration can let front ends subscribe to their replies only, never to a
worker's (which carry participant state). nats-py's default error callback logs a
traceback per failed attempt; ours logs one line with every secret masked, and hands a
publish or subscription the server refused for the user's permissions to the
connection's `Denials` (_permissions.py: a start-up it ends, later ones logged once per
subject).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import ssl
import stat
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client
from nats.errors import Error as NatsError

from ..._exceptions import LifecycleError
from ..._redact import redact_text
from ._cancel import cancel_and_wait
from ._creds import creds_problem
from ._permissions import Denials, parse_denial
from ._wire import NatsConfig, userinfo

__all__ = ["PlaintextRefusedError", "bound_tls_reads", "connect", "connect_options", "inbox_prefix",
           "requires_tls", "safe_error", "secrets_of", "unusable_file"]

logger = logging.getLogger("turnrouter.runtime.nats")


def inbox_prefix(config: NatsConfig, role: str) -> str:
    """The reply-subject prefix of one role (`worker` or `frontend`)."""
    return f"_INBOX_{config.prefix}_{role}"


def secrets_of(config: NatsConfig) -> tuple[str, ...]:
    """The secrets a configuration holds: its password, token and URL user info."""
    found = [s for s in (config.password, config.token) if s]
    for server in config.servers:
        head, sep, _ = server.partition("@")
        if sep:
            userinfo = head.rpartition("//")[2]
            found.append(userinfo.partition(":")[2] or userinfo)
    return tuple(s for s in found if s)


def safe_error(config: NatsConfig, exc: BaseException) -> str:
    """`repr(exc)` with the configuration's secrets and any URL user info masked."""
    return redact_text(repr(exc)[:500], secrets_of(config))


async def connect(config: NatsConfig, role: str, *, patience: float | None = None,
                  denials: Denials | None = None, **options: Any) -> Client:
    """A connection with the configuration's credentials and TLS (`options` go to
    `nats.connect` and win, but an `error_cb` is called after turnrouter's own). A
    refusal of the credentials or of TLS ends the first connection at once: nats-py
    would otherwise retry the same refused credentials until its attempts run out.
    With `patience` (seconds) an unreachable server is tried again (every
    `reconnect_time_wait`, one log line per failed attempt) until it answers or
    `patience` ran out. `LifecycleError` with the URL and error masked. Each publish
    or subscription the server refuses for the connection's permissions (nats-py reports
    those only to its error callback) goes to `denials` (a new one of `role` when None;
    `denials_of(nc)` either way)."""
    refused: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
    attempts = _Attempts(patience)
    denials = denials or Denials(config, role)
    theirs = options.pop("error_cb", None)
    servers, from_url = url_credentials(config.servers)
    merged = {**connect_options(config, role, refused, attempts, denials), **from_url,
              **options}
    if theirs is not None:  # the caller's sees every error too, after ours
        merged["error_cb"] = _both(merged["error_cb"], theirs)
    merged["reconnected_cb"] = _back(attempts, merged.get("reconnected_cb"))
    if patience is not None:
        merged["max_reconnect_attempts"] = -1  # nats-py tries until cancelled below
    nc = _TlsClient() if requires_tls(config) else _BoundedClient()
    denials.attach(nc)
    connecting: asyncio.Future[Any] = asyncio.ensure_future(nc.connect(servers, **merged))
    either: list[asyncio.Future[Any]] = [connecting, refused]
    try:
        await asyncio.wait(either, timeout=patience, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not connecting.done():
            await cancel_and_wait((connecting,))  # nats-py's retries may lose one
            await asyncio.gather(nc.close(), return_exceptions=True)
    if not connecting.cancelled() and connecting.exception() is None:
        attempts.connected = True
        return nc
    if refused.done():
        error = refused.result()
    elif connecting.cancelled():  # `patience` ran out
        error = attempts.last or TimeoutError("no answer")
        if not attempts.count:  # (the bound was shorter than one attempt: redteam22 N2)
            raise LifecycleError(
                f"cannot connect to NATS at {config.safe_url}: no attempt finished within "
                f"reconnect_for ({patience:g} s): give it a few seconds") from None
        raise LifecycleError(
            f"cannot connect to NATS at {config.safe_url}: unreachable for "
            f"{attempts.elapsed():.1f} s ({attempts.count} attempts; reconnect_for is "
            f"{patience:g} s): {safe_error(config, error)}") from None
    else:
        error = connecting.exception() or TimeoutError("no answer")
    raise LifecycleError(f"cannot connect to NATS at {config.safe_url}: "
                         f"{safe_error(config, error)}{_refusal_hint(error, role)}") from None


def _refusal_hint(error: BaseException, role: str) -> str:
    """What to check when the server refused the credentials (newcomer16: a bare
    "Authorization Violation" did not say where credentials go)."""
    if isinstance(error, ssl.SSLError | PlaintextRefusedError) or not _is_refusal(error):
        return ""
    where = ("--nats-user with TURNROUTER_NATS_PASSWORD, --nats-creds, --nats-nkey, or "
             "TURNROUTER_NATS_TOKEN" if role == "worker" else
             "NatsConfig's user and password, creds_file, nkey_seed_file or token")
    return f" (the server refused the credentials given, or their absence: see {where})"


def url_credentials(servers: list[str]) -> tuple[list[str], dict[str, str]]:
    """`servers` without the user and password their URLs give, and those decoded as
    `nats.connect` options, when they are percent-encoded (`p%2Fw` for `p/w`, as a URL
    must write a password holding `/`, `?`, `#` or `@`): nats-py sends what the URL
    says, escapes included, and the server refused it. Unchanged when no URL holds an
    escape in its credentials, or when the URLs give different ones."""
    raw = [userinfo(server) for server in servers]
    given = [info for info in raw if info]
    decoded = {urllib.parse.unquote(info) for info in given}  # (any hex case)
    if len(decoded) != 1 or not any("%" in info for info in given):
        return servers, {}
    plain = [server.replace(f"{info}@", "", 1) if info else server
             for server, info in zip(servers, raw, strict=True)]
    user, colon, password = given[0].partition(":")
    if colon:  # (nats-py: a URL's user and password win over the options')
        return plain, {"user": urllib.parse.unquote(user),
                       "password": urllib.parse.unquote(password)}
    return plain, {"token": urllib.parse.unquote(user)}


#: Connection errors of a connection without `patience` (a front end's, retried for
#: ever) less than this many seconds apart are one outage; within one, the 1st, 2nd,
#: 4th, 8th... error is logged, and one at least every `_QUIET_LOG` seconds.
_OUTAGE_GAP = 10.0
_QUIET_LOG = 30.0


#: What a refused first connection's line adds (a typo in the port, no server started).
_UNREACHABLE = " (is a nats-server listening at that address?)"


class _Attempts:
    """The failed attempts of a first connection (with `patience`: numbered in the log,
    each one), or of a connection retried for ever (without: its errors within one
    outage logged sparsely, `logged`)."""

    def __init__(self, patience: float | None) -> None:
        self.patience, self.count, self.started = patience, 0, time.monotonic()
        self.last: BaseException | None = None
        self.connected = False  # the first connection was made (later errors: reconnects)
        self._outage = 0  # errors of the current outage
        self._previous = self._logged = -math.inf  # when the last error came, was logged

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def back(self) -> None:
        """Connected again: the outage ended, however soon the next error comes."""
        self._outage, self._previous = 0, -math.inf

    def failed(self, exc: BaseException) -> str:
        """Count one failure; how the log line names it."""
        self.count, self.last = self.count + 1, exc
        if self.patience is None or self.connected:
            return ""
        return f"connect attempt {self.count} failed ({self.elapsed():.1f} s of " \
               f"{self.patience:g} s): "

    def logged(self) -> str | None:
        """After `failed`: None when this error is not logged, else what its line adds.
        With `patience`, the 1st, 2nd, 4th... attempt and one at least every
        `_QUIET_LOG` s (each numbered, saying where the bounded wait is: a worker given
        a wrong port logged 120 lines in its minute, newcomer22); without, the same
        spacing within one outage (errors less than `_OUTAGE_GAP` s apart): a front end
        retrying every 0.25 s would otherwise log four lines a second for as long as
        the server is away."""
        now = time.monotonic()
        if self.patience is not None and not self.connected:
            if self.count & (self.count - 1) and now - self._logged < _QUIET_LOG:
                return None
            self._logged = now
            return _UNREACHABLE if isinstance(self.last, ConnectionRefusedError) else ""
        if now - self._previous >= _OUTAGE_GAP:
            self._outage = 0
        self._previous, self._outage = now, self._outage + 1
        if self._outage & (self._outage - 1) and now - self._logged < _QUIET_LOG:
            return None
        self._logged = now
        return "" if self._outage == 1 else f" ({self._outage} errors in a row)"


def requires_tls(config: NatsConfig) -> bool:
    """TLS is configured (a `tls://` server, a CA or a client certificate): a server that
    does not offer it is refused, as the Go client does, rather than sent credentials
    in clear (nats-py itself upgrades only when the server asks for TLS)."""
    return (config.tls_ca_file is not None or config.tls_cert_file is not None
            or any(server.lower().startswith("tls://") for server in config.servers))


class PlaintextRefusedError(NatsError):
    """The server offered no TLS where the configuration asks for it."""


class _BoundedClient(Client):
    """A nats-py client whose reads over TLS are bounded (`bound_tls_reads`), at each
    connection and reconnection: also where TLS comes from the server (a `nats://` URL
    to a server that requires TLS: nats-py upgrades then too)."""

    def _connect_command(self) -> bytes:
        bound_tls_reads(self)
        command: bytes = super()._connect_command()
        return command


class _TlsClient(_BoundedClient):
    """A nats-py client that refuses, before it sends CONNECT (and with it any
    credentials), a server whose INFO does not require TLS: nats-py has upgraded the
    connection to TLS by then exactly when the server required it."""

    def _connect_command(self) -> bytes:
        if not self._server_info.get("tls_required"):
            raise PlaintextRefusedError(
                "the NATS server offers no TLS, but TLS is configured (a tls:// URL, "
                "a CA or a client certificate): refusing to send credentials in clear; "
                "enable TLS on the server (its tls block)")
        return super()._connect_command()


def bound_tls_reads(nc: Client) -> bool:
    """Give the stream reader of `nc`'s TLS connection its transport, so that it stops
    reading once it holds 128 KiB nobody parsed yet (True when it had none before).

    nats-py (2.16) upgrades a connection to TLS with a new `asyncio.StreamReader` that is
    never told its transport (asyncio's `start_tls` makes no `connection_made` call), so
    the reader never pauses it: whatever the server sends faster than the client parses
    piled up in the reader (a flood of 64 KB fleet messages at 37 MB/s: 150 MB in 5 s,
    the worker's RSS at 0.9 GB), behind it the PONGs, until two pings went unanswered
    and the connection was dropped. Bounded, the excess waits in the socket and the
    server, whose own limit for a slow reader applies (see docs/limits.md). Left alone
    where nats-py's transport looks otherwise (another version, a websocket)."""
    transport: Any = getattr(nc, "_transport", None)
    reader = getattr(transport, "_io_reader", None)
    writer = getattr(transport, "_io_writer", None)
    if (isinstance(reader, asyncio.StreamReader) and isinstance(writer, asyncio.StreamWriter)
            and getattr(reader, "_transport", False) is None):
        reader.set_transport(writer.transport)
        return True
    return False


def _is_refusal(exc: BaseException) -> bool:
    if isinstance(exc, ssl.SSLError | PlaintextRefusedError):
        return True
    text = str(exc).lower()
    return isinstance(exc, NatsError) and ("authorization" in text
                                           or "authentication" in text)


def connect_options(config: NatsConfig, role: str,
                    refused: asyncio.Future[BaseException] | None = None,
                    attempts: _Attempts | None = None,
                    denials: Denials | None = None) -> dict[str, Any]:
    """`nats.connect` keyword arguments for the configuration's credentials and TLS
    (`LifecycleError` naming the file, never its content, when one cannot be used)."""
    options: dict[str, Any] = {"inbox_prefix": inbox_prefix(config, role),
                               "error_cb": _error_callback(config, refused, attempts,
                                                           denials)}
    if config.user is not None:
        options["user"], options["password"] = config.user, config.password
    if config.token is not None:
        options["token"] = config.token
    if config.creds_file is not None or config.nkey_seed_file is not None:
        try:
            import nkeys  # noqa: F401  # nats-py signs the server's nonce with it
        except ImportError as exc:
            raise LifecycleError("NATS creds and nkey files need the nkeys package "
                                 "(the nats extra; from a checkout: "
                                 "pip install -e '.[nats]')") from exc
        for path in (config.creds_file, config.nkey_seed_file):
            if path is not None:
                _readable(path)
        if config.creds_file is not None:
            _creds(config.creds_file)
            options["user_credentials"] = config.creds_file
        else:
            assert config.nkey_seed_file is not None
            _nkey_seed(config.nkey_seed_file)
            options["nkeys_seed"] = config.nkey_seed_file
    if config.tls_ca_file is not None or config.tls_cert_file is not None:
        options["tls"] = _tls_context(config)
    return options


#: The largest credentials file (creds, nkey seed, client certificate or key) and CA
#: bundle read: a creds file is about 1 kB, a system CA bundle about 200 kB.
MAX_SECRET_FILE_BYTES = 64 * 1024
MAX_CA_FILE_BYTES = 16 * 1024 * 1024


def _readable(path: str, limit: int = MAX_SECRET_FILE_BYTES) -> None:
    """`LifecycleError` unless `path` is a regular file of at most `limit` bytes that
    opens: a named pipe nobody writes blocked the start for ever (and SIGTERM with it,
    the loop stuck in `open()`), `/dev/zero` was read until memory ran out (redteam14).
    `stat` neither opens nor reads, so it cannot block on either."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise LifecycleError(f"cannot read {path!r}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise LifecycleError(f"cannot read {path!r}: not a regular file (a directory, "
                             "a pipe or a device)")
    if info.st_size > limit:
        raise LifecycleError(f"cannot read {path!r}: {info.st_size} bytes, over the "
                             f"{limit} bytes such a file may hold")
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise LifecycleError(f"cannot read {path!r}: {exc.strerror}") from None


def _creds(path: str) -> None:
    """`LifecycleError` unless `path` holds a user JWT and an nkey seed as nats-py reads
    them: junk or an empty file failed later as an Authorization Violation, or connected
    to a server without authentication, or hung a worker's start (redteam21 F8)."""
    problem = creds_problem(path, MAX_SECRET_FILE_BYTES)
    if problem is not None:
        raise LifecycleError(problem)


def unusable_file(config: NatsConfig) -> tuple[str, str] | None:
    """The first credentials or TLS file of `config` that a connection could not use,
    as its `NatsConfig` field and the problem (naming the file, never its content);
    None when each can be used. The checks `connect_options` makes when it connects, for
    a command line to name the flag at start-up: too big, not a regular file, an nkey
    seed that is none, a CA bundle or client certificate and key that do not load."""
    for field, limit in (("creds_file", MAX_SECRET_FILE_BYTES),
                         ("nkey_seed_file", MAX_SECRET_FILE_BYTES),
                         ("tls_ca_file", MAX_CA_FILE_BYTES),
                         ("tls_cert_file", MAX_SECRET_FILE_BYTES),
                         ("tls_key_file", MAX_SECRET_FILE_BYTES)):
        path = getattr(config, field)
        if path is None:
            continue
        try:
            _readable(path, limit)
            if field == "creds_file":
                _creds(path)
            if field == "nkey_seed_file" and config.creds_file is None:
                try:
                    import nkeys  # noqa: F401
                except ImportError:  # (said by `connect_options`)
                    continue
                _nkey_seed(path)
        except LifecycleError as exc:
            return field, str(exc)
    step = "tls_ca_file"
    try:
        if config.tls_ca_file is not None:
            ssl.create_default_context(cafile=config.tls_ca_file)
        if config.tls_cert_file is not None and config.tls_key_file is not None:
            step = "tls_cert_file"
            ssl.create_default_context().load_cert_chain(config.tls_cert_file,
                                                         config.tls_key_file)
    except (OSError, ssl.SSLError) as exc:
        what = (f"the CA file {config.tls_ca_file!r}" if step == "tls_ca_file" else
                f"the client certificate {config.tls_cert_file!r} with its key "
                f"{config.tls_key_file!r}")
        return step, (f"cannot load {what}: {type(exc).__name__}: "
                      f"{getattr(exc, 'strerror', None) or exc.args[-1]}")
    return None


def _nkey_seed(path: str) -> None:
    """Check that `path` holds an nkey seed as nats-py reads it (stripped), so a file
    that does not is named here: nats-py's own error (`ErrInvalidSeed()`) names none."""
    import nkeys

    try:
        with open(path, "rb") as file:  # (checked by `_readable`; bounded if grown since)
            seed = bytearray(file.read(MAX_SECRET_FILE_BYTES + 1).strip())
    except OSError as exc:
        raise LifecycleError(f"cannot read {path!r}: {exc.strerror}") from None
    try:
        nkeys.from_seed(seed)
    except Exception:  # nkeys raises its own errors and binascii's; none is shown
        raise LifecycleError(f"{path!r} holds no valid nkey seed") from None
    finally:
        seed[:] = bytes(len(seed))  # the seed is a secret: no copy stays behind


def _tls_context(config: NatsConfig) -> ssl.SSLContext:
    # Each step names the file it read and the problem, never what the file holds
    # (ssl's own errors name neither: "No such file or directory", "[X509] PEM lib").
    step = f"the CA file {config.tls_ca_file!r}" if config.tls_ca_file else "the system CAs"
    if config.tls_ca_file is not None:
        _readable(config.tls_ca_file, MAX_CA_FILE_BYTES)
    for path in (config.tls_cert_file, config.tls_key_file):
        if path is not None:
            _readable(path)
    try:
        context = ssl.create_default_context(cafile=config.tls_ca_file)
        if config.tls_cert_file is not None and config.tls_key_file is not None:
            step = (f"the client certificate {config.tls_cert_file!r} with its key "
                    f"{config.tls_key_file!r}")
            context.load_cert_chain(config.tls_cert_file, config.tls_key_file)
    except (OSError, ssl.SSLError) as exc:
        raise LifecycleError(f"cannot load {step}: {type(exc).__name__}: "
                             f"{getattr(exc, 'strerror', None) or exc.args[-1]}") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def _both(ours: Callable[[Exception], Awaitable[None]],
          theirs: Callable[[Exception], Awaitable[None]]
          ) -> Callable[[Exception], Awaitable[None]]:
    """An error callback calling ours (refusals, credentials refused, one log line),
    then the caller's: a caller's `error_cb` option would otherwise replace ours, and
    a refused permission or credential would wait for a timeout again."""
    async def on_error(exc: Exception) -> None:
        await ours(exc)
        await theirs(exc)
    return on_error


def _back(attempts: _Attempts, theirs: Callable[[], Awaitable[None]] | None
          ) -> Callable[[], Awaitable[None]]:
    """A reconnected callback ending the outage in `attempts` (the next error starts
    a new one, logged from its first), then calling the caller's."""
    async def reconnected() -> None:
        attempts.back()
        if theirs is not None:
            await theirs()
    return reconnected


def _error_callback(config: NatsConfig, refused: asyncio.Future[BaseException] | None,
                    attempts: _Attempts | None = None,
                    denials: Denials | None = None
                    ) -> Callable[[Exception], Awaitable[None]]:
    async def on_error(exc: Exception) -> None:
        denied = parse_denial(exc)
        if denied is not None and denials is not None:
            denials.record(*denied)  # logged there, once per subject
            return
        if refused is not None and attempts is not None and not attempts.connected and (
                refused.done() or _is_refusal(exc)):
            # The first connection refused: the caller's error says it, once (the
            # server then resets the connection; that is no news either).
            if not refused.done():
                refused.set_result(exc)
            return
        what = attempts.failed(exc) if attempts is not None else ""
        after = attempts.logged() if attempts is not None else ""
        if after is not None:
            logger.warning("turnrouter: NATS at %s: %s%s%s", config.safe_url, what,
                           safe_error(config, exc), after)
        if refused is not None and not refused.done() and _is_refusal(exc):
            refused.set_result(exc)
    return on_error
