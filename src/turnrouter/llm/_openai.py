"""`OpenAIChatClient`: an OpenAI-compatible chat-completions client on the standard library.

Why the standard library: turnrouter's runtime dependencies are pydantic, anyio,
opentelemetry-api and prometheus-client only, and an acknowledgment is one small
request per slow turn. `http.client` runs in an anyio worker thread
(`anyio.to_thread.run_sync(..., abandon_on_cancel=True)`); cancelling the caller returns
at once and shuts the socket down so the thread ends too. No connection pooling: a new
connection per call (TLS included) - fine at acknowledgment rates; put a local gateway
in front for very high rates.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import os
import re
import socket
import ssl
import threading
import urllib.parse
from collections.abc import Mapping
from typing import Any

import anyio
import anyio.to_thread

from .._exceptions import ConfigurationError
from ._errors import LLMError

__all__ = ["MODEL_ENV_VARS", "OpenAIChatClient"]

DEFAULT_BASE_URL = "https://api.openai.com/v1"
#: Environment variables naming the model, first set wins.
MODEL_ENV_VARS = ("TURNROUTER_LLM_MODEL", "OPENAI_MODEL")
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_BODY_PREVIEW = 500


class _Call:
    """One blocking HTTP exchange, abortable from another thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conn: http.client.HTTPConnection | None = None
        self._aborted = False

    def attach(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if self._aborted:
                raise LLMError("chat completion cancelled")
            self._conn = conn

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            conn = self._conn
        sock = None if conn is None else conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class OpenAIChatClient:
    """An `LLMService` for any OpenAI-compatible `POST {base_url}/chat/completions`.

    - `model`: else `$TURNROUTER_LLM_MODEL`, else `$OPENAI_MODEL` (ConfigurationError if
      none); `base_url`: else `$OPENAI_BASE_URL`, else `https://api.openai.com/v1`;
      `api_key`: else `$OPENAI_API_KEY` (optional: local servers need none).
    - Non-reasoning by default: `reasoning_effort` is sent only when a call asks for
      `reasoning=True` (value `reasoning_effort`, default "low"); `extra_body` lets you
      add provider-specific switches (some providers reason unless their own model-level
      setting says otherwise - the per-call setting cannot override those).
    - `max_tokens` is required per call and capped at `max_tokens_limit`; the field name
      is `max_tokens_field` ("max_tokens", or "max_completion_tokens" for providers that
      want it).
    - `timeout_secs` bounds the whole call (connect, send, reply).
    Failures raise `turnrouter.llm.LLMError` naming the URL, HTTP status and body.
    """

    def __init__(
        self, model: str | None = None, *, base_url: str | None = None,
        api_key: str | None = None, timeout_secs: float = 10.0, max_tokens_limit: int = 1024,
        temperature: float | None = 0.7, reasoning_effort: str = "low",
        max_tokens_field: str = "max_tokens", extra_body: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        model = model or next((os.environ[v] for v in MODEL_ENV_VARS if os.environ.get(v)), None)
        if not model:
            raise ConfigurationError(
                "OpenAIChatClient needs a model: pass model=... or set "
                + " or ".join(f"${v}" for v in MODEL_ENV_VARS))
        base = base_url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL
        parts = urllib.parse.urlsplit(base)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigurationError(
                f"OpenAIChatClient base_url must be an http(s) URL, got {base!r}")
        if not (math.isfinite(timeout_secs) and timeout_secs > 0):
            raise ConfigurationError(
                f"OpenAIChatClient timeout_secs must be finite and positive, got {timeout_secs!r}")
        if max_tokens_limit < 1:
            raise ConfigurationError("OpenAIChatClient max_tokens_limit must be >= 1")
        self.model = model
        self.base_url = base.rstrip("/")
        self.url = self.base_url + "/chat/completions"
        self._parts = urllib.parse.urlsplit(self.url)
        self._api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self.timeout_secs = timeout_secs
        self.max_tokens_limit = max_tokens_limit
        self.temperature = temperature
        self.reasoning_effort = reasoning_effort
        self.max_tokens_field = max_tokens_field
        self._extra = dict(extra_body or {})
        self._headers = dict(headers or {})

    def __repr__(self) -> str:
        return f"OpenAIChatClient(model={self.model!r}, base_url={self.base_url!r})"

    def request_body(self, prompt: str, *, max_tokens: int, reasoning: bool = False
                     ) -> dict[str, Any]:
        """The JSON body `complete()` sends (exposed for inspection and tests)."""
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ConfigurationError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            self.max_tokens_field: min(max_tokens, self.max_tokens_limit),
            "stream": False,
        }
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if reasoning:
            body["reasoning_effort"] = self.reasoning_effort
        body.update(self._extra)
        return body

    async def complete(self, prompt: str, *, max_tokens: int, reasoning: bool = False) -> str:
        """The assistant message text of one chat completion."""
        payload = json.dumps(self.request_body(prompt, max_tokens=max_tokens,
                                               reasoning=reasoning)).encode()
        call = _Call()
        with anyio.move_on_after(self.timeout_secs) as scope:
            try:
                status, raw = await anyio.to_thread.run_sync(
                    self._post, payload, call, abandon_on_cancel=True)
            except BaseException:
                call.abort()
                raise
        if scope.cancelled_caught:
            call.abort()
            raise LLMError(f"chat completion at {self.url} timed out after "
                           f"{self.timeout_secs}s")
        text = raw.decode("utf-8", "replace")
        if not 200 <= status < 300:
            raise LLMError(f"chat completion at {self.url} returned HTTP {status}: "
                           f"{text[:_BODY_PREVIEW]}", status=status, body=text[:_BODY_PREVIEW])
        return _content(text, self.url, status)

    def _post(self, payload: bytes, call: _Call) -> tuple[int, bytes]:
        parts = self._parts
        conn: http.client.HTTPConnection
        if parts.scheme == "https":
            conn = http.client.HTTPSConnection(parts.hostname or "", parts.port,
                                               timeout=self.timeout_secs,
                                               context=ssl.create_default_context())
        else:
            conn = http.client.HTTPConnection(parts.hostname or "", parts.port,
                                              timeout=self.timeout_secs)
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        headers = {"Content-Type": "application/json", "Accept": "application/json",
                   "User-Agent": "turnrouter", **self._headers}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        try:
            call.attach(conn)
            conn.request("POST", path, body=payload, headers=headers)
            response = conn.getresponse()
            return response.status, response.read()
        except LLMError:
            raise
        except (OSError, http.client.HTTPException) as exc:
            raise LLMError(f"chat completion at {self.url} failed: {exc!r}") from exc
        finally:
            conn.close()


def _content(text: str, url: str, status: int) -> str:
    try:
        data = json.loads(text)
        message = data["choices"][0]["message"]
        content = message.get("content")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        raise LLMError(f"chat completion at {url} returned an unreadable reply (HTTP "
                       f"{status}): {text[:_BODY_PREVIEW]}", status=status,
                       body=text[:_BODY_PREVIEW]) from None
    if isinstance(content, list):  # content parts
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    if not isinstance(content, str):
        raise LLMError(f"chat completion at {url} returned no text content (HTTP {status}): "
                       f"{text[:_BODY_PREVIEW]}", status=status, body=text[:_BODY_PREVIEW])
    return _THINK.sub("", content).strip()
