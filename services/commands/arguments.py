"""argparse types the commands share."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def positive(convert: Callable[[str], float]) -> Callable[[str], float]:
    """An argparse type: `convert`, then refuse anything but a finite number above 0."""

    def parse(text: str) -> float:
        try:
            value = convert(text)
        except ValueError:
            kind = "an integer" if convert is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        if not 0 < value < math.inf:
            raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
        return value

    return parse
