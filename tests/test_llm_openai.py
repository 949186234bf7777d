"""OpenAIChatClient against a local chat-completions server on 127.0.0.1 (a real socket)."""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Iterator
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
    received: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    arrived: threading.Event = field(default_factory=threading.Event)


@pytest.fixture
def server() -> Iterator[tuple[str, Script]]:
    """A threaded HTTP server speaking the chat-completions format."""
    script = Script()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            script.received.append(json.loads(self.rfile.read(length)))
            script.headers.append(dict(self.headers))
            script.paths.append(self.path)
            script.arrived.set()
            if script.hold is not None:
                script.hold.wait(10)
            payload = script.body if isinstance(script.body, bytes) else json.dumps(
                script.body).encode()
            try:
                self.send_response(script.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
            except OSError:
                pass  # the client went away (timeout / cancellation tests)

        def log_message(self, format: str, *args: Any) -> None:
            return None

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, args=(0.01,), daemon=True)
    thread.start()
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
    assert "Authorization" not in script.headers[0] or client._api_key


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


def test_configuration_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Model, base URL and key come from the usual environment variables."""
    monkeypatch.setenv("OPENAI_BASE_URL", "http://localhost:8000/v1/")
    monkeypatch.setenv("OPENAI_API_KEY", "env-key")
    monkeypatch.delenv("TURNROUTER_LLM_MODEL", raising=False)
    monkeypatch.setenv("OPENAI_MODEL", "env-model")
    client = OpenAIChatClient()
    assert (client.model, client.url) == ("env-model", "http://localhost:8000/v1/chat/completions")
    assert client._api_key == "env-key"
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
    with pytest.raises(ConfigurationError, match="max_tokens"):
        OpenAIChatClient("m", base_url="http://x").request_body("p", max_tokens=0)
