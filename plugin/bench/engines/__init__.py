"""Engine back ends for the trace benchmark: replays of request traces through real engine code."""

from __future__ import annotations

import argparse
import math

GIB = 1 << 30


def parse_budgets(text: str) -> list[int]:
    """``--cache-gb`` of the engine replays: comma-separated GiB (2^30 bytes) -> bytes."""
    budgets: list[int] = []
    for item in text.split(","):
        try:
            gib = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--cache-gb takes numbers separated by commas, got {item!r}") from None
        if not math.isfinite(gib) or gib <= 0:
            raise argparse.ArgumentTypeError(f"--cache-gb values must be positive, got {item!r}")
        budgets.append(int(gib * GIB))
    return budgets
