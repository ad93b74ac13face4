"""A bounded window of durations and its percentiles."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

import numpy as np

from lightning_tune._validation import check_float, check_int, check_str

#: The largest window: a million durations (8 MB), sorted at each log.
MAX_WINDOW = 1_000_000


def check_percentiles(name: str, percentiles: Sequence[float]) -> tuple[float, ...]:
    """Validate percentiles: a non-empty sequence of distinct numbers strictly inside (0, 100).

    Args:
        name: Argument name for the message.
        percentiles: The value given.

    Returns:
        The percentiles as a tuple of floats, in the order given.

    Raises:
        TypeError: If ``percentiles`` is not a sequence of numbers.
        ValueError: If it is empty, has duplicates or a value outside (0, 100).
    """
    check_str("name", name)
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
    """Key suffix of a percentile: ``p50``, ``p99``, ``p99.9``.

    Args:
        percentile: A percentile in (0, 100).

    Returns:
        The suffix.

    Example:
        >>> [percentile_suffix(p) for p in (50, 99.0, 99.9)]
        ['p50', 'p99', 'p99.9']
    """
    check_float("percentile", percentile, low=0.0, high=100.0, low_inclusive=False, high_inclusive=False)
    return f"p{percentile:g}"


class LatencyWindow:
    """The last ``size`` durations (in milliseconds); percentiles are computed only when asked for.

    Adding is O(1); :meth:`percentiles` sorts at most ``size`` values, so it belongs at logging time, not per step.

    Args:
        size: Number of durations kept, at least 2.

    Raises:
        TypeError: If ``size`` is not an integer.
        ValueError: If ``size`` is below 2 or above :data:`MAX_WINDOW`.

    Example:
        >>> window = LatencyWindow(4)
        >>> window.extend([10.0, 20.0, 30.0, 40.0, 50.0])
        >>> window.percentiles((50.0,)), window.max()
        ({50.0: 35.0}, 50.0)
    """

    def __init__(self, size: int) -> None:
        check_int("size", size, minimum=2, maximum=MAX_WINDOW)
        self.size = size
        self._values: deque[float] = deque(maxlen=size)

    def __len__(self) -> int:
        return len(self._values)

    def add(self, value: float) -> None:
        """Add one duration (ms), dropping the oldest when full."""
        self._values.append(value)

    def extend(self, values: Iterable[float]) -> None:
        """Add several durations (ms) in order."""
        self._values.extend(values)

    def clear(self) -> None:
        """Forget every duration."""
        self._values.clear()

    def percentiles(self, percentiles: Sequence[float]) -> dict[float, float]:
        """Percentiles of the durations in the window (numpy's default linear interpolation).

        Args:
            percentiles: Percentiles in (0, 100).

        Returns:
            ``{percentile: value}``; empty when the window is empty.
        """
        if not self._values:
            return {}
        values = np.percentile(np.fromiter(self._values, dtype=np.float64), list(percentiles))
        return {p: float(v) for p, v in zip(percentiles, values, strict=True)}

    def max(self) -> float | None:
        """Largest duration in the window, or ``None`` when empty."""
        return max(self._values) if self._values else None
