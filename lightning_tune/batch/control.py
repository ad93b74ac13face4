"""The batch-size control law: which micro-batch size to run next, given the memory seen.

Each decision records the interval's peak in a :class:`MemoryModel` and picks the largest grid size predicted within
``target × total``, settling rather than oscillating (``docs/dynamic_batch.md``, "Control law"). The caller empties the
allocator's cache after every decision, so that each interval's peak is its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning_tune._validation import check_float, check_instance, check_int
from lightning_tune.batch.memory import MemoryModel


@dataclass(frozen=True)
class Decision:
    """One decision of the controller: the micro-batch size to run next."""

    batch_size: int
    predicted_fraction: float | None  # predicted peak at batch_size over the device total, when the model can predict
    reason: str  # "grow", "probe", "shrink", "pressure", "oom" or "hold"


class BatchSizeController:
    """Chooses micro-batch sizes that keep peak memory at a target fraction of the device.

    Args:
        target: Fraction of the device's total memory to fill, in (0, 1].
        min_batch_size: Smallest size it may choose.
        max_batch_size: Largest size it may choose (``None``: no limit but the memory).
        multiple_of: Sizes at or above this are multiples of it.
        min_change: Smallest relative growth worth a change.
        ceiling_decisions: How many decisions a size that ran out of memory stays off limits.
        model: The memory model (a fresh :class:`MemoryModel` by default).
        probe_growth: Relative growth of the first decision's probe (``None``: one grid step). A fine grid (padded
            tokens) needs a larger probe for the memory to change measurably.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range or ``min_batch_size > max_batch_size``.

    Example:
        >>> ctl = BatchSizeController(target=0.9, min_batch_size=1, max_batch_size=None, multiple_of=8)
        >>> ctl.decide(8, peak_bytes=180, total_bytes=1000)  # one size seen: probe a step up
        Decision(batch_size=16, predicted_fraction=None, reason='probe')
        >>> ctl.decide(16, peak_bytes=260, total_bytes=1000)  # 100 + 10 per sample; 260 / 16 per sample is safe
        Decision(batch_size=48, predicted_fraction=0.58, reason='grow')
        >>> ctl.decide(48, peak_bytes=580, total_bytes=1000)
        Decision(batch_size=80, predicted_fraction=0.9, reason='grow')
        >>> fresh = BatchSizeController(target=0.9, min_batch_size=1, max_batch_size=None, multiple_of=8)
        >>> fresh.decide(8, peak_bytes=180, total_bytes=1000, base_bytes=100)  # the fixed part is at least 100
        Decision(batch_size=80, predicted_fraction=0.9, reason='grow')
    """

    def __init__(
        self,
        *,
        target: float,
        min_batch_size: int,
        max_batch_size: int | None,
        multiple_of: int,
        min_change: float = 0.1,
        ceiling_decisions: int = 25,
        model: MemoryModel | None = None,
        probe_growth: float | None = None,
    ) -> None:
        check_float("target", target, low=0.0, high=1.0, low_inclusive=False)
        check_int("min_batch_size", min_batch_size, minimum=1)
        check_int("max_batch_size", max_batch_size, minimum=1, allow_none=True)
        check_int("multiple_of", multiple_of, minimum=1)
        check_float("min_change", min_change, low=0.0)
        check_int("ceiling_decisions", ceiling_decisions, minimum=1)
        check_float("probe_growth", probe_growth, low=0.0, low_inclusive=False, allow_none=True)
        check_instance("model", model, MemoryModel, "a MemoryModel", allow_none=True)
        if max_batch_size is not None and min_batch_size > max_batch_size:
            raise ValueError(f"`min_batch_size` ({min_batch_size}) must not exceed `max_batch_size` ({max_batch_size})")
        self.target, self.min_batch_size, self.max_batch_size = target, min_batch_size, max_batch_size
        self.multiple_of, self.min_change = multiple_of, min_change
        self.ceiling_decisions, self.probe_growth = ceiling_decisions, probe_growth
        self.model = model if model is not None else MemoryModel()
        self._ceiling: int | None = None  # smallest size that ran out of memory (or came under pressure) lately
        self._ceiling_age = 0

    #: The unit of its sizes, as a :class:`~lightning_tune.batch.step.SizePolicy`.
    unit = "samples"

    def next_size(self, size: int, *, effective: int, cap: int | None, ran: int, **memory: Any) -> Decision:
        """:meth:`decide` as a size policy: ``ran`` (0: ``size``) is the size observed."""
        return self.decide(size, cap=cap, observed_size=ran or size, **memory)

    def smaller(self, failed: int, *, effective: int, cap: int | None, **memory: Any) -> int:
        """:meth:`on_oom` as a size policy."""
        return self.on_oom(failed, cap=cap, **memory)

    def samples_at(self, size: int, length: int, n: int) -> int:
        """Samples in a micro-batch of ``size`` of any ``length``, as a size policy: ``size``."""
        return size

    # -- the grid ---------------------------------------------------------------------------------------------------
    def _upper(self, cap: int | None) -> float:
        limits = [x for x in (self.max_batch_size, cap) if x is not None]
        if self._ceiling is not None:
            limits.append(self._ceiling - 1)
        return float(min(limits)) if limits else math.inf

    def round_down(self, size: float, cap: int | None = None) -> int:
        """Largest grid size at or below ``size`` (at least ``min_batch_size``).

        Args:
            size: Any positive size.
            cap: An extra upper limit (the held effective batch), which is itself on the grid.
        """
        size = min(size, self._upper(cap))
        if cap is not None and size >= cap and (self.max_batch_size is None or cap <= self.max_batch_size):
            return max(self.min_batch_size, cap)
        if size >= self.multiple_of:
            best = int(size // self.multiple_of) * self.multiple_of
        else:
            best = self.multiple_of
            while best > size and best > 1:
                best //= 2
            best = best if best <= size else 0
        return max(self.min_batch_size, best)

    def step_up(self, size: int, cap: int | None = None) -> int:
        """Next grid size above ``size``, or ``size`` itself at the top."""
        upper = self._upper(cap)
        if size < self.multiple_of:
            nxt = size * 2 if size * 2 <= self.multiple_of else self.multiple_of
        else:
            nxt = (size // self.multiple_of + 1) * self.multiple_of
        if cap is not None and size < cap < nxt:
            nxt = cap
        return nxt if nxt <= upper else size

    # -- decisions -------------------------------------------------------------------------------------------------
    def decide(
        self,
        batch_size: int,
        *,
        peak_bytes: float,
        total_bytes: float,
        pressure: bool = False,
        cap: int | None = None,
        observed_size: int | None = None,
        budget_bytes: float | None = None,
        base_bytes: float | None = None,
    ) -> Decision:
        """Record an interval run at ``batch_size`` and choose the next size.

        Args:
            batch_size: Micro-batch size of the interval.
            peak_bytes: Its peak memory.
            observed_size: Largest micro-batch that actually ran, when smaller than ``batch_size`` (a short last
                batch of an epoch); the peak is recorded against it.
            total_bytes: The device's total memory.
            pressure: Whether the allocator retried allocations during the interval.
            cap: Upper limit from outside (the held effective batch).
            budget_bytes: Peak memory allowed (``None``: ``target × total_bytes``).
            base_bytes: Memory in use at the interval's start, with the cache emptied and no micro-batch running (a
                lower bound of the fixed part; ``None``: keep the model's).
        """
        lifted = self._age_ceiling()
        budget = self.target * total_bytes if budget_bytes is None else budget_bytes
        seen = batch_size if observed_size is None else observed_size
        if base_bytes is not None:
            self.model.base_bytes = float(base_bytes)
        self.model.observe(seen, peak_bytes)
        if pressure:
            self._set_ceiling(batch_size)
            smaller = self.round_down(batch_size - 1, cap)
            return Decision(smaller, self._fraction(smaller, total_bytes), "pressure")
        best_real = self.model.largest_batch(budget)
        assert best_real is not None  # an observation was just recorded
        best = self.round_down(best_real, cap)
        if peak_bytes > budget:
            self._set_ceiling(batch_size)  # not again for a while, so that noise cannot make it oscillate
            best = min(best, self.round_down(batch_size - 1, cap))
            return Decision(best, self._fraction(best, total_bytes), "shrink")
        if not self.model.determined:
            up = self.step_up(batch_size, cap)
            if self.probe_growth is not None:
                up = max(up, self.round_down(batch_size * (1.0 + self.probe_growth), cap))
            # with no fixed part the slope is over-estimated, so this bound on the probe's memory is safe
            if up != batch_size and peak_bytes / seen * up <= budget:
                return Decision(up, None, "probe")
            down = self.round_down(batch_size / 2, cap)  # a step up might not fit: measure a smaller size instead
            if up != batch_size and down < batch_size:  # (at the top of the grid there is nothing to find out)
                return Decision(down, None, "probe")
            return Decision(batch_size, self._fraction(batch_size, total_bytes), "hold")
        if self.model.sizes_seen >= 2:  # a slope fitted far beyond its points amplifies their noise: at most double,
            reach = max(2 * self.model.largest_seen, self.model.largest_safe(budget) or 0.0)  # or what is safe
            best = min(best, max(batch_size, self.round_down(reach, cap)))
        # a lifted ceiling may free less than min_change (a fine token grid held one step below it): grow anyway
        if best > batch_size and (best >= batch_size * (1.0 + self.min_change) or lifted):
            return Decision(best, self._fraction(best, total_bytes), "grow")
        if best < batch_size and seen < batch_size:  # only smaller micro-batches ran: the model speaks for this size
            return Decision(best, self._fraction(best, total_bytes), "shrink")
        # a smaller best means the model predicts over target though this interval was not: trust the measurement
        return Decision(batch_size, self._fraction(batch_size, total_bytes), "hold")

    def on_oom(
        self, batch_size: int, *, total_bytes: float, cap: int | None = None, budget_bytes: float | None = None
    ) -> int:
        """Choose a smaller size after ``batch_size`` ran out of memory.

        Args:
            batch_size: The size that failed.
            total_bytes: The device's total memory.
            cap: Upper limit from outside (the held effective batch).
            budget_bytes: Peak memory allowed (``None``: ``target × total_bytes``).

        Returns:
            The size to retry with: what the model predicts within target, and at most half of ``batch_size``
            while the model has fewer than two sizes to go on.

        Raises:
            torch.OutOfMemoryError: If ``batch_size`` is already ``min_batch_size``.
        """
        import torch

        if batch_size <= self.min_batch_size:
            raise torch.OutOfMemoryError(
                f"out of memory at the smallest allowed micro-batch (min_batch_size={self.min_batch_size}); "
                "lower `min_batch_size`, free memory (8-bit optimizer, activation checkpointing) or use more devices"
            )
        self._set_ceiling(batch_size)
        predicted = self.model.predict(batch_size)
        if predicted is not None and predicted <= total_bytes:  # the model said it fits: memory use has changed
            self.model.forget()
        budget = self.target * total_bytes if budget_bytes is None else budget_bytes
        fits = self.model.largest_batch(budget) if self.model.sizes_seen >= 2 else None
        limit = batch_size / 2 if fits is None else min(fits, batch_size - 1)
        return min(self.round_down(limit, cap), batch_size - 1) if limit >= 1 else self.min_batch_size

    def _fraction(self, batch_size: int, total_bytes: float) -> float | None:
        predicted = self.model.predict(batch_size)
        return None if predicted is None else round(predicted / total_bytes, 6)

    def _set_ceiling(self, batch_size: int) -> None:
        self._ceiling = batch_size if self._ceiling is None else min(self._ceiling, batch_size)
        self._ceiling_age = 0

    def _age_ceiling(self) -> bool:
        """Age the ceiling by one decision; whether it lifted now."""
        if self._ceiling is None:
            return False
        self._ceiling_age += 1
        if self._ceiling_age > self.ceiling_decisions:
            self._ceiling = None
            return True
        return False

    def state_dict(self) -> dict[str, Any]:
        """Memory model and ceiling, for a checkpoint."""
        return {"model": self.model.state_dict(), "ceiling": self._ceiling, "ceiling_age": self._ceiling_age}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.model.load_state_dict(state["model"])
        self._ceiling = state["ceiling"]
        self._ceiling_age = int(state["ceiling_age"])
