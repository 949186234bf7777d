"""The example model of `LexicalDecisions`: a linear ranker and a nearest-example index.

Built once from the example utterances. A text's vector is the sum of its words' vectors
(the word's stem and character n-grams) and of its bigrams, each feature weighted by
count × IDF, divided by the root of the summed squared norms of those parts (n-grams
shared by two words are not merged for the norm). So a query's scores are plain sums of
precomputed per-word parts:

- `linear`: per route, the averaged-perceptron score (rows of per-route weights × IDF);
- `neighbors`: per route, the mean cosine of its `neighbors` nearest examples, over the
  features found in at most `max(30, max_document_frequency × examples)` examples. Each
  word carries its merged hits (example id, partial dot product), heaviest first, so
  the walk is one dictionary update per hit, at most `knn_budget` hits per query.
"""

from __future__ import annotations

import heapq
import itertools
import math
import operator
import random
from array import array
from collections.abc import Collection, Iterable, Mapping, Sequence

from .._exceptions import ConfigurationError
from ._text import counts, gram_counts, inverse_frequencies, word_features, words

__all__ = ["ExampleModel", "build_examples"]

Hits = tuple["array[int]", "array[float]"]
"""(example ids, partial dot products with those examples), heaviest first: two
arrays, a few bytes per hit, since every word of the examples carries its own."""
RouteHits = dict[int, Hits]
"""route position -> the hits among that route's examples."""
FeatureEntry = tuple[float, tuple[float, ...], RouteHits]
"""A feature's IDF, linear row (weights × IDF) and hits per route."""
Follow = dict[str, FeatureEntry]
"""The bigrams starting with one stem: next stem -> the bigram's entry."""
WordEntry = tuple[str, float, Sequence[float] | None, RouteHits | None, Follow]
"""A word's stem, squared norm, summed IDF-weighted linear row (None: no known feature),
its nearest-example hits per route (None: a word not in the examples, whose hits are
computed per route when needed) and the bigrams its stem starts."""

MIN_KNN_DF = 30
"""Features in at most this many examples always stay in the nearest-example index."""
UNSEEN_CACHE_SIZE = 4096
"""Entries of query words not in the examples kept per model (oldest evicted first)."""

_second = operator.itemgetter(1)
_NO_HITS: RouteHits = {}
_NO_FOLLOW: Follow = {}


class ExampleModel:
    """Per-route linear weights and nearest-example hits, built once from the examples."""

    __slots__ = (
        "_follow",
        "_table",
        "_unseen",
        "described",
        "evictions",
        "high",
        "hit_evictions",
        "low",
        "owners",
        "per_route",
        "positions",
        "routes",
        "size",
        "unseen_hits",
        "unseen_words",
        "words",
    )

    def __init__(self, tables: tuple[dict[str, FeatureEntry], dict[str, Follow]],
                 entries: dict[str, WordEntry], routes: tuple[str, ...],
                 owners: tuple[int, ...], shape: tuple[int, int, float, float],
                 described: bool) -> None:
        self._table, self._follow = tables
        """word features -> entry; first stem -> the bigrams it starts."""
        self.words = entries
        """every word of the examples -> its entry (others are computed per query)."""
        self.routes = routes
        self.positions = {route: position for position, route in enumerate(routes)}
        self.size = len(routes)
        self.owners = owners
        """example id -> route position."""
        self.low, self.high, self._unseen, self.per_route = shape
        """n-gram sizes, the IDF of an unseen feature, and the mean number of examples
        per route (chooses the few-shot calibration)."""
        self.described = described
        """Whether description phrases were trained on (chooses the few-shot default)."""
        self.unseen_words: dict[str, WordEntry] = {}
        self.evictions = 0
        self.unseen_hits: dict[tuple[int, str], RouteHits] = {}
        """(route or -1 for every route, query word not in the examples) -> its hits."""
        self.hit_evictions = 0

    def word(self, word: str) -> WordEntry:
        """The entry of `word`: precomputed for example words, else computed (cached)."""
        entry = self.words.get(word) or self.unseen_words.get(word)
        if entry is not None:
            return entry
        stem = word_features(word, self.low, self.high)[0]
        stem, squares, row, hits, follow = _word_entry(
            stem, gram_counts(word, self.low, self.high), self._table, self._unseen,
            self._follow.get(stem, _NO_FOLLOW), False)
        # Cached per service: the row as 8-byte doubles, not float objects.
        entry = (stem, squares, array("d", row) if row is not None else None, hits, follow)
        cache = self.unseen_words
        if len(cache) >= UNSEEN_CACHE_SIZE:
            del cache[next(iter(cache))]
            self.evictions += 1
        cache[word] = entry
        return entry

    def _hits(self, route: int | None, word: str) -> RouteHits:
        """The hits of a word not in the examples among `route`'s examples (None: every
        route's), per route; cached, at most `UNSEEN_CACHE_SIZE` (route, word) entries."""
        key = (-1 if route is None else route, word)
        found = self.unseen_hits.get(key)
        if found is not None:
            return found
        merged: dict[int, dict[int, float]] = {}
        for gram, count in gram_counts(word, self.low, self.high):
            entry = self._table.get(gram)
            if entry is None:
                continue
            by_route = entry[2]
            if route is None:
                parts: Iterable[tuple[int, Hits]] = by_route.items()
            elif route in by_route:
                parts = ((route, by_route[route]),)
            else:
                continue
            for number, (ids, values) in parts:
                sums = merged.setdefault(number, {})
                for example, value in zip(ids, values, strict=True):
                    sums[example] = sums.get(example, 0.0) + count * value
        hits = _by_route(merged) if merged else _NO_HITS
        cache = self.unseen_hits
        if len(cache) >= UNSEEN_CACHE_SIZE:
            del cache[next(iter(cache))]
            self.hit_evictions += 1
        cache[key] = hits
        return hits

    def signals(self, split: Sequence[str], neighbors: int, budget: int,
                routes: tuple[Sequence[int], int | None]
                ) -> tuple[list[float], list[float] | None]:
        """Per route: linear scores and (with `neighbors` > 0) the mean cosine of its
        `neighbors` nearest examples, walking at most `budget` hits.

        `routes` = (the candidates' routes, how many of them get the neighbour signal:
        the best by linear score; None: all). Other routes get 0.
        """
        size = self.size
        rows: list[Sequence[float]] = []
        lists: list[RouteHits] = []
        unknown: list[str] = []
        squares = 0.0
        known = self.words.get
        unseen = self._unseen * self._unseen
        follow: Follow | None = None
        for word in split:
            stem, square, row, hits, following = known(word) or self.word(word)
            squares += square
            if row is not None:
                rows.append(row)
            if hits:
                lists.append(hits)
            elif hits is None:
                unknown.append(word)
            if follow is not None:
                # The bigram (previous stem, this stem).
                found = follow.get(stem)
                if found is None:
                    squares += unseen
                else:
                    squares += found[0] * found[0]
                    rows.append(found[1])
                    if found[2]:
                        lists.append(found[2])
            follow = following
        if not rows:
            return [0.0] * size, [0.0] * size if neighbors else None
        scale = 1.0 / math.sqrt(squares)
        # Column sums run in C: one sum per route.
        linear = [value * scale for value in map(sum, zip(*rows, strict=True))]
        if not neighbors:
            return linear, None
        nearest = [0.0] * size
        factor = scale / neighbors
        wanted, count = routes
        if count == 1:
            route = max(wanted, key=linear.__getitem__)
            sims: dict[int, float] = {}
            get = sims.get
            picked = [among for by_route in lists if (among := by_route.get(route))]
            if unknown:
                picked += [among for word in unknown
                           if (among := self._hits(route, word).get(route))]
            if len(picked) == 1:
                # One word's hits: already heaviest first.
                nearest[route] = sum(picked[0][1][:min(neighbors, budget)]) * factor
                return linear, nearest
            for example, value in _bounded(picked, budget):
                sims[example] = get(example, 0.0) + value
            if sims:
                values = sorted(sims.values(), reverse=True)
                nearest[route] = sum(values[:neighbors]) * factor
            return linear, nearest
        if count is None and len(wanted) == size:
            chosen: Collection[int] = range(size)
            picked = [among for by_route in lists for among in by_route.values()]
        else:
            chosen = set(wanted if count is None
                         else heapq.nlargest(count, wanted, key=linear.__getitem__))
            picked = [among for by_route in lists for route, among in by_route.items()
                      if route in chosen]
        for word in unknown:
            by_route = self._hits(None, word)
            picked += [among for route, among in by_route.items() if route in chosen]
        taken = [0] * size
        owners = self.owners
        for example, value in sorted(_walk(picked, budget).items(), key=_second,
                                     reverse=True):
            route = owners[example]
            if taken[route] < neighbors:
                taken[route] += 1
                nearest[route] += value
        return linear, [value * factor for value in nearest]


def _bounded(lists: list[Hits], budget: int) -> Iterable[tuple[int, float]]:
    """The hits of `lists`, at most `budget` of them: the heaviest lists first when
    there are more (bounded work whatever the query)."""
    pairs = itertools.chain.from_iterable(itertools.starmap(zip, lists))
    if sum(len(ids) for ids, _ in lists) <= budget:
        return pairs
    lists.sort(key=lambda hits: hits[1][0], reverse=True)
    return itertools.islice(itertools.chain.from_iterable(itertools.starmap(zip, lists)),
                            budget)


def _walk(lists: list[Hits], budget: int) -> dict[int, float]:
    """Summed partial dot products per example, over at most `budget` hits."""
    sims: dict[int, float] = {}
    get = sims.get
    for example, value in _bounded(lists, budget):
        sims[example] = get(example, 0.0) + value
    return sims


def _word_entry(stem: str, grams: tuple[tuple[str, int], ...],
                table: Mapping[str, FeatureEntry], unseen: float, follow: Follow,
                with_hits: bool = True) -> WordEntry:
    """A word's entry; without `with_hits`, hits are left to `ExampleModel._hits`."""
    squares = 0.0
    rows: list[tuple[float, ...]] = []
    merged: dict[int, dict[int, float]] = {}
    for gram, count in grams:
        entry = table.get(gram)
        if entry is None:
            squares += (count * unseen) ** 2
            continue
        idf, row, by_route = entry
        squares += (count * idf) ** 2
        if row:
            rows.append(row if count == 1 else tuple(count * v for v in row))
        if not with_hits:
            continue
        for route, (ids, values) in by_route.items():
            sums = merged.setdefault(route, {})
            for example, value in zip(ids, values, strict=True):
                sums[example] = sums.get(example, 0.0) + count * value
    summed = tuple(map(sum, zip(*rows, strict=True))) if rows else None
    if not with_hits:
        return stem, squares, summed, None, follow
    return stem, squares, summed, _by_route(merged) if merged else _NO_HITS, follow


def _by_route(merged: Mapping[int, Mapping[int, float]]) -> RouteHits:
    """Per route, its examples' summed values as hits, heaviest first."""
    out: RouteHits = {}
    for route, sums in merged.items():
        ranked = sorted(sums.items(), key=_second, reverse=True)
        out[route] = (array("i", [example for example, _ in ranked]),
                      array("d", [value for _, value in ranked]))
    return out


def train_linear(
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


def _texts(examples: Mapping[str, Sequence[str]], limits: tuple[int, int, int, int],
           extra: Mapping[str, Sequence[str]]
           ) -> tuple[list[str], list[tuple[int, list[str], dict[str, int]]], int]:
    """Route names; per usable utterance, (route position, words, term counts); and how
    many of those are examples (the `extra` texts of a route with examples follow its
    own)."""
    if not isinstance(examples, Mapping):
        raise ConfigurationError(
            f"examples must be a mapping of route name to utterances, got "
            f"{type(examples).__name__}"
        )
    max_chars, max_words, low, high = limits
    routes: list[str] = []
    texts: list[tuple[int, list[str], dict[str, int]]] = []
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
            split = words(text, max_chars, max_words)
            term_counts = counts(split, low, high, False)
            if term_counts:
                texts.append((index, split, term_counts))
    own = len(texts)
    for index, route in enumerate(routes):
        for text in extra.get(route, ()):
            split = words(text, max_chars, max_words)
            term_counts = counts(split, low, high, False)
            if term_counts:
                texts.append((index, split, term_counts))
    return routes, texts, own


def build_examples(examples: Mapping[str, Sequence[str]], limits: tuple[int, int, int, int],
                   max_df: float, epochs: int, extra: Mapping[str, Sequence[str]]
                   ) -> ExampleModel | None:
    """The example model (None when no example has a feature).

    `limits` = (max query chars, max query words, low, high n-gram sizes); `extra` =
    more texts per route (its description's phrases), trained on as examples but not
    counted in `per_route`.
    """
    routes, texts, own = _texts(examples, limits, extra)
    if not own:
        return None
    low, high = limits[2], limits[3]
    size = len(routes)
    documents = [term_counts for _, _, term_counts in texts]
    idf, unseen = inverse_frequencies(documents)
    df: dict[str, int] = {}
    for term_counts in documents:
        for feature in term_counts:
            df[feature] = df.get(feature, 0) + 1
    vocabulary: dict[str, str] = {}
    for _, split, _ in texts:
        for word in split:
            if word not in vocabulary:
                vocabulary[word] = word_features(word, low, high)[0]
    word_squares = {
        word: sum((count * idf[gram]) ** 2 for gram, count in gram_counts(word, low, high))
        for word in vocabulary
    }
    cutoff = max(MIN_KNN_DF, int(max_df * len(texts)))
    postings: dict[str, dict[int, dict[int, float]]] = {}
    vectors: list[tuple[tuple[str, ...], tuple[float, ...]]] = []
    labels: list[int] = []
    owners: list[int] = []
    for example_id, (route_index, split, term_counts) in enumerate(texts):
        squares = sum(word_squares[word] for word in split) + sum(
            count * idf[f] ** 2 for f, count in term_counts.items() if f.startswith("b:"))
        norm = math.sqrt(squares)
        names = tuple(term_counts)
        vectors.append((names, tuple(term_counts[f] * idf[f] / norm for f in names)))
        labels.append(route_index)
        owners.append(route_index)
        for feature, count in term_counts.items():
            if df[feature] <= cutoff:
                # IDF squared: once for the query's weight, once for the example's.
                postings.setdefault(feature, {}).setdefault(route_index, {})[example_id] = (
                    count * idf[feature] ** 2 / norm)
    linear = train_linear(vectors, labels, size, epochs) if size > 1 else {}
    zero = (0.0,) * size
    table: dict[str, FeatureEntry] = {}
    for feature, weight in idf.items():
        row = linear.get(feature)
        posting = postings.get(feature)
        table[feature] = (weight, tuple(v * weight for v in row) if row else zero,
                          _by_route(posting) if posting else _NO_HITS)
    follows: dict[str, Follow] = {}
    for feature in [f for f in table if f.startswith("b:")]:
        first, _, second = feature[2:].partition(" ")
        follows.setdefault(first, {})[second] = table.pop(feature)
    entries = {word: _word_entry(stem, gram_counts(word, low, high), table, unseen,
                                 follows.get(stem, _NO_FOLLOW))
               for word, stem in vocabulary.items()}
    return ExampleModel((table, follows), entries, tuple(routes), tuple(owners),
                        (low, high, unseen, own / size), len(texts) > own)
