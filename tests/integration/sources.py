"""Where the integration tests get turnrouter metrics from: the real demo.

`source_command` starts `turnrouter demo --serve`, which serves `/metrics` on a given
port and generates traffic until killed.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

__all__ = ["demo_command", "source_command"]


def demo_command(port: int, args: list[str]) -> list[str]:
    """`turnrouter demo --serve ARGS` (the console script next to this interpreter)."""
    script = Path(sys.executable).with_name("turnrouter")
    executable = str(script) if script.exists() else shutil.which("turnrouter") or "turnrouter"
    return [executable, "demo", "--serve", "--quiet", "--metrics-port", str(port), *args]


def source_command(port: int, args: list[str]) -> list[str]:
    """The metrics source the integration tests scrape."""
    return demo_command(port, args)
