"""`TemplateAcknowledger`: route-aware acknowledgments without a model."""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping, Sequence

from .._acknowledgment import PROMPT_DESCRIPTION, PROMPT_QUERY, PROMPT_ROUTE, AcknowledgmentRequest
from .._redact import strip_surrogates

__all__ = ["DEFAULT_PHRASES", "GENERIC_PHRASES", "TemplateAcknowledger"]

#: `{subject}` is the route name as words ("billing", "smart home", "facts"): each
#: phrase reads right whatever the route is called, singular or plural ("your billing
#: question", "your facts request"; "the facts details" did not).
DEFAULT_PHRASES: tuple[str, ...] = (
    "Let me look into your {subject} question.",
    "One moment, I'm checking on your {subject} request.",
    "Give me a second, I'm on your {subject} question.",
    "Okay, I'm pulling that up for your {subject} request.",
    "One moment while I look into your {subject} request.",
    "Let me take a look at your {subject} question.",
)
#: For routes whose spoken topic `topics=` names ("your trip"): `{topic}` is that phrase.
_TOPIC_PHRASES: tuple[str, ...] = (
    "Let me check {topic}.",
    "One moment, I'm looking at {topic}.",
    "Let me look into {topic} for you.",
    "Okay, I'm pulling up {topic}.",
)
#: For routes without a useful topic (chit-chat, a general default).
GENERIC_PHRASES: tuple[str, ...] = (
    "Let me think about that.",
    "One moment.",
    "Give me a second.",
    "Let me see.",
)
_GENERIC_ROUTES = frozenset({
    "conversation", "chat", "general", "default", "smalltalk", "small_talk", "assistant",
    "fallback", "other",
})
_PERSONAL = re.compile(r"\b(your|user'?s?|my|personal|own)\b", re.IGNORECASE)
_WORD_TAIL = re.compile(r"[\w']+$")
_WORD = re.compile(r"[\w']+")
# How far before a topic word to look for "your"/"user's" (two short words fit).
_LOOKBEHIND = 64
#: Only the start of a route name becomes the spoken topic.
TOPIC_NAME_CHARS = 128
#: Only the start of a route description is searched for "your <topic>".
DESCRIPTION_SCAN_CHARS = 1024
#: Routes remembered to avoid repeating a phrase (longer names are not remembered).
_REMEMBERED_ROUTES = 1024
_REMEMBERED_NAME_CHARS = 256


def _occurrences(text: str, word: str) -> list[int]:
    """Start indexes of case-insensitive occurrences of `word` in `text`, left to right,
    not overlapping (like `re.finditer`), without compiling `word` as a pattern."""
    folded, key = text.lower(), word.lower()
    if len(folded) != len(text) or len(key) != len(word):  # lower() changed a length
        return [m.start() for m in re.finditer(re.escape(word), text, re.IGNORECASE)]
    starts: list[int] = []
    index = folded.find(key)
    while index >= 0:
        starts.append(index)
        index = folded.find(key, index + len(key))
    return starts


def _personal_before(description: str, first: str) -> bool:
    """Whether one of the (up to) two words right before `first` is personal.

    One linear pass over `description`: each case-insensitive occurrence of `first` looks
    back at most `_LOOKBEHIND` characters ("the user's calendar" -> True). A regex with a
    repeated word group before the topic word would rescan long words (quadratic).
    """
    description = description[:DESCRIPTION_SCAN_CHARS]
    if not first or len(first) > len(description):
        return False
    for start in _occurrences(description, first):
        head = description[max(0, start - _LOOKBEHIND):start]
        if not head or not head[-1].isspace():
            continue
        tokens = head.split()[-2:]
        if not tokens:
            continue
        last = _WORD_TAIL.search(tokens[-1])
        if last is None:
            continue
        if _PERSONAL.fullmatch(last.group(0)):
            return True
        if len(tokens) == 2 and _WORD.fullmatch(tokens[-1]):
            before = _WORD_TAIL.search(tokens[0])
            if before is not None and _PERSONAL.fullmatch(before.group(0)):
                return True
    return False


#: Words of a route name that say what it is, not what it is about ("billing_agent").
_ROLE_WORDS = frozenset({"agent", "bot", "service", "assistant", "destination", "route",
                         "skill", "handler"})
#: Short words read as words, not letters ("my", "a"); other words of one or two
#: letters are read as initials ("it" -> "IT", "hr" -> "HR"), as are words without a
#: vowel ("sql" -> "SQL").
_SHORT_WORDS = frozenset({"a", "an", "my", "of", "to", "in", "on", "at", "by", "or",
                          "and", "the", "for", "me", "we", "us", "go", "do", "no", "up"})
_VOWEL = re.compile(r"[aeiouy]", re.IGNORECASE)


def _words(name: str) -> str:
    """A route name as words a TTS reads right: "smart_home" -> "smart home",
    "it_support" -> "IT support", "sql_agent" -> "SQL", "BillingAgent" -> "billing";
    "" -> "" (only the first `TOPIC_NAME_CHARS` characters)."""
    spaced = re.sub(r"(?<=[a-z])(?=[A-Z])", " ", name[:TOPIC_NAME_CHARS])
    tokens = re.sub(r"[_\-.]+", " ", spaced).split()
    while len(tokens) > 1 and tokens[-1].lower() in _ROLE_WORDS:
        tokens.pop()
    spoken = []
    for token in tokens:
        lower = token.lower()
        if token.isalpha() and lower not in _SHORT_WORDS and (
                (len(token) > 1 and token.isupper()) or len(token) <= 2
                or not _VOWEL.search(token)):
            spoken.append(token.upper())
        else:
            spoken.append(lower)
    return " ".join(spoken)


def _subject(name: str) -> str:
    """A route name as words (`_words`), "that" when it has none."""
    return _words(name) or "that"


def spoken_topic(name: str, description: str = "") -> str:
    """A route's topic as spoken: 'calendar' + "the user's calendar" -> 'your calendar'.

    Only the first `TOPIC_NAME_CHARS` characters of the name are spoken.
    """
    words = _words(name)
    if not words:
        return "that"
    # "Your" when the description ties the topic to the user ("your calendar").
    if _personal_before(description, words.split()[0]):
        return "your " + words
    if words.startswith("my "):
        return "your " + words.removeprefix("my ")
    return "the " + words


class TemplateAcknowledger:
    """An `LLMService` and structured `Acknowledger` that needs no model.

    It speaks short, varied, route-aware phrases ("Let me check your calendar.") built
    from the routing aid, never a promise of a result. The router uses the structured
    `acknowledge()` path directly; `complete()` parses the route from the documented
    acknowledgment prompt, so it also works wherever an `LLMService` is expected.

    Consecutive acknowledgments of one route never repeat the same phrase.

    Args:
        phrases: Templates with `{subject}`, the route name as words ("Let me look into
            your {subject} question."), and/or `{topic}`, the spoken topic ("Let me
            check {topic}." -> "Let me check your calendar.").
        generic_phrases: Phrases without a topic ("One moment."), for generic routes.
        topics: Spoken topic per route name ("your trip"); with the default phrases such
            a route is acknowledged with topic phrases ("Let me check your trip.").
            Other routes' `{topic}` is `spoken_topic(name, description)`.
        generic_routes: Routes answered with generic phrases.
    """

    def __init__(
        self, *, phrases: Sequence[str] | None = None,
        generic_phrases: Sequence[str] = GENERIC_PHRASES,
        topics: Mapping[str, str] | None = None,
        generic_routes: frozenset[str] = _GENERIC_ROUTES,
    ) -> None:
        if (phrases is not None and not phrases) or not generic_phrases:
            raise ValueError("TemplateAcknowledger needs at least one phrase of each kind")
        for phrase in phrases or ():
            phrase.format(topic="x", subject="x")  # fail early on a malformed template
        self._phrases = DEFAULT_PHRASES if phrases is None else tuple(phrases)
        self._topic_phrases = _TOPIC_PHRASES if phrases is None else self._phrases
        self._generic = tuple(generic_phrases)
        self._topics = dict(topics or {})
        self._generic_routes = generic_routes
        self._last: dict[str, int] = {}

    def phrase(self, route: str, description: str = "", key: str = "") -> str:
        """The acknowledgment for `route`; `key` (e.g. a turn id) varies the choice."""
        generic = route.lower() in self._generic_routes and route not in self._topics
        named = route in self._topics
        choices = (self._generic if generic
                   else self._topic_phrases if named else self._phrases)
        index = zlib.crc32(f"{route}\x00{key}".encode("utf-8", "surrogatepass")) % len(choices)
        if len(choices) > 1 and self._last.get(route) == index:
            index = (index + 1) % len(choices)
        if len(route) <= _REMEMBERED_NAME_CHARS and (
                len(self._last) < _REMEMBERED_ROUTES or route in self._last):
            self._last[route] = index
        if generic:
            return choices[index]
        topic = self._topics.get(route) or spoken_topic(route, description)
        return choices[index].format(topic=topic, subject=_subject(route))

    async def acknowledge(self, request: AcknowledgmentRequest) -> str:
        """The structured path `AgentRouter` uses."""
        aid = request.route
        return self.phrase(aid.name, aid.description, request.turn.turn_id)

    async def complete(self, prompt: str, *, max_tokens: int, reasoning: bool = False) -> str:
        """Parse `Helper:` / `Helper description:` lines of an acknowledgment prompt."""
        route = description = query = ""
        prompt = strip_surrogates(prompt)  # the phrase may quote the route: keep it text
        for line in prompt.splitlines():
            if line.startswith(PROMPT_ROUTE):
                route = line[len(PROMPT_ROUTE):].strip()
            elif line.startswith(PROMPT_DESCRIPTION):
                description = line[len(PROMPT_DESCRIPTION):].strip()
            elif line.startswith(PROMPT_QUERY):
                query = line[len(PROMPT_QUERY):].strip()
        if not route:
            return self._generic[zlib.crc32(prompt.encode()) % len(self._generic)]
        return self.phrase(route, description, query)
