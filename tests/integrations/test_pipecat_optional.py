"""Pipecat stays optional: `import turnrouter` never loads it, a missing extra says so."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest


def test_import_turnrouter_never_imports_pipecat() -> None:
    """Importing turnrouter and its integrations package loads no Pipecat module."""
    code = ("import sys, turnrouter, turnrouter.integrations, turnrouter.testing; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'pipecat'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_missing_extra_gives_one_line_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without Pipecat, importing the adapter raises one ImportError line naming the extra."""
    for name in list(sys.modules):
        if name.split(".")[0] == "pipecat" or name.startswith("turnrouter.integrations."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "pipecat", None)
    with pytest.raises(ImportError) as info:
        importlib.import_module("turnrouter.integrations.pipecat")
    message = str(info.value)
    assert "pipecat extra" in message and "pip install -e '.[pipecat]'" in message
    assert "\n" not in message
