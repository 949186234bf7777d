"""Subjects, participant tokens and message (de)serialisation of the NATS runtime.

Publishers put one participant's messages on `<prefix>.in.<token>.<kind>`; the input
stream's subject transform maps them to `<prefix>.p.<partition>.<token>.<kind>` with the
server's `{{partition(n,1)}}` function, so the partition of a participant is decided by
the engine and is the same for every publisher. The token is the participant id in
unpadded base64url (a valid subject token and key-value key).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from json.encoder import encode_basestring as _json_text
from json.encoder import encode_basestring_ascii as _json_str
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from pydantic_core import to_json

from ... import _strict_json as strict_json
from ..._contracts import MAX_ID_CHARS
from ..._exceptions import ConfigurationError, ContractValueError, TurnrouterError
from ..._frontend import MAX_SESSION_TURNS, MAX_SNAPSHOT_CONTAINERS
from ..._numbers import finite
from ..._redact import REDACTED, has_surrogates, looks_like_nkey_seed, preview, redact_url
from ..._timing import TimingSample
from .._messages import (
    Interrupted,
    ParticipantJoined,
    ParticipantLeft,
    RuntimeMessage,
    UserQuery,
    new_message_id,
)

if TYPE_CHECKING:
    from nats.aio.msg import Msg

__all__ = [
    "KINDS",
    "MAX_ENDED",
    "MAX_PARTICIPANT_ID_BYTES",
    "Ending",
    "NatsConfig",
    "Rejected",
    "StateRecord",
    "ack_info",
    "ack_metadata",
    "ack_sequences",
    "decode_token",
    "encode_token",
    "input_message_id",
    "kind_of",
    "output_message_id",
    "parse_input",
    "parse_record",
    "parse_samples",
    "parse_state",
    "record_json",
    "response_json",
    "samples_body",
    "server_status",
    "state_json",
    "trace_context",
    "userinfo",
]

_MAX_ID = 256  # turnrouter.MAX_ID_CHARS: turn ids in a record

#: Participant ids longer than this (UTF-8) are refused: they become subject tokens and
#: key-value keys, which the server bounds.
MAX_PARTICIPANT_ID_BYTES = 256

#: The kinds of input on a participant's subject, and their payload classes.
KINDS: dict[str, type[RuntimeMessage]] = {
    "query": UserQuery,
    "joined": ParticipantJoined,
    "left": ParticipantLeft,
    "interrupt": Interrupted,
}


#: The credential and TLS fields of `NatsConfig` (paths or names; secrets hidden in repr).
_SECRET_FIELDS = ("password", "token")
_AUTH_FIELDS = ("token", "creds_file", "nkey_seed_file")
#: A JetStream API prefix imported from another account ($JS.FRONT.API): literal tokens.
_API_PREFIX = re.compile(r"[A-Za-z0-9_$-]{1,64}(\.[A-Za-z0-9_$-]{1,64}){0,7}")
_TEXT_FIELDS = ("user", "password", "token", "creds_file", "nkey_seed_file",
                "tls_ca_file", "tls_cert_file", "tls_key_file")


#: A prefix: one subject token that also names the streams and the bucket.
_PREFIX = re.compile(r"[a-z0-9_-]{1,64}")


def _server_problem(server: str) -> str | None:
    """What is wrong with one server of a NATS URL, read as nats-py reads it (a missing
    scheme is nats://, a missing port 4222), or None: a bad port or host was only found
    at connect time, after start-up had begun."""
    if "://" in server:
        scheme = server.split("://", 1)[0].lower()
        if scheme not in ("nats", "tls", "ws", "wss"):
            return f"has scheme {scheme[:20]!r}, not nats://, tls://, ws:// or wss://"
        normalized = server
    else:
        normalized = f"nats://{server}" if ":" in server else f"nats://{server}:4222"
    try:
        parsed = urllib.parse.urlsplit(normalized)
        parsed.port  # noqa: B018 (ValueError for a port that is not a number in range)
    except ValueError:
        return "has no valid port or address"
    if not parsed.hostname:
        return "names no host"
    if "@" in normalized.split("://", 1)[1].partition(parsed.netloc)[2]:
        return ("has an '@' after its host: a password holding '/', '?', '#' or '@' "
                "must be percent-encoded")
    return None


def userinfo(server: str) -> str:
    """The credentials one server of a NATS URL carries, as written (`user:pw` of
    `nats://user:pw@host`, `token` of `nats://token@host`; a URL may leave out its
    scheme), or ''."""
    rest = server.split("://", 1)[-1]
    return rest.split("/", 1)[0].rpartition("@")[0]


def _credentials_differ(servers: list[str]) -> bool:
    """Whether the servers of a list carry different credentials (some none). A ','
    in a password splits its URL into such a list (`nats://svc:pa,ss@h` reads as
    `nats://svc:pa` and `ss@h`), whose parts an error would then show: refused, shown
    not at all."""
    given = {urllib.parse.unquote(server.split("://", 1)[-1].rpartition("@")[0])
             if "@" in server else None for server in servers}
    return len(given) > 1


def _has_userinfo(server: str) -> bool:
    """Whether a server of a NATS URL carries credentials."""
    return "@" in server.split("://", 1)[-1].split("/", 1)[0]


@dataclass(frozen=True, slots=True, repr=False)
class NatsConfig:
    """Names and timings shared by every worker and publisher of one deployment.

    `partitions` is fixed for the life of the streams (changing it remaps participants).
    `failover_timeout` is the pinned consumer's `priority_timeout`: a replica that stops
    pulling for that long loses its partitions; `ack_wait` bounds how long a message
    delivered to a dead replica waits before it is redelivered. Both set the failover gap.
    `drain_timeout` bounds a graceful end's wait for running turns (and a handover's).
    `mark_after`: a turn still running this long after its message arrived is marked in
    flight in its record (one write) so its message can be acknowledged; a turn ending
    sooner needs no mark (its finished record comes first). It is also the longest the
    partition's next message waits behind a turn that just started.

    Security (see docs/distributed.md, "Trust"): at most one way to authenticate:
    `user` + `password`, `token`, `creds_file` (a `.creds` file: user JWT and nkey
    seed) or `nkey_seed_file` (a file holding an nkey seed); credentials in the URL
    (`nats://user:password@host`) work too. `tls_ca_file` verifies the server,
    `tls_cert_file` + `tls_key_file` present a client certificate (use a `tls://` URL or a
    server that requires TLS). `url` may list several servers of one cluster,
    comma-separated (`nats://a:4222,nats://b:4222`): the connection tries them in turn and
    fails over between them; its servers carry the same credentials or none (a ',' in a
    password is written %2C). `repr()` and every error show each URL with its password
    masked and never the password or token.

    `max_input_wait`: the longest a query may wait in the input stream (from the moment
    the stream stored it to its delivery, the server's clock against the worker's) and
    still run. A query delivered later is not run: its participant hears the router's
    busy text (`AgentRouter.busy_text`) as the turn's final output, recorded first like
    any ending, and it is counted (`turnrouter_runtime_rejected_messages_total{topic=
    "nats_input", reason="expired"}`). For a voice user an answer that late is worse
    than a quick "busy": the conversation has moved on. Joined, left and interrupt
    messages carry state and run whatever their age. `input_max_age` is the stream's own
    bound on any message (it deletes older ones unread). `output_max_bytes` and
    `output_max_age` bound the output stream (the oldest outputs go first): front ends
    read outputs as they come, so only a late replay misses what they dropped.

    `front_api`: where the workers reach the JetStream API of the front ends' own
    account, in a deployment that keeps front ends in an account of their own: each
    worker creates (or accepts) there that account's mirror of the output stream, which
    its front ends read. None looks where deploy/nats/nats-server.conf imports it
    ("$JS.FRONT.API") and does nothing when nothing answers there (one account).

    `replicas`: copies a NATS cluster keeps of each stream and of the state bucket (its
    JetStream replication factor, 1 to 5; 3 rides out the loss of one server of a
    three-server cluster). Every worker and front end of a deployment gives the same
    value (they create or accept the streams).

    `state_max_age`: how long the state bucket keeps a participant's record after its
    last write (30 days): a participant silent that long starts with an empty history,
    and records of made-up participant ids do not pile up for good. A bucket that exists
    is taken as it is.

    `idle_after`: a participant with no input for this long (30 min; at least 1 s) is
    let go from its replica's memory and router (`max_participants`); its record keeps
    its state for its next input, as when its partition moves. A session that ends
    without `left` then frees its slot.

    `reconnect_for`: how long a worker rides out a lost server (retrying every 0.5 s at
    start-up, every 0.1 s once connected) before it exits with an error.
    `fleet_backlog`: messages of each fleet subject
    (control, presence, timing) a worker holds unread; past it a flood's messages are
    dropped by the client and counted (`dropped`).
    """

    url: str = "nats://127.0.0.1:4222"
    prefix: str = "turnrouter"
    partitions: int = 16
    failover_timeout: float = 1.0
    ack_wait: float = 1.5
    pull_expires: float = 0.4
    max_message_bytes: int = 64 * 1024
    dedup_window: float = 120.0
    output_max_age: float = 3600.0
    output_max_bytes: int = 1024**3
    max_queued_per_participant: int = 1000
    input_max_bytes: int = 1024**3
    input_max_age: float = 86400.0
    state_max_age: float = 30 * 86400.0
    max_input_wait: float = 10.0
    probe_interval: float = 0.5
    drain_timeout: float = 20.0
    mark_after: float = 0.005
    reconnect_for: float = 60.0
    idle_after: float = 1800.0
    fleet_backlog: int = 1024
    replicas: int = 1
    failure_text: str = "Sorry, something went wrong. Please try again."
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    creds_file: str | None = None
    nkey_seed_file: str | None = None
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    front_api: str | None = None

    def __repr__(self) -> str:
        shown = []
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name == "url":
                value = self.safe_url if isinstance(value, str) else value
            elif item.name in _SECRET_FIELDS and value is not None:
                value = REDACTED
            shown.append(f"{item.name}={value!r}")
        return f"NatsConfig({', '.join(shown)})"

    @property
    def safe_url(self) -> str:
        """The URL with any password or token masked (what errors and logs show), each
        server of a comma-separated list masked on its own. A list holding an `@` is
        masked from its scheme to its last `@` as a whole: a password's unencoded `,` and
        `@` can make it read as a list whose hosts would show pieces of it."""
        if len(self.servers) > 1 and "@" in self.url:
            scheme = self.url.split("://", 1)[0] + "://" if "://" in self.url else ""
            return f"{scheme}{REDACTED}@{self.url.rpartition('@')[2]}"
        return ",".join(redact_url(server) for server in self.servers)

    @property
    def servers(self) -> list[str]:
        """The servers `url` names (one, or a comma-separated list), in order."""
        return [server.strip() for server in self.url.split(",")]

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url or len(self.url) > 4096 or any(
                c in self.url for c in " \t\r\n\0"):
            raise ConfigurationError("NatsConfig.url must be a NATS URL (nats://host:4222)")
        if _credentials_differ(self.servers):  # first: no part of it may be shown
            raise ConfigurationError(
                "NatsConfig.url lists servers whose credentials in the URL differ (or "
                "a password holds a ',', which splits the URL into a list): the servers "
                "of a list carry the same credentials or none, and a ',' in a password "
                "is percent-encoded as %2C (the URL is not shown: it may hold a password)")
        if not all(self.servers):
            raise ConfigurationError(
                "NatsConfig.url lists an empty server (nats://a:4222,nats://b:4222)")
        for number, server in enumerate(self.servers, 1):
            problem = _server_problem(server)
            if problem is None:
                continue
            if len(self.servers) > 1 and "@" in self.url:  # (see safe_url)
                raise ConfigurationError(
                    f"NatsConfig.url: server {number} of {len(self.servers)} {problem} "
                    "(nats://host:4222; not shown: the URL holds credentials)")
            raise ConfigurationError(  # shown masked: the URL may hold a password
                f"NatsConfig.url {preview(redact_url(server))} {problem} (nats://host:4222)")
        for name in _TEXT_FIELDS:
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value
                                          and len(value) <= 4096 and "\0" not in value
                                          and "\n" not in value):
                # Never show the value: it may be a secret.
                raise ConfigurationError(
                    f"NatsConfig.{name} must be a non-empty one-line string or None")
        for name in ("creds_file", "nkey_seed_file"):
            value = getattr(self, name)
            if value is not None and looks_like_nkey_seed(value):
                raise ConfigurationError(
                    f"NatsConfig.{name} holds an nkey seed itself, not the path of a file "
                    f"holding one: put the seed in a file (not shown: it is a secret)")
        ways = [name for name in _AUTH_FIELDS if getattr(self, name) is not None]
        if any(_has_userinfo(server) for server in self.servers):
            # nats-py would send the field's credentials and drop the URL's: refused here
            # rather than as an authorization violation at connect time.
            ways.append("credentials in the URL")
        if self.user is not None or self.password is not None:
            ways.append("user/password")
            if self.user is None or self.password is None:
                raise ConfigurationError(
                    "NatsConfig.user and NatsConfig.password go together")
        if len(ways) > 1:
            raise ConfigurationError(
                f"NatsConfig: one way to authenticate at most, got {', '.join(ways)}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigurationError(
                "NatsConfig.tls_cert_file and NatsConfig.tls_key_file go together")
        if not (isinstance(self.prefix, str) and _PREFIX.fullmatch(self.prefix)):
            # It names streams (`<PREFIX>_IN`, at most 255 characters, of file names the
            # server stores) and the bucket: ASCII letters, digits, "-" and "_" only;
            # lower case, as two prefixes differing in case would name the same streams.
            raise ConfigurationError(
                f"NatsConfig.prefix must be 1 to 64 lower-case ASCII letters, digits, '-' "
                f"or '_' (one subject token that names streams, which are upper-cased: "
                f"prefixes differing in case would share them), got {preview(self.prefix)}")
        if self.front_api is not None and not (
                isinstance(self.front_api, str) and _API_PREFIX.fullmatch(self.front_api)
                and not self.front_api.startswith("$JS.API")):
            raise ConfigurationError(
                f"NatsConfig.front_api must be a subject prefix like $JS.FRONT.API (not "
                f"this account's own $JS.API), got {preview(self.front_api)}")
        if not 1 <= self.partitions <= MAX_PARTITIONS:
            raise ConfigurationError(
                f"NatsConfig.partitions must be in 1..{MAX_PARTITIONS} (a consumer each on "
                f"one stream), got {self.partitions}")
        for name in ("failover_timeout", "ack_wait", "pull_expires", "dedup_window",
                     "output_max_age", "probe_interval", "drain_timeout", "mark_after",
                     "input_max_age", "max_input_wait", "reconnect_for", "state_max_age",
                     "idle_after"):
            value = getattr(self, name)
            if not (finite(value) and 0 < value <= 366 * 86400):
                raise ConfigurationError(
                    f"NatsConfig.{name} must be a finite number of seconds in (0, 1 year], "
                    f"got {preview(value)}")
        if self.idle_after < 1.0:
            raise ConfigurationError(
                f"NatsConfig.idle_after must be at least 1 s (the sweep runs every quarter "
                f"of it), got {self.idle_after:g}")
        if self.state_max_age < self.input_max_age:
            raise ConfigurationError(
                f"NatsConfig.state_max_age ({self.state_max_age:g} s) must be at least "
                f"input_max_age ({self.input_max_age:g} s): a record expiring before the "
                "inputs it ended would let such an input run again")
        if self.pull_expires >= self.failover_timeout:
            raise ConfigurationError(
                f"NatsConfig.failover_timeout ({self.failover_timeout:g} s, "
                f"--failover-timeout) must be longer than pull_expires "
                f"({self.pull_expires:g} s), or the owning replica loses its partitions "
                "while it waits")
        if self.mark_after >= self.ack_wait / 2:
            raise ConfigurationError(
                "NatsConfig.mark_after must be under half of ack_wait, or a held message "
                "is redelivered while its turn still runs")
        if self.max_message_bytes < 1024:
            raise ConfigurationError("NatsConfig.max_message_bytes must be at least 1024")
        for name in ("input_max_bytes", "output_max_bytes"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool)
                    and 64 * self.max_message_bytes <= value <= 2**50):
                raise ConfigurationError(
                    f"NatsConfig.{name} must be an int of at least 64 messages "
                    f"(64 * max_message_bytes) and at most 1 PiB, got {preview(value)}")

        if not (type(self.replicas) is int and 1 <= self.replicas <= 5):
            raise ConfigurationError(
                f"NatsConfig.replicas must be an int in 1..5 (JetStream's replication "
                f"factor), got {preview(self.replicas)}")
        for name in ("fleet_backlog", "max_queued_per_participant"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool)
                    and 1 <= value <= 1_000_000):
                raise ConfigurationError(
                    f"NatsConfig.{name} must be an int in 1..1000000, got {preview(value)}")

    @property
    def stream(self) -> str:
        """The input stream (work queue, one message per participant event)."""
        return f"{self.prefix.upper()}_IN"

    @property
    def output_stream(self) -> str:
        """The output stream: deduplicated router and destination output."""
        return f"{self.prefix.upper()}_OUT"

    @property
    def mirror_api(self) -> str:
        """Where the front ends' account reaches this account's consumer creation, for its
        mirror of the output stream (deploy/nats/nats-server.conf imports it there)."""
        return f"$JS.{self.prefix.upper()}.API"

    @property
    def mirror_deliver(self) -> str:
        """The subject prefix the front ends' mirror receives the output stream on."""
        return f"{self.prefix}.mirror"

    @property
    def bucket(self) -> str:
        """The key-value bucket holding participant state."""
        return f"{self.prefix}_state"

    def input_subject(self, participant_id: str, kind: str) -> str:
        return f"{self.prefix}.in.{encode_token(participant_id)}.{kind}"

    def output_subject(self, participant_id: str) -> str:
        return f"{self.prefix}.out.{encode_token(participant_id)}"

    def consumer(self, partition: int) -> str:
        return f"p{partition}"

    @property
    def interrupt_all_subject(self) -> str:
        return f"{self.prefix}.ctl.interrupt"

    @property
    def timing_subject(self) -> str:
        return f"{self.prefix}.timing"

    def probe_subject(self, partition: int) -> str:
        """Where a probe of `partition` is published: an input subject whose token the
        stream's `partition()` transform sends to that partition (`probe_token`), so
        each partition's consumer reads its probes through its one filter (a second
        filter subject for probes made the server's cost per input grow with the
        backlog: `benchmarks/bench_many_participants.py`)."""
        return f"{self.prefix}.in.{probe_token(partition, self.partitions)}.probe"

    def legacy_probe_subject(self, partition: int) -> str:
        """Where turnrouter published probes before (`<prefix>.probe.<n>`): read by the
        two-filter consumers an earlier turnrouter made, which a worker still uses."""
        return f"{self.prefix}.probe.{partition}"


def _fnv1a(data: bytes) -> int:
    """FNV-1a, 32 bits: what nats-server's `partition()` subject transform hashes a
    token with (then modulo the partition count)."""
    h = 0x811C9DC5
    for byte in data:
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return h


#: Each partition count's probe tokens (at most a few counts per process).
_PROBE_TOKENS: dict[int, tuple[str, ...]] = {}


#: The most partitions: one consumer each on the input stream, and nats-server refuses
#: a stream's 1,001st consumer ("maximum consumers limit reached", redteam22 F6).
MAX_PARTITIONS = 1000


def probe_token(partition: int, partitions: int) -> str:
    """The first token `probe<j>` that the server's `partition(partitions, 1)` sends to
    `partition` (a few dozen hashes per partition, once per partition count)."""
    tokens = _PROBE_TOKENS.get(partitions)
    if tokens is None:
        found: dict[int, str] = {}
        j = 0
        while len(found) < partitions:
            token = f"probe{j}"
            found.setdefault(_fnv1a(token.encode()) % partitions, token)
            j += 1
        tokens = _PROBE_TOKENS[partitions] = tuple(found[n] for n in range(partitions))
    return tokens[partition]


#: Tokens of the participants seen lately, both ways (a worker encodes a participant's
#: id four times per turn); emptied when either holds `_TOKENS_BOUND` entries.
_TOKENS_BOUND = 4096
_TOKEN_OF: dict[str, str] = {}
_ID_OF: dict[str, str] = {}


def encode_token(participant_id: str) -> str:
    """The participant id as a subject token / key (unpadded base64url of its UTF-8)."""
    cached = type(participant_id) is str
    if cached:
        token = _TOKEN_OF.get(participant_id)
        if token is not None:
            return token
    raw = participant_id.encode("utf-8")
    if not raw or len(raw) > MAX_PARTICIPANT_ID_BYTES:
        raise ContractValueError(
            f"participant id must be 1..{MAX_PARTICIPANT_ID_BYTES} UTF-8 bytes, "
            f"got {len(raw)}")
    token = base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")
    if cached:
        _remember(participant_id, token)
    return token


def _remember(participant_id: str, token: str) -> None:
    if len(_TOKEN_OF) >= _TOKENS_BOUND or len(_ID_OF) >= _TOKENS_BOUND:
        _TOKEN_OF.clear()
        _ID_OF.clear()
    _TOKEN_OF[participant_id] = token
    _ID_OF[token] = participant_id


def decode_token(token: str) -> str:
    """Inverse of `encode_token`; ValueError for anything `encode_token` cannot produce."""
    if type(token) is str:
        known = _ID_OF.get(token)
        if known is not None:
            return known
    if not token or len(token) > 4 * MAX_PARTICIPANT_ID_BYTES // 3 + 4:
        raise ValueError("participant token of bad length")
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        pid = raw.decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"participant token is not base64url UTF-8: {exc}") from exc
    if not pid or encode_token(pid) != token:
        raise ValueError("participant token is not canonical")
    return pid


def kind_of(message: RuntimeMessage) -> str:
    """The subject kind of a typed input message (TypeError for other messages)."""
    for kind, payload in KINDS.items():
        if type(message) is payload:
            return kind
    raise TypeError(f"not a runtime input message: {type(message).__name__}")


class Rejected(TurnrouterError, ValueError):
    """An input refused before the router saw it; `reason` is a low-cardinality label
    (`unknown_subject`, `oversized`, `invalid`, `foreign_id`)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def _check_probe(data: bytes) -> None:
    """A probe carries nothing: one with a body was not a replica's (redteam21 F5:
    forged probes were acknowledged unread and counted nowhere)."""
    if data:
        raise Rejected("invalid", f"a probe carries no body, this one {len(data)} bytes")


def parse_input(
    config: NatsConfig, subject: str, data: bytes, msg_id: str | None = None
) -> tuple[int, str | None, str, RuntimeMessage | None]:
    """Check one delivered input: (partition, participant id, kind, message).

    Probes (`kind == "probe"`) carry no participant and no message. `msg_id` is the
    message's `Nats-Msg-Id` header (`""` when it has none; None: not checked). Raises
    `Rejected` naming what is wrong: `unknown_subject`, `oversized`, `invalid`, or
    `foreign_id` for an id other than `<token>.<message id>` of this very message
    (`NatsFrontEnd.publish`'s): a message carrying another participant's id was
    published to make the stream drop theirs, or one with none, which takes another
    participant's id in their record instead (redteam22 F1).
    """
    parts = subject.split(".")
    if len(parts) == 3 and parts[1] == "probe" and parts[2].isascii() and parts[2].isdigit():
        _check_probe(data)
        return int(parts[2]), None, "probe", None  # (`legacy_probe_subject`)
    if len(parts) != 5 or parts[0] != config.prefix or parts[1] != "p" or not (
        parts[2].isascii() and parts[2].isdigit() and int(parts[2]) < config.partitions
    ):
        raise Rejected("unknown_subject", f"subject {subject[:200]!r} is not an input subject")
    partition, token, kind = int(parts[2]), parts[3], parts[4]
    if kind == "probe" and token == probe_token(partition, config.partitions):
        _check_probe(data)
        return partition, None, "probe", None
    payload = KINDS.get(kind)
    if payload is None:
        raise Rejected("unknown_subject", f"unknown input kind {kind[:50]!r}")
    if len(data) > config.max_message_bytes:
        raise Rejected("oversized", f"{len(data)} bytes > {config.max_message_bytes}")
    try:
        pid = decode_token(token)
    except ValueError as exc:
        raise Rejected("invalid", str(exc)) from None
    try:
        message = payload.model_validate_json(data)
    except ValidationError as exc:
        raise Rejected("invalid", f"malformed {payload.__name__}: {exc.error_count()} "
                                  f"error(s)") from None
    except (ValueError, RecursionError) as exc:
        raise Rejected("invalid", f"malformed {payload.__name__}: {exc}") from None
    message_pid = getattr(message, "participant_id", None)
    if message_pid != pid:
        raise Rejected("invalid", "participant_id does not match the subject")
    if msg_id is not None and msg_id != f"{token}.{message.message_id}":
        raise Rejected("foreign_id", "its Nats-Msg-Id is not <token>.<message id> of this "
                                     "message: another participant's id, or another message's"
                       if msg_id else "no Nats-Msg-Id (NatsFrontEnd.publish sets one): it "
                                      "could take another message's id")
    return partition, pid, kind, message


_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
_TRACESTATE = re.compile(r"[\x20-\x7e]{1,512}")
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16
#: The W3C limit of a `tracestate` header (512 characters).
MAX_TRACESTATE_CHARS = 512


def trace_context(carrier: dict[str, str]) -> dict[str, str]:
    """The input's W3C trace context as it may travel on: a well-formed `traceparent`
    and, with it, a printable `tracestate` of at most 512 characters. Anything else of
    a publisher's headers (or a malformed or huge context) is never echoed into outputs."""
    parent = carrier.get("traceparent")
    if not (isinstance(parent, str) and _TRACEPARENT.fullmatch(parent)) or (
            parent[:2] == "ff" or parent[3:35] == _ZERO_TRACE or parent[36:52] == _ZERO_SPAN):
        return {}  # (W3C: version ff and all-zero ids are invalid)
    kept = {"traceparent": parent}
    state = carrier.get("tracestate")
    if isinstance(state, str) and _TRACESTATE.fullmatch(state):
        kept["tracestate"] = state
    return kept


def input_message_id(participant_id: str, message_id: str) -> str:
    """The input stream's deduplication id of one input: `<token>.<message id>`, scoped
    to its participant, so two participants may use the same message id."""
    return f"{encode_token(participant_id)}.{message_id}"


def output_message_id(participant_id: str, turn_id: str, route: str, text: str, *,
                      final: bool) -> str:
    """The deduplication id of one output, scoped to its participant (`<token>.`): a
    turn's terminal output (its answer, or the failure text) is `<token>.<turn>.final`
    whoever publishes it, so the output stream keeps only the first; control text is
    identified by its content."""
    return token_output_id(encode_token(participant_id), turn_id, route, text, final)


def token_output_id(token: str, turn_id: str, route: str, text: str, final: bool) -> str:
    """`output_message_id` from the participant's token (`encode_token`), at hand where
    the output's subject is made too."""
    if final:
        return f"{token}.{turn_id}.final"
    digest = hashlib.blake2b(f"{route}\0{text}".encode(), digest_size=8).hexdigest()
    return f"{token}.{turn_id}.{digest}"


def response_json(participant_id: str, request_id: str, route: str, text: str, *,
                  final: bool, carrier: Mapping[str, str]) -> bytes:
    """The JSON of `ResponseOutput(participant_id=..., request_id=..., route=...,
    text=..., final=..., traceparent=..., tracestate=...)` (the trace context from
    `carrier`), with a new message id and the current time, built without the model: a
    worker publishes one per turn, and the model's construction, field validators and
    dump cost several times the JSON. It checks what the model's constructor checks
    (types, id lengths, no lone surrogate) and raises `ContractValueError` naming how
    many fields are invalid; non-ASCII text stays UTF-8, as the model writes it."""
    traceparent, tracestate = carrier.get("traceparent"), carrier.get("tracestate")
    # One pass over the usual case (all text, ASCII); the field count only on refusal.
    if not (isinstance(participant_id, str) and isinstance(request_id, str)
            and isinstance(route, str) and isinstance(text, str) and isinstance(final, bool)
            and isinstance(traceparent, str | None) and isinstance(tracestate, str | None)
            and 0 < len(participant_id) <= MAX_ID_CHARS
            and 0 < len(request_id) <= MAX_ID_CHARS
            and (f"{participant_id}{request_id}{route}{text}{traceparent}{tracestate}"
                 .isascii() or not any(map(has_surrogates, (
                     participant_id, request_id, route, text, traceparent or "",
                     tracestate or ""))))):
        invalid = sum((
            not _valid_id(participant_id), not _valid_id(request_id),
            not _valid_str(route), not _valid_str(text), not isinstance(final, bool),
            traceparent is not None and not _valid_str(traceparent),
            tracestate is not None and not _valid_str(tracestate)))
        raise ContractValueError(f"output of turn {preview(request_id)} refused: "
                                 f"{invalid} invalid field(s)")
    return (f'{{"message_id":"{new_message_id()}","timestamp_us":{time.time_ns() // 1000},'
            f'"traceparent":{"null" if traceparent is None else _json_text(traceparent)},'
            f'"tracestate":{"null" if tracestate is None else _json_text(tracestate)},'
            f'"participant_id":{_json_text(participant_id)},'
            f'"request_id":{_json_text(request_id)},"route":{_json_text(route)},'
            f'"text":{_json_text(text)},"final":{"true" if final else "false"}}}'
            ).encode()


def _valid_str(value: object) -> bool:
    return isinstance(value, str) and not has_surrogates(value)


def _valid_id(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS and not has_surrogates(value)


Ending = tuple[str, str, str, float]
"""A turn's terminal output in a participant's record: (turn id, route, text, Unix time
it was recorded). Republished on takeover only while the output stream's deduplication
window still covers it."""


#: Turn ids a record keeps as ended (the most recent ones): a redelivered query whose id
#: is among them never runs its destination again. A participant has one turn running at
#: a time, so a server crash leaves only its last turn or two unacknowledged; every id
#: kept costs its bytes in every record write.
MAX_ENDED = 16


def state_json(owner: str, inflight: list[str], snapshot: str | bytes | None,
               outbox: list[Ending] | None = None, ended: list[str] | None = None) -> bytes:
    """The key-value record of one participant: a JSON header line (owner, turns in
    flight, endings to publish, the last `MAX_ENDED` turns ended), then the snapshot's
    own JSON as is (not re-escaped inside the header: the snapshot is most of the record
    and written every turn)."""
    return record_json(owner, inflight, snapshot, outbox,
                       ",".join(map(_json_str, ended[-MAX_ENDED:])) if ended else "")


def record_json(owner: str, inflight: list[str], snapshot: str | bytes | None,
                outbox: list[Ending] | None, ended_json: str) -> bytes:
    """`state_json` with the ended ids already JSON strings joined by commas (a worker
    keeps them so, written every turn)."""
    endings = ",".join(f"[{_json_str(t)},{_json_str(r)},{_json_str(x)},{float(at)!r}]"
                       for t, r, x, at in outbox or ())
    head = (f'{{"owner":{_json_str(owner)},"inflight":[{",".join(map(_json_str, inflight))}'
            f'],"outbox":[{endings}]')
    head += f',"ended":[{ended_json}]' if ended_json else ""
    if snapshot is None:
        return f"{head}}}".encode("ascii")
    snapshot, session = _split_session(
        snapshot.encode("utf-8") if isinstance(snapshot, str) else snapshot)
    return b'%s%s}\n%s' % (head.encode("ascii"),
                           b',"session":%s' % session if session else b"", snapshot)


#: How the snapshot's last field begins (`ParticipantSnapshot.session_turns`).
_SESSION_FIELD = b',"session_turns":['


def _split_session(snapshot: bytes) -> tuple[bytes, bytes]:
    """The snapshot's JSON without its `session_turns`, and that field's array (b""
    without one). A record carries the array in its header: a worker of an earlier
    version reads the snapshot with a strict reader that refuses fields it does not know
    (it quarantined the record, and the participant started clean, in a rolling
    upgrade), and ignores header keys it does not know. The field is the snapshot's
    last, so the last match is it when the array it starts runs to the end; anything
    else (a patch's facts holding such a key) is left as it is."""
    at = snapshot.rfind(_SESSION_FIELD)
    if at < 0 or not snapshot.endswith(b"]}"):
        return snapshot, b""
    array = snapshot[at + len(_SESSION_FIELD) - 1:-1]
    try:
        ids = strict_json.loads(array)
    except (ValueError, RecursionError):
        return snapshot, b""
    if not (isinstance(ids, list) and all(isinstance(t, str) for t in ids)):
        return snapshot, b""
    return snapshot[:at] + b"}", array


def _join_session(snapshot: str, session: list[str]) -> str:
    """`snapshot` with the header's session turns as its last field again (the reverse
    of `_split_session`, in the JSON `ParticipantSnapshot.to_json` writes)."""
    body = snapshot.rstrip()
    if not body.endswith("}"):
        return snapshot  # (not a snapshot the worker wrote: read, and judged, as it is)
    inner = body[:-1].rstrip()
    joiner = "" if inner.endswith("{") else ","
    return f'{inner}{joiner}"session_turns":{to_json(session).decode()}}}'


#: Bounds of a participant's record, checked on every read: its size (a snapshot's own
#: bound plus the header), the turns in flight and the endings it holds.
MAX_STATE_BYTES = 4 * 1024 * 1024 + 256 * 1024
MAX_STATE_INFLIGHT = 64
MAX_STATE_OUTBOX = 64
#: Objects and arrays a record may hold (its `{` and `[` characters): the snapshot's
#: own bound plus room for the header's in-flight ids, endings and ended ids.
MAX_STATE_CONTAINERS = MAX_SNAPSHOT_CONTAINERS + 1024


def parse_state(data: bytes) -> tuple[list[str], str | None, list[Ending]]:
    """(in-flight turn ids, snapshot JSON, endings to publish) of a key-value record
    (ValueError naming the problem on junk or past a bound: `MAX_STATE_BYTES`,
    `MAX_STATE_CONTAINERS`, `MAX_STATE_INFLIGHT`, `MAX_STATE_OUTBOX`, ids over 256
    characters, lone surrogates). Records of the earlier one-object format (the snapshot
    as a string field) are read too."""
    record = parse_record(data)
    return record.inflight, record.snapshot, record.outbox


def _parse_state(data: bytes) -> tuple[dict[str, Any], list[str], str | None, list[Ending]]:
    if len(data) > MAX_STATE_BYTES:
        raise ValueError(f"state record of {len(data)} bytes > {MAX_STATE_BYTES}")
    # Counted before parsing: what parsing costs grows with the objects and arrays.
    containers = strict_json.containers(data, MAX_STATE_CONTAINERS)
    if containers > MAX_STATE_CONTAINERS:
        raise ValueError(f"state record holds {containers} objects and arrays > "
                         f"{MAX_STATE_CONTAINERS}")
    head, newline, snapshot_json = data.partition(b"\n")
    try:
        record: Any = strict_json.loads(head)
    except RecursionError as exc:
        raise ValueError("state record nested too deeply") from exc
    except ValueError as exc:
        raise ValueError(f"state record is not valid JSON: {exc}") from None
    if not isinstance(record, dict):
        raise ValueError("state record is not a JSON object")
    inflight, outbox = record.get("inflight", []), record.get("outbox", [])
    if newline:
        snapshot: Any = snapshot_json.decode("utf-8")  # UnicodeDecodeError: a ValueError
    else:
        snapshot = record.get("snapshot")
    if not (isinstance(inflight, list) and all(isinstance(t, str) for t in inflight)):
        raise ValueError("state record 'inflight' is not a list of turn ids")
    session: Any = record.get("session")
    if session is not None:
        if not (isinstance(session, list) and len(session) <= MAX_SESSION_TURNS and all(
                isinstance(t, str) and 0 < len(t) <= _MAX_ID and not has_surrogates(t)
                for t in session)):
            raise ValueError(f"state record 'session' is not a list of at most "
                             f"{MAX_SESSION_TURNS} turn ids")
        if isinstance(snapshot, str):
            snapshot = _join_session(snapshot, session)
    if snapshot is not None and not isinstance(snapshot, str):
        raise ValueError("state record 'snapshot' is not a string")
    if not (isinstance(outbox, list) and all(
            isinstance(e, list) and len(e) == 4 and all(isinstance(x, str) for x in e[:3])
            and finite(e[3]) for e in outbox)):
        raise ValueError("state record 'outbox' is not a list of [turn, route, text, time]")
    if len(inflight) > MAX_STATE_INFLIGHT or len(outbox) > MAX_STATE_OUTBOX:
        raise ValueError(f"state record holds over {MAX_STATE_INFLIGHT} turns in flight or "
                         f"endings")
    # Every id the record holds is one the next write can hold again: a lone surrogate
    # read here would be written back, and that record refused by the next owner.
    if any(not 0 < len(t) <= _MAX_ID or has_surrogates(t) for t in inflight) or any(
            not 0 < len(e[0]) <= _MAX_ID or len(e[1]) > _MAX_ID
            or has_surrogates(e[2]) or has_surrogates(e[0]) or has_surrogates(e[1])
            for e in outbox):
        raise ValueError("state record holds an id or a text out of bounds")
    return record, inflight, snapshot, [(e[0], e[1], e[2], float(e[3])) for e in outbox]


@dataclass(frozen=True, slots=True)
class StateRecord:
    """A participant's record as `parse_record` reads it."""

    inflight: list[str]
    """Turns the owner marked in flight (a new owner ends them with the failure text)."""
    snapshot: str | None
    """The router snapshot's JSON (`ParticipantSnapshot.from_json`)."""
    outbox: list[Ending]
    """Endings recorded and maybe not yet heard (republished on takeover)."""
    ended: list[str]
    """The last `MAX_ENDED` turns the record says ended: a query whose id is here (or in
    flight, or in the outbox) never runs its destination again."""
    owner: str | None = None
    """The replica that wrote the record (None if it does not say)."""


def parse_record(data: bytes) -> StateRecord:
    """The whole record `state_json` writes (`parse_state` gives its first three parts);
    ValueError naming the problem on junk."""
    record, inflight, snapshot, outbox = _parse_state(data)
    ended: Any = record.get("ended", [])
    if not (isinstance(ended, list) and all(isinstance(t, str) for t in ended)):
        raise ValueError("state record 'ended' is not a list of turn ids")
    if len(ended) > MAX_STATE_INFLIGHT or any(
            not 0 < len(t) <= _MAX_ID or has_surrogates(t) for t in ended):
        raise ValueError("state record 'ended' holds an id out of bounds or too many ids")
    owner = record.get("owner")
    return StateRecord(inflight, snapshot, outbox, ended[-MAX_ENDED:],
                       owner if isinstance(owner, str) else None)


def samples_body(lines: list[str]) -> bytes:
    """One fleet message of timing samples: their `TimingSample.to_json` lines, one per
    line (a single sample is the one-object message of earlier versions)."""
    return "\n".join(lines).encode("utf-8")


def parse_samples(config: NatsConfig, data: bytes) -> tuple[list[TimingSample], list[str]]:
    """The timing samples of one fleet message, and why each refused line was refused.

    A message over `max_message_bytes` or not UTF-8 raises `Rejected` (`oversized`,
    `invalid`); otherwise each line stands alone, so one bad line costs only itself.
    Empty lines are skipped.
    """
    if len(data) > config.max_message_bytes:
        raise Rejected("oversized", f"{len(data)} bytes > {config.max_message_bytes}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Rejected("invalid", f"timing samples are not UTF-8: {exc.reason}") from None
    samples: list[TimingSample] = []
    errors: list[str] = []
    for line in text.split("\n"):
        if not line.strip():
            continue
        try:
            samples.append(TimingSample.from_json(line))
        except RecursionError:
            errors.append("a timing sample nested too deeply")
        except ValueError as exc:
            errors.append(str(exc)[:200])
    return samples, errors


def _ack_fields(reply: str | None) -> list[str]:
    """The fields of a JetStream ack subject after `$JS.ACK.`, in the short layout:
    stream, consumer, delivered, stream sequence, consumer sequence, stored time (Unix
    ns), pending. The long layout's `<domain>.<account hash>.` after `$JS.ACK.` is
    skipped (its last token is left at the end). Empty for no subject."""
    if not reply:
        return []
    parts = reply.split(".")
    return parts[2:] if len(parts) == 9 else parts[4:]


def ack_consumer(reply: str | None) -> str | None:
    """The stream and consumer names a JetStream ack subject names ("stream.consumer"),
    or None for anything else: whose delivery a message is."""
    fields = _ack_fields(reply)
    return f"{fields[0]}.{fields[1]}" if len(fields) >= 7 else None


def _stored(field: str) -> int:
    """A stored time (Unix ns) that a float holds; 0 when unknown."""
    stored = int(field)
    return stored if 0 < stored < 2**63 else 0


def ack_metadata(reply: str | None) -> tuple[int, int]:
    """The delivery count and the stored time (Unix ns; 0 when unknown) in a JetStream
    ack subject: $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ns>.<pending>,
    or with <domain>.<account hash> after ACK and a token at the end."""
    fields = _ack_fields(reply)
    try:
        return int(fields[2]), _stored(fields[5])
    except (IndexError, ValueError):
        return 1, 0


def ack_info(reply: str | None) -> tuple[int, int, int]:
    """The delivery count, stream sequence (0 when unknown) and stored time (Unix ns; 0
    when unknown) in a JetStream ack subject (see `ack_metadata`)."""
    fields = _ack_fields(reply)
    try:
        return int(fields[2]), int(fields[3]), _stored(fields[5])
    except (IndexError, ValueError):
        return 1, 0, 0


def server_status(msg: Msg) -> str | None:
    """The status of a server's reply to a pull request or a consumer's heartbeat or flow
    control (its `Status` header), or None for a message the stream delivered: that one
    carries its `$JS.ACK.` reply subject, and a `Status` header of its publisher's is
    just a header. (Taken for a status, such a message ended no request, was never
    acknowledged and came back for ever, holding its whole partition.)"""
    headers = msg.headers
    if not headers:
        return None
    status = headers.get("Status")
    if status is None or msg.reply.startswith("$JS.ACK."):
        return None
    return status


def ack_sequences(reply: str | None) -> tuple[int, int, int] | None:
    """The stream sequence, consumer sequence and stored time (Unix ns; 0 when unknown)
    of a JetStream ack subject (see `ack_metadata`); None for anything else."""
    if not reply or not reply.startswith("$JS.ACK."):
        return None
    fields = _ack_fields(reply)
    try:
        return int(fields[3]), int(fields[4]), _stored(fields[5])
    except (IndexError, ValueError):
        return None
