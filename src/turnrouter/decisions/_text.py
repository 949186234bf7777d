"""Text features shared by `LexicalDecisions`' example and description models.

Words are NFKC + lower-case alphanumeric runs (apostrophes joined), stemmed by stripping
one common English suffix; a word's features are its stem (`w:`) and its character
n-grams taken inside the word padded with spaces; a text adds stem bigrams (`b:`).
Per-word work is cached process-wide in bounded LRU caches.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache

from .._contracts import RoutingAid

MAX_WORD = 32
"""Longer words are cut: bounds the character n-grams per word and the word caches."""
WORD_CACHE_ENTRIES = 16384
"""Process-wide LRU bound of each per-word cache (stems, n-grams, n-gram counts): with
words of at most 32 characters, a flood of distinct junk words holds tens of MB at most."""

_WORD_RE = re.compile(r"[a-z0-9]+")

# Function words: dropped from description matching, where an IDF over a handful of
# routes cannot learn that they carry no routing signal, and not counted by `coverage`.
STOPWORDS = frozenset(
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


@lru_cache(maxsize=WORD_CACHE_ENTRIES)
def stem(word: str) -> str:
    """Strip one common English suffix, keeping a stem of at least three letters."""
    for suffix in _SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            base = word[: -len(suffix)]
            if suffix in ("ies", "ied"):
                return base + "y"
            return base
    return word


@lru_cache(maxsize=WORD_CACHE_ENTRIES)
def word_features(word: str, low: int, high: int) -> tuple[str, tuple[str, ...]]:
    """A word's stem and its unigram + character n-gram features (cached per word).

    N-grams are taken from the word padded with spaces, so boundaries are features too.
    """
    base = stem(word)
    padded = f" {word} "
    grams: list[str] = ["w:" + base]
    size = len(padded)
    for n in range(low, high + 1):
        if n > size:
            break
        grams.extend(padded[i : i + n] for i in range(size - n + 1))
    return base, tuple(grams)


@lru_cache(maxsize=WORD_CACHE_ENTRIES)
def gram_counts(word: str, low: int, high: int) -> tuple[tuple[str, int], ...]:
    """A word's unigram + n-gram features with their counts inside the word (cached)."""
    counts: dict[str, int] = {}
    for gram in word_features(word, low, high)[1]:
        counts[gram] = counts.get(gram, 0) + 1
    return tuple(counts.items())


def words(text: str, max_chars: int, max_words: int) -> list[str]:
    """Normalised lower-case alphanumeric words; apostrophes join ("what's" -> "whats").

    At most `max_chars` characters are read and `max_words` words (each cut to
    `MAX_WORD` characters) kept, so any input costs bounded work.
    """
    text = text[:max_chars]
    # ASCII text is already NFKC: skip the normalisation pass (most queries).
    text = text.lower() if text.isascii() else unicodedata.normalize("NFKC", text).lower()
    if "'" in text or "\u2019" in text:
        text = text.replace("'", "").replace("\u2019", "")
    found = _WORD_RE.findall(text, 0, max_chars * 2)
    if len(found) > max_words:
        del found[max_words:]
    return [w if len(w) <= MAX_WORD else w[:MAX_WORD] for w in found]


def features(text: str, low: int, high: int, *, drop_stopwords: bool = False,
             max_chars: int = 1_000_000, max_words: int = 1_000_000) -> dict[str, int]:
    """Term counts of `text`: stemmed word unigrams and bigrams, then char n-grams.

    Stopwords are kept for example models (IDF learns their weight, and "no" or "who are
    you" are intents) and dropped for descriptions, where IDF over a few routes cannot.
    """
    return counts(words(text, max_chars, max_words), low, high, drop_stopwords)


def counts(split: Sequence[str], low: int, high: int, drop_stopwords: bool
           ) -> dict[str, int]:
    """The term counts of `features` from already split words."""
    if drop_stopwords:
        split = [w for w in split if w not in STOPWORDS]
    out: dict[str, int] = {}
    get = out.get
    previous = ""
    for word in split:
        base, grams = word_features(word, low, high)
        for gram in grams:
            out[gram] = get(gram, 0) + 1
        if previous:
            key = f"b:{previous} {base}"
            out[key] = get(key, 0) + 1
        previous = base
    return out


def weigh(term_counts: Mapping[str, int], idf: Mapping[str, float], unseen: float
          ) -> dict[str, float]:
    """Sublinear TF times IDF, L2-normalised; unseen features keep the largest IDF."""
    vector = {f: (1.0 + math.log(c)) * idf.get(f, unseen) for f, c in term_counts.items()}
    return normalise(vector)


def inverse_frequencies(documents: Sequence[Iterable[str]]) -> tuple[dict[str, float], float]:
    """Smoothed IDF over `documents` and the IDF an unseen feature gets."""
    df: dict[str, int] = {}
    for doc in documents:
        for feature in doc:
            df[feature] = df.get(feature, 0) + 1
    total = len(documents)
    idf = {f: math.log((1 + total) / (1 + n)) + 1.0 for f, n in df.items()}
    return idf, math.log(1 + total) + 1.0


def normalise(vector: Mapping[str, float]) -> dict[str, float]:
    """`vector` divided by its L2 norm (empty when the norm is zero)."""
    norm = math.sqrt(sum(v * v for v in vector.values()))
    if norm == 0.0:
        return {}
    return {f: v / norm for f, v in vector.items()}


def route_words(name: str) -> str:
    """A route name with snake/kebab case split into words."""
    return name.replace("_", " ").replace("-", " ")


def aid_text(aid: RoutingAid) -> str:
    """A route's name (snake/kebab case split into words) followed by its description."""
    return f"{route_words(aid.name)} {aid.description}"


# Phrase boundaries inside a description: punctuation and the coordinating "and"/"or",
# so "balance, transfers and bills" is three phrases.
_PHRASE_SPLIT_RE = re.compile(r"[.,;:!?()\[\]/]|\band\b|\bor\b|\s[-\u2013\u2014]\s",
                              re.IGNORECASE)


def phrases(aid: RoutingAid) -> list[str]:
    """The route's description split into phrases, plus its name as a phrase of its own."""
    return description_phrases(aid.name, aid.description)


def description_phrases(name: str, description: str) -> list[str]:
    """`description` split into phrases (surrounding spaces removed, empty ones dropped),
    plus the route `name` as a phrase of its own."""
    parts = [part.strip() for part in _PHRASE_SPLIT_RE.split(description)]
    parts = [part for part in parts if part]
    parts.append(route_words(name).strip())
    return parts
