"""LiveKit is an optional extra: turnrouter never imports it on its own."""

from __future__ import annotations

import subprocess
import sys


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)


def test_import_turnrouter_does_not_import_livekit() -> None:
    """`import turnrouter` (and its integrations package) loads no livekit module."""
    done = _python("import sys, turnrouter, turnrouter.integrations, turnrouter.testing\n"
                   "print(sorted(m for m in sys.modules if m.split('.')[0] == 'livekit'))")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_missing_extra_names_it_in_one_line() -> None:
    """Without LiveKit Agents the adapter's ImportError says what to install."""
    done = _python("import sys\nsys.modules['livekit'] = None\n"
                   "try:\n    import turnrouter.integrations.livekit\n"
                   "except ImportError as exc:\n    print(str(exc))\n")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1
    assert "livekit extra" in lines[0] and "pip install -e '.[livekit]'" in lines[0]
