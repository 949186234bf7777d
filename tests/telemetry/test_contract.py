"""The telemetry contract: metric names, types, labels and buckets; docs; API hygiene."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

import turnrouter.telemetry as telemetry_pkg
from turnrouter.telemetry import (
    ATTR,
    FAST_BUCKETS,
    LATENCY_BUCKETS,
    METRICS,
    RESPONSE_BUCKETS,
    Telemetry,
    metric,
    metrics_markdown_table,
)

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "telemetry.md"

# Typed from the design contract (telemetry.md); change only with a migration note.
CONTRACT: dict[str, tuple[str, tuple[str, ...]]] = {
    "turnrouter_turns_total": ("counter", ("route", "outcome")),
    "turnrouter_clarifications_total": ("counter", ("reason",)),
    "turnrouter_admissions_total": ("counter", ("route", "disposition", "focused")),
    "turnrouter_reroutes_total": ("counter", ("route",)),
    "turnrouter_default_fallbacks_total": ("counter", ("route",)),
    "turnrouter_failures_total": ("counter", ("route", "stage")),
    "turnrouter_interruptions_total": ("counter", ()),
    "turnrouter_focus_transitions_total": ("counter", ("route", "transition")),
    "turnrouter_turn_duration_seconds": ("histogram", ("route", "outcome")),
    "turnrouter_decision_duration_seconds": ("histogram", ()),
    "turnrouter_admission_duration_seconds": ("histogram", ("route",)),
    "turnrouter_first_response_seconds": ("histogram", ("route",)),
    # Censored first responses, counted by tune and the tuning dashboard (issue 31).
    "turnrouter_first_response_interrupted_seconds": ("histogram", ("route",)),
    "turnrouter_silence_seconds": ("histogram", ("route",)),
    "turnrouter_acknowledgments_total": ("counter", ("route", "outcome", "trigger")),
    "turnrouter_acknowledgment_delay_seconds": ("gauge", ()),
    "turnrouter_acknowledgment_route_delay_seconds": ("gauge", ("route",)),
    "turnrouter_predicted_first_response_seconds": ("gauge", ("route",)),
    "turnrouter_context_patches_total": ("counter", ("strategy", "outcome")),
    # Beyond telemetry.md: the runtime subscriber counts the messages it rejects.
    "turnrouter_runtime_rejected_messages_total": ("counter", ("topic", "reason")),
    "turnrouter_limit_overflows_total": ("counter", ("limit",)),
    "turnrouter_ineligible_routes_total": ("counter", ("route", "reason")),
    "turnrouter_needless_acknowledgments_total": ("counter", ("route", "trigger")),
    "turnrouter_acknowledgment_generation_seconds": ("histogram", ("route",)),
    "turnrouter_active_participants": ("gauge", ()),
    "turnrouter_turns_in_flight": ("gauge", ()),
    # Saturation and admission control (issue 33).
    "turnrouter_event_loop_lag_seconds": ("histogram", ()),
    "turnrouter_turn_wait_seconds": ("gauge", ()),
    "turnrouter_overload_state": ("gauge", ()),
    "turnrouter_shed_turns_total": ("counter", ("reason",)),
    "turnrouter_window_participants": ("gauge", ()),
    "turnrouter_window_clarified_participants": ("gauge", ()),
}
CONTRACT_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10)
#: Buckets chosen for what each histogram measures (issue 16): sub-millisecond steps for
#: decisions and admissions, fine steps across acknowledgment delays for the others.
BUCKETS_BY_FAMILY = {
    "turnrouter_turn_duration_seconds": LATENCY_BUCKETS,
    "turnrouter_decision_duration_seconds": FAST_BUCKETS,
    "turnrouter_admission_duration_seconds": FAST_BUCKETS,
    "turnrouter_first_response_seconds": RESPONSE_BUCKETS,
    "turnrouter_first_response_interrupted_seconds": RESPONSE_BUCKETS,
    "turnrouter_silence_seconds": RESPONSE_BUCKETS,
    # A template acknowledger answers in microseconds, an LLM in hundreds of ms.
    "turnrouter_acknowledgment_generation_seconds": FAST_BUCKETS,
    "turnrouter_event_loop_lag_seconds": FAST_BUCKETS,
}


def test_definitions_match_the_contract() -> None:
    """METRICS defines exactly the contract's families, types, labels and buckets."""
    assert {spec.name: (spec.type, spec.labels) for spec in METRICS} == CONTRACT
    assert LATENCY_BUCKETS == CONTRACT_BUCKETS
    for spec in METRICS:
        expected = BUCKETS_BY_FAMILY.get(spec.name)
        assert spec.buckets == expected, spec.name
        if spec.buckets:  # the contract's bounds are all there, up to 10 s (traces11)
            assert set(CONTRACT_BUCKETS) <= set(spec.buckets), spec.name
        assert spec.documentation
        assert (spec.type == "counter") == spec.name.endswith("_total"), spec.name
        assert metric(spec.name) is spec


def test_registered_families_match_the_contract() -> None:
    """A registry exposes each family under its exact name, type and labels."""
    registry = CollectorRegistry()
    Telemetry(registry=registry)
    exposed = generate_latest(registry).decode()
    types = dict(re.findall(r"^# TYPE (turnrouter_\w+) (\w+)$", exposed, re.MULTILINE))
    types = {name: kind for name, kind in types.items() if not name.endswith("_created")}
    assert types == {name: kind for name, (kind, _) in CONTRACT.items()}
    by_name = {family.name: family for family in registry.collect()}
    for name, (kind, labels) in CONTRACT.items():
        family = by_name[name.removesuffix("_total") if kind == "counter" else name]
        assert family.type == kind
        assert metric(name).labels == labels
        if kind == "histogram":
            bounds = [sample.labels["le"] for sample in family.samples
                      if sample.name.endswith("_bucket")]
            if bounds:  # labelled histograms have no samples before first use
                assert bounds == [*map(repr, map(float, BUCKETS_BY_FAMILY[name])), "+Inf"]


def _docs_metrics() -> dict[str, tuple[str, tuple[str, ...], tuple[float, ...] | None]]:
    rows: dict[str, tuple[str, tuple[str, ...], tuple[float, ...] | None]] = {}
    for line in DOCS.read_text().splitlines():
        match = re.match(r"^\| `(turnrouter_\w+)` \| (\w+) \| ([^|]+) \| ([^|]+) \|", line)
        if match is None:
            continue
        name, kind, labels, buckets = (part.strip() for part in match.groups())
        label_tuple = () if labels == "—" else tuple(label.strip() for label in labels.split(","))
        bucket_tuple = None if buckets == "—" else tuple(map(float, buckets.split()))
        assert name not in rows, f"{name} listed twice"
        rows[name] = (kind, label_tuple, bucket_tuple)
    return rows


def test_docs_metrics_table_matches_definitions() -> None:
    """docs/telemetry.md lists exactly the defined metrics, with their labels and buckets."""
    documented = _docs_metrics()
    defined = {spec.name: (spec.type, spec.labels, spec.buckets) for spec in METRICS}
    assert documented == defined
    assert metrics_markdown_table() in DOCS.read_text()


def test_docs_name_every_span_and_attribute() -> None:
    """Every span name and attribute key in the code is documented."""
    text = DOCS.read_text()
    keys = [value for name, value in vars(ATTR).items() if name.isupper()]
    spans = [getattr(telemetry_pkg, name) for name in telemetry_pkg.__all__
             if name.startswith("SPAN_") or name.startswith("EVENT_")]
    for key in [*keys, *spans, "turnrouter.decision.scores.<route>", "invoke_agent {route}",
                telemetry_pkg.TRACER_NAME, telemetry_pkg.CONTENT_CAPTURE_ENV]:
        assert f"`{key.strip()}" in text, key


def test_public_all_is_sorted_and_complete() -> None:
    """turnrouter.telemetry exports a sorted __all__ whose names all exist."""
    exported = telemetry_pkg.__all__
    assert exported == sorted(exported, key=lambda name: (
        0 if name.isupper() else 1 if name[0].isupper() else 2, name))
    for name in exported:
        assert hasattr(telemetry_pkg, name)


def test_library_imports_only_the_opentelemetry_api() -> None:
    """No library module imports the OpenTelemetry SDK or sets a global provider (the
    applications' set-up in demo/_run.py does, for `turnrouter worker`).

    The demo is an application and `TelemetryCapture` a test kit: they may build their
    own SDK provider, but only lazily (inside a function, guarded by ImportError, or for
    type checking), so importing turnrouter or turnrouter.testing never needs the SDK.
    """
    package = ROOT / "src" / "turnrouter"
    for path in package.rglob("*.py"):
        source = path.read_text()
        relative = path.relative_to(package)
        # The applications' tracing set-up (demo/_run.py: install_env_tracing) installs
        # the global provider for `turnrouter worker`, whose routers follow it; nothing
        # else may.
        if relative != Path("demo/_run.py"):
            assert "set_tracer_provider(" not in source, path
        tree = ast.parse(source)
        uses_sdk = relative.parts[0] == "demo" or relative == Path("telemetry/_capture.py")
        lazy: set[ast.AST] = set()
        if uses_sdk:
            for block in ast.walk(tree):
                if isinstance(block, ast.FunctionDef | ast.AsyncFunctionDef) or (
                    isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
                ):
                    lazy.update(ast.walk(block))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert not name.startswith("opentelemetry.sdk") or node in lazy, (path, name)


def _documented_values(bullet: str) -> list[list[str]]:
    """The comma-separated value lists of one `Label values` bullet (split at ` / `)."""
    text = DOCS.read_text()
    start = text.index(f"- {bullet}:")
    line = " ".join(text[start:].split("\n- ")[0].split())
    values = line.split(":", 1)[1].split(".")[0]
    return [[value.strip() for value in part.split(",")] for part in values.split(" / ")]


def test_docs_label_values_match_the_code() -> None:
    """The label values docs/telemetry.md lists are exactly the code's Literal values."""
    from typing import get_args

    from turnrouter import MergeStrategy
    from turnrouter.events import (
        AcknowledgmentOutcome,
        AcknowledgmentTrigger,
        ClarificationReason,
        FailureStage,
        FocusTransition,
        PatchOutcome,
        ReleaseReason,
        TurnOutcome,
    )

    assert _documented_values("`outcome` (turns)") == [list(get_args(TurnOutcome))]
    assert _documented_values("`reason` (clarifications)") == [
        list(get_args(ClarificationReason))]
    assert _documented_values("`stage` (failures)") == [list(get_args(FailureStage))]
    assert _documented_values("`transition` (focus)") == [list(get_args(FocusTransition))]
    assert _documented_values("`outcome` / `trigger` (acknowledgments)") == [
        list(get_args(AcknowledgmentOutcome)), list(get_args(AcknowledgmentTrigger))]
    strategies, outcomes = DOCS.read_text().split("- `strategy` / `outcome` (context "
                                                  "patches): ")[1].split(" / ", 1)
    assert strategies.split(", ") == [strategy.value for strategy in MergeStrategy]
    bullet = outcomes.split("\n\n")[0]
    assert [value for value in get_args(PatchOutcome) if f"`{value}`" not in bullet] == []
    span_row = next(line for line in DOCS.read_text().splitlines()
                    if line.startswith("| `turnrouter.release` |"))
    reasons = span_row.split("`turnrouter.release.reason` (")[1].split(")")[0]
    assert reasons.split(", ") == list(get_args(ReleaseReason))


@pytest.mark.parametrize("module", ["_telemetry.py", "_turns.py", "_families.py"])
def test_telemetry_names_come_from_the_constants(module: str) -> None:
    """The telemetry modules spell no span, event or attribute name themselves: each is
    an ATTR / SPAN_* / EVENT_* constant, which the docs test above checks."""
    path = ROOT / "src" / "turnrouter" / "telemetry" / module
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef
                                | ast.AsyncFunctionDef)
                  and node.body and isinstance(node.body[0], ast.Expr)}
    spelled = [node.value for node in ast.walk(tree)
               if isinstance(node, ast.Constant) and isinstance(node.value, str)
               and id(node) not in docstrings
               and node.value.startswith(("turnrouter.", "gen_ai.", "invoke_agent "))]
    assert spelled == []
