"""The public surface: exported names are pinned, sorted and importable."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

import turnrouter
from turnrouter import AgentRouter

CORE = {
    "CLARIFY", "Admission", "AgentExchange", "AgentRouter", "AgentTurn",
    "ConfigurationError", "ContractTypeError", "ContractValueError", "DecisionService",
    "DestinationContractError", "DestinationResult", "LLMService", "LifecycleError",
    "PolicyError", "RoutableAgent", "RouteDecision", "RouteRequest", "RouterObserver",
    "RoutingAid", "RoutingTurnContext", "TurnInterrupted", "TurnObserver", "TurnrouterError",
    "current_turn_context",
    # A destination written in one class (README, docs/quickstart.md).
    "Destination",
    # Background context patches.
    "AppliedContextPatch", "ContextPatch", "ContextState", "MergeStrategy",
    "PatchNotSavedError", "PendingContextPatch", "PendingPatchLimitError",
    "UnknownPatchError",
    "current_context_patches",
    # The front-end seam (runtimes, framework adapters).
    "Departure", "MAX_SNAPSHOT_BYTES", "MAX_SNAPSHOT_CONTAINERS", "MAX_SNAPSHOT_ITEMS",
    "ParticipantSnapshot",
    "RoutedResult",
    # docs/router.md: the turns a session remembers to refuse an earlier session's patch.
    "MAX_SESSION_TURNS",
    # docs/limits.md: the longest participant and turn id, the largest context version.
    "MAX_HISTORY_VERSION", "MAX_ID_CHARS",
    # docs/limits.md: how deep a context patch may nest, accepted and imported.
    "MAX_IMPORTED_PATCH_DEPTH", "MAX_PATCH_DEPTH",
    # docs/acknowledgments.md: the prompt an LLMService gets, and how its reply is cleaned.
    "acknowledgment_prompt", "clean_acknowledgment",
}

#: Names the contract fixes; they must never disappear.
CONTRACT = {
    "Admission", "AgentExchange", "AgentTurn", "DestinationResult", "RoutableAgent",
    "RoutingAid", "RoutingTurnContext", "AgentRouter", "current_turn_context",
    "DecisionService", "RouteRequest", "RouteDecision",
}


#: The public test kit: a fake for every seam, and real telemetry captured in memory.
TESTING = {
    "Call", "DecisionScript", "ManualClock", "OutputRecorder", "RecordingObserver",
    "ScriptedAgent", "ScriptedDecisions", "ScriptedDepartingAgent", "ScriptedLLM", "Spoken",
    "TelemetryCapture",
}


#: Names other public modules export for users (each documented in docs/): they must
#: never disappear.
PINNED = {
    # docs/distributed.md: parse a deployment's `turnrouter worker` command with it.
    "turnrouter.cli": {"demo_parser", "main", "worker_parser"},
    "turnrouter.runtime.nats": {
        # docs/distributed.md: read (and write) a participant's record in the bucket.
        "Ending", "parse_state", "state_json",
        # docs/distributed.md: the whole record, with the turns it says ended.
        "MAX_ENDED", "StateRecord", "parse_record",
        # docs/limits.md: the credentials and CA files a worker or front end reads.
        "MAX_CA_FILE_BYTES", "MAX_SECRET_FILE_BYTES",
    },
    "turnrouter.telemetry": {
        # docs/telemetry.md: the exemplar interval, and the metrics table it shows.
        "EXEMPLAR_INTERVAL_SECS", "METRICS", "metrics_markdown_table",
    },
    "turnrouter.llm": {
        # docs/acknowledgments.md: how TemplateAcknowledger names a route.
        "spoken_topic",
    },
    "turnrouter.ops": {
        # docs/operations.md: the alert thresholds and where runbook links point.
        "ACK_OVERUSE_RATIO", "CLARIFICATION_CONFIRM", "CLARIFICATION_CRITICAL",
        "CLARIFICATION_WARNING", "DEAD_AIR_SECONDS", "DECISION_SLOW_SECONDS",
        "FAILURE_RATIO", "MIN_ROUTE_TURNS", "MIN_TURNS", "MIN_TURNS_1M",
        "ROUTE_FAILURE_RATIO", "RUNBOOK_URL",
        "SLOW_FIRST_RESPONSE_SECONDS",
        # docs/operations.md: the generated and hand-written files of the demo's stack.
        "COMPOSE_RULES", "DEMO_OVERRIDES", "MAX_OVERRIDES_BYTES",
        # docs/operations.md: the acknowledgment-delay what-if model.
        "EARLY_SECS", "GENERATION_SECS", "Candidate", "candidates",
        # PromQL helpers the generated queries are checked with.
        "exposed_series_names", "le_regex", "le_value", "metric_names", "queries",
        "Selector", "grouping_labels", "selectors",
    },
    "turnrouter.decisions": {
        # docs/decisions.md: fit a calibration to your own decisions; see the phrases.
        "SIGNALS", "description_phrases", "fit_calibration",
        # docs/limits.md: the route names PolicyDecisions logs as unavailable.
        "MAX_NOTED_POLICY_ROUTES",
        "MAX_POLICY_SEQUENCE",
    },
    "turnrouter.demo": {
        # docs/operations.md: the demo's per-route latency models.
        "LATENCIES",
    },
}


@pytest.mark.parametrize("module", sorted(PINNED))
def test_documented_names_of_other_modules_are_exported(module: str) -> None:
    """Each public module still exports the names its docs page tells users to use."""
    assert set(importlib.import_module(module).__all__) >= PINNED[module]


def test_testing_kit_exports_are_pinned() -> None:
    """turnrouter.testing exports exactly the pinned kit."""
    testing = importlib.import_module("turnrouter.testing")
    assert set(testing.__all__) == TESTING


def test_core_exports_are_pinned() -> None:
    """turnrouter.__all__ holds the pinned core names (additions must be deliberate)."""
    assert set(turnrouter.__all__) >= CORE
    assert set(turnrouter.__all__) >= CONTRACT


@pytest.mark.parametrize(
    "module",
    ["turnrouter", "turnrouter.cli", "turnrouter.decisions", "turnrouter.demo",
     "turnrouter.llm", "turnrouter.ops", "turnrouter.runtime", "turnrouter.runtime.nats",
     "turnrouter.telemetry", "turnrouter.testing"],
)
def test_all_is_sorted_unique_and_importable(module: str) -> None:
    """Every public module's __all__ is sorted, has no duplicates, and resolves."""
    mod = importlib.import_module(module)
    names = list(mod.__all__)
    assert names == sorted(names, key=lambda n: (not n.isupper(), n)) or names == sorted(names)
    assert len(names) == len(set(names))
    for name in names:
        assert hasattr(mod, name), f"{module}.{name} is exported but missing"


def test_exceptions_share_one_root() -> None:
    """Every exported exception derives from TurnrouterError."""
    errors = [getattr(turnrouter, n) for n in turnrouter.__all__
              if isinstance(getattr(turnrouter, n), type)
              and issubclass(getattr(turnrouter, n), BaseException)]
    assert errors
    assert all(issubclass(e, turnrouter.TurnrouterError) for e in errors)


def test_interrupted_is_a_cancellation() -> None:
    """TurnInterrupted is both a TurnrouterError and an asyncio.CancelledError."""
    import asyncio

    assert issubclass(turnrouter.TurnInterrupted, asyncio.CancelledError)
    assert issubclass(turnrouter.TurnInterrupted, turnrouter.TurnrouterError)


def test_library_never_imports_the_otel_sdk() -> None:
    """Library modules import opentelemetry-api only; only the demo application and the
    test kit's TelemetryCapture use the SDK (lazily; see tests/telemetry/test_contract.py)."""
    from pathlib import Path

    root = Path(turnrouter.__file__).parent
    kit = root / "telemetry" / "_capture.py"
    offenders = [str(p) for p in root.rglob("*.py")
                 if "opentelemetry.sdk" in p.read_text() and "demo" not in p.parts
                 and p != kit]
    assert offenders == []


def test_router_md_shows_every_constructor_argument_in_order() -> None:
    """docs/router.md opens with AgentRouter's signature: every argument, in order
    (newcomer18 F14: acknowledgment_route_delays was missing)."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "router.md").read_text()
    shown = page.split("`AgentRouter(", 1)[1].split(")`", 1)[0]
    names = [piece.split("=")[0].strip() for piece in shown.split(",")
             if piece.strip() not in {"*", ""}]
    assert names == list(inspect.signature(AgentRouter).parameters)
