"""Redaction helpers shared by every module that shows a URL, an error body or a value.

Why one module: credentials in a URL (`https://user:secret@host/?api_key=...`), an
`Authorization` header echoed back in a server's error body, or user text repeated in a
reply must never reach `repr()`, exceptions, logs or telemetry. Each helper is linear in
its input and never raises.
"""

from __future__ import annotations

import re
import reprlib
import urllib.parse
from collections.abc import Iterable

__all__ = [
    "REDACTED", "has_surrogates", "looks_like_nkey_seed", "one_line", "preview",
    "redact_text", "redact_url", "strip_reasoning", "strip_surrogates",
]

#: What replaces a secret.
REDACTED = "***"

_SECRET_QUERY_KEY = re.compile(
    r"(?:key|token|secret|passw|pwd|auth|sig|credential|session)", re.IGNORECASE)
# Header-like "name: value" / "name=value" / JSON "name": "value" pairs that carry
# credentials. Each alternative is a bounded literal followed by one greedy class run,
# so the scan is linear.
_SECRET_PAIR = re.compile(
    r"""((?:proxy-)?authorization|x-api-key|api[-_]?key|access[-_]?token|"""
    r"""secret|password|cookie|set-cookie)(["']?\s{0,8}[:=]\s{0,8}["']?)([^"'\r\n,}]*)""",
    re.IGNORECASE)
_BEARER = re.compile(r"\b(bearer)(\s{1,8})([A-Za-z0-9._~+/=-]+)", re.IGNORECASE)
_URL_USERINFO = re.compile(r"([a-z][a-z0-9+.-]{0,20}://)[^/@\s\"']{1,256}@", re.IGNORECASE)
_SCHEME = re.compile(r"[a-z][a-z0-9+.-]{0,20}://", re.IGNORECASE)
_SURROGATES = re.compile("[\ud800-\udfff]")
#: An NKEY seed (NATS): "S", the key's type, then base32 (58 characters in all).
_NKEY_SEED = re.compile(r"\bS[UOANCXP][A-Z2-7]{56}\b")


def looks_like_nkey_seed(text: str) -> bool:
    """Whether `text` holds an NKEY seed (a secret, whatever field it was put in)."""
    return _NKEY_SEED.search(text) is not None


def redact_url(url: str) -> str:
    """`url` with its password (or whole user info) and secret-looking query values masked.

    `https://bob:pw@host/v1?api_key=k&x=1` -> `https://bob:***@host/v1?api_key=***&x=1`.
    A string that does not parse as a URL, or parses without a host (`user:pw@host`,
    its scheme left out), comes back with everything between its scheme and its last
    `@` masked, so the helper is safe on arbitrary text.
    """
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:  # e.g. "http://user:pw@[" (an unclosed IPv6 host)
        return _masked_to_last_at(url)
    netloc = parts.netloc
    if url.count("@") > netloc.count("@"):
        # No host parsed ("user:pw@host/v1" without its scheme, "http:/user:pw@host",
        # "//://user:pw@host"), or a password holding "/", "?" or "#" cut the user info
        # short ("svc:p@ss/word@host": the parser's host is "ss"): what precedes the
        # last "@" may be user info all the same (an "@" in a path or query is masked
        # with it: safe, if more than needed).
        return _masked_to_last_at(url)
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, has_password, _ = userinfo.partition(":")
        netloc = f"{user}:{REDACTED}@{hostport}" if has_password else f"{REDACTED}@{hostport}"
    query = parts.query
    if query:
        pairs = []
        for item in query.split("&"):
            name, eq, _ = item.partition("=")
            secret = eq and _SECRET_QUERY_KEY.search(urllib.parse.unquote(name))
            pairs.append(f"{name}={REDACTED}" if secret else item)
        query = "&".join(pairs)
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _masked_to_last_at(url: str) -> str:
    """`url` with everything between its scheme (if any) and its last `@` masked."""
    if "@" not in url:
        return url
    scheme = _SCHEME.match(url)
    return f"{scheme.group(0) if scheme else ''}{REDACTED}@{url.rpartition('@')[2]}"


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """`text` with known `secrets` (>= 4 characters) and credential-looking pairs masked.

    Masks every exact occurrence of each secret, `Authorization: ...`-style header lines
    and JSON pairs, `Bearer <token>`, NKEY seeds and `scheme://user:password@` URL user
    info.
    """
    for secret in secrets:
        if secret and len(secret) >= 4 and secret in text:
            text = text.replace(secret, REDACTED)
    text = _SECRET_PAIR.sub(rf"\g<1>\g<2>{REDACTED}", text)
    text = _BEARER.sub(rf"\g<1>\g<2>{REDACTED}", text)
    text = _NKEY_SEED.sub(REDACTED, text)
    return _URL_USERINFO.sub(rf"\g<1>{REDACTED}@", text)


def strip_surrogates(text: str) -> str:
    """`text` with lone surrogate code points (not encodable as UTF-8) replaced by U+FFFD."""
    if text.isascii() or _SURROGATES.search(text) is None:
        return text
    return _SURROGATES.sub("\ufffd", text)


def has_surrogates(text: str) -> bool:
    """Whether `text` holds a lone surrogate code point (so it cannot be stored as UTF-8)."""
    return not text.isascii() and _SURROGATES.search(text) is not None


_PREVIEW_CHARS = 120
_PREVIEW = reprlib.Repr()
_PREVIEW.maxlevel = 2
_PREVIEW.maxstring = 60
_PREVIEW.maxother = 60
_PREVIEW.maxlong = 40
for _name in ("maxtuple", "maxlist", "maxarray", "maxdict", "maxset", "maxfrozenset",
              "maxdeque"):
    setattr(_PREVIEW, _name, 4)


def preview(value: object) -> str:
    """A short, bounded repr of a configuration value for an error message; never raises.

    Deeply nested or huge containers are abbreviated (`[[[...]]]`), so building the
    message costs little and cannot hit the recursion limit.
    """
    try:
        shown = _PREVIEW.repr(value)
    except Exception:  # a broken __repr__ must not replace the real error
        return f"<{type(value).__name__} object>"
    return shown if len(shown) <= _PREVIEW_CHARS else shown[:_PREVIEW_CHARS - 3] + "..."


def one_line(text: str, limit: int = 200) -> str:
    """`text` cut to `limit` characters, then every character that is not printable (a
    terminal escape, a line or paragraph separator, a lone surrogate) written as its
    escape (`\\x1b`, `\\u2028`): what a log line may carry of a message that could hold
    someone else's bytes."""
    text = text[:limit]
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


#: A think tag: opening or closing, `think` or `thinking`, attributes allowed (bounded:
#: a tag left open for ever is not a tag).
_THINK_TAG = re.compile(r"<(/?)think(?:ing)?\b[^<>]{0,200}>", re.IGNORECASE)


#: A think tag cut off before its ">" at the very end of a reply.
_CUT_TAG = re.compile(r"<(/?)think(?:ing)?(?:\s[^<>]*)?\Z", re.IGNORECASE)


def strip_reasoning(text: str) -> str:
    """`text` without reasoning, in one linear scan over its think tags (`<think>` or
    `<thinking>`, any case, attributes allowed):

    - a block and everything in it, nested blocks too, is removed;
    - an opening tag never closed is removed with everything after it (a reasoning model
      cut off by its token limit: only the text before it is visible);
    - a closing tag with no opening one removes everything before it (a chat template
      that opened the block in the prompt, as DeepSeek-R1 and Qwen3 templates do);
    - a tag cut off before its ">" at the very end is taken as a tag.
    """
    pieces: list[str] = []
    position = depth = 0
    for tag in _THINK_TAG.finditer(text):
        closing = tag.group(1) == "/"
        if depth == 0:
            if closing:  # the reply so far was reasoning
                pieces.clear()
            else:
                pieces.append(text[position:tag.start()])
                depth = 1
        elif closing:
            depth -= 1
        else:
            depth += 1
        position = tag.end()
    if depth:
        return "".join(pieces)  # unclosed: the rest is reasoning
    rest = text[position:]
    cut = _CUT_TAG.search(rest) if "<" in rest else None
    if cut is not None:
        # A tag cut off before its ">" (the token limit again): an opening one starts
        # reasoning, a closing one ends reasoning with nothing visible after it.
        if cut.group(1):
            return ""
        rest = rest[:cut.start()]
    elif position == 0:
        return text
    pieces.append(rest)
    return "".join(pieces)
