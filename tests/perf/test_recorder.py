"""StepRecorder without a Trainer: a hand-set device clock gives exact step times, waits, percentiles and ratios."""

from __future__ import annotations

import math
from dataclasses import fields

import numpy as np
import pytest
import torch

from lightning_tune import keys
from lightning_tune.perf.recorder import StepRecorder, format_summary
from lightning_tune.perf.stats import Totals
from lightning_tune.perf.step_run import StepRun
from lightning_tune.perf.timing import Timeline


class HandClock:
    """A device clock the test sets: a mark is the time now (ms); it completes once the device has got that far."""

    def __init__(self) -> None:
        self.now = 0.0
        self.completed = math.inf  # the device's progress: marks at or before it have run
        self.waits = 0

    def mark(self) -> float:
        return self.now

    def elapsed_ms(self, start: float, end: float) -> float:
        if not (self.done(start) and self.done(end)):
            raise RuntimeError("device not ready")  # as CUDA's elapsed_time on an event still running
        return end - start

    def done(self, mark: float) -> bool:
        return mark <= self.completed

    def wait(self, mark: float) -> None:
        self.waits += 1
        self.completed = max(self.completed, mark)

    def release(self, mark: float) -> None:
        pass


def recorder(clock: HandClock, **kwargs: object) -> StepRecorder:
    kwargs.setdefault("window", 100)
    kwargs.setdefault("percentiles", (50.0, 95.0))
    return StepRecorder(Timeline(clock), **kwargs)  # type: ignore[arg-type]


def step(
    rec: StepRecorder,
    clock: HandClock,
    global_step: int,
    *,
    gap: float,
    ms: float,
    samples: int = 4,
    tokens: int | torch.Tensor | None = None,
    stepped: bool = True,
    **end: object,
) -> bool:
    """One batch: ``gap`` ms waiting for it, ``ms`` ms running it; step ``global_step`` ends with it if ``stepped``."""
    clock.now += gap
    rec.start_batch(global_step=global_step - 1)
    clock.now += ms
    return rec.end_batch(global_step if stepped else global_step - 1, (samples, None), tokens, **end)  # type: ignore[arg-type]


def test_step_times_waits_and_rates_are_exact_and_percentiles_are_numpys() -> None:
    clock = HandClock()
    rec = recorder(clock, window=4, percentiles=(50.0, 90.0, 99.0))
    rec.gap_starts()  # the epoch's iterator is made: waiting for data from here
    steps, gaps = [10.0, 20.0, 30.0, 40.0, 100.0, 12.0], [5.0, 1.0, 2.0, 1.0, 1.0, 50.0]
    for n, (ms, gap) in enumerate(zip(steps, gaps, strict=True), start=1):
        assert step(rec, clock, n, gap=gap, ms=ms, tokens=16)
    local, metrics = rec.train_metrics()
    wall_s = (sum(steps) + sum(gaps)) / 1000
    assert local["samples_per_sec"] == pytest.approx(6 * 4 / wall_s)
    assert local["tokens_per_sec"] == pytest.approx(6 * 16 / wall_s)
    assert local["data_wait_frac"] == pytest.approx(sum(gaps) / (sum(steps) + sum(gaps)))
    for q in (50, 90, 99):  # the window holds the last 4 steps
        assert metrics[f"perf/train/step_ms_p{q}"] == pytest.approx(np.percentile(steps[-4:], q))
    assert metrics["perf/train/step_ms_max"] == 100.0
    assert "perf/train/padding_frac" not in metrics and keys.MFU not in metrics
    after, _ = rec.train_metrics()  # a new interval: no step since the log, so no rates; the window stays
    assert "samples_per_sec" not in after and after["step_ms_max"] == 100.0


def test_a_step_of_micro_batches_spans_them_and_the_gaps_between_are_waiting() -> None:
    clock = HandClock()
    rec = recorder(clock)
    rec.gap_starts()
    for n in (1, 2):  # two optimizer steps of two micro-batches each
        assert not step(rec, clock, n, gap=3.0, ms=10.0, stepped=False)  # accumulating
        assert step(rec, clock, n, gap=2.0, ms=10.0)
    local, _ = rec.train_metrics()
    assert local["step_ms_p50"] == 22.0  # 10 + 2 + 10: from the first micro-batch's start to the last's end
    assert local["data_wait_frac"] == pytest.approx((3 + 2) * 2 / 50)
    assert local["batches_per_sec"] == pytest.approx(4 / 0.050) and local["samples_per_sec"] == pytest.approx(16 / 0.05)


def test_a_step_still_running_at_a_log_is_carried_to_the_next_and_only_the_end_waits() -> None:
    clock = HandClock()
    rec = recorder(clock)
    rec.gap_starts()
    step(rec, clock, 1, gap=1.0, ms=10.0)
    step(rec, clock, 2, gap=1.0, ms=30.0)
    clock.completed = 15.0  # the device has run step 1 (ends at 11 ms), not step 2 (ends at 42 ms)
    first, _ = rec.train_metrics()
    assert first["step_ms_max"] == 10.0 and first["samples_per_sec"] == pytest.approx(4 / 0.011)
    step(rec, clock, 3, gap=1.0, ms=20.0)
    clock.completed = 50.0  # step 2 has run, step 3 (ends at 63 ms) not yet
    second, _ = rec.train_metrics()
    assert second["step_ms_max"] == 30.0 and second["samples_per_sec"] == pytest.approx(4 / 0.031)
    assert clock.waits == 0  # nothing blocked while training
    summary = rec.finish()
    assert clock.waits == 1 and summary["steps"] == 3.0 and summary["seconds"] == pytest.approx(0.063)
    assert summary["step_ms_p50"] == 20.0 and summary["step_ms_max"] == 30.0


def test_warmup_steps_are_left_out_even_when_still_pending_at_its_end() -> None:
    clock = HandClock()
    rec = recorder(clock)
    rec.warmup_end = 2
    rec.gap_starts()
    for n, ms in enumerate([100.0, 90.0, 10.0, 20.0], start=1):
        if n == 2:
            clock.completed = clock.now  # step 2 is still running at its log
        step(rec, clock, n, gap=1.0, ms=ms)
        local, _ = rec.train_metrics()  # a log at every step
        if n == 2:
            assert local["step_ms_max"] == 100.0  # the warm-up's own log still shows step 1
        rec.close_warmup(n)
        clock.completed = math.inf
    summary = rec.finish()
    assert summary["steps"] == 2.0 and summary["step_ms_max"] == 20.0 and summary["step_ms_p50"] == 15.0
    assert summary["samples_per_sec"] == pytest.approx(8 / 0.032)  # steps 3 and 4 and the gaps before them


def test_padding_comes_from_the_masks_or_from_the_micro_batches_that_ran() -> None:
    clock = HandClock()
    rec = recorder(clock)
    rec.gap_starts()
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    step(rec, clock, 1, gap=1.0, ms=1.0, tokens=mask.sum(), mask=mask)  # counted on the device, read at the log
    step(rec, clock, 2, gap=1.0, ms=1.0, ran=StepRun(micro_batches=2, tokens=(9, 12)))  # trimmed by the cutter
    local, metrics = rec.train_metrics()
    assert metrics["perf/train/padding_frac"] == pytest.approx(1 - (5 + 9) / (8 + 12))
    assert local["tokens_per_sec"] == pytest.approx(5 / 0.004) and local["batches_per_sec"] == pytest.approx(3 / 0.004)


def test_straggler_ratio_and_summed_rates_from_gathered_rows() -> None:
    clock = HandClock()
    rec = recorder(clock, distributed=True)
    rec.flops_per_batch, rec.peak = 1e9, 1e12
    rec.gap_starts()
    for n in (1, 2, 3):  # own time per step: 2 ms waiting + 4 ms forward; the rest is backward and all-reduce
        clock.now += 2.0
        rec.start_batch(global_step=n - 1)
        clock.now += 4.0
        rec.end_forward()
        clock.now += 14.0
        rec.end_batch(n, (4, None), None)
    # the other ranks' rows: samples/s, tokens/s, batches/s, FLOP/s, hardware FLOP/s, own time per step (p50)
    others = torch.tensor(
        [[100.0, 0.0, 25.0, 5e10, 0.0, 6.0], [100.0, 0.0, 25.0, 5e10, 0.0, 18.0], [300.0, 0.0, 75.0, 3e11, 0.0, 6.0]],
        dtype=torch.float64,
    )
    rows: list[torch.Tensor] = []

    def gather(row: torch.Tensor) -> torch.Tensor:
        rows.append(row)
        return torch.cat([row[None], others])

    local, metrics = rec.train_metrics(gather)
    # this rank: 3 steps of 4 samples and 1e9 FLOPs in 60 ms; its own time per step 2 + 4 ms
    assert rows[0].tolist() == pytest.approx([200.0, 0.0, 50.0, 5e10, 0.0, 6.0])
    assert metrics[keys.STRAGGLER_RATIO] == pytest.approx(18.0 / 6.0)  # the slowest own time over the median
    assert metrics["perf/train/samples_per_sec"] == pytest.approx(700.0)
    assert metrics["perf/train/batches_per_sec"] == pytest.approx(175.0)
    assert metrics[keys.MFU] == pytest.approx((3 * 5e10 + 3e11) / 4 / 1e12)  # over the ranks' mean FLOP/s
    assert keys.HFU not in metrics  # no recomputation counted
    assert "perf/train/tokens_per_sec" not in metrics  # no rank counted tokens


def test_inference_latency_percentiles_budget_share_and_report() -> None:
    clock = HandClock()
    rec = recorder(clock, window=4, percentiles=(50.0, 95.0), latency_budget_ms=15.0, distributed=True)
    rec.peak = 1e12
    durations = [10.0, 20.0, 12.0, 30.0, 14.0]
    rec.begin_inference("val")
    for ms in durations:
        clock.now += 1.0
        rec.start_inference_batch("val")
        clock.now += ms
        rec.end_inference_batch("val", 2, 7, flops=1e9)
    clock.completed = 0.0  # still running on the device: the end of the run waits once
    metrics, summary = rec.end_inference("val") or ({}, {})
    assert clock.waits == 1
    seconds = (sum(durations) + 4.0) / 1000  # from the first batch's start to the last's end
    for q in (50, 95):
        assert metrics[f"perf/val/batch_ms_p{q}"] == pytest.approx(np.percentile(durations[-4:], q))
        assert metrics[f"perf/val/sample_ms_p{q}"] == pytest.approx(np.percentile(durations[-4:], q) / 2)
    assert metrics["perf/val/samples_per_sec"] == pytest.approx(10 / seconds)
    assert metrics["perf/val/tokens_per_sec"] == pytest.approx(35 / seconds)
    assert metrics["perf/val/mfu"] == pytest.approx(5e9 / seconds / 1e12)
    assert metrics["perf/val/over_budget_frac"] == 0.5  # of the last 4: 20 and 30 ms
    assert summary["batches"] == 5.0 and summary["over_budget_frac"] == 0.5 and summary["seconds"] == seconds
    line, warning = rec.budget_report()[0]
    assert line == (
        "ThroughputLatencyMonitor: 2 of 5 validation batches on this rank (40.0 %) took longer than the latency "
        "budget of 15 ms"
    )
    assert warning is not None and warning.startswith("40.0 % of validation batches on this rank took longer")
    assert "--p95-budget-ms 15`" in warning and rec.budget_report() == []  # reported once


def resized_run(sizes: list[int], ms_per_sample: list[float]) -> dict[str, float]:
    """A validation run of batches of ``sizes`` samples, each taking its samples times its ``ms_per_sample``."""
    clock = HandClock()
    rec = recorder(clock, percentiles=(50.0, 95.0, 99.0))
    rec.begin_inference("val")
    for k, per_sample in zip(sizes, ms_per_sample, strict=True):
        rec.start_inference_batch("val")
        clock.now += k * per_sample
        rec.end_inference_batch("val", k, None, 0.0)
    return (rec.end_inference("val") or ({}, {}))[0]


def test_per_sample_latency_and_samples_per_second_do_not_move_when_batches_are_resized() -> None:
    # 64 samples at 1.25 ms each, run in batches of 8, or of 32 and 16 and a batch split in two after an out-of-memory
    # error (DynamicBatchSize's evaluation sizing): the figures a sample are the same, a batch's time is not
    eights = resized_run([8] * 8, [1.25] * 8)
    resized = resized_run([32, 16, 8, 8], [1.25] * 4)
    for q in (50, 95, 99):
        assert eights[f"perf/val/sample_ms_p{q}"] == resized[f"perf/val/sample_ms_p{q}"] == pytest.approx(1.25)
    assert eights["perf/val/samples_per_sec"] == pytest.approx(resized["perf/val/samples_per_sec"]) == 800.0
    assert eights["perf/val/batch_ms_p50"] == 10.0 and resized["perf/val/batch_ms_p50"] == 15.0
    # samples of unequal cost: each batch's time over its samples, percentiles as numpy takes them
    per_sample = [1.0, 1.5, 1.0, 1.2, 1.0, 3.0, 1.0, 1.0]
    uneven = resized_run([4, 8, 2, 8, 16, 8, 8, 1], per_sample)
    for q in (50, 95, 99):
        assert uneven[f"perf/val/sample_ms_p{q}"] == pytest.approx(np.percentile(per_sample, q))


def test_summary_text() -> None:
    clock = HandClock()
    rec = recorder(clock, percentiles=(50.0, 99.0))
    rec.gap_starts()
    for n, ms in enumerate([20.0, 30.0], start=1):
        step(rec, clock, n, gap=25.0, ms=ms, tokens=1000)
    summary = rec.finish(vram_peak_gib=3.5)
    assert format_summary(summary, rec.percentiles, num_workers=2) == (
        "ThroughputLatencyMonitor summary (this rank)\n"
        "  throughput    80.0 samples/s, 20,000 tokens/s\n"
        "  step time     p50 25.0, p99 29.9, max 30.0 ms\n"
        "  peak VRAM     3.50 GiB\n"
        "  data wait     50.0 % of training time\n"
        "  hint: 50 % of training time passes between batches. If that is data loading, raise the DataLoader's "
        "num_workers (now 2) and set pin_memory=True and persistent_workers=True"
    )


def test_totals_add_every_figure() -> None:
    ones = Totals(**{f.name: 1 for f in fields(Totals)})
    total = Totals()
    total.add(ones)
    total.add(ones)
    assert {f.name: getattr(total, f.name) for f in fields(Totals)} == {f.name: 2 for f in fields(Totals)}
