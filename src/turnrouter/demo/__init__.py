"""`turnrouter demo`: a realistic simulated deployment on the embedded defaults."""

from ._report import DemoReport, histogram_quantile
from ._run import (
    DEFAULT_ACK_DELAY,
    OTLP_PROTOCOLS,
    DemoConfig,
    demo_resource,
    demo_tracer_provider,
    install_env_tracing,
    otlp_settings,
    run_demo,
)
from ._tracing import env_tracer_provider
from ._world import (
    DESCRIPTIONS,
    LATENCIES,
    Latency,
    Sample,
    SimulatedAgent,
    build_agents,
    load_sample,
)

__all__ = [
    "DEFAULT_ACK_DELAY",
    "DESCRIPTIONS",
    "LATENCIES",
    "OTLP_PROTOCOLS",
    "DemoConfig",
    "DemoReport",
    "Latency",
    "Sample",
    "SimulatedAgent",
    "build_agents",
    "demo_resource",
    "demo_tracer_provider",
    "env_tracer_provider",
    "histogram_quantile",
    "install_env_tracing",
    "load_sample",
    "otlp_settings",
    "run_demo",
]
