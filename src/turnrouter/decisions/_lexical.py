"""`LexicalDecisions`: the embedded default decision service (pure Python, no model).

A query is turned into a sparse TF-IDF vector of stemmed word unigrams, word bigrams and
character n-grams taken inside word boundaries. With example utterances, routes are
ranked by a linear model trained on the examples at construction (an averaged
perceptron); the best route's cosine to its example centroid and to its nearest examples
say how close the query is to anything seen. Without examples, a route is scored from its
name and description (whole text and best-matching phrase). The raw signals are mapped to
a calibrated `confidence` (probability that the choice is right, see `_calibration.py`);
"clarify" is answered when it is below the floor.

Everything expensive is done once: example models at construction, description models
once per distinct set of candidate descriptions (a small LRU cache). The work per
decision is bounded: the query is cut to `max_query_chars` characters and
`max_query_words` words, and each word to `_MAX_WORD` characters.
"""

from __future__ import annotations

import heapq
import itertools
import math
import operator
import random
import re
import unicodedata
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType

from .._contracts import CLARIFY, RouteDecision, RouteRequest, RoutingAid, _unchecked
from .._exceptions import ConfigurationError
from ._calibration import LexicalCalibration

__all__ = ["LexicalDecisions"]

_WORD_RE = re.compile(r"[a-z0-9]+")
_MAX_WORD = 32
"""Longer words are cut: bounds the character n-grams per word and the word caches."""
_WORD_CACHE_ENTRIES = 16384
"""Process-wide LRU bound of each per-word cache (stems, n-grams, n-gram counts): with
words of at most 32 characters, a flood of distinct junk words holds tens of MB at most."""
_second = operator.itemgetter(1)
_WORD_CACHE_SIZE = 4096
"""Entries of query words not in the examples kept per service (oldest evicted first)."""
_MIN_KNN_DF = 30
"""Features in at most this many examples always stay in the kNN index (small sets)."""

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


@lru_cache(maxsize=_WORD_CACHE_ENTRIES)
def _stem(word: str) -> str:
    """Strip one common English suffix, keeping a stem of at least three letters."""
    for suffix in _SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            stem = word[: -len(suffix)]
            if suffix in ("ies", "ied"):
                return stem + "y"
            return stem
    return word


@lru_cache(maxsize=_WORD_CACHE_ENTRIES)
def _word_features(word: str, low: int, high: int) -> tuple[str, tuple[str, ...]]:
    """A word's stem and its unigram + character n-gram features (cached per word).

    N-grams are taken from the word padded with spaces, so boundaries are features too.
    """
    stem = _stem(word)
    padded = f" {word} "
    grams: list[str] = ["w:" + stem]
    size = len(padded)
    for n in range(low, high + 1):
        if n > size:
            break
        grams.extend(padded[i : i + n] for i in range(size - n + 1))
    return stem, tuple(grams)


@lru_cache(maxsize=_WORD_CACHE_ENTRIES)
def _gram_counts(word: str, low: int, high: int) -> tuple[tuple[str, int], ...]:
    """A word's unigram + n-gram features with their counts inside the word (cached)."""
    counts: dict[str, int] = {}
    for gram in _word_features(word, low, high)[1]:
        counts[gram] = counts.get(gram, 0) + 1
    return tuple(counts.items())


def _words(text: str, max_chars: int, max_words: int) -> list[str]:
    """Normalised lower-case alphanumeric words; apostrophes join ("what's" -> "whats").

    At most `max_chars` characters are read and `max_words` words (each cut to
    `_MAX_WORD` characters) kept, so any input costs bounded work.
    """
    text = unicodedata.normalize("NFKC", text[:max_chars]).lower()
    text = text.replace("'", "").replace("\u2019", "")
    words = _WORD_RE.findall(text, 0, max_chars * 2)[:max_words]
    return [w if len(w) <= _MAX_WORD else w[:_MAX_WORD] for w in words]


def _features(text: str, low: int, high: int, *, drop_stopwords: bool = False,
              max_chars: int = 1_000_000, max_words: int = 1_000_000) -> dict[str, int]:
    """Term counts of `text`: stemmed word unigrams and bigrams, then char n-grams.

    Stopwords are kept for example models (IDF learns their weight, and "no" or "who are
    you" are intents) and dropped for descriptions, where IDF over a few routes cannot.
    """
    return _counts(_words(text, max_chars, max_words), low, high, drop_stopwords)


def _counts(words: Sequence[str], low: int, high: int, drop_stopwords: bool
            ) -> dict[str, int]:
    """The term counts of `_features` from already split words."""
    if drop_stopwords:
        words = [w for w in words if w not in _STOPWORDS]
    counts: dict[str, int] = {}
    get = counts.get
    previous = ""
    for word in words:
        stem, grams = _word_features(word, low, high)
        for gram in grams:
            counts[gram] = get(gram, 0) + 1
        if previous:
            key = f"b:{previous} {stem}"
            counts[key] = get(key, 0) + 1
        previous = stem
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


# Calibrations fitted by `benchmarks/sweep_decisions.py` on CLINC150 train + oos_train
# (never on the validation split); signals in `_calibration.SIGNALS` order.
DEFAULT_EXAMPLE_CALIBRATION = LexicalCalibration((6.9171, 2.0899, 3.896, 0.0, 0.0), -5.2897)
DEFAULT_FEW_SHOT_CALIBRATION = LexicalCalibration(
    (3.5908, 3.0126, 2.4676, 5.3128, 6.2481), -3.0052)
DEFAULT_DESCRIPTION_CALIBRATION = LexicalCalibration((0.0, 0.0, 0.0, 8.2477, 5.2714), -1.9754)
# Floors maximising the balanced score on the same tuning data, per regime.
DEFAULT_EXAMPLE_FLOOR = 0.475
DEFAULT_FEW_SHOT_FLOOR = 0.3
DEFAULT_DESCRIPTION_FLOOR = 0.35
FEW_SHOT_BELOW = 50
"""Example sets averaging fewer examples per route use the few-shot calibration."""


_WordEntry = tuple[str, float, tuple[float, ...] | None]
"""A word's stem, squared norm and summed IDF-weighted row (None: no known feature)."""


@dataclass(frozen=True, slots=True)
class _ExampleModel:
    """Linear model, centroids and per-route kNN indexes built once from the examples.

    A text's vector is the sum of its words' vectors (the word's unigram and character
    n-grams) and of its bigrams, each feature weighted by count × IDF, divided by the
    root of the summed squared norms of those parts (n-grams shared by two words are not
    merged for the norm). So a query's scores are plain sums of precomputed per-word rows.
    """

    table: dict[str, tuple[float, tuple[float, ...]]]
    """feature -> (IDF, row): row = per-route linear weights then centroid weights, both
    already multiplied by the IDF."""
    words: dict[str, _WordEntry]
    """every word of the examples -> its entry (other words are computed per query)."""
    unseen: float
    size: int
    features: tuple[dict[str, tuple[int, float]], ...]
    """per route: feature -> (posting number, the feature's IDF squared)."""
    word_postings: tuple[dict[str, tuple[tuple[int, float], ...]], ...]
    """per route: word -> ((posting number, summed count × IDF²), ...)."""
    postings: tuple[tuple[tuple[tuple[int, ...], tuple[float, ...]], ...], ...]
    """per route: posting number -> (example ids, count / example norm).

    An example's weight for a feature is the feature's IDF times the posting's factor,
    so features found in exactly the same examples with the same counts (the character
    n-grams of one word, mostly) share one posting, walked once per query."""
    routes: tuple[str, ...]
    positions: dict[str, int]
    per_route: float
    """Mean number of examples per route (chooses the few-shot calibration)."""
    low: int
    high: int

    def word(self, word: str) -> _WordEntry:
        """The entry of `word`: precomputed for example words, else computed now."""
        entry = self.words.get(word)
        if entry is not None:
            return entry
        stem = _word_features(word, self.low, self.high)[0]
        return _word_entry(stem, _gram_counts(word, self.low, self.high), self.table,
                           self.unseen, self.size * 2)

    def word_posting(self, route: int, word: str) -> tuple[tuple[int, float], ...]:
        """(posting number, count × IDF²) of `word`'s features in `route`'s kNN index."""
        entries = self.word_postings[route].get(word)
        if entries is not None or word in self.words:
            return entries or ()
        return _word_posting(_gram_counts(word, self.low, self.high), self.features[route])


def _word_entry(stem: str, grams: tuple[tuple[str, int], ...],
                table: Mapping[str, tuple[float, tuple[float, ...]]], unseen: float,
                width: int) -> _WordEntry:
    squares = 0.0
    rows: list[tuple[float, ...]] = []
    for gram, count in grams:
        entry = table.get(gram)
        if entry is None:
            squares += (count * unseen) ** 2
            continue
        squares += (count * entry[0]) ** 2
        rows.append(entry[1] if count == 1 else tuple(count * v for v in entry[1]))
    if not rows:
        return stem, squares, None
    return stem, squares, tuple(map(sum, zip(*rows, strict=True))) if width else None


def _word_posting(grams: tuple[tuple[str, int], ...],
                  index: Mapping[str, tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    summed: dict[int, float] = {}
    for gram, count in grams:
        entry = index.get(gram)
        if entry is not None:
            summed[entry[0]] = summed.get(entry[0], 0.0) + count * entry[1]
    return tuple(summed.items())


@dataclass(frozen=True, slots=True)
class _DescriptionModel:
    """Per-candidate-set TF-IDF vectors of the routes' names, descriptions and phrases."""

    table: dict[str, tuple[float, tuple[tuple[int, float], ...]]]
    """feature -> (IDF², ((slot, IDF × weight), ...)): slots 0..n-1 are the candidates'
    whole name + description vectors, the next ones each phrase's own L2-normalised
    vector (both weighed with the IDF of the whole descriptions)."""
    unseen: float
    size: int
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


def _check_calibration(name: str, value: object, default: LexicalCalibration
                       ) -> LexicalCalibration:
    if value is None:
        return default
    if not isinstance(value, LexicalCalibration):
        raise ConfigurationError(
            f"{name} must be a LexicalCalibration or None, got {type(value).__name__}"
        )
    return value


def _train_linear(
    vectors: Sequence[tuple[tuple[str, ...], tuple[float, ...]]],
    labels: Sequence[int],
    routes: int,
    epochs: int,
) -> dict[str, list[float]]:
    """Averaged multi-class perceptron over normalised TF-IDF vectors (deterministic order).

    Mistake-driven updates touch two routes of the example's own features only, so a
    pass over 15,000 utterances takes a fraction of a second.
    """
    weights: dict[str, list[float]] = {}
    totals: dict[str, list[float]] = {}
    for names, _ in vectors:
        for name in names:
            if name not in weights:
                weights[name] = [0.0] * routes
                totals[name] = [0.0] * routes
    order = list(range(len(vectors)))
    shuffle = random.Random(0).shuffle
    step = 1
    mul = operator.mul
    for _ in range(epochs):
        shuffle(order)
        for i in order:
            names, values = vectors[i]
            label = labels[i]
            rows = [weights[name] for name in names]
            scores = [sum(map(mul, column, values)) for column in zip(*rows, strict=True)]
            guess = max(range(routes), key=scores.__getitem__)
            if guess != label:
                for name, value, row in zip(names, values, rows, strict=True):
                    row[label] += value
                    row[guess] -= value
                    total = totals[name]
                    total[label] += step * value
                    total[guess] -= step * value
            step += 1
    return {name: [w - t / step for w, t in zip(row, totals[name], strict=True)]
            for name, row in weights.items()}


class LexicalDecisions:
    """Embedded default decision service: lexical similarity, no network, no model.

    `examples` maps a route name to example utterances; routes without examples (and
    every route when `examples` is None) are scored from their routing aid's name and
    description. Every candidate's score is a calibrated confidence in [0, 1] (the
    probability that choosing it is right, fitted with equal weight on in-scope and
    out-of-scope traffic); the best candidate is chosen unless its score is below
    `min_example_score` (a route with examples) / `min_description_score` (a route
    scored from its description) or leads the runner-up by less than `min_margin`, in
    which case the answer is "clarify" with all scores kept. Exact ties go to the higher
    `RoutingAid.priority`, then to the earlier candidate. See docs/decisions.md.
    """

    def __init__(
        self,
        examples: Mapping[str, Sequence[str]] | None = None,
        *,
        min_example_score: float | None = None,
        min_description_score: float = DEFAULT_DESCRIPTION_FLOOR,
        min_margin: float = 0.0,
        phrase_weight: float = 0.3,
        neighbors: int = 3,
        knn_routes: int = 1,
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
        self._min_description_score = _check_unit("min_description_score",
                                                  min_description_score)
        self._min_margin = _check_unit("min_margin", min_margin)
        self._phrase_weight = _check_unit("phrase_weight", phrase_weight)
        self._neighbors = _check_positive_int("neighbors", neighbors)
        self._knn_routes = _check_positive_int("knn_routes", knn_routes)
        self._max_df = _check_unit("max_document_frequency", max_document_frequency)
        self._epochs = _check_positive_int("epochs", epochs)
        self._knn_budget = _check_positive_int("knn_budget", knn_budget)
        self._max_chars = _check_positive_int("max_query_chars", max_query_chars)
        self._max_words = _check_positive_int("max_query_words", max_query_words)
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
        self._description_calibration = _check_calibration(
            "description_calibration", description_calibration,
            DEFAULT_DESCRIPTION_CALIBRATION)
        self._descriptions: OrderedDict[tuple[tuple[str, str], ...], _DescriptionModel] = (
            OrderedDict()
        )
        self._description_evictions = 0
        self._word_cache: dict[str, _WordEntry] = {}
        self._word_evictions = 0
        self._posting_cache: dict[tuple[int, str], tuple[tuple[int, float], ...]] = {}
        self._posting_evictions = 0
        self._examples = _build_examples(self, examples) if examples else None
        floor = DEFAULT_EXAMPLE_FLOOR
        if self._examples is not None and self._examples.per_route < FEW_SHOT_BELOW:
            calibration, floor = few_shot, DEFAULT_FEW_SHOT_FLOOR
        self._example_calibration = calibration
        self._min_example_score = floor if explicit_floor is None else explicit_floor

    @property
    def min_example_score(self) -> float:
        """Confidence floor for choosing a route scored from its examples."""
        return self._min_example_score

    @property
    def min_description_score(self) -> float:
        """Confidence floor for choosing a route scored from its description."""
        return self._min_description_score

    def cache_stats(self) -> dict[str, int]:
        """Sizes and eviction counts of the per-service caches (all bounded).

        `description_models` (at most `description_cache_size` candidate sets),
        `query_words` (at most 4,096 words not seen in the examples) and
        `query_word_postings` (their kNN postings per route, at most 4,096).
        """
        return {
            "description_models": len(self._descriptions),
            "description_model_evictions": self._description_evictions,
            "query_words": len(self._word_cache),
            "query_word_evictions": self._word_evictions,
            "query_word_postings": len(self._posting_cache),
            "query_word_posting_evictions": self._posting_evictions,
        }

    # -- construction -------------------------------------------------------------

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
                    slot = len(candidates) + len(owners)
                    owners.append(position)
                    for feature, weight in vector.items():
                        index.setdefault(feature, []).append((slot, weight))
        table = {f: (idf[f] ** 2, tuple((slot, idf[f] * w) for slot, w in entries))
                 for f, entries in index.items()}
        model = _DescriptionModel(table=table, unseen=unseen, size=len(candidates),
                                  owners=tuple(owners))
        self._descriptions[key] = model
        if len(self._descriptions) > self._cache_size:
            self._descriptions.popitem(last=False)
            self._description_evictions += 1
        return model

    # -- scoring ------------------------------------------------------------------

    def _example_signals(self, model: _ExampleModel, words: Sequence[str],
                         wanted: Sequence[int]) -> tuple[list[float], list[float],
                                                         dict[int, float]]:
        """Linear scores and centroid cosines of every model route, and the mean cosine
        of the nearest examples of the `knn_routes` best `wanted` routes."""
        size = model.size
        table = model.table
        rows: list[tuple[float, ...]] = []
        squares = 0.0
        stems: list[str] = []
        known = model.words.get
        cache = self._word_cache
        for word in words:
            entry = known(word) or cache.get(word)
            if entry is None:
                entry = model.word(word)
                if len(cache) >= _WORD_CACHE_SIZE:
                    del cache[next(iter(cache))]
                    self._word_evictions += 1
                cache[word] = entry
            stem, square, row = entry
            squares += square
            if row is not None:
                rows.append(row)
            stems.append(stem)
        bigrams = [f"b:{first} {second}" for first, second in itertools.pairwise(stems)]
        unseen = model.unseen
        for key in bigrams:
            found = table.get(key)
            if found is None:
                squares += unseen * unseen
            else:
                squares += found[0] * found[0]
                rows.append(found[1])
        if not rows:
            return [0.0] * size, [0.0] * size, {}
        scale = 1.0 / math.sqrt(squares)
        # Column sums run in C: one sum per route and signal.
        sums = [value * scale for value in map(sum, zip(*rows, strict=True))]
        linear, centroid = sums[:size], sums[size:]
        nearest: dict[int, float] = {}
        if self._example_calibration.weights[2] != 0.0:
            k = self._neighbors
            posting_cache = self._posting_cache
            for route_index in heapq.nlargest(self._knn_routes, wanted,
                                              key=linear.__getitem__):
                coefficients: dict[int, float] = {}
                cget = coefficients.get
                route_words = model.word_postings[route_index]
                for word in words:
                    listed = route_words.get(word)
                    if listed is None:
                        if word in model.words:
                            continue
                        cache_key = (route_index, word)
                        listed = posting_cache.get(cache_key)
                        if listed is None:
                            listed = model.word_posting(route_index, word)
                            if len(posting_cache) >= _WORD_CACHE_SIZE:
                                del posting_cache[next(iter(posting_cache))]
                                self._posting_evictions += 1
                            posting_cache[cache_key] = listed
                    for number, weight in listed:
                        coefficients[number] = cget(number, 0.0) + weight
                index = model.features[route_index]
                for key in bigrams:
                    posting = index.get(key)
                    if posting is not None:
                        number, weight = posting
                        coefficients[number] = cget(number, 0.0) + weight
                postings = model.postings[route_index]
                sims: dict[int, float] = {}
                get = sims.get
                # Heaviest features first, and at most `knn_budget` posting entries: a
                # query's kNN work is bounded whatever its words.
                budget = self._knn_budget
                for number, coefficient in sorted(coefficients.items(), key=_second,
                                                  reverse=True):
                    ids, factors = postings[number]
                    for example_id, factor in zip(ids, factors, strict=True):
                        sims[example_id] = get(example_id, 0.0) + coefficient * factor
                    budget -= len(ids)
                    if budget <= 0:
                        break
                nearest[route_index] = (sum(heapq.nlargest(k, sims.values())) * scale / k
                                        if sims else 0.0)
        return linear, centroid, nearest

    def _description_scores(self, candidates: Sequence[RoutingAid], words: Sequence[str]
                            ) -> list[float]:
        """(1 - phrase_weight) × cosine to the whole name + description + phrase_weight ×
        cosine to the route's best-matching phrase (its name is one of them).

        The query side counts every n-gram occurrence on its own (no merging across
        words, linear TF), so no per-query dictionaries are built.
        """
        model = self._description_model(candidates)
        size = model.size
        sums = [0.0] * (size + len(model.owners))
        get = model.table.get
        unseen = model.unseen * model.unseen
        squares = 0.0
        low, high = self._low, self._high
        previous = ""
        for word in words:
            if word in _STOPWORDS:
                continue
            stem, grams = _word_features(word, low, high)
            if previous:
                grams = (*grams, f"b:{previous} {stem}")
            previous = stem
            for gram in grams:
                entry = get(gram)
                if entry is None:
                    squares += unseen
                    continue
                square, postings = entry
                squares += square
                for slot, weight in postings:
                    sums[slot] += weight
        if squares == 0.0:
            return [0.0] * size
        scale = 1.0 / math.sqrt(squares)
        share = self._phrase_weight
        if share == 0.0:
            return [value * scale for value in sums]
        best = [0.0] * size
        for number, position in enumerate(model.owners):
            value = sums[size + number]
            if value > best[position]:
                best[position] = value
        return [((1.0 - share) * whole + share * part) * scale
                for whole, part in zip(sums, best, strict=False)]

    def _signals(self, request: RouteRequest) -> list[tuple[bool, tuple[float, ...]]]:
        """Per candidate: (scored from examples?, raw signals in `SIGNALS` order).

        Used by `score` and by the benchmark's calibration sweep.
        """
        candidates = request.candidates
        words = _words(request.turn.query, self._max_chars, self._max_words)
        model = self._examples
        positions = model.positions if model is not None else {}
        backed = [aid.name in positions for aid in candidates]
        calibration = self._example_calibration
        # Description signals: for every candidate when the example calibration uses
        # them (few-shot), else only for the candidates without examples.
        if calibration.weights[3] != 0.0 or calibration.weights[4] != 0.0:
            described = list(range(len(candidates)))
        else:
            described = [number for number, flag in enumerate(backed) if not flag]
        descriptions = [0.0] * len(candidates)
        leads = [0.0] * len(candidates)
        if described:
            values = self._description_scores([candidates[i] for i in described], words)
            first, second = heapq.nlargest(2, values) if len(values) > 1 else (values[0], 0.0)
            for number, value in zip(described, values, strict=True):
                descriptions[number] = value
                leads[number] = value - (second if value == first else first)
        linear: list[float] = []
        centroid: list[float] = []
        nearest: dict[int, float] = {}
        if model is not None and any(backed):
            wanted = [positions[aid.name] for aid in candidates if aid.name in positions]
            linear, centroid, nearest = self._example_signals(model, words, wanted)
        out: list[tuple[bool, tuple[float, ...]]] = []
        for number, aid in enumerate(candidates):
            description = descriptions[number]
            lead = leads[number]
            if backed[number]:
                i = positions[aid.name]
                out.append((True, (linear[i], centroid[i], nearest.get(i, 0.0),
                                   description, lead)))
            else:
                out.append((False, (0.0, 0.0, 0.0, description, lead)))
        return out

    async def decide(self, request: RouteRequest) -> RouteDecision:
        """Score every candidate and choose the best, or "clarify" when out of scope."""
        return self.score(request)

    def score(self, request: RouteRequest) -> RouteDecision:
        """The synchronous body of `decide` (useful for benchmarks and batch scoring)."""
        candidates = request.candidates
        if not candidates:
            return RouteDecision(CLARIFY, confidence=0.0, rationale="lexical: no candidates")
        ranked: list[tuple[float, int, int, str, float]] = []
        scores: dict[str, float] = {}
        (a, b, c, d, e), bias = self._example_calibration.weights, self._example_calibration.bias
        (_, _, _, dd, de), dbias = (self._description_calibration.weights,
                                    self._description_calibration.bias)
        exp = math.exp
        for position, (aid, (backed, signals)) in enumerate(
            zip(candidates, self._signals(request), strict=True)
        ):
            linear, centroid, nearest, description, lead = signals
            if backed:
                z = bias + a * linear + b * centroid + c * nearest + d * description + e * lead
                floor = self._min_example_score
            else:
                z = dbias + dd * description + de * lead
                floor = self._min_description_score
            # A logistic that cannot overflow: exp of a non-positive number only.
            value = 1.0 / (1.0 + exp(-z)) if z >= 0.0 else 1.0 - 1.0 / (1.0 + exp(z))
            scores[aid.name] = value
            ranked.append((value, aid.priority, -position, aid.name, floor))
        ranked.sort(reverse=True)
        top, _, _, name, floor = ranked[0]
        second = ranked[1][0] if len(ranked) > 1 else 0.0
        margin = top - second
        summary = f"top={name} {top:.2f} margin {margin:.2f}"
        if top < floor or top == 0.0:
            choice, rationale = CLARIFY, f"lexical: clarify, {summary} below {floor:.2f}"
        elif len(ranked) > 1 and margin < self._min_margin:
            choice = CLARIFY
            rationale = f"lexical: clarify, {summary} under {self._min_margin:.2f}"
        else:
            choice, rationale = name, f"lexical: {summary}"
        # Valid by construction (finite scores in [0, 1], a fresh dict nobody else holds),
        # so the contract's per-field checks and copy are skipped.
        return _unchecked(RouteDecision, choice=choice, confidence=top,
                          scores=MappingProxyType(scores), rationale=rationale)


def _build_examples(
    service: LexicalDecisions, examples: Mapping[str, Sequence[str]]
) -> _ExampleModel | None:
    """The example model of `service` (trained once, at construction)."""
    if not isinstance(examples, Mapping):
        raise ConfigurationError(
            f"examples must be a mapping of route name to utterances, got "
            f"{type(examples).__name__}"
        )
    routes: list[str] = []
    texts: list[tuple[int, list[str], dict[str, int]]] = []
    low, high = service._low, service._high
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
            words = _words(text, service._max_chars, service._max_words)
            counts = _counts(words, low, high, False)
            if counts:
                texts.append((index, words, counts))
    if not texts:
        return None
    size = len(routes)
    documents = [counts for _, _, counts in texts]
    idf, unseen = _idf(documents)
    df: dict[str, int] = {}
    for counts in documents:
        for feature in counts:
            df[feature] = df.get(feature, 0) + 1
    vocabulary: dict[str, tuple[str, tuple[str, ...]]] = {}
    for _, words, _ in texts:
        for word in words:
            if word not in vocabulary:
                vocabulary[word] = _word_features(word, low, high)
    word_squares = {
        word: sum((count * idf[gram]) ** 2 for gram, count in _gram_counts(word, low, high))
        for word in vocabulary
    }
    max_df = max(_MIN_KNN_DF, int(service._max_df * len(texts)))
    sums: list[dict[str, float]] = [{} for _ in routes]
    raw: list[dict[str, tuple[list[int], list[float]]]] = [{} for _ in routes]
    local_ids = [0] * size
    vectors: list[tuple[tuple[str, ...], tuple[float, ...]]] = []
    labels: list[int] = []
    for route_index, words, counts in texts:
        total = sums[route_index]
        route_raw = raw[route_index]
        example_id = local_ids[route_index]
        local_ids[route_index] += 1
        squares = sum(word_squares[word] for word in words) + sum(
            count * idf[f] ** 2 for f, count in counts.items() if f.startswith("b:"))
        norm = math.sqrt(squares)
        names = tuple(counts)
        values = tuple(counts[f] * idf[f] / norm for f in names)
        vectors.append((names, values))
        labels.append(route_index)
        for feature, value in zip(names, values, strict=True):
            total[feature] = total.get(feature, 0.0) + value
            if df[feature] <= max_df:
                ids, factors = route_raw.setdefault(feature, ([], []))
                ids.append(example_id)
                factors.append(counts[feature] / norm)
    features: list[dict[str, tuple[int, float]]] = []
    postings: list[tuple[tuple[tuple[int, ...], tuple[float, ...]], ...]] = []
    for route_raw in raw:
        numbers: dict[tuple[tuple[int, ...], tuple[float, ...]], int] = {}
        mapping: dict[str, tuple[int, float]] = {}
        for feature, (ids, factors) in route_raw.items():
            posting = (tuple(ids), tuple(factors))
            # IDF squared: once for the query's weight, once for the example's.
            mapping[feature] = (numbers.setdefault(posting, len(numbers)),
                                idf[feature] ** 2)
        features.append(mapping)
        postings.append(tuple(numbers))
    linear = _train_linear(vectors, labels, size, service._epochs) if size > 1 else {}
    dense: dict[str, list[float]] = {f: [0.0] * (2 * size) for f in idf}
    for feature, row in linear.items():
        dense[feature][:size] = row
    for route_index, total in enumerate(sums):
        for feature, weight in _normalise(total).items():
            dense[feature][size + route_index] = weight
    table = {f: (idf[f], tuple(v * idf[f] for v in row)) for f, row in dense.items()}
    entries = {word: _word_entry(stem, _gram_counts(word, low, high), table, unseen,
                                 2 * size)
               for word, (stem, _) in vocabulary.items()}
    word_postings: list[dict[str, tuple[tuple[int, float], ...]]] = []
    for mapping in features:
        per_word: dict[str, tuple[tuple[int, float], ...]] = {}
        for word in vocabulary:
            found = _word_posting(_gram_counts(word, low, high), mapping)
            if found:
                per_word[word] = found
        word_postings.append(per_word)
    return _ExampleModel(
        table=table,
        words=entries,
        unseen=unseen,
        size=size,
        features=tuple(features),
        word_postings=tuple(word_postings),
        postings=tuple(postings),
        routes=tuple(routes),
        positions={route: position for position, route in enumerate(routes)},
        per_route=len(texts) / size,
        low=low,
        high=high,
    )
