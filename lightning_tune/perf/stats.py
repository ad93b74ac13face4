"""Training throughput and step-time statistics, from resolved step durations (no tensors, no clock).

The monitor feeds one record per optimizer step (its duration, the samples, tokens and micro-batches in it) and the
gaps between batches (time spent waiting for the next batch); :class:`StepStats` turns them into rates over the
logging interval, percentiles over a bounded window, and whole-run totals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_tune._validation import check_int
from lightning_tune.perf.window import MAX_WINDOW, LatencyWindow, check_percentiles, percentile_suffix


@dataclass
class Totals:
    """Sums over a stretch of training.

    Args:
        steps: Optimizer steps.
        batches: Micro-batches.
        samples: Samples.
        tokens: Input tokens (0 when the batches hold none).
        step_ms: Time inside optimizer steps (first micro-batch start to last micro-batch end).
        between_ms: Time between steps (from one step's end to the next step's start).
        wait_ms: Time waiting for batches, between steps and between the micro-batches of a step.
        flops: Model FLOPs, when known.
        hardware_flops: FLOPs the hardware ran, recomputation (activation checkpointing) included, when known.
    """

    steps: int = 0
    batches: int = 0
    samples: int = 0
    tokens: int = 0
    step_ms: float = 0.0
    between_ms: float = 0.0
    wait_ms: float = 0.0
    flops: float = 0.0
    hardware_flops: float = 0.0

    @property
    def wall_ms(self) -> float:
        """Training wall time of the stretch: step time plus the time between steps."""
        return self.step_ms + self.between_ms

    def add(self, other: Totals) -> None:
        """Add the ``other`` stretch to this one."""
        self.steps += other.steps
        self.batches += other.batches
        self.samples += other.samples
        self.tokens += other.tokens
        self.step_ms += other.step_ms
        self.between_ms += other.between_ms
        self.wait_ms += other.wait_ms
        self.flops += other.flops
        self.hardware_flops += other.hardware_flops


class StepStats:
    """Accumulate step records; report interval rates, window percentiles and run totals.

    Args:
        window: Number of recent steps the percentiles are taken over.
        percentiles: Step-time percentiles to report, in (0, 100).

    Example:
        >>> stats = StepStats(window=10, percentiles=(50,))
        >>> stats.add_step(step_ms=100.0, samples=8, tokens=0, batches=1)
        >>> stats.add_between(wait_ms=25.0)
        >>> stats.add_step(step_ms=100.0, samples=8, tokens=0, batches=1)
        >>> m = stats.interval_metrics()
        >>> m["samples_per_sec"], m["step_ms_p50"], m["data_wait_frac"]
        (71.11111111111111, 100.0, 0.1111111111111111)
    """

    def __init__(self, *, window: int, percentiles: Sequence[float]) -> None:
        check_int("window", window, minimum=2, maximum=MAX_WINDOW)
        self.window = LatencyWindow(window)
        self.percentiles = check_percentiles("percentiles", percentiles)
        self.interval = Totals()
        self.total = Totals()

    def add_step(
        self,
        *,
        step_ms: float,
        samples: int,
        tokens: int,
        batches: int,
        wait_ms: float = 0.0,
        flops: float = 0.0,
        hardware_flops: float = 0.0,
    ) -> None:
        """Record one optimizer step.

        Args:
            step_ms: Duration of the step.
            samples: Samples in all its micro-batches.
            tokens: Input tokens in all its micro-batches.
            batches: Its micro-batches.
            wait_ms: Time between its micro-batches (waiting for data), already inside ``step_ms``.
            flops: Model FLOPs of the step, if known.
            hardware_flops: Hardware FLOPs of the step (recomputation included), if known.
        """
        self.window.add(step_ms)
        record = Totals(
            steps=1,
            batches=batches,
            samples=samples,
            tokens=tokens,
            step_ms=step_ms,
            wait_ms=wait_ms,
            flops=flops,
            hardware_flops=hardware_flops,
        )
        self.interval.add(record)
        self.total.add(record)

    def add_between(self, *, wait_ms: float) -> None:
        """Record the time between two steps (waiting for the next batch).

        Args:
            wait_ms: Milliseconds from one step's end to the next step's start.
        """
        record = Totals(between_ms=wait_ms, wait_ms=wait_ms)
        self.interval.add(record)
        self.total.add(record)

    @staticmethod
    def rates(totals: Totals) -> dict[str, float]:
        """Per-second rates and the data-wait share of a stretch.

        Args:
            totals: The stretch.

        Returns:
            ``samples_per_sec``, ``batches_per_sec``, ``data_wait_frac``, plus ``tokens_per_sec`` and
            ``flops_per_sec`` and ``hardware_flops_per_sec`` when non-zero; empty when no time has passed.
        """
        seconds = totals.wall_ms / 1000.0
        if seconds <= 0:
            return {}
        out = {
            "samples_per_sec": totals.samples / seconds,
            "batches_per_sec": totals.batches / seconds,
            "data_wait_frac": totals.wait_ms / totals.wall_ms,
        }
        if totals.tokens:
            out["tokens_per_sec"] = totals.tokens / seconds
        if totals.flops:
            out["flops_per_sec"] = totals.flops / seconds
        if totals.hardware_flops:
            out["hardware_flops_per_sec"] = totals.hardware_flops / seconds
        return out

    def latency_metrics(self) -> dict[str, float]:
        """Step-time percentiles and maximum over the window, keyed ``step_ms_p50`` ... ``step_ms_max``.

        Returns:
            The values in milliseconds; empty when no step was recorded.
        """
        out = {f"step_ms_{percentile_suffix(p)}": v for p, v in self.window.percentiles(self.percentiles).items()}
        largest = self.window.max()
        if largest is not None:
            out["step_ms_max"] = largest
        return out

    def interval_metrics(self) -> dict[str, float]:
        """Rates since the previous call and the window's percentiles; starts a new interval.

        Returns:
            Metric names (without prefix) to values.
        """
        out = {**self.rates(self.interval), **self.latency_metrics()}
        self.interval = Totals()
        return out
