"""Percentiles of a window of durations (a ``deque`` with a ``maxlen``), and the check of the percentiles asked for."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from lightning_tune._validation import check_float

#: The largest window: a million durations (8 MB), sorted at each log.
MAX_WINDOW = 1_000_000


def check_percentiles(name: str, percentiles: Sequence[float]) -> tuple[float, ...]:
    """The user's percentiles as floats, refused unless distinct numbers strictly inside (0, 100)."""
    if isinstance(percentiles, (str, bytes)) or not isinstance(percentiles, Sequence):
        raise TypeError(f"`{name}` must be a sequence of numbers such as (50, 95, 99), got {percentiles!r}")
    if not percentiles:
        raise ValueError(f"`{name}` must hold at least one percentile, got {percentiles!r}")
    for index, value in enumerate(percentiles):
        check_float(f"{name}[{index}]", value, low=0.0, high=100.0, low_inclusive=False, high_inclusive=False)
    if len(set(percentiles)) != len(percentiles):
        raise ValueError(f"`{name}` must not repeat a percentile, got {percentiles!r}")
    return tuple(float(p) for p in percentiles)


def percentile_suffix(percentile: float) -> str:
    """Key suffix of a percentile.

    Example:
        >>> [percentile_suffix(p) for p in (50, 99.0, 99.9)]
        ['p50', 'p99', 'p99.9']
    """
    return f"p{percentile:g}"


def window_percentiles(window: Collection[float], percentiles: Sequence[float]) -> dict[float, float]:
    """``{percentile: value}`` by numpy's default linear interpolation, asked for at logging time; ``{}`` if empty.

    Example:
        >>> from collections import deque
        >>> window = deque([10.0, 20.0, 30.0, 40.0, 50.0], maxlen=4)
        >>> window_percentiles(window, (50.0,)), max(window)
        ({50.0: 35.0}, 50.0)
    """
    if not window:
        return {}
    values = np.percentile(np.fromiter(window, dtype=np.float64), list(percentiles))
    return {p: float(v) for p, v in zip(percentiles, values, strict=True)}
