"""The NATS runtime's boundaries without a server: subjects, tokens, records, config."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from turnrouter import ConfigurationError, ContractValueError
from turnrouter.runtime import Interrupted, ParticipantLeft, UserQuery
from turnrouter.runtime.nats import (
    MAX_PARTICIPANT_ID_BYTES,
    NatsConfig,
    decode_token,
    encode_token,
)
from turnrouter.runtime.nats._link import pub_ack
from turnrouter.runtime.nats._metrics import runtime_metrics
from turnrouter.runtime.nats._wire import (
    Rejected,
    ack_metadata,
    kind_of,
    output_message_id,
    parse_input,
    parse_state,
    state_json,
)

CONFIG = NatsConfig(prefix="tr", partitions=8)
JUNK = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=50),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10),
                                                                 inner, max_size=5),
    max_leaves=30)


def delivered(pid: str, kind: str, partition: int = 3) -> str:
    """The subject the stream's transform gives a participant's input."""
    return f"tr.p.{partition}.{encode_token(pid)}.{kind}"


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


def test_overlong_participant_ids_are_refused() -> None:
    """Participant ids over the documented bound are a ContractValueError."""
    with pytest.raises(ContractValueError, match="participant id"):
        encode_token("x" * (MAX_PARTICIPANT_ID_BYTES + 1))


def test_valid_inputs_parse_to_their_typed_messages() -> None:
    """A query, a departure and an interrupt parse with their partition and participant."""
    query = UserQuery(participant_id="ann", text="hi")
    assert parse_input(CONFIG, delivered("ann", "query"),
                       query.model_dump_json().encode()) == (3, "ann", "query", query)
    left = ParticipantLeft(participant_id="ann")
    assert parse_input(CONFIG, delivered("ann", "left"), left.model_dump_json().encode())[3] \
        == left
    assert parse_input(CONFIG, "tr.probe.5", b"") == (5, None, "probe", None)
    assert kind_of(Interrupted(participant_id="ann")) == "interrupt"


@pytest.mark.parametrize(("subject", "data", "reason"), [
    ("tr.p.3.YW5u.bogus", b"{}", "unknown_subject"),
    ("tr.p.99.YW5u.query", b"{}", "unknown_subject"),
    ("other.p.3.YW5u.query", b"{}", "unknown_subject"),
    ("tr.p.3.YW5u.query", b"x" * (64 * 1024 + 1), "oversized"),
    ("tr.p.3.YW5u.query", b"{not json", "invalid"),
    ("tr.p.3.YW5u.query", b'{"participant_id":"bob","text":"hi"}', "invalid"),
    ("tr.p.3.!!.query", b'{"participant_id":"ann","text":"hi"}', "invalid"),
    ("tr.p.3.YW5u.query", b"\xff\xfe\xfa", "invalid"),
    ("tr.p.3.YW5u.query", b"[" * 60_000, "invalid"),
])
def test_bad_inputs_are_rejected_with_a_reason(subject: str, data: bytes,
                                               reason: str) -> None:
    """Unknown subjects, oversized, malformed, non-UTF-8, deeply nested and mismatched
    inputs raise Rejected with a low-cardinality reason."""
    with pytest.raises(Rejected) as info:
        parse_input(CONFIG, subject, data)
    assert info.value.reason == reason


@settings(max_examples=200)
@given(subject=st.text(max_size=120), data=st.binary(max_size=2000) | JUNK.map(
    lambda v: json.dumps(v).encode()))
def test_any_input_parses_or_is_rejected(subject: str, data: bytes) -> None:
    """Whatever arrives, parse_input returns a typed message or raises Rejected."""
    reason = "parsed"
    try:
        parse_input(CONFIG, subject, data)
    except Rejected as exc:
        reason = exc.reason
    assert reason in {"parsed", "unknown_subject", "oversized", "invalid"}


@given(JUNK)
def test_validation_bypassing_bodies_are_rejected(value: object) -> None:
    """Well-formed JSON of the wrong shape on a query subject is rejected as invalid."""
    with pytest.raises(Rejected, match="invalid"):
        parse_input(CONFIG, delivered("ann", "query"), json.dumps({"body": value}).encode())


def test_state_records_round_trip() -> None:
    """A participant record keeps its in-flight ids, snapshot and held endings."""
    ending = ("t0", "echo", 'said "hi" \u00e9\n', 1700000000.5)
    data = state_json("w1", ["t1"], '{"participant_id":"ann"}', [ending])
    assert parse_state(data) == (["t1"], '{"participant_id":"ann"}', [ending])
    assert parse_state(state_json("w1", [], None)) == ([], None, [])


def test_records_of_the_earlier_format_are_read() -> None:
    """A record written as one JSON object (the snapshot a string field) still reads."""
    old = json.dumps({"owner": "w1", "inflight": ["t1"], "snapshot": '{"a":1}',
                      "outbox": [["t0", "echo", "hi", 1.5]]}).encode()
    assert parse_state(old) == (["t1"], '{"a":1}', [("t0", "echo", "hi", 1.5)])


@given(st.lists(st.text(max_size=20), max_size=3), st.text(max_size=30),
       st.lists(st.tuples(st.text(max_size=10), st.text(max_size=10), st.text(max_size=40),
                          st.floats(0, 2e9)), max_size=3))
def test_any_record_written_reads_back(inflight: list[str], snapshot: str,
                                       outbox: list[tuple[str, str, str, float]]) -> None:
    """Whatever ids, snapshot text and endings (lone surrogates included) go in, the
    record reads back the same (the snapshot part is bytes of the router's JSON)."""
    if any("\ud800" <= c <= "\udfff" for c in snapshot):
        snapshot = "{}"
    assert parse_state(state_json("w", inflight, snapshot, outbox)) == (
        inflight, snapshot, outbox)


@given(st.binary(max_size=500) | JUNK.map(lambda v: json.dumps(v).encode()))
def test_junk_state_records_raise_value_error(data: bytes) -> None:
    """An unreadable record raises ValueError (the worker then starts afresh)."""
    try:
        inflight, snapshot, outbox = parse_state(data)
    except ValueError:
        return
    assert isinstance(inflight, list) and isinstance(outbox, list)
    assert snapshot is None or isinstance(snapshot, str)


def test_deeply_nested_state_record_is_a_value_error() -> None:
    """A record nested past the parser's depth is refused as ValueError."""
    with pytest.raises(ValueError, match="nested too deeply"):
        parse_state(b"[" * 200_000 + b"]" * 200_000)


def test_terminal_outputs_share_one_id_and_control_text_is_by_content() -> None:
    """An answer and the failure text of one turn deduplicate; control text does not."""
    assert output_message_id("t", "echo", "a", final=True) == output_message_id(
        "t", "none", "sorry", final=True)
    assert output_message_id("t", "echo", "a", final=False) != output_message_id(
        "t", "echo", "b", final=False)


@pytest.mark.parametrize(("field", "value"), [
    ("prefix", "a.b"), ("prefix", ""), ("partitions", 0), ("partitions", 5000),
    ("failover_timeout", 0), ("pull_expires", 2.0), ("max_message_bytes", 10),
    ("ack_wait", float("inf")), ("drain_timeout", float("nan")), ("dedup_window", True),
    ("mark_after", 0), ("mark_after", 1.0),
])
def test_bad_config_names_the_field(field: str, value: object) -> None:
    """An impossible configuration raises ConfigurationError naming the field."""
    with pytest.raises(ConfigurationError, match=field):
        NatsConfig(**{field: value})  # type: ignore[arg-type]


def test_metric_families_register_once_per_registry() -> None:
    """Two workers on one registry share one set of families."""
    registry = CollectorRegistry()
    assert runtime_metrics(registry) is runtime_metrics(registry)
    assert runtime_metrics(CollectorRegistry()) is not runtime_metrics(registry)


def test_public_names_are_pinned() -> None:
    """turnrouter.runtime.nats exports exactly the documented names."""
    import turnrouter.runtime.nats as module

    assert set(module.__all__) == {
        "MAX_PARTICIPANT_ID_BYTES", "NatsConfig", "NatsFrontEnd", "NatsWorker",
        "WorkerContext", "decode_token", "encode_token"}


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
