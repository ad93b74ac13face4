"""The monitor's step recording, marks in and metrics out, and its end-of-fit summary (:func:`format_summary`)."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_tune import keys
from lightning_tune.perf.counting import FlopModel
from lightning_tune.perf.stats import StepStats
from lightning_tune.perf.step_run import StepRun
from lightning_tune.perf.timing import CudaTimer, Timeline, compiled_graphs
from lightning_tune.perf.window import percentile_suffix, window_percentiles

#: A data-wait share above this gets a hint in the end-of-fit summary.
DATA_WAIT_HINT = 0.10
#: A share of validation or predict batches over the latency budget above this gets a warning at the end.
OVER_BUDGET_WARN = 0.05
#: The rates each rank contributes to one row of the logging interval's collective, then its own time per step.
GATHERED = ("samples_per_sec", "tokens_per_sec", "batches_per_sec", "flops_per_sec", "hardware_flops_per_sec")


@dataclass(slots=True)
class _Step:
    """One optimizer step being recorded: marks, gaps and counts (resolved at logging time)."""

    start: int  # marks are numbers on the recorder's Timeline
    before: tuple[int, int] | None
    end: int = -1
    within: list[tuple[int, int]] = field(default_factory=list)
    forward: list[tuple[int, int]] = field(default_factory=list)
    batch_start: int | None = None
    samples: int = 0
    tokens: int = 0
    mask_tokens: Tensor | None = None  # tokens counted from masks, on the device
    mask_real: Tensor | None = None  # real tokens of attention masks (padding), on the device
    padding: list[int] = field(default_factory=lambda: [0, 0])  # real and padded tokens known on the host
    counts: Tensor | None = None  # the two device counts: on the host (CUDA, copied without blocking) or as counted
    warmup: bool = False
    batches: int = 0
    global_step: int = 0
    excluded: bool = False
    flops: float = 0.0
    hardware_flops: float = 0.0
    compiled: int = 0


@dataclass
class _Inference:
    """Batch marks of one validation or predict run: each batch's start, and its end and samples once it ended."""

    marks: list[tuple[int, int | None, int]] = field(default_factory=list)
    samples: int = 0
    tokens: Any = 0  # an int, or a device tensor read at the end
    flops: float = 0.0


class StepRecorder:
    """The training steps, and the validation and predict runs, of one Trainer call, on one timeline; no Trainer.

    A step runs from its first micro-batch's start to the end of the batch after which the global step has moved on.
    The host never waits for the device while training: a log folds in the steps whose marks have completed and
    carries the others to the next one; the end of a fit (or of a validation or predict run) waits once. The warm-up's
    steps (:meth:`close_warmup`) and a compiling step's timings (``torch.compile``) are left out. With
    ``distributed``, each step's own time (batch waits and forward passes) is kept for the straggler ratio.

    Example:
        >>> from lightning_tune.perf.timing import HostTimer
        >>> recorder = StepRecorder(Timeline(HostTimer()), window=10, percentiles=(50,))
        >>> recorder.start_batch(global_step=0); recorder.end_batch(1, (8, None), None), recorder.finish()["steps"]
        (True, 1.0)
    """

    def __init__(
        self,
        timeline: Timeline,
        *,
        window: int,
        percentiles: Sequence[float],
        distributed: bool = False,
        latency_budget_ms: float | None = None,
    ) -> None:
        self.timeline = timeline
        self.stats = StepStats(window=window, percentiles=percentiles)
        self.window, self.percentiles = window, self.stats.percentiles
        self.distributed, self.latency_budget_ms = distributed, latency_budget_ms
        self.warmup_end = 0  # the global step that ends the warm-up
        self.peak: float | None = None  # the device's peak FLOP/s, for MFU
        # FLOPs of a training micro-batch: given, else by its shape (model FLOPs, hardware FLOPs with recomputation)
        self.flops_per_batch: float | None = None
        self.flop_model: FlopModel | None = None
        self.hardware_flop_model: FlopModel | None = None
        self.over_budget: dict[str, list[int]] = {}  # per stage: [batches over the budget, batches timed]
        self._pending: list[_Step] = []
        self._current: _Step | None = None
        self._prev_end: int | None = None
        self._prepared = False
        self._padding = [0, 0]  # real and padded tokens of the steps resolved since the last log
        self._own: deque[float] = deque(maxlen=window)  # own times per step (ms), under DDP
        self.runs: dict[str, _Inference] = {}  # the validation or predict runs being recorded

    def gap_starts(self) -> None:
        """From now until the next batch is waiting for data (a new epoch's iterator; after validation)."""
        self._prev_end = self.timeline.mark()

    def start_batch(self, *, global_step: int, prepare: Callable[[], Any] | None = None) -> None:
        """Mark a training batch's start; the first of a step opens it, after ``prepare`` (run once, untimed)."""
        mark = self.timeline.mark()
        step = self._current
        if step is None:
            before = (self._prev_end, mark) if self._prev_end is not None else None
            if prepare is not None and not self._prepared:
                self._prepared = True
                prepare()
                mark = self.timeline.mark()
            step = self._current = _Step(start=mark, before=before, global_step=global_step, compiled=compiled_graphs())
        elif self._prev_end is not None:
            step.within.append((self._prev_end, mark))
        step.batch_start = mark
        step.batches += 1

    def end_forward(self) -> None:
        """Mark a forward pass's end, before the first gradient all-reduce (kept only when ``distributed``)."""
        step = self._current
        if self.distributed and step is not None and step.batch_start is not None:
            step.forward.append((step.batch_start, self.timeline.mark()))

    def end_batch(
        self,
        global_step: int,
        shape: tuple[int, int | None],
        tokens: Any,
        ran: StepRun | None = None,
        mask: object = None,
    ) -> bool:
        """Mark a training batch's end, with its counts; whether it closed the optimizer step.

        ``shape`` is its samples and sequence length (``None`` where its FLOPs are not counted by shape), ``tokens`` a
        number, a device tensor (read once the step has run) or ``None``, ``ran`` the micro-batches a callback cut it
        into, ``mask`` its attention mask (the padding).
        """
        step = self._current
        if step is None:
            return False
        step.samples += shape[0]
        if isinstance(tokens, Tensor):
            step.mask_tokens = tokens.detach() if step.mask_tokens is None else step.mask_tokens + tokens.detach()
        elif tokens is not None:
            step.tokens += int(tokens)
        if ran is not None and ran.tokens:
            step.padding[0] += ran.tokens[0]
            step.padding[1] += ran.tokens[1]
        elif isinstance(mask, Tensor) and mask.dim() == 2:
            real = mask.detach().sum()  # on the device: read once the step has run
            step.mask_real = real if step.mask_real is None else step.mask_real + real
            step.padding[1] += mask.numel()
        stepped = global_step != step.global_step  # else accumulating: the optimizer step is still to come
        if stepped and (step.mask_tokens is not None or step.mask_real is not None):
            # in before the end mark completes; copied only where that mark is a CUDA event that orders the read
            step.counts = _counts(step.mask_tokens, step.mask_real, to_host=isinstance(self.timeline.timer, CudaTimer))
        mark = self._prev_end = self.timeline.mark()
        if self.flops_per_batch is not None:
            step.flops += self.flops_per_batch
        elif self.flop_model is not None:  # of the micro-batches that ran, else the batch's
            hardware = self.hardware_flop_model or self.flop_model
            for samples, length in (ran.shapes if ran is not None else None) or [shape]:
                step.flops += self.flop_model.flops(samples, length)
                step.hardware_flops += hardware.flops(samples, length)
        if ran is not None:
            step.batches += ran.micro_batches - 1
        if not stepped:
            return False
        step.end = mark
        step.excluded = compiled_graphs() != step.compiled  # torch.compile compiled during the step: not a timing
        self._current = None
        self._pending.append(step)
        return True

    def close_warmup(self, global_step: int) -> None:
        """After a step's log: at ``warmup_end`` the warm-up's steps, resolved or not, are left out of the figures."""
        if global_step == self.warmup_end:
            for pending in self._pending:
                pending.warmup = True
            self.stats = StepStats(window=self.window, percentiles=self.percentiles)

    def resolve(self, *, wait: bool = False) -> None:
        """Fold the steps whose marks have completed into the figures; the others wait for the next call.

        Without ``wait`` nothing blocks: at most one ``Event.query()`` per pending mark. With it (the end of the fit),
        one wait on the newest mark resolves them all.
        """
        if not self._pending:
            return
        resolved = self.timeline.resolve(wait=wait)
        ready = 0
        while ready < len(self._pending) and self._pending[ready].end < resolved:
            ready += 1
        for step in self._pending[:ready]:
            self._fold(step)
        del self._pending[:ready]
        self._forget()

    def _forget(self) -> None:
        """Drop the times no longer needed: all but those of pending steps, the step recorded and the next gap."""
        steps = [*self._pending, *([self._current] if self._current is not None else [])]
        oldest = [step.before[0] if step.before is not None else step.start for step in steps]
        if self._prev_end is not None:
            oldest.append(self._prev_end)
        self.timeline.forget(min(oldest, default=self.timeline.resolved))

    def _fold(self, step: _Step) -> None:
        """Add one resolved step to the figures."""
        ms = self.timeline.ms
        real, padded = step.padding
        if step.counts is not None:  # on CUDA copied before the step's end mark, which has completed: no wait
            counts = step.counts if step.counts.device.type == "cpu" else step.counts.cpu()  # MPS, XPU: read now
            mask_tokens, mask_real = (int(v) for v in counts.numpy())
            real += mask_real
            if not step.excluded and not step.warmup:
                self.stats.interval.tokens += mask_tokens
                self.stats.total.tokens += mask_tokens
        self._padding[0] += real
        self._padding[1] += padded
        before = ms(*step.before) if step.before is not None else 0.0
        within = sum(ms(a, b) for a, b in step.within)
        if self.distributed and not step.excluded:
            self._own.append(before + within + sum(ms(a, b) for a, b in step.forward))
        if step.warmup:
            return
        if step.before is not None:
            self.stats.add_between(wait_ms=before)
        if step.excluded:
            return
        self.stats.add_step(
            step_ms=ms(step.start, step.end),
            samples=step.samples,
            tokens=step.tokens,
            batches=step.batches,
            wait_ms=within,
            flops=step.flops,
            hardware_flops=step.hardware_flops,
        )

    def train_metrics(self, gather: Callable[[Tensor], Tensor] | None = None) -> tuple[dict[str, float], ...]:
        """The logging interval's figures: this rank's (keys without prefix), and the ``perf/...`` keys to log.

        Under DDP, ``gather`` is ``all_gather`` of a 1-D float64 row (every rank's, stacked): rates are then summed over
        ranks, and the ranks' own times per step give ``perf/straggler_ratio``.
        """
        self.resolve()
        local = self.stats.interval_metrics()
        metrics = {keys.TRAIN + k: v for k, v in local.items() if not k.endswith("flops_per_sec")}
        real, padded = self._padding
        self._padding = [0, 0]
        if padded:
            metrics[keys.PADDING_FRAC] = 1.0 - real / padded
        metrics.update(self._utilisation(local) if gather is None else self._gathered(local, gather))
        return local, metrics

    def _gathered(self, local: dict[str, float], gather: Callable[[Tensor], Tensor]) -> dict[str, float]:
        """Rates summed over ranks; the largest own time per step over the ranks' median, the straggler ratio.

        (The step time itself cannot tell a straggler: the fast ranks wait for it inside the gradient all-reduce.)
        """
        p50 = window_percentiles(self._own, (50.0,)).get(50.0, 0.0)
        row = torch.tensor([local.get(n, 0.0) for n in GATHERED] + [p50], dtype=torch.float64)
        gathered = gather(row).reshape(-1, len(GATHERED) + 1).cpu()
        out = {keys.TRAIN + n: float(gathered[:, i].sum()) for i, n in enumerate(GATHERED[:3]) if n in local}
        out.update(self._utilisation({n: float(gathered[:, i].mean()) for i, n in enumerate(GATHERED) if n in local}))
        medians = [float(v) for v in gathered[:, -1]]
        middle = statistics.median(medians)
        if middle > 0:
            out[keys.STRAGGLER_RATIO] = max(medians) / middle
        return out

    def _utilisation(self, rates: dict[str, float]) -> dict[str, float]:
        """MFU, and HFU when recomputation adds hardware FLOPs, from FLOP rates."""
        if not self.peak or "flops_per_sec" not in rates:
            return {}
        out = {keys.MFU: rates["flops_per_sec"] / self.peak}
        if self.hardware_flop_model is not None and "hardware_flops_per_sec" in rates:
            out[keys.HFU] = rates["hardware_flops_per_sec"] / self.peak
        return out

    def finish(self, vram_peak_gib: float | None = None) -> dict[str, float]:
        """The end of the fit: one wait for the steps still pending, then the fit's figures, keys without prefix."""
        self.resolve(wait=True)
        self._current = self._prev_end = None  # no gap to time until the next fit
        self._forget()
        totals = self.stats.total
        summary = {**StepStats.rates(totals), **self.stats.latency_metrics()}
        summary.update({key.rpartition("/")[2]: value for key, value in self._utilisation(summary).items()})
        if vram_peak_gib is not None:
            summary["vram_peak_gib"] = vram_peak_gib
        summary.update(steps=float(totals.steps), seconds=totals.wall_ms / 1000.0)
        return summary

    def begin_inference(self, stage: str) -> None:
        """Start recording a validation or predict run (``stage``: ``"val"`` or ``"predict"``)."""
        self.runs[stage] = _Inference()

    def start_inference_batch(self, stage: str) -> None:
        """Mark a validation or predict batch's start."""
        run = self.runs.get(stage)
        if run is not None:
            run.marks.append((self.timeline.mark(), None, 0))

    def end_inference_batch(self, stage: str, samples: int, tokens: Any, flops: float) -> None:
        """Mark a validation or predict batch's end, with its counts (its tokens may be a tensor, read at the end)."""
        run = self.runs.get(stage)
        if run is None or not run.marks:
            return
        run.marks[-1] = (run.marks[-1][0], self.timeline.mark(), samples)
        run.flops += flops
        run.samples += samples
        run.tokens = run.tokens + (tokens.detach() if isinstance(tokens, Tensor) else tokens or 0)

    def end_inference(self, stage: str) -> tuple[dict[str, float], dict[str, float]] | None:
        """The end of a validation or predict run, after one wait: its keys to log and its summary, if it timed any."""
        run = self.runs.pop(stage, None)
        timeline = self.timeline
        if run is None or not run.marks or run.marks[-1][1] is None:
            return None
        end = run.marks[-1][1]
        timeline.resolve(wait=True)  # the end of a run: one wait
        ended = [(timeline.ms(a, b), k) for a, b, k in run.marks if b is not None]
        durations = [ms for ms, _ in ended]
        metrics: dict[str, float] = {}
        # a batch's time, and its time a sample: the same figure whatever size the batches are
        for key, values in ((keys.BATCH_MS, durations), (keys.SAMPLE_MS, [ms / k for ms, k in ended if k])):
            percentiles = window_percentiles(values[-self.window :], self.percentiles)
            metrics.update({key.format(stage=stage, q=f"{p:g}"): v for p, v in percentiles.items()})
        seconds = timeline.ms(run.marks[0][0], end) / 1000.0
        self._forget()
        if seconds > 0:
            metrics[keys.STAGE_SAMPLES_PER_SEC.format(stage=stage)] = run.samples / seconds
            if run.tokens:
                metrics[keys.STAGE_TOKENS_PER_SEC.format(stage=stage)] = float(run.tokens) / seconds
            if run.flops and self.peak:
                metrics[keys.STAGE_MFU.format(stage=stage)] = run.flops / seconds / self.peak
        if self.latency_budget_ms is not None and durations:
            over = [ms > self.latency_budget_ms for ms in durations]
            recent = over[-self.window :]
            metrics[keys.OVER_BUDGET_FRAC.format(stage=stage)] = sum(recent) / len(recent)
            counted = self.over_budget.get(stage, [0, 0])
            self.over_budget[stage] = [counted[0] + sum(over), counted[1] + len(over)]
        summary = {key.rpartition("/")[2]: v for key, v in metrics.items()}
        summary.update(batches=float(len(durations)), seconds=seconds)
        return metrics, summary

    def budget_report(self) -> list[tuple[str, str | None]]:
        """Per stage timed since the last report: a line on its batches over the latency budget, a warning past 5 %."""
        tallies, self.over_budget = self.over_budget, {}
        report: list[tuple[str, str | None]] = []
        rank = " on this rank" if self.distributed else ""
        for name, (over, total) in tallies.items():
            what = f"{'validation' if name == 'val' else name} batches{rank}"
            share, budget = over / total, f"the latency budget of {self.latency_budget_ms:g} ms"
            info = f"ThroughputLatencyMonitor: {over} of {total} {what} ({100 * share:.1f} %) took longer than {budget}"
            warning = (
                f"{100 * share:.1f} % of {what} took longer than {budget} (more than {100 * OVER_BUDGET_WARN:g} %). "
                f"A smaller batch size brings them under it; `lightning-tune bench --p95-budget-ms "
                f"{self.latency_budget_ms:g}` finds the largest that stays within it"
            )
            report.append((info, warning if share > OVER_BUDGET_WARN else None))
        return report


def _counts(*counts: Tensor | None, to_host: bool) -> Tensor:
    """Device counts (0-dim tensors, ``None`` for 0) stacked; ``to_host``: copied into pinned memory, no wait.

    The copy may be read only once a CUDA event recorded after this call has completed. Host-clock marks (MPS, XPU, the
    CPU) order nothing, so there the counts stay where they were counted and are read when the step is folded in, at a
    logging step, rather than synchronising every step.
    """
    device = next(t for t in counts if t is not None).device
    stacked = torch.stack([torch.zeros((), dtype=torch.long, device=device) if t is None else t.long() for t in counts])
    return stacked.to("cpu", non_blocking=True) if to_host else stacked


def format_summary(summary: dict[str, float], percentiles: Sequence[float], *, num_workers: int | None = None) -> str:
    """The monitor's end-of-fit table; a hint (naming the DataLoader's ``num_workers``) when data waits are long.

    Example:
        >>> print(format_summary({"samples_per_sec": 1200.0, "step_ms_p50": 26.5, "data_wait_frac": 0.01}, (50,)))
        ThroughputLatencyMonitor summary (this rank)
          throughput    1,200.0 samples/s
          step time     p50 26.5 ms
          data wait     1.0 % of training time
    """
    lines = ["ThroughputLatencyMonitor summary (this rank)"]
    rate = f"{summary['samples_per_sec']:,.1f} samples/s" if "samples_per_sec" in summary else None
    if "tokens_per_sec" in summary:
        rate = f"{rate}, {summary['tokens_per_sec']:,.0f} tokens/s"
    if rate:
        lines.append(f"  throughput    {rate}")
    times = [
        f"{q} {summary[f'step_ms_{q}']:.1f}" for q in map(percentile_suffix, percentiles) if f"step_ms_{q}" in summary
    ]
    if "step_ms_max" in summary and len(percentiles) > 1:
        times.append(f"max {summary['step_ms_max']:.1f}")
    if times:
        lines.append(f"  step time     {', '.join(times)} ms")
    if "vram_peak_gib" in summary:
        lines.append(f"  peak VRAM     {summary['vram_peak_gib']:.2f} GiB")
    if "mfu" in summary:
        hfu = f" (HFU {100 * summary['hfu']:.1f} %, recomputation included)" if "hfu" in summary else ""
        lines.append(f"  MFU           {100 * summary['mfu']:.1f} %{hfu}")
    if "data_wait_frac" in summary:
        share = summary["data_wait_frac"]
        lines.append(f"  data wait     {100 * share:.1f} % of training time")
        if share > DATA_WAIT_HINT:
            workers = f" (now {num_workers})" if num_workers is not None else ""
            lines.append(
                f"  hint: {100 * share:.0f} % of training time passes between batches. If that is data loading, raise "
                f"the DataLoader's num_workers{workers} and set pin_memory=True and persistent_workers=True"
            )
    return "\n".join(lines)
