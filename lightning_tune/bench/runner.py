"""Run a sweep: each batch size in a fresh Trainer with :class:`~lightning_tune.ThroughputLatencyMonitor`.

Train mode fits ``warmup + steps`` optimizer steps. The monitor logs once at the end of the warm-up, which resolves
the warm-up's step records; a small callback copies the monitor's running totals there, and the figures are the
totals at the end minus that copy. The percentile window holds exactly the last ``steps`` steps.

Predict mode runs ``Trainer.predict`` twice in the same Trainer: ``warmup`` batches, then ``steps`` batches. The
monitor measures each predict run on its own and writes the figures to the Trainer's loggers; the runner gives it
an in-memory logger and keeps the second run's figures.

A setting that raises ``torch.OutOfMemoryError`` becomes an ``"oom"`` result, its memory is freed and the sweep goes
on; any other error stops the sweep as :class:`SettingFailed`.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import platform
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import fields
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from typing_extensions import override

from lightning_tune._validation import check_bool, check_int
from lightning_tune.bench.progress import SweepProgress
from lightning_tune.bench.result import BenchResult
from lightning_tune.bench.settings import BenchSettings
from lightning_tune.bench.target import BenchTarget, load_target
from lightning_tune.callbacks.throughput import ThroughputLatencyMonitor
from lightning_tune.perf.batch import count_samples, count_tokens
from lightning_tune.perf.devices import cuda_memory_metrics, reset_run_peak
from lightning_tune.perf.flops import FlopCounter, mfu
from lightning_tune.perf.stats import StepStats, Totals
from lightning_tune.plugins.tune import TunePlugin

__all__ = ["BenchRunner", "SettingFailed", "describe_device"]

# Lightning announces the accelerators at every Trainer and the monitor prints a summary at every fit end: a
# sweep builds one Trainer per batch size and prints its own table instead.
_QUIET_LOGGERS = ("lightning.pytorch", "lightning.fabric")


class SettingFailed(RuntimeError):
    """A setting of the sweep failed with an error other than running out of memory.

    Args:
        batch_size: The batch size that failed.
        error: The error.
    """

    def __init__(self, batch_size: int, error: BaseException) -> None:
        first = str(error).strip().splitlines()
        super().__init__(f"batch size {batch_size} failed: {type(error).__name__}: {first[0] if first else ''}".strip())
        self.batch_size = batch_size
        self.error = error


def describe_device(device: torch.device) -> str:
    """Name a device for the results: ``"cuda:0 (NVIDIA H100 80GB HBM3)"``, ``"cpu (<CPU model>)"``.

    Args:
        device: The device.

    Returns:
        The description.
    """
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    if device.type == "cpu":
        threads = torch.get_num_threads()
        return f"cpu ({_cpu_model()}, {threads} thread{'s' if threads != 1 else ''})"
    return str(device)


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as handle:
        for line in handle:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown model"


class _MemoryLogger(Logger):
    """Keeps the latest value of every metric written to it (the monitor writes predict figures to loggers)."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: dict[str, float] = {}

    @property
    @override
    def name(self) -> str:
        return "bench"

    @property
    @override
    def version(self) -> int:
        return 0

    @override
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self.metrics.update(metrics)

    @override
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class _FirstBatch(Callback):
    """Remembers the samples of the first batch, to catch a module whose dataloader ignores ``batch_size``."""

    def __init__(self) -> None:
        self.first_samples: int | None = None

    def _see(self, batch: Any) -> None:
        if self.first_samples is None:
            self.first_samples = count_samples(batch)


class _WarmupMark(_FirstBatch):
    """Copies the monitor's running totals when the warm-up's last step ends (the monitor has just logged)."""

    def __init__(self, monitor: ThroughputLatencyMonitor, warmup: int) -> None:
        super().__init__()
        self.monitor = monitor
        self.warmup = warmup
        self.totals: Totals | None = Totals() if warmup == 0 else None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._see(batch)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.totals is None and trainer.global_step == self.warmup:
            total = self.monitor.stats.total
            self.totals = Totals(**{f.name: getattr(total, f.name) for f in fields(Totals)})


class _PredictCounter(_FirstBatch):
    """Counts the samples, tokens and batches of a predict run; optionally the FLOPs of its first batch."""

    def __init__(self) -> None:
        super().__init__()
        self.count_flops = False
        self.flops_per_sample: float | None = None
        self._counter: FlopCounter | None = None
        self.reset()

    def reset(self) -> None:
        """Start counting a new predict run (FLOPs per sample are kept)."""
        self.batches = 0
        self.samples = 0
        self.tokens: int | torch.Tensor = 0

    @override
    def on_predict_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._see(batch)
        samples = count_samples(batch) or 0
        tokens = count_tokens(batch)
        self.batches += 1
        self.samples += samples
        if tokens is not None:
            self.tokens = self.tokens + tokens
        if self.count_flops and self.flops_per_sample is None and self._counter is None and samples:
            self._counter = FlopCounter()
            self._counter.start()

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
        if self._counter is not None:
            samples = count_samples(batch) or 1
            self.flops_per_sample = self._counter.stop() / samples
            self._counter = None

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._counter is not None:
            self._counter.stop()
            self._counter = None


def _minus(total: Totals, before: Totals) -> Totals:
    return Totals(**{f.name: getattr(total, f.name) - getattr(before, f.name) for f in fields(Totals)})


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


class BenchRunner:
    """Runs the settings of a sweep, one fresh Trainer and model per batch size.

    Building the runner checks everything that can be checked before training: the model and datamodule import
    and build, the batch size can be set, the precision, optimizer and attention backend can run on the device
    (an explicit ``attention="flash"`` where flash-attn cannot run is an error; ``"auto"`` falls back to SDPA and
    says so in :attr:`notes`).

    Args:
        settings: The sweep.
        progress: Draw a progress bar per setting on standard error.

    Raises:
        TypeError: If an argument has the wrong type, or the model is not a LightningModule.
        ValueError: If the model cannot be built or fed, or the precision, accelerator or attention backend cannot
            run here.
        ModuleNotFoundError: If an optional package the settings need is missing (the message names the extra).

    Example:
        >>> runner = BenchRunner(BenchSettings(batch_sizes=(2,), seq_len=8, steps=2, warmup=0,
        ...                                    model_args={"d_model": 16, "n_layers": 1}, accelerator="cpu"),
        ...                      progress=False)
        >>> [(r.batch_size, r.status, r.steps) for r in runner.sweep()]
        [(2, 'ok', 2)]
    """

    def __init__(self, settings: BenchSettings, *, progress: bool = True) -> None:
        if not isinstance(settings, BenchSettings):
            raise TypeError(f"`settings` must be a BenchSettings, got {settings!r} ({type(settings).__name__})")
        check_bool("progress", progress)
        self.settings = settings
        self.progress = progress
        #: Messages about choices made for the settings (e.g. the attention fallback of ``"auto"``).
        self.notes: list[str] = []
        self._quiet_depth = 0
        self._plugin_device: str | None = None
        self.target: BenchTarget = load_target(settings)
        with self._quiet():
            try:
                trainer = self._trainer(callbacks=[], max_steps=1)
            except MisconfigurationException as err:
                raise ValueError(f"`accelerator` {settings.accelerator!r}: {_first_line(err)}") from err
        #: The device every setting runs on.
        self.device: torch.device = trainer.strategy.root_device
        if self.device.type in ("cuda", "cpu"):
            self._plugin_device = self.device.type
            self._plugin()  # told the device, the plugin refuses what cannot run there (16-mixed on a CPU) now
        #: The Lightning precision the settings run in (``"auto"`` resolved).
        self.precision: str = str(trainer.precision)
        #: The attention backend that runs (``"auto"`` resolved), or ``None`` when attention is left alone.
        self.attention: str | None = None
        if settings.attention is not None:
            from lightning_tune.swaps.attention import precision_dtype, resolve_backend

            try:
                self.attention = resolve_backend(
                    settings.attention,
                    device=self.device,
                    dtype=precision_dtype(self.precision),
                    notify=self.notes.append,
                )
            except ModuleNotFoundError as err:
                raise ModuleNotFoundError(f"`attention` {settings.attention!r}: {err}", name=err.name) from err
            except ValueError as err:
                raise ValueError(f"`attention` {settings.attention!r} on {self.device}: {err}") from err

    def describe(self) -> dict[str, Any]:
        """What the sweep runs on, for the results file.

        Returns:
            ``model`` (a description), ``device``, ``precision`` and ``attention`` (as resolved), ``optimizer`` and
            ``notes``.
        """
        return {
            "model": self.target.describe(),
            "device": describe_device(self.device),
            "precision": self.precision,
            "attention": self.attention,
            "optimizer": self.settings.optimizer,
            "notes": list(self.notes),
        }

    # ------------------------------------------------------------------ the sweep

    def sweep(self, *, after_each: Callable[[list[BenchResult]], None] | None = None) -> list[BenchResult]:
        """Run every batch size of the settings, in order.

        Args:
            after_each: Called with the results so far after each setting (e.g. to write them to disk).

        Returns:
            One result per batch size.

        Raises:
            SettingFailed: If a setting fails with an error other than running out of memory; the results before
                it have been passed to ``after_each``.
        """
        results: list[BenchResult] = []
        sizes = self.settings.batch_sizes
        with self._quiet():
            for index, batch_size in enumerate(sizes, start=1):
                results.append(self.run(batch_size, label=f"batch size {batch_size} ({index}/{len(sizes)})"))
                if after_each is not None:
                    after_each(list(results))
        return results

    def run(self, batch_size: int, *, label: str | None = None) -> BenchResult:
        """Run one batch size in a fresh Trainer with a fresh model.

        Args:
            batch_size: The batch size, >= 1.
            label: Text of the progress bar; default ``"batch size <n>"``.

        Returns:
            The figures, or an ``"oom"`` result if the setting ran out of memory.

        Raises:
            SettingFailed: If the setting fails with an error other than running out of memory.
        """
        check_int("batch_size", batch_size, minimum=1)
        settings = self.settings
        bar = SweepProgress(
            label or f"batch size {batch_size}", warmup=settings.warmup, steps=settings.steps, enabled=self.progress
        )
        try:
            with self._quiet():
                result = self._measure(batch_size, bar)
        except torch.OutOfMemoryError as err:
            result = BenchResult(batch_size=batch_size, status="oom", message=_first_line(err))
        except Exception as err:
            bar.close("failed")
            raise SettingFailed(batch_size, err) from err
        finally:
            _free_memory(self.device)
        if result.status == "oom":
            bar.close("out of memory")
        else:
            bar.close(f"{result.samples_per_sec:,.1f} samples/s")
        return result

    # ------------------------------------------------------------------ one setting

    @contextlib.contextmanager
    def _quiet(self) -> Iterator[None]:
        """Lightning's per-Trainer banners off; entered once per sweep, so a warning still shows once, not per run."""
        if self._quiet_depth:
            yield
            return
        loggers = [logging.getLogger(name) for name in _QUIET_LOGGERS]
        levels = [logger.level for logger in loggers]
        for logger in loggers:
            logger.setLevel(logging.WARNING)
        self._quiet_depth += 1
        try:
            with warnings.catch_warnings():
                if self.target.is_demo:  # its data is generated in memory: worker processes would only cost
                    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
                yield
        finally:
            self._quiet_depth -= 1
            for logger, level in zip(loggers, levels, strict=True):
                logger.setLevel(level)

    def _plugin(self) -> TunePlugin:
        settings = self.settings
        return TunePlugin(
            settings.precision,
            optimizer=settings.optimizer,  # type: ignore[arg-type]
            attention=settings.attention,
            device=self._plugin_device,  # type: ignore[arg-type]
        )

    def _trainer(self, callbacks: list[Callback], *, max_steps: int = -1, logger: Logger | None = None) -> pl.Trainer:
        settings = self.settings
        plugin = self._plugin()
        return pl.Trainer(
            accelerator=settings.accelerator,
            devices=1,
            plugins=[plugin],
            max_steps=max_steps,
            logger=logger if logger is not None else False,
            callbacks=callbacks,
            enable_checkpointing=False,
            enable_model_summary=False,
            enable_progress_bar=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
        )

    def _measure(self, batch_size: int, bar: SweepProgress) -> BenchResult:
        pl.seed_everything(self.settings.seed, verbose=False)
        model, datamodule = self.target.build(batch_size)
        if self.device.type == "cuda":
            reset_run_peak(self.device)  # each batch size's own peak, DynamicBatchSize's interval resets included
        if self.settings.mode == "train":
            figures, first = self._train(model, datamodule, bar)
        else:
            figures, first = self._predict(model, datamodule, bar)
        if first is not None and first != batch_size:
            warnings.warn(
                f"batch size {batch_size} was asked for but the first batch held {first} samples: does the "
                "dataloader read `batch_size` from the module (or datamodule) each time it is built?",
                UserWarning,
                stacklevel=2,
            )
        vram = cuda_memory_metrics(self.device).get("vram_peak_gib")
        return BenchResult(batch_size=batch_size, status="ok", peak_vram_gib=vram, **figures)

    def _train(
        self, model: pl.LightningModule, datamodule: pl.LightningDataModule | None, bar: SweepProgress
    ) -> tuple[dict[str, Any], int | None]:
        warmup, steps = self.settings.warmup, self.settings.steps
        # logging exactly at the end of the warm-up resolves the warm-up's records before the mark copies them
        monitor = ThroughputLatencyMonitor(window=steps, log_every_n_steps=warmup or None, gpu_stats=False)
        mark = _WarmupMark(monitor, warmup)
        trainer = self._trainer([monitor, mark, bar], max_steps=warmup + steps)
        trainer.fit(model, datamodule=datamodule)
        if mark.totals is None:
            raise RuntimeError(f"training stopped after {trainer.global_step} steps, within the {warmup} warm-up steps")
        measured = _minus(monitor.stats.total, mark.totals)
        rates = StepStats.rates(measured)
        if not measured.steps or "samples_per_sec" not in rates:
            raise RuntimeError(f"training stopped after {trainer.global_step} steps, with no measured step")
        figures: dict[str, Any] = {
            "steps": measured.steps,
            "seconds": measured.wall_ms / 1000.0,
            "samples_per_sec": rates["samples_per_sec"],
            "tokens_per_sec": rates.get("tokens_per_sec"),
            **self._percentiles(monitor.summary, "step_ms"),
        }
        if "flops_per_sec" in rates:  # counted only where the device's peak is known
            peak = monitor.device_peak_flops(trainer)
            figures["mfu"] = mfu(rates["flops_per_sec"], peak) if peak else None
        return figures, mark.first_samples

    def _predict(
        self, model: pl.LightningModule, datamodule: pl.LightningDataModule | None, bar: SweepProgress
    ) -> tuple[dict[str, Any], int | None]:
        warmup, steps = self.settings.warmup, self.settings.steps
        monitor = ThroughputLatencyMonitor(window=steps, gpu_stats=False)
        counter = _PredictCounter()
        logger = _MemoryLogger()
        trainer = self._trainer([monitor, counter, bar], logger=logger)
        peak = monitor.device_peak_flops(trainer)
        if warmup:
            counter.count_flops = peak is not None  # on the first warm-up batch, where its cost does not count
            trainer.limit_predict_batches = warmup
            trainer.predict(model, datamodule=datamodule, return_predictions=False)
            counter.reset()
            logger.metrics.clear()
        trainer.limit_predict_batches = steps
        trainer.predict(model, datamodule=datamodule, return_predictions=False)
        rate = logger.metrics.get("perf/predict/samples_per_sec")
        if not counter.batches or not rate:
            raise RuntimeError("the predict dataloader yielded no batch with samples")
        tokens = int(counter.tokens)
        figures: dict[str, Any] = {
            "steps": counter.batches,
            "seconds": counter.samples / rate,
            "samples_per_sec": rate,
            "tokens_per_sec": rate * tokens / counter.samples if tokens else None,
            **self._percentiles({k.removeprefix("perf/predict/"): v for k, v in logger.metrics.items()}, "batch_ms"),
        }
        if peak is not None and counter.flops_per_sample is not None:
            figures["mfu"] = mfu(counter.flops_per_sample * rate, peak)
        return figures, counter.first_samples

    @staticmethod
    def _percentiles(metrics: Mapping[str, float], prefix: str) -> dict[str, float | None]:
        return {f"p{q}_ms": metrics.get(f"{prefix}_p{q}") for q in (50, 95, 99)}
