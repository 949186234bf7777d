"""A password or token of any characters never shows, in part, where a NATS URL is shown
(redteam18 F3: a ',' in a password split the URL into a server list before it was
masked, and the error showed the part before the comma)."""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnrouter import ConfigurationError
from turnrouter.cli import main
from turnrouter.runtime.nats import NatsConfig

# Letters absent from every fixed text around the URL ("nats", "worker", "host", the
# messages), so any piece of the secret that shows came from the secret, and the
# characters a URL gives a meaning to.
SECRET = st.text(st.sampled_from("QZXJKV,/?#@:%[]!$&;="), min_size=4, max_size=24)


def pieces(secret: str) -> set[str]:
    """Every 4-character piece of `secret` holding one of its letters (a piece of
    punctuation alone, such as "://" plus one, also appears in the URL's own syntax)."""
    return {secret[i:i + 4] for i in range(len(secret) - 3)
            if any(c.isalpha() for c in secret[i:i + 4])}


def urls(secret: str) -> list[str]:
    """URLs carrying `secret` as a password or a token (without ':', which makes it a
    user and a password), alone and in lists."""
    token = secret.replace(":", "")
    return [f"nats://worker:{secret}@127.0.0.1:4222", f"tls://{token}@127.0.0.1:4222",
            f"worker:{secret}@127.0.0.1:4222",
            f"nats://worker:{secret}@127.0.0.1:4222,nats://127.0.0.1:4223",
            f"nats://127.0.0.1:4223,nats://worker:{secret}@127.0.0.1:4222",
            f"nats://worker:4222,{secret}@127.0.0.1:4222"]


def shown(url: str) -> str:
    """What a NatsConfig of `url` shows: its error, or its repr and masked URL."""
    try:
        config = NatsConfig(url=url)
    except ConfigurationError as exc:
        return str(exc)
    return repr(config) + config.safe_url


@contextlib.contextmanager
def env(name: str, value: str) -> Iterator[None]:
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def worker_error(*args: str) -> str:
    """The stderr of `turnrouter worker ARGS` ending in a usage error."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
        main(["worker", "--app", "tests.nats.app:make_router", *args])
    return err.getvalue()


@settings(max_examples=300, deadline=None)
@given(SECRET)
def test_no_piece_of_a_url_secret_is_shown(secret: str) -> None:
    """For a password or token of any characters (',', '/', '?', '#', '@', ':' ...), no
    error, repr or masked URL shows any 4-character piece of it."""
    for url in urls(secret):
        text = shown(url)
        assert not [piece for piece in pieces(secret) if piece in text], (url, text)


@settings(max_examples=25, deadline=None)
@given(SECRET)
def test_the_worker_cli_shows_no_piece_of_a_url_secret(secret: str) -> None:
    """The same through `--nats` and TURNROUTER_NATS_URL."""
    for url in urls(secret)[:3]:
        err = worker_error("--nats", url, "--partitions", "2000")
        with env("TURNROUTER_NATS_URL", url):
            err += worker_error("--partitions", "2000")
        assert "error" in err
        assert not [piece for piece in pieces(secret) if piece in err], (url, err)


@pytest.mark.parametrize("url", [
    "nats://worker:SECRET,pw@127.0.0.1:4222", "nats://worker:pa,ss,SECRETword@127.0.0.1:4222",
    "nats://worker:4222,SECRET@127.0.0.1:4222", "worker:SEC,RET@127.0.0.1:4222",
    "nats://worker:SE/CR,ET@127.0.0.1:4222", "nats://worker:SE,CR/ET@127.0.0.1:4222",
])
def test_a_comma_in_a_password_is_refused_unshown(url: str) -> None:
    """The red team's URLs: refused, the message saying how to write the comma and
    showing no part of the URL."""
    for text in (shown(url), worker_error("--nats", url)):
        assert "%2C" in text
        assert not [piece for piece in ("SEC", "RET", "pa,", ",ss", "pw@") if piece in text]


def test_a_percent_encoded_comma_is_a_password() -> None:
    """`%2C` is how a URL writes a ',' in a password: one server, password masked."""
    config = NatsConfig(url="nats://worker:SECRET%2Cpw@127.0.0.1:4222")
    assert config.servers == ["nats://worker:SECRET%2Cpw@127.0.0.1:4222"]
    assert "SECRET" not in repr(config) and config.safe_url == "nats://worker:***@127.0.0.1:4222"
