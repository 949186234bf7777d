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

Layout: a model is tens of thousands of per-word parts held for the process's life, and
CPython's cyclic garbage collector walks every object it tracks in each full collection.
So the parts are built from objects it does not track: a route's hits of one feature
are packed records in one `bytes` (never tracked, 12 bytes a hit, read back in C by
`struct.iter_unpack`); the routes that have hits are a `str` (route position i as
`chr(i)`, found with `str.find`); entries are tuples of those, of floats and of tuples
of floats, which the collector stops tracking in its first passes. No dict sits inside
a tuple or another dict (that would keep both tracked): the few objects left tracked
are per model, not per word.
"""

from __future__ import annotations

import heapq
import itertools
import math
import operator
import random
import struct
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence

from .._exceptions import ConfigurationError
from ._text import counts, gram_counts, inverse_frequencies, word_features, words

__all__ = ["ExampleModel", "build_examples"]

_RECORD = struct.Struct("=id")
"""One hit: the example id (int32) and the partial dot product (float64), unaligned."""
Hits = bytes
"""One route's hits of one feature, heaviest first: `_RECORD`s packed in a `bytes`."""
RouteHits = tuple[str, tuple[Hits, ...]]
"""The routes with hits (route position i as `chr(i)`) and, in that order, their hits."""
FeatureEntry = tuple[float, float, bytes, str, tuple[Hits, ...]]
"""A feature's IDF, IDF², linear row (weights × IDF, packed doubles: see `_packed`),
routes with hits and their hits."""
Follow = dict[str, FeatureEntry]
"""The bigrams starting with one stem: next stem -> the bigram's entry."""
WordEntry = tuple[str, float, bytes | None, str | None, tuple[Hits, ...]]
"""A word's stem, squared norm, summed IDF-weighted linear row (None: no known feature),
the routes with nearest-example hits and their hits (routes None: a word not in the
examples, whose hits are computed per route when needed)."""

MAX_ROUTES = 4096
"""Routes with examples one model holds: every feature keeps a linear row of this many
floats, and a route's position is stored as one character (`chr`)."""
MAX_EXAMPLES = 2**31 - 1
"""Usable utterances one model holds (an example id is stored as an int32)."""

MIN_KNN_DF = 30
"""Features in at most this many examples always stay in the nearest-example index."""
UNSEEN_CACHE_SIZE = 4096
"""Entries of query words not in the examples kept per model (oldest evicted first)."""

_second = operator.itemgetter(1)
_records = _RECORD.iter_unpack
_NO_HITS: RouteHits = ("", ())
_NO_FOLLOW: Follow = {}


def _pack(sums: Mapping[int, float]) -> Hits:
    """`sums` (example id -> value) as hits, heaviest first."""
    ranked = sorted(sums.items(), key=_second, reverse=True)
    return b"".join(itertools.starmap(_RECORD.pack, ranked))


def _heaviest(hits: Hits) -> float:
    """The value of the first (heaviest) hit."""
    value: float = _RECORD.unpack_from(hits)[1]
    return value


def _by_route(merged: Mapping[int, Mapping[int, float]]) -> RouteHits:
    """Per route (in `merged`'s order), its examples' summed values as hits."""
    if not merged:
        return _NO_HITS
    return "".join(map(chr, merged)), tuple(map(_pack, merged.values()))


class ExampleModel:
    """Per-route linear weights and nearest-example hits, built once from the examples."""

    __slots__ = (
        "_follow",
        "_table",
        "_unpack",
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
                 owners: tuple[int, ...], shape: tuple[int, int, float, float, bool]) -> None:
        self._table, self._follow = tables
        """word features -> entry; first stem -> the bigrams it starts."""
        self.words = entries
        """every word of the examples -> its entry (others are computed per query)."""
        self.routes = routes
        self.positions = {route: position for position, route in enumerate(routes)}
        self.size = len(routes)
        self._unpack = struct.Struct(f"={self.size}d").unpack
        """A packed linear row (`_packed`) back to its floats."""
        self.owners = owners
        """example id -> route position."""
        self.low, self.high, self._unseen, self.per_route, self.described = shape
        """n-gram sizes, the IDF of an unseen feature, the mean number of examples per
        route (chooses the few-shot calibration) and whether description phrases were
        trained on (chooses the few-shot default)."""
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
        squares, row = _linear_part(gram_counts(word, self.low, self.high),
                                    self._table, self._unseen)
        entry = (word_features(word, self.low, self.high)[0], squares, row, None, ())
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
        found = _word_hits(gram_counts(word, self.low, self.high), self._table, route)
        cache = self.unseen_hits
        if len(cache) >= UNSEEN_CACHE_SIZE:
            del cache[next(iter(cache))]
            self.hit_evictions += 1
        cache[key] = found
        return found

    def signals(self, split: Sequence[str], neighbors: int, budget: int,
                routes: tuple[Sequence[int], int | None]
                ) -> tuple[list[float], list[float] | None]:
        """Per route: linear scores and (with `neighbors` > 0) the mean cosine of its
        `neighbors` nearest examples, walking at most `budget` hits.

        `routes` = (the candidates' routes, how many of them get the neighbour signal:
        the best by linear score; None: all). Other routes get 0.
        """
        size = self.size
        rows: list[tuple[float, ...]] = []
        unpack = self._unpack
        lists: list[RouteHits] = []
        unknown: list[str] = []
        squares = 0.0
        known = self.words.get
        follows = self._follow.get
        unseen = self._unseen * self._unseen
        previous: str | None = None
        for word in split:
            stem, square, row, found, hits = known(word) or self.word(word)
            squares += square
            if row is not None:
                rows.append(unpack(row))
            if found:
                lists.append((found, hits))
            elif found is None:
                unknown.append(word)
            if previous is not None:
                # The bigram (previous stem, this stem).
                bigram = follows(previous, _NO_FOLLOW).get(stem)
                if bigram is None:
                    squares += unseen
                else:
                    squares += bigram[1]
                    rows.append(unpack(bigram[2]))
                    if bigram[3]:
                        lists.append((bigram[3], bigram[4]))
            previous = stem
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
            key = chr(route)
            if unknown:
                lists += [self._hits(route, word) for word in unknown]
            picked = [among[index] for found, among in lists
                      if (index := found.find(key)) >= 0]
            if len(picked) == 1:
                # One word's hits: already heaviest first.
                top = itertools.islice(_records(picked[0]), min(neighbors, budget))
                nearest[route] = sum(map(_second, top)) * factor
                return linear, nearest
            sims = _walk(picked, budget)
            if sims:
                values = sorted(sims.values(), reverse=True)
                nearest[route] = sum(values[:neighbors]) * factor
            return linear, nearest
        lists += [self._hits(None, word) for word in unknown]
        if count is None and len(wanted) == size:
            picked = [hits for _, among in lists for hits in among]
        else:
            chosen: Collection[int] = set(
                wanted if count is None
                else heapq.nlargest(count, wanted, key=linear.__getitem__))
            picked = [hits for found, among in lists
                      for number, hits in zip(found, among, strict=True)
                      if ord(number) in chosen]
        taken = [0] * size
        owners = self.owners
        for example, value in sorted(_walk(picked, budget).items(), key=_second,
                                     reverse=True):
            route = owners[example]
            if taken[route] < neighbors:
                taken[route] += 1
                nearest[route] += value
        return linear, [value * factor for value in nearest]


def _bounded(lists: list[Hits], budget: int) -> Iterator[tuple[int, float]]:
    """The hits of `lists`, at most `budget` of them: the heaviest lists first when
    there are more (bounded work whatever the query)."""
    pairs: Iterator[tuple[int, float]] = itertools.chain.from_iterable(map(_records, lists))
    if sum(map(len, lists)) <= budget * _RECORD.size:
        return pairs
    lists.sort(key=_heaviest, reverse=True)
    return itertools.islice(itertools.chain.from_iterable(map(_records, lists)), budget)


def _walk(lists: list[Hits], budget: int) -> dict[int, float]:
    """Summed partial dot products per example, over at most `budget` hits."""
    sims: dict[int, float] = {}
    get = sims.get
    for example, value in _bounded(lists, budget):
        sims[example] = get(example, 0.0) + value
    return sims


def _linear_part(grams: tuple[tuple[str, int], ...], table: Mapping[str, FeatureEntry],
                 unseen: float) -> tuple[float, bytes | None]:
    """A word's squared norm and summed linear row (None: no known feature)."""
    squares = 0.0
    rows: list[tuple[float, ...]] = []
    for gram, count in grams:
        entry = table.get(gram)
        if entry is None:
            squares += (count * unseen) ** 2
            continue
        idf, _, row, _, _ = entry
        squares += (count * idf) ** 2
        if row:
            values = _unpacked(row)
            rows.append(values if count == 1 else tuple(count * v for v in values))
    return squares, _packed(list(map(sum, zip(*rows, strict=True)))) if rows else None


def _packed(row: Sequence[float]) -> bytes:
    """`row` as packed doubles in a `bytes`: under a third of a tuple of floats' memory
    and not walked by the garbage collector; a query unpacks the fifteen or so it sums."""
    return struct.pack(f"={len(row)}d", *row)


def _unpacked(row: bytes) -> tuple[float, ...]:
    return struct.unpack(f"={len(row) >> 3}d", row)


def _word_hits(grams: tuple[tuple[str, int], ...], table: Mapping[str, FeatureEntry],
               route: int | None = None) -> RouteHits:
    """A word's hits: its n-grams' hits summed per example, per route (only `route`'s
    when given)."""
    merged: dict[int, dict[int, float]] = {}
    wanted = "" if route is None else chr(route)
    for gram, count in grams:
        entry = table.get(gram)
        if entry is None:
            continue
        _, _, _, routes, lists = entry
        if route is None:
            parts: Iterable[tuple[str, Hits]] = zip(routes, lists, strict=True)
        elif (index := routes.find(wanted)) >= 0:
            parts = ((wanted, lists[index]),)
        else:
            continue
        for number, hits in parts:
            sums = merged.setdefault(ord(number), {})
            for example, value in _records(hits):
                sums[example] = sums.get(example, 0.0) + count * value
    return _by_route(merged)


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
        if index == MAX_ROUTES:
            raise ConfigurationError(
                f"examples holds more than {MAX_ROUTES} routes; route {route!r:.60} is one "
                "too many (every feature keeps a linear weight per route)")
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
    if len(texts) > MAX_EXAMPLES:
        raise ConfigurationError(
            f"examples holds {len(texts)} usable utterances, more than {MAX_EXAMPLES}")
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
    zero = _packed((0.0,) * size)
    table: dict[str, FeatureEntry] = {}
    for feature, weight in idf.items():
        row = linear.get(feature)
        found, hits = _by_route(postings.get(feature, {}))
        table[feature] = (weight, weight * weight,
                          _packed([v * weight for v in row]) if row else zero, found, hits)
    # Bigram keys are the word entries' own stem objects: lookups match by identity.
    stems = {stem: stem for stem in vocabulary.values()}
    follows: dict[str, Follow] = {}
    for feature in [f for f in table if f.startswith("b:")]:
        first, _, second = feature[2:].partition(" ")
        follows.setdefault(stems.get(first, first), {})[stems.get(second, second)] = (
            table.pop(feature))
    entries: dict[str, WordEntry] = {}
    for word, stem in vocabulary.items():
        grams = gram_counts(word, low, high)
        squares, summed = _linear_part(grams, table, unseen)
        entries[word] = (stem, squares, summed, *_word_hits(grams, table))
    return ExampleModel((table, follows), entries, tuple(routes), tuple(owners),
                        (low, high, unseen, own / size, len(texts) > own))
