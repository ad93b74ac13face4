"""Run a sweep, each batch size in a fresh Trainer, measured by :class:`~lightning_tune.ThroughputLatencyMonitor`."""

from __future__ import annotations

import contextlib
import gc
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback

from lightning_tune._validation import check_bool, check_instance, check_int
from lightning_tune.bench.progress import SweepProgress
from lightning_tune.bench.result import PERCENTILES, BenchResult
from lightning_tune.bench.settings import BenchSettings
from lightning_tune.bench.target import BenchTarget, load_target
from lightning_tune.callbacks.throughput import ThroughputLatencyMonitor
from lightning_tune.perf.devices import cuda_memory_metrics, describe_device, reset_run_peak
from lightning_tune.perf.window import percentile_suffix
from lightning_tune.plugins.tune import TunePlugin

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


def _figures(summary: dict[str, float], count: str, latency: str) -> dict[str, Any]:
    """A result's figures from the monitor's summary of a fit (``steps``, ``step_ms``) or predict run (``batches``)."""
    return {
        "steps": int(summary[count]),
        "seconds": summary["seconds"],
        "samples_per_sec": summary["samples_per_sec"],
        "tokens_per_sec": summary.get("tokens_per_sec"),
        "mfu": summary.get("mfu"),
        **{f"p{q:g}_ms": summary.get(f"{latency}_{percentile_suffix(q)}") for q in PERCENTILES},
    }


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


class BenchRunner:
    """Runs the settings of a sweep, one fresh Trainer and model per batch size.

    Building it checks all that can be checked before training (``docs/bench.md``); an ``attention="auto"`` that
    falls back to SDPA says so in :attr:`notes`.

    Args:
        settings: The sweep.
        progress: Draw a progress bar per setting on standard error.

    Raises:
        TypeError: If an argument has the wrong type, or the model is not a LightningModule.
        ValueError: If the model cannot be built or fed, or the precision, accelerator or attention backend cannot
            run here.
        ModuleNotFoundError: If an optional package the settings need is missing (the message names the extra).

    Example:
        >>> runner = BenchRunner(BenchSettings(batch_sizes=(2,), sequence_length=8, steps=2, warmup=0,
        ...                                    model_args={"d_model": 16, "n_layers": 1}, accelerator="cpu"),
        ...                      progress=False)
        >>> [(r.batch_size, r.status, r.steps) for r in runner.sweep()]
        [(2, 'ok', 2)]
    """

    def __init__(self, settings: BenchSettings, *, progress: bool = True) -> None:
        check_instance("settings", settings, BenchSettings, "a BenchSettings")
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
            from lightning_tune.swaps.attention import resolve_backend
            from lightning_tune.vocab import precision_dtype

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
        """What the sweep runs on (the ``run`` entry of ``bench.json``), ``precision`` and ``attention`` as resolved."""
        return {
            "model": self.target.describe(),
            "device": describe_device(self.device),
            "precision": self.precision,
            "attention": self.attention,
            "optimizer": self.settings.optimizer,
            "notes": list(self.notes),
        }

    def sweep(self, *, after_each: Callable[[list[BenchResult]], object] | None = None) -> list[BenchResult]:
        """Run every batch size of the settings, in order: one result each.

        Args:
            after_each: Called with the results so far after each setting (e.g. to write them to disk).

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
        """Run one batch size in a fresh Trainer with a fresh model; an ``"oom"`` result if it runs out of memory.

        Args:
            batch_size: The batch size, >= 1.
            label: Text of the progress bar; default ``"batch size <n>"``.

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
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        bar.close("out of memory" if result.status == "oom" else f"{result.samples_per_sec:,.1f} samples/s")
        return result

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
            optimizer=settings.optimizer,
            attention=settings.attention,
            device=self._plugin_device,  # type: ignore[arg-type]
        )

    def _trainer(self, callbacks: list[Callback], *, max_steps: int = -1) -> pl.Trainer:
        return pl.Trainer(
            accelerator=self.settings.accelerator,
            devices=1,
            plugins=[self._plugin()],
            max_steps=max_steps,
            logger=False,
            callbacks=callbacks,
            enable_checkpointing=False,
            enable_model_summary=False,
            enable_progress_bar=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
        )

    def _measure(self, batch_size: int, bar: SweepProgress) -> BenchResult:
        warmup, steps = self.settings.warmup, self.settings.steps
        pl.seed_everything(self.settings.seed, verbose=False)
        model, datamodule = self.target.build(batch_size)
        if self.device.type == "cuda":
            reset_run_peak(self.device)  # each batch size's own peak, DynamicBatchSize's interval resets included
        if self.settings.mode == "train":
            # one log, at the last step: no resolution of the step records in between but the warm-up's end
            monitor = ThroughputLatencyMonitor(
                window=steps, warmup_steps=warmup, log_every_n_steps=warmup + steps, gpu_stats=False
            )
            trainer = self._trainer([monitor, bar], max_steps=warmup + steps)
            trainer.fit(model, datamodule=datamodule)
            if trainer.global_step <= warmup or not monitor.summary.get("samples_per_sec"):
                raise RuntimeError(
                    f"training stopped after {trainer.global_step} steps, with no step measured after the {warmup} "
                    "warm-up steps"
                )
            figures = _figures(monitor.summary, "steps", "step_ms")
        else:
            monitor = ThroughputLatencyMonitor(window=steps, gpu_stats=False)
            trainer = self._trainer([monitor, bar])
            for batches in (warmup, steps):  # the monitor measures each run on its own
                if batches:
                    trainer.limit_predict_batches = batches
                    trainer.predict(model, datamodule=datamodule, return_predictions=False)
            if not monitor.summary.get("samples_per_sec"):
                raise RuntimeError("the predict dataloader yielded no batch with samples")
            figures = _figures(monitor.summary, "batches", "batch_ms")
        if bar.first_samples is not None and bar.first_samples != batch_size:
            warnings.warn(
                f"batch size {batch_size} was asked for but the first batch held {bar.first_samples} samples: does the "
                "dataloader read `batch_size` from the module (or datamodule) each time it is built?",
                UserWarning,
                stacklevel=2,
            )
        vram = cuda_memory_metrics(self.device).get("vram_peak_gib")
        return BenchResult(batch_size=batch_size, status="ok", peak_vram_gib=vram, **figures)
