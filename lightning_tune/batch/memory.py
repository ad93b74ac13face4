"""A linear memory model, peak ≈ fixed + per-sample × batch size, fitted to the latest peak of recent sizes.

With one size seen it anchors a prior slope there, or else the line from :attr:`MemoryModel.base_bytes` (a lower bound
of the fixed part) through it, whose slope is an over-estimate: a size it predicts within budget fits.
"""

from __future__ import annotations

from typing import Any

from lightning_tune._validation import check_float, check_int


class MemoryModel:
    """Peak memory as a line in the batch size, fitted to recent observations.

    Args:
        prior_fixed_bytes: Fixed part of a prior estimate (used only while fewer than two sizes have been seen).
        prior_bytes_per_sample: Per-sample part of a prior estimate.
        window: How many of the most recently observed batch sizes the fit uses.
        tolerance: Relative prediction error beyond which older observations are dropped (see :meth:`observe`).

    Raises:
        TypeError: If an argument is not an integer.
        ValueError: If an argument is out of range, or only one half of the prior is given.

    Example:
        >>> model = MemoryModel()
        >>> model.observe(8, 1800)
        >>> model.observe(16, 2600)
        >>> model.fixed_bytes, model.bytes_per_sample
        (1000.0, 100.0)
        >>> model.predict(32)
        4200.0
        >>> model.largest_batch(5000)
        40.0
        >>> one = MemoryModel()
        >>> one.base_bytes = 600  # weights alone: the fixed part is at least this
        >>> one.observe(8, 1800)
        >>> one.fixed_bytes, one.bytes_per_sample  # a steeper slope than the truth, 100: safe to extrapolate
        (600.0, 150.0)
    """

    def __init__(
        self,
        *,
        prior_fixed_bytes: int | None = None,
        prior_bytes_per_sample: int | None = None,
        window: int = 6,
        tolerance: float = 0.1,
    ) -> None:
        check_int("prior_fixed_bytes", prior_fixed_bytes, minimum=0, allow_none=True)
        check_int("prior_bytes_per_sample", prior_bytes_per_sample, minimum=1, allow_none=True)
        check_int("window", window, minimum=2)
        check_float("tolerance", tolerance, low=0.0, low_inclusive=False)
        if (prior_fixed_bytes is None) != (prior_bytes_per_sample is None):
            raise ValueError(
                "`prior_fixed_bytes` and `prior_bytes_per_sample` go together: give both or neither, got "
                f"{prior_fixed_bytes!r} and {prior_bytes_per_sample!r}"
            )
        self.prior = (
            None if prior_bytes_per_sample is None else (float(prior_fixed_bytes or 0), float(prior_bytes_per_sample))
        )
        self.window = window
        self.tolerance = tolerance
        self._misses = 0
        self._points: dict[int, float] = {}  # batch size -> latest peak, in insertion (recency) order
        self.base_bytes: float | None = None  # memory in use while no micro-batch runs, once known

    @property
    def determined(self) -> bool:
        """Whether the fit can separate fixed from per-sample memory: two sizes seen, a prior or a known base."""
        return len(self._points) >= 2 or self.prior is not None or self.base_bytes is not None

    @property
    def sizes_seen(self) -> int:
        """How many distinct batch sizes the fit is using."""
        return len(self._points)

    @property
    def largest_seen(self) -> int:
        """Largest batch size among the observations the fit uses (0 with none)."""
        return max(self._points, default=0)

    def observe(self, batch_size: int, peak_bytes: float) -> None:
        """Record an interval's peak; two peaks running more than ``tolerance`` off the fit drop older observations."""
        if len(self._points) >= 2:
            predicted = self.predict(batch_size)
            missed = predicted is not None and abs(predicted - peak_bytes) > self.tolerance * max(peak_bytes, 1.0)
            self._misses = self._misses + 1 if missed else 0
            if self._misses >= 2:  # twice running: memory use changed, not noise
                self._points.clear()
                self._misses = 0
        self._points.pop(batch_size, None)
        self._points[batch_size] = float(peak_bytes)
        while len(self._points) > self.window:
            del self._points[next(iter(self._points))]

    def _fit(self) -> tuple[float, float] | None:
        points = list(self._points.items())
        if not points:
            return self.prior
        base = float(min(self.base_bytes or 0.0, min(p for _, p in points)))  # a lower bound of the fixed part
        if len(points) == 1:
            ((b, peak),) = points
            if self.prior is not None:
                fixed = peak - self.prior[1] * b
                if fixed >= base:
                    return fixed, self.prior[1]
            return self._anchored(b, peak)
        n = len(points)
        mean_b = sum(b for b, _ in points) / n
        mean_p = sum(p for _, p in points) / n
        var = sum((b - mean_b) ** 2 for b, _ in points)
        slope = sum((b - mean_b) * (p - mean_p) for b, p in points) / var
        fixed = mean_p - slope * mean_b
        if slope <= 0 or fixed < base:  # noise swamped the slope: the over-estimate through the worst point instead
            return base, max(max(p - base, 1.0) / b for b, p in points)
        return fixed, slope

    def _anchored(self, batch_size: int, peak: float) -> tuple[float, float]:
        """The line from :attr:`base_bytes` (0 when unknown) through one observation: its slope is an over-estimate."""
        base = float(min(self.base_bytes or 0.0, peak))
        return base, max(peak - base, 1.0) / batch_size

    def largest_safe(self, budget_bytes: float) -> float | None:
        """Largest batch size within ``budget_bytes`` by the line from the base through the largest size seen.

        That line's slope is at least the true one, so the size fits however noise bent the least-squares line.
        """
        if not self._points:
            return None
        b = max(self._points)
        fixed, slope = self._anchored(b, self._points[b])
        return max(0.0, (budget_bytes - fixed) / slope)

    @property
    def fixed_bytes(self) -> float | None:
        """Estimated memory that does not depend on the batch size, or ``None`` with nothing to go on."""
        fit = self._fit()
        return None if fit is None else fit[0]

    @property
    def bytes_per_sample(self) -> float | None:
        """Estimated memory each sample adds, or ``None`` with nothing to go on."""
        fit = self._fit()
        return None if fit is None else fit[1]

    def predict(self, batch_size: int) -> float | None:
        """Predicted peak bytes at ``batch_size``, or ``None`` with nothing to go on."""
        fit = self._fit()
        return None if fit is None else fit[0] + fit[1] * batch_size

    def largest_batch(self, budget_bytes: float) -> float | None:
        """Largest (real-valued) batch size whose predicted peak stays within ``budget_bytes``."""
        fit = self._fit()
        return None if fit is None else max(0.0, (budget_bytes - fit[0]) / fit[1])

    def forget(self) -> None:
        """Drop every observation (the prior stays)."""
        self._points.clear()
        self._misses = 0

    def state_dict(self) -> dict[str, Any]:
        """Observations, for a checkpoint."""
        return {"points": [[b, p] for b, p in self._points.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore observations saved by :meth:`state_dict`."""
        self._points = {int(b): float(p) for b, p in state["points"]}
