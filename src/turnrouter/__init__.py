"""turnrouter: route each user turn of a realtime assistant to one destination agent.

Admission before speech, explicit focus, acknowledgments at a predicted moment, and
telemetry (OpenTelemetry spans, Prometheus metrics) for every step.
"""

from ._acknowledgment import (
    Acknowledger,
    AcknowledgmentPolicy,
    AcknowledgmentRequest,
    acknowledgment_prompt,
    clean_acknowledgment,
)
from ._clock import Clock, SystemClock
from ._context import RoutingTurnContext, current_turn_context
from ._contracts import (
    CLARIFY,
    MAX_HISTORY_VERSION,
    MAX_ID_CHARS,
    Admission,
    AgentExchange,
    AgentTurn,
    DecisionService,
    DestinationResult,
    RoutableAgent,
    RouteDecision,
    RouteRequest,
    RoutingAid,
)
from ._destination import Destination
from ._exceptions import (
    ConfigurationError,
    ContractTypeError,
    ContractValueError,
    DestinationContractError,
    LifecycleError,
    LLMError,
    PatchNotSavedError,
    PendingPatchLimitError,
    PolicyError,
    RouterBusyError,
    TurnInterrupted,
    TurnrouterError,
    UnknownPatchError,
)
from ._frontend import (
    MAX_SESSION_TURNS,
    MAX_SNAPSHOT_BYTES,
    MAX_SNAPSHOT_CONTAINERS,
    MAX_SNAPSHOT_ITEMS,
    Departure,
    ParticipantSnapshot,
    RoutedResult,
)
from ._llm import LLMService
from ._load import OverloadPolicy, RouterLoad
from ._observer import RouterObserver, TurnObserver
from ._patches import (
    MAX_IMPORTED_PATCH_DEPTH,
    MAX_PATCH_DEPTH,
    AppliedContextPatch,
    ContextPatch,
    ContextState,
    MergeStrategy,
    PendingContextPatch,
    current_context_patches,
)
from ._router import AgentRouter
from ._timing import (
    JsonLinesSink,
    LLMTimingPredictor,
    Prediction,
    RouteTimingPredictor,
    TimingPredictor,
    TimingSample,
    TimingSink,
    load_samples,
    query_length_class,
)

__all__ = [
    "CLARIFY",
    "MAX_HISTORY_VERSION",
    "MAX_ID_CHARS",
    "MAX_IMPORTED_PATCH_DEPTH",
    "MAX_PATCH_DEPTH",
    "MAX_SESSION_TURNS",
    "MAX_SNAPSHOT_BYTES",
    "MAX_SNAPSHOT_CONTAINERS",
    "MAX_SNAPSHOT_ITEMS",
    "Acknowledger",
    "AcknowledgmentPolicy",
    "AcknowledgmentRequest",
    "Admission",
    "AgentExchange",
    "AgentRouter",
    "AgentTurn",
    "AppliedContextPatch",
    "Clock",
    "ConfigurationError",
    "ContextPatch",
    "ContextState",
    "ContractTypeError",
    "ContractValueError",
    "DecisionService",
    "Departure",
    "Destination",
    "DestinationContractError",
    "DestinationResult",
    "JsonLinesSink",
    "LLMError",
    "LLMService",
    "LLMTimingPredictor",
    "LifecycleError",
    "MergeStrategy",
    "OverloadPolicy",
    "ParticipantSnapshot",
    "PatchNotSavedError",
    "PendingContextPatch",
    "PendingPatchLimitError",
    "PolicyError",
    "Prediction",
    "RoutableAgent",
    "RouteDecision",
    "RouteRequest",
    "RouteTimingPredictor",
    "RoutedResult",
    "RouterBusyError",
    "RouterLoad",
    "RouterObserver",
    "RoutingAid",
    "RoutingTurnContext",
    "SystemClock",
    "TimingPredictor",
    "TimingSample",
    "TimingSink",
    "TurnInterrupted",
    "TurnObserver",
    "TurnrouterError",
    "UnknownPatchError",
    "acknowledgment_prompt",
    "clean_acknowledgment",
    "current_context_patches",
    "current_turn_context",
    "load_samples",
    "query_length_class",
]

__version__ = "0.1.0"
