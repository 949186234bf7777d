"""Fuzz: the shared redaction helpers (`turnrouter._redact`) never raise and never leak.

Other modules show URLs and error bodies through these helpers, so their guarantees are
pinned here: any input is accepted, a password or key never survives, output is text.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnrouter._redact import preview, redact_text, redact_url, strip_surrogates

from .fuzz import ANY_TEXT, HUGE_TEXT, JUNK, valid_text

FUZZ = settings(max_examples=200, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example])
SECRET = st.text("abcdefghijklmnopqrstuvwxyz0123456789", min_size=8, max_size=16).map(
    lambda s: "Zq" + s)


@FUZZ
@given(st.sampled_from(["http", "https", "postgres"]), st.text("abc", min_size=1, max_size=5),
       SECRET, st.sampled_from(["example.com", "127.0.0.1:8080", "[::1]:9"]),
       st.sampled_from(["", "/v1", "/a/b"]), SECRET)
def test_redact_url_masks_password_and_key(scheme: str, user: str, password: str, host: str,
                                           path: str, key: str) -> None:
    """The password and secret-looking query values never survive; the host does."""
    url = f"{scheme}://{user}:{password}@{host}{path}?api_key={key}&model=m"
    shown = redact_url(url)
    assert password not in shown and key not in shown
    assert host in shown and "model=m" in shown


@FUZZ
@given(st.one_of(ANY_TEXT, HUGE_TEXT, st.from_regex(r"\A[a-z]{1,6}://[^/]*@?[^/]*/?.*\Z")))
def test_redact_url_accepts_any_text(text: str) -> None:
    """Any string (not a URL, invalid IPv6, huge) comes back as a string, no exception."""
    assert isinstance(redact_url(text), str)


@FUZZ
@given(st.one_of(ANY_TEXT, HUGE_TEXT), SECRET,
       st.sampled_from(['Authorization: Bearer {}', '"authorization": "Bearer {}"',
                        "x-api-key={}", "token is {}", "https://u:{}@h/"]))
def test_redact_text_masks_known_and_credential_looking_secrets(
        noise: str, secret: str, template: str) -> None:
    """A known secret anywhere, and header-style credentials, are masked in any text."""
    text = noise[:200] + template.format(secret) + noise[:200]
    assert secret not in redact_text(text, [secret])
    if "{}" in template and "token is" not in template:
        assert secret not in redact_text(text)


@FUZZ
@given(st.one_of(ANY_TEXT, HUGE_TEXT))
def test_strip_surrogates_gives_storable_text(text: str) -> None:
    """The result always encodes as UTF-8 and keeps valid text unchanged."""
    stripped = strip_surrogates(text)
    assert valid_text(stripped) and len(stripped) == len(text)
    if valid_text(text):
        assert stripped == text


@FUZZ
@given(JUNK)
def test_preview_is_short_for_anything(value: object) -> None:
    """preview() never raises and stays short for huge, nested or broken values."""
    assert len(preview(value)) <= 200


def test_preview_of_a_broken_repr() -> None:
    """An object whose __repr__ raises (or a too-long int) is shown by its type."""

    class Broken:
        def __repr__(self) -> str:
            raise RuntimeError("no")

    assert preview(Broken()).startswith("<Broken ")
    assert preview(10**5000) == "<int object>"
