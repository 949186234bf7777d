"""A partition's pull requests (`_worker._Inbox.pull_body`): the body names the batch,
the expiry, the priority group and the pin held when it is sent, made again when the pin
changes."""

from __future__ import annotations

import json

from turnrouter.runtime.nats._setup import GROUP
from turnrouter.runtime.nats._worker import _BATCH, _Inbox


def test_a_pull_names_the_pin_held_when_it_is_sent() -> None:
    inbox = _Inbox(3, "$JS.API.CONSUMER.MSG.NEXT.S.p3", "_INBOX.x", 0.4)
    plain = {"batch": _BATCH, "expires": 400_000_000, "group": GROUP}
    for pin in (None, "a", "a", "", "b", None):
        expected = plain if pin is None else {**plain, "id": pin}
        assert json.loads(inbox.pull_body(pin)) == expected
        assert inbox.pull_body(pin) == json.dumps(expected).encode()
