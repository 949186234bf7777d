"""The argument parser every `turnrouter` subcommand uses."""

from __future__ import annotations

import argparse
import re
from typing import NoReturn

__all__ = ["OneLineParser", "option_name"]

_UNRECOGNIZED = "unrecognized arguments: "
#: An option's name as a user would type one: what a usage error may show of a word.
_NAME = re.compile(r"--?[A-Za-z][A-Za-z0-9-]*")
#: argparse's "ambiguous option: --x=VALUE could match ..." (3.11): an option quoted with
#: a value attached, anywhere in a message.
_OPTION_VALUE = re.compile(r"(?<!\S)(--?[\w-]*)(?:=\S*|:\S+)")


def option_name(word: str) -> str:
    """What a usage error shows of `word`, a command-line word starting with `-` that
    is no known option: its name when it reads as one (`--nats-token` of
    `--nats-token=S3CRET`), else `-...`. A value attached (`=`, `:`, a short option's
    `-pS3CRET`) or a value that itself starts with `-` is never shown: it may be a
    secret."""
    name, sep, _ = word.partition("=")
    if _NAME.fullmatch(name) and (name.startswith("--") or len(name) == 2):
        return name + ("=..." if sep else "")
    return "-..."


def _without_values(message: str) -> str:
    """A usage error's text without the values of arguments the parser did not take.

    A guessed flag such as `--nats-token S3CRET` or `--nats-pass=S3CRET` is not one of
    ours, so argparse would print it back whole, secret included; option names stay so
    the user still sees which flag was wrong."""
    if message.startswith(_UNRECOGNIZED):
        shown: list[str] = []
        hidden = 0
        for word in message[len(_UNRECOGNIZED):].split():
            if word.startswith("-") and len(word) > 1:
                name = option_name(word)
                shown.append(name)
                hidden += name.endswith("...")
            else:
                hidden += 1
        note = (f" ({hidden} value{'s' if hidden != 1 else ''} not shown: arguments may "
                "hold secrets)" if hidden else "")
        return _UNRECOGNIZED + (" ".join(shown) or "...") + note
    return _OPTION_VALUE.sub(r"\1=...", message)


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line on stderr, exit status 2, and
    never echo the value of an argument it did not recognize (it may be a secret)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {_without_values(message)}\n")
