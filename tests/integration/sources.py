"""Where the integration tests get turnrouter metrics from: the real demo.

`source_command` starts `turnrouter demo --serve`, which serves `/metrics` on a given
port and generates traffic (40 participants at 4x speed, so every series exists within
seconds) until killed.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

__all__ = ["demo_command", "source_command"]

#: The demo at 4x speed with 40 participants produces every series within seconds.
DEMO_PARTICIPANTS = 40


def demo_command(port: int, *, clarify_heavy: bool, seed: int) -> list[str]:
    """`turnrouter demo --serve` (the console script next to this interpreter)."""
    script = Path(sys.executable).with_name("turnrouter")
    executable = str(script) if script.exists() else shutil.which("turnrouter") or "turnrouter"
    command = [executable, "demo", "--serve", "--quiet", "--metrics-port", str(port),
               "--participants", str(DEMO_PARTICIPANTS), "--speed", "4", "--seed", str(seed)]
    return [*command, "--clarify-heavy"] if clarify_heavy else command


def source_command(port: int, *, clarify_heavy: bool, seed: int) -> list[str]:
    """The metrics source the integration tests scrape."""
    return demo_command(port, clarify_heavy=clarify_heavy, seed=seed)
