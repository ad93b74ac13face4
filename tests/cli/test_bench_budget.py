"""Latency budgets: the batch size a sweep recommends, the knee beside it, and the uncertain mark, on a fake clock."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import pytest

from lightning_tune.bench import BenchResult, BenchRunner, BenchSettings, LatencyBudget
from lightning_tune.bench.budget import format_recommendation, timed_batches_needed
from lightning_tune.bench.plot import _figure
from tests.cli.test_bench_modules import CLOCK

MODULES = "tests.cli.test_bench_modules"
SIZES = (1, 2, 4, 8)
BASE_MS, PER_SAMPLE_MS = 0.5, 1.0  # a batch of b samples takes 0.5 + b ms: 1.5, 2.5, 4.5, 8.5 ms


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr("lightning_tune.perf.timing.perf_counter", CLOCK)
    return CLOCK


def sweep(mode: str, durations_ms: list[float], *, steps: int, ms_per_sample: float = PER_SAMPLE_MS) -> list[Any]:
    settings = BenchSettings(
        batch_sizes=SIZES,
        mode=mode,  # type: ignore[arg-type]
        model=f"{MODULES}:ClockedModule",
        model_args={"durations_ms": durations_ms, "ms_per_sample": ms_per_sample},
        accelerator="cpu",
        steps=steps,
        warmup=0,
    )
    return BenchRunner(settings, progress=False).sweep()


# ------------------------------------------------------------------------------------------ exact timings

_EXACT: dict[str, list[Any]] = {}


def exact(mode: str) -> list[Any]:
    """The exact-timing sweep of ``mode``, run once (on the fake clock the calling test has patched in)."""
    if mode not in _EXACT:
        _EXACT[mode] = sweep(mode, [BASE_MS], steps=20)
    return _EXACT[mode]


@pytest.mark.parametrize("mode", ["train", "predict"])
@pytest.mark.parametrize(
    ("budget_ms", "chosen", "binds"),
    [
        pytest.param(9.0, 8, "knee", id="budget-allows-all"),
        pytest.param(5.0, 4, "both", id="knee-is-the-largest-within"),
        pytest.param(3.0, 2, "budget", id="budget-below-the-knee"),
        pytest.param(2.0, 1, "budget", id="only-the-smallest"),
    ],
)
def test_exact_timings_give_an_exact_choice_with_the_knee_beside_it(
    clock: Any, mode: str, budget_ms: float, chosen: int, binds: str
) -> None:
    results = exact(mode)
    latency = {b: BASE_MS + PER_SAMPLE_MS * b for b in SIZES}
    for result in results:  # the figures the decision rests on, against numpy over the scripted times
        assert result.p95_ms == pytest.approx(np.percentile([latency[result.batch_size]] * 20, 95))
        assert result.samples_per_sec == pytest.approx(result.batch_size / latency[result.batch_size] * 1000)

    rec = LatencyBudget(p95_budget_ms=budget_ms).recommend(results)
    # the largest batch size whose p95 is within the budget
    assert rec.batch_size == chosen == max(b for b in SIZES if latency[b] <= budget_ms)
    # samples/s 667, 800, 889, 941: batch size 4 is the first to reach 90 % of the best (847)
    assert rec.knee_batch_size == 4 and rec.best_batch_size == 8
    assert rec.binds == binds
    assert rec.firm and rec.needed == 20 and rec.timed_batches == dict.fromkeys(SIZES, 20)

    lines = format_recommendation(rec, mode=mode)
    kind = "step" if mode == "train" else "request"
    assert (
        lines[0]
        == f"latency budget: {kind} p95 <= {budget_ms:g} ms; each percentile from 20 timed {kind}s per batch size"
    )
    assert lines[1] == (
        f"  recommended  batch size {chosen}: {1000 * chosen / latency[chosen]:,.1f} samples/s, "
        f"{kind} p95 {latency[chosen]:.2f} ms"
    )
    assert lines[2].startswith("  knee         batch size 4: 888.9 samples/s, 94 % of the best (941.2 at batch size 8)")
    assert not any("uncertain" in line for line in lines)

    record = rec.as_dict()
    assert json.loads(json.dumps(record)) == record
    assert record["batch_size"] == chosen and record["knee"]["batch_size"] == 4 and record["binds"] == binds
    assert record["samples_per_sec"] == pytest.approx(1000 * chosen / latency[chosen])
    assert record["timed_batches"] == {"1": 20, "2": 20, "4": 20, "8": 20} and record["firm"] is True


def test_the_binding_constraint_is_explained(clock: Any) -> None:
    results = exact("predict")
    lines = {
        b: format_recommendation(LatencyBudget(p95_budget_ms=b).recommend(results), mode="predict")[3]
        for b in (9.0, 5.0, 3.0)
    }
    assert lines[9.0] == (
        "  binds        the throughput knee: batch size 8 gives +6 % samples/s over 4 for p95 +89 % latency; "
        "take 4 for lower latency"
    )
    assert lines[5.0] == (
        "  binds        both: batch size 4 is the knee, and the budget stops there (batch size 8 has request p95 "
        "8.50 ms)"
    )
    assert lines[3.0] == (
        "  binds        the budget (batch size 4 has request p95 4.50 ms); throughput still rises up to the knee at "
        "batch size 4"
    )


# ------------------------------------------------------------------------------------------ noise


def spiky(steps: int) -> list[float]:
    """0.5 ms (plus the per-sample time) with a 3 ms stall at calls 5 and 15: one step in ten, as a noisy neighbour."""
    return [BASE_MS + (3.0 if i in (5, 15) else 0.0) for i in range(steps)]


@pytest.mark.slow
def test_noisy_timings_with_too_few_steps_give_the_uncertain_mark(clock: Any) -> None:
    budget = LatencyBudget(p95_budget_ms=4.2)
    # 5 steps never see a stall: batch size 8 (p95 2.5 ms) looks within the budget
    few = budget.recommend(sweep("predict", spiky(5), steps=5, ms_per_sample=0.25))
    assert few.batch_size == 8 and not few.firm and few.needed == 20
    lines = format_recommendation(few, mode="predict")
    assert "  recommended  batch size 8 (uncertain):" in lines[1]
    assert lines[-1] == (
        "  uncertain    the percentiles rest on 5 timed requests per batch size; a p95 needs 20 for one request "
        "beyond it. Run with --steps 20 or more to make the choice firm"
    )
    assert few.as_dict()["firm"] is False and few.as_dict()["steps_for_firm"] == 20
    # 20 steps see both stalls; the p95 takes them in (batch size 4: 1.5 + 3 ms), and the firm choice is smaller
    firm = budget.recommend(sweep("predict", spiky(20), steps=20, ms_per_sample=0.25))
    assert firm.firm and firm.batch_size == 2
    assert firm.row(4).p95_ms == pytest.approx(np.percentile(np.array(spiky(20)) + 0.25 * 4, 95))
    assert not any("uncertain" in line for line in format_recommendation(firm))


# ------------------------------------------------------------------------------------------ the engine alone


def row(batch_size: int, p95: float, p99: float, rate: float, steps: int = 100) -> BenchResult:
    return BenchResult(batch_size, "ok", steps, p50_ms=p95 / 2, p95_ms=p95, p99_ms=p99, samples_per_sec=rate)


ROWS = [row(1, 4.0, 5.0, 250.0), row(4, 9.0, 14.0, 460.0), row(16, 30.0, 32.0, 500.0), BenchResult(64, "oom")]


def test_both_budgets_must_hold_and_p99_needs_a_hundred_timed_batches() -> None:
    assert LatencyBudget(p95_budget_ms=10.0).recommend(ROWS).batch_size == 4
    both = LatencyBudget(p95_budget_ms=10.0, p99_budget_ms=12.0).recommend(ROWS)
    assert both.batch_size == 1  # batch size 4 meets the p95 budget but not the p99 one
    assert both.binds == "budget" and both.knee_batch_size == 4  # 460 >= 0.9 * 500
    assert LatencyBudget(p99_budget_ms=40.0).recommend(ROWS).binds == "knee"
    assert [timed_batches_needed(q) for q in (50, 90, 95, 99, 99.9)] == [2, 10, 20, 100, 1000]
    thin = [row(1, 4.0, 5.0, 250.0, steps=50), row(4, 9.0, 9.5, 440.0, steps=50)]
    assert LatencyBudget(p95_budget_ms=10.0).recommend(thin).firm
    assert not LatencyBudget(p99_budget_ms=10.0).recommend(thin).firm  # p99 of 50 batches is the slowest one
    assert LatencyBudget(p95_budget_ms=9.0).recommend(ROWS).batch_size == 4  # equal to the budget is within it


def test_nothing_within_the_budget_names_the_smallest_batch_size_latency() -> None:
    rec = LatencyBudget(p95_budget_ms=3.0, p99_budget_ms=4.0).recommend(list(reversed(ROWS)))
    assert rec.batch_size is None and rec.binds is None and rec.as_dict()["batch_size"] is None
    assert format_recommendation(rec, mode="predict") == [
        "no batch size meets the latency budget (request p95 <= 3 ms, request p99 <= 4 ms): the smallest, "
        "batch size 1, has request p95 4.00 ms, request p99 5.00 ms"
    ]
    nothing = LatencyBudget(p95_budget_ms=3.0).recommend([BenchResult(8, "oom")])
    assert format_recommendation(nothing)[0].endswith("no batch size was measured (every one ran out of memory)")


def test_the_plot_draws_the_budget_line_and_rings_the_recommended_point() -> None:
    rec = LatencyBudget(p95_budget_ms=10.0, p99_budget_ms=20.0).recommend(ROWS)
    fig, points = _figure(ROWS, mode="predict", title=None, subtitle=None, dpi=50, recommendation=rec)
    (ax,) = fig.axes
    budget_line = next(line for line in ax.lines if line.get_linestyle() == "--")
    assert list(budget_line.get_xdata()) == [10.0, 10.0]
    (ring,) = ax.collections
    assert [tuple(p) for p in ring.get_offsets()] == [(9.0, 460.0)]
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    assert labels == ["p95 budget 10 ms", "and p99 request latency <= 20 ms", "recommended: bs 4"]
    assert ax.get_xlabel() == "p95 request latency (ms)"
    # a budget on p99 alone puts p99 on the x axis
    p99_only = LatencyBudget(p99_budget_ms=15.0).recommend(ROWS)
    fig, points = _figure(ROWS, mode="train", title=None, subtitle=None, dpi=50, recommendation=p99_only)
    assert fig.axes[0].get_xlabel() == "p99 step latency (ms)" and [p[1] for p in points] == [5.0, 14.0, 32.0]
    # an uncertain choice says so in the key
    thin = [row(1, 4.0, 5.0, 250.0, steps=5)]
    fig, _ = _figure(thin, mode="train", title=None, subtitle=None, dpi=50,
                     recommendation=LatencyBudget(p95_budget_ms=5.0).recommend(thin))  # fmt: skip
    assert "recommended: bs 1 (uncertain)" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        pytest.param({"p95_budget_ms": 0}, ValueError, "`p95_budget_ms` must be in (0, inf], got 0", id="zero"),
        pytest.param({"p99_budget_ms": -1.0}, ValueError, "`p99_budget_ms` must be in (0, inf], got -1.0", id="neg"),
        pytest.param(
            {"p95_budget_ms": float("nan")}, ValueError, "`p95_budget_ms` must be a finite number, got nan", id="nan"
        ),
        pytest.param(
            {"p95_budget_ms": float("inf")}, ValueError, "`p95_budget_ms` must be a finite number, got inf", id="inf"
        ),
        pytest.param({"p95_budget_ms": "5"}, TypeError, "`p95_budget_ms` must be a number, got '5' (str)", id="str"),
        pytest.param(
            {}, ValueError, "`p95_budget_ms` and `p99_budget_ms` are both None: give at least one budget", id="none"
        ),
        pytest.param(
            {"p95_budget_ms": 5.0, "knee_fraction": 0.0},
            ValueError,
            "`knee_fraction` must be in (0, 1], got 0.0",
            id="knee-zero",
        ),
        pytest.param(
            {"p95_budget_ms": 5.0, "knee_fraction": 1.5},
            ValueError,
            "`knee_fraction` must be in (0, 1], got 1.5",
            id="knee-above-one",
        ),
    ],
)
def test_bad_budgets_name_the_argument(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message) + "$"):
        LatencyBudget(**kwargs)


def test_recommend_refuses_what_is_not_a_result() -> None:
    with pytest.raises(TypeError, match=r"`results\[1\]` must be a BenchResult, got \{'batch_size': 2\}"):
        LatencyBudget(p95_budget_ms=5.0).recommend([ROWS[0], {"batch_size": 2}])  # type: ignore[list-item]


def test_a_smaller_faster_batch_size_within_the_budget_is_pointed_out() -> None:
    # as a busy CPU measures it: batch size 2 is the fastest; 4 and 8 only wait longer
    rows = [row(1, 4.0, 5.0, 131.5), row(2, 17.6, 19.3, 140.8), row(4, 33.4, 48.7, 130.6), row(8, 66.0, 75.5, 126.0)]
    rec = LatencyBudget(p95_budget_ms=40.0).recommend(rows)
    assert rec.batch_size == 4 and rec.knee_batch_size == 1 and rec.binds == "knee"
    assert rec.faster_smaller is rows[1]
    assert rec.as_dict()["faster_smaller"] == {"batch_size": 2, "samples_per_sec": 140.8}
    lines = format_recommendation(rec, mode="predict")
    assert lines[3] == (
        "  binds        the throughput knee: batch size 4 gives -1 % samples/s against 1, at p95 +735 % latency; take "
        "1, both faster and sooner"
    )
    assert lines[4] == (
        "  note         batch size 2 is within the budget too and faster (140.8 samples/s, request p95 17.60 ms): "
        "past it, larger batches cost latency and buy no throughput here"
    )
    # where throughput rises with the batch size there is no such note
    assert LatencyBudget(p95_budget_ms=40.0).recommend(ROWS).faster_smaller is None
