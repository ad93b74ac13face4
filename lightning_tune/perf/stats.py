"""Training throughput and step-time statistics from resolved step durations (no tensors, no clock)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_tune._validation import check_int
from lightning_tune.perf.window import MAX_WINDOW, check_percentiles, percentile_suffix, window_percentiles


@dataclass
class Totals:
    """Sums over a stretch of training (tokens 0 when the batches hold none; FLOPs 0 when unknown)."""

    steps: int = 0
    batches: int = 0  # micro-batches
    samples: int = 0
    tokens: int = 0
    step_ms: float = 0.0  # inside optimizer steps: first micro-batch start to last micro-batch end
    between_ms: float = 0.0  # from one step's end to the next step's start
    wait_ms: float = 0.0  # waiting for batches, between steps and between the micro-batches of a step
    flops: float = 0.0
    hardware_flops: float = 0.0  # recomputation (activation checkpointing) included

    @property
    def wall_ms(self) -> float:
        """Step time plus the time between steps."""
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
        self.window: deque[float] = deque(maxlen=window)  # the latest step times (ms)
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
        self.window.append(step_ms)
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
        """Record the milliseconds from one step's end to the next step's start (waiting for the next batch)."""
        record = Totals(between_ms=wait_ms, wait_ms=wait_ms)
        self.interval.add(record)
        self.total.add(record)

    @staticmethod
    def rates(totals: Totals) -> dict[str, float]:
        """``samples_per_sec``, ``batches_per_sec``, ``data_wait_frac``, token and FLOP rates if non-zero; {} at 0 s."""
        seconds = totals.wall_ms / 1000.0
        if seconds <= 0:
            return {}
        out = {
            "samples_per_sec": totals.samples / seconds,
            "batches_per_sec": totals.batches / seconds,
            "data_wait_frac": totals.wait_ms / totals.wall_ms,
        }
        for name in ("tokens", "flops", "hardware_flops"):
            if value := getattr(totals, name):
                out[f"{name}_per_sec"] = value / seconds
        return out

    def latency_metrics(self) -> dict[str, float]:
        """Step-time percentiles and maximum over the window, ``step_ms_p50`` ... ``step_ms_max``; empty at first."""
        percentiles = window_percentiles(self.window, self.percentiles)
        out = {f"step_ms_{percentile_suffix(p)}": v for p, v in percentiles.items()}
        if self.window:
            out["step_ms_max"] = max(self.window)
        return out

    def interval_metrics(self) -> dict[str, float]:
        """Rates since the previous call and the window's percentiles (keys without prefix); starts a new interval."""
        out = {**self.rates(self.interval), **self.latency_metrics()}
        self.interval = Totals()
        return out
