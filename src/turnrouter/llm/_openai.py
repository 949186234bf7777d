"""`OpenAIChatClient`: an OpenAI-compatible chat-completions client on the standard library.

Why the standard library: turnrouter's runtime dependencies are pydantic, anyio,
opentelemetry-api and prometheus-client only, and an acknowledgment is one small
request per slow turn. `http.client` runs in an anyio worker thread
(`anyio.to_thread.run_sync(..., abandon_on_cancel=True)`); cancelling the caller returns
at once and shuts the socket down so the thread ends too. No connection pooling: a new
connection per call (TLS included) - fine at acknowledgment rates; put a local gateway
in front for very high rates.

Bounds (see docs/limits.md): the reply body is read in chunks up to `max_reply_bytes`
(1 MiB by default; a bigger or endless reply raises `LLMError` and is counted in
`oversized_replies`), and decoding, JSON parsing and reasoning-tag stripping all run in
the worker thread, inside the timeout, so a big reply never blocks the event loop.
Exceptions never carry credentials (URLs are shown redacted, echoed headers masked) nor
the prompt (a server body that echoes the request is withheld).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
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
from .._headers import HEADER_NAME
from .._numbers import finite
from .._redact import preview, redact_text, redact_url, strip_reasoning, strip_surrogates
from ._errors import LLMError

__all__ = ["DEFAULT_MAX_REPLY_BYTES", "MODEL_ENV_VARS", "OpenAIChatClient"]

logger = logging.getLogger("turnrouter.llm")

DEFAULT_BASE_URL = "https://api.openai.com/v1"
#: Environment variables naming the model, first set wins.
MODEL_ENV_VARS = ("TURNROUTER_LLM_MODEL", "OPENAI_MODEL")
#: Default cap on a reply body (bytes); past it the call raises LLMError.
DEFAULT_MAX_REPLY_BYTES = 1 << 20
#: The request fields the client sets itself, which `extra_body` may not replace.
_OWN_FIELDS = frozenset(("model", "messages", "stream", "temperature", "reasoning_effort"))
_MAX_TOKENS_FIELDS = frozenset(("max_tokens", "max_completion_tokens"))
#: The longest `timeout_secs` (a day: past it the platform's clock overflows).
_MAX_TIMEOUT_SECS = 86400.0
_THINK_OPEN = re.compile(r"<think(?:ing)?\b", re.IGNORECASE)
#: Where servers put a reasoning model's reasoning beside (or instead of) the content.
_REASONING_FIELDS = ("reasoning_content", "reasoning")

_BODY_PREVIEW = 500
_READ_CHUNK = 64 * 1024
# A body sharing an aligned window of this many characters with the prompt is withheld
# from errors (the server echoed the request, user text included).
_ECHO_WINDOW = 12
_WITHHELD = "[body withheld: it echoes the request]"


class _Call:
    """One blocking HTTP exchange, abortable from another thread: it holds the socket
    itself from the moment it exists (connecting, in the TLS handshake, and while a reply
    is read after `http.client` handed the socket to the response), so an abort always
    finds something to shut down and the worker thread ends at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._aborted = False

    def hold(self, sock: socket.socket) -> None:
        """The call's socket now (the TLS one once wrapped); raises if aborted."""
        with self._lock:
            if self._aborted:
                sock.close()
                raise OSError("chat completion cancelled")
            self._sock = sock

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def _connect(host: str, port: int, timeout: float | None, call: _Call) -> socket.socket:
    """`socket.create_connection`, each socket held by `call` before it connects."""
    error: OSError | None = None
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, 0,
                                                              socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            call.hold(sock)
            sock.settimeout(timeout)
            sock.connect(address)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError as exc:
            error = exc
            sock.close()
    raise error or OSError(f"no address for {host!r}")


class _HTTP(http.client.HTTPConnection):
    """An HTTP connection whose socket its `_Call` holds (see `_Call`)."""

    def __init__(self, host: str, port: int | None, timeout: float, call: _Call) -> None:
        super().__init__(host, port, timeout=timeout)
        self._call = call

    def connect(self) -> None:
        self.sock = _connect(self.host, self.port, self.timeout, self._call)


class _HTTPS(http.client.HTTPSConnection):
    """An HTTPS connection whose sockets (TCP, then TLS) its `_Call` holds, the
    handshake done once the TLS socket is held (so an abort also ends a handshake the
    server never completes)."""

    def __init__(self, host: str, port: int | None, timeout: float, call: _Call,
                 context: ssl.SSLContext) -> None:
        super().__init__(host, port, timeout=timeout, context=context)
        self._call, self._tls = call, context

    def connect(self) -> None:
        raw = _connect(self.host, self.port, self.timeout, self._call)
        tls = self._tls.wrap_socket(raw, server_hostname=self.host,
                                    do_handshake_on_connect=False)
        self.sock = tls
        self._call.hold(tls)
        tls.do_handshake()


def _check_header_value(value: object, where: str) -> None:
    """`ConfigurationError` naming `where`, never the value, unless `value` is None or a
    str http.client can send as a header: one line of Latin-1 without control
    characters. A key read from a file with its newline was refused only at the first
    call, by http.client, whose error quoted the key's bytes (bounds17 H4)."""
    if value is None:
        return
    if not isinstance(value, str):
        raise ConfigurationError(f"OpenAIChatClient {where} must be a str, got "
                                 f"{type(value).__name__}")
    if any(ord(ch) < 32 or ord(ch) == 127 or ord(ch) > 255 for ch in value):
        raise ConfigurationError(
            f"OpenAIChatClient {where} holds a line break, a control character or a "
            "character outside Latin-1, which no HTTP header can carry (a key read from a "
            "file with its newline? strip it)")


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
    - `timeout_secs` bounds the whole call (connect, send, reply, parsing).
    - `max_reply_bytes` caps the reply body (default 1 MiB); a longer or endless reply
      raises LLMError and adds one to `oversized_replies`.
    Failures raise `turnrouter.llm.LLMError` naming the (redacted) URL, HTTP status and
    the start of the body, with credentials masked and request echoes withheld.

    Args:
        model: The model name (see above for the environment fallbacks).
        base_url: The API's base URL (see above).
        api_key: The bearer token (see above).
        timeout_secs: Bound on a whole call (default 10 s).
        max_tokens_limit: Cap on any call's `max_tokens` (default 1024).
        temperature: Sampling temperature sent with each call (None: not sent).
        reasoning_effort: Sent only for calls with `reasoning=True` (default "low").
        max_tokens_field: The request field carrying the token budget.
        extra_body: Provider-specific fields added to every request body.
        headers: Extra HTTP headers (e.g. an organisation or project id).
        max_reply_bytes: Cap on a reply body (default 1 MiB).
    """

    def __init__(
        self, model: str | None = None, *, base_url: str | None = None,
        api_key: str | None = None, timeout_secs: float = 10.0, max_tokens_limit: int = 1024,
        temperature: float | None = 0.7, reasoning_effort: str = "low",
        max_tokens_field: str = "max_tokens", extra_body: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
    ) -> None:
        model = model or next((os.environ[v] for v in MODEL_ENV_VARS if os.environ.get(v)), None)
        if not model:
            raise ConfigurationError(
                "OpenAIChatClient needs a model: pass model=... or set "
                + " or ".join(f"${v}" for v in MODEL_ENV_VARS))
        base = base_url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL
        try:
            parts = urllib.parse.urlsplit(base)
            valid = parts.scheme in ("http", "https") and bool(parts.hostname)
            parts.port  # noqa: B018 - raises ValueError for a port outside 0-65535
        except ValueError:
            valid = False
        if not valid or any(ch.isspace() or not ch.isprintable() for ch in base):
            raise ConfigurationError(
                f"OpenAIChatClient base_url must be an http(s) URL, got {redact_url(base)!r}")
        if not (finite(timeout_secs) and 0 < timeout_secs <= _MAX_TIMEOUT_SECS):
            raise ConfigurationError("OpenAIChatClient timeout_secs must be in (0, "
                                     f"{_MAX_TIMEOUT_SECS:g}], got {preview(timeout_secs)}")
        if temperature is not None and not (finite(temperature) and 0 <= temperature <= 2):
            raise ConfigurationError("OpenAIChatClient temperature must be None or in "
                                     f"[0, 2], got {preview(temperature)}")
        if max_tokens_field not in _MAX_TOKENS_FIELDS:
            raise ConfigurationError(
                f"OpenAIChatClient max_tokens_field must be one of {sorted(_MAX_TOKENS_FIELDS)}, "
                f"got {preview(max_tokens_field)}")
        owned = sorted(set(extra_body or {}) & {*_OWN_FIELDS, *_MAX_TOKENS_FIELDS})
        if owned:
            raise ConfigurationError(
                f"OpenAIChatClient extra_body may not set {owned}: the client sets them "
                "(max_tokens is capped at max_tokens_limit)")
        try:
            json.dumps(dict(extra_body or {}), allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:
            raise ConfigurationError(
                f"OpenAIChatClient extra_body must be JSON (no NaN or infinity): "
                f"{type(exc).__name__}") from None
        if (not isinstance(max_tokens_limit, int) or isinstance(max_tokens_limit, bool)
                or max_tokens_limit < 1):
            raise ConfigurationError("OpenAIChatClient max_tokens_limit must be >= 1")
        if (not isinstance(max_reply_bytes, int) or isinstance(max_reply_bytes, bool)
                or max_reply_bytes < 1):
            raise ConfigurationError("OpenAIChatClient max_reply_bytes must be an int >= 1, "
                                     f"got {preview(max_reply_bytes)}")
        self.model = model
        self.base_url = base.rstrip("/")
        # The endpoint joins the path, keeping a query (Azure's `?api-version=...`, a
        # gateway's key): appended to the URL it went into the query's value instead.
        parts = urllib.parse.urlsplit(base)
        self.url = urllib.parse.urlunsplit(parts._replace(
            path=parts.path.rstrip("/") + "/chat/completions", fragment=""))
        self._shown_url = redact_url(self.url)
        self._parts = urllib.parse.urlsplit(self.url)
        self._api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        _check_header_value(self._api_key, "api_key" if api_key is not None
                            else "$OPENAI_API_KEY")
        for name, value in dict(headers or {}).items():
            if not (isinstance(name, str) and HEADER_NAME.fullmatch(name)):
                raise ConfigurationError(f"OpenAIChatClient headers: {preview(name)} is not "
                                         "an HTTP header name")
            _check_header_value(value, f"headers[{name!r}]")
        self.timeout_secs = timeout_secs
        self.max_tokens_limit = max_tokens_limit
        self.max_reply_bytes = max_reply_bytes
        self.temperature = temperature
        self.reasoning_effort = reasoning_effort
        self.max_tokens_field = max_tokens_field
        self._extra = dict(extra_body or {})
        self._headers = dict(headers or {})
        secrets = [value for value in self._headers.values() if isinstance(value, str)]
        userinfo = self._parts.password
        self._secrets = tuple(s for s in (self._api_key, userinfo, *secrets) if s)
        self._count_lock = threading.Lock()
        self._oversized = 0
        self._empty = 0

    def __repr__(self) -> str:
        return f"OpenAIChatClient(model={self.model!r}, base_url={redact_url(self.base_url)!r})"

    @property
    def empty_replies(self) -> int:
        """How many replies had no visible text once reasoning was removed (each raised
        LLMError): only `<think>` blocks, closed or cut off, or nothing at all."""
        return self._empty

    @property
    def oversized_replies(self) -> int:
        """How many replies were cut off at `max_reply_bytes` (each raised LLMError)."""
        return self._oversized

    def request_body(self, prompt: str, *, max_tokens: int, reasoning: bool = False
                     ) -> dict[str, Any]:
        """The JSON body `complete()` sends (exposed for inspection and tests)."""
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ConfigurationError(f"max_tokens must be an int >= 1, got {preview(max_tokens)}")
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
        """The assistant message text of one chat completion.

        Everything proportional to the prompt or reply size (JSON encoding, reading,
        decoding, parsing) runs in the worker thread under `timeout_secs`.
        """
        if not isinstance(prompt, str):
            raise ConfigurationError(f"prompt must be a str, got {type(prompt).__name__}")
        body = self.request_body(prompt, max_tokens=max_tokens, reasoning=reasoning)
        call = _Call()
        text = ""
        with anyio.move_on_after(self.timeout_secs) as scope:
            try:
                text = await anyio.to_thread.run_sync(
                    self._exchange, body, prompt, call, abandon_on_cancel=True)
            except BaseException:
                call.abort()
                raise
        if scope.cancelled_caught:
            call.abort()
            raise LLMError(f"chat completion at {self._shown_url} timed out after "
                           f"{self.timeout_secs}s")
        return text

    def _exchange(self, body: dict[str, Any], prompt: str, call: _Call) -> str:
        """Worker thread: encode, post, read (capped), decode and parse one completion."""
        try:
            payload = json.dumps(body).encode()
        except (TypeError, ValueError, RecursionError) as exc:  # extra_body not JSON-able
            raise LLMError(f"chat completion request for {self._shown_url} is not "
                           f"JSON-serialisable: {type(exc).__name__}") from exc
        status, raw = self._post(payload, call)
        text = raw.decode("utf-8", "replace")
        if not 200 <= status < 300:
            shown = self._preview(text, prompt)
            raise LLMError(f"chat completion at {self._shown_url} returned HTTP {status}: "
                           f"{shown}", status=status, body=shown)
        return self._content(text, status, prompt)

    def _post(self, payload: bytes, call: _Call) -> tuple[int, bytes]:
        parts = self._parts
        conn: http.client.HTTPConnection
        if parts.scheme == "https":
            conn = _HTTPS(parts.hostname or "", parts.port, self.timeout_secs, call,
                          ssl.create_default_context())
        else:
            conn = _HTTP(parts.hostname or "", parts.port, self.timeout_secs, call)
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        headers = {"Content-Type": "application/json", "Accept": "application/json",
                   "User-Agent": "turnrouter", **self._headers}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        response: http.client.HTTPResponse | None = None
        try:
            conn.request("POST", path, body=payload, headers=headers)
            response = conn.getresponse()
            return response.status, self._read(response)
        except LLMError:
            raise
        except ValueError as exc:
            # An invalid header value or URL character, rejected by http.client (checked
            # at construction; never chained: its message quotes the value, a key's
            # bytes as their repr, which no redaction of the key itself finds).
            raise LLMError(f"chat completion at {self._shown_url} failed: "
                           f"{type(exc).__name__} (a header or the URL)") from None
        except (OSError, http.client.HTTPException) as exc:
            detail = redact_text(f"{type(exc).__name__}: {exc}"[:200], self._secrets)
            raise LLMError(f"chat completion at {self._shown_url} failed: {detail}") from exc
        finally:
            # Close the response too: its file object keeps the socket open (a cut-off
            # reply would otherwise stay connected while the error is referenced).
            if response is not None:
                response.close()
            conn.close()

    def _read(self, response: http.client.HTTPResponse) -> bytes:
        """The body, at most `max_reply_bytes`; an announced or actual overflow raises."""
        cap = self.max_reply_bytes
        if response.length is not None and response.length > cap:
            self._overflow(response.status, f"announces {response.length} bytes, more")
        chunks: list[bytes] = []
        total = 0
        while True:
            chunk = response.read(min(_READ_CHUNK, cap + 1 - total))
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            total += len(chunk)
            if total > cap:
                self._overflow(response.status, "is longer")

    def _overflow(self, status: int, how: str) -> None:
        with self._count_lock:
            self._oversized += 1
        message = (f"chat completion at {self._shown_url} (HTTP {status}): the reply {how} "
                   f"than max_reply_bytes={self.max_reply_bytes}")
        logger.warning("turnrouter: %s; cut off", message)
        raise LLMError(message, status=status)

    def _preview(self, text: str, prompt: str) -> str:
        """The start of a body for an error: credentials masked, request echoes withheld."""
        head = redact_text(text[:2 * _BODY_PREVIEW], self._secrets)[:_BODY_PREVIEW]
        return _WITHHELD if _echoes(head, prompt) else head

    def _content(self, text: str, status: int, prompt: str) -> str:
        problem = ""
        content: object = None
        try:
            data = json.loads(text)
            message = data["choices"][0]["message"]
            content = message.get("content")
        except RecursionError:
            problem = "a reply nested too deeply"
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            problem = "an unreadable reply"
        if not problem:
            if isinstance(content, list):  # content parts
                content = "".join(part["text"] for part in content
                                  if isinstance(part, dict) and isinstance(part.get("text"), str))
            if content is None and any(isinstance(message.get(field), str) and message[field]
                                       for field in _REASONING_FIELDS):
                # Reasoning in a field of its own and no content (vLLM, SGLang, Ollama,
                # OpenRouter: a reasoning model cut off by its token limit): only
                # reasoning, counted as such and never shown (it may quote the user).
                content = "<think>"
            if not isinstance(content, str):
                problem = "no text content"
        if problem:
            shown = self._preview(text, prompt)
            raise LLMError(f"chat completion at {self._shown_url} returned {problem} (HTTP "
                           f"{status}): {shown}", status=status, body=shown)
        assert isinstance(content, str)
        visible = strip_reasoning(strip_surrogates(content)).strip()
        if not visible:
            # A reasoning model cut off by its token limit replies "<think>..." only:
            # nothing of it may be spoken, and an empty string is no answer either.
            with self._count_lock:
                self._empty += 1
            what = "only reasoning" if _THINK_OPEN.search(content) else "an empty reply"
            raise LLMError(f"chat completion at {self._shown_url} returned {what}, no "
                           f"visible text (HTTP {status})", status=status)
        return visible


def _echoes(body: str, prompt: str) -> bool:
    """Whether `body` repeats any run of about 2 x `_ECHO_WINDOW` prompt characters.

    Checks aligned windows of the body against the prompt as sent (raw and JSON-escaped),
    so an echo of the user's text is caught even when the server truncated it.
    """
    if not prompt or not body:
        return False
    variants = {prompt, json.dumps(prompt)[1:-1], json.dumps(prompt, ensure_ascii=False)[1:-1]}
    step = _ECHO_WINDOW // 2
    windows = {body[i:i + _ECHO_WINDOW] for i in range(0, max(1, len(body) - step), step)}
    if len(prompt) < _ECHO_WINDOW:  # a short prompt: withhold on a whole occurrence
        return len(prompt) >= _ECHO_WINDOW // 2 and any(v in body for v in variants)
    return any(len(window) == _ECHO_WINDOW and window in variant
               for window in windows for variant in variants)

