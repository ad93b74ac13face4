"""DynamicBatchSize: grow and shrink the micro-batch during training to hold a memory target, through OOMs.

The Lightning wiring of :class:`~lightning_tune.batch.MicroBatchRunner` (details in ``docs/dynamic_batch.md``): the
train DataLoader's ``BatchSampler`` becomes a :class:`~lightning_tune.batch.ResizableBatchSampler` handing out whole
optimizer steps, the module's ``training_step`` hands each step to the runner, and every ``adjust_every`` steps the
interval's peak memory goes to a :class:`~lightning_tune.batch.BatchSizeController`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.utils.data import BatchSampler, DataLoader
from typing_extensions import override

from lightning_tune import keys
from lightning_tune._validation import check_bool, check_choice, check_float, check_int, check_strings
from lightning_tune.batch.control import BatchSizeController, Decision
from lightning_tune.batch.logs import StepLogs
from lightning_tune.batch.memory import MemoryModel
from lightning_tune.batch.probes import CudaMemory, MemoryProbe
from lightning_tune.batch.runner import (
    MicroBatch,
    MicroBatchRunner,
    all_reduce_max,
    cut_step,
    is_allocation_failure,
    step_with_retry,
)
from lightning_tune.batch.sampler import ResizableBatchSampler
from lightning_tune.batch.sharded import GatheredStep
from lightning_tune.batch.tokens import TokenBudget
from lightning_tune.batch.trim import PaddingLayout, cut_sequences, padding_layout, sample_tokens
from lightning_tune.callbacks._logging import log_every_n_steps
from lightning_tune.callbacks._resizable_loader import (
    attach,
    loader_parts,
    retarget_schedules,
    sample_limit,
    scale_learning_rates,
    set_batch_sampler,
    set_epoch_length,
    start_epoch_from_its_first_batch,
    train_loader,
)
from lightning_tune.lr.scaling import SCALE_RULES, ScaleRule, scale_lr
from lightning_tune.perf.batch import count_samples
from lightning_tune.perf.ran import StepRun
from lightning_tune.plan.estimate import MemoryEstimate

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["KEEPS", "LOSS_WEIGHTS", "DynamicBatchSize", "Keep", "LossWeight"]

Keep = Literal["effective", "lr", "none"]
#: What ``keep`` accepts.
KEEPS: tuple[str, ...] = get_args(Keep)
_GIB = 1 << 30
LossWeight = Literal["samples", "tokens"]
#: What ``loss_weight`` accepts.
LOSS_WEIGHTS: tuple[str, ...] = get_args(LossWeight)
_NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended and your dataloader is not"
#: The arguments a checkpoint records, so that a run resumed with other values can say which it uses.
_RESUMED_ARGUMENTS = (
    "target_vram",
    "min_batch_size",
    "max_batch_size",
    "adjust_every",
    "keep",
    "lr_rule",
    "multiple_of",
    "reserve_gib",
    "loss_weight",
    "label_shift",
    "pad_to_multiple_of",
)


class DynamicBatchSize(Callback):
    r"""Adjust the micro-batch size while training runs to keep peak device memory at ``target_vram``.

    Variable-length batches (a mapping with a 2-D ``attention_mask``): each step's samples are ordered longest first,
    cut into micro-batches and each micro-batch is trimmed to its own longest sequence. With ``keep="effective"`` the
    micro-batch is then a budget of padded tokens (``tune/micro_batch_tokens``): many short samples or few long ones.

    Args:
        target_vram: Fraction of the memory PyTorch can get (free memory plus what its allocator holds, re-read at
            every decision) to fill, in (0, 0.98].
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
            :class:`~lightning_tune.SimulatedMemory` to try the callback without one. Elsewhere without a probe
            there is no memory to target: the micro-batch stays the DataLoader's, and padding is still trimmed.
        prior: A :class:`~lightning_tune.MemoryEstimate` (from :func:`~lightning_tune.estimate_memory` or
            :func:`~lightning_tune.measure_memory`) that starts the memory model, so the first decision need not probe.
        min_change: Smallest relative growth worth a change.
        sync_oom: Under DDP and FSDP2, agree on allocation failures across ranks: one small all-reduce per optimizer
            step (DDP: before the last micro-batch's backward; FSDP2: after every backward, before the gradients are
            reduced). Without it an OOM under DDP cannot be recovered; FSDP2 requires it.
        reserve_gib: Memory (GiB) kept free whatever ``target_vram`` says, for other processes on a shared GPU.
        agree_timeout: Seconds a rank waits for the others' agreement before failing with a clear error.
        loss_weight: How the micro-batch losses of a step are weighted: ``"samples"`` by their share of the step's
            samples (per-sample mean losses), ``"tokens"`` by their share of the step's label tokens (labels other
            than -100, or mask tokens without labels), so that token-mean losses add up to one token mean over the
            whole step.
        label_shift: Leading positions of each row that are never a loss target, for ``"tokens"``: ``None`` is 1
            for a Hugging Face causal LM in the module (its loss compares position ``i`` with label ``i + 1``), else 0.
        trim_keys: Batch keys besides Hugging Face's (``input_ids``, ``attention_mask``, ``labels``,
            ``token_type_ids``, ``position_ids``) whose second dimension is the padded sequence, trimmed with them.
        pad_to_multiple_of: Trimmed sequence lengths are rounded up to a multiple of this (few distinct shapes for
            ``torch.compile``, tensor-core friendly), as the collator's argument of that name.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range, ``min_batch_size > max_batch_size``, or ``label_shift`` is given
            without ``loss_weight="tokens"``. At the start of training: if ``reserve_gib`` is all the device has.

    Example:
        >>> from lightning_tune import DynamicBatchSize, SimulatedMemory
        >>> DynamicBatchSize(target_vram=0.9, min_batch_size=8, max_batch_size=64, adjust_every=100)
        DynamicBatchSize(target_vram=0.9, min_batch_size=8, max_batch_size=64, adjust_every=100, keep='effective')
    """

    def __init__(
        self,
        target_vram: float = 0.9,
        *,
        min_batch_size: int = 1,
        max_batch_size: int | None = None,
        adjust_every: int = 100,
        keep: Keep = "effective",
        lr_rule: ScaleRule = "sqrt",
        multiple_of: int = 8,
        probe: MemoryProbe | None = None,
        prior: MemoryEstimate | None = None,
        min_change: float = 0.1,
        sync_oom: bool = True,
        reserve_gib: float = 0.0,
        agree_timeout: float = 600.0,
        loss_weight: LossWeight = "samples",
        label_shift: int | None = None,
        trim_keys: Sequence[str] = (),
        pad_to_multiple_of: int = 8,
    ) -> None:
        # min/max_batch_size, multiple_of and min_change are checked by the controller, pad_to_multiple_of by the tokens
        check_float("target_vram", target_vram, low=0.0, high=0.98, low_inclusive=False)
        check_int("adjust_every", adjust_every, minimum=1)
        check_choice("keep", keep, KEEPS)
        check_choice("lr_rule", lr_rule, SCALE_RULES)
        check_bool("sync_oom", sync_oom)
        check_float("reserve_gib", reserve_gib, low=0.0)
        check_float("agree_timeout", agree_timeout, low=0.0, low_inclusive=False)
        check_choice("loss_weight", loss_weight, LOSS_WEIGHTS)
        check_int("label_shift", label_shift, minimum=0, allow_none=True)
        if label_shift is not None and loss_weight != "tokens":
            raise ValueError(f"`label_shift` is read only with `loss_weight='tokens'`, got {loss_weight=!r}")
        check_strings("trim_keys", trim_keys, what="key names (strings)")
        if probe is not None and not isinstance(probe, MemoryProbe):
            raise TypeError(
                "`probe` must be a memory probe (CudaMemory, SimulatedMemory or an object with total_bytes, "
                f"capacity_bytes, reset_peak, peak_bytes, pressure, before_micro_batch, free and empty_cache), got "
                f"{type(probe).__name__}"
            )
        if prior is not None and not isinstance(prior, MemoryEstimate):
            raise TypeError(f"`prior` must be a MemoryEstimate (estimate_memory, measure_memory) or None, got {prior}")
        fixed, per_sample = (None, None) if prior is None else (prior.fixed_bytes, prior.bytes_per_sample)
        self.target_vram, self.min_batch_size, self.max_batch_size = target_vram, min_batch_size, max_batch_size
        self.adjust_every, self.keep, self.lr_rule, self.multiple_of = adjust_every, keep, lr_rule, multiple_of
        self.sync_oom, self.reserve_gib, self.agree_timeout = sync_oom, reserve_gib, agree_timeout
        self.probe: MemoryProbe | None = probe
        self.loss_weight, self.label_shift, self.pad_to_multiple_of = loss_weight, label_shift, pad_to_multiple_of
        self.trim_keys = tuple(trim_keys)
        self.controller = BatchSizeController(
            target=target_vram,
            min_batch_size=min_batch_size,
            max_batch_size=max_batch_size,
            multiple_of=multiple_of,
            min_change=min_change,
            model=MemoryModel(prior_fixed_bytes=fixed, prior_bytes_per_sample=per_sample),
        )
        #: Micro-batch size in use (``None`` before training starts).
        self.batch_size: int | None = None
        #: Out-of-memory errors recovered from so far.
        self.oom_recoveries = 0
        #: Decisions taken so far.
        self.decisions = 0
        #: The last decision taken.
        self.last_decision: Decision | None = None
        self.runner: MicroBatchRunner | None = None
        self._trainer: pl.Trainer | None = None
        self._sampler: ResizableBatchSampler | None = None
        self._loader: DataLoader | None = None
        self._original_batch_sampler: BatchSampler | None = None
        self._originals: dict[str, Callable[..., Any]] = {}
        self._user_batch_size = 0  # the DataLoader's own batch size
        self._user_accumulation = 1  # the Trainer's accumulate_grad_batches as configured
        self._lr_factor = 1.0
        self._steps = 0  # optimizer steps in the current decision interval
        self._consumed = 0  # samples of the running epoch trained on
        self._batches_done = 0  # windows of the running epoch trained on
        self._restore: dict[str, Any] | None = None  # state from a checkpoint, applied at train start
        self._seed: int | None = None  # a shuffling sampler's base seed: epoch e draws with seed + e
        self._installed_epoch = -1
        self._figures: list[float] | None = None  # the interval's agreed [peak, pressure, -budget]
        self._val_figures = (0, False)  # training's peak and pressure before a validation run
        self._base = 0.0  # memory live tensors hold at the interval's start (the model's base_bytes)
        self._quiet: Any = None  # the warnings filter silencing Lightning's false "not resumable" warning
        self._step_args: tuple[int, tuple[Any, ...], dict[str, Any]] = (0, (), {})
        self._gathered: GatheredStep | None = None  # FSDP2: parameters gathered once per step
        # variable-length batches
        self.tokens = TokenBudget(self.controller, pad_to_multiple_of=pad_to_multiple_of)
        #: Real and padded tokens of the micro-batches the last step ran (``None`` for batches without a mask).
        self.step_tokens: tuple[int, int] | None = None
        #: (samples, padded length) of each micro-batch the last step ran, trimmed (``None``: not trimmed).
        self.step_shapes: list[tuple[int, int]] | None = None
        #: Distinct (samples, padded length) micro-batch shapes run so far (each one a compile under torch.compile).
        self.shapes: set[tuple[int, int]] = set()
        self._shift = 0  # label_shift as resolved at train start
        self._micro_batches = 0  # micro-batches of the last step
        self._logs = StepLogs()  # what the step's micro-batches log with self.log
        self._layout_warned = self._compiled = self._compile_warned = False

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
    def micro_batch_tokens(self) -> int | None:
        """Padded tokens per micro-batch in use, when micro-batches are budgeted in tokens (else ``None``)."""
        return self.tokens.budget

    @property
    def token_controller(self) -> BatchSizeController | None:
        """The controller of :attr:`micro_batch_tokens` (``None`` while there is no budget)."""
        return None if self.tokens.budget is None else self.tokens.controller

    @property
    def accumulate_grad_batches(self) -> int | None:
        """Micro-batches per optimizer step."""
        if self.batch_size is None or self.effective_batch_size is None:
            return None
        if self.micro_batch_tokens is not None and self._micro_batches:
            return self._micro_batches  # micro-batches of the last step, as long as its samples were
        return math.ceil(self.effective_batch_size / self.batch_size)

    @property
    def micro_batches(self) -> int:
        """Micro-batches the last optimizer step ran (0 before the first)."""
        return self._micro_batches

    def last_step_run(self) -> StepRun | None:
        """The micro-batches of the last training step (:class:`~lightning_tune.perf.ran.StepRunSource`)."""
        if self.runner is None:
            return None
        shapes = None if self.step_shapes is None else tuple(self.step_shapes)
        return StepRun(self._micro_batches, shapes, self.step_tokens)

    @property
    def _active(self) -> bool:
        return self.runner is not None

    # -- setup -------------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._trainer = trainer
        if self.probe is None and trainer.strategy.root_device.type == "cuda":
            self.probe = CudaMemory(trainer.strategy.root_device)
        elif self.probe is None:
            warnings.warn(
                f"DynamicBatchSize: training runs on {trainer.strategy.root_device.type!r}, which has no device memory "
                "to target, so the micro-batch size is left as the DataLoader's; padding is still trimmed (each "
                "step's samples grouped by length, each micro-batch cut to its longest). To try the size control "
                "without a GPU, give it probe=SimulatedMemory(...).",
                stacklevel=2,
            )
        from lightning_tune._compat import check_lightning_version

        check_lightning_version("DynamicBatchSize")  # its private Lightning internals were checked on these versions
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
        from lightning.pytorch.strategies import DDPStrategy

        if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):  # type: ignore[attr-defined]
            raise MisconfigurationException(
                "DynamicBatchSize sets gradient accumulation itself: remove GradientAccumulationScheduler and give "
                "the effective batch through the DataLoader's batch size and Trainer(accumulate_grad_batches=...)"
            )
        distributed = trainer.world_size > 1
        ddp = isinstance(trainer.strategy, DDPStrategy)
        fsdp2 = distributed and _check_sharded_strategy(trainer.strategy)
        if distributed and not (ddp or fsdp2):
            warnings.warn(
                f"DynamicBatchSize: under {type(trainer.strategy).__name__} every rank takes the same batch-size "
                "decisions, but an out-of-memory error can only be recovered when every rank hits it: the agreement "
                "that lets one rank's OOM make all of them retry (`sync_oom`) is made for DDP and FSDP2",
                stacklevel=2,
            )
        if fsdp2 and not self.sync_oom:
            raise MisconfigurationException(
                "DynamicBatchSize needs `sync_oom=True` under FSDP2: the step's gradients are reduced only once the "
                "ranks agreed that every micro-batch ran, and without the agreement a rank that ran out of memory "
                "would leave the others waiting in that reduction"
            )
        # FSDP2: the parameters are gathered once per step, so the micro-batches run with no collective
        self._gathered = GatheredStep(pl_module) if fsdp2 else None
        self.runner = MicroBatchRunner(
            forward=self._forward,
            backward=self._backward_micro_batch,
            zero_grad=self._zero_grad,
            free=self._free_after_failure,
            shrink=self._shrink,
            min_size=self.min_batch_size,
            # without a memory target nothing is decided and no out-of-memory error recovered: nothing to agree on
            agree=self._max_over_ranks if distributed and (ddp or fsdp2) and self.sync_oom and self.probe else None,
            no_sync=getattr(trainer.strategy, "block_backward_sync", contextlib.nullcontext),
            on_failure=self._on_failure,
        )
        for name in ("training_step", "backward", "optimizer_zero_grad"):  # the instance's, not its class's
            self._originals[name] = getattr(pl_module, name)
            setattr(pl_module, name, getattr(self, f"_{name}"))
        expandable = getattr(self.probe, "expandable_segments", None)
        if self.probe is not None:
            rank_zero_info(
                f"DynamicBatchSize: reading memory from {self.probe!r}"
                + ("" if expandable is None else f", expandable_segments {'on' if expandable else 'off'}")
            )

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        for name in self._originals:
            with contextlib.suppress(AttributeError):
                delattr(pl_module, name)  # back to the class's method
        self._originals.clear()
        for optimizer in trainer.optimizers:
            step = vars(optimizer).get("step")
            if isinstance(step, functools.partial) and step.func is step_with_retry:
                if inspect.ismethod(step.args[1]):  # the class's own step
                    del vars(optimizer)["step"]
                else:  # an LR scheduler's wrapper
                    optimizer.step = step.args[1]  # type: ignore[method-assign]
        if self._active:
            trainer.accumulate_grad_batches = self._user_accumulation
        if self._loader is not None and self._original_batch_sampler is not None:
            # a DataLoader the module or DataModule keeps must come back as it was given
            set_batch_sampler(self._loader, self._original_batch_sampler)
        self._loader = self._sampler = self._original_batch_sampler = self.runner = self._gathered = None
        self._seed = None  # a new fit draws new orders
        self._unquiet()

    # -- the DataLoader ----------------------------------------------------------------------------------------------
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active:
            return
        self._user_accumulation = int(trainer.accumulate_grad_batches)
        self._lr_factor = 1.0  # a new fit starts from the optimizer's configured LR (a checkpoint may say otherwise)
        self._shift = self.label_shift if self.label_shift is not None else _causal_lm_shift(pl_module)
        self._compiled = _has_compiled(pl_module)
        self._install(trainer)
        if self.probe is None:
            return
        capacity = self.probe.capacity_bytes()
        if self.reserve_gib * _GIB >= capacity:
            raise ValueError(
                f"`reserve_gib` must leave memory to train in: PyTorch can get {capacity / _GIB:.3g} GiB on this "
                f"device, got reserve_gib={self.reserve_gib!r}"
            )
        free = self.probe.free
        for optimizer in trainer.optimizers:
            if not isinstance(optimizer, torch.optim.LBFGS):  # LBFGS runs its closure many times
                # update_wrapper keeps an LR scheduler's mark on the step, or torch warns it was overridden
                retry = functools.partial(step_with_retry, optimizer, optimizer.step, free=free, warn=rank_zero_warn)
                optimizer.step = functools.update_wrapper(retry, optimizer.step)  # type: ignore[method-assign]

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active:
            return
        loader = train_loader(trainer)
        self._consumed = self._batches_done = 0  # not called when a run resumes mid-epoch
        if loader is not self._loader or loader.batch_sampler is not self._sampler:  # reloaded by the Trainer
            self._install(trainer)
        elif self._sampler is not None and trainer.current_epoch != self._installed_epoch:
            # the epoch's iterator comes after this hook: the sampler's order is the last epoch's (with workers, the
            # iterator of the epoch the sampler was installed in has drawn its order already)
            self._sampler.new_epoch()
            self._sampler.set_epoch(trainer.current_epoch)
            self._update_epoch_length(trainer)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # inside fit, Lightning's stage is "validating" here (trainer.training is False): test the fitting state
        if self._active and self.probe is not None and trainer.state.fn == "fit":
            peak, pressure = self._val_figures
            self._val_figures = (max(peak, self.probe.peak_bytes()), pressure or self.probe.pressure())

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active and self.probe is not None and trainer.state.fn == "fit":
            self.probe.free()  # validation's memory is not training's
            self.probe.reset_peak()
            self.tokens.largest = 0

    def _install(self, trainer: pl.Trainer) -> None:
        loader, inner, loader_batch, drop_last, original = loader_parts(trainer)
        if original is not None:
            self._original_batch_sampler = original
        self._user_batch_size = loader_batch
        if self.batch_size is None:
            start = loader_batch
            if self.controller.model.prior is not None and self.probe is not None:  # start from its prediction
                best = self.controller.model.largest_batch(self._budget()[1])
                start = self.controller.round_down(best or 1, self._cap())
            self.batch_size = max(self.min_batch_size, min(start, self._cap() or start, self.max_batch_size or start))
        limit = sample_limit(trainer, loader_batch)
        if self._seed is None and hasattr(inner, "generator"):  # drawn as the sampler draws its own seed each epoch
            self._seed = int(torch.empty((), dtype=torch.int64).random_(generator=inner.generator).item())
        sampler = ResizableBatchSampler(
            inner, self._window_size(), drop_last=drop_last, granule=loader_batch, limit=limit, seed=self._seed
        )
        next_epoch = self._restore is not None and self._apply_restore(trainer, sampler)
        self._loader, self._sampler, self._installed_epoch = loader, sampler, trainer.current_epoch
        attach(trainer, loader, sampler, lambda: self._update_epoch_length(trainer))
        if next_epoch:
            start_epoch_from_its_first_batch(trainer)
        if self.probe is not None:
            self._new_interval()

    @property
    def _configured_effective(self) -> int:
        """The effective batch as configured: the DataLoader's batch size times the Trainer's accumulation."""
        return self._user_batch_size * self._user_accumulation

    def _cap(self) -> int | None:
        return self._configured_effective if self.keep == "effective" else None

    def _window_size(self) -> int:
        assert self.batch_size is not None
        return self._configured_effective if self.keep == "effective" else self.batch_size * self._user_accumulation

    def _budget(self) -> tuple[int, float]:
        """What PyTorch can get now, and the peak allowed: ``target_vram`` of it, ``reserve_gib`` kept free."""
        assert self.probe is not None
        capacity = self.probe.capacity_bytes()
        return capacity, max(1.0, min(self.target_vram * capacity, capacity - self.reserve_gib * _GIB))

    def _update_epoch_length(self, trainer: pl.Trainer) -> None:
        assert self._sampler is not None
        interval = trainer.val_check_interval
        every = interval // self._user_accumulation if isinstance(interval, int) and self.keep == "effective" else None
        set_epoch_length(trainer, len(self._sampler), every)

    # -- per batch ---------------------------------------------------------------------------------------------------
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._unquiet()  # Lightning's resume warning is behind us
        if not self._active or self.keep != "lr":
            return
        n = count_samples(batch)
        if n is not None:
            factor = scale_lr(1.0, self._configured_effective, n, rule=self.lr_rule)
            if factor != self._lr_factor:
                scale_learning_rates(trainer, factor / self._lr_factor)
                self._lr_factor = factor

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._active:
            return
        self._consumed += count_samples(batch) or 0
        self._batches_done += 1
        self._steps += 1
        if self._steps >= self.adjust_every and self.probe is not None:
            self._decide(trainer)
        log_every_n_steps(trainer, self._metrics)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active:
            rank_zero_info(
                f"DynamicBatchSize: settled at micro-batch {self.batch_size} samples ({self.accumulate_grad_batches} "
                f"per optimizer step of {self.effective_batch_size} samples"
                + ("" if self.micro_batch_tokens is None else f", {self.micro_batch_tokens} padded tokens at most")
                + f"); {self.decisions} decision{'s' * (self.decisions != 1)}, "
                f"{self.oom_recoveries} out-of-memory error{'s' * (self.oom_recoveries != 1)} recovered"
            )

    def _max_over_ranks(self, values: Sequence[float]) -> list[float]:
        """The element-wise maximum of ``values`` over the ranks (of one rank: ``values``)."""
        trainer = self._trainer
        assert trainer is not None
        if trainer.world_size == 1:
            return list(values)
        return all_reduce_max(values, device=trainer.strategy.root_device, timeout=self.agree_timeout)

    def _interval_figures(self) -> list[float]:
        """This rank's interval figures: peak, pressure, -budget, largest micro-batch in tokens, -base."""
        assert self.probe is not None
        peak, pressure = self._val_figures
        peak, pressure = max(self.probe.peak_bytes(), peak), self.probe.pressure() or pressure
        return [float(peak), float(pressure), -self._budget()[1], float(self.tokens.largest), -self._base]

    def _decide(self, trainer: pl.Trainer) -> None:
        assert self.probe is not None and self.batch_size is not None and self.runner is not None
        # the worst rank's figures, agreed in the step's own collective, or here when none ran (no `sync_oom`)
        figures = self._figures or self._max_over_ranks(self._interval_figures())
        self._figures, self._val_figures, self._steps = None, (0, False), 0
        memory: dict[str, Any] = {"peak_bytes": figures[0], "pressure": figures[1] > 0, "budget_bytes": -figures[2]}
        memory["base_bytes"] = -figures[4]  # the smallest rank's
        self.tokens.largest = int(figures[3])  # the ranks' largest micro-batch in tokens: one decision on all
        ran = self.runner.largest_run or self.batch_size  # a short last batch of an epoch may be all it saw
        self.runner.largest_run = 0
        tokens, size = self.tokens.budget is not None, self.tokens.budget or self.batch_size
        if tokens:  # the peak is the reserved memory's, whose cached blocks hold the largest micro-batch in tokens
            decide = functools.partial(self.tokens.decide, self._configured_effective)
        else:
            decide = functools.partial(self.controller.decide, size, cap=self._cap(), observed_size=ran)
        decision = decide(total_bytes=self.probe.capacity_bytes(), **memory)
        self.last_decision, self.decisions = decision, self.decisions + 1
        if decision.batch_size != size:
            rank_zero_info(
                f"DynamicBatchSize: micro-batch {self._unit(size)} -> {self._unit(decision.batch_size)} "
                f"({decision.reason})"
            )
            if not tokens:
                self._set_batch_size(trainer, decision.batch_size)
        self._new_interval()

    def _new_interval(self) -> None:
        """Empty the cache and start an interval; what stays reserved is its base (weights, optimizer state).

        Emptied, the cache no longer holds an earlier, larger need: the next peak of reserved memory is the interval's.
        """
        assert self.probe is not None
        self.probe.empty_cache()
        self.probe.reset_peak()
        # the base is what live tensors hold, not what stays reserved: a segment a live tensor holds keeps its free
        # room reserved, the next step's activations fill that room first, and a reserved base would under-state the
        # slope (to nothing when they fit in it) and so over-state the size that fits
        allocated = getattr(self.probe, "allocated_bytes", None)
        self._base = float(allocated() if callable(allocated) else self.probe.peak_bytes())

    def _set_batch_size(self, trainer: pl.Trainer, batch_size: int) -> None:
        """Use ``batch_size``; unless the effective batch is held, the sampler's steps and the schedules follow."""
        self.batch_size = batch_size
        if self.keep != "effective" and self._sampler is not None:
            self._sampler.batch_size = self._window_size()
            self._update_epoch_length(trainer)
            retarget_schedules(trainer, self._sampler.epoch_samples(), self._window_size(), self._batches_done)

    def _metrics(self) -> dict[str, float]:
        """The decision keys, logged every ``log_every_n_steps`` optimizer steps."""
        metrics = {
            keys.BATCH_SIZE: float(self.batch_size or 0),
            keys.ACCUMULATE_GRAD_BATCHES: float(self.accumulate_grad_batches or 0),
            keys.EFFECTIVE_BATCH_SIZE: float(self.effective_batch_size or 0),
            keys.OOM_RECOVERIES: float(self.oom_recoveries),
        }
        if self.micro_batch_tokens is not None:
            metrics[keys.MICRO_BATCH_TOKENS] = float(self.micro_batch_tokens)
        if self.last_decision is not None and self.last_decision.predicted_fraction is not None:
            metrics[keys.PREDICTED_VRAM_FRAC] = self.last_decision.predicted_fraction
        return metrics

    # -- what the runner calls, and the module's wrapped hooks ------------------------------------------------------
    def _training_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Any:
        trainer, runner = self._trainer, self.runner
        if runner is None or trainer is None or not trainer.training or self.batch_size is None:
            return self._originals["training_step"](batch, batch_idx, *args, **kwargs)
        n = count_samples(batch)
        if n is None:
            raise TypeError(
                f"DynamicBatchSize cannot count the samples of a batch of type {type(batch).__name__}: it needs a "
                "tensor whose first dimension is the batch"
            )
        self._step_args = (batch_idx, args, kwargs)
        deciding = runner.agree is not None and self._steps + 1 >= self.adjust_every
        self.step_tokens = self.step_shapes = None
        layout = self._layout(batch)
        tokens = sample_tokens(batch, self._shift) if self.loss_weight == "tokens" else None
        size = self.batch_size
        if layout is not None and self.keep == "effective":  # micro-batches become budgets of padded tokens
            size = self.tokens.start(layout.padded, size, agree=self._max_over_ranks)
            runner.min_size, runner.min_samples = self.tokens.controller.min_batch_size, self.min_batch_size
        if self._gathered is not None:
            self._gathered.begin()
        with self._step_logs(trainer.lightning_module):
            outcome = runner.run(
                batch,
                [0.0, 0.0, 0.0, 0.0],
                lambda b, budget: self._cut(b, n, budget, layout, tokens),
                size,
                leave_last_backward=trainer.world_size > 1 and self._gathered is None,
                payload_fn=self._interval_figures if deciding else None,
            )
        if deciding and not outcome.failures:  # after a failure the interval starts again
            self._figures = outcome.payload
        if self._gathered is not None:  # agreed: every backward ran, so reduce the gradients and reshard
            self._gathered.reduce()
        return outcome.output  # DDP: the last backward is Lightning's; else every backward ran (the loss is detached)

    def _cut(
        self, batch: Any, n: int, size: int, layout: PaddingLayout | None, tokens: Sequence[int] | None
    ) -> list[MicroBatch]:
        """The step's micro-batches with their weights (see ``docs/dynamic_batch.md``, "Short last batch").

        ``size`` is samples, or padded tokens when :attr:`micro_batch_tokens` is set. With a ``layout`` the samples
        are grouped by length and each micro-batch is trimmed; with ``tokens`` it weighs its share of them.
        """
        self._logs.clear()  # an attempt at the step starts: what an earlier one logged is gone
        tail, sample_weight, tail_weight = 0, 1.0 / n, 0.0
        if self.keep == "effective":
            tail, sample_weight = self._short_batch_in(n), 1.0 / self._configured_effective
            tail_weight = 1.0 / max(tail * self._user_accumulation, 1)
        if layout is None and tokens is None:
            pieces = cut_step(batch, size, sample_weight=sample_weight, tail=tail, tail_weight=tail_weight)
            self._micro_batches = len(pieces)
            return pieces
        budget = self.tokens.budget is not None and layout is not None

        def fits(length: int | None) -> int:
            return self.tokens.samples_at(size, length, n) if budget and length else size

        pieces = cut_sequences(
            batch,
            n,
            layout,
            fits,
            sample_weight=sample_weight,
            tail=tail,
            tail_weight=tail_weight,
            tokens=tokens,
            multiple=self.pad_to_multiple_of,
        )
        if layout is not None:
            run = [(p.samples, p.seq_len or layout.padded) for p in pieces]
            self.step_shapes, self.step_tokens = run, (sum(layout.lengths), sum(b * length for b, length in run))
            self.shapes.update(run)
            if self._compiled:  # one graph for every shape instead of one per shape (and a fall back to eager)
                for piece, key, dim in itertools.product(pieces, layout.keys, (0, 1)):
                    torch._dynamo.maybe_mark_dynamic(piece.batch[key], dim)
            if budget:
                self.batch_size = max(b for b, _ in run)
            self._check_recompiles()
        self._micro_batches = len(pieces)
        return pieces

    @contextlib.contextmanager
    def _step_logs(self, module: pl.LightningModule) -> Iterator[None]:
        """While a step's micro-batches run, collect what ``module`` logs; then log the step's value of each key once.

        ``self.log`` inside the step goes to :class:`~lightning_tune.batch.StepLogs` (the instance's ``log``, never
        its class's), with each micro-batch weighted as its loss: the logged value is the step's, as without the cut,
        and Lightning's epoch aggregate counts the step once, at the step's batch size.
        """
        original = module.log
        signature = inspect.signature(original)

        def collect(*args: Any, **kwargs: Any) -> None:
            options = dict(signature.bind(*args, **kwargs).arguments)
            name, value = options.pop("name"), options.pop("value")
            if not self._logs.add(name, value, options):
                original(name, value, **options)  # a torchmetrics metric accumulates by itself

        own = vars(module).get("log")
        module.log = collect  # type: ignore[method-assign]
        try:
            yield
        finally:
            if own is None:
                del module.log
            else:
                module.log = own  # type: ignore[method-assign]
        for name, value, options in self._logs.values():
            original(name, value, **options)
        self._logs.clear()

    def _layout(self, batch: Any) -> PaddingLayout | None:
        """The step's padding layout; an unknown sequence key is warned about once per fit."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            layout = padding_layout(batch, self.trim_keys)
        if caught and not self._layout_warned:
            self._layout_warned = True
            rank_zero_warn(f"DynamicBatchSize: {caught[0].message}")
        return layout

    def _check_recompiles(self) -> None:
        """Warn once when a compiled module has seen nearly as many shapes as Dynamo compiles before giving up."""
        if not self._compiled or self._compile_warned:
            return
        config = torch._dynamo.config
        limit = int(getattr(config, "recompile_limit", 0) or getattr(config, "cache_size_limit", 8))
        if config.automatic_dynamic_shapes or len(self.shapes) < max(limit - 2, 1):
            return
        self._compile_warned = True
        rank_zero_warn(
            f"DynamicBatchSize: the compiled model has run {len(self.shapes)} micro-batch shapes (samples x padded "
            f"length) and torch._dynamo's recompile limit is {limit}; past it the model runs eagerly. Turn on "
            "torch._dynamo.config.automatic_dynamic_shapes, raise `pad_to_multiple_of` (fewer lengths) or raise "
            "torch._dynamo.config.recompile_limit"
        )

    def _short_batch_in(self, n: int) -> int:
        """Samples of the DataLoader's short last batch of the epoch inside this window of ``n`` (0 if none)."""
        sampler = self._sampler
        if sampler is None or sampler.drop_last:
            return 0
        total = sampler.epoch_samples()
        short = total % self._user_batch_size
        return short if short and self._consumed + n == total and n >= short else 0

    def _forward(self, piece: MicroBatch) -> Any:
        self.tokens.largest = max(self.tokens.largest, piece.samples * (piece.seq_len or 1))
        if self.probe is not None:
            self.probe.before_micro_batch(piece.samples, piece.seq_len)
        self._logs.weight = piece.weight  # what it logs weighs as its loss
        batch_idx, args, kwargs = self._step_args
        return self._originals["training_step"](piece.batch, batch_idx, *args, **kwargs)

    def _backward_micro_batch(self, loss: Tensor) -> None:
        trainer = self._trainer
        assert trainer is not None
        device = trainer.strategy.root_device.type
        # Lightning runs backward outside autocast; this one runs inside training_step
        autocast_off = torch.autocast(device_type=device, enabled=False) if torch.is_autocast_enabled(device) else None
        with autocast_off or contextlib.nullcontext():
            trainer.strategy.backward(loss, trainer.optimizers[0] if trainer.optimizers else None)

    def _backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        if self.runner is not None and not loss.requires_grad:  # the runner ran every backward of the step
            return None
        try:
            return self._originals["backward"](loss, *args, **kwargs)
        except (torch.OutOfMemoryError, RuntimeError) as err:
            trainer = self._trainer
            # DDP's last backward, which reduces the gradients; the runner's own backward passes run without sync
            reducing = (
                trainer is not None
                and trainer.world_size > 1
                and getattr(trainer.strategy.model, "require_backward_grad_sync", False)
            )
            if self.runner is None or not reducing or self._gathered is not None or not is_allocation_failure(err):
                raise  # the runner recovers
            message = str(err).splitlines()[0]
        raise torch.OutOfMemoryError(
            f"DynamicBatchSize: out of memory in the last micro-batch's backward, where the gradients are reduced "
            f"across ranks ({message}); it cannot be agreed with the other ranks, so training stops. Lower "
            "`target_vram` or `max_batch_size`, or keep memory free with `reserve_gib`"
        )

    def _optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        """Lightning zeroes gradients between ``training_step`` and backward: the runner zeroes them instead."""
        if self.batch_size is None:  # not driving yet (BatchSizeFinder's trials run before training starts)
            self._originals["optimizer_zero_grad"](epoch, batch_idx, optimizer)

    def _zero_grad(self) -> None:
        trainer = self._trainer
        assert trainer is not None
        batch_idx = self._step_args[0]
        for optimizer in trainer.optimizers:
            self._originals["optimizer_zero_grad"](trainer.current_epoch, batch_idx, optimizer)
        if self._gathered is not None:
            self._gathered.drop_grads()

    def _shrink(self, failed: int) -> int:
        trainer = self._trainer
        assert trainer is not None
        if self.probe is None:
            raise torch.OutOfMemoryError(
                f"DynamicBatchSize: out of memory at a micro-batch of {self._unit(failed)}, with no memory probe to "
                "choose a smaller one from; lower the DataLoader's batch size or give DynamicBatchSize a probe"
            )
        if trainer.world_size > 1 and self.runner is not None and self.runner.agree is None:
            raise torch.OutOfMemoryError(
                f"DynamicBatchSize: out of memory at a micro-batch of {self._unit(failed)}; without `sync_oom` an "
                "out-of-memory error cannot be recovered under several processes"
            )
        capacity, budget = self._budget()
        self.tokens.largest = 0
        if self.tokens.budget is not None:
            smaller = self.tokens.on_oom(failed, self._configured_effective, total_bytes=capacity, budget_bytes=budget)
        else:
            smaller = self.controller.on_oom(failed, total_bytes=capacity, cap=self._cap(), budget_bytes=budget)
            self._set_batch_size(trainer, smaller)
        self.last_decision = Decision(smaller, None, "oom")
        self.probe.reset_peak()
        self._steps, self._figures, self._val_figures = 0, None, (0, False)
        return smaller

    def _free_after_failure(self) -> None:
        if self.probe is not None:
            self.probe.free()
        if self._gathered is not None:  # every rank, after the agreement: FSDP2 starts the step again
            self._gathered.recover()

    def _on_failure(self, old: int, new: int, message: str) -> None:
        self.oom_recoveries += 1
        rank_zero_warn(
            f"DynamicBatchSize: out of memory at a micro-batch of {self._unit(old)} ({message}); recovered: running "
            f"the same step again at {self._unit(new)}"
        )
        rank_zero_info(f"DynamicBatchSize: micro-batch {self._unit(old)} -> {self._unit(new)} (oom)")

    def _unit(self, size: int) -> str:
        """A micro-batch size with its unit: padded tokens under a token budget, else samples."""
        return f"{size} padded tokens" if self.tokens.budget is not None else f"{size} samples"

    # -- checkpoints -------------------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "batch_size": self.batch_size,
            "user_batch_size": self._user_batch_size,
            "user_accumulation": self._user_accumulation,
            "lr_factor": self._lr_factor,
            "oom_recoveries": self.oom_recoveries,
            "decisions": self.decisions,
            "steps": self._steps,
            "controller": self.controller.state_dict(),
            "consumed": self._consumed,
            "batches_done": self._batches_done,
            "order": None,
            "epoch": None,  # the epoch `consumed` counts in
            "seed": self._seed,
            "arguments": self._arguments(),
            **self.tokens.state_dict(),  # micro_batch_tokens, longest, token_controller
        }
        trainer = self._trainer
        if trainer is not None:
            state["epoch"] = trainer.current_epoch
        if self._sampler is not None and trainer is not None and trainer.world_size == 1:
            state["order"] = self._sampler.saved_order()
        return state

    def _arguments(self) -> dict[str, Any]:
        """The arguments as a checkpoint records them."""
        values = {name: getattr(self, name) for name in _RESUMED_ARGUMENTS}
        return {**values, "min_change": self.controller.min_change, "trim_keys": list(self.trim_keys)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # a checkpoint saved before training started (as BatchSizeFinder saves one to go back to) holds nothing
        if state_dict.get("batch_size") is not None:
            self._restore = dict(state_dict)

    def _apply_restore(self, trainer: pl.Trainer, sampler: ResizableBatchSampler) -> bool:
        """Restore the checkpoint's state; whether Lightning goes on with the epoch after the checkpoint's."""
        state, self._restore = self._restore, None
        assert state is not None
        saved = (state["user_batch_size"], state["user_accumulation"])
        if saved != (self._user_batch_size, self._user_accumulation):  # the run's configuration wins
            rank_zero_warn(
                f"DynamicBatchSize: the checkpoint was trained with DataLoader batch {saved[0]} x "
                f"accumulate_grad_batches {saved[1]}; this run configures {self._user_batch_size} x "
                f"{self._user_accumulation}, which is used from here on"
            )
        limits = [x for x in (state["batch_size"], self._cap(), self.max_batch_size) if x is not None]
        self.batch_size = max(self.min_batch_size, min(limits))  # the arguments of this run win
        before, now = state.get("arguments", {}), self._arguments()
        changed = [f"{k} {before[k]!r} -> {v!r}" for k, v in now.items() if k in before and before[k] != v]
        if changed:
            moved = f"; micro-batch {state['batch_size']} -> {self.batch_size}"
            rank_zero_warn(
                "DynamicBatchSize: resumed with other arguments than the checkpoint's, which are used from here on: "
                + ", ".join(changed)
                + (moved if self.batch_size != state["batch_size"] else "")
            )
        self._lr_factor, self._steps = state["lr_factor"], state["steps"]
        if self.keep != "lr" and self._lr_factor != 1.0:  # the checkpoint's LR was scaled to its batch: undo that
            scale_learning_rates(trainer, 1.0 / self._lr_factor)
            self._lr_factor = 1.0
        self.oom_recoveries, self.decisions = state["oom_recoveries"], state.get("decisions", 0)
        self.controller.load_state_dict(state["controller"])
        self.tokens.load_state_dict(state)
        sampler.batch_size = self._window_size()
        if state.get("seed") is not None:
            self._seed = sampler.seed = state["seed"]
        # Lightning resumes the epoch the position counts in, or, from a checkpoint at an epoch's last batch, the next
        if state.get("epoch") is None:  # saved before the epoch was: an epoch whose samples were all trained has ended
            total = sampler.epoch_samples() if state["order"] is None else len(state["order"])
            same_epoch = state["consumed"] < total
        else:
            same_epoch = state["epoch"] == trainer.current_epoch
        if trainer.fit_loop.restarted_mid_epoch and same_epoch and state["consumed"]:  # skip what was trained
            order = state["order"]
            sampler.resume(
                state["consumed"], state["batches_done"], None if order is None else [int(i) for i in order.tolist()]
            )
            self._consumed, self._batches_done = state["consumed"], state["batches_done"]
            # Lightning then warns that the DataLoader is not resumable: the sampler resumes it, so silence that
            warnings.filterwarnings("ignore", message=_NOT_RESUMABLE)
            self._quiet = warnings.filters[0]
        return trainer.fit_loop.restarted_mid_epoch and not same_epoch

    def _unquiet(self) -> None:
        if self._quiet is not None:
            with contextlib.suppress(ValueError):
                warnings.filters.remove(self._quiet)  # type: ignore[attr-defined]
            warnings._filters_mutated()  # type: ignore[attr-defined]
            self._quiet = None


def _check_sharded_strategy(strategy: Any) -> bool:
    """Whether ``strategy`` is FSDP2 (data-parallel ``ModelParallelStrategy``); refuse the sharded ones it cannot drive.

    Raises:
        MisconfigurationException: Under ``FSDPStrategy``, or ``ModelParallelStrategy`` with tensor parallelism,
            whose forward passes run collectives that cannot be taken out of the micro-batches.
    """
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    if isinstance(strategy, FSDPStrategy):
        raise MisconfigurationException(
            "DynamicBatchSize cannot drive FSDPStrategy: its forward all-gathers each wrapped module's parameters, so "
            "an out-of-memory error on one rank would leave the others waiting in the next all-gather. Use "
            "ModelParallelStrategy with a `configure_model` that calls `fully_shard` (FSDP2), where DynamicBatchSize "
            "gathers the parameters once per step and the ranks agree before any collective, or DDP"
        )
    if not isinstance(strategy, ModelParallelStrategy):
        return False
    tensor_parallel = getattr(strategy, "_tensor_parallel_size", 1)
    if tensor_parallel not in (1, "auto"):
        raise MisconfigurationException(
            f"DynamicBatchSize cannot drive ModelParallelStrategy with tensor_parallel_size={tensor_parallel}: tensor "
            "parallelism runs collectives inside every forward, so an out-of-memory error on one rank would leave the "
            "others waiting in one. Use tensor_parallel_size=1 (FSDP2 only) or DDP"
        )
    return True


def _causal_lm_shift(module: torch.nn.Module) -> int:
    """1 when ``module`` holds a Hugging Face causal LM (its loss shifts labels, as the HF Trainer decides), else 0."""
    try:
        from transformers import PreTrainedModel
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return 0
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    for sub in module.modules():
        if isinstance(sub, PreTrainedModel):  # the outermost: a causal LM's inner decoder is no LM of its own
            return int(type(sub).__name__ in causal)
    return 0


def _has_compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` runs compiled code: a ``torch.compile``d submodule or a TorchCompile-compiled forward."""
    from lightning_tune.swaps.compile import is_compiled

    return any(isinstance(m, torch._dynamo.eval_frame.OptimizedModule) or is_compiled(m) for m in module.modules())
