"""``ThroughputLatencyMonitor``: hooks driving a ``perf.recorder.StepRecorder`` and a ``perf.devices.DeviceReader``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial, partialmethod
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
from lightning_tune.callbacks._logging import log, should_log
from lightning_tune.perf.batch import LAST_BATCH, count_samples, count_tokens, sequence_length
from lightning_tune.perf.counting import FlopModel, count_step_flops
from lightning_tune.perf.devices import DeviceReader, NvmlSampler
from lightning_tune.perf.flops import peak_flops
from lightning_tune.perf.recorder import StepRecorder, format_summary
from lightning_tune.perf.stats import StepStats
from lightning_tune.perf.step_run import StepRunSource
from lightning_tune.perf.timing import HostTimer, Timeline, timer_for
from lightning_tune.perf.window import MAX_WINDOW, check_percentiles
from lightning_tune.vocab import precision_dtype

if TYPE_CHECKING:
    import lightning.pytorch as pl

_STEP_HOOKS = {"train": "training_step", "val": "validation_step", "predict": "predict_step"}
# strategies whose module holds parameter shards: the FLOP count's meta copy cannot stand for the model there
_SHARDED_STRATEGIES = (FSDPStrategy, ModelParallelStrategy, DeepSpeedStrategy)


class ThroughputLatencyMonitor(Callback):
    """Measure training throughput, step-time and inference-latency percentiles, memory, utilisation and MFU.

    Args:
        window: Recent steps (and validation or predict batches) the percentiles cover, >= 2.
        log_every_n_steps: Log every this many optimizer steps; ``None`` follows the Trainer's.
        warmup_steps: Optimizer steps of each fit (a resumed one's too) left out of the figures, >= 0.
        percentiles: Percentiles to report, each in (0, 100).
        batch_size_fn: ``fn(batch) -> int``, the samples in a batch; default: counted as ``DynamicBatchSize`` cuts.
        tokens_fn: ``fn(batch) -> int``, its input tokens; default: from token ids and attention masks (padding out).
        flops_per_batch: Model FLOPs of one training micro-batch; default: counted once on a meta-device copy.
        peak_flops: Peak FLOP/s for MFU (then logged on any device); default: a known GPU's dense peak at the precision.
        gpu_stats: Log CUDA memory and NVML utilisation.
        latency_budget_ms: Latency budget of one validation or predict batch, in ms, > 0; past 5 % over it, a warning.

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
        self.percentiles = check_percentiles("percentiles", percentiles)
        for name, fn in (("batch_size_fn", batch_size_fn), ("tokens_fn", tokens_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"`{name}` must be a callable taking a batch, or None, got {fn!r}")
        check_float("flops_per_batch", flops_per_batch, low=0.0, low_inclusive=False, allow_none=True)
        check_float("peak_flops", peak_flops, low=0.0, low_inclusive=False, allow_none=True)
        check_bool("gpu_stats", gpu_stats)
        check_float("latency_budget_ms", latency_budget_ms, low=0.0, low_inclusive=False, allow_none=True)
        self.window, self.log_every_n_steps, self.warmup_steps = window, log_every_n_steps, warmup_steps
        self.batch_size_fn, self.tokens_fn = batch_size_fn, tokens_fn
        self.flops_per_batch, self.peak_flops = flops_per_batch, peak_flops
        self.gpu_stats, self.latency_budget_ms = gpu_stats, latency_budget_ms
        #: Figures of the latest run (fit, validation or predict), keys without their ``perf/<stage>/`` prefix.
        self.summary: dict[str, float] = {}
        #: This rank's figures of the latest logging interval (before summing over ranks).
        self.last_interval: dict[str, float] = {}
        self._recorder = StepRecorder(Timeline(HostTimer()), window=window, percentiles=self.percentiles)  # until a run
        self._inference_flops: dict[str, FlopModel | None] = {}  # per stage, counted once per Trainer call
        self._source: StepRunSource | None = None  # a callback cutting steps into micro-batches (DynamicBatchSize)
        self._devices = DeviceReader(partial(rank_zero_warn, category=RuntimeWarning))
        self._last_logged_step = -1
        self._device: torch.device | None = None  # the device of the recorder's timeline
        self._uncounted: set[str] = set()  # stages whose batches had no samples to count (warned about once)

    @property
    def stats(self) -> StepStats:
        """Training statistics of the latest fit (after ``warmup_steps``)."""
        return self._recorder.stats

    @property
    def flop_model(self) -> FlopModel | None:
        """FLOPs of a training micro-batch by its shape, counted at the fit's first batch (``None`` if not)."""
        return self._recorder.flop_model

    def _setup_device(self, trainer: pl.Trainer) -> None:
        """A recorder on the device's timeline, for a fit or a validate or predict call; NVML, once."""
        device = self._device = trainer.strategy.root_device
        self._recorder = recorder = StepRecorder(
            Timeline(timer_for(device)),
            window=self.window,
            percentiles=self.percentiles,
            distributed=trainer.world_size > 1,
            latency_budget_ms=self.latency_budget_ms,
        )
        recorder.flops_per_batch, recorder.peak = self.flops_per_batch, self.device_peak_flops(trainer)
        reader = self._devices
        if device.type != "cuda" or not self.gpu_stats or reader.nvml is not None or reader.nvml_off:
            return
        reader.nvml_off = True  # until it works: one message, one attempt
        try:
            reader.nvml = NvmlSampler(device)
            reader.nvml_off = False
        except ModuleNotFoundError as err:
            rank_zero_warn(f"{err} Until then `{keys.GPU_UTIL_PCT}` is not logged.", category=RuntimeWarning)
        except Exception as err:  # noqa: BLE001 - NVML present but unusable (e.g. no driver access)
            rank_zero_warn(f"NVML could not be read ({err}); `{keys.GPU_UTIL_PCT}` is not logged.")

    def device_peak_flops(self, trainer: pl.Trainer) -> float | None:
        """Dense peak FLOP/s of ``trainer``'s device at its precision: ``peak_flops``, else the table's, or ``None``."""
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
        if self.gpu_stats:  # the fit's peak, not the process's: DynamicBatchSize's resets keep it
            self._devices.start(trainer.strategy.root_device)
        self.summary, self._last_logged_step = {}, -1
        # the micro-batches DynamicBatchSize runs are trimmed: its figures, not the step batch's, give the padding
        callbacks = trainer.callbacks  # type: ignore[attr-defined]
        self._source = next((cb for cb in callbacks if isinstance(cb, StepRunSource)), None)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._recorder.warmup_end = trainer.global_step + self.warmup_steps  # after a restore: a resumed fit too

    def _count(self, batch: Any, stage: str) -> tuple[int, int | Tensor | None]:
        samples = self.batch_size_fn(batch) if self.batch_size_fn is not None else count_samples(batch)
        tokens = self.tokens_fn(batch) if self.tokens_fn is not None else count_tokens(batch)
        if samples is None and stage not in self._uncounted:  # nothing per-sample found: say so once per stage
            self._uncounted.add(stage)
            rank_zero_warn(
                f"ThroughputLatencyMonitor cannot count the samples of a {stage} batch of type {type(batch).__name__} "
                "(it holds no tensor and no sequence of per-sample objects), so its samples count as 0 in "
                f"`{keys.STAGE_SAMPLES_PER_SEC.format(stage=stage)}`. Pass `batch_size_fn=` (fn(batch) -> samples) "
                "to give the count.",
                category=RuntimeWarning,
            )
        return int(samples or 0), tokens

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._recorder.gap_starts()  # creating the epoch's data iterator counts as waiting for data

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        recorder = self._recorder

        def count_flops() -> None:  # at the fit's first step, on a meta copy: neither training nor waiting
            samples = self._count(batch, "train")[0]
            recorder.flop_model, recorder.hardware_flop_model = self._count_flops(pl_module, batch, batch_idx, samples)

        by_shape = recorder.peak is not None and self.flops_per_batch is None  # FLOPs of each batch's shape
        recorder.start_batch(global_step=trainer.global_step, prepare=count_flops if by_shape else None)

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
        self._recorder.end_forward()  # forward ends before the first gradient all-reduce: the rank's own compute

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # counted at the end, as the step has counted it (DynamicBatchSize): the batch is walked once, and counting
        # is the step's time, as it was Lightning's
        recorder = self._recorder
        samples, tokens = self._count(batch, "train")
        shape = (samples, sequence_length(batch) if recorder.flop_model is not None else None)
        ran = self._source.last_step_run() if self._source is not None else None
        mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
        global_step = trainer.global_step
        if not recorder.end_batch(global_step, shape, tokens, ran, mask):
            return
        if global_step != self._last_logged_step and should_log(trainer, self.log_every_n_steps):
            self._last_logged_step = global_step
            self._log(trainer, self._train_metrics(trainer))
        self._recorder.close_warmup(global_step)

    def _train_metrics(self, trainer: pl.Trainer) -> dict[str, float]:
        strategy = trainer.strategy
        gather = (lambda row: strategy.all_gather(row.to(strategy.root_device))) if trainer.world_size > 1 else None
        self.last_interval, metrics = self._recorder.train_metrics(gather)
        if self.gpu_stats:
            metrics.update({keys.DEVICE + k: v for k, v in self._devices.read().items()})
        return metrics

    def _begin_inference(self, stage: str, trainer: pl.Trainer, *_: Any) -> None:
        if trainer.sanity_checking:
            return
        if trainer.state.fn != TrainerFn.FITTING:  # a validate or predict call: its figures; the last fit's stay
            if trainer.strategy.root_device != self._device:
                self._setup_device(trainer)
            else:  # its Trainer's precision
                self._recorder.peak = self.device_peak_flops(trainer)
            self.summary = {}
        self._recorder.begin_inference(stage)

    def _inference_batch_start(
        self, stage: str, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, *_: Any
    ) -> None:
        if stage not in self._recorder.runs:
            return
        if self._recorder.peak is not None and stage not in self._inference_flops:
            samples = self._count(batch, stage)[0]
            self._inference_flops[stage] = self._count_flops(pl_module, batch, batch_idx, samples, stage)[0]
        self._recorder.start_inference_batch(stage)

    def _inference_batch_end(
        self, stage: str, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, *_: Any
    ) -> None:
        if stage not in self._recorder.runs:
            return
        samples, tokens = self._count(batch, stage)  # at the end, as the training batches
        flop_model = self._inference_flops.get(stage)
        flops = flop_model.flops(samples, sequence_length(batch)) if flop_model is not None else 0.0
        self._recorder.end_inference_batch(stage, samples, tokens, flops)

    def _end_inference(self, stage: str, trainer: pl.Trainer, *_: Any) -> None:
        figures = self._recorder.end_inference(stage)
        if figures is not None:
            self._log(trainer, figures[0])
            self.summary = figures[1]

    # a validation run and a predict run are recorded alike, each under its stage
    on_validation_start = partialmethod(_begin_inference, "val")
    on_validation_batch_start = partialmethod(_inference_batch_start, "val")
    on_validation_batch_end = partialmethod(_inference_batch_end, "val")
    on_predict_start = partialmethod(_begin_inference, "predict")
    on_predict_batch_start = partialmethod(_inference_batch_start, "predict")
    on_predict_batch_end = partialmethod(_inference_batch_end, "predict")
    on_predict_end = partialmethod(_end_inference, "predict")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_inference("val", trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._recorder.gap_starts()  # validation time is not training time: the next gap starts now

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._inference_flops = {}  # the next call may run another model
        LAST_BATCH.clear()  # the last batch counted is let go
        for line, warning in self._recorder.budget_report():
            rank_zero_info(line)
            if warning is not None:
                rank_zero_warn(warning, category=RuntimeWarning)

    @staticmethod
    def _log(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
        if metrics:
            log(trainer, {**metrics, "epoch": float(trainer.current_epoch)})  # as on Lightning's own rows

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.summary = self._recorder.finish(self._devices.peak() if self.gpu_stats else None)  # the fit's one wait
        if self.summary["steps"]:
            workers = getattr(getattr(trainer, "train_dataloader", None), "num_workers", None)
            rank_zero_info(format_summary(self.summary, self.percentiles, num_workers=workers))
