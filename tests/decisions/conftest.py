"""Shared fixtures for the decision-service tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    """Run the anyio-marked tests on asyncio only."""
    return "asyncio"
