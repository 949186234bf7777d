"""One asyncio warning that a TLS connection to NATS prints at every close, silenced.

nats-py's protocol returns True from `eof_received()`; under TLS asyncio says, at every
connection close or reconnect, `returning true from eof_received() has no effect when
using ssl` (a WARNING of the `asyncio` logger that operators chased as an error,
redteam18 F8). The filter drops that exact message and nothing else; the worker CLI and
`NatsFrontEnd.connect` install it (once).
"""

from __future__ import annotations

import logging

__all__ = ["quiet_tls_eof"]

_TEXT = "returning true from eof_received() has no effect when using ssl"


class _TlsEofFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == _TEXT and not record.args)


_FILTER = _TlsEofFilter()


def quiet_tls_eof() -> None:
    """Install the filter on the `asyncio` logger (idempotent)."""
    target = logging.getLogger("asyncio")
    if _FILTER not in target.filters:
        target.addFilter(_FILTER)
