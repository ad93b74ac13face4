"""``PlateauDetector``: ``ReduceLROnPlateau``'s decisions without an optimizer, so they compose with any schedule."""

from __future__ import annotations

import math
from typing import Any, Final, Literal

from lightning_tune._validation import check_choice, check_float, check_int

PlateauMode = Literal["min", "max"]
ThresholdMode = Literal["rel", "abs"]
PLATEAU_MODES: Final[tuple[str, ...]] = ("min", "max")
THRESHOLD_MODES: Final[tuple[str, ...]] = ("rel", "abs")
_COUNTERS = ("num_bad_evals", "cooldown_counter", "num_evals")  # the integer counters a checkpoint holds


class PlateauDetector:
    """Counts evaluations without improvement and says when to reduce.

    Args:
        mode: ``"min"`` when lower is better, ``"max"`` when higher is better.
        patience: Number of evaluations without improvement tolerated before a reduction.
        threshold: Smallest change that counts as an improvement.
        threshold_mode: ``"rel"`` (relative to the best value) or ``"abs"``.
        cooldown: Evaluations to wait after a reduction before counting again.

    Raises:
        ValueError: If an argument is out of range or an unknown mode is given.

    Example:
        >>> detector = PlateauDetector(mode="min", patience=1)
        >>> [detector.update(v) for v in (1.0, 1.0, 1.0, 0.5)]
        [False, False, True, False]
    """

    def __init__(
        self,
        *,
        mode: PlateauMode = "min",
        patience: int = 5,
        threshold: float = 1e-4,
        threshold_mode: ThresholdMode = "rel",
        cooldown: int = 0,
    ) -> None:
        check_choice("mode", mode, PLATEAU_MODES)
        check_int("patience", patience, minimum=0)
        check_float("threshold", threshold, low=0.0)
        check_choice("threshold_mode", threshold_mode, THRESHOLD_MODES)
        check_int("cooldown", cooldown, minimum=0)
        self.mode, self.patience, self.cooldown = mode, patience, cooldown
        self.threshold, self.threshold_mode = threshold, threshold_mode
        self.best = math.inf if mode == "min" else -math.inf
        self.num_bad_evals = self.cooldown_counter = self.num_evals = 0

    def is_better(self, value: float, best: float) -> bool:
        """Return whether ``value`` improves on ``best`` by more than the threshold.

        Args:
            value: New metric value.
            best: Best value so far.
        """
        if self.mode == "min":
            return value < (best * (1.0 - self.threshold) if self.threshold_mode == "rel" else best - self.threshold)
        return value > (best * (1.0 + self.threshold) if self.threshold_mode == "rel" else best + self.threshold)

    def update(self, value: float) -> bool:
        """Record one evaluation of the metric; return whether the learning rate should be reduced now.

        Args:
            value: The metric's value (NaN counts as no improvement).
        """
        self.num_evals += 1
        if self.is_better(value, self.best):
            self.best = value
            self.num_bad_evals = 0
        else:
            self.num_bad_evals += 1
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.num_bad_evals = 0
        if self.num_bad_evals > self.patience:
            self.cooldown_counter = self.cooldown
            self.num_bad_evals = 0
            return True
        return False

    def state_dict(self) -> dict[str, Any]:
        """Return the counters, as plain numbers, for :meth:`load_state_dict`."""
        return {"best": self.best} | {key: getattr(self, key) for key in _COUNTERS}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters saved by :meth:`state_dict`.

        Args:
            state: The saved dictionary.
        """
        self.best = float(state["best"])
        for key in _COUNTERS:
            setattr(self, key, int(state[key]))
