"""OpenAIChatClient against a local chat-completions server on 127.0.0.1 (a real socket)."""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import anyio
import pytest

from turnrouter import ConfigurationError, LLMService, TurnrouterError
from turnrouter.llm import LLMError, OpenAIChatClient


@dataclass
class Script:
    """What the fake server answers, and what it received."""

    status: int = 200
    body: Any = field(default_factory=lambda: {
        "choices": [{"message": {"role": "assistant", "content": "  Let me check.  "}}]})
    hold: threading.Event | None = None
    #: Send the body in chunks (Transfer-Encoding: chunked) instead of Content-Length.
    chunks: Callable[[], Iterator[bytes]] | None = None
    #: Answer with the request's headers and body (an echoing error page).
    echo: bool = False
    received: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    arrived: threading.Event = field(default_factory=threading.Event)
    sent_chunks: int = 0
    #: Set when the server stopped writing chunks (client gone or chunks exhausted).
    chunks_done: threading.Event = field(default_factory=threading.Event)


def serve(script: Script) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """A threaded HTTP server speaking the chat-completions format on a free port."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            raw = self.rfile.read(length)
            script.received.append(json.loads(raw))
            script.headers.append(dict(self.headers))
            script.paths.append(self.path)
            script.arrived.set()
            if script.hold is not None:
                script.hold.wait(10)
            try:
                if script.chunks is not None:
                    self._send_chunks(script.chunks())
                    return
                if script.echo:
                    payload = json.dumps({"error": "bad request", "headers": dict(self.headers),
                                          "request": raw.decode()}).encode()
                elif isinstance(script.body, bytes):
                    payload = script.body
                else:
                    payload = json.dumps(script.body).encode()
                self.send_response(script.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(payload)
            except OSError:
                pass  # the client went away (timeout / cancellation / cut-off tests)

        def _send_chunks(self, chunks: Iterator[bytes]) -> None:
            self.send_response(script.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Connection", "close")
            self.end_headers()
            try:
                for chunk in chunks:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    script.sent_chunks += 1
                self.wfile.write(b"0\r\n\r\n")
            finally:
                script.chunks_done.set()

        def log_message(self, format: str, *args: Any) -> None:
            return None

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    return httpd, thread


@pytest.fixture
def server() -> Iterator[tuple[str, Script]]:
    """A local chat-completions server and its script, stopped after the test."""
    script = Script()
    httpd, thread = serve(script)
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1", script
    finally:
        if script.hold is not None:
            script.hold.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join()


@pytest.mark.anyio
async def test_completion_text_and_request_body(server: tuple[str, Script]) -> None:
    """complete() posts model, prompt and max_tokens, no reasoning_effort, and strips text."""
    url, script = server
    client = OpenAIChatClient("small-model", base_url=url, api_key="k-123")
    assert isinstance(client, LLMService)
    text = await client.complete("Say hi", max_tokens=24)
    assert text == "Let me check."
    [body] = script.received
    assert body["model"] == "small-model" and body["max_tokens"] == 24
    assert body["messages"] == [{"role": "user", "content": "Say hi"}]
    assert "reasoning_effort" not in body and body["stream"] is False
    assert script.paths == ["/v1/chat/completions"]
    assert script.headers[0]["Authorization"] == "Bearer k-123"


@pytest.mark.anyio
async def test_reasoning_is_sent_only_when_asked(server: tuple[str, Script]) -> None:
    """reasoning=True adds reasoning_effort; max_tokens is capped at the limit."""
    url, script = server
    client = OpenAIChatClient("m", base_url=url, max_tokens_limit=50, reasoning_effort="low",
                              max_tokens_field="max_completion_tokens")
    await client.complete("x", max_tokens=500, reasoning=True)
    assert script.received[0]["reasoning_effort"] == "low"
    assert script.received[0]["max_completion_tokens"] == 50
    await client.complete("x", max_tokens=500)
    assert "reasoning_effort" not in script.received[1]


@pytest.mark.anyio
async def test_http_error_names_status_and_body(server: tuple[str, Script]) -> None:
    """A non-2xx reply raises LLMError (a TurnrouterError) naming status and body."""
    url, script = server
    script.status, script.body = 429, {"error": {"message": "rate limited"}}
    client = OpenAIChatClient("m", base_url=url)
    with pytest.raises(LLMError, match=r"HTTP 429: .*rate limited") as info:
        await client.complete("x", max_tokens=5)
    assert info.value.status == 429 and "rate limited" in info.value.body
    assert isinstance(info.value, TurnrouterError)


@pytest.mark.anyio
async def test_unreadable_reply_is_an_llm_error(server: tuple[str, Script]) -> None:
    """A 200 reply that is not a chat completion raises LLMError with the body."""
    url, script = server
    script.body = b"<html>proxy</html>"
    with pytest.raises(LLMError, match=r"unreadable reply .*proxy"):
        await OpenAIChatClient("m", base_url=url).complete("x", max_tokens=5)


@pytest.mark.anyio
async def test_content_parts_and_think_blocks(server: tuple[str, Script]) -> None:
    """List content parts are joined and <think> blocks removed."""
    url, script = server
    script.body = {"choices": [{"message": {"content": [
        {"type": "text", "text": "<think>hm</think>One "}, {"type": "text", "text": "moment."}]}}]}
    assert await OpenAIChatClient("m", base_url=url).complete("x", max_tokens=5) == "One moment."


@pytest.mark.anyio
async def test_timeout_raises_llm_error(server: tuple[str, Script]) -> None:
    """A server that does not answer within timeout_secs gives LLMError(timed out)."""
    url, script = server
    script.hold = threading.Event()
    client = OpenAIChatClient("m", base_url=url, timeout_secs=0.05)
    with pytest.raises(LLMError, match="timed out"):
        await client.complete("x", max_tokens=5)


@pytest.mark.anyio
async def test_cancellation_returns_promptly(server: tuple[str, Script]) -> None:
    """Cancelling a call in flight returns at once; the request had reached the server."""
    url, script = server
    script.hold = threading.Event()
    client = OpenAIChatClient("m", base_url=url, timeout_secs=30)
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(client.complete, "x", max_tokens=5))
        await anyio.to_thread.run_sync(script.arrived.wait, 10)
        tg.cancel_scope.cancel()
    assert script.received


@pytest.mark.anyio
async def test_connection_refused_is_an_llm_error() -> None:
    """No server listening: LLMError naming the URL."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = OpenAIChatClient("m", base_url=f"http://127.0.0.1:{port}/v1")
    with pytest.raises(LLMError, match=f"127.0.0.1:{port}"):
        await client.complete("x", max_tokens=5)


@pytest.mark.anyio
async def test_configuration_from_environment(monkeypatch: pytest.MonkeyPatch,
                                              server: tuple[str, Script]) -> None:
    """Model, base URL and key come from the usual environment variables."""
    url, script = server
    monkeypatch.setenv("OPENAI_BASE_URL", "http://localhost:8000/v1/")
    monkeypatch.setenv("OPENAI_API_KEY", "env-key")
    monkeypatch.delenv("TURNROUTER_LLM_MODEL", raising=False)
    monkeypatch.setenv("OPENAI_MODEL", "env-model")
    client = OpenAIChatClient()
    assert (client.model, client.url) == ("env-model", "http://localhost:8000/v1/chat/completions")
    monkeypatch.setenv("OPENAI_BASE_URL", url)
    await OpenAIChatClient().complete("x", max_tokens=5)
    assert script.headers[0]["Authorization"] == "Bearer env-key"
    assert script.received[0]["model"] == "env-model"
    monkeypatch.setenv("TURNROUTER_LLM_MODEL", "router-model")
    assert OpenAIChatClient().model == "router-model"


def test_invalid_configuration_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    """Missing model, bad URL, bad timeout and bad max_tokens raise ConfigurationError."""
    monkeypatch.delenv("TURNROUTER_LLM_MODEL", raising=False)
    monkeypatch.delenv("OPENAI_MODEL", raising=False)
    with pytest.raises(ConfigurationError, match="model"):
        OpenAIChatClient()
    with pytest.raises(ConfigurationError, match="base_url"):
        OpenAIChatClient("m", base_url="ftp://x")
    with pytest.raises(ConfigurationError, match="timeout_secs"):
        OpenAIChatClient("m", base_url="http://x", timeout_secs=0)
    with pytest.raises(ConfigurationError, match="timeout_secs"):  # not an OverflowError
        OpenAIChatClient("m", base_url="http://x", timeout_secs=10**400)
    with pytest.raises(ConfigurationError, match="max_tokens"):
        OpenAIChatClient("m", base_url="http://x").request_body("p", max_tokens=0)


@pytest.mark.parametrize(("settings", "named"), [
    ({"extra_body": {"max_tokens": 999_999}}, "extra_body may not set"),
    ({"extra_body": {"messages": []}}, "extra_body may not set"),
    ({"extra_body": {"stream": True}}, "extra_body may not set"),
    ({"extra_body": {"seed": float("nan")}}, "extra_body must be JSON"),
    ({"extra_body": {"x": object()}}, "extra_body must be JSON"),
    ({"max_tokens_field": "messages"}, "max_tokens_field"),
    ({"temperature": float("nan")}, "temperature"), ({"temperature": 5.0}, "temperature"),
    ({"timeout_secs": 1e308}, "timeout_secs"),
])
def test_settings_that_would_break_or_uncap_every_request_are_refused(
        settings: dict[str, Any], named: str) -> None:
    """Settings that would override the max_tokens cap, replace the prompt or stream,
    send NaN (not JSON: the provider refuses every call), or a timeout the platform's
    clock cannot hold (every call an OverflowError) are a ConfigurationError naming
    them; before, each was accepted and sent."""
    with pytest.raises(ConfigurationError, match=named):
        OpenAIChatClient("m", base_url="http://x", max_tokens_limit=64, **settings)
    body = OpenAIChatClient("m", base_url="http://x", max_tokens_limit=64,
                            extra_body={"seed": 7}).request_body("p", max_tokens=500)
    assert body["max_tokens"] == 64 and body["seed"] == 7


def reply(content: Any) -> dict[str, Any]:
    """A chat-completions reply carrying `content`."""
    return {"choices": [{"message": {"role": "assistant", "content": content}}]}


@pytest.mark.anyio
async def test_reply_announced_over_the_cap_is_cut_off_and_counted(
        server: tuple[str, Script], caplog: pytest.LogCaptureFixture) -> None:
    """A Content-Length over max_reply_bytes raises LLMError, counts and logs the cut-off."""
    url, script = server
    script.body = reply("x" * 5000)
    client = OpenAIChatClient("m", base_url=url, max_reply_bytes=1000)
    with caplog.at_level("WARNING", logger="turnrouter.llm"), pytest.raises(
            LLMError, match="max_reply_bytes=1000") as info:
        await client.complete("x", max_tokens=5)
    assert info.value.status == 200
    assert client.oversized_replies == 1
    assert any("max_reply_bytes=1000" in record.getMessage() for record in caplog.records)


@pytest.mark.anyio
async def test_endless_chunked_reply_is_cut_off_at_the_cap(server: tuple[str, Script]) -> None:
    """An endless chunked body stops being read at the cap: LLMError, counted, socket closed."""
    url, script = server
    script.chunks = lambda: itertools.repeat(b"x" * 4096, 64 * 1024)  # 256 MiB at most
    client = OpenAIChatClient("m", base_url=url, max_reply_bytes=64 * 1024, timeout_secs=30)
    with pytest.raises(LLMError, match="longer than max_reply_bytes=65536"):
        await client.complete("x", max_tokens=5)
    assert client.oversized_replies == 1
    assert await anyio.to_thread.run_sync(script.chunks_done.wait, 10)
    assert script.sent_chunks < 64 * 1024  # the server stopped: the client hung up


@pytest.mark.anyio
async def test_chunked_reply_within_the_cap_is_read(server: tuple[str, Script]) -> None:
    """A chunked reply under the cap is reassembled and parsed."""
    url, script = server
    payload = json.dumps(reply("Chunked hello.")).encode()
    script.chunks = lambda: iter([payload[:7], payload[7:20], payload[20:]])
    client = OpenAIChatClient("m", base_url=url, max_reply_bytes=len(payload))
    assert await client.complete("x", max_tokens=5) == "Chunked hello."
    assert client.oversized_replies == 0


def test_max_reply_bytes_must_be_positive() -> None:
    """max_reply_bytes below 1 (or not an int) is a ConfigurationError."""
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ConfigurationError, match="max_reply_bytes"):
            OpenAIChatClient("m", base_url="http://x", max_reply_bytes=bad)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_a_reply_of_unclosed_think_tags_is_an_llm_error(server: tuple[str, Script]
                                                              ) -> None:
    """Opening tags without a closing tag are reasoning cut off, never spoken: 900 kB of
    them (the quadratic regex needed minutes here) is an LLMError, counted."""
    url, script = server
    script.body = reply("<think>" * 130_000)
    client = OpenAIChatClient("m", base_url=url)
    with pytest.raises(LLMError, match="only reasoning") as info:
        await client.complete("x", max_tokens=5)
    assert info.value.status == 200
    assert client.empty_replies == 1


@pytest.mark.anyio
@pytest.mark.parametrize(("content", "why"), [
    ("<think>The user wants a forecast, so I should", "only reasoning"),
    ("<THINK>a</think> \n <think>b", "only reasoning"),
    ("<think>done</think>   ", "only reasoning"),
    ("", "an empty reply"),
    (" \n\t", "an empty reply"),
])
async def test_a_reply_with_no_visible_text_is_an_llm_error(
    server: tuple[str, Script], content: str, why: str,
) -> None:
    """A reasoning model cut off by its token limit (or an empty reply) gives nothing to
    speak: LLMError, counted in empty_replies; the next good reply still works."""
    url, script = server
    client = OpenAIChatClient("m", base_url=url)
    script.body = reply(content)
    with pytest.raises(LLMError, match=why):
        await client.complete("x", max_tokens=5)
    assert client.empty_replies == 1
    script.body = reply("Sure.")
    assert await client.complete("x", max_tokens=5) == "Sure."
    assert client.empty_replies == 1


@pytest.mark.anyio
async def test_text_before_an_unclosed_think_tag_is_kept(server: tuple[str, Script]) -> None:
    """Visible text, then reasoning cut off: only the text before the opening tag."""
    url, script = server
    script.body = reply("One moment. <think>I should also mention the rain")
    client = OpenAIChatClient("m", base_url=url)
    assert await client.complete("x", max_tokens=5) == "One moment."
    assert client.empty_replies == 0


@pytest.mark.anyio
async def test_every_closed_think_block_is_removed(server: tuple[str, Script]) -> None:
    """Many closed blocks, in any case, are all removed and the rest joined."""
    url, script = server
    script.body = reply("<THINK>a</think>One<think>b</Think> " * 20_000 + "end <think>")
    text = await OpenAIChatClient("m", base_url=url).complete("x", max_tokens=5)
    assert text == "One " * 20_000 + "end"


@pytest.mark.anyio
async def test_deeply_nested_reply_is_an_llm_error(server: tuple[str, Script]) -> None:
    """A reply nested past the recursion limit raises LLMError, not RecursionError."""
    url, script = server
    script.body = b'{"choices": ' + b"[" * 200_000
    with pytest.raises(LLMError, match="nested too deeply"):
        await OpenAIChatClient("m", base_url=url).complete("x", max_tokens=5)


@pytest.mark.anyio
async def test_non_utf8_reply_bytes_are_replaced(server: tuple[str, Script]) -> None:
    """Invalid UTF-8 in the content becomes U+FFFD; an invalid body is an LLMError."""
    url, script = server
    script.body = json.dumps(reply("ok")).encode().replace(b"ok", b"o\xffk")
    assert await OpenAIChatClient("m", base_url=url).complete("x", max_tokens=5) == "o\ufffdk"
    script.body = b"\xff\xfe\x00{"
    with pytest.raises(LLMError, match="unreadable reply"):
        await OpenAIChatClient("m", base_url=url).complete("x", max_tokens=5)


@pytest.mark.anyio
async def test_lone_surrogate_in_content_is_replaced(server: tuple[str, Script]) -> None:
    """A JSON-escaped lone surrogate cannot reach callers: it becomes U+FFFD."""
    url, script = server
    script.body = b'{"choices": [{"message": {"content": "a\\ud800b"}}]}'
    text = await OpenAIChatClient("m", base_url=url).complete("x", max_tokens=5)
    assert text == "a\ufffdb"
    text.encode("utf-8")  # storable


@pytest.mark.anyio
async def test_content_parts_without_text_strings_are_skipped(
        server: tuple[str, Script]) -> None:
    """Content parts whose text is missing or not a string are ignored, not a TypeError."""
    url, script = server
    script.body = reply([{"text": 5}, "junk", {"text": "Fine."}, {"type": "image"}])
    assert await OpenAIChatClient("m", base_url=url).complete("x", max_tokens=5) == "Fine."


@pytest.mark.anyio
async def test_credentials_in_the_base_url_are_redacted(server: tuple[str, Script]) -> None:
    """A password or key in the base URL never shows in repr() or in an LLMError."""
    url, script = server
    secret_url = url.replace("http://", "http://bob:pa55word@") + "?api_key=k-secret-1"
    client = OpenAIChatClient("m", base_url=secret_url)
    assert "pa55word" not in repr(client) and "k-secret-1" not in repr(client)
    assert "bob:***@" in repr(client) and "api_key=***" in repr(client)
    script.status, script.body = 500, {"error": "boom"}
    with pytest.raises(LLMError) as info:
        await client.complete("x", max_tokens=5)
    assert "pa55word" not in str(info.value) and "k-secret-1" not in str(info.value)
    assert "bob:***@" in str(info.value)
    with pytest.raises(ConfigurationError) as bad:
        OpenAIChatClient("m", base_url="ftp://bob:pa55word@host/")
    assert "pa55word" not in str(bad.value)


@pytest.mark.anyio
async def test_echoed_authorization_and_prompt_never_reach_the_error(
        server: tuple[str, Script]) -> None:
    """An error page echoing the request withholds it; the key is masked in any case."""
    url, script = server
    script.status, script.echo = 400, True
    client = OpenAIChatClient("m", base_url=url, api_key="sk-live-abcdef",
                              headers={"X-Custom-Token": "tok-998877"})
    prompt = "My card number is 4111 1111 1111 1111, please route me."
    with pytest.raises(LLMError, match="HTTP 400") as info:
        await client.complete(prompt, max_tokens=5)
    shown = str(info.value) + info.value.body
    for secret in ("sk-live-abcdef", "tok-998877", "4111 1111", "card number"):
        assert secret not in shown
    assert "withheld" in info.value.body


@pytest.mark.anyio
async def test_authorization_header_in_an_error_body_is_masked(
        server: tuple[str, Script]) -> None:
    """Credential-looking pairs in an error body are masked even for an unknown key."""
    url, script = server
    script.status = 401
    script.body = {"error": "invalid key", "Authorization": "Bearer sk-other-777",
                   "note": "see https://user:hunter2@proxy.example/"}
    with pytest.raises(LLMError, match="invalid key") as info:
        await OpenAIChatClient("m", base_url=url).complete("x", max_tokens=5)
    for secret in ("sk-other-777", "hunter2"):
        assert secret not in str(info.value) and secret not in info.value.body


def test_malformed_base_urls_are_configuration_errors() -> None:
    """A bad port, whitespace or an unparsable host is a ConfigurationError, not ValueError."""
    for bad in ("http://h:99999/v1", "http://h/v 1", "http://[::1/v1", "http://h/\nx"):
        with pytest.raises(ConfigurationError, match="base_url"):
            OpenAIChatClient("m", base_url=bad)


@pytest.mark.anyio
async def test_a_timed_out_reply_still_coming_has_its_socket_shut_down(
        server: tuple[str, Script]) -> None:
    """A reply whose headers came ("Connection: close") and whose body trickles: past
    timeout_secs the socket is shut down, so the server's next writes fail and the
    worker thread ends (before, `http.client` had handed the socket to the response
    and the abort found none: the thread read on as long as the server sent)."""
    url, script = server

    def trickle() -> Iterator[bytes]:
        for _ in range(600):  # a minute at most: the test waits 5 s below
            yield b" "
            threading.Event().wait(0.1)

    script.chunks = trickle
    client = OpenAIChatClient("m", base_url=url, timeout_secs=0.3)
    with pytest.raises(LLMError, match="timed out"):
        await client.complete("x", max_tokens=5)
    assert await anyio.to_thread.run_sync(script.chunks_done.wait, 5.0)
    assert script.sent_chunks < 100


@pytest.mark.anyio
async def test_a_cancel_during_the_tls_handshake_closes_the_socket() -> None:
    """An https endpoint that accepts the connection and never answers the handshake:
    cancelling the call closes its socket at once (the listener reads the end of it),
    not after timeout_secs."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    closed = threading.Event()

    def accept() -> None:
        conn, _ = listener.accept()
        accepted.append(conn)
        conn.settimeout(10)
        with contextlib.suppress(OSError):
            while conn.recv(4096):  # the ClientHello, then the end of the connection
                pass
        closed.set()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    port = listener.getsockname()[1]
    client = OpenAIChatClient("m", base_url=f"https://127.0.0.1:{port}/v1", timeout_secs=30)
    try:
        with anyio.move_on_after(0.3):
            await client.complete("x", max_tokens=5)
        assert await anyio.to_thread.run_sync(closed.wait, 5.0)
    finally:
        for conn in accepted:
            conn.close()
        listener.close()
        thread.join(10)


@pytest.mark.anyio
async def test_a_base_url_with_a_query_keeps_it_after_the_endpoint(
        server: tuple[str, Script]) -> None:
    """`base_url` with a query (Azure's `?api-version=...`): POST to
    `<path>/chat/completions?<query>` (before, the endpoint went into the query)."""
    url, script = server
    client = OpenAIChatClient("m", base_url=f"{url}/?api-version=2024-10-21")
    assert await client.complete("x", max_tokens=5) == "Let me check."
    assert script.paths == ["/v1/chat/completions?api-version=2024-10-21"]


@pytest.mark.anyio
@pytest.mark.parametrize("field_name", ["reasoning_content", "reasoning"])
async def test_reasoning_in_a_field_of_its_own_and_no_content_is_only_reasoning(
        server: tuple[str, Script], field_name: str) -> None:
    """`content: null` with the reasoning in `reasoning_content` (vLLM, SGLang) or
    `reasoning` (Ollama, OpenRouter), a reasoning model cut off by its token limit:
    "only reasoning", counted in `empty_replies`, the reasoning never in the error."""
    url, script = server
    script.body = {"choices": [{"message": {"role": "assistant", "content": None,
                                            field_name: "The user wants rain news"}}]}
    client = OpenAIChatClient("m", base_url=url)
    with pytest.raises(LLMError, match="only reasoning") as caught:
        await client.complete("x", max_tokens=5)
    assert client.empty_replies == 1
    assert "rain" not in str(caught.value) and "rain" not in (caught.value.body or "")


@pytest.mark.anyio
async def test_a_failing_classifier_says_why_at_warning(server: tuple[str, Script],
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A classifier whose server answers 401 (or nothing listening) fails every turn to
    the default: the WARNING names the HTTP status and the redacted URL, so an operator
    need not enable DEBUG to see why (newcomer16). The reply's body, the prompt and the
    key stay out of it."""
    from turnrouter import AgentRouter, AgentTurn
    from turnrouter.decisions import ClassifierDecisions
    from turnrouter.testing import OutputRecorder, ScriptedAgent

    url, script = server
    script.status, script.body = 401, {"error": {"message": "bad key sk-secret-9 for you"}}
    client = OpenAIChatClient("m", base_url=url, api_key="sk-secret-9")
    agents = {name: ScriptedAgent(name) for name in ("billing", "conversation")}
    router = AgentRouter(agents, ClassifierDecisions(client), output=OutputRecorder(),
                         default_destination="conversation", overload=None)
    with caplog.at_level("WARNING", logger="turnrouter"), anyio.fail_after(10):
        result = await router.handle(AgentTurn("p1", "t1", "my private question"))
    assert result.disposition == "answer"  # the default answered
    (record,) = [r for r in caplog.records if "decision service" in r.getMessage()]
    message = record.getMessage()
    assert "HTTP 401" in message and f"127.0.0.1:{url.split(':')[-1].split('/')[0]}" in message
    assert "sk-secret" not in message and "bad key" not in message
    assert "private question" not in message
    await router.stop()


@pytest.mark.parametrize(("kwargs", "where"), [
    ({"api_key": "sk-SECRET1234567890\n"}, "api_key"),
    ({"api_key": "sk-SECRET\r\nX-Evil: 1"}, "api_key"),
    ({"api_key": "sk-SECRET\u20ac"}, "api_key"),
    ({"headers": {"api-key": "azkey-SECRET0123456789\n"}}, "headers['api-key']"),
    ({"headers": {"api-key": "azkey-SECRET\x00"}}, "headers['api-key']"),
    ({"headers": {"api-key": 7}}, "headers['api-key']"),
    ({"headers": {"bad name": "SECRET-value"}}, "not an HTTP header name"),
])
def test_a_credential_no_header_can_carry_is_refused_without_showing_it(
        kwargs: dict[str, Any], where: str) -> None:
    """An API key or header value with a newline (a key read from a file), a control
    character or a non-Latin-1 character is refused at construction, naming where it
    was and never showing it: it failed only at the first call, in an `LLMError` that
    quoted the key's bytes (and in the chained error), logged at WARNING on every turn
    (bounds17 H4)."""
    with pytest.raises(ConfigurationError) as refused:
        OpenAIChatClient("m", base_url="http://127.0.0.1:9/v1", **kwargs)
    assert where in str(refused.value)
    assert "SECRET" not in str(refused.value)


def test_a_key_from_the_environment_with_its_newline_is_refused_naming_the_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`$OPENAI_API_KEY` set from a file with its newline is named as the variable."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-SECRET1234567890\n")
    with pytest.raises(ConfigurationError, match=r"\$OPENAI_API_KEY") as refused:
        OpenAIChatClient("m", base_url="http://127.0.0.1:9/v1")
    assert "SECRET" not in str(refused.value)
