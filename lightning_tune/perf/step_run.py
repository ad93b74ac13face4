"""What a step ran, as a callback that cuts each optimizer step into micro-batches publishes it for the monitor.

Only that callback (:class:`~lightning_tune.DynamicBatchSize`) knows how many micro-batches ran, their shapes and their
padding; the monitor reads this record, never the callback's attributes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class StepRun:
    """The micro-batches one training step ran.

    Args:
        micro_batches: Micro-batches the step ran (its last attempt, after any out-of-memory retry).
        shapes: ``(samples, padded length)`` of each micro-batch when they were trimmed, else ``None``.
        tokens: Real and padded tokens of those micro-batches, else ``None``.
    """

    micro_batches: int
    shapes: tuple[tuple[int, int], ...] | None = None
    tokens: tuple[int, int] | None = None


@runtime_checkable
class StepRunSource(Protocol):
    """A callback that runs each training batch as micro-batches of its own making."""

    def last_step_run(self) -> StepRun | None:
        """The training step that just ran, or ``None`` when this callback did not cut it."""
