"""`LexicalDecisions`: the embedded default decision service (pure Python, no model).

A query is turned into a sparse TF-IDF vector of stemmed word unigrams, word bigrams and
character n-grams taken inside word boundaries. With example utterances, each route is
scored by blending the cosine to the route's centroid with the mean cosine of its nearest
examples (a kNN over per-route inverted indexes, walked only for the `knn_routes` routes
closest by centroid); without examples, by blending the cosine to the route's whole name
and description with the cosine to its best-matching phrase (descriptions are mostly
enumerations, and a query usually asks about one item). Out-of-scope queries are answered
with "clarify" when the best score is too low or the best two routes are too close.

Everything expensive is done once: example models at construction, description models
once per distinct set of candidate descriptions (a small LRU cache), so a decision only
walks the query's own features.
"""

from __future__ import annotations

import heapq
import itertools
import math
import operator
import re
import unicodedata
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

from .._contracts import CLARIFY, RouteDecision, RouteRequest, RoutingAid
from .._exceptions import ConfigurationError

__all__ = ["LexicalDecisions"]

_WORD_RE = re.compile(r"[a-z0-9]+")

# Function words: dropped from description matching, where an IDF over a handful of
# routes cannot learn that they carry no routing signal.
_STOPWORDS = frozenset(
    (
        "a", "an", "the", "and", "or", "but", "if", "of", "at", "by", "for", "with",
        "about", "to", "from", "in", "on", "into", "over", "under", "is", "are", "was",
        "were", "be", "been", "being", "am", "do", "does", "did", "doing", "have", "has",
        "had", "having", "i", "me", "my", "mine", "we", "us", "our", "you", "your", "he",
        "him", "his", "she", "her", "it", "its", "they", "them", "their", "this", "that",
        "these", "those", "what", "which", "who", "whom", "whose", "when", "where", "why",
        "how", "can", "could", "would", "should", "will", "shall", "may", "might", "must",
        "please", "just", "so", "than", "then", "there", "here", "very", "too", "also",
        "any", "some", "all", "not", "no", "s", "t", "d", "ll", "m", "re", "ve",
    )
)

_SUFFIXES = ("ations", "ation", "ings", "ing", "edly", "ies", "ied", "ers", "er", "ed",
             "ly", "es", "s")


@lru_cache(maxsize=65536)
def _stem(word: str) -> str:
    """Strip one common English suffix, keeping a stem of at least three letters."""
    for suffix in _SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            stem = word[: -len(suffix)]
            if suffix in ("ies", "ied"):
                return stem + "y"
            return stem
    return word


@lru_cache(maxsize=65536)
def _char_grams(word: str, low: int, high: int) -> tuple[str, ...]:
    """Character n-grams of `word` padded with spaces, so boundaries are features too."""
    padded = f" {word} "
    grams: list[str] = []
    size = len(padded)
    for n in range(low, high + 1):
        if n > size:
            break
        grams.extend(padded[i : i + n] for i in range(size - n + 1))
    return tuple(grams)


def _words(text: str) -> list[str]:
    """Normalised lower-case alphanumeric words; apostrophes join ("what's" -> "whats")."""
    text = unicodedata.normalize("NFKC", text).lower().replace("'", "").replace("\u2019", "")
    return _WORD_RE.findall(text)


def _features(text: str, low: int, high: int, *, drop_stopwords: bool = False
              ) -> dict[str, int]:
    """Term counts of `text`: stemmed word unigrams and bigrams, then char n-grams.

    Stopwords are kept for example models (IDF learns their weight, and "no" or "who are
    you" are intents) and dropped for descriptions, where IDF over a few routes cannot.
    """
    words = _words(text)
    if drop_stopwords:
        words = [w for w in words if w not in _STOPWORDS]
    stems = [_stem(w) for w in words]
    counts: dict[str, int] = {}
    for stem in stems:
        key = "w:" + stem
        counts[key] = counts.get(key, 0) + 1
    for first, second in itertools.pairwise(stems):
        key = f"b:{first} {second}"
        counts[key] = counts.get(key, 0) + 1
    for word in words:
        for gram in _char_grams(word, low, high):
            counts[gram] = counts.get(gram, 0) + 1
    return counts


def _weigh(counts: Mapping[str, int], idf: Mapping[str, float], unseen: float
           ) -> dict[str, float]:
    """Sublinear TF times IDF, L2-normalised; unseen features keep the largest IDF."""
    vector = {f: (1.0 + math.log(c)) * idf.get(f, unseen) for f, c in counts.items()}
    norm = math.sqrt(sum(v * v for v in vector.values()))
    if norm == 0.0:
        return {}
    return {f: v / norm for f, v in vector.items()}


def _idf(documents: Sequence[Iterable[str]]) -> tuple[dict[str, float], float]:
    """Smoothed IDF over `documents` and the IDF an unseen feature gets."""
    df: dict[str, int] = {}
    for doc in documents:
        for feature in doc:
            df[feature] = df.get(feature, 0) + 1
    total = len(documents)
    idf = {f: math.log((1 + total) / (1 + n)) + 1.0 for f, n in df.items()}
    return idf, math.log(1 + total) + 1.0



def _normalise(vector: Mapping[str, float]) -> dict[str, float]:
    norm = math.sqrt(sum(v * v for v in vector.values()))
    if norm == 0.0:
        return {}
    return {f: v / norm for f, v in vector.items()}


def _route_words(name: str) -> str:
    """A route name with snake/kebab case split into words."""
    return name.replace("_", " ").replace("-", " ")


def _aid_text(aid: RoutingAid) -> str:
    """A route's name (snake/kebab case split into words) followed by its description."""
    return f"{_route_words(aid.name)} {aid.description}"


# Phrase boundaries inside a description: punctuation and the coordinating "and"/"or",
# so "balance, transfers and bills" is three phrases.
_PHRASE_SPLIT_RE = re.compile(r"[.,;:!?()\[\]/]|\band\b|\bor\b|\s[-\u2013\u2014]\s",
                              re.IGNORECASE)


def _phrases(aid: RoutingAid) -> list[str]:
    """The route's description split into phrases, plus its name as a phrase of its own."""
    parts = [part for part in _PHRASE_SPLIT_RE.split(aid.description) if part.strip()]
    parts.append(_route_words(aid.name))
    return parts


@dataclass(frozen=True, slots=True)
class _ExampleModel:
    """Centroids and per-route kNN indexes built once from the example utterances."""

    idf: dict[str, float]
    unseen: float
    centroids: dict[str, tuple[float, ...]]
    """feature -> per-route weights of the L2-normalised route centroids."""
    features: tuple[dict[str, tuple[int, float]], ...]
    """per route: feature -> (posting number, the feature's IDF)."""
    postings: tuple[tuple[tuple[tuple[int, ...], tuple[float, ...]], ...], ...]
    """per route: posting number -> (example ids, sublinear TF / example norm).

    An example's weight for a feature is the feature's IDF times the posting's factor,
    so features found in exactly the same examples with the same counts (the character
    n-grams of one word, mostly) share one posting, walked once per query."""
    routes: tuple[str, ...]
    positions: dict[str, int]


@dataclass(frozen=True, slots=True)
class _DescriptionModel:
    """Per-candidate-set TF-IDF vectors of the routes' names and descriptions."""

    idf: dict[str, float]
    unseen: float
    index: dict[str, list[tuple[int, float]]]
    """feature -> [(candidate position, weight)] for whole name + description vectors."""
    phrase_index: dict[str, list[tuple[int, float]]]
    """feature -> [(phrase number, weight)] for each phrase's own L2-normalised vector."""
    owners: tuple[int, ...]
    """phrase number -> candidate position."""


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


class LexicalDecisions:
    """Embedded default decision service: lexical similarity, no network, no model.

    `examples` maps a route name to example utterances; routes without examples (and
    every route when `examples` is None) are scored from their routing aid's name and
    description. Scores are in [0, 1]; the best candidate is chosen unless its score is
    below the applicable `min_*_score` or it leads the runner-up by less than
    `min_margin`, in which case the answer is "clarify" with all scores kept. Exact ties
    go to the higher `RoutingAid.priority`, then to the earlier candidate.
    """

    def __init__(
        self,
        examples: Mapping[str, Sequence[str]] | None = None,
        *,
        min_example_score: float = 0.18,
        min_description_score: float = 0.13,
        min_margin: float = 0.01,
        phrase_weight: float = 0.3,
        centroid_weight: float = 0.5,
        neighbors: int = 3,
        knn_routes: int = 2,
        max_document_frequency: float = 0.015,
        char_ngrams: tuple[int, int] = (4, 4),
        description_cache_size: int = 256,
    ) -> None:
        self._min_example_score = _check_unit("min_example_score", min_example_score)
        self._min_description_score = _check_unit("min_description_score",
                                                  min_description_score)
        self._min_margin = _check_unit("min_margin", min_margin)
        self._phrase_weight = _check_unit("phrase_weight", phrase_weight)
        self._centroid_weight = _check_unit("centroid_weight", centroid_weight)
        self._neighbors = _check_positive_int("neighbors", neighbors)
        self._knn_routes = _check_positive_int("knn_routes", knn_routes)
        self._max_df = _check_unit("max_document_frequency", max_document_frequency)
        if (
            not isinstance(char_ngrams, tuple)
            or len(char_ngrams) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) for n in char_ngrams)
            or not 1 <= char_ngrams[0] <= char_ngrams[1]
        ):
            raise ConfigurationError(
                f"char_ngrams must be (low, high) ints with 1 <= low <= high, got {char_ngrams!r}"
            )
        self._low, self._high = char_ngrams
        self._cache_size = _check_positive_int("description_cache_size",
                                               description_cache_size)
        self._descriptions: OrderedDict[tuple[tuple[str, str], ...], _DescriptionModel] = (
            OrderedDict()
        )
        self._examples = self._build_examples(examples) if examples else None

    # -- construction -------------------------------------------------------------

    def _build_examples(self, examples: Mapping[str, Sequence[str]]) -> _ExampleModel | None:
        if not isinstance(examples, Mapping):
            raise ConfigurationError(
                f"examples must be a mapping of route name to utterances, got "
                f"{type(examples).__name__}"
            )
        routes: list[str] = []
        texts: list[tuple[int, dict[str, int]]] = []
        for route, utterances in examples.items():
            if not isinstance(route, str) or not route:
                raise ConfigurationError(f"examples keys must be route names, got {route!r}")
            if isinstance(utterances, str) or not isinstance(utterances, Sequence):
                raise ConfigurationError(
                    f"examples[{route!r}] must be a sequence of str, got "
                    f"{type(utterances).__name__}"
                )
            index = len(routes)
            routes.append(route)
            for position, text in enumerate(utterances):
                if not isinstance(text, str):
                    raise ConfigurationError(
                        f"examples[{route!r}][{position}] must be a str, got {text!r:.60}"
                    )
                counts = _features(text, self._low, self._high)
                if counts:
                    texts.append((index, counts))
        if not texts:
            return None
        documents = [counts for _, counts in texts]
        idf, unseen = _idf(documents)
        df: dict[str, int] = {}
        for counts in documents:
            for feature in counts:
                df[feature] = df.get(feature, 0) + 1
        max_df = max(1, int(self._max_df * len(texts)))
        sums: list[dict[str, float]] = [{} for _ in routes]
        raw: list[dict[str, tuple[list[int], list[float]]]] = [{} for _ in routes]
        local_ids = [0] * len(routes)
        for route_index, counts in texts:
            total = sums[route_index]
            route_raw = raw[route_index]
            example_id = local_ids[route_index]
            local_ids[route_index] += 1
            tf = {f: 1.0 + math.log(c) for f, c in counts.items()}
            norm = math.sqrt(sum((t * idf[f]) ** 2 for f, t in tf.items()))
            for feature, value in tf.items():
                total[feature] = total.get(feature, 0.0) + value * idf[feature] / norm
                if df[feature] <= max_df:
                    ids, factors = route_raw.setdefault(feature, ([], []))
                    ids.append(example_id)
                    factors.append(value / norm)
        features: list[dict[str, tuple[int, float]]] = []
        postings: list[tuple[tuple[tuple[int, ...], tuple[float, ...]], ...]] = []
        for route_raw in raw:
            numbers: dict[tuple[tuple[int, ...], tuple[float, ...]], int] = {}
            mapping: dict[str, tuple[int, float]] = {}
            for feature, (ids, factors) in route_raw.items():
                posting = (tuple(ids), tuple(factors))
                mapping[feature] = (numbers.setdefault(posting, len(numbers)), idf[feature])
            features.append(mapping)
            postings.append(tuple(numbers))
        dense: dict[str, list[float]] = {}
        for route_index, total in enumerate(sums):
            for feature, weight in _normalise(total).items():
                dense.setdefault(feature, [0.0] * len(routes))[route_index] = weight
        return _ExampleModel(
            idf=idf,
            unseen=unseen,
            centroids={f: tuple(row) for f, row in dense.items()},
            features=tuple(features),
            postings=tuple(postings),
            routes=tuple(routes),
            positions={route: position for position, route in enumerate(routes)},
        )

    def _description_model(self, candidates: Sequence[RoutingAid]) -> _DescriptionModel:
        key = tuple((aid.name, aid.description) for aid in candidates)
        cached = self._descriptions.get(key)
        if cached is not None:
            self._descriptions.move_to_end(key)
            return cached
        docs = [_features(_aid_text(aid), self._low, self._high, drop_stopwords=True)
                for aid in candidates]
        idf, unseen = _idf(docs)
        index: dict[str, list[tuple[int, float]]] = {}
        for position, counts in enumerate(docs):
            for feature, weight in _weigh(counts, idf, unseen).items():
                index.setdefault(feature, []).append((position, weight))
        phrase_index: dict[str, list[tuple[int, float]]] = {}
        owners: list[int] = []
        if self._phrase_weight > 0.0:
            # Each phrase is weighed with the IDF of the whole descriptions: a phrase is a
            # field of its route, not a document of its own.
            for position, aid in enumerate(candidates):
                for phrase in _phrases(aid):
                    counts = _features(phrase, self._low, self._high, drop_stopwords=True)
                    vector = _weigh(counts, idf, unseen)
                    if not vector:
                        continue
                    number = len(owners)
                    owners.append(position)
                    for feature, weight in vector.items():
                        phrase_index.setdefault(feature, []).append((number, weight))
        model = _DescriptionModel(idf=idf, unseen=unseen, index=index,
                                  phrase_index=phrase_index, owners=tuple(owners))
        self._descriptions[key] = model
        if len(self._descriptions) > self._cache_size:
            self._descriptions.popitem(last=False)
        return model

    # -- scoring ------------------------------------------------------------------

    def _example_scores(self, model: _ExampleModel, query: str, wanted: Sequence[int]
                        ) -> list[float]:
        """Scores of every model route; only the `wanted` routes get the kNN part."""
        vector = _weigh(_features(query, self._low, self._high), model.idf, model.unseen)
        centroids = model.centroids
        rows: list[tuple[float, ...]] = []
        values: list[float] = []
        for feature, value in vector.items():
            row = centroids.get(feature)
            if row is not None:
                rows.append(row)
                values.append(value)
        if not rows:
            return [0.0] * len(model.routes)
        # Column sums run in C: one dot product per route.
        centroid = [sum(map(operator.mul, column, values)) for column in zip(*rows, strict=True)]
        weight = self._centroid_weight
        scores = [weight * value for value in centroid]
        if weight < 1.0 and wanted:
            # The k nearest examples of the few routes closest by centroid: the others
            # are too far to be chosen, and skipping them keeps a decision cheap.
            k = self._neighbors
            share = (1.0 - weight) / k
            items = list(vector.items())
            for route_index in heapq.nlargest(self._knn_routes, wanted,
                                              key=centroid.__getitem__):
                index = model.features[route_index]
                coefficients: dict[int, float] = {}
                for feature, value in items:
                    entry = index.get(feature)
                    if entry is not None:
                        number, scale = entry
                        coefficients[number] = coefficients.get(number, 0.0) + value * scale
                postings = model.postings[route_index]
                sims: dict[int, float] = {}
                get = sims.get
                for number, coefficient in coefficients.items():
                    for example_id, factor in zip(*postings[number], strict=True):
                        sims[example_id] = get(example_id, 0.0) + coefficient * factor
                if sims:
                    nearest = sorted(sims.values(), reverse=True)[:k]
                    scores[route_index] += share * sum(nearest)
        return scores

    def _description_scores(self, candidates: Sequence[RoutingAid], query: str
                            ) -> list[float]:
        """(1 - phrase_weight) × cosine to the whole name + description + phrase_weight ×
        cosine to the route's best-matching phrase (its name is one of them)."""
        model = self._description_model(candidates)
        counts = _features(query, self._low, self._high, drop_stopwords=True)
        scores = [0.0] * len(candidates)
        phrases = [0.0] * len(model.owners)
        index = model.index
        phrase_index = model.phrase_index
        for feature, value in _weigh(counts, model.idf, model.unseen).items():
            entries = index.get(feature)
            if entries is not None:
                for position, weight in entries:
                    scores[position] += value * weight
                for number, weight in phrase_index.get(feature, ()):
                    phrases[number] += value * weight
        share = self._phrase_weight
        if share == 0.0:
            return scores
        best = [0.0] * len(candidates)
        for number, value in enumerate(phrases):
            position = model.owners[number]
            if value > best[position]:
                best[position] = value
        return [(1.0 - share) * whole + share * part
                for whole, part in zip(scores, best, strict=True)]

    async def decide(self, request: RouteRequest) -> RouteDecision:
        """Score every candidate and choose the best, or "clarify" when out of scope."""
        return self.score(request)

    def score(self, request: RouteRequest) -> RouteDecision:
        """The synchronous body of `decide` (useful for benchmarks and batch scoring)."""
        candidates = request.candidates
        if not candidates:
            return RouteDecision(CLARIFY, confidence=0.0, rationale="lexical: no candidates")
        query = request.turn.query
        model = self._examples
        example_scores: dict[str, float] = {}
        if model is not None:
            positions = model.positions
            wanted = [positions[aid.name] for aid in candidates if aid.name in positions]
            if wanted:
                values = self._example_scores(model, query, wanted)
                example_scores = {model.routes[i]: values[i] for i in wanted}
        needs_description = [aid for aid in candidates if aid.name not in example_scores]
        description_scores: dict[str, float] = {}
        if needs_description:
            description_scores = dict(zip(
                (aid.name for aid in needs_description),
                self._description_scores(needs_description, query),
                strict=True,
            ))
        ranked: list[tuple[float, int, int, str, float]] = []
        scores: dict[str, float] = {}
        for position, aid in enumerate(candidates):
            if aid.name in example_scores:
                value, floor = example_scores[aid.name], self._min_example_score
            else:
                value, floor = description_scores[aid.name], self._min_description_score
            value = min(1.0, max(0.0, value))
            scores[aid.name] = value
            ranked.append((value, aid.priority, -position, aid.name, floor))
        ranked.sort(reverse=True)
        top, _, _, name, floor = ranked[0]
        second = ranked[1][0] if len(ranked) > 1 else 0.0
        margin = top - second
        summary = f"top={name} {top:.2f} margin {margin:.2f}"
        if top < floor or top == 0.0:
            return RouteDecision(CLARIFY, confidence=top, scores=scores,
                                 rationale=f"lexical: clarify, {summary} below {floor:.2f}")
        if len(ranked) > 1 and margin < self._min_margin:
            return RouteDecision(
                CLARIFY, confidence=top, scores=scores,
                rationale=f"lexical: clarify, {summary} under {self._min_margin:.2f}",
            )
        return RouteDecision(name, confidence=top, scores=scores, rationale=f"lexical: {summary}")
