"""Files named by users, opened without waiting on what is not a file.

A FIFO nobody writes (or reads) blocks a plain `open()` for ever: on the event loop
that froze every participant, and `asyncio.wait_for` could not end it, since no await
ever came (bounds17 H3). Opening with `O_NONBLOCK` returns at once, and a file that is
not regular (a FIFO, a socket, a directory) is refused before anything is read or
written.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import IO, Literal

__all__ = ["open_regular"]

_FLAGS = {"rb": os.O_RDONLY, "ab": os.O_WRONLY | os.O_APPEND | os.O_CREAT}


def open_regular(path: str | os.PathLike[str], mode: Literal["rb", "ab"], *,
                 devices: bool = False) -> IO[bytes]:
    """`path` opened in `mode` ("rb", or "ab" creating it), without blocking;
    `OSError(EINVAL, "not a regular file")` for anything but a regular file (a character
    device such as /dev/null too when `devices`). ValueError for a path holding a NUL."""
    fd = os.open(path, _FLAGS[mode] | os.O_NONBLOCK, 0o644)
    try:
        kind = os.fstat(fd).st_mode
        if not (stat.S_ISREG(kind) or (devices and stat.S_ISCHR(kind))):
            raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise
