"""The argument parser every `turnrouter` subcommand uses."""

from __future__ import annotations

import argparse
from typing import NoReturn

__all__ = ["OneLineParser"]


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line on stderr, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")
