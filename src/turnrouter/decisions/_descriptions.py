"""The description model of `LexicalDecisions`: routes scored from names and descriptions.

Per distinct candidate set (cached by the service): TF-IDF vectors of each candidate's
whole name + description and of each of its phrases (the description split at
punctuation and "and"/"or", plus the name), weighed with the IDF of the whole
descriptions (a phrase is a field of its route, not a document of its own). Stopwords
are dropped. A query's score for a route is (1 − `phrase_weight`) × cosine to the whole
text + `phrase_weight` × cosine to its best phrase.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .._contracts import RoutingAid
from ._text import (
    STOPWORDS,
    aid_text,
    features,
    inverse_frequencies,
    phrases,
    weigh,
    word_features,
    words,
)

__all__ = ["WORD_CACHE_SIZE", "DescriptionModel", "WordCache", "build_descriptions"]

_Entry = tuple[float, tuple[tuple[int, float], ...]]
"""A feature's IDF² and ((slot, IDF × weight), ...)."""
_Word = tuple[str, float, tuple[tuple[int, float], ...]]
"""A query word's stem, squared norm and ((slot, summed IDF × weight), ...)."""
_NO_FOLLOW: dict[str, _Entry] = {}
WORD_CACHE_SIZE = 4096
"""Query words (per description model) whose summed n-gram parts one service keeps."""


class WordCache:
    """The query words' parts of every description model of one service, bounded as a
    whole (`WORD_CACHE_SIZE`, oldest evicted first, evictions counted). Keys are
    (model serial, word): a model evicted from the service's LRU leaves its words to
    age out, and a serial is never reused."""

    __slots__ = ("entries", "evictions", "serials")

    def __init__(self) -> None:
        self.entries: dict[tuple[int, str], _Word] = {}
        self.evictions = 0
        self.serials = 0

    def add(self, key: tuple[int, str], entry: _Word) -> None:
        entries = self.entries
        if len(entries) >= WORD_CACHE_SIZE:
            del entries[next(iter(entries))]
            self.evictions += 1
        entries[key] = entry


class DescriptionModel:
    """Per-candidate-set vectors: slots 0..n-1 are the candidates' whole name +
    description, the next ones each phrase's own L2-normalised vector."""

    __slots__ = ("_cache", "_follow", "_owners", "_serial", "_table", "_unseen", "high",
                 "low", "size", "vocabulary")

    def __init__(self, table: dict[str, _Entry],
                 unseen: float, size: int, owners: tuple[int, ...],
                 vocabulary: frozenset[str], ngrams: tuple[int, int],
                 cache: WordCache) -> None:
        self._table = table
        """word feature -> (IDF², ((slot, IDF × weight), ...))."""
        self._follow: dict[str, dict[str, _Entry]] = {}
        """first stem -> second stem -> the bigram's entry (moved out of `_table`)."""
        for feature in [f for f in table if f.startswith("b:")]:
            first, _, second = feature[2:].partition(" ")
            self._follow.setdefault(first, {})[second] = table.pop(feature)
        self._unseen = unseen * unseen
        self.size = size
        self._owners = owners
        """phrase number -> candidate position."""
        self.vocabulary = vocabulary
        """The words of the candidates' names and descriptions (for `coverage`)."""
        self.low, self.high = ngrams
        self._cache = cache
        cache.serials += 1
        self._serial = cache.serials

    def word(self, word: str) -> _Word:
        """A query word's stem, squared norm and per-slot weights summed over its
        n-grams (cached: one lookup per word instead of one per n-gram, whose scattered
        entries cost a cache miss each once a busy router's state evicted them)."""
        stem, grams = word_features(word, self.low, self.high)
        get = self._table.get
        squares = 0.0
        merged: dict[int, float] = {}
        for gram in grams:
            found = get(gram)
            if found is None:
                squares += self._unseen
                continue
            squares += found[0]
            for slot, weight in found[1]:
                merged[slot] = merged.get(slot, 0.0) + weight
        entry = (stem, squares, tuple(merged.items()))
        self._cache.add((self._serial, word), entry)
        return entry

    def scores(self, split: Sequence[str], phrase_weight: float) -> list[float]:
        """Per candidate: (1 - phrase_weight) × cosine to the whole name + description +
        phrase_weight × cosine to its best-matching phrase.

        The query side counts every n-gram occurrence on its own (no merging across
        words, linear TF), so no per-query dictionaries are built; each word's n-grams
        are summed once and cached (`word`).
        """
        size = self.size
        sums = [0.0] * (size + len(self._owners))
        cached = self._cache.entries.get
        serial = self._serial
        follows = self._follow.get
        unseen = self._unseen
        squares = 0.0
        previous: str | None = None
        for word in split:
            if word in STOPWORDS:
                continue
            stem, square, parts = cached((serial, word)) or self.word(word)
            squares += square
            for slot, weight in parts:
                sums[slot] += weight
            if previous is not None:
                # The bigram (previous stem, this stem), without building its key.
                entry = follows(previous, _NO_FOLLOW).get(stem)
                if entry is None:
                    squares += unseen
                else:
                    squares += entry[0]
                    for slot, weight in entry[1]:
                        sums[slot] += weight
            previous = stem
        if squares == 0.0:
            return [0.0] * size
        scale = 1.0 / math.sqrt(squares)
        if phrase_weight == 0.0:
            return [value * scale for value in sums[:size]]
        best = [0.0] * size
        for number, position in enumerate(self._owners):
            value = sums[size + number]
            if value > best[position]:
                best[position] = value
        return [((1.0 - phrase_weight) * whole + phrase_weight * part) * scale
                for whole, part in zip(sums, best, strict=False)]


def build_descriptions(candidates: Sequence[RoutingAid], ngrams: tuple[int, int],
                       phrase_weight: float, cache: WordCache) -> DescriptionModel:
    """The description model of one candidate set (its query words cached in `cache`,
    shared by a service's models)."""
    low, high = ngrams
    docs = [features(aid_text(aid), low, high, drop_stopwords=True) for aid in candidates]
    idf, unseen = inverse_frequencies(docs)
    index: dict[str, list[tuple[int, float]]] = {}
    for position, term_counts in enumerate(docs):
        for feature, weight in weigh(term_counts, idf, unseen).items():
            index.setdefault(feature, []).append((position, weight))
    owners: list[int] = []
    if phrase_weight > 0.0:
        for position, aid in enumerate(candidates):
            for phrase in phrases(aid):
                vector = weigh(features(phrase, low, high, drop_stopwords=True), idf, unseen)
                if not vector:
                    continue
                slot = len(candidates) + len(owners)
                owners.append(position)
                for feature, weight in vector.items():
                    index.setdefault(feature, []).append((slot, weight))
    # A phrase may hold features the whole text's first 1,000,000 characters lack (a
    # word cut at that bound, phrases past it): unseen, as `weigh` takes them.
    table = {f: (weight ** 2, tuple((slot, weight * w) for slot, w in entries))
             for f, entries in index.items() for weight in (idf.get(f, unseen),)}
    vocabulary = frozenset(word for aid in candidates
                           for word in words(aid_text(aid), 100_000, 100_000))
    return DescriptionModel(table, unseen, len(candidates), tuple(owners), vocabulary, ngrams,
                            cache)

