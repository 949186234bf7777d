"""Fuzz: LLM replies (real local HTTP server) and classifier reply parsing.

Rule for `OpenAIChatClient.complete`: storable text or `LLMError`, whose message never
holds the API key or the prompt, for any body: junk, huge, nested, non-UTF-8, chunked
or endless. Rule for classifier parsing: a valid `ParsedClassification` /
`RouteDecision` for any reply text.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnrouter import CLARIFY, AgentTurn, ConfigurationError, RouteRequest, RoutingAid
from turnrouter.decisions import ClassifierDecisions, parse_classifier_output
from turnrouter.llm import LLMError, OpenAIChatClient, TemplateAcknowledger
from turnrouter.testing import ScriptedLLM

from .fuzz import ANY_TEXT, HUGE_TEXT, NON_UTF8, nested_json, valid_text
from .kit import BROKEN_HTTP_REPLIES, RawReplyServer, completion
from .test_llm_openai import Script, serve

FUZZ = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example,
                                       HealthCheck.function_scoped_fixture])
API_KEY = "sk-fuzz-0123456789"
PROMPT = "Route this for me: my account password is hunter2-fuzz, thanks."
CAP = 256 * 1024


@pytest.fixture(scope="module")
def shared() -> Iterator[tuple[str, Script]]:
    """One local chat-completions server for every example of this module."""
    script = Script()
    httpd, thread = serve(script)
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1", script
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def reply(content: Any) -> bytes:
    return json.dumps({"choices": [{"message": {"content": content}}]}).encode()


JSON_JUNK = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), ANY_TEXT),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.sampled_from(["choices", "message", "content",
                                                             "text", "x"]), inner,
                                            max_size=3)),
    max_leaves=12,
)
BODIES = st.one_of(
    st.binary(max_size=200),
    NON_UTF8,
    JSON_JUNK.map(lambda value: json.dumps(value).encode()),
    JSON_JUNK.map(reply),
    ANY_TEXT.map(lambda text: reply(text).replace(b"\\\\", b"\\")),  # raw escapes
    HUGE_TEXT.map(reply),
    st.sampled_from([10, 5_000, 200_000]).map(
        lambda depth: b'{"choices": ' + nested_json(depth).encode() + b"}"),
    st.just(reply("<think>" * 100_000)),
    st.just(b"\xff" * (CAP + 10)),
)


def complete(url: str) -> str | LLMError:
    client = OpenAIChatClient("m", base_url=url, api_key=API_KEY, timeout_secs=30,
                              max_reply_bytes=CAP)
    return completion(client, PROMPT)


def check(outcome: str | LLMError) -> None:
    if isinstance(outcome, str):
        assert valid_text(outcome)
        return
    shown = f"{outcome} {outcome.body}"
    assert API_KEY not in shown and "hunter2" not in shown
    assert len(str(outcome)) < 2000


@FUZZ
@given(st.sampled_from([200, 200, 400, 500]), BODIES, st.booleans())
def test_any_reply_body(shared: tuple[str, Script], status: int, body: bytes,
                        chunked: bool) -> None:
    """Any status and body, sent whole or chunked: text or LLMError, nothing else."""
    url, script = shared
    script.status, script.body, script.echo = status, body, False
    pieces = [body[i:i + 4096] for i in range(0, len(body), 4096)]
    script.chunks = (lambda: iter(pieces)) if chunked else None
    check(complete(url))


@FUZZ
@given(st.sampled_from([200, 401, 422]))
def test_echoing_and_endless_servers(shared: tuple[str, Script], status: int) -> None:
    """A server echoing the request, or streaming forever: LLMError without secrets."""
    url, script = shared
    script.status, script.chunks, script.echo = status, None, True
    outcome = complete(url)
    if status != 200:
        assert isinstance(outcome, LLMError)
    check(outcome)
    script.echo = False
    script.chunks = lambda: itertools.repeat(b"{" * 4096, 16 * 1024)
    outcome = complete(url)
    assert isinstance(outcome, LLMError) and "max_reply_bytes" in str(outcome)
    check(outcome)


THINK_CLOSE = re.compile(r"</think(?:ing)?\b[^<>]{0,200}>", re.IGNORECASE)
THINK_TOKENS = st.lists(st.sampled_from(["<think>", "</think>", "<THINK>", "</Think>", "a",
                                         " ", "\n", "<", ">", "é", "<thinking>",
                                         "</thinking>", "<think id='1'>", "</ think>"]),
                        max_size=30).map("".join)
THINK_TAG = re.compile(r"<(/?)think(?:ing)?\b[^<>]{0,200}>", re.IGNORECASE)


def without_reasoning(text: str) -> str:
    """The visible text, by another route than the client's scan: split at the think
    tags and keep what lies outside every block (nested ones too); an opening tag never
    closed hides the rest, a closing tag with no opening one hides what came before."""
    visible: list[str] = []
    depth = 0
    for index, part in enumerate(THINK_TAG.split(text)):
        if index % 2 == 0:  # text between tags (split yields text, then a tag's "/" or "")
            if depth == 0:
                visible.append(part)
        else:
            if part == "/":
                if depth == 0:
                    visible.clear()
                else:
                    depth -= 1
            else:
                depth += 1
    return "".join(visible)


@FUZZ
@given(THINK_TOKENS)
def test_think_stripping_matches_the_regex(shared: tuple[str, Script], content: str) -> None:
    """The linear tag scan gives exactly what the reference above gives (nested blocks,
    attributes, `<thinking>`, a lone closing tag); a reply left with no visible text is
    an LLMError, never an empty or reasoning string."""
    url, script = shared
    script.status, script.body, script.chunks, script.echo = 200, reply(content), None, False
    visible = without_reasoning(content).strip()
    outcome = complete(url)
    if visible:
        assert outcome == visible
    else:
        assert isinstance(outcome, LLMError)
        assert "no visible text" in str(outcome)


@FUZZ
@given(visible=st.text(st.characters(codec="utf-8"), max_size=200),
       reasoning=st.one_of(ANY_TEXT, HUGE_TEXT),
       tag=st.sampled_from(["<think>", "<THINK>", "<Think>"]))
def test_nothing_after_an_unclosed_think_tag_is_ever_returned(
    shared: tuple[str, Script], visible: str, reasoning: str, tag: str,
) -> None:
    """Text, an opening tag, then anything without a closing tag: at most the text
    before the tag comes back (or LLMError when that is blank), never the reasoning."""
    url, script = shared
    while THINK_CLOSE.search(reasoning):  # (a removal may join a new closing tag)
        reasoning = THINK_CLOSE.sub("", reasoning)
    content = visible + tag + reasoning
    script.status, script.body, script.chunks, script.echo = 200, reply(content), None, False
    outcome = complete(url)
    expected = without_reasoning(visible + tag).strip()
    if isinstance(outcome, LLMError):  # blank before the tag, or a reply over the cap
        assert not expected or "max_reply_bytes" in str(outcome)
    else:
        assert outcome == expected


CLASSIFIER_LINES = st.lists(st.one_of(
    ANY_TEXT,
    st.tuples(st.sampled_from(["route", "ROUTE", "**route**", "> route", "confidence",
                               "Confidence"]),
              st.sampled_from([":", "=", " : "]),
              st.one_of(ANY_TEXT, st.sampled_from(["billing", "support", "0.7", "85%",
                                                   "1e400", "nan", "-3"]))).map("".join),
    HUGE_TEXT,
), max_size=6).map("\n".join)


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example])
@given(CLASSIFIER_LINES)
def test_classifier_parsing(text: str) -> None:
    """parse_classifier_output: a stripped route or None, a confidence in [0, 1] or None."""
    parsed = parse_classifier_output(text)
    assert parsed.route is None or (parsed.route and parsed.route == parsed.route.strip())
    assert parsed.confidence is None or 0.0 <= parsed.confidence <= 1.0


AIDS = (RoutingAid("billing", "Invoices."), RoutingAid("support", "Outages."))


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example])
@given(CLASSIFIER_LINES, st.sampled_from([0.0, 0.5]))
def test_classifier_decisions(text: str, threshold: float) -> None:
    """ClassifierDecisions: any reply becomes a candidate or clarify, with a short rationale."""
    service = ClassifierDecisions(ScriptedLLM(text), require_confidence_above=threshold)
    request = RouteRequest(AgentTurn("p", "t", "my invoice"), AIDS)

    async def main() -> None:
        decision = await service.decide(request)
        assert decision.choice in ("billing", "support", CLARIFY)
        assert len(decision.rationale) < 1000

    anyio.run(main)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example,
                                 HealthCheck.data_too_large])
@given(st.lists(st.one_of(
    ANY_TEXT, HUGE_TEXT,
    st.tuples(st.sampled_from(["Helper: ", "Helper description: ", "User: "]),
              st.one_of(ANY_TEXT, HUGE_TEXT)).map("".join)), max_size=5).map("\n".join))
def test_template_acknowledger_any_prompt(prompt: str) -> None:
    """TemplateAcknowledger.complete: any prompt (surrogates, 1 MB lines) gives a phrase."""
    acknowledger = TemplateAcknowledger()

    async def main() -> str:
        return await acknowledger.complete(prompt, max_tokens=16)

    assert valid_text(anyio.run(main))


@pytest.fixture(scope="module")
def raw_server() -> Iterator[RawReplyServer]:
    """One raw TCP 'LLM server' for every example: it answers whatever bytes it is given."""
    server = RawReplyServer()
    try:
        yield server
    finally:
        server.close()


@settings(max_examples=len(BROKEN_HTTP_REPLIES) * 3, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(BROKEN_HTTP_REPLIES))
def test_broken_http_framing(raw_server: RawReplyServer, reply: bytes) -> None:
    """Broken status lines, truncated chunks and header floods: LLMError, nothing else."""
    raw_server.reply = reply
    outcome = complete(raw_server.url + "/v1")
    assert isinstance(outcome, LLMError)
    check(outcome)


@settings(max_examples=200, deadline=None)
@given(key=st.one_of(ANY_TEXT, HUGE_TEXT, st.integers()),
       headers=st.dictionaries(st.one_of(ANY_TEXT, st.integers()),
                               st.one_of(ANY_TEXT, st.none(), st.integers()), max_size=3))
def test_credentials_are_accepted_only_when_a_header_can_carry_them(
        key: Any, headers: dict[Any, Any]) -> None:
    """Any `api_key` and `headers=`: accepted only when every value is one line of
    Latin-1 without control characters and every name a header name; else a
    `ConfigurationError` that never shows a value (a key with its newline was refused
    only at the first call, in an error quoting the key's bytes: bounds17 H4)."""
    values = [value for value in (key, *headers.values()) if value is not None]
    carried = all(isinstance(value, str) and all(32 <= ord(ch) <= 255 and ord(ch) != 127
                                                 for ch in value) for value in values)
    names = all(isinstance(name, str) and re.fullmatch(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+", name)
                for name in headers)
    if carried and names:
        OpenAIChatClient("m", base_url="http://127.0.0.1:9/v1", api_key=key,
                         headers=headers)
        return
    with pytest.raises(ConfigurationError) as refused:
        OpenAIChatClient("m", base_url="http://127.0.0.1:9/v1", api_key=key,
                         headers=headers)
    shown = str(refused.value)
    names_shown = {str(name) for name in headers}  # a name may be shown, never a value
    assert not [value for value in values if isinstance(value, str) and len(value) >= 8
                and value in shown and not any(value in name for name in names_shown)]
