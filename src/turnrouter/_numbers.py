"""Numbers from users: real (not bool) and finite, huge ints included.

`math.isfinite(10**400)` raises `OverflowError` instead of answering: a validator that
calls it on an int a user passed would fail with the wrong error. `finite` answers.
"""

from __future__ import annotations

import math
from typing import TypeGuard

__all__ = ["finite", "is_number"]


def is_number(value: object) -> TypeGuard[float]:
    """Whether `value` is an int or float (a bool is not a number here)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def finite(value: object) -> TypeGuard[float]:
    """Whether `value` is a number that is finite as a float (an int too large for a
    float is not)."""
    if not is_number(value):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False
