"""pytest fixtures of the `turnrouter.testing` kit.

pytest loads this plugin by itself wherever turnrouter is installed (the `pytest11` entry
point, as anyio does), so a test only names the fixture:

```python
@pytest.mark.anyio  # an async test needs a runner: anyio's plugin comes with turnrouter
async def test_weather_is_traced(turnrouter_telemetry):
    router = AgentRouter(agents, decisions, output=speak,
                         telemetry=turnrouter_telemetry.telemetry)
    ...
```

(docs/telemetry.md, "Testing with real telemetry", has the whole file.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # imported by the fixture, so loading the plugin imports no turnrouter code
    from .testing import TelemetryCapture

__all__ = ["turnrouter_telemetry"]


@pytest.fixture
def turnrouter_telemetry() -> Iterator[TelemetryCapture]:
    """Real turnrouter spans and metrics, recorded in memory; fresh for each test."""
    from .testing import TelemetryCapture

    with TelemetryCapture() as capture:
        yield capture
