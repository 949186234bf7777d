"""The `ops` and `nats` extras stay optional: without them, one line names the extra."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

import turnrouter.ops


def test_ops_without_pyyaml_exits_with_one_line_naming_the_extra(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m turnrouter.ops` without PyYAML: exit 1, one line, nothing written."""
    monkeypatch.setitem(sys.modules, "yaml", None)
    assert turnrouter.ops.main(["--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "ops extra" in err and "pip install -e '.[ops]'" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not any(path.is_file() for path in tmp_path.rglob("*"))


def test_ops_overrides_without_pyyaml_name_the_extra(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    overrides = tmp_path / "overrides.yaml"
    overrides.write_text("routes: {}\n", encoding="utf-8")
    monkeypatch.setitem(sys.modules, "yaml", None)
    assert turnrouter.ops.main(["--root", str(tmp_path), "--overrides", str(overrides)]) == 1
    assert "ops extra" in capsys.readouterr().err


def test_nats_runtime_without_nats_py_gives_one_line_naming_the_extra(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(sys.modules):
        if name.split(".")[0] == "nats" or name.startswith("turnrouter.runtime.nats"):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "nats", None)
    with pytest.raises(ImportError) as info:
        importlib.import_module("turnrouter.runtime.nats")
    message = str(info.value)
    assert "nats extra" in message and "pip install -e '.[nats]'" in message
    assert "\n" not in message


def test_the_worker_without_nats_py_says_it_once_in_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`turnrouter worker` without nats-py: exit 2, one line naming the extra and how to
    install it, once (newcomer16: the install hint came twice)."""
    from turnrouter.cli import main

    for name in list(sys.modules):
        if name.split(".")[0] == "nats" or name.startswith("turnrouter.runtime.nats"):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "nats", None)
    assert main(["worker", "--nats", "nats://127.0.0.1:1", "--app", "x:y"]) == 2
    err = capsys.readouterr().err
    assert err == ("turnrouter worker needs the nats extra (from a checkout: "
                   "pip install -e '.[nats]'): nats is missing\n")
