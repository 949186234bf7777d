"""Decision services: choose a route for a turn from the request's candidates.

`LexicalDecisions` is the embedded default (pure Python, no network, no model).
`ClassifierDecisions` asks an `LLMService` with the `route:` / `confidence:` format.
`PolicyDecisions` lets a config-driven `RoutingPolicy` (such as `DictRoutingPolicy`)
pin or override routes before falling back to another service.
"""

from ._calibration import LexicalCalibration
from ._classifier import (
    DEFAULT_CLASSIFIER_PROMPT,
    ClassifierDecisions,
    ParsedClassification,
    parse_classifier_output,
)
from ._lexical import LexicalDecisions
from ._policies import (
    DictRoutingPolicy,
    KeyGetter,
    PolicyChoice,
    PolicyDecisions,
    RoutingPolicy,
    by_participant,
    by_query_prefix,
)

__all__ = [
    "DEFAULT_CLASSIFIER_PROMPT",
    "ClassifierDecisions",
    "DictRoutingPolicy",
    "KeyGetter",
    "LexicalCalibration",
    "LexicalDecisions",
    "ParsedClassification",
    "PolicyChoice",
    "PolicyDecisions",
    "RoutingPolicy",
    "by_participant",
    "by_query_prefix",
    "parse_classifier_output",
]
