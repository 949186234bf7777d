"""Shared fixtures: every async test runs on asyncio through anyio's pytest plugin.

Property tests explore new random inputs on every developer run; under CI (`CI` set)
they are derandomized, so a landing is judged on the same inputs as its last local
run would be reproducible from, rather than on a lucky or unlucky draw.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture
def anyio_backend() -> str:
    """turnrouter targets asyncio (TurnInterrupted is an asyncio.CancelledError)."""
    return "asyncio"
