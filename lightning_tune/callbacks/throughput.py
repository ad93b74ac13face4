"""Throughput, step-time and inference-latency percentiles, VRAM, GPU utilisation and MFU, cheap enough to leave on.

Per step the monitor only takes two timestamps (CUDA events from a pool on a GPU) and reads the batch's shape; it
never makes the host wait for the device while training. At a logging step it resolves the steps whose events have
completed (one non-blocking ``Event.query()`` per pending mark at most) and carries the others to the next log,
reads the allocator's counters once and the driver (``mem_get_info``, NVML) at most every
:data:`~lightning_tune.perf.devices.DRIVER_READ_EVERY_S` seconds, and under DDP runs one small collective. The end
of the fit (and of a validation or predict run) waits once, for the marks still pending.

Logs straight to the Trainer's loggers the ``perf/...`` keys of :mod:`lightning_tune.keys` (table in
``docs/logged_keys.md``).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from typing_extensions import override

from lightning_tune import keys
from lightning_tune._validation import check_bool, check_float, check_int
from lightning_tune.callbacks._logging import lightning_step, should_log
from lightning_tune.perf.batch import count_samples, count_tokens, sequence_length
from lightning_tune.perf.counting import FlopModel, count_step_flops
from lightning_tune.perf.devices import (
    DRIVER_READ_EVERY_S,
    NvmlSampler,
    allocator_metrics,
    driver_metrics,
    reset_run_peak,
)
from lightning_tune.perf.flops import mfu, peak_flops
from lightning_tune.perf.ran import StepRun, StepRunSource
from lightning_tune.perf.stats import StepStats
from lightning_tune.perf.timing import CudaTimer, Timeline, compiled_graphs, timer_for
from lightning_tune.perf.window import MAX_WINDOW, LatencyWindow, check_percentiles, percentile_suffix
from lightning_tune.vocab import precision_dtype

if TYPE_CHECKING:
    import lightning.pytorch as pl

#: A data-wait share above this gets a hint in the end-of-fit summary.
DATA_WAIT_HINT = 0.10
_STEP_HOOKS = {"train": "training_step", "val": "validation_step", "predict": "predict_step"}
# strategies whose module holds parameter shards: the FLOP count's meta copy cannot stand for the model there
_SHARDED_STRATEGIES = (FSDPStrategy, ModelParallelStrategy, DeepSpeedStrategy)
#: A share of validation or predict batches over ``latency_budget_ms`` above this gets a warning at the end.
OVER_BUDGET_WARN = 0.05


@dataclass(slots=True)
class _Step:
    """One optimizer step being recorded: marks, gaps and counts (resolved at logging time)."""

    start: int  # marks are numbers on the monitor's Timeline
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
    shape: tuple[int, int | None] | None = None  # the running batch's samples and length, for its FLOPs


@dataclass
class _Inference:
    """Batch marks of one validation or predict run."""

    marks: list[tuple[int, int | None]] = field(default_factory=list)
    samples: int = 0
    tokens: Any = 0  # an int, or a device tensor read at the end
    flops: float = 0.0
    start: int | None = None


class ThroughputLatencyMonitor(Callback):
    """Measure training throughput, step-time and inference-latency percentiles, memory, utilisation and MFU.

    A "step" is an optimizer step: with gradient accumulation its samples are those of all its micro-batches, and
    batch sizes may change from one step to the next. Step time runs from the start of a step's first micro-batch
    to the end of its last; time between batches counts as waiting for data. On CUDA, times come from CUDA events
    read at logging steps once the device has completed them (steps still running are carried to the next log), so
    the host never waits for the device while training; the end of the fit waits once for the last steps.

    Args:
        window: Number of recent steps (and, for validation/predict, batches) the percentiles cover, >= 2.
        log_every_n_steps: Log every this many optimizer steps; ``None`` follows the Trainer's
            ``log_every_n_steps``.
        warmup_steps: Optimizer steps of each fit left out of the figures, >= 0 (cuDNN autotuning, the allocator's
            growth and compilation make the first ones slow, a resumed fit's too): when they end, the totals,
            rates and percentile window start afresh, so :attr:`summary` covers only the steps after it.
        percentiles: Percentiles to report, each in (0, 100).
        batch_size_fn: ``fn(batch) -> int`` giving the samples in a batch; default: the leading dimension of the
            first tensor in it.
        tokens_fn: ``fn(batch) -> int`` giving the input tokens in a batch; default: found from integer
            ``(batch, seq)`` tensors and attention masks (see :mod:`lightning_tune.perf.batch`).
        flops_per_batch: Model FLOPs of one training micro-batch (forward and backward); default: counted once,
            at the first batch, on a meta-device copy of the model (the model itself never runs under a FLOP
            counter, so a compiled model stays compiled), then scaled to each batch's samples and sequence length,
            attention with the square of the length (``docs/peak_flops.md``).
        peak_flops: The device's peak FLOP/s to divide by; default: the dense peak of a known GPU at the training
            precision (``docs/peak_flops.md``). Given, MFU is logged on any device, CPU included.
        gpu_stats: Log CUDA memory and NVML utilisation.
        latency_budget_ms: Latency budget of one validation or predict batch, in ms, > 0. Each run logs the share
            of its window's batches over it; at the end of ``fit``/``validate``/``predict`` one line sums it up,
            and a warning follows when more than 5 % of the batches were over.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[ThroughputLatencyMonitor(window=50)], logger=False)
    """

    def __init__(
        self,
        window: int = 100,
        *,
        log_every_n_steps: int | None = None,
        warmup_steps: int = 0,
        percentiles: Sequence[float] = (50, 95, 99),
        batch_size_fn: Callable[[Any], int] | None = None,
        tokens_fn: Callable[[Any], int | Tensor] | None = None,
        flops_per_batch: float | None = None,
        peak_flops: float | None = None,
        gpu_stats: bool = True,
        latency_budget_ms: float | None = None,
    ) -> None:
        check_int("window", window, minimum=2, maximum=MAX_WINDOW)
        check_int("log_every_n_steps", log_every_n_steps, minimum=1, allow_none=True)
        check_int("warmup_steps", warmup_steps, minimum=0)
        self.warmup_steps = warmup_steps
        self._warmup_end = warmup_steps  # the global step that ends the warm-up of the current fit
        self.percentiles = check_percentiles("percentiles", percentiles)
        for name, fn in (("batch_size_fn", batch_size_fn), ("tokens_fn", tokens_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"`{name}` must be a callable taking a batch, or None, got {fn!r}")
        check_float("flops_per_batch", flops_per_batch, low=0.0, low_inclusive=False, allow_none=True)
        check_float("peak_flops", peak_flops, low=0.0, low_inclusive=False, allow_none=True)
        check_bool("gpu_stats", gpu_stats)
        check_float("latency_budget_ms", latency_budget_ms, low=0.0, low_inclusive=False, allow_none=True)
        self.latency_budget_ms = latency_budget_ms
        #: Per stage ("val", "predict"): [batches over the budget, batches timed] since the Trainer call began.
        self._over_budget: dict[str, list[int]] = {}
        self.window = window
        self.log_every_n_steps = log_every_n_steps
        self.batch_size_fn = batch_size_fn
        self.tokens_fn = tokens_fn
        self.flops_per_batch = flops_per_batch
        self.peak_flops = peak_flops
        self.gpu_stats = gpu_stats
        self.stats = StepStats(window=window, percentiles=self.percentiles)
        #: Figures of the latest run, keys without their ``perf/<stage>/`` prefix: a fit's (at its end, after
        #: ``warmup_steps``; ``steps``, ``seconds``, rates, ``step_ms_p{q}``, ``mfu``) or a validation or predict
        #: run's (``batches``, ``seconds``, ``samples_per_sec``, ``tokens_per_sec``, ``batch_ms_p{q}``, ``mfu``).
        self.summary: dict[str, float] = {}
        self._timer: Timeline | None = None
        self._inference_flops: dict[str, FlopModel | None] = {}  # per stage, counted once per Trainer call
        self._pending: list[_Step] = []
        self._current: _Step | None = None
        self._padding = [0, 0]  # real and padded tokens of the steps resolved since the last log
        self._source: StepRunSource | None = None  # a callback cutting steps into micro-batches (DynamicBatchSize)
        self._prev_end: int | None = None
        self._peak: float | None = None
        self._vram_peak = 0.0  # the fit's peak allocated GiB, as read so far
        self._driver_due = -math.inf  # monotonic time of the next driver read (mem_get_info, NVML)
        #: FLOPs of a training micro-batch by its shape: model FLOPs, and hardware FLOPs when recomputation adds any.
        self.flop_model: FlopModel | None = None
        self.hardware_flop_model: FlopModel | None = None
        self._flops_counted = False
        self._nvml: NvmlSampler | None = None
        self._nvml_off = False
        self._inference: dict[str, _Inference] = {}
        self._last_logged_step = -1
        self._own = LatencyWindow(window)
        self._distributed = False
        #: This rank's figures of the latest logging interval (before summing over ranks).
        self.last_interval: dict[str, float] = {}

    # ------------------------------------------------------------------ set-up

    def _setup_device(self, trainer: pl.Trainer) -> None:
        device = trainer.strategy.root_device
        self._timer = Timeline(timer_for(device))
        if device.type != "cuda" or not self.gpu_stats or self._nvml is not None or self._nvml_off:
            return
        self._nvml_off = True  # until it works: one message, one attempt
        try:
            self._nvml = NvmlSampler(device)
            self._nvml_off = False
        except ModuleNotFoundError as err:
            rank_zero_warn(f"{err} Until then `{keys.GPU_UTIL_PCT}` is not logged.", category=RuntimeWarning)
        except Exception as err:  # noqa: BLE001 - NVML present but unusable (e.g. no driver access)
            rank_zero_warn(f"NVML could not be read ({err}); `{keys.GPU_UTIL_PCT}` is not logged.")

    def device_peak_flops(self, trainer: pl.Trainer) -> float | None:
        """Dense peak FLOP/s of the training device at the training precision, ``None`` when unknown.

        Args:
            trainer: The Trainer.

        Returns:
            The ``peak_flops`` given, else the table's peak, or ``None`` (CPU, or a GPU missing from the table).
        """
        if self.peak_flops is not None:
            return self.peak_flops
        device = trainer.strategy.root_device
        if device.type != "cuda":
            return None
        name = torch.cuda.get_device_name(device)
        dtype = precision_dtype(str(trainer.precision))
        peak = peak_flops(name, dtype, float32_matmul_precision=torch.get_float32_matmul_precision())
        if peak is None:
            rank_zero_warn(
                f"ThroughputLatencyMonitor has no peak {dtype} FLOP/s for {name!r}, so `{keys.MFU}` is not logged. "
                "Known devices are listed in lightning_tune.perf.flops.PEAK_FLOPS.",
                category=RuntimeWarning,
            )
        return peak

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._setup_device(trainer)
        self._peak = self.device_peak_flops(trainer)
        self.stats = StepStats(window=self.window, percentiles=self.percentiles)
        self._pending, self._current, self._prev_end, self._padding = [], None, None, [0, 0]
        self._own = LatencyWindow(self.window)
        self._vram_peak, self._driver_due = 0.0, -math.inf
        device = trainer.strategy.root_device
        if self.gpu_stats and device.type == "cuda" and torch.cuda.is_available():
            reset_run_peak(device)  # the fit's peak, not the process's: DynamicBatchSize's resets keep it
        self._distributed = trainer.world_size > 1
        self._last_logged_step = -1
        self.flop_model = self.hardware_flop_model = None  # the model may have changed since the last fit
        self._flops_counted = False
        self.summary = {}
        # the micro-batches DynamicBatchSize runs are trimmed: its figures, not the step batch's, give the padding
        callbacks = trainer.callbacks  # type: ignore[attr-defined]
        self._source = next((cb for cb in callbacks if isinstance(cb, StepRunSource)), None)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._warmup_end = trainer.global_step + self.warmup_steps  # after a restore: a resumed fit warms up too

    # ------------------------------------------------------------------ training

    def _count(self, batch: Any) -> tuple[int, int | Tensor | None]:
        samples = self.batch_size_fn(batch) if self.batch_size_fn is not None else count_samples(batch)
        tokens = self.tokens_fn(batch) if self.tokens_fn is not None else count_tokens(batch)
        return int(samples or 0), tokens

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._timer is not None:
            self._prev_end = self._timer.mark()  # creating the epoch's data iterator counts as waiting for data

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._timer is None:
            return
        mark = self._timer.mark()
        step = self._current
        samples, tokens = self._count(batch)
        if step is None:
            before = (self._prev_end, mark) if self._prev_end is not None else None
            if self._peak is not None and self.flops_per_batch is None and not self._flops_counted:
                self._flops_counted = True
                self.flop_model, self.hardware_flop_model = self._count_flops(pl_module, batch, batch_idx, samples)
                mark = self._timer.mark()  # the count is neither waiting for data nor training
            step = self._current = _Step(
                start=mark, before=before, global_step=trainer.global_step, compiled=compiled_graphs()
            )
        elif self._prev_end is not None:
            step.within.append((self._prev_end, mark))
        step.batch_start = mark
        step.samples += samples
        step.batches += 1
        if self.flops_per_batch is not None:
            step.flops += self.flops_per_batch
        elif self.flop_model is not None:  # this batch's shape: its samples and sequence length
            step.shape = (samples, sequence_length(batch))
        if isinstance(tokens, Tensor):  # counted on the device; read once the step has run
            step.mask_tokens = tokens.detach() if step.mask_tokens is None else step.mask_tokens + tokens.detach()
        elif tokens is not None:
            step.tokens += int(tokens)

    def _count_flops(
        self, pl_module: pl.LightningModule, batch: Any, batch_idx: int, samples: int, stage: str = "train"
    ) -> tuple[FlopModel | None, FlopModel | None]:
        """Count a step's FLOPs on a meta-device copy: the model that is timed never runs under a counter."""
        hook, key = _STEP_HOOKS[stage], keys.STAGE_MFU.format(stage=stage)
        give = " Pass `flops_per_batch=` (FLOPs of one batch on one rank, forward and backward) to give them."
        give = give if stage == "train" else ""
        strategy = pl_module.trainer.strategy
        if isinstance(strategy, _SHARDED_STRATEGIES):  # parameters are shards (DTensor, flat handles), not the model
            rank_zero_warn(
                f"ThroughputLatencyMonitor cannot count FLOPs on a copy of a model sharded by "
                f"{type(strategy).__name__}, so `{key}` is not logged.{give}",
                category=RuntimeWarning,
            )
            return None, None

        def step(copied: nn.Module, meta_batch: Any) -> Any:
            with torch.set_grad_enabled(stage == "train"):  # validation and predict run no backward
                return getattr(type(copied), hook)(copied, meta_batch, batch_idx)

        try:
            return count_step_flops(pl_module, batch, step, samples=samples)
        except Exception as err:  # noqa: BLE001 - any failure of the copy only costs the MFU figure
            rank_zero_warn(
                f"ThroughputLatencyMonitor could not count the {hook.replace('_', ' ')}'s FLOPs on a meta-device copy "
                f"of the model ({type(err).__name__}: {err}), so `{key}` is not logged.{give}",
                category=RuntimeWarning,
            )
            return None, None

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        step = self._current
        if self._distributed and self._timer is not None and step is not None and step.batch_start is not None:
            # forward ends here, before the first gradient all-reduce: the rank's own compute time
            step.forward.append((step.batch_start, self._timer.mark()))

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = self._current
        if self._timer is None or step is None:
            return
        ran = self._source.last_step_run() if self._source is not None else None
        self._count_padding(step, batch, ran)
        global_step = trainer.global_step
        stepped = global_step != step.global_step  # else accumulating: the optimizer step is still to come
        if stepped and (step.mask_tokens is not None or step.mask_real is not None):
            # in before the end mark completes; copied only where that mark is a CUDA event that orders the read
            step.counts = _counts(step.mask_tokens, step.mask_real, to_host=isinstance(self._timer.timer, CudaTimer))
        mark = self._prev_end = self._timer.mark()
        self._count_batch_flops(step, ran)
        if ran is not None:  # the batch was a step cut in micro-batches
            step.batches += ran.micro_batches - 1
        if not stepped:
            return
        step.end = mark
        step.excluded = compiled_graphs() != step.compiled  # torch.compile compiled during the step: not a timing
        self._current = None
        self._pending.append(step)
        if global_step != self._last_logged_step and should_log(trainer, self.log_every_n_steps):
            self._last_logged_step = global_step
            self._log(trainer, self._train_metrics(trainer))
        if global_step == self._warmup_end:  # the warm-up ends: its steps, resolved or not, are left out
            for pending in self._pending:
                pending.warmup = True
            self.stats = StepStats(window=self.window, percentiles=self.percentiles)

    def _count_batch_flops(self, step: _Step, ran: StepRun | None) -> None:
        """Add the batch's FLOPs: of the micro-batches DynamicBatchSize ran (trimmed), else of the batch's shape."""
        shape = step.shape
        if self.flop_model is None or shape is None:
            return
        step.shape = None
        hardware = self.hardware_flop_model or self.flop_model
        for samples, length in (ran.shapes if ran is not None else None) or [shape]:
            step.flops += self.flop_model.flops(samples, length)
            step.hardware_flops += hardware.flops(samples, length)

    def _count_padding(self, step: _Step, batch: Any, ran: StepRun | None) -> None:
        """Add the batch's real and padded tokens: as DynamicBatchSize ran them (trimmed), else from the mask."""
        if ran is not None and ran.tokens:
            step.padding[0] += ran.tokens[0]
            step.padding[1] += ran.tokens[1]
            return
        mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
        if isinstance(mask, Tensor) and mask.dim() == 2:
            real = mask.detach().sum()  # on the device: read once the step has run
            step.mask_real = real if step.mask_real is None else step.mask_real + real
            step.padding[1] += mask.numel()

    def _padding_metrics(self) -> dict[str, float]:
        real, padded = self._padding
        self._padding = [0, 0]
        return {keys.PADDING_FRAC: 1.0 - real / padded} if padded else {}

    def _resolve_pending(self, *, wait: bool = False) -> None:
        """Fold the steps whose marks have completed into the figures; the others wait for the next call.

        Without ``wait`` nothing blocks: at most one ``Event.query()`` per pending mark. With it (the end of the fit),
        one wait on the newest mark resolves them all.
        """
        timeline = self._timer
        if timeline is None or not self._pending:
            return
        resolved = timeline.resolve(wait=wait)
        ready = 0
        while ready < len(self._pending) and self._pending[ready].end < resolved:
            ready += 1
        for step in self._pending[:ready]:
            self._fold(step, timeline)
        del self._pending[:ready]
        self._forget()

    def _forget(self) -> None:
        """Drop the times no longer needed: all but those of pending steps, the step recorded and the next gap."""
        if self._timer is None:
            return
        steps = [*self._pending, *([self._current] if self._current is not None else [])]
        oldest = [step.before[0] if step.before is not None else step.start for step in steps]
        if self._prev_end is not None:
            oldest.append(self._prev_end)
        self._timer.forget(min(oldest, default=self._timer.resolved))

    def _fold(self, step: _Step, timeline: Timeline) -> None:
        """Add one resolved step to the figures."""
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
        before = timeline.ms(*step.before) if step.before is not None else 0.0
        within = sum(timeline.ms(a, b) for a, b in step.within)
        if self._distributed and not step.excluded:
            self._own.add(before + within + sum(timeline.ms(a, b) for a, b in step.forward))
        if step.warmup:
            return
        if step.before is not None:
            self.stats.add_between(wait_ms=before)
        if step.excluded:
            return
        self.stats.add_step(
            step_ms=timeline.ms(step.start, step.end),
            samples=step.samples,
            tokens=step.tokens,
            batches=step.batches,
            wait_ms=within,
            flops=step.flops,
            hardware_flops=step.hardware_flops,
        )

    def _train_metrics(self, trainer: pl.Trainer) -> dict[str, float]:
        self._resolve_pending()
        local = self.last_interval = self.stats.interval_metrics()
        metrics = {keys.TRAIN + k: v for k, v in local.items() if not k.endswith("flops_per_sec")}
        metrics.update(self._padding_metrics())
        if trainer.world_size > 1:
            metrics.update(self._gather(trainer, local))
        else:
            metrics.update(self._utilisation(local))
        if self.gpu_stats:
            metrics.update({keys.DEVICE + k: v for k, v in self._device_metrics(trainer).items()})
        return metrics

    def _device_metrics(self, trainer: pl.Trainer) -> dict[str, float]:
        """The allocator's counters (one read); the driver's too when :data:`DRIVER_READ_EVERY_S` has passed."""
        device = trainer.strategy.root_device
        out = allocator_metrics(device)  # nothing off CUDA
        if "vram_peak_gib" in out:  # kept across any reset of torch's peak counters between two reads
            out["vram_peak_gib"] = self._vram_peak = max(self._vram_peak, out["vram_peak_gib"])
        now = time.monotonic()
        if now >= self._driver_due:
            self._driver_due = now + DRIVER_READ_EVERY_S
            out.update(driver_metrics(device))
            out.update(self._sample_nvml())
        return out

    def _sample_nvml(self) -> dict[str, float]:
        if self._nvml is None:
            return {}
        try:
            return self._nvml.sample()
        except Exception as err:  # noqa: BLE001 - e.g. NVMLError_NotSupported on a MIG device: stop asking
            self._nvml, self._nvml_off = None, True
            rank_zero_warn(
                f"NVML could not read GPU utilisation ({type(err).__name__}: {err}); `{keys.GPU_UTIL_PCT}` and "
                f"`{keys.GPU_MEM_BW_PCT}` are not logged from now on.",
                category=RuntimeWarning,
            )
            return {}

    def _utilisation(self, rates: dict[str, float]) -> dict[str, float]:
        """MFU, and HFU when recomputation adds hardware FLOPs, from FLOP rates."""
        if not self._peak or "flops_per_sec" not in rates:
            return {}
        out = {keys.MFU: mfu(rates["flops_per_sec"], self._peak)}
        if self.hardware_flop_model is not None and "hardware_flops_per_sec" in rates:
            out[keys.HFU] = mfu(rates["hardware_flops_per_sec"], self._peak)
        return out

    def _gather(self, trainer: pl.Trainer, local: dict[str, float]) -> dict[str, float]:
        """One collective per logging interval: sum rates over ranks, compare the ranks' own time per step.

        A rank's own time per step is what no collective waits in: waiting for its batches plus its forward passes.
        (The step time itself cannot tell a straggler: the fast ranks wait for it inside the gradient all-reduce.)
        """
        names = ("samples_per_sec", "tokens_per_sec", "batches_per_sec", "flops_per_sec", "hardware_flops_per_sec")
        p50 = self._own.percentiles((50.0,)).get(50.0, 0.0)
        row = torch.tensor([local.get(n, 0.0) for n in names] + [p50], dtype=torch.float64)
        gathered = trainer.strategy.all_gather(row.to(trainer.strategy.root_device)).reshape(-1, len(names) + 1).cpu()
        out: dict[str, float] = {}
        for index, name in enumerate(names[:3]):
            if name in local:
                out[keys.TRAIN + name] = float(gathered[:, index].sum())
        out.update(self._utilisation({n: float(gathered[:, i].mean()) for i, n in enumerate(names) if n in local}))
        medians = [float(v) for v in gathered[:, -1]]
        middle = statistics.median(medians)
        if middle > 0:
            out[keys.STRAGGLER_RATIO] = max(medians) / middle
        return out

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._begin_inference("val", trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_inference("val", trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            # validation time is not training time: the next gap starts now
            self._prev_end = self._timer.mark() if self._timer is not None else None

    # ------------------------------------------------------------------ validation and predict

    def _begin_inference(self, stage: str, trainer: pl.Trainer) -> None:
        if self._timer is None:
            self._setup_device(trainer)
        if trainer.sanity_checking:
            return
        if trainer.state.fn != TrainerFn.FITTING:
            self._peak, self.summary = self.device_peak_flops(trainer), {}
        self._inference[stage] = _Inference()

    def _inference_batch_start(self, stage: str, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        run = self._inference.get(stage)
        if run is None or self._timer is None:
            return
        samples, tokens = self._count(batch)
        if self._peak is not None and stage not in self._inference_flops:
            self._inference_flops[stage] = self._count_flops(pl_module, batch, batch_idx, samples, stage)[0]
        flop_model = self._inference_flops.get(stage)
        run.flops += flop_model.flops(samples, sequence_length(batch)) if flop_model is not None else 0.0
        run.samples += samples
        run.tokens = run.tokens + (tokens.detach() if isinstance(tokens, Tensor) else tokens or 0)
        mark = self._timer.mark()
        run.start = run.start if run.start is not None else mark
        run.marks.append((mark, None))

    def _inference_batch_end(self, stage: str) -> None:
        run = self._inference.get(stage)
        if run is None or self._timer is None or not run.marks:
            return
        start, _ = run.marks[-1]
        run.marks[-1] = (start, self._timer.mark())

    def _end_inference(self, stage: str, trainer: pl.Trainer) -> None:
        run = self._inference.pop(stage, None)
        timeline = self._timer
        if run is None or timeline is None or not run.marks or run.marks[-1][1] is None:
            return
        end = run.marks[-1][1]
        timeline.resolve(wait=True)  # the end of a run: one wait
        durations = [timeline.ms(a, b) for a, b in run.marks if b is not None]
        window = LatencyWindow(self.window)
        window.extend(durations)
        percentiles = window.percentiles(self.percentiles)
        metrics = {keys.BATCH_MS.format(stage=stage, q=f"{p:g}"): v for p, v in percentiles.items()}
        seconds = timeline.ms(run.start, end) / 1000.0 if run.start is not None else 0.0
        self._forget()
        if seconds > 0:
            metrics[keys.STAGE_SAMPLES_PER_SEC.format(stage=stage)] = run.samples / seconds
            if run.tokens:
                metrics[keys.STAGE_TOKENS_PER_SEC.format(stage=stage)] = float(run.tokens) / seconds
            if run.flops and self._peak:
                metrics[keys.STAGE_MFU.format(stage=stage)] = mfu(run.flops / seconds, self._peak)
        if self.latency_budget_ms is not None and durations:
            over = [ms > self.latency_budget_ms for ms in durations]
            recent = over[-self.window :]
            metrics[keys.OVER_BUDGET_FRAC.format(stage=stage)] = sum(recent) / len(recent)
            tally = self._over_budget.setdefault(stage, [0, 0])
            tally[0] += sum(over)
            tally[1] += len(over)
        self._log(trainer, metrics)
        self.summary = {key.rpartition("/")[2]: v for key, v in metrics.items()}
        self.summary.update(batches=float(len(durations)), seconds=seconds)

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._inference_batch_start("val", pl_module, batch, batch_idx)

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._inference_batch_end("val")

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._begin_inference("predict", trainer)

    @override
    def on_predict_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._inference_batch_start("predict", pl_module, batch, batch_idx)

    @override
    def on_predict_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._inference_batch_end("predict")

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_inference("predict", trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """End of ``fit``, ``validate`` or ``predict``: one line per stage on the latency budget, a warning past 5 %."""
        tallies, self._over_budget = self._over_budget, {}
        self._inference_flops = {}  # the next call may run another model
        for name, (over, total) in tallies.items():
            what = "validation" if name == "val" else name
            share = over / total
            rank = " on this rank" if trainer.world_size > 1 else ""
            rank_zero_info(
                f"ThroughputLatencyMonitor: {over} of {total} {what} batches{rank} ({100 * share:.1f} %) took longer "
                f"than the latency budget of {self.latency_budget_ms:g} ms"
            )
            if share > OVER_BUDGET_WARN:
                rank_zero_warn(
                    f"{100 * share:.1f} % of {what} batches{rank} took longer than the latency budget of "
                    f"{self.latency_budget_ms:g} ms (more than {100 * OVER_BUDGET_WARN:g} %). A smaller batch size "
                    f"brings them under it; `lightning-tune bench --p95-budget-ms {self.latency_budget_ms:g}` finds "
                    "the largest that stays within it",
                    category=RuntimeWarning,
                )

    # ------------------------------------------------------------------ output

    @staticmethod
    def _log(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
        if not metrics:
            return
        metrics = {**metrics, "epoch": float(trainer.current_epoch)}  # as on Lightning's own rows
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=lightning_step(trainer))

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._resolve_pending(wait=True)  # the fit's one wait: the steps still pending complete
        self._current = self._prev_end = None  # no gap to time until the next fit
        self._forget()
        totals = self.stats.total
        summary = {**StepStats.rates(totals), **self.stats.latency_metrics()}
        summary.update({key.rpartition("/")[2]: value for key, value in self._utilisation(summary).items()})
        peak = allocator_metrics(trainer.strategy.root_device).get("vram_peak_gib") if self.gpu_stats else None
        if peak is not None:
            summary["vram_peak_gib"] = self._vram_peak = max(self._vram_peak, peak)
        summary.update(steps=float(totals.steps), seconds=totals.wall_ms / 1000.0)
        self.summary = summary
        if totals.steps:
            rank_zero_info(format_summary(summary, self.percentiles, num_workers=_num_workers(trainer)))


def _counts(*counts: Tensor | None, to_host: bool) -> Tensor:
    """Device counts (0-dim tensors, ``None`` for 0) stacked; ``to_host``: copied into pinned memory, no wait.

    The copy may be read only once a CUDA event recorded after this call has completed. Host-clock marks (MPS, XPU, the
    CPU) order nothing, so there the counts stay where they were counted and are read when the step is folded in, at a
    logging step, rather than synchronising every step.
    """
    device = next(t for t in counts if t is not None).device
    stacked = torch.stack([torch.zeros((), dtype=torch.long, device=device) if t is None else t.long() for t in counts])
    return stacked.to("cpu", non_blocking=True) if to_host else stacked


def _num_workers(trainer: pl.Trainer) -> int | None:
    loader = getattr(trainer, "train_dataloader", None)
    return getattr(loader, "num_workers", None)


def format_summary(summary: dict[str, float], percentiles: Sequence[float], *, num_workers: int | None = None) -> str:
    """The end-of-fit table printed by :class:`ThroughputLatencyMonitor`.

    Args:
        summary: Whole-run figures (``samples_per_sec``, ``step_ms_p50``, ...).
        percentiles: The monitor's percentiles.
        num_workers: The training DataLoader's workers, for the data-wait hint.

    Returns:
        The table, with a hint line when the data-wait share is above 10 %.

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
        f"{percentile_suffix(p)} {summary[f'step_ms_{percentile_suffix(p)}']:.1f}"
        for p in percentiles
        if f"step_ms_{percentile_suffix(p)}" in summary
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
