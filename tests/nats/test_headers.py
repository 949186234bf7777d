"""The worker's header parser (`_connection.parse_header_lines`) reads every header
block as nats-py's own `Client._parse_header_lines` does."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from nats.aio.client import Client

from turnrouter.runtime.nats._connection import parse_header_lines

_PIECES = st.sampled_from([
    b"Nats-Msg-Id", b"Status", b"traceparent", b":", b": ", b"\r\n", b" ", b"\t", b"\x0b",
    b"\x1c", b"\x1f", b"\x85", b"\xa0", b"\xe2\x80\x83", b"\xff", b"a", b"-", b"408",
    b"Nats-Pending-Messages: 0", b"\r", b"\n", b"", b"x y", b"\x00"])


@given(st.lists(_PIECES, max_size=40))
def test_header_blocks_parse_as_nats_py_parses_them(pieces: list[bytes]) -> None:
    raw = b"".join(pieces)
    assert parse_header_lines(raw) == Client._parse_header_lines(raw)


@given(st.binary(max_size=200))
def test_any_bytes_parse_as_nats_py_parses_them(raw: bytes) -> None:
    assert parse_header_lines(raw) == Client._parse_header_lines(raw)


def test_a_worker_connection_uses_it() -> None:
    """`Connection.connect` installs it on the client (nats-py 2.16 has the method)."""
    from turnrouter.runtime.nats._connection import _lean_headers

    nc = Client()
    _lean_headers(nc)
    assert nc._parse_header_lines is parse_header_lines
    block = b"Nats-Msg-Id: a.b\r\nbad name: x\r\nNats-Pin-Id: p\r\n\r\n"
    assert nc._parse_header_lines(block) == {"Nats-Msg-Id": "a.b", "Nats-Pin-Id": "p"}
