"""Publishes and subscriptions the server refused for the connection's permissions.

The server answers a refused publish or subscription with `-ERR 'Permissions Violation
for Publish to "<subject>"'` (or `for Subscription to ...`) and keeps the connection;
nats-py hands that to its error callback only, lower-cased, and a request whose publish
or reply subscription was refused simply times out. Each connection of a worker or
front end keeps a `Denials`: the error callback records each refusal there, which

- at start-up (`Denials.guard`) ends the step at once with a `DeniedError` (a
  `ConfigurationError`) naming the refused subjects and the role the credentials do not
  seem to have: credentials of the other role (the shipped configuration's `worker`
  and `frontend` swapped) waited for a request's timeout, or retried for
  `reconnect_for` seconds, before saying anything useful;
- later is logged once per subject (one line naming the subject and the user's role),
  counted (`Denials.count`, per subject), and never ends anything. At most
  `MAX_SUBJECTS` subjects are told apart; past them refusals are counted together.

Secrets never appear: a message names the subject, the user name (not a secret) and
the role, nothing of the password, token or files.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import re
import weakref
from collections.abc import Awaitable, Callable
from typing import NamedTuple, TypeVar

from nats.aio.client import Client

from ..._exceptions import ConfigurationError
from ..._limits import is_logged
from ._cancel import cancel_and_wait
from ._wire import NatsConfig

__all__ = ["MAX_SUBJECTS", "Denial", "Denials", "DeniedError", "denials_of", "parse_denial"]

logger = logging.getLogger("turnrouter.runtime.nats")

T = TypeVar("T")

#: Subjects whose refusals are counted (and logged) one by one; past them, together.
MAX_SUBJECTS = 256
#: Subjects whose spelling is remembered to show them as sent (nats-py lower-cases them).
_KNOWN = 256
#: Seconds a failed start-up step waits for the server to report the refusals of what
#: it sent with the first one (a ping's round trip), to name them all.
_COLLECT_SECS = 1

#: nats-py's text of a refusal: `nats: permissions violation for publish to "<subject>"`
#: (or `subscription to "<subject>"`, maybe followed by `using queue "<queue>"`).
_DENIED = re.compile(r'permissions violation for (publish|subscription) to "([^"]*)"',
                     re.IGNORECASE)

#: The subject prefix the shipped permissions name.
_SHIPPED_PREFIX = "turnrouter"
#: What each role's user is called in the shipped configuration, and its permissions.
_SHIPPED = {"worker": ("a worker's", "worker", "WORKER_PERMISSIONS"),
            "frontend": ("a front end's", "frontend", "FRONTEND_PERMISSIONS")}


class Denial(NamedTuple):
    """One refusal: `kind` is "publish" or "subscription"; `subject` as this connection
    sent it where known (else as nats-py reports it, lower-cased); `lowered` as reported."""

    kind: str
    subject: str
    lowered: str


class DeniedError(ConfigurationError):
    """The server refused a publish or subscription the role must make (`denials`)."""

    def __init__(self, message: str, denials: list[Denial]) -> None:
        super().__init__(message)
        self.denials = denials


def parse_denial(error: BaseException) -> tuple[str, str] | None:
    """(kind, subject as nats-py reports it) when `error` is a permissions violation."""
    found = _DENIED.search(str(error))
    if found is None:
        return None
    return found.group(1).lower(), found.group(2)


_of: weakref.WeakKeyDictionary[Client, Denials] = weakref.WeakKeyDictionary()


def denials_of(nc: Client) -> Denials | None:
    """The `Denials` of a connection `connect` made (None for one made otherwise)."""
    return _of.get(nc)


class Denials:
    """The refusals of one connection of `role` ("worker" or "frontend")."""

    def __init__(self, config: NatsConfig, role: str) -> None:
        self._config, self._role = config, role
        self._client: weakref.ref[Client] | None = None
        self.count = 0
        """Refusals so far."""
        self.per_subject: dict[tuple[str, str], int] = {}
        """Refusals so far by (kind, subject as reported); at most `MAX_SUBJECTS`."""
        self.others = 0
        """Refusals of subjects past the first `MAX_SUBJECTS`."""
        self.recent: collections.deque[Denial] = collections.deque(maxlen=16)
        self._known: dict[str, str] = {}
        self._inbox = f"_INBOX_{config.prefix}_{role}"
        self._guarded: list[Denial] | None = None  # the refusals of the guarded step
        self._fatal: Callable[[Denial], bool] = lambda denial: True
        self._alarm: asyncio.Future[None] | None = None
        self._quiet = False  # reported by an error already: counted, not logged

    def attach(self, nc: Client) -> None:
        """Make this the connection's `denials_of(nc)`."""
        self._client = weakref.ref(nc)  # (the registry holds the connection weakly)
        _of[nc] = self

    def known(self, subject: str) -> None:
        """Remember how `subject` is spelled (shown so when it is refused)."""
        if len(self._known) >= _KNOWN:
            del self._known[next(iter(self._known))]
        self._known[subject.lower()] = subject

    def _shown(self, lowered: str) -> str:
        if lowered in self._known:
            return self._known[lowered]
        inbox = self._inbox.lower()
        if lowered == inbox or lowered.startswith(inbox + "."):
            return f"{self._inbox}.>"
        return lowered

    def record(self, kind: str, reported: str) -> None:
        """One refusal (from the error callback)."""
        lowered = reported.lower()
        denial = Denial(kind, self._shown(lowered), lowered)
        self.count += 1
        self.recent.append(denial)
        key = (kind, lowered)
        if key in self.per_subject or len(self.per_subject) < MAX_SUBJECTS:
            seen = self.per_subject[key] = self.per_subject.get(key, 0) + 1
        else:
            self.others += 1
            seen = 0
        if self._guarded is not None and self._fatal(denial):
            self._guarded.append(denial)
            if self._alarm is not None and not self._alarm.done():
                self._alarm.set_result(None)
            return
        if self._quiet:
            return
        if seen == 1:
            logger.warning("turnrouter: NATS refused %s to %r (permissions violation%s): "
                           "%s; logged once per subject (and at its 10th, 100th, ... "
                           "refusal)", kind, denial.subject, self._user(),
                           self._why_runtime())
        elif seen and is_logged(seen):
            logger.warning("turnrouter: NATS refused %s to %r %d times so far "
                           "(permissions violation)", kind, denial.subject, seen)
        elif not seen and is_logged(self.others):
            logger.warning("turnrouter: NATS refused %d publishes or subscriptions of "
                           "subjects past the first %d refused (permissions violation)",
                           self.others, MAX_SUBJECTS)

    def refused(self, kind: str, subject: str, since: int) -> bool:
        """Whether a `kind` of `subject` was refused lately, after `since` refusals."""
        lowered = subject.lower()
        return self.count > since and any(d.kind == kind and d.lowered == lowered
                                          for d in self.recent)

    async def guard(self, work: Awaitable[T],
                    fatal: Callable[[Denial], bool] = lambda denial: True) -> T:
        """`work`, ended at once by a refusal `fatal` says it cannot do without: then,
        after a round trip for the refusals of what was sent with it, `DeniedError`
        naming them (other refusals are logged as usual)."""
        loop = asyncio.get_running_loop()
        self._guarded, self._fatal = [], fatal
        alarm = self._alarm = loop.create_future()
        task = asyncio.ensure_future(work)
        try:
            await asyncio.wait((task, alarm), return_when=asyncio.FIRST_COMPLETED)
            if not alarm.done():
                return task.result()
            await cancel_and_wait((task,))
            nc = self._client() if self._client is not None else None
            if nc is not None and nc.is_connected:
                with contextlib.suppress(Exception):
                    await nc.flush(timeout=_COLLECT_SECS)
            denied = list(self._guarded)
            self._quiet = True  # what follows is this error's doing: counted only
            raise DeniedError(self.explain(denied), denied)
        finally:
            if not task.done():
                await cancel_and_wait((task,))
            self._guarded, self._alarm = None, None
            self._fatal = lambda denial: True

    def explain(self, denied: list[Denial]) -> str:
        """One line: what the server refused, and whose credentials these are not."""
        ordered = sorted(dict.fromkeys(denied), key=lambda d: d.kind != "publish")[:3]
        what = " and ".join(f"{d.kind} to {d.subject!r}" for d in ordered)
        whose, user, permissions = _SHIPPED.get(self._role, (self._role, self._role, ""))
        refused = f"NATS refused {what} (permissions violation{self._user()})"
        if self._config.user != user:
            return (f"{refused}: these credentials are not {whose}; the shipped "
                    f"configuration's {self._name()} user is `{user}` "
                    f"(deploy/nats/permissions.conf, {permissions})")
        if self._config.prefix != _SHIPPED_PREFIX:
            return (f"{refused}: this user's permissions do not name prefix "
                    f"{self._config.prefix!r}; the shipped deploy/nats/permissions.conf "
                    f"names `{_SHIPPED_PREFIX}`: with another prefix, replace it there "
                    "throughout (docs/distributed.md, Trust)")
        return (f"{refused}: this user's permissions lack it; compare them with "
                f"deploy/nats/permissions.conf, {permissions}")

    def _name(self) -> str:
        return "front-end" if self._role == "frontend" else self._role

    def _user(self) -> str:
        user = self._config.user
        return f" for user {user!r}" if user else ""

    def _why_runtime(self) -> str:
        _, user, permissions = _SHIPPED.get(self._role, (self._role, self._role, ""))
        return (f"this {self._name()}'s permissions lack it (the shipped configuration's "
                f"{self._name()} user is `{user}`, deploy/nats/permissions.conf "
                f"{permissions})")
