"""TemplateAcknowledger: route-aware, varied acknowledgments without a model."""

from __future__ import annotations

import itertools
import re

import pytest

from turnrouter import (
    Acknowledger,
    AcknowledgmentRequest,
    AgentTurn,
    LLMService,
    RoutingAid,
    acknowledgment_prompt,
    clean_acknowledgment,
)
from turnrouter.llm import TemplateAcknowledger, spoken_topic

pytestmark = pytest.mark.anyio

_PROMISES = ("found", "here is", "here's", "will have", "the answer", "done")


async def test_phrases_name_the_route() -> None:
    """The structured path speaks about the route by name ("your calendar question")."""
    ack = TemplateAcknowledger()
    assert isinstance(ack, Acknowledger) and isinstance(ack, LLMService)
    calendar = RoutingAid("calendar", "Manages the user's calendar")
    text = await ack.acknowledge(AcknowledgmentRequest(calendar, AgentTurn("p", "t1", "q"), 32))
    assert "calendar" in text
    weather = RoutingAid("smart_home", "Lights and heating")
    text = await ack.acknowledge(AcknowledgmentRequest(weather, AgentTurn("p", "t1", "q"), 32))
    assert "smart home" in text


@pytest.mark.parametrize("route", ["billing", "weather", "calendar", "music", "refunds"])
def test_default_phrases_read_right_whatever_the_route_is_called(route: str) -> None:
    """The route name is a modifier ("your billing question", "the weather details"),
    never a bare noun after "the" ("Let me check the billing." reads wrong)."""
    ack = TemplateAcknowledger()
    texts = {ack.phrase(route, "", key=str(key)) for key in range(40)}
    assert len(texts) >= 4
    for text in texts:
        assert re.search(rf"(your|the) {route} (question|request|details)\b", text), text
        assert not text.rstrip(".").endswith(f"the {route}"), text


def test_custom_phrases_take_the_topic_and_the_subject() -> None:
    ack = TemplateAcknowledger(phrases=["Checking {topic} ({subject})."])
    assert ack.phrase("calendar", "the user's calendar") == "Checking your calendar (calendar)."
    with pytest.raises(KeyError):
        TemplateAcknowledger(phrases=["Checking {place}."])


async def test_phrases_vary_and_never_promise_a_result() -> None:
    """Over many turns several phrasings occur, consecutive ones differ, none promises."""
    ack = TemplateAcknowledger()
    aid = RoutingAid("music", "plays music")
    texts = [await ack.acknowledge(AcknowledgmentRequest(aid, AgentTurn("p", f"t{i}", "q"), 8))
             for i in range(30)]
    assert len(set(texts)) >= 4
    assert all(a != b for a, b in itertools.pairwise(texts))
    assert not any(word in text.lower() for text in texts for word in _PROMISES)
    assert all(len(text.split()) <= 10 for text in texts)


async def test_complete_parses_the_acknowledgment_prompt() -> None:
    """complete() reads the route and description back from the documented prompt."""
    ack = TemplateAcknowledger(topics={"travel": "your trip"})
    prompt = acknowledgment_prompt(RoutingAid("travel", "books trips"), "plan Rome")
    assert "your trip" in await ack.complete(prompt, max_tokens=16)
    generic = acknowledgment_prompt(RoutingAid("conversation", "small talk"), "hi")
    assert "conversation" not in await ack.complete(generic, max_tokens=16)
    assert await ack.complete("no structure at all", max_tokens=16)


@pytest.mark.parametrize(("route", "said"), [
    ("it_support", "Okay, I'm pulling up the IT support details."),
    ("hr", "Okay, I'm pulling up the HR details."),
    ("sql_agent", "Okay, I'm pulling up the SQL details."),
    ("BillingAgent", "Okay, I'm pulling up the billing details."),
    ("tv_guide", "Okay, I'm pulling up the TV guide details."),
    ("smart_home", "Okay, I'm pulling up the smart home details."),
    ("agent", "Okay, I'm pulling up the agent details."),
])
def test_route_names_read_as_a_tts_would_say_them(route: str, said: str) -> None:
    """Initials are upper-cased for the TTS (the pronoun "it" for the IT desk read
    wrong) and role words ("agent") dropped unless they are the whole name."""
    template = TemplateAcknowledger(phrases=("Okay, I'm pulling up the {subject} details.",))
    assert template.phrase(route, "answers questions", "t1") == said


def test_spoken_topic() -> None:
    """Route names become spoken topics; personal descriptions use "your"."""
    assert spoken_topic("smart_home") == "the smart home"
    assert spoken_topic("emailInbox", "reads your email inbox") == "your email inbox"
    assert spoken_topic("calendar", "the user's calendar") == "your calendar"


def test_clean_acknowledgment() -> None:
    """The first non-empty line, unquoted, cut at a word boundary."""
    assert clean_acknowledgment('\n  "Let me   check."  \nmore', 100) == "Let me check."
    assert clean_acknowledgment("one two three four", 9) == "one two"
    assert clean_acknowledgment(" \n ", 10) == ""


@pytest.mark.parametrize(("reply", "said"), [
    ("\u200b", ""), ("\x00", ""), ("\ufeff", ""), ("\x1b[2J", ""), ("**", ""), ("-", ""),
    ("...", ""), ("<think>planning the reply", ""),
    ("<think>x</think>One moment.", "One moment."),
    ("plan: check the calendar</think>One moment.", "One moment."),  # opened in the prompt
    ("<think><think>a</think>LEAK</think>Visible.", "Visible."),
    ("Sure! Here's a short acknowledgment:\nLet me check.", "Let me check."),
    ('{"text": "One moment"}', ""), ("User request: my card number is 4111", ""),
    ("Helper: calendar", ""), ("**Checking** your \x1b[1mcalendar\x1b[0m now",
                               "Checking your calendar now"),
    ("One\u200b moment\u202e.", "One moment."), ("١٢٣", "١٢٣"),
    # Reasoning longer than the cut (80 * 4 characters): removed before the cut, so the
    # closing tag is still seen (before, the reasoning was spoken, or the answer lost).
    ("the user asks about rain " * 40 + "</think>Let me check the weather.",
     "Let me check the weather."),
    ("<think>" + "the user asks about rain " * 40 + "</think>One moment.", "One moment."),
    # A tag cut off before its ">" by the token limit.
    ("Let me check.<think", "Let me check."), ("<think\nthe user wants", ""),
    ("reasoning here</think", ""),
])
def test_only_speakable_text_is_kept(reply: str, said: str) -> None:
    """What an acknowledgment LLM replies is said only where something speakable is in
    it: reasoning (closed, nested, opened by the prompt's template, cut off), escape
    sequences, invisible and control characters and markdown emphasis go; a line with no
    letter or digit, the model's lead-in ending with ":", JSON, and an echo of the
    prompt's labelled lines (the user's request) are skipped. Before, each of these was
    spoken as it came."""
    assert clean_acknowledgment(reply, 80) == said


def test_spoken_topic_of_a_huge_description_is_linear() -> None:
    """A megabyte of description words is scanned once; only its start is considered."""
    assert spoken_topic("calendar", "a" * 1_000_000) == "the calendar"
    assert spoken_topic("calendar", "your " * 200_000 + "calendar") == "the calendar"
    assert spoken_topic("calendar", "reads " * 10 + "your calendar") == "your calendar"
    assert spoken_topic("a" * 1_000_000, "a" * 1_000_000) == "the " + "a" * 128
    # "İ".lower() is two characters: the case-insensitive search still finds the topic.
    assert spoken_topic("calendar", "İ: your Calendar") == "your calendar"
