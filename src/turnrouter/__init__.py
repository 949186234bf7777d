"""turnrouter: route each user turn of a realtime assistant to one destination agent.

Admission before speech, explicit focus, acknowledgments at a predicted moment, and
telemetry (OpenTelemetry spans, Prometheus metrics) for every step.
"""

from ._context import RoutingTurnContext, current_turn_context
from ._contracts import (
    CLARIFY,
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
from ._exceptions import (
    ConfigurationError,
    ContractTypeError,
    ContractValueError,
    DestinationContractError,
    LifecycleError,
    PolicyError,
    TurnInterrupted,
    TurnrouterError,
)
from ._llm import LLMService
from ._observer import RouterObserver, TurnObserver
from ._router import AgentRouter

__all__ = [
    "CLARIFY",
    "Admission",
    "AgentExchange",
    "AgentRouter",
    "AgentTurn",
    "ConfigurationError",
    "ContractTypeError",
    "ContractValueError",
    "DecisionService",
    "DestinationContractError",
    "DestinationResult",
    "LLMService",
    "LifecycleError",
    "PolicyError",
    "RoutableAgent",
    "RouteDecision",
    "RouteRequest",
    "RouterObserver",
    "RoutingAid",
    "RoutingTurnContext",
    "TurnInterrupted",
    "TurnObserver",
    "TurnrouterError",
    "current_turn_context",
]

__version__ = "0.1.0"
