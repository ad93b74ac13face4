"""DynamicBatchSize: grow and shrink the micro-batch during training to hold a memory target, through OOMs.

How it works (details in ``docs/dynamic_batch.md``):

- At the start of training the train DataLoader's ``BatchSampler`` is replaced by a
  :class:`~lightning_tune.batch.ResizableBatchSampler` over the same sampler, so the loader hands out whole
  optimizer steps ("windows"); the Trainer's ``accumulate_grad_batches`` becomes 1 while the callback runs.
- Each window is cut into micro-batches of :attr:`DynamicBatchSize.batch_size` samples; every micro-batch but the
  last is run forward and backward by the callback, the last is left to Lightning. Each micro-batch's loss is
  weighted by its share of the step's samples, so gradients are those of the whole window.
- Every ``adjust_every`` optimizer steps the peak memory of the interval goes to a
  :class:`~lightning_tune.batch.BatchSizeController`, which picks the next micro-batch size.
- An out-of-memory error in forward or backward drops the window's gradients, frees memory, shrinks the micro-batch
  and runs the same window again in smaller pieces; no sample is lost or trained twice.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, get_args

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback
from torch import Tensor
from torch.utils.data import BatchSampler, DataLoader, IterableDataset
from typing_extensions import override

from lightning_tune._validation import check_bool, check_choice, check_float, check_int
from lightning_tune.batch.control import BatchSizeController, Decision
from lightning_tune.batch.memory import MemoryModel
from lightning_tune.batch.probes import CudaMemory, MemoryProbe
from lightning_tune.batch.sampler import ResizableBatchSampler
from lightning_tune.batch.split import split_sizes
from lightning_tune.lr.scaling import SCALE_RULES, ScaleRule, scale_lr
from lightning_tune.perf.batch import count_samples

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["KEEPS", "DynamicBatchSize", "Keep"]

Keep = Literal["effective", "lr", "none"]
#: What ``keep`` accepts.
KEEPS: tuple[str, ...] = get_args(Keep)

_OOM = (torch.OutOfMemoryError,)


class _Piece(NamedTuple):
    """A micro-batch of a window: the batch itself, its sample count and its weight in the optimizer step."""

    batch: Any
    samples: int
    weight: float


class DynamicBatchSize(Callback):
    r"""Adjust the micro-batch size while training runs to keep peak device memory at ``target_vram``.

    Args:
        target_vram: Fraction of the device's memory to fill, in (0, 1].
        min_batch_size: Smallest micro-batch it may use.
        max_batch_size: Largest micro-batch it may use (``None``: as large as memory and ``keep`` allow).
        adjust_every: Optimizer steps between decisions.
        keep: ``"effective"`` holds the effective batch (DataLoader batch size × ``accumulate_grad_batches``, as
            configured): only the split into micro-batches changes, so training is mathematically unchanged.
            ``"lr"`` lets the effective batch follow the micro-batch (× the configured accumulation) and rescales
            the learning rate with ``lr_rule``. ``"none"`` changes only the batch.
        lr_rule: ``"sqrt"`` or ``"linear"``, as :func:`~lightning_tune.scale_lr` (used with ``keep="lr"``).
        multiple_of: Micro-batch sizes at or above this are multiples of it.
        probe: Where memory is read: ``None`` for :class:`~lightning_tune.batch.CudaMemory` on a CUDA device, or a
            :class:`~lightning_tune.SimulatedMemory` to try the callback without one.
        prior: A memory estimate with ``fixed_bytes`` and ``bytes_per_sample`` (such as
            :func:`lightning_tune.plan.estimate_memory`'s) that starts the memory model, so the first decision
            need not probe.
        min_change: Smallest relative growth worth a change.
        sync_oom: Under DDP, agree on out-of-memory errors across ranks every step (one four-byte all-reduce and
            one extra pass over the parameters per step). Without it an OOM on one rank cannot be recovered.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range, or ``min_batch_size > max_batch_size``.

    Example:
        >>> from lightning_tune import DynamicBatchSize, SimulatedMemory
        >>> DynamicBatchSize(target_vram=0.9, min_batch_size=8, max_batch_size=64, adjust_every=100)
        DynamicBatchSize(target_vram=0.9, min_batch_size=8, max_batch_size=64, adjust_every=100, keep='effective')
    """

    def __init__(
        self,
        target_vram: float = 0.9,
        min_batch_size: int = 1,
        max_batch_size: int | None = None,
        adjust_every: int = 100,
        keep: Keep = "effective",
        lr_rule: ScaleRule = "sqrt",
        multiple_of: int = 8,
        probe: MemoryProbe | None = None,
        *,
        prior: Any = None,
        min_change: float = 0.1,
        sync_oom: bool = True,
    ) -> None:
        check_float("target_vram", target_vram, low=0.0, high=1.0, low_inclusive=False)
        check_int("min_batch_size", min_batch_size, minimum=1)
        check_int("max_batch_size", max_batch_size, minimum=1, allow_none=True)
        check_int("adjust_every", adjust_every, minimum=1)
        check_choice("keep", keep, KEEPS)
        check_choice("lr_rule", lr_rule, SCALE_RULES)
        check_int("multiple_of", multiple_of, minimum=1)
        check_float("min_change", min_change, low=0.0)
        check_bool("sync_oom", sync_oom)
        if max_batch_size is not None and min_batch_size > max_batch_size:
            raise ValueError(f"`min_batch_size` ({min_batch_size}) must not exceed `max_batch_size` ({max_batch_size})")
        if probe is not None and not isinstance(probe, MemoryProbe):
            raise TypeError(
                "`probe` must be a memory probe (CudaMemory, SimulatedMemory or an object with total_bytes, "
                f"reset_peak, peak_bytes, pressure, before_micro_batch and free), got {type(probe).__name__}"
            )
        prior_fixed = prior_per_sample = None
        if prior is not None:
            prior_fixed, prior_per_sample = (
                getattr(prior, "fixed_bytes", None),
                getattr(prior, "bytes_per_sample", None),
            )
            if not isinstance(prior_fixed, int) or not isinstance(prior_per_sample, int) or prior_per_sample < 1:
                raise TypeError(
                    "`prior` must have integer `fixed_bytes` and `bytes_per_sample` (>= 1) attributes, such as "
                    f"lightning_tune.plan.estimate_memory's result, got {prior!r}"
                )
        self.target_vram = target_vram
        self.min_batch_size = min_batch_size
        self.max_batch_size = max_batch_size
        self.adjust_every = adjust_every
        self.keep: Keep = keep
        self.lr_rule: ScaleRule = lr_rule
        self.multiple_of = multiple_of
        self.sync_oom = sync_oom
        self.probe: MemoryProbe | None = probe
        self.controller = BatchSizeController(
            target=target_vram,
            min_batch_size=min_batch_size,
            max_batch_size=max_batch_size,
            multiple_of=multiple_of,
            min_change=min_change,
            model=MemoryModel(prior_fixed_bytes=prior_fixed, prior_bytes_per_sample=prior_per_sample),
        )
        #: Micro-batch size in use (``None`` before training starts).
        self.batch_size: int | None = None
        #: Out-of-memory errors recovered from so far.
        self.oom_recoveries = 0
        #: The last decision taken.
        self.last_decision: Decision | None = None
        self._active = False
        self._sampler: ResizableBatchSampler | None = None
        self._loader: DataLoader | None = None
        self._user_batch_size = 0  # the DataLoader's own batch size
        self._user_accumulation = 1  # the Trainer's accumulate_grad_batches as configured
        self._lr_factor = 1.0
        self._steps = 0  # optimizer steps in the current decision interval
        self._consumed = 0  # samples of the running epoch trained on
        self._batches_done = 0  # windows of the running epoch trained on
        self._restore: dict[str, Any] | None = None  # state from a checkpoint, applied at train start
        self._originals: dict[str, Callable[..., Any]] = {}
        self._trainer: pl.Trainer | None = None
        self._window: tuple[Any, int, tuple[Any, ...], dict[str, Any]] | None = None
        self._returned_loss: Tensor | None = None
        self._owns_zero_grad = False
        self._manual = False
        self._largest_run = 0  # largest micro-batch run in the current decision interval
        self._window_samples = 0  # samples in the running window
        self._train_peak = 0  # training's peak before a validation run in the current interval
        self._train_pressure = False
        self._original_batch_sampler: BatchSampler | None = None
        self._installed_epoch = -1
        self._ddp = False

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(target_vram={self.target_vram}, min_batch_size={self.min_batch_size}, "
            f"max_batch_size={self.max_batch_size}, adjust_every={self.adjust_every}, keep={self.keep!r})"
        )

    @property
    def effective_batch_size(self) -> int | None:
        """Samples per optimizer step: held constant with ``keep="effective"``."""
        return None if self.batch_size is None else self._window_size()

    @property
    def accumulate_grad_batches(self) -> int | None:
        """Micro-batches per optimizer step."""
        if self.batch_size is None or self.effective_batch_size is None:
            return None
        return math.ceil(self.effective_batch_size / self.batch_size)

    # -- setup -------------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._trainer = trainer
        if self.probe is None:
            if trainer.strategy.root_device.type != "cuda":
                warnings.warn(
                    f"DynamicBatchSize: training runs on {trainer.strategy.root_device.type!r}, which has no device "
                    "memory to target, so the batch size is left alone. To try the callback without a GPU, give it "
                    "probe=SimulatedMemory(...).",
                    stacklevel=2,
                )
                return
            self.probe = CudaMemory(trainer.strategy.root_device)
        if not pl_module.automatic_optimization:
            raise MisconfigurationException(
                "DynamicBatchSize needs automatic optimization: with manual optimization the module runs its own "
                "backward and steps, so micro-batches cannot be split or retried for it"
            )
        if getattr(trainer.strategy, "handles_gradient_accumulation", False):
            raise MisconfigurationException(
                f"DynamicBatchSize cannot drive {type(trainer.strategy).__name__}, which accumulates gradients "
                "itself (DeepSpeed); use DDP or FSDP"
            )
        from lightning.pytorch.callbacks import GradientAccumulationScheduler

        if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):  # type: ignore[attr-defined]
            raise MisconfigurationException(
                "DynamicBatchSize sets gradient accumulation itself: remove GradientAccumulationScheduler and give "
                "the effective batch through the DataLoader's batch size and Trainer(accumulate_grad_batches=...)"
            )
        from lightning.pytorch.strategies import DDPStrategy

        self._ddp = isinstance(trainer.strategy, DDPStrategy)
        if trainer.world_size > 1 and not self._ddp:
            warnings.warn(
                f"DynamicBatchSize: under {type(trainer.strategy).__name__} every rank takes the same batch-size "
                "decisions, but an out-of-memory error can only be recovered when every rank hits it: the agreement "
                "that lets one rank's OOM make all of them retry (`sync_oom`) is made for DDP",
                stacklevel=2,
            )
        self._patch_module(pl_module)
        self._active = True

    def _patch_module(self, pl_module: pl.LightningModule) -> None:
        """Wrap the module instance's ``training_step``, ``backward`` and ``optimizer_zero_grad`` (not its class)."""
        for name, wrapper in (
            ("training_step", self._training_step),
            ("backward", self._backward),
            ("optimizer_zero_grad", self._optimizer_zero_grad),
        ):
            self._originals[name] = getattr(pl_module, name)
            setattr(pl_module, name, wrapper)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        for name in self._originals:
            with contextlib.suppress(AttributeError):
                delattr(pl_module, name)  # back to the class's method
        self._originals.clear()
        if self._active:
            trainer.accumulate_grad_batches = self._user_accumulation
        if self._loader is not None and self._original_batch_sampler is not None:
            # a DataLoader the module or DataModule keeps must come back as it was given
            _set_batch_sampler(self._loader, self._original_batch_sampler)
        self._loader = self._sampler = self._original_batch_sampler = None
        self._active = False
        self._window = None
        self._returned_loss = None

    # -- the DataLoader ----------------------------------------------------------------------------------------------
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active:
            return
        self._user_accumulation = int(trainer.accumulate_grad_batches)
        self._lr_factor = 1.0  # a new fit starts from the optimizer's configured LR (a checkpoint may say otherwise)
        self._install(trainer)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active:
            return
        loader = _train_loader(trainer)
        self._consumed = self._batches_done = 0  # not called when a run resumes mid-epoch
        if loader is not self._loader or loader.batch_sampler is not self._sampler:  # reloaded by the Trainer
            self._install(trainer)
        elif self._sampler is not None and trainer.current_epoch != self._installed_epoch:
            # the epoch's iterator comes after this hook: the sampler's order is the last epoch's (with workers, the
            # iterator of the epoch the sampler was installed in has drawn its order already)
            self._sampler.new_epoch()
            self._update_epoch_length(trainer)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active and trainer.training and self.probe is not None:
            self._train_peak = max(self._train_peak, self.probe.peak_bytes())
            self._train_pressure = self._train_pressure or self.probe.pressure()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active and trainer.training and self.probe is not None:  # validation's memory is not training's
            self.probe.free()
            self.probe.reset_peak()

    def _install(self, trainer: pl.Trainer) -> None:
        loader = _train_loader(trainer)
        original = loader.batch_sampler
        if isinstance(original, ResizableBatchSampler):  # left by a run that could not put the original back
            inner: Any = original.sampler
            original_size = original.granule
            drop_last = original.drop_last
        else:
            if isinstance(loader.dataset, IterableDataset):
                raise MisconfigurationException(
                    "DynamicBatchSize needs a map-style dataset (with __getitem__ and __len__) in the train "
                    f"DataLoader, got the iterable dataset {type(loader.dataset).__name__}; batch an iterable "
                    "dataset yourself or wrap it in a map-style one"
                )
            if original is not None and type(original) is not BatchSampler:
                raise MisconfigurationException(
                    f"DynamicBatchSize replaces the train DataLoader's BatchSampler, but it has a custom "
                    f"{type(original).__name__}; give the DataLoader a `sampler` and a `batch_size` instead of a "
                    "`batch_sampler` (a custom sampler is kept)"
                )
            if original is None or original.batch_size is None:
                raise MisconfigurationException(
                    "DynamicBatchSize needs a train DataLoader built with a `batch_size`; this one has batch_size=None "
                    "(the dataset returns whole batches), so there is no batch size to control"
                )
            inner = loader.sampler
            original_size = int(original.batch_size)
            drop_last = bool(original.drop_last)
            self._original_batch_sampler = original
        self._user_batch_size = original_size
        if self.batch_size is None:
            start = original_size if self.controller.model.prior is None else None
            if start is None:  # start from the prior's prediction
                budget = self.target_vram * self.probe.total_bytes()  # type: ignore[union-attr]
                start = self.controller.round_down(self.controller.model.largest_batch(budget) or 1, self._cap())
            self.batch_size = max(self.min_batch_size, min(start, self._cap() or start, self.max_batch_size or start))
        # Lightning limited the epoch in batches of the DataLoader's own size; the sampler limits it in samples
        limited = trainer.fit_loop.max_batches
        limit = None if trainer.limit_train_batches == 1.0 or limited == float("inf") else int(limited) * original_size
        sampler = ResizableBatchSampler(
            inner, self._window_size(), drop_last=drop_last, granule=original_size, limit=limit
        )
        if self._restore is not None:
            self._apply_restore(trainer, sampler)
        if hasattr(inner, "set_epoch"):  # workers draw the order at once; Lightning sets the epoch only later
            inner.set_epoch(trainer.current_epoch)
        _set_batch_sampler(loader, sampler)
        self._loader, self._sampler = loader, sampler
        self._installed_epoch = trainer.current_epoch
        trainer.accumulate_grad_batches = 1
        self._update_epoch_length(trainer)  # the new iterator's limits
        _restart_train_iterator(trainer)
        self._update_epoch_length(trainer)  # the length the fetcher took from the old loader
        if self.probe is not None:
            self.probe.reset_peak()

    @property
    def _configured_effective(self) -> int:
        """The effective batch as configured: the DataLoader's batch size times the Trainer's accumulation."""
        return self._user_batch_size * self._user_accumulation

    def _cap(self) -> int | None:
        return self._configured_effective if self.keep == "effective" else None

    def _window_size(self) -> int:
        assert self.batch_size is not None
        return self._configured_effective if self.keep == "effective" else self.batch_size * self._user_accumulation

    def _update_epoch_length(self, trainer: pl.Trainer) -> None:
        assert self._sampler is not None
        batches = len(self._sampler)
        _set_epoch_batches(trainer, batches)
        interval = trainer.val_check_interval
        if getattr(trainer, "_val_check_time_interval", None) is not None:
            return
        if isinstance(interval, int) and self.keep == "effective":  # counted in the DataLoader's own batches
            trainer.val_check_batch = max(1, interval // self._user_accumulation)
        elif isinstance(interval, float):
            trainer.val_check_batch = max(1, int(batches * interval))

    # -- per batch ---------------------------------------------------------------------------------------------------
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._active or self.keep != "lr":
            return
        n = count_samples(batch)
        if n is not None:
            self._set_lr_factor(trainer, scale_lr(1.0, self._configured_effective, n, self.lr_rule))

    def _set_lr_factor(self, trainer: pl.Trainer, factor: float) -> None:
        """Multiply every group's learning rate (and the schedulers' base LRs) by ``factor / previous factor``."""
        ratio = factor / self._lr_factor
        if ratio == 1.0:
            return
        self._lr_factor = factor
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                for key in ("lr", "initial_lr", "max_lr", "min_lr"):
                    value = group.get(key)
                    if isinstance(value, Tensor):
                        value.mul_(ratio)
                    elif isinstance(value, (int, float)) and not isinstance(value, bool):
                        group[key] = value * ratio
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            base = getattr(scheduler, "base_lrs", None)
            if isinstance(base, list):
                scheduler.base_lrs = [b * ratio for b in base]
            if hasattr(scheduler, "scale_group"):  # lightning_tune's ScheduleLR keeps per-group scales
                for i in range(len(scheduler.optimizer.param_groups)):
                    scheduler.scale_group(i, ratio)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._active:
            return
        self._window = None
        self._returned_loss = None
        self._owns_zero_grad = False
        self._consumed += self._window_samples
        self._batches_done += 1
        self._steps += 1
        if self._steps >= self.adjust_every:
            self._steps = 0
            self._decide(trainer)
        self._log(trainer)

    def _decide(self, trainer: pl.Trainer) -> None:
        assert self.probe is not None and self.batch_size is not None
        peak = float(max(self.probe.peak_bytes(), self._train_peak))
        pressure = self.probe.pressure() or self._train_pressure
        self._train_peak, self._train_pressure = 0, False
        if trainer.world_size > 1:  # every rank decides on the same figures: the worst rank's
            figures = torch.tensor([peak, float(pressure)], dtype=torch.float64, device=trainer.strategy.root_device)
            figures = _all_reduce_max(trainer, figures)
            peak, pressure = float(figures[0]), bool(figures[1] > 0)
        ran = self._largest_run or self.batch_size  # a short last batch of an epoch may be all it saw
        self._largest_run = 0
        decision = self.controller.decide(
            self.batch_size,
            peak_bytes=peak,
            total_bytes=self.probe.total_bytes(),
            pressure=pressure,
            cap=self._cap(),
            observed_size=ran,
        )
        self.last_decision = decision
        shrunk = decision.batch_size < self.batch_size
        self._resize(trainer, decision.batch_size)
        if shrunk:  # give the larger size's cached blocks back, or the next peak of reserved memory still shows them
            self.probe.free()
        self.probe.reset_peak()

    def _resize(self, trainer: pl.Trainer, batch_size: int) -> None:
        if batch_size == self.batch_size:
            return
        self.batch_size = batch_size
        if self.keep != "effective" and self._sampler is not None:
            self._sampler.batch_size = self._window_size()
            self._update_epoch_length(trainer)
            self._retarget_schedules(trainer)

    def _retarget_schedules(self, trainer: pl.Trainer) -> None:
        """Tell lightning_tune's schedules how many optimizer steps the run now has (``keep="lr"``/``"none"``)."""
        from lightning_tune.callbacks.lr_schedule import ScheduleCallback

        assert self._sampler is not None
        per_epoch = math.ceil(self._sampler.epoch_samples() / self._window_size())
        remaining = max(0, int(trainer.fit_loop.max_batches) - self._batches_done)
        max_epochs = trainer.max_epochs
        if max_epochs is not None and max_epochs >= 0:
            remaining += max(0, max_epochs - trainer.current_epoch - 1) * per_epoch
        elif trainer.max_steps < 0:
            return  # an unbounded run: nothing to aim at
        if trainer.max_steps >= 0:
            remaining = min(remaining, trainer.max_steps - trainer.global_step)
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, ScheduleCallback):
                callback.retarget(trainer.global_step + remaining)

    def _log(self, trainer: pl.Trainer) -> None:
        """Write the decision keys to the loggers every ``log_every_n_steps`` optimizer steps.

        Straight to the loggers rather than through ``self.log``, which would copy each value to the device (a
        host-device synchronisation per key and step on a GPU).
        """
        every = trainer.log_every_n_steps  # type: ignore[attr-defined]  # set at runtime by the logger connector
        if not trainer.loggers or not every or trainer.global_step % every:
            return
        metrics = {
            "tune/batch_size": float(self.batch_size or 0),
            "tune/accumulate_grad_batches": float(self.accumulate_grad_batches or 0),
            "tune/effective_batch_size": float(self.effective_batch_size or 0),
            "tune/oom_recoveries": float(self.oom_recoveries),
        }
        if self.last_decision is not None and self.last_decision.predicted_fraction is not None:
            metrics["tune/predicted_vram_frac"] = self.last_decision.predicted_fraction
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    # -- the wrapped module hooks ------------------------------------------------------------------------------------
    def _optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        if self._owns_zero_grad:  # gradients of this window were zeroed before its first micro-batch
            return
        self._originals["optimizer_zero_grad"](epoch, batch_idx, optimizer)

    def _zero_grad(self, batch_idx: int) -> None:
        assert self._trainer is not None
        for optimizer in self._trainer.optimizers:
            self._originals["optimizer_zero_grad"](self._trainer.current_epoch, batch_idx, optimizer)

    def _training_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Any:
        trainer = self._trainer
        if not self._active or trainer is None or not trainer.training or self.batch_size is None:
            return self._originals["training_step"](batch, batch_idx, *args, **kwargs)
        n = count_samples(batch)
        if n is None:
            raise TypeError(
                f"DynamicBatchSize cannot count the samples of a batch of type {type(batch).__name__}: it needs a "
                "tensor whose first dimension is the batch"
            )
        self._window, self._window_samples = (batch, batch_idx, args, kwargs), n
        distributed = trainer.world_size > 1 and self.sync_oom and self._ddp
        while True:
            assert self.batch_size is not None
            try:
                pieces = self._pieces(batch, n)
                if len(pieces) == 1 and not distributed:
                    output = self._forward(pieces[0], batch_idx, args, kwargs)
                    self._returned_loss = _loss_of(output)
                    return _with_value(output, [], pieces[0].weight)
                return self._run_window(trainer, pieces, distributed)
            except _OOM as err:
                self._recover(trainer, batch_idx, err)

    def _pieces(self, batch: Any, n: int) -> list[_Piece]:
        """The window's micro-batches, each with its weight in the optimizer step.

        With ``keep="effective"`` a sample weighs ``1 / (b × k)``, as in Lightning's fixed-batch run, except in the
        DataLoader's short last batch of an epoch (``r < b`` samples), where Lightning gives the batch's mean loss
        ``1 / k``: those samples form micro-batches of their own weighing ``1 / (r × k)`` each. Otherwise every
        sample weighs ``1 / n`` for a window of ``n``.
        """
        assert self.batch_size is not None
        m = self.batch_size

        def chunks(total: int) -> list[int]:
            return [min(m, total - start) for start in range(0, total, m)]

        if self.keep != "effective":
            sizes = chunks(n)
            weights = [k / n for k in sizes]
        else:
            tail = self._short_batch_in(n)
            head_sizes, tail_sizes = chunks(n - tail), chunks(tail)
            sizes = head_sizes + tail_sizes
            weights = [k / self._configured_effective for k in head_sizes]
            weights += [k / (tail * self._user_accumulation) for k in tail_sizes]
        parts = [batch] if len(sizes) == 1 else split_sizes(batch, sizes)
        return [_Piece(*piece) for piece in zip(parts, sizes, weights, strict=True)]

    def _short_batch_in(self, n: int) -> int:
        """Samples of the DataLoader's short last batch of the epoch inside this window of ``n`` (0 if none)."""
        sampler = self._sampler
        if sampler is None or sampler.drop_last:
            return 0
        total = sampler.epoch_samples()
        short = total % self._user_batch_size
        return short if short and self._consumed + n == total and n >= short else 0

    def _forward(self, piece: _Piece, batch_idx: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``training_step`` on a micro-batch; its loss comes back multiplied by the piece's weight."""
        assert self.probe is not None
        self.probe.before_micro_batch(piece.samples)
        self._largest_run = max(self._largest_run, piece.samples)
        output = self._originals["training_step"](piece.batch, batch_idx, *args, **kwargs)
        return output if piece.weight == 1.0 else _scale_output(output, piece.weight)

    def _run_window(self, trainer: pl.Trainer, pieces: list[_Piece], distributed: bool) -> Any:
        """Run the window's micro-batches; return what Lightning should backward (the last one, or a sync graph).

        What is returned carries the window's mean loss as its value (what the progress bar and callbacks see) and
        the last micro-batch's weighted loss as its gradient.
        """
        assert self._window is not None
        _, batch_idx, args, kwargs = self._window
        total_weight = sum(piece.weight for piece in pieces)
        self._zero_grad(batch_idx)
        self._owns_zero_grad = True
        manual = pieces if distributed else pieces[:-1]
        oom: BaseException | None = None
        shown: list[Tensor] = []
        with _no_sync(trainer):
            for piece in manual:
                try:
                    loss = self._forward_backward(trainer, piece, batch_idx, args, kwargs)
                except _OOM as err:
                    oom = err
                    break
                if loss is not None:
                    shown.append(loss)
        if distributed:
            failed = torch.tensor([0.0 if oom is None else 1.0], device=trainer.strategy.root_device)
            if float(_all_reduce_max(trainer, failed)[0]) > 0:  # some rank ran out of memory: all retry
                raise oom if oom is not None else torch.OutOfMemoryError("out of memory on another rank")
            return _sync_graph(trainer.lightning_module, shown, total_weight)
        if oom is not None:
            raise oom
        output = self._forward(pieces[-1], batch_idx, args, kwargs)
        self._returned_loss = _loss_of(output)
        return _with_value(output, shown, total_weight)

    def _forward_backward(
        self, trainer: pl.Trainer, piece: _Piece, batch_idx: int, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Tensor | None:
        output = self._forward(piece, batch_idx, args, kwargs)
        loss = _loss_of(output)
        if loss is None:
            return None
        self._manual = True
        try:
            with _autocast_off(trainer):
                trainer.strategy.backward(loss, trainer.optimizers[0] if trainer.optimizers else None)
        finally:
            self._manual = False
        return loss.detach()

    def _backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        original = self._originals["backward"]
        trainer = self._trainer
        if self._manual or not self._active or trainer is None or self._window is None:
            return original(loss, *args, **kwargs)
        try:
            return original(loss, *args, **kwargs)
        except _OOM as err:
            if trainer.world_size > 1:
                raise  # other ranks are inside the gradient all-reduce already; see `sync_oom`
            failure: BaseException = err
        # Out of memory in Lightning's backward of the window's last micro-batch: release its graph, then run the
        # whole window again in smaller pieces from here; Lightning then steps with the gradients this leaves.
        for tensor in (loss, self._returned_loss):
            if tensor is not None:
                with contextlib.suppress(RuntimeError):  # a view cannot be detached in place; its graph goes later
                    tensor.detach_()
        self._returned_loss = None
        batch, batch_idx, step_args, step_kwargs = self._window
        while True:
            self._recover(trainer, batch_idx, failure)
            try:
                self._owns_zero_grad = True  # `_recover` zeroed the gradients
                # forward passes run under the precision's autocast, as Lightning runs training_step
                with trainer.precision_plugin.train_step_context():
                    for piece in self._pieces(batch, self._window_samples):
                        self._forward_backward(trainer, piece, batch_idx, step_args, step_kwargs)
                return None
            except _OOM as again:
                failure = again

    def _recover(self, trainer: pl.Trainer, batch_idx: int, err: BaseException) -> None:
        """Drop the window's gradients, free memory and shrink the micro-batch after an out-of-memory error."""
        assert self.probe is not None and self.batch_size is not None
        self._zero_grad(batch_idx)
        self.probe.free()
        failed = self.batch_size
        self.batch_size = self.controller.on_oom(failed, total_bytes=self.probe.total_bytes(), cap=self._cap())
        self.oom_recoveries += 1
        self.last_decision = Decision(self.batch_size, None, "oom")
        if self.keep != "effective" and self._sampler is not None:
            self._sampler.batch_size = self._window_size()
            self._update_epoch_length(trainer)
            self._retarget_schedules(trainer)
        self.probe.reset_peak()
        self._steps = 0
        self._largest_run = 0

    # -- checkpoints -------------------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "batch_size": self.batch_size,
            "user_batch_size": self._user_batch_size,
            "user_accumulation": self._user_accumulation,
            "lr_factor": self._lr_factor,
            "oom_recoveries": self.oom_recoveries,
            "steps": self._steps,
            "controller": self.controller.state_dict(),
            "consumed": self._consumed,
            "batches_done": self._batches_done,
            "order": None,
        }
        trainer = self._trainer
        if self._sampler is not None and trainer is not None and trainer.world_size == 1:
            state["order"] = self._sampler.saved_order()
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restore = dict(state_dict)

    def _apply_restore(self, trainer: pl.Trainer, sampler: ResizableBatchSampler) -> None:
        state, self._restore = self._restore, None
        assert state is not None
        self.batch_size = state["batch_size"]
        self._user_batch_size = state["user_batch_size"]
        self._user_accumulation = state["user_accumulation"]
        self._lr_factor = state["lr_factor"]
        self.oom_recoveries = state["oom_recoveries"]
        self._steps = state["steps"]
        self.controller.load_state_dict(state["controller"])
        sampler.batch_size = self._window_size()
        if trainer.fit_loop.restarted_mid_epoch and state["consumed"]:  # resumed mid-epoch: skip what was trained
            order = state["order"]
            sampler.resume(
                state["consumed"], state["batches_done"], None if order is None else [int(i) for i in order.tolist()]
            )
            self._consumed, self._batches_done = state["consumed"], state["batches_done"]


def _loss_of(output: Any) -> Tensor | None:
    if isinstance(output, Tensor):
        return output
    if isinstance(output, dict):
        loss = output.get("loss")
        return loss if isinstance(loss, Tensor) else None
    return None


def _scale_output(output: Any, weight: float) -> Any:
    if isinstance(output, Tensor):
        return output * weight
    if isinstance(output, dict) and isinstance(output.get("loss"), Tensor):
        return {**output, "loss": output["loss"] * weight}
    return output


def _with_value(output: Any, earlier: list[Tensor], total_weight: float) -> Any:
    """Give the returned loss the window's mean loss as value, keeping the last micro-batch's gradient."""
    loss = _loss_of(output)
    if loss is None or (not earlier and total_weight == 1.0):
        return output
    value = (torch.stack([*earlier, loss.detach()]).sum() / total_weight).to(loss.dtype)
    shown = loss + (value - loss.detach())
    return shown if isinstance(output, Tensor) else {**output, "loss": shown}


def _sync_graph(pl_module: pl.LightningModule, shown: list[Tensor], total_weight: float) -> Tensor:
    """A zero loss touching every trainable parameter, valued at the window's mean loss.

    Its backward adds nothing to the gradients but makes DDP all-reduce them, once every rank has agreed that the
    window's micro-batches all fit.
    """
    params = [p for p in pl_module.parameters() if p.requires_grad]
    zero = torch.stack([p.sum() for p in params]).sum() * 0.0
    value = torch.stack(shown).sum() / total_weight if shown else torch.zeros((), device=zero.device)
    return value.to(zero.dtype) + zero


def _all_reduce_max(trainer: pl.Trainer, tensor: Tensor) -> Tensor:
    from torch.distributed import ReduceOp

    return trainer.strategy.reduce(tensor, reduce_op=ReduceOp.MAX)  # type: ignore[arg-type]


@contextlib.contextmanager
def _no_sync(trainer: pl.Trainer) -> Iterator[None]:
    block = getattr(trainer.strategy, "block_backward_sync", None)
    if block is None:
        yield
        return
    with block():
        yield


@contextlib.contextmanager
def _autocast_off(trainer: pl.Trainer) -> Iterator[None]:
    """Backward runs outside autocast, as Lightning's own backward does (this one runs inside ``training_step``)."""
    device = trainer.strategy.root_device.type
    if torch.is_autocast_enabled(device):
        with torch.autocast(device_type=device, enabled=False):
            yield
    else:
        yield


def _train_loader(trainer: pl.Trainer) -> DataLoader:
    combined = trainer.train_dataloader
    loaders = getattr(combined, "flattened", [combined])
    if len(loaders) != 1 or not isinstance(loaders[0], DataLoader):
        raise MisconfigurationException(
            "DynamicBatchSize controls a single train DataLoader; this run has "
            f"{len(loaders)} train loaders ({', '.join(type(x).__name__ for x in loaders)})"
        )
    return loaders[0]


def _set_batch_sampler(loader: DataLoader, batch_sampler: BatchSampler | ResizableBatchSampler) -> None:
    """Give an existing DataLoader a new batch sampler.

    ``DataLoader.__setattr__`` refuses ``batch_sampler`` once constructed; building a new DataLoader instead would lose
    a subclass's behaviour and whatever Lightning did to the instance (its distributed sampler, worker init function).
    Workers receive indices from the main process, so the instance keeps working with the new sampler. A persistent
    worker iterator would keep drawing from the old one, so it is shut down, as Lightning does when it resets a
    loader. Checked on torch 2.3 to 2.13; ``tests/test_dynamic_batch.py`` fails if this stops working.
    """
    from lightning.pytorch.utilities.combined_loader import _shutdown_workers_and_reset_iterator

    object.__setattr__(loader, "batch_sampler", batch_sampler)
    _shutdown_workers_and_reset_iterator(loader)


def _restart_train_iterator(trainer: pl.Trainer) -> None:
    """Make the training loop draw its batches from the new batch sampler.

    Lightning (checked on 2.4 to 2.6) creates the first epoch's DataLoader iterator in ``FitLoop.setup_data``, before
    any callback hook, and keeps it in the loop's private data fetcher; calling ``iter`` on that fetcher again (as
    Lightning itself does at each epoch start) re-creates the iterator from the current batch sampler.
    """
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is not None:
        iter(fetcher)


def _set_epoch_batches(trainer: pl.Trainer, batches: int) -> None:
    """Tell the training loop how many batches the running epoch has.

    ``FitLoop.max_batches`` is a public attribute; the data fetcher (private, Lightning 2.4 to 2.6) caches the length
    it saw when the epoch's iterator was created and ends the epoch by it.
    """
    trainer.fit_loop.max_batches = batches
    combined = trainer.fit_loop._combined_loader
    if combined is not None:
        combined.limits = [batches]
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is not None and fetcher.length is not None:
        fetcher.length = batches
