"""ClassifierDecisions: prompt, lenient parsing, thresholds, fallback, errors."""

from __future__ import annotations

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnrouter import (
    CLARIFY,
    AgentRouter,
    AgentTurn,
    ConfigurationError,
    LLMError,
    RouteRequest,
    RoutingAid,
)
from turnrouter.decisions import (
    DEFAULT_CLASSIFIER_PROMPT,
    ClassifierDecisions,
    ParsedClassification,
    parse_classifier_output,
)
from turnrouter.testing import OutputRecorder, ScriptedAgent
from turnrouter.testing import ScriptedLLM as RecordedLLM

AIDS = (
    RoutingAid("billing", "Invoices, payments and refunds."),
    RoutingAid("support", "Technical problems and outages."),
)


class ScriptedLLM:
    """Replies with fixed text (or raises) and records prompts."""

    def __init__(self, reply: str = "", error: Exception | None = None) -> None:
        self.reply = reply
        self.error = error
        self.calls: list[tuple[str, int, bool]] = []

    async def complete(self, prompt: str, *, max_tokens: int, reasoning: bool = False) -> str:
        self.calls.append((prompt, max_tokens, reasoning))
        if self.error is not None:
            raise self.error
        return self.reply


def request(query: str = "my invoice is wrong",
            aids: tuple[RoutingAid, ...] = AIDS) -> RouteRequest:
    return RouteRequest(AgentTurn("p1", "t1", query), aids)


@pytest.mark.anyio
async def test_prompt_lists_candidates_and_query_with_bounded_non_reasoning_call() -> None:
    """The prompt names each candidate with its description and the query."""
    llm = ScriptedLLM("route: billing\nconfidence: 0.9")
    await ClassifierDecisions(llm, max_tokens=20).decide(request())
    prompt, max_tokens, reasoning = llm.calls[0]
    assert "- billing: Invoices, payments and refunds." in prompt
    assert "- support: Technical problems and outages." in prompt
    assert "my invoice is wrong" in prompt
    assert (max_tokens, reasoning) == (20, False)


@pytest.mark.anyio
async def test_parsed_route_and_confidence_become_decision_with_raw_rationale() -> None:
    """A well-formed reply picks the route, scores it, and keeps the raw text."""
    decision = await ClassifierDecisions(ScriptedLLM("route: billing\nconfidence: 0.8")).decide(
        request()
    )
    assert decision.choice == "billing"
    assert decision.confidence == pytest.approx(0.8)
    assert dict(decision.scores) == {"billing": pytest.approx(0.8)}
    assert decision.rationale.startswith("classifier: route: billing")


@pytest.mark.parametrize(
    ("text", "route", "confidence"),
    [
        ("route: billing\nconfidence: 0.7", "billing", 0.7),
        ("ROUTE = Billing\nConfidence = .5", "Billing", 0.5),
        ("Sure!\n`route: billing`\n\"confidence: 0.9\"\nbecause invoices", "billing", 0.9),
        ("**route**: 'support'\n", "support", None),
        ("route: billing\nconfidence: 1.7", "billing", None),
        ("route: billing\nconfidence: 85 %", "billing", 0.85),  # read as 1.0 before
        ("route: billing\nconfidence: 85 percent", "billing", 0.85),
        ("route: billing\nconfidence: 85", "billing", 0.85),
        ("route: billing\nconfidence: 1/2", "billing", 0.5),  # read as 1.0 before
        ("route: billing\nconfidence: 17/20", "billing", 0.85),
        ("route: billing\nconfidence: 1/0", "billing", None),
        ("route: billing\nconfidence: 150", "billing", None),
        ("route: billing\nconfidence: \u0669\u0660%", "billing", None),  # not ASCII digits
        ("route: billing\nconfidence: -3", "billing", 0.0),
        ("route: billing\nconfidence: 85%", "billing", 0.85),
        ("route: billing\nconfidence: high", "billing", None),
        ("route: billing\nconfidence: nan", "billing", None),
        ("nothing useful here", None, None),
        ("", None, None),
    ],
)
def test_parser_tolerates_format_variations(
    text: str, route: str | None, confidence: float | None
) -> None:
    """Case, '=' separators, quotes, backticks, extra lines and bad numbers are handled: a
    confidence that cannot be read is missing (the threshold's fallback), never one."""
    parsed = parse_classifier_output(text)
    assert parsed.route == route
    if confidence is None:
        assert parsed.confidence is None
    else:
        assert parsed.confidence == pytest.approx(confidence)


@pytest.mark.anyio
async def test_route_match_is_case_insensitive() -> None:
    """A route named in another case still maps to the candidate."""
    decision = await ClassifierDecisions(ScriptedLLM("route: BILLING")).decide(request())
    assert decision.choice == "billing"
    assert decision.confidence is None
    assert dict(decision.scores) == {}


@pytest.mark.anyio
async def test_unknown_route_clarifies_without_fallback() -> None:
    """A route that is not a candidate answers clarify."""
    decision = await ClassifierDecisions(ScriptedLLM("route: weather\nconfidence: 0.9")).decide(
        request()
    )
    assert decision.choice == CLARIFY
    assert "unknown route" in decision.rationale


@pytest.mark.anyio
async def test_unknown_route_uses_fallback_when_it_is_a_candidate() -> None:
    """The fallback route replaces clarify when the request offers it."""
    service = ClassifierDecisions(ScriptedLLM("gibberish"), fallback_route="support")
    assert (await service.decide(request())).choice == "support"
    assert service.fallback_route == "support"  # what AgentRouter checks is registered


@pytest.mark.anyio
async def test_fallback_not_a_candidate_clarifies() -> None:
    """A fallback route absent from the candidates is not used."""
    service = ClassifierDecisions(ScriptedLLM("gibberish"), fallback_route="support")
    assert (await service.decide(request(aids=AIDS[:1]))).choice == CLARIFY


@pytest.mark.parametrize(
    ("reply", "threshold", "fallback", "expected"),
    [
        ("route: billing\nconfidence: 0.9", 0.5, None, "billing"),
        ("route: billing\nconfidence: 0.5", 0.5, None, CLARIFY),
        ("route: billing\nconfidence: 0.3", 0.5, "support", "support"),
        ("route: billing", 0.5, None, CLARIFY),
        ("route: billing", 0.5, "support", "support"),
        ("route: billing", 0.0, None, "billing"),
        ("route: billing", None, None, "billing"),
        ("route: billing\nconfidence: 0.0", 0.0, None, "billing"),
    ],
)
@pytest.mark.anyio
async def test_threshold_and_fallback_combinations(
    reply: str, threshold: float | None, fallback: str | None, expected: str
) -> None:
    """Confidence must exceed the threshold; missing confidence counts as 0 when set."""
    service = ClassifierDecisions(
        ScriptedLLM(reply), require_confidence_above=threshold, fallback_route=fallback
    )
    assert (await service.decide(request())).choice == expected


@pytest.mark.anyio
async def test_raw_text_is_truncated_in_rationale() -> None:
    """Very long replies are kept on the rationale up to 500 characters."""
    reply = "route: billing\nconfidence: 0.9\n" + "x" * 2000
    decision = await ClassifierDecisions(ScriptedLLM(reply)).decide(request())
    assert len(decision.rationale) <= len("classifier: ") + 500 + 3
    assert decision.rationale.endswith("...")


@pytest.mark.anyio
@pytest.mark.parametrize("reply", [b"route: billing", None, 42, ["route: billing"]])
async def test_a_reply_that_is_not_text_is_an_llm_error(reply: object) -> None:
    """A service breaking the LLMService protocol is named, not str()-ed into routing
    text (b"route: billing" would have been parsed as "b'route: billing'")."""
    llm = ScriptedLLM()
    llm.reply = reply  # type: ignore[assignment]
    with pytest.raises(LLMError, match=f"returned {type(reply).__name__}, not the str"):
        await ClassifierDecisions(llm).decide(request())


@pytest.mark.anyio
async def test_llm_errors_propagate_unchanged() -> None:
    """An LLM failure is raised as-is for the router to record."""
    error = ConnectionError("down")
    with pytest.raises(ConnectionError) as caught:
        await ClassifierDecisions(ScriptedLLM(error=error)).decide(request())
    assert caught.value is error


@pytest.mark.anyio
async def test_custom_prompt_template_is_used() -> None:
    """A custom template gets the route list and the query."""
    llm = ScriptedLLM("route: support")
    service = ClassifierDecisions(llm, classifier_prompt="R:\n{route_descriptions}\nQ: {query}")
    await service.decide(request("it crashed"))
    assert llm.calls[0][0].startswith("R:\n- billing:")
    assert llm.calls[0][0].endswith("Q: it crashed")


@pytest.mark.anyio
async def test_a_prompt_without_the_query_placeholder_gets_the_request_appended() -> None:
    """A prompt in the reference's shape (only `{route_descriptions}`: the query went in
    a separate message) is accepted, and the request follows it."""
    llm = ScriptedLLM("route: support")
    prompt = "You are a routing classifier.\n\nAvailable routes:\n{route_descriptions}\n"
    service = ClassifierDecisions(llm, classifier_prompt=prompt)
    decision = await service.decide(request("it crashed {query}"))
    assert decision.choice == "support"
    sent = llm.calls[0][0]
    assert sent.startswith("You are a routing classifier.\n\nAvailable routes:\n- billing:")
    assert sent.endswith("\n\nUser request:\nit crashed {query}\n")


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"require_confidence_above": 1.5}, "require_confidence_above"),
        ({"require_confidence_above": -0.1}, "require_confidence_above"),
        ({"classifier_prompt": "no placeholders"}, "classifier_prompt"),
        ({"classifier_prompt": "{query} only"}, "classifier_prompt"),
        ({"classifier_prompt": "{route_descriptions} {query} {extra}"}, "classifier_prompt"),
        ({"classifier_prompt": "{route_descriptions} {query"}, "classifier_prompt"),
        ({"fallback_route": ""}, "fallback_route"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_invalid_configuration_is_rejected(kwargs: dict[str, object], name: str) -> None:
    """Bad thresholds, templates, fallbacks or token limits raise ConfigurationError."""
    with pytest.raises(ConfigurationError, match=name):
        ClassifierDecisions(ScriptedLLM(), **kwargs)  # type: ignore[arg-type]


def test_llm_without_complete_is_rejected() -> None:
    """An object that is not an LLMService raises ConfigurationError naming llm."""
    with pytest.raises(ConfigurationError, match="llm"):
        ClassifierDecisions(object())  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(
    reply=st.text(max_size=200)
    | st.builds(
        lambda r, c: f"route: {r}\nconfidence: {c}", st.text(max_size=20), st.text(max_size=8)
    ),
    subset=st.lists(st.sampled_from(AIDS), min_size=1, max_size=2, unique_by=lambda a: a.name),
    threshold=st.floats(min_value=0.0, max_value=1.0),
)
def test_any_llm_text_yields_a_candidate_or_clarify(
    reply: str, subset: list[RoutingAid], threshold: float
) -> None:
    """Whatever the LLM says, the choice is a candidate of the request or clarify."""
    import anyio

    service = ClassifierDecisions(ScriptedLLM(reply), require_confidence_above=threshold,
                                  fallback_route="support")
    decision = anyio.run(service.decide, request("q", tuple(subset)))
    assert decision.choice in {a.name for a in subset} | {CLARIFY}
    assert decision.confidence is None or 0.0 <= decision.confidence <= 1.0


def test_long_lines_of_padding_parse_in_one_pass() -> None:
    """Long runs of spaces or markup before a key still parse (the scan is linear)."""
    padded = " " * 300_000 + "route: billing\n" + "*" * 300_000 + "confidence: 0.5"
    assert parse_classifier_output(padded) == ParsedClassification("billing", 0.5)
    assert parse_classifier_output(" " * 300_000) == ParsedClassification(None, None)


@pytest.mark.parametrize(("reply", "parsed"), [
    ("<think>route: support\nconfidence: 1</think>\nroute: billing\nconfidence: 0.4",
     ParsedClassification("billing", 0.4)),
    ("<think>route: support\nconfidence: 1\n", ParsedClassification(None, None)),
    ("route: billing\n<thinking>confidence: 1", ParsedClassification("billing", None)),
    ("<think><think>route: support</think>confidence: 1</think>route: billing\n"
     "confidence: 0.4", ParsedClassification("billing", 0.4)),
    ("route: support\nconfidence: 1</think>route: billing", ParsedClassification("billing", None)),
])
def test_reasoning_is_never_read_as_the_answer(reply: str,
                                               parsed: ParsedClassification) -> None:
    """A route or confidence inside reasoning (closed, nested, never closed, or opened by
    the chat template) is no answer, whatever the LLM service: one returning reasoning
    made the classifier take `confidence: 1` from the model's musings."""
    assert parse_classifier_output(reply) == parsed


def test_only_the_first_lines_of_a_reply_are_read() -> None:
    """The route and confidence come first: past `MAX_PARSED_LINES` lines nothing is
    read (a million line breaks blocked the event loop 100-220 ms), and a reply that
    starts with them is read whatever follows."""
    late = "\n" * 1_000_000 + "route: billing\nconfidence: 0.5"
    assert parse_classifier_output(late) == ParsedClassification(None, None)
    first = "route: billing\nconfidence: 0.5" + "\nroute: support" * 100_000
    assert parse_classifier_output(first) == ParsedClassification("billing", 0.5)
    just = "\n" * 999 + "route: billing\nconfidence: 0.5"  # the 1,000th and 1,001st
    assert parse_classifier_output(just) == ParsedClassification("billing", None)


# ------------------------------------------------------------- the reference's contract


@pytest.mark.anyio
async def test_first_route_and_confidence_lines_win_over_later_lines() -> None:
    """The answer is the first route and confidence lines; repeated lines never override."""
    reply = "route: billing\nroute: support\nconfidence: 0.8\nconfidence: 0.1"
    assert parse_classifier_output(reply) == ParsedClassification("billing", 0.8)
    swapped = "confidence: 0.8\nconfidence: 0.1\nroute: billing\nroute: support"
    assert parse_classifier_output(swapped) == ParsedClassification("billing", 0.8)
    service = ClassifierDecisions(RecordedLLM(reply), require_confidence_above=0.5)
    decision = await service.decide(request())
    assert decision.choice == "billing"
    assert decision.confidence == pytest.approx(0.8)


@pytest.mark.anyio
async def test_default_prompt_asks_for_the_two_lines_the_parser_reads() -> None:
    """The default prompt is the reference's text (only `{route_descriptions}`: it
    formats as the reference's does, contract18 F9), the request appended; it asks for
    route then confidence, and a reply filled in from it parses."""
    llm = RecordedLLM("route: billing")
    await ClassifierDecisions(llm).decide(request())
    prompt = llm.prompts[0][0]
    assert prompt == DEFAULT_CLASSIFIER_PROMPT.format(
        route_descriptions="- billing: Invoices, payments and refunds.\n"
        "- support: Technical problems and outages.").rstrip() + (
        "\n\nUser request:\nmy invoice is wrong\n")
    _, _, instructions = prompt.partition("Output exactly two lines, in this order:\n")
    route_line, confidence_line = instructions.splitlines()[:2]
    reply = "\n".join([route_line.split("<")[0] + "support",
                       confidence_line.split("<")[0] + "0.75"])
    assert parse_classifier_output(reply) == ParsedClassification("support", 0.75)


@pytest.mark.anyio
async def test_classified_specialist_alone_answers_and_its_output_is_the_result() -> None:
    """Through the router, only the classified destination answers, and its answer is returned."""
    agents = {name: ScriptedAgent(name) for name in ("billing", "support", "conversation")}
    llm = RecordedLLM("route: support\nconfidence: 0.9")
    router = AgentRouter(agents, ClassifierDecisions(llm, require_confidence_above=0.5),
                         output=OutputRecorder())
    with anyio.fail_after(10):
        result = await router.handle(AgentTurn("p1", "t1", "the app crashed"))
    assert (result.disposition, result.text) == ("answer", "support answer")
    assert agents["support"].methods()[-1] == "answer"
    assert "answer" not in agents["billing"].methods()
    assert "answer" not in agents["conversation"].methods()
    assert len(llm.prompts) == 1
