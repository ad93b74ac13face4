"""Latency budgets: the batch size a sweep recommends under a p95/p99 budget, the throughput knee, and how firm it is.

Decisions on a sweep's :class:`~lightning_tune.bench.BenchResult` rows only: nothing here runs a model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from lightning_tune._validation import check_float
from lightning_tune.bench.result import BenchResult

#: Share of the best samples/s that marks the throughput knee.
KNEE_FRACTION: Final = 0.9

#: What stops the batch size from growing: ``"budget"`` (throughput still rises past the largest batch within it),
#: ``"knee"`` (throughput levels off below what the budget allows) or ``"both"`` (the knee is that largest batch).
Binds = Literal["budget", "knee", "both"]


def timed_batches_needed(percentile: float) -> int:
    """Timed batches a percentile in (0, 100) needs so that one of them lies beyond it: ``ceil(100 / (100 - q))``.

    Example:
        >>> timed_batches_needed(95), timed_batches_needed(99)
        (20, 100)
    """
    return math.ceil(100.0 / (100.0 - percentile) - 1e-9)


def _latency(result: BenchResult, percentile: int) -> float | None:
    return getattr(result, f"p{percentile}_ms")


@dataclass(frozen=True)
class Recommendation:
    """What :meth:`LatencyBudget.recommend` decided, with the figures it rests on.

    Args:
        budgets_ms: Budget per percentile, e.g. ``{95: 50.0}``.
        rows: The measured results the decision used (status ``"ok"``), in batch-size order.
        batch_size: The largest batch size within every budget, or ``None`` when none is.
        knee_batch_size: The smallest batch size reaching ``knee_fraction`` of the best samples/s (``None`` when
            nothing was measured).
        best_batch_size: The batch size with the most samples/s.
        knee_fraction: Share of the best samples/s that marks the knee.
        binds: What stops the batch size from growing (:data:`Binds`); ``None`` when no batch size is within it.
        needed: Timed batches per batch size the budget's percentiles need to be firm.

    Example:
        >>> rows = [BenchResult(1, "ok", 5, p95_ms=4.0, samples_per_sec=250.0)]
        >>> choice = LatencyBudget(p95_budget_ms=5.0).recommend(rows)
        >>> choice.batch_size, choice.firm, choice.as_dict()["steps_for_firm"]
        (1, False, 20)
    """

    budgets_ms: dict[int, float]
    rows: tuple[BenchResult, ...]
    batch_size: int | None
    knee_batch_size: int | None
    best_batch_size: int | None
    knee_fraction: float
    binds: Binds | None
    needed: int

    def row(self, batch_size: int | None) -> BenchResult | None:
        """The result of ``batch_size`` among :attr:`rows`, or ``None``."""
        return next((r for r in self.rows if r.batch_size == batch_size), None)

    @property
    def timed_batches(self) -> dict[int, int]:
        """Timed batches each batch size's percentiles rest on."""
        return {r.batch_size: r.steps for r in self.rows}

    @property
    def firm(self) -> bool:
        """Whether every batch size's percentiles rest on at least :attr:`needed` timed batches."""
        return bool(self.rows) and min(self.timed_batches.values()) >= self.needed

    @property
    def faster_smaller(self) -> BenchResult | None:
        """The fastest smaller batch size within the budget, if it has more samples/s than the choice."""
        chosen = self.row(self.batch_size)
        if chosen is None:
            return None
        smaller = [r for r in self.rows if r.batch_size < chosen.batch_size and not self.over_budget(r)]
        best = max(smaller, key=lambda r: r.samples_per_sec or 0.0, default=None)
        return best if best is not None and (best.samples_per_sec or 0.0) > (chosen.samples_per_sec or 0.0) else None

    def over_budget(self, result: BenchResult) -> dict[int, float]:
        """Percentile -> latency of ``result``, for each percentile above its budget."""
        return {
            q: value
            for q, budget in self.budgets_ms.items()
            if (value := _latency(result, q)) is not None and value > budget
        }

    def as_dict(self) -> dict[str, Any]:
        """The decision as JSON-ready builtins: the ``recommendation`` entry of ``bench.json`` (``docs/bench.md``)."""
        chosen = self.row(self.batch_size)
        return {
            "budgets_ms": {f"p{q}": ms for q, ms in self.budgets_ms.items()},
            "batch_size": self.batch_size,
            "samples_per_sec": chosen.samples_per_sec if chosen else None,
            "latency_ms": {f"p{q}": _latency(chosen, q) for q in self.budgets_ms} if chosen else None,
            "knee": _point(self.row(self.knee_batch_size)),
            "best": _point(self.row(self.best_batch_size)),
            "knee_fraction": self.knee_fraction,
            "binds": self.binds,
            "firm": self.firm,
            "timed_batches": {str(size): n for size, n in self.timed_batches.items()},
            "steps_for_firm": self.needed,
            "faster_smaller": _point(self.faster_smaller),
        }


def _point(result: BenchResult | None) -> dict[str, Any] | None:
    return {"batch_size": result.batch_size, "samples_per_sec": result.samples_per_sec} if result else None


class LatencyBudget:
    """A p95 and/or p99 latency budget (a latency equal to it is within it), and the batch size a sweep recommends.

    Args:
        p95_budget_ms: Budget of the p95 latency in milliseconds, > 0, or ``None``.
        p99_budget_ms: Budget of the p99 latency in milliseconds, > 0, or ``None``. At least one budget is needed.
        knee_fraction: Share of the best samples/s that marks the knee, in (0, 1].

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If a budget is not a finite number > 0, both are ``None``, or ``knee_fraction`` is outside
            (0, 1].

    Example:
        >>> rows = [BenchResult(1, "ok", 20, p95_ms=4.0, p99_ms=4.2, samples_per_sec=250.0),
        ...         BenchResult(4, "ok", 20, p95_ms=9.0, p99_ms=9.5, samples_per_sec=480.0),
        ...         BenchResult(8, "ok", 20, p95_ms=17.0, p99_ms=18.0, samples_per_sec=500.0)]
        >>> choice = LatencyBudget(p95_budget_ms=10.0).recommend(rows)
        >>> choice.batch_size, choice.knee_batch_size, choice.binds, choice.firm
        (4, 4, 'both', True)
    """

    def __init__(
        self,
        *,
        p95_budget_ms: float | None = None,
        p99_budget_ms: float | None = None,
        knee_fraction: float = KNEE_FRACTION,
    ) -> None:
        budgets: dict[int, float] = {}
        for q, value in ((95, p95_budget_ms), (99, p99_budget_ms)):
            check_float(f"p{q}_budget_ms", value, low=0.0, low_inclusive=False, allow_none=True)
            if value is not None:
                budgets[q] = float(value)
        if not budgets:
            raise ValueError("`p95_budget_ms` and `p99_budget_ms` are both None: give at least one budget")
        check_float("knee_fraction", knee_fraction, low=0.0, high=1.0, low_inclusive=False)
        self.budgets_ms = budgets
        self.knee_fraction = float(knee_fraction)

    def __repr__(self) -> str:
        budgets = ", ".join(f"p{q}_budget_ms={ms!r}" for q, ms in self.budgets_ms.items())
        return f"{type(self).__name__}({budgets}, knee_fraction={self.knee_fraction!r})"

    def recommend(self, results: Sequence[BenchResult]) -> Recommendation:
        """Decide on a sweep's results, in any order; out-of-memory rows are left out.

        Raises:
            TypeError: If ``results`` holds something other than :class:`~lightning_tune.bench.BenchResult`.
        """
        for index, result in enumerate(results):
            if not isinstance(result, BenchResult):
                raise TypeError(f"`results[{index}]` must be a BenchResult, got {result!r}")
        measured = [r for r in results if r.status == "ok" and r.samples_per_sec is not None]
        measured = [r for r in measured if all(_latency(r, q) is not None for q in self.budgets_ms)]
        rows = tuple(sorted(measured, key=lambda r: r.batch_size))
        within = [r.batch_size for r in rows if all(_latency(r, q) <= ms for q, ms in self.budgets_ms.items())]  # type: ignore[operator]
        chosen = max(within, default=None)
        knee = best = None
        if rows:
            best_row = max(rows, key=lambda r: r.samples_per_sec or 0.0)
            best = best_row.batch_size
            floor = self.knee_fraction * (best_row.samples_per_sec or 0.0)
            knee = next(r.batch_size for r in rows if (r.samples_per_sec or 0.0) >= floor)
        binds: Binds | None = None
        if chosen is not None and knee is not None:
            binds = "budget" if chosen < knee else "knee" if chosen > knee else "both"
        return Recommendation(
            budgets_ms=dict(self.budgets_ms),
            rows=rows,
            batch_size=chosen,
            knee_batch_size=knee,
            best_batch_size=best,
            knee_fraction=self.knee_fraction,
            binds=binds,
            needed=max(timed_batches_needed(q) for q in self.budgets_ms),
        )


def _latencies(result: BenchResult, percentiles: Iterable[int], kind: str) -> str:
    return ", ".join(f"{kind} p{q} {_latency(result, q):,.2f} ms" for q in percentiles)


def format_recommendation(recommendation: Recommendation, *, mode: str = "train") -> list[str]:
    """The lines printed after the table: the choice, the knee, what binds and whether it is firm.

    When no batch size is within the budget, the first line says so and names the smallest batch size's latency.

    Args:
        recommendation: From :meth:`LatencyBudget.recommend`.
        mode: ``"train"`` (step latency) or ``"predict"`` (request latency).

    Example:
        >>> rows = [BenchResult(1, "ok", 20, p95_ms=4.0, samples_per_sec=250.0),
        ...         BenchResult(4, "ok", 20, p95_ms=9.0, samples_per_sec=480.0)]
        >>> lines = format_recommendation(LatencyBudget(p95_budget_ms=10.0).recommend(rows))
        >>> print(lines[1])
          recommended  batch size 4: 480.0 samples/s, step p95 9.00 ms
    """
    rec = recommendation
    kind, unit = ("step", "steps") if mode == "train" else ("request", "requests")
    qs = list(rec.budgets_ms)
    budget = ", ".join(f"{kind} p{q} <= {ms:g} ms" for q, ms in rec.budgets_ms.items())
    chosen, knee, best = rec.row(rec.batch_size), rec.row(rec.knee_batch_size), rec.row(rec.best_batch_size)
    if chosen is None:
        why = "no batch size was measured (every one ran out of memory)"
        if rec.rows:
            why = f"the smallest, batch size {rec.rows[0].batch_size}, has {_latencies(rec.rows[0], qs, kind)}"
        lines = [f"no batch size meets the latency budget ({budget}): {why}"]
    else:
        counts = sorted(set(rec.timed_batches.values()))
        rests = f"{counts[0]} timed {unit}" if len(counts) == 1 else f"{counts[0]} to {counts[-1]} timed {unit}"
        lines = [
            f"latency budget: {budget}; each percentile from {rests} per batch size",
            f"  recommended  batch size {chosen.batch_size}{'' if rec.firm else ' (uncertain)'}: "
            f"{chosen.samples_per_sec:,.1f} samples/s, {_latencies(chosen, qs, kind)}",
        ]
    if knee is not None and best is not None and chosen is not None:
        share = (knee.samples_per_sec or 0.0) / (best.samples_per_sec or 1.0)
        lines.append(
            f"  knee         batch size {knee.batch_size}: {knee.samples_per_sec:,.1f} samples/s, {100 * share:.0f} % "
            f"of the best ({best.samples_per_sec:,.1f} at batch size {best.batch_size}); knee = smallest batch size "
            f"reaching {100 * rec.knee_fraction:.0f} % of the best"
        )
        bigger = next((r for r in rec.rows if r.batch_size > chosen.batch_size), None)
        breaks = (  # the latencies over the budget of the next batch size
            f"batch size {bigger.batch_size} has {_latencies(bigger, rec.over_budget(bigger), kind)}"
            if bigger is not None
            else "no larger batch size was measured"
        )
        if rec.binds == "budget":
            why = f"the budget ({breaks}); throughput still rises up to the knee at batch size {knee.batch_size}"
        elif rec.binds == "knee":
            gain = (chosen.samples_per_sec or 0.0) / (knee.samples_per_sec or 1.0) - 1.0
            slower = ", ".join(
                f"p{q} {100 * (_latency(chosen, q) / _latency(knee, q) - 1.0):+.0f} %"  # type: ignore[operator]
                for q in qs
            )
            why = (
                f"the throughput knee: batch size {chosen.batch_size} gives {100 * gain:+.0f} % samples/s over "
                f"{knee.batch_size} for {slower} latency; take {knee.batch_size} for lower latency"
                if gain >= 0
                else f"the throughput knee: batch size {chosen.batch_size} gives {100 * gain:+.0f} % samples/s "
                f"against {knee.batch_size}, at {slower} latency; take {knee.batch_size}, both faster and sooner"
            )
        else:
            why = f"both: batch size {chosen.batch_size} is the knee, and the budget stops there ({breaks})"
        lines.append(f"  binds        {why}")
    faster = rec.faster_smaller
    if faster is not None and chosen is not None:
        lines.append(
            f"  note         batch size {faster.batch_size} is within the budget too and faster "
            f"({faster.samples_per_sec:,.1f} samples/s, {_latencies(faster, qs, kind)}): past it, larger batches "
            "cost latency and buy no throughput here"
        )
    if rec.rows and not rec.firm:
        weakest = min(rec.timed_batches.values())
        lines.append(
            f"  uncertain    the percentiles rest on {weakest} timed {unit} per batch size; a p{max(qs)} needs "
            f"{rec.needed} for one {kind} beyond it. Run with --steps {rec.needed} or more to make the choice firm"
        )
    return lines
