"""`ClassifierDecisions`: an LLM classifier answering in the `route:` / `confidence:` format.

The prompt lists the candidates' names and descriptions and the query; the reply is
parsed leniently (case, `=` or `:` separators, quotes, backticks, extra lines, a missing
confidence). An unknown route or a confidence at or below `require_confidence_above`
becomes "clarify", or the configured fallback route when it is a candidate of the
request. The raw reply is kept on the decision's rationale for tracing; LLM errors
propagate unchanged (the router records them as decision failures).
"""

from __future__ import annotations

import math
import re
import string
from dataclasses import dataclass

from .._contracts import CLARIFY, RouteDecision, RouteRequest
from .._exceptions import ConfigurationError, LLMError
from .._llm import LLMService
from .._redact import preview, strip_reasoning, strip_surrogates

__all__ = ["DEFAULT_CLASSIFIER_PROMPT", "ClassifierDecisions", "ParsedClassification",
           "parse_classifier_output"]

DEFAULT_CLASSIFIER_PROMPT = """You are a routing classifier. Given the user's request, decide which
specialist handles it best.

Available routes:
{route_descriptions}

Output exactly two lines, in this order:
route: <one of the route names above>
confidence: <number between 0 and 1>

Then optionally one line of brief reasoning. The first two lines
must match the format exactly so they can be parsed.
"""

_PLACEHOLDERS = frozenset({"route_descriptions", "query"})
_RAW_LIMIT = 500
# One character class before the key (it includes whitespace): a separate leading `\s*`
# made a long run of spaces backtrack quadratically.
_LINE_RE = re.compile(r"[*_`\"'#>\-\s]*(route|confidence)[*_`\"'\s]*[:=]\s*(.*)",
                      re.IGNORECASE | re.DOTALL)
#: A number (ASCII digits only: a reply in other digits is unreadable, not a guess),
#: then maybe a percent sign or word, or a fraction's "/ denominator".
_NUMBER_RE = re.compile(r"([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[-+]?\d+)?)"
                        r"(?:\s*(%|percent\b)|\s*/\s*(\d+(?:\.\d*)?))?",
                        re.ASCII | re.IGNORECASE)
_STRIP = " \t\"'`*_.,;"
#: The most lines of a reply's visible text read for `route:`/`confidence:` (the
#: prompt asks for them first, in a few tokens): a million line breaks blocked the
#: event loop 100-220 ms.
MAX_PARSED_LINES = 1_000


@dataclass(frozen=True, slots=True)
class ParsedClassification:
    """What a classifier reply said: the route text (if any) and the confidence (if any)."""

    route: str | None
    """The route text of the `route:` line (None: no such line)."""
    confidence: float | None
    """The `confidence:` value clamped to [0, 1] (None: missing or unparsable)."""


def parse_classifier_output(text: str) -> ParsedClassification:
    """Parse the first `route:` and `confidence:` lines of a classifier reply.

    Tolerates any case, `=` instead of `:`, surrounding quotes, backticks or markdown
    emphasis, and extra lines. A confidence is a number from 0 to 1; a percentage
    ("85%", "85 %", "85 percent") or a whole number above 1 up to 100 ("85") is divided
    by 100, a fraction ("1/2", "17/20") divided out; a negative one is 0; anything else
    (another number over 1, not finite, a zero denominator, digits other than ASCII)
    counts as missing, so a threshold then sends the turn to the fallback route.
    Reasoning (`<think>` blocks, closed or not, as `strip_reasoning` finds them) is not
    read, whatever the LLM service: a route or confidence it muses about is no answer.
    Only the first `MAX_PARSED_LINES` lines of what is left are read.
    """
    route: str | None = None
    confidence: float | None = None
    for line in strip_reasoning(text).splitlines()[:MAX_PARSED_LINES]:
        match = _LINE_RE.match(line)
        if match is None:
            continue
        key, value = match.group(1).lower(), match.group(2)
        if key == "route" and route is None:
            name = value.strip().strip(_STRIP).strip()
            if name:
                route = name
        elif key == "confidence" and confidence is None:
            number = _NUMBER_RE.search(value)
            if number is not None:
                confidence = _confidence(*number.groups())
        if route is not None and confidence is not None:
            break
    return ParsedClassification(route, confidence)


def _confidence(number: str, percent: str | None, denominator: str | None) -> float | None:
    """The confidence a `confidence:` value says (`parse_classifier_output`), or None."""
    value = float(number)
    if denominator is not None:
        below = float(denominator)
        value = value / below if below > 0 else math.nan
    elif percent is not None or (1.0 < value <= 100.0 and value.is_integer()):
        value /= 100.0
    if not math.isfinite(value) or value > 1.0:
        return None
    return max(0.0, value)


_QUERY_SECTION = "\n\nUser request:\n{query}\n"


def _check_template(template: str) -> str:
    """The template to format: a prompt without `{query}` (the reference's shape, which
    sends the query separately) gets the request appended after it."""
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name}
    except ValueError as exc:
        raise ConfigurationError(f"classifier_prompt is not a valid format string: {exc}"
                                 ) from exc
    if "route_descriptions" not in fields:
        raise ConfigurationError(
            "classifier_prompt must contain the {route_descriptions} placeholder "
            "({query} is optional: without it the request is appended)"
        )
    unknown = fields - _PLACEHOLDERS
    if unknown:
        raise ConfigurationError(
            f"classifier_prompt has unknown placeholders {sorted(unknown)}; "
            f"allowed are {sorted(_PLACEHOLDERS)}"
        )
    return template if "query" in fields else template.rstrip() + _QUERY_SECTION


class ClassifierDecisions:
    """Decision service asking an `LLMService` to classify the query among the candidates.

    `require_confidence_above`: when greater than 0, a decision needs a confidence
    strictly above it, and a reply without a confidence counts as confidence 0.
    `fallback_route` is used instead of "clarify" for unknown routes or low confidence,
    but only when it is a candidate of the request. `classifier_prompt` is a
    `str.format` template with the `{route_descriptions}` placeholder and, optionally,
    `{query}` (without it, as in prompts that send the query separately, the request is
    appended after the prompt under "User request:").

    Args:
        llm: The `LLMService` asked to classify (its reply: `route:` and `confidence:`
            lines, parsed by `parse_classifier_output`).
        require_confidence_above: See above (default 0.0: any parsed route counts).
        fallback_route: See above (default None: "clarify").
        classifier_prompt: See above (default `DEFAULT_CLASSIFIER_PROMPT`).
        max_tokens: Output-token budget of each classification (default 32).
    """

    def __init__(
        self,
        llm: LLMService,
        *,
        require_confidence_above: float | None = 0.0,
        fallback_route: str | None = None,
        classifier_prompt: str | None = None,
        max_tokens: int = 32,
    ) -> None:
        if not callable(getattr(llm, "complete", None)):
            raise ConfigurationError(
                f"llm must implement LLMService.complete, got {type(llm).__name__}"
            )
        threshold = 0.0 if require_confidence_above is None else require_confidence_above
        if (
            not isinstance(threshold, int | float)
            or isinstance(threshold, bool)
            or not 0.0 <= threshold <= 1.0
        ):
            raise ConfigurationError(
                f"require_confidence_above must be within [0, 1], got "
                f"{preview(require_confidence_above)}"
            )
        if fallback_route is not None and (
            not isinstance(fallback_route, str) or not fallback_route
        ):
            raise ConfigurationError(
                "fallback_route must be a non-empty route name or None, got "
                f"{preview(fallback_route)}"
            )
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ConfigurationError(
                f"max_tokens must be a positive int, got {preview(max_tokens)}")
        template = DEFAULT_CLASSIFIER_PROMPT if classifier_prompt is None else classifier_prompt
        if not isinstance(template, str):
            raise ConfigurationError(
                f"classifier_prompt must be a str or None, got {type(template).__name__}"
            )
        self._llm = llm
        self._threshold = float(threshold)
        self._fallback = fallback_route
        self._template = _check_template(template)
        self._max_tokens = max_tokens

    @property
    def fallback_route(self) -> str | None:
        """The route chosen for an unknown route or a low confidence (None: clarify)."""
        return self._fallback

    def prompt(self, request: RouteRequest) -> str:
        """The classifier prompt for `request`: candidates' names and descriptions, query."""
        lines = [
            f"- {aid.name}: {aid.description}" if aid.description else f"- {aid.name}"
            for aid in request.candidates
        ]
        return self._template.format(route_descriptions="\n".join(lines),
                                     query=request.turn.query)

    async def decide(self, request: RouteRequest) -> RouteDecision:
        """Ask the LLM, parse its reply, and apply the threshold and fallback rules."""
        raw = await self._llm.complete(self.prompt(request), max_tokens=self._max_tokens,
                                       reasoning=False)
        if not isinstance(raw, str):  # the LLMService contract: plain text
            raise LLMError(f"the classifier's LLM service returned "
                           f"{type(raw).__name__}, not the str its protocol promises")
        raw = strip_surrogates(raw)  # a lone surrogate could not be traced or stored
        parsed = parse_classifier_output(raw)
        shown = raw if len(raw) <= _RAW_LIMIT else raw[:_RAW_LIMIT] + "..."
        trace = f"classifier: {shown}"
        names = {aid.name: aid.name for aid in request.candidates}
        folded = {name.casefold(): name for name in names}
        route = None
        if parsed.route is not None:
            route = names.get(parsed.route) or folded.get(parsed.route.casefold())
        confidence = parsed.confidence
        if route is None:
            return self._fallback_decision(request, confidence, "unknown route", trace)
        effective = 0.0 if confidence is None else confidence
        if self._threshold > 0.0 and effective <= self._threshold:
            return self._fallback_decision(
                request, confidence,
                f"confidence {effective:.2f} not above {self._threshold:.2f}", trace,
            )
        scores = {route: confidence} if confidence is not None else {}
        return RouteDecision(route, confidence=confidence, scores=scores, rationale=trace)

    def _fallback_decision(self, request: RouteRequest, confidence: float | None,
                           reason: str, trace: str) -> RouteDecision:
        fallback = self._fallback
        if fallback is not None and fallback in request.candidate_names:
            return RouteDecision(fallback, confidence=confidence,
                                 rationale=f"{trace} ({reason}; fallback {fallback})")
        return RouteDecision(CLARIFY, confidence=confidence,
                             rationale=f"{trace} ({reason}; clarify)")
