"""Decision services: choose a route for a turn from the request's candidates.

`LexicalDecisions` is the embedded default (pure Python, no network, no model).
`ClassifierDecisions` asks an `LLMService` with the `route:` / `confidence:` format.
`PolicyDecisions` lets a config-driven `RoutingPolicy` (such as `DictRoutingPolicy`)
pin or override routes before falling back to another service.

`fit_calibration` fits a `LexicalCalibration` (weights over `SIGNALS`) to your own
held-out decisions; `description_phrases` shows how a description is split into the
phrases `LexicalDecisions` scores.
"""

from ._calibration import SIGNALS, LexicalCalibration, fit_calibration
from ._classifier import (
    DEFAULT_CLASSIFIER_PROMPT,
    ClassifierDecisions,
    ParsedClassification,
    parse_classifier_output,
)
from ._lexical import LexicalDecisions
from ._policies import (
    MAX_NOTED_POLICY_ROUTES,
    MAX_POLICY_SEQUENCE,
    DictRoutingPolicy,
    KeyGetter,
    PolicyChoice,
    PolicyDecisions,
    RoutingPolicy,
    by_participant,
    by_query_prefix,
)
from ._text import description_phrases

__all__ = [
    "DEFAULT_CLASSIFIER_PROMPT",
    "MAX_NOTED_POLICY_ROUTES",
    "MAX_POLICY_SEQUENCE",
    "SIGNALS",
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
    "description_phrases",
    "fit_calibration",
    "parse_classifier_output",
]
