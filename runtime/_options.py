"""Command-line option types shared by the runtime's commands."""

from __future__ import annotations

import argparse
import math


def seconds(text: str, most: float = math.inf) -> float:
    """An option's seconds: a finite number above 0, and at most ``most``.

    Raises:
        argparse.ArgumentTypeError: It is not (NaN included).
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= most or value == math.inf:
        limit = "" if most == math.inf else f" and at most {most:g}"
        raise argparse.ArgumentTypeError(f"{text}: give a finite number of seconds above 0{limit}")
    return value
