"""Fuzz: redaction where users meet it, at the LLM client's boundaries.

`OpenAIChatClient` shows URLs in its repr and errors, server bodies in `LLMError`, reply
text to its caller and bad settings in `ConfigurationError`; so its guarantees are
pinned here for any input: a password or key never survives, nothing but the documented
error is raised, output is storable text, and a shown value stays short.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from turnrouter import ConfigurationError
from turnrouter.llm import LLMError, OpenAIChatClient

from .fuzz import ANY_CHAR, ANY_TEXT, HUGE_TEXT, JUNK, valid_text
from .kit import completion
from .test_llm_openai import Script, serve

FUZZ = settings(max_examples=200, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example,
                                       HealthCheck.function_scoped_fixture])
SECRET = st.text("abcdefghijklmnopqrstuvwxyz0123456789", min_size=8, max_size=16).map(
    lambda s: "Zq" + s)
#: Text dense in lone surrogates (ANY_TEXT holds one in about 500 examples).
SURROGATE_TEXT = st.text(st.one_of(ANY_CHAR, st.characters(min_codepoint=0xD800,
                                                           max_codepoint=0xDFFF)), max_size=40)
#: Containers whose plain repr is always far over the shown bound.
WIDE = st.dictionaries(st.text(min_size=30, max_size=40), st.text(min_size=30, max_size=40),
                       min_size=4, max_size=6)
#: Short enough that an error body is never withheld as an echo of the prompt.
PROMPT = "ping"


@pytest.fixture(scope="module")
def shared() -> Iterator[tuple[int, Script]]:
    """One local chat-completions server (its port) for every example of this module."""
    script = Script()
    httpd, thread = serve(script)
    try:
        yield httpd.server_address[1], script
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def complete(client: OpenAIChatClient) -> str | LLMError:
    """One completion's text, or the LLMError it raised (bounded)."""
    return completion(client, PROMPT)


@FUZZ
@given(st.sampled_from(["http", "https", "postgres"]), st.text("abc", min_size=1, max_size=5),
       SECRET, st.sampled_from(["example.com", "127.0.0.1:8080", "[::1]:9"]),
       st.sampled_from(["", "/v1", "/a/b"]), SECRET)
def test_base_url_password_and_key_are_masked(scheme: str, user: str, password: str,
                                              host: str, path: str, key: str) -> None:
    """In the client's repr, and in the error refusing a non-HTTP URL, the password and
    secret-looking query values never survive; the host and other parameters do."""
    url = f"{scheme}://{user}:{password}@{host}{path}?api_key={key}&model=m"
    if scheme == "postgres":
        with pytest.raises(ConfigurationError) as info:
            OpenAIChatClient("m", base_url=url, api_key="")
        shown = str(info.value)
    else:
        shown = repr(OpenAIChatClient("m", base_url=url, api_key=""))
    assert password not in shown and key not in shown
    assert host in shown and "model=m" in shown


@FUZZ
@given(st.one_of(ANY_TEXT, HUGE_TEXT, st.from_regex(r"\A[a-z]{1,6}://[^/]*@?[^/]*/?.*\Z")))
def test_any_base_url_is_a_client_or_a_configuration_error(text: str) -> None:
    """Any string (not a URL, invalid IPv6, huge) makes a client whose repr is a string,
    or raises ConfigurationError: showing it redacted never raises anything else."""
    try:
        client = OpenAIChatClient("m", base_url=text, api_key="")
    except ConfigurationError:  # its message shows the URL redacted
        return
    assert isinstance(repr(client), str)


@FUZZ
@given(st.one_of(ANY_TEXT, HUGE_TEXT), SECRET,
       st.sampled_from(['Authorization: Bearer {}', '"authorization": "Bearer {}"',
                        "x-api-key={}", "token is {}", "https://u:{}@h/",
                        "invalid Bearer {} given"]),
       st.sampled_from(["api_key", "header", "url_password", "unknown"]),
       st.sampled_from([200, 401, 500]))
def test_error_bodies_mask_known_and_credential_looking_secrets(
        shared: tuple[int, Script], noise: str, secret: str, template: str, known: str,
        status: int) -> None:
    """A server body holding one of the client's own secrets (API key, header value, URL
    password) anywhere, or a header-style credential, reaches LLMError masked."""
    port, script = shared
    text = noise[:200] + template.format(secret) + noise[:200]
    script.status, script.chunks, script.echo = status, None, False
    script.body = text.encode("utf-8", "surrogatepass")
    userinfo = f"u:{secret}@" if known == "url_password" else ""
    client = OpenAIChatClient(
        "m", base_url=f"http://{userinfo}127.0.0.1:{port}/v1",
        api_key=secret if known == "api_key" else "",
        headers={"X-Custom": secret} if known == "header" else None)
    outcome = complete(client)
    assert isinstance(outcome, LLMError)
    if known != "unknown" or "token is" not in template:
        assert secret not in f"{outcome} {outcome.body}"


@FUZZ
@given(st.one_of(ANY_TEXT, SURROGATE_TEXT, HUGE_TEXT))
def test_reply_text_is_storable(shared: tuple[int, Script], text: str) -> None:
    """Reply content with lone surrogates comes back as text that encodes as UTF-8, as
    long as what the reply's JSON says (a high and a low surrogate escaped side by side
    read as one character, as every JSON reader reads them); valid content comes back
    unchanged."""
    assume("<think>" not in text.lower())  # reasoning is not spoken (test_llm_openai)
    port, script = shared
    content = f"[{text}]"  # brackets: the client strips surrounding whitespace
    script.status, script.chunks, script.echo = 200, None, False
    script.body = {"choices": [{"message": {"content": content}}]}
    client = OpenAIChatClient("m", base_url=f"http://127.0.0.1:{port}/v1", api_key="",
                              max_reply_bytes=16 << 20)
    reply = complete(client)
    assert isinstance(reply, str)
    assert valid_text(reply) and len(reply) == len(json.loads(json.dumps(content)))
    if valid_text(content):
        assert reply == content


def configuration_error(setting: str, value: object) -> str | None:
    """The message of the ConfigurationError a client setting raises (None if valid)."""
    try:
        if setting == "max_tokens":
            OpenAIChatClient("m", api_key="").request_body(
                "x", max_tokens=value)  # type: ignore[arg-type]
        else:
            OpenAIChatClient("m", api_key="", max_reply_bytes=value)  # type: ignore[arg-type]
    except ConfigurationError as exc:
        return str(exc)
    return None


@FUZZ
@given(st.one_of(JUNK, WIDE), st.sampled_from(["max_tokens", "max_reply_bytes"]))
def test_bad_settings_are_shown_short(value: object, setting: str) -> None:
    """A bad setting of any kind (huge, nested, broken) raises ConfigurationError whose
    message shows the value in at most 200 characters."""
    message = configuration_error(setting, value)
    if message is not None:
        assert setting in message
        assert len(message.split(", got ", 1)[1]) <= 200


def test_broken_values_are_shown_by_their_type() -> None:
    """A value whose __repr__ raises (or a too-long int) is shown by its type."""

    class Broken:
        def __repr__(self) -> str:
            raise RuntimeError("no")

    assert ", got <Broken " in (configuration_error("max_tokens", Broken()) or "")
    assert (configuration_error("max_reply_bytes", -10**5000) or "").endswith(
        ", got <int object>")


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["", "http:", "http:/", "://", "https://", "HTTP://"]),
       st.text(max_size=20).filter(lambda s: "@" not in s),
       st.text(max_size=20).filter(lambda s: "S3CR3T" not in s))
def test_a_password_before_an_unparsed_host_is_masked(prefix: str, password: str,
                                                      host: str) -> None:
    """`user:password@host` with the scheme missing or broken, a password holding "/",
    "?" or "#" (the URL's host then ends inside it), or a host urllib cannot parse (an
    unclosed IPv6 bracket): the client or its refusal never shows the password."""
    try:
        shown = repr(OpenAIChatClient("m", base_url=f"{prefix}user:S3CR3T{password}@{host}"))
    except ConfigurationError as exc:
        shown = str(exc)
    assert "S3CR3T" not in shown
