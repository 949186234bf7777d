"""`turnrouter demo`: a realistic simulated deployment on the embedded defaults."""

from ._report import DemoReport, histogram_quantile
from ._run import DemoConfig, run_demo
from ._world import DESCRIPTIONS, Latency, Sample, SimulatedAgent, build_agents, load_sample

__all__ = [
    "DESCRIPTIONS",
    "DemoConfig",
    "DemoReport",
    "Latency",
    "Sample",
    "SimulatedAgent",
    "build_agents",
    "histogram_quantile",
    "load_sample",
    "run_demo",
]
