"""The applications' tracing set-up (`turnrouter demo`, `turnrouter worker`), from the
OpenTelemetry environment as the SDK documents it.

The library never configures the SDK; these two commands do, the same way:

- `OTEL_SDK_DISABLED=true`: no tracing at all;
- `OTEL_TRACES_EXPORTER`: `otlp` (default; spans go to the endpoint given by a flag or
  `OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT`, none given: no export), `console`, `none`;
  unknown values are warned about and ignored;
- `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG`: the SDK's samplers; an unknown name
  is warned about and the SDK's default (`parentbased_always_on`) is used.

No exporter, no provider: spans that are never exported would still be sampled, and the
metrics' trace exemplars would link to traces nobody can open. "exporting spans to ..."
is printed only when spans are exported (not with a sampler that samples nothing).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any, TextIO

from .._redact import redact_url

__all__ = ["EXPORTERS", "SAMPLERS", "env_tracer_provider"]

#: `OTEL_TRACES_SAMPLER` values the SDK knows.
SAMPLERS = frozenset({
    "always_on", "always_off", "traceidratio", "parentbased_always_on",
    "parentbased_always_off", "parentbased_traceidratio",
})
#: `OTEL_TRACES_EXPORTER` values handled here.
EXPORTERS = frozenset({"otlp", "console", "none"})
_OFF_SAMPLERS = frozenset({"always_off", "parentbased_always_off"})


def _env(name: str) -> str:
    return os.environ.get(name, "").strip()


#: Said when spans are asked for and the SDK is missing.
NO_SDK = "opentelemetry-sdk not installed (pip install 'turnrouter[otlp]')"


def _samples_nothing(sampler: str) -> bool:
    if sampler in _OFF_SAMPLERS:
        return True
    if sampler.endswith("traceidratio"):
        try:
            return float(_env("OTEL_TRACES_SAMPLER_ARG") or "1") <= 0
        except ValueError:
            return False
    return False


def env_tracer_provider(
    *, endpoint: str | None, protocol: str, out: TextIO,
    resource: Any, exporter: Callable[[str, str], Any],
) -> Any:
    """An SDK tracer provider as the environment asks, or None (tracing off, SDK missing,
    or nothing to export to). `endpoint`/`protocol`: the OTLP destination (flag or
    environment, resolved by the caller); `exporter(endpoint, protocol)` builds the OTLP
    exporter; notes and warnings go to `out`."""
    if _env("OTEL_SDK_DISABLED").lower() == "true":
        print("tracing: off (OTEL_SDK_DISABLED=true)", file=out)
        return None
    names = [name.strip().lower() for name in
             (_env("OTEL_TRACES_EXPORTER") or "otlp").split(",") if name.strip()]
    unknown = [name for name in names if name not in EXPORTERS]
    if unknown:
        shown = ", ".join(repr(name[:40]) for name in unknown[:5])
        print(f"tracing: warning: unknown OTEL_TRACES_EXPORTER {shown} ignored "
              f"(known: {', '.join(sorted(EXPORTERS))})", file=out)
    # Named whatever else is set: a misspelt sampler showed only once an endpoint was.
    sampler_name = _env("OTEL_TRACES_SAMPLER").lower()
    if sampler_name and sampler_name not in SAMPLERS:
        print(f"tracing: warning: unknown OTEL_TRACES_SAMPLER {sampler_name[:40]!r}; using "
              f"parentbased_always_on (known: {', '.join(sorted(SAMPLERS))})", file=out)
    if "none" in names:
        return None
    wanted = [name for name in names if name in EXPORTERS]
    exporters: list[tuple[str, Any]] = []
    if "otlp" in wanted and endpoint:
        # Shown on standard output: the endpoint may carry a password or an API key.
        exporters.append((f"{redact_url(endpoint)} ({protocol})", exporter(endpoint, protocol)))
    if "console" in wanted:
        try:
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter
        except ImportError:
            print(f"tracing: {NO_SDK}; spans off", file=out)
            return None
        exporters.append(("the console", ConsoleSpanExporter()))
    if not exporters:
        return None  # nothing would ever see the spans
    try:
        sdk_trace = importlib.import_module("opentelemetry.sdk.trace")
        export = importlib.import_module("opentelemetry.sdk.trace.export")
        sampling = importlib.import_module("opentelemetry.sdk.trace.sampling")
    except ImportError:
        print(f"tracing: {NO_SDK}; spans off", file=out)
        return None
    kwargs: dict[str, Any] = {"resource": resource}
    if sampler_name and sampler_name not in SAMPLERS:
        kwargs["sampler"] = sampling.ParentBased(sampling.ALWAYS_ON)
        sampler_name = "parentbased_always_on"
    provider = sdk_trace.TracerProvider(**kwargs)
    for where, span_exporter in exporters:
        provider.add_span_processor(export.BatchSpanProcessor(span_exporter))
        if not _samples_nothing(sampler_name):
            print(f"tracing: exporting spans to {where}", file=out)
    return provider
