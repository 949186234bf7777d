"""The NATS runtime's wire: subjects, tokens, inputs, records, output ids, config.

What a deployment can put on the wire goes to a real nats-server and one in-process
`NatsWorker` (one partition, so inputs are handled in the order they were published):
junk inputs are rejected with their documented reason, records in the bucket are read in
both formats or start the participant afresh, and outputs carry the documented ids.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import string
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

import nats
from turnrouter import (
    MAX_HISTORY_VERSION,
    MAX_SESSION_TURNS,
    MAX_SNAPSHOT_CONTAINERS,
    Admission,
    AgentRouter,
    AgentTurn,
    ConfigurationError,
    ContextPatch,
    ContractTypeError,
    ContractValueError,
    DestinationResult,
    LifecycleError,
    MergeStrategy,
    ParticipantSnapshot,
    PendingContextPatch,
    RoutingAid,
    TimingSample,
    TurnrouterError,
)
from turnrouter.cli import worker_parser
from turnrouter.events import MessageRejected
from turnrouter.runtime import (
    Interrupted,
    ParticipantJoined,
    ParticipantLeft,
    ResponseOutput,
    RuntimeMessage,
    UserQuery,
)
from turnrouter.runtime.nats import (
    MAX_PARTICIPANT_ID_BYTES,
    NatsConfig,
    NatsFrontEnd,
    NatsWorker,
    Rejected,
    WorkerContext,
    decode_token,
    encode_token,
    parse_input,
    parse_record,
    parse_samples,
    parse_state,
    samples_body,
    state_json,
)

# Private names, only for the last section: what no deployment can put on the wire.
from turnrouter.runtime.nats._link import pub_ack
from turnrouter.runtime.nats._setup import _ensure_front_mirror, api_request
from turnrouter.runtime.nats._wire import (
    ack_consumer,
    ack_metadata,
    ack_sequences,
    response_json,
)
from turnrouter.testing import RecordingObserver, ScriptedLLM

from ..fuzz import valid_text
from .app import Always, make_router
from .conftest import NatsServer

T = TypeVar("T")
CONFIG = NatsConfig(prefix="tr", partitions=8)
JUNK = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=50),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10),
                                                                 inner, max_size=5),
    max_leaves=30)
#: The documented kinds of input and their payload classes (docs/distributed.md).
PAYLOADS: dict[str, type[RuntimeMessage]] = {
    "query": UserQuery, "joined": ParticipantJoined, "left": ParticipantLeft,
    "interrupt": Interrupted}
ACK = "One moment."
PREAMBLE = "working on it"


# ---------------------------------------------------------------- no server needed


@given(st.text(min_size=1, max_size=80).filter(lambda s: 0 < len(s.encode()) <= 256))
def test_tokens_round_trip_and_are_subject_safe(pid: str) -> None:
    """Any participant id becomes one subject token / key and decodes back."""
    token = encode_token(pid)
    assert decode_token(token) == pid
    assert all(c.isalnum() or c in "-_" for c in token)


@given(st.text(max_size=400))
def test_junk_tokens_are_refused_with_value_error(token: str) -> None:
    """A token encode_token cannot produce raises ValueError, nothing else."""
    try:
        pid = decode_token(token)
    except ValueError:
        return
    assert encode_token(pid) == token


def test_tokens_stay_exact_past_the_participants_a_worker_remembers() -> None:
    """A worker remembers the tokens of its last 4,096 participants (docs/limits.md):
    ids past that bound, and ids remembered, forgotten and seen again, encode and decode
    exactly as base64url, and a non-canonical spelling of a remembered token is still
    refused."""
    pids = [f"participant-{i}-é" for i in range(10_000)]
    expected = [base64.urlsafe_b64encode(p.encode()).rstrip(b"=").decode() for p in pids]
    assert [encode_token(p) for p in pids] == expected
    assert [decode_token(t) for t in expected] == pids
    assert [encode_token(p) for p in reversed(pids)] == expected[::-1]
    remembered = encode_token("ab")  # "YWI", padded "YWI="
    assert decode_token(remembered) == "ab"
    for junk in (remembered + "=", remembered[:-1] + "J", "", "Y"):  # padded, stray bits
        with pytest.raises(ValueError, match="participant token"):
            decode_token(junk)


def test_overlong_participant_ids_are_refused() -> None:
    """Participant ids over the documented bound are a ContractValueError."""
    with pytest.raises(ContractValueError, match="participant id"):
        encode_token("x" * (MAX_PARTICIPANT_ID_BYTES + 1))


@pytest.mark.parametrize(("field", "value"), [
    ("prefix", "a.b"), ("prefix", ""), ("partitions", 0), ("partitions", 5000),
    ("partitions", 1001),  # nats-server refuses a stream's 1,001st consumer (redteam22 F6)
    ("failover_timeout", 0), ("pull_expires", 2.0), ("max_message_bytes", 10),
    ("ack_wait", float("inf")), ("drain_timeout", float("nan")), ("dedup_window", True),
    ("mark_after", 0), ("mark_after", 1.0), ("ack_wait", 10**400),
    ("fleet_backlog", 0), ("fleet_backlog", True), ("fleet_backlog", 2.0),
    ("fleet_backlog", 10**6 + 1), ("state_max_age", 0), ("state_max_age", float("nan")),
    ("state_max_age", 400 * 86400),
])
def test_bad_config_names_the_field(field: str, value: object) -> None:
    """An impossible configuration raises ConfigurationError naming the field."""
    with pytest.raises(ConfigurationError, match=field):
        NatsConfig(**{field: value})  # type: ignore[arg-type]


def test_the_most_partitions_are_a_streams_most_consumers() -> None:
    assert NatsConfig(partitions=1000).partitions == 1000


@given(st.one_of(st.integers(-10, 2_000_000), st.integers(), st.floats(), st.booleans(),
                 st.text(max_size=5), st.none()))
def test_fleet_backlog_is_an_int_within_its_bound(value: object) -> None:
    """`fleet_backlog` takes an int in 1..1,000,000; anything else (bools, floats, text,
    huge ints) is a ConfigurationError naming the field."""
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 1_000_000:
        assert NatsConfig(fleet_backlog=value).fleet_backlog == value
        return
    with pytest.raises(ConfigurationError, match="fleet_backlog"):
        NatsConfig(fleet_backlog=value)  # type: ignore[arg-type]


@given(st.one_of(st.floats(), st.integers(-10, 400 * 86400), st.integers(), st.booleans(),
                 st.text(max_size=5), st.none()),
       st.sampled_from([60.0, 86400.0, 30 * 86400.0]))
@example(10**400, 86400.0)
@example(366 * 86400, 86400.0)
@example(86400.0, 86400.0)
def test_state_max_age_is_a_bounded_duration_no_shorter_than_input_max_age(
        value: object, input_max_age: float) -> None:
    """`state_max_age` (how long a record outlives its last write) takes a number of
    seconds in 0..366 days, at least `input_max_age` (a record expiring first would let
    an input it ended run again); anything else (bools, NaN, infinities, huge ints, text,
    None) is a ConfigurationError naming the field."""
    if (isinstance(value, int | float) and not isinstance(value, bool)
            and input_max_age <= value <= 366 * 86400):
        config = NatsConfig(state_max_age=value, input_max_age=input_max_age)
        assert config.state_max_age == value
        return
    with pytest.raises(ConfigurationError, match="state_max_age"):
        NatsConfig(state_max_age=value, input_max_age=input_max_age)  # type: ignore[arg-type]


@given(st.one_of(st.floats(), st.integers(-10, 400 * 86400), st.integers(), st.booleans(),
                 st.text(max_size=5), st.none(), st.binary(max_size=5)))
@example(10**400)
@example(366 * 86400)
@example(0.5)
@example(1)
def test_idle_after_is_a_bounded_duration(value: object) -> None:
    """`idle_after` (how long a participant without input stays in its replica's
    memory) takes a number of seconds in [1, 366 days], from the worker's
    `--idle-after` too; anything else is a ConfigurationError naming the field."""
    if (isinstance(value, int | float) and not isinstance(value, bool)
            and 1 <= value <= 366 * 86400):
        assert NatsConfig(idle_after=value).idle_after == value
        return
    with pytest.raises(ConfigurationError, match="idle_after"):
        NatsConfig(idle_after=value)  # type: ignore[arg-type]


def test_idle_after_defaults_to_half_an_hour_and_has_a_flag() -> None:
    assert NatsConfig().idle_after == 1800.0
    assert worker_parser().parse_args(
        ["--nats", "n", "--app", "a:b", "--idle-after", "60"]).idle_after == 60.0


@given(st.one_of(st.text(max_size=80), st.text(st.sampled_from("$JS.AFRONTPI*>_- \n"),
                                                 max_size=40),
                 st.integers(), st.none(), st.binary(max_size=10)))
def test_front_api_is_a_literal_subject_prefix(value: object) -> None:
    """`front_api` is None or a subject prefix of literal tokens (no wildcard, space or
    empty token) other than this account's own `$JS.API`; anything else is a
    ConfigurationError naming the field. The mirror it leads to is named after the
    prefix of the deployment."""
    tokens = value.split(".") if isinstance(value, str) else []
    ok = value is None or (
        isinstance(value, str) and 1 <= len(tokens) <= 8
        and all(t and len(t) <= 64 and all(c.isascii() and (c.isalnum() or c in "_$-")
                                           for c in t) for t in tokens)
        and not value.startswith("$JS.API"))
    if ok:
        config = NatsConfig(front_api=value)  # type: ignore[arg-type]
        assert config.front_api == value
        assert (config.mirror_api, config.mirror_deliver) == (
            "$JS.TURNROUTER.API", "turnrouter.mirror")
        return
    with pytest.raises(ConfigurationError, match="front_api"):
        NatsConfig(front_api=value)  # type: ignore[arg-type]


@given(st.one_of(st.text(max_size=80), st.text(st.sampled_from("aZ9_-.*> \nû\x00"),
                                                max_size=70), st.integers(), st.none()))
def test_prefix_is_one_ascii_token_that_can_name_streams(value: object) -> None:
    """`prefix` names subjects, the streams (`<PREFIX>_IN`) and the bucket: 1 to 64
    lower-case ASCII letters, digits, "-" or "_"; anything else (a dot, a wildcard, a
    space, a non-ASCII letter, NUL, 300 characters, an upper-case letter) is a
    ConfigurationError naming the field at once. Before, `tûrn` was accepted and the
    worker's set-up then timed out (5 s a try, for `reconnect_for`), reading like an
    outage; `TurnRouter` named the streams of `turnrouter` (redteam7 D5)."""
    ok = (isinstance(value, str) and 1 <= len(value) <= 64
          and all(c.isascii() and (c.isdigit() or c.islower() or c in "_-") for c in value))
    if ok:
        assert NatsConfig(prefix=value).prefix == value  # type: ignore[arg-type]
        return
    with pytest.raises(ConfigurationError, match=r"NatsConfig\.prefix"):
        NatsConfig(prefix=value)  # type: ignore[arg-type]


URL_PARTS = st.text(st.sampled_from("ab1:/@[]%?#.-_ \u00e9"), max_size=12)


@settings(max_examples=300)
@given(st.one_of(st.sampled_from(["nats", "tls", "ws", "http", "NATS", ""]), URL_PARTS),
       URL_PARTS, URL_PARTS, st.one_of(URL_PARTS, st.integers(-5, 70_000).map(str)))
@example(scheme="//", before="", host="", port="")  # a scheme that leaves no "@" host
@example(scheme="nats", before="ab@ET/x", host="127.0.0.1", port="4222")  # "/" cuts it
@example(scheme="nats", before="p@ss?", host="h", port="1")
@example(scheme="nats", before="p@ss#", host="h", port="1")
def test_any_url_is_a_config_or_a_masked_configuration_error(scheme: str, before: str,
                                                             host: str, port: str) -> None:
    """Junk around a URL's parts (brackets, colons, percent signs, a port out of range,
    another scheme, no host) builds a config or raises ConfigurationError, nothing
    else, and the error never shows the password the URL carried, also its part after
    an "@", "/", "?" or "#" it holds (which ends the parser's user info early)."""
    url = f"{scheme}://svc:{before}S3CRET@{host}:{port}" if scheme else f"{host}:{port}"
    try:
        shown = repr(NatsConfig(url=url))
    except ConfigurationError as exc:
        shown = str(exc)
    assert "S3CRET" not in shown


def family_names(registry: CollectorRegistry) -> list[str]:
    return [family.name for family in registry.collect()]


def test_metric_families_register_once_per_registry() -> None:
    """Two workers on one registry share one set of families (a second registration
    would raise); a worker on another registry registers its own there."""
    registry, other = CollectorRegistry(), CollectorRegistry()
    NatsWorker(make_router, CONFIG, registry=registry)
    names = family_names(registry)
    NatsWorker(make_router, CONFIG, registry=registry)
    assert family_names(registry) == names and "turnrouter_nats_partitions" in names
    NatsWorker(make_router, CONFIG, registry=other)
    assert family_names(other) == names


def test_public_names_are_pinned() -> None:
    """turnrouter.runtime.nats exports exactly the documented names."""
    import turnrouter.runtime.nats as module

    assert set(module.__all__) == {
        "MAX_CA_FILE_BYTES", "MAX_ENDED", "MAX_PARTICIPANT_ID_BYTES", "MAX_PUBLISHED",
        "MAX_SECRET_FILE_BYTES", "MAX_SEEN_FINALS", "READER_PATIENCE", "STALL_SECS", "Ending",
        "NatsConfig",
        "NatsFrontEnd", "NatsWorker", "Readiness", "Rejected", "StateRecord", "WorkerContext",
        "decode_token", "encode_token", "parse_input", "parse_presence", "parse_record",
        "parse_samples", "parse_state", "samples_body", "state_json"}


# ---------------------------------------------------------------- one worker on a server


class Probe:
    """The one destination: answers `<query>|<previous user text or ->|<F or N>` through
    `ctx.answer`. A participant whose id starts with `ack-` is admitted with a preamble
    and answers only once its acknowledgment went out: two control texts in one turn."""

    def __init__(self, ctx: WorkerContext, wire: Wire) -> None:
        self._ctx, self._wire = ctx, wire
        self._focused: dict[str, bool] = {}

    def routing_aid(self, participant_id: str) -> RoutingAid:
        return RoutingAid("echo", "echoes")

    async def admit(self, turn: AgentTurn, *, focused: bool) -> Admission:
        self._focused[turn.turn_id] = focused
        if turn.participant_id.startswith("ack-"):
            return Admission("accept", preamble=PREAMBLE)
        return Admission("accept")

    async def answer(self, turn: AgentTurn, *,
                     started: Callable[[], Awaitable[None]]) -> DestinationResult:
        if turn.participant_id.startswith("ack-"):
            await self._wire.until(lambda: ACK in self._wire.texts(turn.turn_id))
        await started()
        previous = turn.history[-1].user if turn.history else "-"
        text = f"{turn.query}|{previous}|{'F' if self._focused.pop(turn.turn_id) else 'N'}"
        await self._ctx.answer(turn, "echo", text)
        return DestinationResult("focus", text)

    async def release(self, participant_id: str) -> None:
        return None


class Watch(RecordingObserver):
    """The router's telemetry: wakes the test at every rejected input."""

    def __init__(self, wire: Wire) -> None:
        super().__init__()
        self.rejected: list[str] = []
        self._wire = wire

    def message_rejected(self, event: MessageRejected) -> None:
        super().message_rejected(event)
        self.rejected.append(event.reason)
        self._wire.changed.set()


class Wire:
    """A nats-server and one in-process worker (prefix `tr`, one partition) with a front
    end and a reader of the output stream (headers included), on an event loop in a
    background thread, so property tests can use them example after example."""

    def __init__(self, *, server_config: Path | None = None,
                 router_options: dict[str, Any] | None = None) -> None:
        self.server = NatsServer(config=server_config)
        self.config = NatsConfig(url=self.server.url, prefix="tr", partitions=1)
        self.router_options = router_options or {}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        #: Per request id: each output heard, with its Nats-Msg-Id.
        self.heard: dict[str, list[tuple[ResponseOutput, str]]] = {}
        try:
            self.call(self._start())
        except BaseException:
            self.close()
            raise

    def call(self, work: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        """Run `work` on the wire's loop (bounded)."""
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout)

    def _factory(self, ctx: WorkerContext) -> AgentRouter:
        return AgentRouter({"echo": Probe(ctx, self)}, Always(), default_destination="echo",
                           telemetry=self.watch, acknowledgment_llm=ScriptedLLM(ACK),
                           acknowledgment_delay_secs=0.05, **self.router_options)

    async def _start(self) -> None:
        self.changed = asyncio.Event()
        self.watch = Watch(self)
        self.worker = NatsWorker(self._factory, self.config, registry=CollectorRegistry(),
                                 replica="wire")
        self.run = asyncio.create_task(self.worker.run())
        async with asyncio.timeout(15):
            await self.worker.ready.wait()
        self.front = await NatsFrontEnd.connect(self.config)
        self.js = self.front.connection.jetstream()
        self.kv: KeyValue = await self.js.key_value(f"{self.config.prefix}_state")
        self.sub = await self.js.subscribe(f"{self.config.prefix}.out.*",
                                           ordered_consumer=True,
                                           deliver_policy=DeliverPolicy.NEW)
        self.reader = asyncio.create_task(self._read(self.sub))

    async def _read(self, sub: Any) -> None:
        async for msg in sub.messages:
            output = ResponseOutput.model_validate_json(msg.data)
            headers = msg.headers or {}
            self.heard.setdefault(output.request_id, []).append(
                (output, headers.get("Nats-Msg-Id", "")))
            self.changed.set()

    async def until(self, done: Callable[[], bool], seconds: float = 15) -> None:
        """Until `done()` holds (re-checked at each output and rejection; bounded)."""
        async with asyncio.timeout(seconds):
            while not done():
                self.changed.clear()
                await self.changed.wait()

    def texts(self, request_id: str) -> list[str]:
        return [output.text for output, _ in self.heard.get(request_id, ())]

    async def ask(self, query: UserQuery) -> str:
        """Publish a query; the text of its answer (its final output)."""
        await self.front.publish(query)
        await self.until(lambda: any(msg_id.endswith(".final")
                                     for _, msg_id in self.heard.get(query.message_id, ())))
        return next(output.text for output, msg_id in self.heard[query.message_id]
                    if msg_id.endswith(".final"))

    async def record(self, pid: str) -> bytes:
        entry = await self.kv.get(f"0.{encode_token(pid)}")
        assert entry.value is not None
        return entry.value

    def close(self) -> None:
        async def stop() -> None:
            if hasattr(self, "reader"):
                self.reader.cancel()
                await asyncio.gather(self.reader, return_exceptions=True)
                await self.sub.unsubscribe()
                await self.front.close()
            if hasattr(self, "run"):
                self.worker.request_stop()
                async with asyncio.timeout(20):
                    await self.run

        try:
            self.call(stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()
            self.server.close()


@pytest.fixture(scope="module")
def wire() -> Iterator[Wire]:
    made = Wire()
    try:
        yield made
    finally:
        made.close()


_pids = iter(range(10**9))


def fresh(prefix: str = "p") -> str:
    """A participant id no earlier test or example used."""
    return f"{prefix}{next(_pids)}"


# ---------------------------------------------------------------- inputs


def test_typed_messages_go_to_their_kind_subjects(wire: Wire) -> None:
    """The front end publishes each input message on `<prefix>.in.<token>.<kind>` with
    its documented kind; anything but an input message is a ContractTypeError."""
    pid = fresh("i")

    async def main() -> list[str]:
        nc = wire.front.connection
        subjects: list[str] = []
        got = asyncio.Event()

        async def collect(msg: Msg) -> None:
            subjects.append(msg.subject)
            if len(subjects) == len(PAYLOADS):
                got.set()

        sub = await nc.subscribe("tr.in.>", cb=collect)
        try:
            for message in (UserQuery(participant_id=pid, text="hi"),
                            ParticipantJoined(participant_id=pid),
                            ParticipantLeft(participant_id=pid),
                            Interrupted(participant_id=pid)):
                await wire.front.publish(message)
            async with asyncio.timeout(10):
                await got.wait()
            with pytest.raises(ContractTypeError, match="ResponseOutput"):
                await wire.front.publish(ResponseOutput(
                    participant_id=pid, request_id="r", route="echo", text="x"))
        finally:
            await sub.unsubscribe()
        return subjects

    token = encode_token(pid)
    assert wire.call(main()) == [f"tr.in.{token}.{kind}" for kind in PAYLOADS]


def own_id(token: str, data: bytes) -> str:
    """The `Nats-Msg-Id` `NatsFrontEnd.publish` would give a body naming its own
    `message_id` (`<token>.<message id>`), "" for one naming none (sent without it)."""
    try:
        named = json.loads(data).get("message_id")
    except (ValueError, AttributeError, RecursionError):
        return ""
    return f"{token}.{named}" if isinstance(named, str) and named.isprintable() and (
        named == named.strip()) else ""


def expected_reason(config: NatsConfig, token: str, kind: str, data: bytes) -> str | None:
    """The rejection reason docs/distributed.md gives for an input (None: accepted),
    published with `own_id` as its `Nats-Msg-Id` (or none)."""
    payload = PAYLOADS.get(kind)
    if payload is None:
        return "unknown_subject"
    if len(data) > config.max_message_bytes:
        return "oversized"
    try:
        pid = decode_token(token)
        message = payload.model_validate_json(data)
    except ValueError:  # pydantic's ValidationError is one
        return "invalid"
    if getattr(message, "participant_id", None) != pid:
        return "invalid"
    return None if own_id(token, data) == f"{token}.{message.message_id}" else "foreign_id"


Input = tuple[str, str, bytes]  # token, kind, body


async def deliver(wire: Wire, inputs: list[Input]) -> None:
    """Publish raw inputs, then a query behind them; check each was rejected with its
    documented reason, in order, or answered (accepted queries)."""
    start = len(wire.watch.rejected)
    for token, kind, data in inputs:
        msg_id = own_id(token, data)
        await wire.js.publish(f"tr.in.{token}.{kind}", data,
                              headers={"Nats-Msg-Id": msg_id} if msg_id else None)
    assert await wire.ask(UserQuery(participant_id=fresh("s"), text="after")) == "after|-|N"
    reasons = [expected_reason(wire.config, *item) for item in inputs]
    assert wire.watch.rejected[start:] == [reason for reason in reasons if reason]
    accepted = [UserQuery.model_validate_json(data) for (_, kind, data), reason
                in zip(inputs, reasons, strict=True) if reason is None and kind == "query"]
    await wire.until(lambda: all(wire.heard.get(query.message_id) for query in accepted))


@pytest.mark.parametrize(("token", "kind", "data", "reason"), [
    ("YW5u", "bogus", b"{}", "unknown_subject"),
    ("YW5u", "query", b"x" * (64 * 1024 + 1), "oversized"),
    ("YW5u", "query", b"{not json", "invalid"),
    ("YW5u", "query", b'{"participant_id":"bob","text":"hi"}', "invalid"),
    ("!!", "query", b'{"participant_id":"ann","text":"hi"}', "invalid"),
    ("YW5uPQ", "query", b'{"participant_id":"ann","text":"hi"}', "invalid"),
    ("YW5u", "query", b"\xff\xfe\xfa", "invalid"),
    ("YW5u", "query", b"[" * 60_000, "invalid"),
    ("YW5u", "left", b'{"participant_id":"bob"}', "invalid"),
])
def test_bad_inputs_are_rejected_with_a_reason(wire: Wire, token: str, kind: str,
                                               data: bytes, reason: str) -> None:
    """Unknown kinds, oversized, malformed, non-UTF-8, deeply nested, badly named and
    mismatched inputs are rejected with a low-cardinality reason; the next is answered."""
    assert expected_reason(wire.config, token, kind, data) == reason
    wire.call(deliver(wire, [(token, kind, data)]))


#: Subject-safe token text (NATS tokens hold no dot, wildcard or whitespace).
TOKEN_CHARS = string.ascii_letters + string.digits + "-_=!%~"
PIDS = st.text(min_size=1, max_size=30).filter(
    lambda s: valid_text(s) and len(s.encode()) <= 256 and not s.startswith("ack-"))


@st.composite
def inputs(draw: st.DrawFn) -> Input:
    """One input of any shape a publisher could send: a valid or junk token, any kind,
    a valid, mismatched, junk, oversized or deeply nested body."""
    pid = draw(PIDS)
    token = draw(st.one_of(st.just(encode_token(pid)),
                           st.text(TOKEN_CHARS, min_size=1, max_size=24)))
    kind = draw(st.sampled_from([*PAYLOADS, "bogus", "Query"]))
    text = draw(st.text(max_size=30).filter(valid_text))
    data = draw(st.one_of(
        st.just(UserQuery(participant_id=pid, text=text).model_dump_json().encode()),
        st.just(json.dumps({"participant_id": pid + "x", "text": text}).encode()),
        st.binary(max_size=300),
        JUNK.map(lambda value: json.dumps(value).encode()),
        JUNK.map(lambda value: json.dumps({"participant_id": pid, "body": value}).encode()),
        st.sampled_from([b"x" * (64 * 1024 + 1), b"[" * 60_000])))
    return token, kind, data


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(st.lists(inputs(), min_size=1, max_size=6))
def test_any_input_is_answered_or_rejected_with_its_reason(wire: Wire,
                                                           batch: list[Input]) -> None:
    """Whatever a publisher sends (junk, huge, validation-bypassing bodies), the worker
    rejects it with the documented reason or handles it, and goes on serving."""
    wire.call(deliver(wire, batch))


# ---------------------------------------------------------------- records


def test_a_turn_leaves_the_documented_record(wire: Wire) -> None:
    """After a turn, its participant's record is a JSON header line (owner, turns in
    flight, the outbox holding the answer exactly) then the snapshot's own JSON."""
    pid = fresh()
    text = 'said "hi" \u00e9\n\\ {x}'

    async def main() -> None:
        query = UserQuery(participant_id=pid, text=text)
        answer = await wire.ask(query)
        assert answer == f"{text}|-|N"
        head, newline, snapshot = (await wire.record(pid)).partition(b"\n")
        assert newline
        header = json.loads(head)
        assert header["owner"] == "wire" and header["inflight"] == []
        [[turn_id, route, said, at]] = header["outbox"]
        assert (turn_id, route, said) == (query.message_id, "echo", answer)
        assert abs(at - time.time()) < 60
        moved = ParticipantSnapshot.from_json(snapshot)
        assert moved.participant_id == pid
        assert [(item.user, item.assistant) for item in moved.history] == [(text, answer)]

    wire.call(main())


def left_behind(pid: str, *, old_format: bool) -> bytes:
    """A record a previous owner left: one exchange in the snapshot, an answer in the
    outbox not yet heard (turn `<pid>-1`), and a turn in flight (`<pid>-2`)."""
    snapshot = ParticipantSnapshot.from_json(json.dumps({
        "participant_id": pid, "focus": "echo", "used": ["echo"], "initialized": True,
        "history_version": 1,
        "history": [{"user": "earlier", "assistant": "before", "turn_id": "old-0"}],
    })).to_json()
    outbox = [[f"{pid}-1", "echo", 'said "hi" \u00e9\n', time.time()]]
    inflight = [f"{pid}-2"]
    if old_format:
        return json.dumps({"owner": "gone", "inflight": inflight, "snapshot": snapshot,
                           "outbox": outbox}).encode()
    head = json.dumps({"owner": "gone", "inflight": inflight, "outbox": outbox})
    return f"{head}\n{snapshot}".encode()


@pytest.mark.parametrize("old_format", [False, True])
def test_records_left_by_a_previous_owner_are_taken_over(wire: Wire,
                                                         old_format: bool) -> None:
    """A record of either format (the earlier one-object format too) is read when its
    participant talks: the history goes on, the unheard answer is published, and the
    turn in flight ends with the failure text, both under `<token>.<turn id>.final`."""
    pid = fresh()

    async def main() -> None:
        await wire.kv.put(f"0.{encode_token(pid)}", left_behind(pid, old_format=old_format))
        assert await wire.ask(UserQuery(participant_id=pid, text="again")) == (
            "again|earlier|F")
        [(answered, msg_id)] = wire.heard[f"{pid}-1"]
        assert (answered.participant_id, answered.route, answered.text, msg_id) == (
            pid, "echo", 'said "hi" \u00e9\n', f"{encode_token(pid)}.{pid}-1.final")
        [(failed, msg_id)] = wire.heard[f"{pid}-2"]
        assert (failed.participant_id, failed.route, failed.text, msg_id) == (
            pid, "none", wire.config.failure_text, f"{encode_token(pid)}.{pid}-2.final")

    wire.call(main())


#: The empty record included: nats-py reads an empty value as None, which once made the
#: claim expect no record and be refused forever, holding the partition.
RECORDS = st.one_of(
    st.just(b""),
    st.binary(max_size=500),
    JUNK.map(lambda value: json.dumps(value).encode()),
    st.fixed_dictionaries({}, optional={
        "owner": JUNK, "inflight": JUNK, "outbox": JUNK, "snapshot": JUNK,
    }).map(lambda value: json.dumps(value).encode()),
    JUNK.map(lambda value: b'{"owner":"x"}\n' + json.dumps(value).encode()),
    st.just(b"[" * 200_000 + b"]" * 200_000),
)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(RECORDS, min_size=1, max_size=4))
def test_unreadable_records_start_their_participant_afresh(wire: Wire,
                                                           records: list[bytes]) -> None:
    """A record of junk (any bytes, wrong shapes, nested past the parser's depth) makes
    its participant start afresh when it talks; the worker goes on serving."""

    async def main() -> None:
        pids = [fresh() for _ in records]
        for pid, data in zip(pids, records, strict=True):
            await wire.kv.put(f"0.{encode_token(pid)}", data)
        for pid in pids:
            assert await wire.ask(UserQuery(participant_id=pid, text="hi")) == "hi|-|N"

    wire.call(main())


def test_untrusted_records_are_quarantined_and_their_participant_starts_clean(
        wire: Wire) -> None:
    """Alice's snapshot in mallory's record, 45,000 turns in flight, a history_version
    past `MAX_HISTORY_VERSION`, a pending patch over `max_patch_bytes`: each record is
    set aside under `quarantine.<key>` and counted (`nats_state`); its participant
    starts clean, no failure text is published for the in-flight ids, alice keeps her
    own history, and later turns work."""

    async def main() -> None:
        alice, mallory, crowd, maxed = fresh("alice"), fresh("mallory"), fresh(), fresh()
        patched = fresh()
        assert await wire.ask(UserQuery(participant_id=alice, text="secret")) \
            == "secret|-|N"
        await wire.kv.put(f"0.{encode_token(mallory)}", await wire.record(alice))
        await wire.kv.put(f"0.{encode_token(crowd)}",
                          state_json("old", [f"t{i}" for i in range(45_000)], None))
        await wire.kv.put(f"0.{encode_token(maxed)}", state_json("old", [], json.dumps(
            {"participant_id": maxed, "history_version": MAX_HISTORY_VERSION + 1})))
        held = {"patch_id": "big", "participant_id": patched, "task_id": "t",
                "created_at": 1.0, "patch": {"task_id": "t", "facts": {"x": "x" * 70_000}}}
        await wire.kv.put(f"0.{encode_token(patched)}", state_json("old", [], json.dumps(
            {"participant_id": patched, "pending": [held]})))
        before = sum(1 for r in wire.watch.rejected if r in ("invalid", "invalid_snapshot"))
        for pid in (mallory, crowd, maxed, patched):
            assert await wire.ask(UserQuery(participant_id=pid, text="hi")) == "hi|-|N"
            assert await wire.ask(UserQuery(participant_id=pid, text="2")) == "2|hi|F"
            quarantined = await wire.kv.get(f"quarantine.0.{encode_token(pid)}")
            assert quarantined.value
        assert "t1" not in wire.heard and "t44999" not in wire.heard
        assert await wire.ask(UserQuery(participant_id=alice, text="me")) == "me|secret|F"
        after = sum(1 for r in wire.watch.rejected if r in ("invalid", "invalid_snapshot"))
        assert after - before >= 4
        assert ("limit_exceeded", "patch_bytes") in wire.watch.events

    wire.call(main())


def test_a_record_at_the_version_bound_keeps_its_history_across_owners(wire: Wire) -> None:
    """A record at `MAX_HISTORY_VERSION` is imported; after two turns the version has
    wrapped and the record its worker writes is one the next owner imports (history
    intact), instead of being quarantined at the next move."""
    pid = fresh()

    async def main() -> None:
        snapshot = {"participant_id": pid, "focus": "echo", "used": ["echo"],
                    "initialized": True, "history_version": MAX_HISTORY_VERSION,
                    "history": [{"user": "earlier", "assistant": "x", "turn_id": "old"}]}
        await wire.kv.put(f"0.{encode_token(pid)}", state_json("gone", [], json.dumps(
            snapshot)))
        assert await wire.ask(UserQuery(participant_id=pid, text="a")) == "a|earlier|F"
        assert await wire.ask(UserQuery(participant_id=pid, text="b")) == "b|a|F"
        record = parse_record(await wire.record(pid))
        assert record.snapshot is not None
        moved = ParticipantSnapshot.from_json(record.snapshot)  # what a new owner reads
        assert moved.history_version == 1
        assert [item.user for item in moved.history] == ["earlier", "a", "b"]
        with pytest.raises(KeyNotFoundError):
            await wire.kv.get(f"quarantine.0.{encode_token(pid)}")

    wire.call(main())


def test_big_records_are_imported_and_too_many_objects_quarantined(wire: Wire) -> None:
    """A record over 64 KiB (read off the event loop) is imported: its newest exchange
    is the participant's history. A record holding more objects and arrays than
    `MAX_SNAPSHOT_CONTAINERS` allows (17,000 tiny exchanges; 18,000 are past the
    record's own bound) is quarantined before it is parsed, counted, and its participant
    starts clean."""

    async def main() -> None:
        big, crowded, packed = fresh("big"), fresh("crowded"), fresh("packed")
        history = [{"user": f"u{i}", "assistant": "a" * 300} for i in range(299)]
        history.append({"user": "remembered", "assistant": "yes"})
        record = state_json("old", [], json.dumps(
            {"participant_id": big, "history": history}))
        assert len(record) > 64 * 1024
        await wire.kv.put(f"0.{encode_token(big)}", record)
        for pid, count in ((crowded, 17_000), (packed, 18_000)):
            tiny = ",".join(['{"user":"q","assistant":"a"}'] * count)
            await wire.kv.put(f"0.{encode_token(pid)}", state_json(
                "old", [], f'{{"participant_id":{json.dumps(pid)},"history":[{tiny}]}}'))
        rejected = wire.watch.rejected
        before = rejected.count("invalid"), rejected.count("invalid_snapshot")
        assert await wire.ask(UserQuery(participant_id=big, text="hi")) == "hi|remembered|N"
        for pid in (crowded, packed):
            assert await wire.ask(UserQuery(participant_id=pid, text="hi")) == "hi|-|N"
            assert (await wire.kv.get(f"quarantine.0.{encode_token(pid)}")).value
        # The snapshot's own bound, then the record's (the snapshot's plus 1024).
        assert (rejected.count("invalid"), rejected.count("invalid_snapshot")) == (
            before[0] + 1, before[1] + 1)

    wire.call(main())


def test_a_forged_snapshots_keys_and_ids_reach_the_log_short_and_escaped(
        wire: Wire, caplog: pytest.LogCaptureFixture) -> None:
    """redteam20 F3 and F6: a forged record whose snapshot has an unknown key of
    terminal escapes and line separators is quarantined with a WARNING line that holds
    no control or separator character and stays short (before: the key raw, cut at
    ~316 characters); one whose two held patches share an id is quarantined and
    counted too (before: imported, one patch silently gone)."""

    async def main() -> None:
        key = "\x1b[2J\x1b[31mFORGED LOG LINE\u2028" * 2_000
        held = {"patch_id": "same", "task_id": "t", "created_at": 1.0,
                "patch": {"task_id": "t"}}
        forged: dict[str, dict[str, Any]] = {fresh("ansi"): {key: 1},
                                             fresh("twins"): {"pending": [held, held]}}
        for pid, extra in forged.items():
            await wire.kv.put(f"0.{encode_token(pid)}", state_json("old", [], json.dumps(
                {"participant_id": pid, **extra}, ensure_ascii=False)))
        before = wire.watch.rejected.count("invalid_snapshot")
        for pid in forged:
            assert await wire.ask(UserQuery(participant_id=pid, text="hi")) == "hi|-|N"
        assert wire.watch.rejected.count("invalid_snapshot") == before + 2

    with caplog.at_level(logging.WARNING, logger="turnrouter.runtime.nats"):
        wire.call(main())
    lines = [record.getMessage() for record in caplog.records if "quarantined" in
             record.getMessage()]
    assert len(lines) == 2, lines
    assert all(line.isprintable() and len(line) < 400 for line in lines), lines
    assert "two pending patches share the id 'same'" in lines[1]


@settings(max_examples=30, deadline=None)
@given(st.text(max_size=200), st.integers(1, 64), st.sampled_from(["{}", "[]"]))
def test_records_over_the_containers_bound_are_refused_unparsed(
        junk: str, extra: int, unit: str) -> None:
    """A record with more objects and arrays than the snapshot's bound plus 1024 is a
    ValueError naming the count, whatever else it holds."""
    bound = MAX_SNAPSHOT_CONTAINERS + 1024
    filler = ",".join([unit] * (bound + extra))
    for data in (f'{{"owner":"x"}}\n[{filler}]{junk}', f'{{"owner":{json.dumps(junk)},'
                 f'"inflight":[]}}\n{{"participant_id":"p","x":[{filler}]}}'):
        with pytest.raises(ValueError, match="objects and arrays"):
            parse_state(data.encode("utf-8", "surrogatepass"))


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 64), st.sampled_from(["{", "[", '\\"[', "\\\\{"]))
def test_brackets_in_a_records_text_are_not_counted(extra: int, unit: str) -> None:
    """`{` and `[` inside the record's strings, past the bound's count, cost parsing
    nothing and are read (counted raw, a participant's history of them got the record
    quarantined and the participant started clean)."""
    text = unit * (MAX_SNAPSHOT_CONTAINERS + 1024 + extra)
    snapshot = json.dumps({"participant_id": "p", "focus": text})
    assert parse_state(state_json("w", [], snapshot)) == ([], snapshot, [])


ID = st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=20)


@given(st.lists(ID, max_size=3), st.text(max_size=30),
       st.lists(st.tuples(ID, st.text(max_size=10), st.text(max_size=40).filter(valid_text),
                          st.floats(0, 2e9)), max_size=3))
def test_any_record_written_reads_back(inflight: list[str], snapshot: str,
                                       outbox: list[tuple[str, str, str, float]]) -> None:
    """Whatever ids, snapshot text and endings a worker writes (ids of validated
    messages: non-empty, no lone surrogate), the record reads back the same."""
    if any("\ud800" <= c <= "\udfff" for c in snapshot):
        snapshot = "{}"
    data = state_json("w", inflight, snapshot, outbox)
    assert parse_state(data) == (inflight, snapshot, outbox)
    record = parse_record(data)
    assert (record.inflight, record.snapshot, record.outbox, record.owner) == (
        inflight, snapshot, outbox, "w")


@given(st.lists(st.text(max_size=300), min_size=0, max_size=80),
       st.lists(st.tuples(st.text(max_size=300), st.text(max_size=300), st.text(max_size=20),
                          st.floats(0, 2e9)), max_size=80))
def test_records_past_their_bounds_are_refused(inflight: list[str],
                                               outbox: list[tuple[str, str, str, float]]
                                               ) -> None:
    """A record holding more than 64 turns in flight or endings, an empty or over-long
    id, or a lone surrogate is a ValueError; one within every bound reads back."""
    data = state_json("w", inflight, None, outbox)
    ids = [*inflight, *(e[0] for e in outbox)]
    within = (len(inflight) <= 64 and len(outbox) <= 64
              and all(0 < len(i) <= 256 for i in ids)
              and all(len(e[1]) <= 256 for e in outbox)
              and not any("\ud800" <= c <= "\udfff"
                          for t in [*ids, *(e[1] + e[2] for e in outbox)] for c in t))
    try:
        read = parse_state(data)
    except ValueError:
        assert not within
        return
    assert within and read == (inflight, None, outbox)


def test_oversized_records_are_refused_before_parsing() -> None:
    """A record over MAX_STATE_BYTES is refused by its size."""
    with pytest.raises(ValueError, match="bytes"):
        parse_state(state_json("w", [], "x" * (5 * 1024 * 1024)))


def test_a_record_time_too_large_for_a_float_is_refused() -> None:
    """An outbox entry whose time is an integer too large for a float is a ValueError
    naming the outbox (the record is then unreadable, its participant starts afresh)."""
    record = json.dumps({"owner": "w", "inflight": [], "outbox": [["t", "r", "x", 10**400]]})
    with pytest.raises(ValueError, match="outbox"):
        parse_state(record.encode())


@pytest.mark.parametrize("head", [
    '{"owner":"w","inflight":["t-1"],"inflight":[]}',
    '{"owner":"w","inflight":[],"outbox":[],"outbox":[["t","r","x",1.0]]}',
])
def test_a_record_with_a_key_twice_is_refused(head: str) -> None:
    """A record whose key appears twice is unreadable (its participant starts afresh,
    quarantined): which of the two a reader takes is not something to guess."""
    with pytest.raises(ValueError, match="duplicate key"):
        parse_state(head.encode())


# ---------------------------------------------------------------- output ids


def test_outputs_carry_their_deduplication_ids(wire: Wire) -> None:
    """A turn's answer goes out as `<token>.<turn id>.final` (scoped to its participant),
    marked final; each of its control texts (the preamble, the acknowledgment) under an
    id of its own, by content, not final."""
    query = UserQuery(participant_id=fresh("ack-"), text="book a table for two tonight")

    async def main() -> None:
        answer = await wire.ask(query)
        ids = {output.text: msg_id for output, msg_id in wire.heard[query.message_id]}
        assert list(ids) == [PREAMBLE, ACK, answer]
        scope = f"{encode_token(query.participant_id)}.{query.message_id}"
        assert ids[answer] == f"{scope}.final"
        assert len({ids[PREAMBLE], ids[ACK], ids[answer]}) == 3
        assert all(ids[text].startswith(f"{scope}.") for text in (PREAMBLE, ACK))
        finals = {output.text: output.final for output, _ in wire.heard[query.message_id]}
        assert finals == {PREAMBLE: False, ACK: False, answer: True}

    wire.call(main())



# ---------------------------------------------------------------- unreachable from outside
#
# What no deployment can put on the wire, so only private names reach it: the server's
# own replies (JetStream ack subjects, publish acknowledgments) and subjects outside the
# stream's transform. These parsers guard against a server that changed or misbehaves.


@pytest.mark.parametrize("subject", [
    "tr.p.99.YW5u.query",  # a partition the deployment does not have
    "other.p.3.YW5u.query",  # another deployment's prefix
    "tr.p.3.YW5u",  # too few tokens
])
def test_subjects_outside_the_transform_are_unknown(subject: str) -> None:
    """Subjects the input stream's transform never produces are rejected as unknown."""
    with pytest.raises(Rejected) as info:
        parse_input(CONFIG, subject, b'{"participant_id":"ann","text":"hi"}')
    assert info.value.reason == "unknown_subject"
    assert isinstance(info.value, TurnrouterError) and isinstance(info.value, ValueError)


@settings(max_examples=200)
@given(subject=st.text(max_size=120), data=st.binary(max_size=2000) | JUNK.map(
    lambda v: json.dumps(v).encode()))
@example(subject="tr.probe.\u00b2", data=b"")  # a digit int() does not read
@example(subject="tr.p.\u00b2.YW5u.query", data=b"{}")
def test_any_subject_parses_or_is_rejected(subject: str, data: bytes) -> None:
    """Whatever the subject (any text, not only what the server delivers), parse_input
    returns a typed message or raises Rejected with a documented reason."""
    reason = "parsed"
    try:
        parse_input(CONFIG, subject, data)
    except Rejected as exc:
        reason = exc.reason
    assert reason in {"parsed", "unknown_subject", "oversized", "invalid"}


@given(partition=st.integers(0, CONFIG.partitions - 1), body=st.binary(max_size=70_000))
@example(partition=0, body=b"")
def test_a_probe_carries_no_body(partition: int, body: bytes) -> None:
    """A probe (as delivered, of either subject form) parses as one only when empty; a
    body means it is not a replica's: `invalid`, counted (redteam21 F5)."""
    token = CONFIG.probe_subject(partition).split(".")[2]
    for subject in (f"{CONFIG.prefix}.p.{partition}.{token}.probe",
                    CONFIG.legacy_probe_subject(partition)):
        if not body:
            assert parse_input(CONFIG, subject, body) == (partition, None, "probe", None)
            continue
        with pytest.raises(Rejected) as info:
            parse_input(CONFIG, subject, body)
        assert info.value.reason == "invalid"


@settings(max_examples=200)
@given(msg_id=st.none() | st.text(max_size=300), message_id=st.text(
    alphabet=string.ascii_letters + string.digits + "-._", min_size=1, max_size=64))
@example(msg_id="YW5u.m-1", message_id="m-1")  # its own: accepted
@example(msg_id="dmlj.m-1", message_id="m-1")  # another participant's: refused
def test_a_nats_msg_id_other_than_the_messages_own_is_refused(
        msg_id: str | None, message_id: str) -> None:
    """An input's `Nats-Msg-Id` must be `<token>.<message id>` of that very message (as
    `NatsFrontEnd.publish` sets it); any other is `foreign_id` (a decoy taking another
    participant's id, redteam18 F7), whatever its text, and so is none (`""`: a decoy
    without one took the participant's id in their record, redteam22 F1). None skips
    the check."""
    body = UserQuery(participant_id="ann", text="hi", message_id=message_id)
    own = f"{encode_token('ann')}.{message_id}"
    subject = f"{CONFIG.prefix}.p.0.{encode_token('ann')}.query"
    with pytest.raises(Rejected, match="no Nats-Msg-Id") as info:
        parse_input(CONFIG, subject, body.model_dump_json().encode(), "")
    assert info.value.reason == "foreign_id"
    if msg_id is None or msg_id == own:
        _, pid, _, parsed = parse_input(CONFIG, subject, body.model_dump_json().encode(),
                                        msg_id)
        assert pid == "ann" and parsed == body
    else:
        with pytest.raises(Rejected) as info:
            parse_input(CONFIG, subject, body.model_dump_json().encode(), msg_id)
        assert info.value.reason == "foreign_id"
    with pytest.raises(Rejected) as info:
        parse_input(CONFIG, subject, body.model_dump_json().encode(),
                    f"{encode_token('vic')}.{message_id}")
    assert info.value.reason == "foreign_id"


SAMPLES = st.builds(
    TimingSample, st.text(min_size=1, max_size=40),
    st.floats(min_value=0, max_value=1e6, allow_nan=False),
    st.booleans(), st.floats(min_value=-1e9, max_value=1e10, allow_nan=False,
                             allow_infinity=False),
    st.none() | st.text(min_size=1, max_size=20))


@given(st.lists(SAMPLES, min_size=1, max_size=70))
def test_timing_samples_round_trip_through_one_message(samples: list[TimingSample]) -> None:
    """A batch of samples written by samples_body reads back as the same samples (times
    rounded as the sample files round them), with no line refused."""
    got, errors = parse_samples(CONFIG, samples_body([x.to_json() for x in samples]))
    assert errors == []
    assert got == [TimingSample.from_json(x.to_json()) for x in samples]


@settings(max_examples=200)
@given(st.binary(max_size=3000) | st.lists(
    st.text(max_size=60) | JUNK.map(json.dumps) | SAMPLES.map(TimingSample.to_json),
    max_size=8).map(lambda lines: "\n".join(lines).encode()))
def test_any_timing_message_parses_line_by_line_or_is_rejected(data: bytes) -> None:
    """Whatever the body, parse_samples returns samples and one error per bad line (at
    most one per line), or raises Rejected with a documented reason."""
    reason = "parsed"
    samples: list[TimingSample] = []
    errors: list[str] = []
    try:
        samples, errors = parse_samples(CONFIG, data)
    except Rejected as exc:
        reason = exc.reason
    assert reason in {"parsed", "invalid"}
    assert len(samples) + len(errors) <= data.count(b"\n") + 1
    assert all(isinstance(x, TimingSample) and x.route for x in samples)


def test_oversized_and_deep_timing_messages_are_refused_by_name() -> None:
    """A body over max_message_bytes is `oversized`; a line nested past the parser's
    depth is one refused line, not a crash."""
    with pytest.raises(Rejected, match="oversized"):
        parse_samples(CONFIG, b"\n" * (CONFIG.max_message_bytes + 1))
    good = TimingSample("r", 1.0).to_json()
    samples, errors = parse_samples(CONFIG, samples_body(["[" * 5000, good]))
    assert (len(samples), errors) == (1, ["a timing sample nested too deeply"])


def test_publish_acknowledgments_parse_to_a_sequence_or_an_error() -> None:
    """A stored publish's reply gives its sequence; a refusal gives the server's error."""
    assert pub_ack(b'{"stream":"KV_s","seq":42}') == (42, None)
    wrong = {"code": 400, "err_code": 10071, "description": "wrong last sequence: 41"}
    assert pub_ack(json.dumps({"error": wrong}).encode()) == (None, wrong)


@given(st.binary(max_size=300) | JUNK.map(lambda v: json.dumps(v).encode()))
def test_junk_publish_acknowledgments_raise_value_error(data: bytes) -> None:
    """Whatever the reply holds, pub_ack returns a non-negative int sequence or an
    error, or raises ValueError (the record write then logs it)."""
    try:
        seq, error = pub_ack(data)
    except ValueError:
        return
    assert (isinstance(seq, int) and seq >= 0 and error is None) or (
        seq is None and error is not None)


ACK_NAMES = st.text(max_size=12) | st.sampled_from(["KV_tr_state", "TR_OUT", 'a"b', "a\\b"])


@given(stream=ACK_NAMES, seq=st.integers(min_value=-5, max_value=2**63) | st.text(max_size=4),
       domain=st.none() | ACK_NAMES, duplicate=st.booleans(), spaced=st.booleans())
def test_acknowledgments_read_as_the_json_parser_reads_them(
        stream: str, seq: int | str, domain: str | None, duplicate: bool,
        spaced: bool) -> None:
    """pub_ack reads the usual acknowledgment without the JSON parser: whatever the
    stream name, sequence, domain and layout, it gives what parsing the JSON gives."""
    body: dict[str, Any] = {"stream": stream, "seq": seq}
    if domain is not None:
        body["domain"] = domain
    if duplicate:
        body["duplicate"] = True
    data = json.dumps(body, separators=(", ", ": ") if spaced else (",", ":")).encode()
    ok = isinstance(seq, int) and seq >= 0
    if ok:
        assert pub_ack(data) == (seq, None)
    else:
        with pytest.raises(ValueError, match="publish acknowledgment"):
            pub_ack(data)


OUTPUT_TEXT = st.text(max_size=300) | st.sampled_from(["\ud800", "a\udfffb", "", "x" * 257])


@settings(max_examples=300)
@given(pid=OUTPUT_TEXT | JUNK, turn=OUTPUT_TEXT | JUNK, route=OUTPUT_TEXT | JUNK,
       text=OUTPUT_TEXT | JUNK, final=st.booleans() | JUNK,
       parent=st.none() | OUTPUT_TEXT, state=st.none() | OUTPUT_TEXT)
def test_outputs_are_built_and_checked_as_the_model_builds_them(
        pid: Any, turn: Any, route: Any, text: Any, final: Any, parent: str | None,
        state: str | None) -> None:
    """A worker writes its outputs' JSON without building a `ResponseOutput`: whatever
    the fields (junk types, lone surrogates, ids of any length), it refuses exactly what
    the model refuses (ContractValueError), and what it writes reads back through the
    model as those fields."""
    carrier = {k: v for k, v in (("traceparent", parent), ("tracestate", state))
               if v is not None}
    fields = {"participant_id": pid, "request_id": turn, "route": route, "text": text,
              "final": final, "traceparent": parent, "tracestate": state}
    try:
        ResponseOutput(**fields)
    except ValidationError:
        with pytest.raises(ContractValueError, match="invalid field"):
            response_json(pid, turn, route, text, final=final, carrier=carrier)
        return
    read = ResponseOutput.model_validate_json(
        response_json(pid, turn, route, text, final=final, carrier=carrier))
    assert read.model_dump(exclude={"message_id", "timestamp_us"}) == fields
    assert read.message_id and abs(read.timestamp_us - time.time_ns() // 1000) < 60_000_000


def test_deeply_nested_acknowledgment_is_a_value_error() -> None:
    """A reply nested past the parser's depth is refused as ValueError."""
    with pytest.raises(ValueError, match="nested"):
        pub_ack(b"[" * 200_000 + b"]" * 200_000)


def test_ack_subjects_give_the_delivery_count_and_stored_time() -> None:
    """Both ack subject layouts (with and without domain and account) are read."""
    assert ack_metadata("$JS.ACK.TR_IN.p3.2.17.9.1700000000123456789.0") == (
        2, 1700000000123456789)
    assert ack_metadata("$JS.ACK.dom.acc.TR_IN.p3.3.17.9.1700000000123456789.0.x") == (
        3, 1700000000123456789)
    assert ack_metadata(None) == (1, 0)


@given(st.text(max_size=200))
def test_junk_ack_subjects_give_defaults(reply: str) -> None:
    """Any reply subject gives two ints (count 1 and no stored time when unreadable);
    a stored time is a nanosecond count a float holds."""
    count, stored = ack_metadata(reply)
    assert isinstance(count, int) and isinstance(stored, int) and 0 <= stored < 2**63
    assert ack_metadata("$JS.ACK.S.c.1.2.3." + "9" * 400 + ".0") == (1, 0)


def test_ack_subjects_give_the_sequences_and_stored_time() -> None:
    """Both layouts give the stream and consumer sequences (an output reader's, the
    backpressure check's) and the stored time; anything but an ack subject gives None."""
    assert ack_sequences("$JS.ACK.TR_IN.p3.2.17.9.1700000000123456789.0") == (
        17, 9, 1700000000123456789)
    assert ack_sequences("$JS.ACK.dom.acc.TR_IN.p3.3.17.9.1700000000123456789.0.x") == (
        17, 9, 1700000000123456789)
    for junk in (None, "", "_INBOX.x.y", "$JS.ACK.S.c.1", "$JS.ACK.S.c.1.x.3.4.0",
                 "X.ACK.S.c.1.2.3.4.0"):
        assert ack_sequences(junk) is None


@given(st.text(max_size=200))
def test_junk_ack_subjects_give_no_sequences_or_ints(reply: str) -> None:
    """Any reply subject gives None or three ints, the stored time one a float holds."""
    got = ack_sequences("$JS.ACK." + reply)
    assert got is None or (all(isinstance(v, int) for v in got) and 0 <= got[2] < 2**63)


@given(st.text(max_size=200))
def test_an_ack_subject_names_its_consumer_or_nothing(reply: str) -> None:
    """Both layouts name the delivering stream and consumer (an output reader keeps only
    its own consumer's deliveries); anything else, junk included, names none."""
    assert ack_consumer("$JS.ACK.TR_OUT.c1.1.17.9.1700000000123456789.0") == "TR_OUT.c1"
    assert ack_consumer("$JS.ACK.dom.acc.TR_OUT.c1.1.17.9.1.0.x") == "TR_OUT.c1"
    assert ack_consumer(None) is None and ack_consumer("$JS.ACK.S.c.1") is None
    got = ack_consumer("$JS.ACK." + reply)
    assert got is None or (isinstance(got, str) and got.count(".") >= 1)


@pytest.mark.parametrize("header", [
    {"inflight": ["a\ud800"]}, {"ended": ["a\udfff"]},
    {"outbox": [["t", "r\ud800", "text", 1.0]]},
])
def test_a_record_holding_a_lone_surrogate_id_is_refused_at_read(
        header: dict[str, object]) -> None:
    """An id or route the next write could not hold again (a lone surrogate) makes the
    record unreadable at its first read (quarantined, its participant starting clean),
    not after the claiming worker wrote it back for the next owner to refuse."""
    data = json.dumps({"owner": "w", "inflight": [], "outbox": [], "ended": [],
                       **header}).encode()
    with pytest.raises(ValueError, match="out of bounds"):
        parse_record(data)


def test_a_record_past_the_servers_max_payload_never_holds_its_partition(
        tmp_path: Path) -> None:
    """A participant whose record grows past the NATS server's `max_payload` (a context
    budget larger than a message) is answered all along, its record written without
    its snapshot and counted (`nats_state`, `oversized`), its history kept while it
    stays here; the other participants of its partition are answered all along. A
    record stored just under `max_payload`, which its claim cannot write back, is
    quarantined and its participant starts clean. (Before, the write failed at every
    attempt and the partition's next inputs waited for ever.)"""
    conf = tmp_path / "small.conf"
    conf.write_text("max_payload: 262144\n")
    wire = Wire(server_config=conf, router_options={"context_budget_bytes": 4_000_000})

    async def main() -> None:
        big, other, stored = fresh("big"), fresh(), fresh("stored")
        for i in range(6):  # ~60 kB of history per turn: past 256 KiB at the 5th
            answer = await wire.ask(UserQuery(participant_id=big, text=f"{i}" + "x" * 20_000))
            assert answer.startswith(f"{i}x") and answer.endswith("|N" if i == 0 else "|F")
            previous = "-" if i == 0 else f"o{i - 1}"
            assert await wire.ask(UserQuery(participant_id=other, text=f"o{i}")) \
                == f"o{i}|{previous}|{'N' if i == 0 else 'F'}"
        assert "oversized" in wire.watch.rejected
        assert parse_record(await wire.record(big)).snapshot is None
        assert (await wire.ask(UserQuery(participant_id=big, text="last"))).startswith(
            "last|5x")  # its history, here

        snapshot = json.dumps({"participant_id": stored, "history": [
            {"user": "u" * 100_000, "assistant": "a" * 100_000}]})
        record = state_json("old", [], snapshot)
        record += b" " * (262_144 - 200 - len(record))  # (JSON whitespace)
        await wire.kv.put(f"0.{encode_token(stored)}", record)
        before = wire.watch.rejected.count("oversized")
        assert await wire.ask(UserQuery(participant_id=stored, text="hi")) == "hi|-|N"
        assert wire.watch.rejected.count("oversized") > before
        assert (await wire.kv.get(f"quarantine.0.{encode_token(stored)}")).value
        assert await wire.ask(UserQuery(participant_id=other, text="end")) == "end|o5|F"

    try:
        wire.call(main(), timeout=120)
    finally:
        wire.close()


@pytest.mark.anyio
async def test_a_placement_refused_for_want_of_servers_is_waited_out(
        nats_server: NatsServer) -> None:
    """JetStream's "no suitable peers for placement" (10005: fewer servers of a cluster
    online than the copies asked for, as while it forms or a server restarts) is a
    passing state the start-up tries again (`LifecycleError`), not a refused
    configuration; other refusals stay `ConfigurationError`s. (A worker starting on a
    cluster whose third server had not joined yet exited at once.)"""
    nc = await nats.connect(nats_server.url)
    try:
        async def refuse(msg: Msg) -> None:  # a JetStream API refusing with a code
            code = int(msg.subject.rsplit(".", 1)[1])
            await msg.respond(json.dumps({"error": {
                "code": 400, "err_code": code, "description": "refused"}}).encode())

        await nc.subscribe("api.>", cb=refuse)
        with pytest.raises(LifecycleError, match="no suitable peers"):
            await api_request(nc, "api.10005")
        with pytest.raises(ConfigurationError, match="refused"):
            await api_request(nc, "api.10058")
    finally:
        await nc.close()


@pytest.mark.anyio
async def test_a_front_ends_mirror_refused_placement_is_waited_for_not_skipped(
        nats_server: NatsServer) -> None:
    """With no `front_api` named, a front ends' API that does not answer is optional
    (the mirror skipped), but one answering 10005 exists and lacks servers: the
    start-up waits for them (`LifecycleError`, tried again) instead of going on without
    the mirror, which front ends would then miss outputs of until it was recreated."""
    config = NatsConfig(url=nats_server.url)
    nc = await nats.connect(nats_server.url)
    try:
        await _ensure_front_mirror(nc, config)  # nothing answers: skipped, no error

        async def unplaced(msg: Msg) -> None:
            await msg.respond(json.dumps({"error": {
                "code": 500, "err_code": 10005,
                "description": "no suitable peers for placement"}}).encode())

        await nc.subscribe("$JS.FRONT.API.>", cb=unplaced)
        with pytest.raises(LifecycleError, match=r"no suitable peers.*storage limits"):
            await _ensure_front_mirror(nc, config)
    finally:
        await nc.close()


# ------------------------------------------------------------- the session in the header

#: The snapshot fields a worker of the version before session turns knows: its strict
#: reader refuses any other (the record was quarantined, the participant started clean).
EARLIER_FIELDS = {"participant_id", "focus", "history", "history_version", "used",
                  "pending", "initialized", "departed", "cleanup_pending"}
_ids = st.text(min_size=1, max_size=12).filter(
    lambda t: not any(0xD800 <= ord(c) <= 0xDFFF for c in t))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(session=st.none() | st.lists(_ids, max_size=MAX_SESSION_TURNS, unique=True),
       facts=st.dictionaries(st.sampled_from(["session_turns", "x", "history_version"]),
                             st.lists(_ids, max_size=3) | st.integers(), max_size=3),
       cleanup=st.booleans(), inflight=st.lists(_ids, max_size=3))
def test_a_record_carries_the_session_in_its_header_and_reads_back_whole(
        session: list[str] | None, facts: dict[str, Any], cleanup: bool,
        inflight: list[str]) -> None:
    """A record's snapshot part holds only fields a worker of the earlier version reads
    (its strict reader refused `session_turns`: in a rolling upgrade, a partition moved
    back to such a worker lost its participants' state); the session's turns ride in
    the header, which that worker ignores, and `parse_record` gives the snapshot back
    whole, also when a patch's facts hold keys named like the field."""
    patch = ContextPatch(task_id="job", facts=facts)
    held = PendingContextPatch("ann-h", "job", patch, participant_id="ann")
    snapshot = ParticipantSnapshot.from_json(json.dumps({
        "participant_id": "ann", "history_version": 1, "cleanup_pending": cleanup,
        "session_turns": session,
        "history": [{"user": "q", "assistant": "a", "turn_id": "t0", "patch": {
            "patch_id": "ann-p", "task_id": "job", "strategy": MergeStrategy.APPEND.value,
            "diverged": False, "patch": patch.model_dump(mode="json")}}],
        "pending": [held.model_dump(mode="json")]}))
    record = state_json("w1", inflight, snapshot.to_json())
    head, _, part = record.partition(b"\n")
    assert set(json.loads(part)) <= EARLIER_FIELDS
    assert json.loads(head).get("session") == session
    read = parse_record(record)
    assert read.inflight == inflight and read.snapshot is not None
    assert ParticipantSnapshot.from_json(read.snapshot) == snapshot


@pytest.mark.parametrize("session", [
    "t1", [1], [""], ["x" * 257], ["\ud800"], [f"t{n}" for n in range(MAX_SESSION_TURNS + 1)],
    {"t1": None}])
def test_a_header_session_out_of_bounds_is_refused_naming_it(session: object) -> None:
    """A forged header's session (not a list of at most MAX_SESSION_TURNS turn ids of
    1 to 256 characters) makes the record junk, named, as its other fields do."""
    snapshot = ParticipantSnapshot(participant_id="ann").to_json()
    head = json.dumps({"owner": "w1", "inflight": [], "outbox": [], "session": session})
    with pytest.raises(ValueError, match="'session'"):
        parse_record(f"{head}\n{snapshot}".encode("utf-8", "surrogatepass"))
