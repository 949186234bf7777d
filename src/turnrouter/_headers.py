"""What an HTTP or NATS header name may be: an RFC 9110 `token`.

Shared by the NATS front end's `publish()` headers and the OpenAI-compatible client's
`headers=`, which refuse any other name before a transport does (with less clear words).
"""

from __future__ import annotations

import re

__all__ = ["HEADER_NAME"]

#: One header name: letters, digits and ``!#$%&'*+-.^_`|~``, at least one.
HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
