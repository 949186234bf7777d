"""`LexicalDecisions`: the embedded default decision service (pure Python, no model).

A query is turned into a sparse TF-IDF vector of stemmed word unigrams, word bigrams and
character n-grams taken inside word boundaries (`_text.py`). With example utterances,
routes are ranked by a linear model trained on the examples at construction (an averaged
perceptron) and by their nearest examples (`_examples.py`). Without examples, a route is
scored from its name and description, whole text and best-matching phrase
(`_descriptions.py`). The raw signals are mapped to a calibrated `confidence`
(probability that the choice is right, see `_calibration.py`); "clarify" is answered
when it is below the floor.

Everything expensive is done once: example models at construction, description models
once per distinct set of candidate descriptions (a small LRU cache). The work per
decision is bounded: the query is cut to `max_query_chars` characters and
`max_query_words` words, each word to `MAX_WORD` characters, and the nearest-example
walk to `knn_budget` hits.
"""

from __future__ import annotations

import math
import operator
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from .._contracts import CLARIFY, RouteDecision, RouteRequest, RoutingAid, _unchecked
from .._exceptions import ConfigurationError, ContractTypeError
from ._calibration import LexicalCalibration
from ._descriptions import DescriptionModel, WordCache, build_descriptions
from ._examples import ExampleModel, build_examples
from ._text import STOPWORDS, description_phrases, words

__all__ = ["LexicalDecisions"]

# Calibrations fitted by `benchmarks/sweep_decisions.py` on CLINC150 train + oos_train
# (never on the validation split); signals in `_calibration.SIGNALS` order. The floors
# are also what makes a score usable: under them a "clarify" carries no scores.
DEFAULT_EXAMPLE_CALIBRATION = LexicalCalibration(
    (6.2543, 3.2141, 0.0, 0.0, 3.0742), -7.0441)
DEFAULT_FEW_SHOT_CALIBRATION = LexicalCalibration(
    (4.1552, 3.4151, 2.8291, 4.9809, 1.9196), -3.7504)
"""Few-shot with `descriptions=` (their phrases train the example model)."""
DEFAULT_FEW_SHOT_PLAIN_CALIBRATION = LexicalCalibration(
    (3.1696, 3.2847, 3.0578, 4.6253, 1.7879), -2.4381)
"""Few-shot without `descriptions=`: fitted on apps of 3, 5 and 10 routes with 5 or 10
examples each and routing aids described in no words, one-liners or keyword lists
(`sweep_decisions.py --modes small-apps`), what an application written from the
quickstart looks like."""
DEFAULT_DESCRIPTION_CALIBRATION = LexicalCalibration((0.0, 0.0, 7.7941, 4.7411, 0.0), -2.0705)
"""Descriptions only: fitted leave-one-style-out over five description sets written in
different styles (`benchmarks/description_styles.py`), so it does not depend on one way
of writing descriptions."""
# Floors maximising the balanced score on the same tuning data, per regime.
DEFAULT_EXAMPLE_FLOOR = 0.45
DEFAULT_FEW_SHOT_FLOOR = 0.4
DEFAULT_FEW_SHOT_PLAIN_FLOOR = 0.325
DEFAULT_DESCRIPTION_FLOOR = 0.35
DEFAULT_EXAMPLE_USABLE = 0.15
"""With 50 or more examples per route, a query sharing no feature with any route scores
about 0.11 (the calibration's bias): between this and the floor a route is asked, under
it the query is out of scope. Smaller example sets and descriptions score unrelated
chit-chat up to ~0.3, so there the usable floor is the confidence floor itself."""
# Routes given the neighbour signal (the best by linear score; None: every route).
DEFAULT_EXAMPLE_KNN_ROUTES: int | None = 1
DEFAULT_FEW_SHOT_KNN_ROUTES: int | None = None
FEW_SHOT_BELOW = 50
"""Example sets averaging fewer examples per route use the few-shot calibration."""

Signals = tuple[float, float, float, float, float]
"""One candidate's raw signals, in `SIGNALS` order."""
_NO_SCORES: list[float] = []


@dataclass(frozen=True, slots=True)
class _Plan:
    """What scoring one candidate set needs (cached per distinct set)."""

    rows: tuple[tuple[str, int | None, tuple[int, int]], ...]
    """Per candidate: name, example-model route (None: scored from its description),
    tie-break key (priority, minus position)."""
    wanted: tuple[int, ...]
    """The example-model routes among the candidates."""
    described: tuple[int, ...]
    """Positions of the candidates scored from their descriptions."""
    descriptions: DescriptionModel | None
    vocabulary: frozenset[str]
    """Words of the described candidates' names and descriptions (for `coverage`)."""


_EMPTY_PLAN = _Plan((), (), (), None, frozenset())


def _check_unit(name: str, value: object) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ConfigurationError(f"{name} must be a float in [0, 1], got {value!r}")
    if not 0.0 <= value <= 1.0:
        raise ConfigurationError(f"{name} must be within [0, 1], got {value!r}")
    return float(value)


def _check_positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigurationError(f"{name} must be a positive int, got {value!r}")
    return value


def _check_calibration(name: str, value: object, default: LexicalCalibration
                       ) -> LexicalCalibration:
    if value is None:
        return default
    if not isinstance(value, LexicalCalibration):
        raise ConfigurationError(
            f"{name} must be a LexicalCalibration or None, got {type(value).__name__}"
        )
    return value


def _description_texts(descriptions: object) -> dict[str, list[str]]:
    """The phrases of each route's description (validated), trained on as examples."""
    if descriptions is None:
        return {}
    if not isinstance(descriptions, Mapping):
        raise ConfigurationError(
            f"descriptions must be a mapping of route name to description, got "
            f"{type(descriptions).__name__}")
    out: dict[str, list[str]] = {}
    for route, text in descriptions.items():
        if not isinstance(route, str) or not route:
            raise ConfigurationError(f"descriptions keys must be route names, got {route!r:.60}")
        if not isinstance(text, str):
            raise ConfigurationError(
                f"descriptions[{route!r:.60}] must be a str, got {type(text).__name__}")
        out[route] = description_phrases(route, text)
    return out


def _check_ngrams(value: object) -> tuple[int, int]:
    if (
        not isinstance(value, tuple)
        or len(value) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) for n in value)
        or not 1 <= value[0] <= value[1]
    ):
        raise ConfigurationError(
            f"char_ngrams must be (low, high) ints with 1 <= low <= high, got {value!r}"
        )
    return value[0], value[1]


class LexicalDecisions:
    """Embedded default decision service: lexical similarity, no network, no model.

    `examples` maps a route name to example utterances; routes without examples (and
    every route when `examples` is None) are scored from their routing aid's name and
    description. Every candidate's score is a calibrated confidence in [0, 1] (the
    probability that choosing it is right, fitted with equal weight on in-scope and
    out-of-scope traffic); the best candidate is chosen unless its score is below
    `min_example_score` (a route with examples) / `min_description_score` (a route
    scored from its description) or leads the runner-up by less than `min_margin`.

    Under the floor but at or above `min_usable_score`, the answer is "clarify" with the
    usable scores: the router asks the best of them, whose admission decides (the
    contract's clarify-with-scores). Under the usable floor (a near-zero match such as
    "hi there") the answer is `fallback_route` when it is a candidate, else "clarify"
    with no scores, so a router never sends it to a domain route. A "clarify" for a
    small margin keeps the close candidates' usable scores. Exact ties go to
    the higher `RoutingAid.priority`, then to the earlier candidate. See
    docs/decisions.md.

    Args:
        examples: route name -> example utterances (None: every route is scored from
            its routing aid's name and description).
        fallback_route: the route chosen when the best score is under its floor (as
            `ClassifierDecisions(fallback_route=...)`); usually the router's
            `default_destination`. None, or not a candidate: "clarify".
        min_example_score: the confidence floor of routes with examples (None: the
            default of the regime, few-shot or not).
        min_description_score: the confidence floor of routes scored from their
            descriptions (also their usable floor).
        min_usable_score: the least score of a route with examples that the router may
            still ask when the best is under `min_example_score` (None: the regime's
            default, 0.15 with 50 or more examples per route, else the confidence
            floor; never above the confidence floor).
        min_margin: the least lead over the runner-up for a choice (0: none).
        descriptions: route name -> description; its phrases are trained on as extra
            examples of routes that have examples (pass the routing aids' text).
        phrase_weight: the share of a description score that comes from the route's
            best-matching phrase rather than its whole description.
        neighbors: how many nearest examples a route's neighbour signal averages.
        knn_routes: how many routes (best by the linear score) get the neighbour signal
            (None: 1 with 50 or more examples per route, else every route).
        max_document_frequency: features found in more than this share of the
            examples (and in more than 30) are left out of the nearest-example index.
        char_ngrams: (low, high) lengths of the character n-grams taken inside words.
        description_cache_size: scoring plans and description models kept (LRU), one
            per distinct candidate set.
        epochs: training passes of the averaged perceptron over the examples.
        example_calibration: the calibration of routes with 50 or more examples each
            (None: the fitted default).
        few_shot_calibration: the calibration of smaller example sets (None: the
            fitted default, with or without `descriptions=`).
        description_calibration: the calibration of routes scored from their
            descriptions (None: the fitted default).
        max_query_chars: characters of a query read (the rest is ignored).
        max_query_words: words of a query scored.
        knn_budget: nearest-example hits walked per query.
    """

    def __init__(
        self,
        examples: Mapping[str, Sequence[str]] | None = None,
        *,
        fallback_route: str | None = None,
        descriptions: Mapping[str, str] | None = None,
        min_example_score: float | None = None,
        min_description_score: float = DEFAULT_DESCRIPTION_FLOOR,
        min_usable_score: float | None = None,
        min_margin: float = 0.0,
        phrase_weight: float = 0.3,
        neighbors: int = 3,
        knn_routes: int | None = None,
        max_document_frequency: float = 0.002,
        char_ngrams: tuple[int, int] = (4, 4),
        description_cache_size: int = 256,
        epochs: int = 4,
        example_calibration: LexicalCalibration | None = None,
        few_shot_calibration: LexicalCalibration | None = None,
        description_calibration: LexicalCalibration | None = None,
        max_query_chars: int = 1000,
        max_query_words: int = 64,
        knn_budget: int = 400,
    ) -> None:
        explicit_floor = (None if min_example_score is None
                          else _check_unit("min_example_score", min_example_score))
        calibration = _check_calibration("example_calibration", example_calibration,
                                         DEFAULT_EXAMPLE_CALIBRATION)
        few_shot = _check_calibration("few_shot_calibration", few_shot_calibration,
                                      DEFAULT_FEW_SHOT_CALIBRATION)
        explicit_few_shot = few_shot_calibration is not None
        self._min_description_score = _check_unit("min_description_score",
                                                  min_description_score)
        self._min_margin = _check_unit("min_margin", min_margin)
        if fallback_route is not None and (not isinstance(fallback_route, str)
                                           or not fallback_route):
            raise ConfigurationError(
                f"fallback_route must be a non-empty route name or None, got "
                f"{fallback_route!r:.60}")
        self._fallback = fallback_route
        self._phrase_weight = _check_unit("phrase_weight", phrase_weight)
        self._neighbors = _check_positive_int("neighbors", neighbors)
        explicit_routes = (None if knn_routes is None
                           else _check_positive_int("knn_routes", knn_routes))
        max_df = _check_unit("max_document_frequency", max_document_frequency)
        epochs = _check_positive_int("epochs", epochs)
        self._knn_budget = _check_positive_int("knn_budget", knn_budget)
        self._max_chars = _check_positive_int("max_query_chars", max_query_chars)
        self._max_words = _check_positive_int("max_query_words", max_query_words)
        self._ngrams = _check_ngrams(char_ngrams)
        self._cache_size = _check_positive_int("description_cache_size",
                                               description_cache_size)
        self._description_calibration = _check_calibration(
            "description_calibration", description_calibration,
            DEFAULT_DESCRIPTION_CALIBRATION)
        self._plans: OrderedDict[tuple[tuple[str, str, int], ...], _Plan] = OrderedDict()
        self._descriptions: OrderedDict[tuple[tuple[str, str], ...], DescriptionModel] = (
            OrderedDict())
        self._description_evictions = 0
        self._description_words = WordCache()
        self._last: tuple[tuple[RoutingAid, ...], _Plan] = ((), _EMPTY_PLAN)
        self._plan_evictions = 0
        limits = (self._max_chars, self._max_words, *self._ngrams)
        extra = _description_texts(descriptions)
        self._examples: ExampleModel | None = (
            build_examples(examples, limits, max_df, epochs, extra) if examples else None)
        floor, routes = DEFAULT_EXAMPLE_FLOOR, DEFAULT_EXAMPLE_KNN_ROUTES
        if self._examples is not None and self._examples.per_route < FEW_SHOT_BELOW:
            calibration, floor = few_shot, DEFAULT_FEW_SHOT_FLOOR
            if not self._examples.described:
                # Fitted without description phrases: the other default applies.
                floor = DEFAULT_FEW_SHOT_PLAIN_FLOOR
                if not explicit_few_shot:
                    calibration = DEFAULT_FEW_SHOT_PLAIN_CALIBRATION
            routes = DEFAULT_FEW_SHOT_KNN_ROUTES
        self._example_calibration = calibration
        self._knn_routes = routes if explicit_routes is None else explicit_routes
        self._min_example_score = floor if explicit_floor is None else explicit_floor
        few_shot_regime = (self._examples is not None
                           and self._examples.per_route < FEW_SHOT_BELOW)
        usable = self._min_example_score if few_shot_regime else DEFAULT_EXAMPLE_USABLE
        if min_usable_score is not None:
            usable = _check_unit("min_usable_score", min_usable_score)
        self._min_usable_score = min(usable, self._min_example_score)

    @property
    def min_example_score(self) -> float:
        """Confidence floor for choosing a route scored from its examples."""
        return self._min_example_score

    @property
    def example_routes(self) -> tuple[str, ...]:
        """The routes given examples, in order (an `AgentRouter` warns of one it does not
        have: a key's typo silently left that route without its examples)."""
        return () if self._examples is None else self._examples.routes

    @property
    def fallback_route(self) -> str | None:
        """The route chosen when the best score is under its floor (None: clarify)."""
        return self._fallback

    @property
    def min_usable_score(self) -> float:
        """Least score of a route with examples that may still be asked under the floor."""
        return self._min_usable_score

    @property
    def min_description_score(self) -> float:
        """Confidence floor for choosing a route scored from its description."""
        return self._min_description_score

    @property
    def example_calibration(self) -> LexicalCalibration:
        """The calibration of example-backed routes (few-shot for small example sets)."""
        return self._example_calibration

    @property
    def description_calibration(self) -> LexicalCalibration:
        """The calibration of routes scored from their name and description."""
        return self._description_calibration

    def cache_stats(self) -> dict[str, int]:
        """Sizes and eviction counts of the per-service caches (all bounded).

        `candidate_sets` (scoring plans, at most `description_cache_size`),
        `description_models` (one per distinct set of description-scored candidates, at
        most `description_cache_size`), `description_words` (query words' summed
        n-gram parts per description model, at most 4,096 in all), `query_words` (at
        most 4,096 words not seen in the examples) and `query_word_hits` (their
        nearest-example hits per route, at most 4,096).
        """
        model = self._examples
        return {
            "candidate_sets": len(self._plans),
            "candidate_set_evictions": self._plan_evictions,
            "description_models": len(self._descriptions),
            "description_model_evictions": self._description_evictions,
            "description_words": len(self._description_words.entries),
            "description_word_evictions": self._description_words.evictions,
            "query_words": len(model.unseen_words) if model is not None else 0,
            "query_word_evictions": model.evictions if model is not None else 0,
            "query_word_hits": len(model.unseen_hits) if model is not None else 0,
            "query_word_hit_evictions": model.hit_evictions if model is not None else 0,
        }

    def _description_model(self, described: Sequence[RoutingAid]) -> DescriptionModel:
        """The description model of these candidates, shared by every candidate set that
        scores the same ones from their descriptions (LRU)."""
        key = tuple((aid.name, aid.description) for aid in described)
        model = self._descriptions.get(key)
        if model is not None:
            self._descriptions.move_to_end(key)
            return model
        model = build_descriptions(described, self._ngrams, self._phrase_weight,
                                   self._description_words)
        self._descriptions[key] = model
        if len(self._descriptions) > self._cache_size:
            self._descriptions.popitem(last=False)
            self._description_evictions += 1
        return model

    def _plan(self, candidates: tuple[RoutingAid, ...]) -> _Plan:
        """What scoring this candidate set needs, built once per distinct set (LRU)."""
        last_candidates, last_plan = self._last
        # Routers pass the same (immutable) routing aids turn after turn: identity is
        # a cheaper test than the cache key.
        if len(candidates) == len(last_candidates) and all(
                map(operator.is_, candidates, last_candidates)):
            return last_plan
        key = tuple((aid.name, aid.description, aid.priority) for aid in candidates)
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            self._last = (candidates, plan)
            return plan
        model = self._examples
        positions = model.positions if model is not None else {}
        routes = tuple(positions.get(aid.name) for aid in candidates)
        weights = self._example_calibration.weights
        everyone = weights[2] != 0.0 or weights[3] != 0.0
        described = tuple(number for number, route in enumerate(routes)
                          if route is None or everyone)
        descriptions = (self._description_model([candidates[i] for i in described])
                        if described else None)
        plan = _Plan(
            rows=tuple((aid.name, route, (aid.priority, -number))
                       for number, (aid, route) in enumerate(zip(candidates, routes,
                                                                  strict=True))),
            wanted=tuple(route for route in routes if route is not None),
            described=described,
            descriptions=descriptions,
            vocabulary=descriptions.vocabulary if descriptions is not None else frozenset(),
        )
        self._plans[key] = plan
        self._last = (candidates, plan)
        if len(self._plans) > self._cache_size:
            self._plans.popitem(last=False)
            self._plan_evictions += 1
        return plan

    # -- scoring ------------------------------------------------------------------

    def _raw(self, request: RouteRequest, every: bool) -> tuple[
            _Plan, list[float] | None, list[float] | None, list[float], list[float], float]:
        """The candidate set's plan; the example model's linear and neighbour signals
        (per model route); the description and lead signals (per candidate); the
        query's coverage.

        Only what the calibrations use is computed; `every` (for `signals`) adds the
        neighbour and coverage signals (description signals of example-backed routes
        stay 0 unless the example calibration weighs them).
        """
        candidates = request.candidates
        plan = self._plan(candidates)
        split = words(request.turn.query, self._max_chars, self._max_words)
        model = self._examples
        weights = self._example_calibration.weights
        linear = nearest = None
        if model is not None and plan.wanted:
            k = self._neighbors if every or weights[1] != 0.0 else 0
            linear, nearest = model.signals(split, k, self._knn_budget,
                                            (plan.wanted, self._knn_routes))
        descriptions = leads = _NO_SCORES
        if plan.descriptions is not None:
            descriptions = [0.0] * len(candidates)
            leads = [0.0] * len(candidates)
            values = plan.descriptions.scores(split, self._phrase_weight)
            first = second = 0.0
            for value in values:
                if value > first:
                    first, second = value, first
                elif value > second:
                    second = value
            for number, value in zip(plan.described, values, strict=True):
                descriptions[number] = value
                leads[number] = value - (second if value == first else first)
        coverage = 0.0
        if split and (every or weights[4] != 0.0
                      or self._description_calibration.weights[4] != 0.0):
            content = [word for word in split if word not in STOPWORDS] or split
            known = model.words if model is not None else {}
            missing = [word for word in content if word not in known]
            found = len(content) - len(missing)
            if missing:
                found += sum(map(plan.vocabulary.__contains__, missing))
            coverage = found / len(content)
        return plan, linear, nearest, descriptions, leads, coverage

    def signals(self, request: RouteRequest) -> list[tuple[bool, Signals]]:
        """Per candidate: (scored from examples?, raw signals in `SIGNALS` order).

        What `score` maps to confidences, plus `neighbors` and `coverage` even when the
        calibrations do not weigh them; `description` and `lead` of a route with
        examples are 0 unless the example calibration weighs either. This is what
        `benchmarks/sweep_decisions.py` fits calibrations on.
        """
        plan, linear, nearest, descriptions, leads, coverage = self._raw(request, True)
        out: list[tuple[bool, Signals]] = []
        for number, (_, route, _) in enumerate(plan.rows):
            description = descriptions[number] if descriptions else 0.0
            lead = leads[number] if leads else 0.0
            if route is not None and linear is not None and nearest is not None:
                out.append((True, (linear[route], nearest[route], description, lead,
                                   coverage)))
            else:
                out.append((False, (0.0, 0.0, description, lead, coverage)))
        return out

    async def decide(self, request: RouteRequest) -> RouteDecision:
        """Score every candidate and choose the best, or "clarify" when out of scope."""
        return self.score(request)

    def score(self, request: RouteRequest, *, keep_scores: bool = False) -> RouteDecision:
        """The synchronous body of `decide` (useful for benchmarks and batch scoring).

        `keep_scores=True` keeps every candidate's score in a "clarify" too (for
        analysis: a router given such a decision would ask the best-scored candidate
        even under the floor).
        """
        try:
            candidates = request.candidates
        except AttributeError:  # an AgentTurn, say: the router builds the request
            raise ContractTypeError(
                f"LexicalDecisions.decide() takes a RouteRequest (the turn with its "
                f"candidates, as AgentRouter builds it), got {type(request).__name__}"
            ) from None
        if not candidates:
            return RouteDecision(CLARIFY, confidence=0.0, rationale="lexical: no candidates")
        plan, linear, nearest, descriptions, leads, coverage = self._raw(request, False)
        (a, b, c, d, e), bias = self._example_calibration.weights, self._example_calibration.bias
        (_, _, dc, dd, de), dbias = (self._description_calibration.weights,
                                     self._description_calibration.bias)
        example_base = bias + e * coverage
        description_base = dbias + de * coverage
        with_descriptions = bool(descriptions) and (c != 0.0 or d != 0.0)
        exp = math.exp
        scores: dict[str, float] = {}
        top = second = -1.0
        best_key: tuple[float, tuple[int, int]] = (-1.0, (0, 0))
        name, backed = "", False
        for number, (candidate, route, tie) in enumerate(plan.rows):
            if route is not None and linear is not None:
                z = example_base + a * linear[route]
                if nearest is not None:
                    z += b * nearest[route]
                if with_descriptions:
                    z += c * descriptions[number] + d * leads[number]
            else:
                z = description_base + dc * descriptions[number] + dd * leads[number]
            # A logistic that cannot overflow: exp of a non-positive number only.
            value = 1.0 / (1.0 + exp(-z)) if z >= 0.0 else 1.0 - 1.0 / (1.0 + exp(z))
            scores[candidate] = value
            if value > top:
                top, second = value, top
            elif value > second:
                second = value
            key = (value, tie)
            if key > best_key:
                best_key, name, backed = key, candidate, route is not None and linear is not None
        floor = self._min_example_score if backed else self._min_description_score
        margin = top - max(second, 0.0)
        summary = f"top={name} {top:.2f} margin {margin:.2f}"
        kept = scores
        usable_floor = self._min_usable_score if backed else floor
        if top < floor and top >= usable_floor and top > 0.0:
            # Uncertain, not out of scope: the router asks the best usable candidate.
            choice, rationale = CLARIFY, f"lexical: clarify, {summary} below {floor:.2f}"
            if not keep_scores:
                kept = self._usable(plan, scores, linear is not None, usable=True)
        elif top < floor or top == 0.0:
            fallback = self._fallback
            if fallback is not None and fallback in scores:
                choice = fallback
                rationale = f"lexical: fallback {fallback}, {summary} below {floor:.2f}"
            else:
                choice, rationale = CLARIFY, f"lexical: clarify, {summary} below {floor:.2f}"
                if not keep_scores:
                    kept = {}  # none usable: the router must not pick a near-zero match
        elif len(candidates) > 1 and margin < self._min_margin:
            choice = CLARIFY
            rationale = f"lexical: clarify, {summary} under {self._min_margin:.2f}"
            if not keep_scores:
                kept = self._usable(plan, scores, linear is not None)
        else:
            choice, rationale = name, f"lexical: {summary}"
        # Valid by construction (finite scores in [0, 1], a fresh dict nobody else holds),
        # so the contract's per-field checks and copy are skipped.
        return _unchecked(RouteDecision, choice=choice, confidence=top,
                          scores=MappingProxyType(kept), rationale=rationale)

    def _usable(self, plan: _Plan, scores: dict[str, float], backed: bool, *,
                usable: bool = False) -> dict[str, float]:
        """The scores at or above their candidate's floor (what a router may pick from):
        the confidence floor, or with `usable` the usable floor of routes with examples."""
        example_floor = self._min_usable_score if usable else self._min_example_score
        description_floor = self._min_description_score
        out: dict[str, float] = {}
        for candidate, route, _ in plan.rows:
            value = scores[candidate]
            if value > 0.0 and value >= (example_floor if backed and route is not None
                                         else description_floor):
                out[candidate] = value
        return out
