"""Shared fixtures: every async test runs on asyncio through anyio's pytest plugin."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    """turnrouter targets asyncio (TurnInterrupted is an asyncio.CancelledError)."""
    return "asyncio"
