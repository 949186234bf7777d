"""Shared helpers for the operations-artefact tests."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def require_binary(name: str) -> str:
    """The binary's path; skip when missing locally, fail when missing in CI (`CI` set)."""
    path = shutil.which(name)
    if path is not None:
        return path
    if os.environ.get("CI"):
        pytest.fail(f"{name} is required in CI: install the Debian 'prometheus' and "
                    "'prometheus-alertmanager' packages (see .ci/run)")
    pytest.skip(f"{name} is not installed (apt-get install prometheus prometheus-alertmanager)")
