"""DynamicBatchSize: the Lightning wiring of :class:`~lightning_tune.batch.step.DynamicStep` (see its docs page).

The DataLoader's ``BatchSampler`` becomes a :class:`~lightning_tune.batch.sampler.ResizableBatchSampler` handing out
whole optimizer steps, and the module's ``training_step`` hands each step to the engine.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader
from typing_extensions import override

from lightning_tune import keys
from lightning_tune.batch import runner as micro, step as engine
from lightning_tune.batch.control import BatchSizeController, Decision
from lightning_tune.batch.evaluate import EvalSizer
from lightning_tune.batch.logs import StepLogs
from lightning_tune.batch.probes import MemoryProbe
from lightning_tune.batch.sampler import ResizableBatchSampler
from lightning_tune.batch.sharded import GatheredStep
from lightning_tune.batch.step import KEEPS, LOSS_WEIGHTS, Keep, LossWeight, Weighting
from lightning_tune.batch.tokens import TokenBudget
from lightning_tune.callbacks import _dynamic_batch_plumbing as plumbing, _resizable_loader as loaders
from lightning_tune.callbacks._dynamic_batch_plumbing import Engine
from lightning_tune.callbacks._logging import log, log_every_n_steps
from lightning_tune.lr.scaling import ScaleRule
from lightning_tune.perf.batch import LAST_BATCH
from lightning_tune.perf.step_run import StepRun
from lightning_tune.plan.estimate import MemoryEstimate

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["KEEPS", "LOSS_WEIGHTS", "DynamicBatchSize", "Keep", "LossWeight"]


_EVAL_STEPS = {"validate": "validation_step", "test": "test_step", "predict": "predict_step"}


class DynamicBatchSize(Callback):
    r"""Adjust the micro-batch size while training runs to keep peak device memory at ``target_vram``.

    Args:
        target_vram: Fraction of the memory PyTorch can get (re-read at every decision) to fill, in (0, 0.98].
        min_batch_size: Smallest micro-batch it may use.
        max_batch_size: Largest micro-batch it may use (``None``: as large as memory and ``keep`` allow).
        adjust_every: Optimizer steps between decisions.
        keep: What stays constant: ``"effective"``, ``"lr"`` or ``"none"``. See "What keep means" in the docs.
        lr_rule: ``"sqrt"`` or ``"linear"``, as :func:`~lightning_tune.scale_lr` (used with ``keep="lr"``).
        multiple_of: Micro-batch sizes at or above this are multiples of it.
        probe: Where memory is read (``None``: ``CudaMemory`` on a CUDA device). See "Which probe to use" in the docs.
        prior: A ``MemoryEstimate`` to start the memory model from (the first decision need not probe).
        min_change: Smallest relative growth worth a change.
        sync_oom: Under DDP and FSDP2, agree on allocation failures across ranks (one small all-reduce per optimizer
            step). Without it an OOM under DDP cannot be recovered; FSDP2 requires it.
        reserve_gib: Memory (GiB) kept free whatever ``target_vram`` says, for other processes on a shared GPU.
        agree_timeout: Seconds a rank waits for the others' agreement before failing with a clear error.
        loss_weight: ``"samples"``, ``"tokens"`` or ``"auto"`` (:attr:`weighting`). See "Which run the defaults equal".
        label_shift: Leading positions never a target, when weighting by tokens (``None``: 1 for a causal LM, else 0).
        trim_keys: Batch keys besides Hugging Face's (``input_ids``, ``attention_mask``, ``labels``,
            ``token_type_ids``, ``position_ids``) whose second dimension is the padded sequence, trimmed with them.
        pad_to_multiple_of: Trimmed lengths are rounded up to a multiple of this (few ``torch.compile`` shapes).
        per_batch: Mapping keys or places (``"batch[2]"``) given whole to each micro-batch. See "Batches the pack cuts".
        split_batch: ``split_batch(batch, sizes) -> pieces`` cuts batches the rule refuses. See "Batches the pack cuts".
        pack: Padding-free micro-batches, each one row of its samples' real tokens. See "Packing" in the docs.
        pack_guard: With ``pack``, check the fit's first packed micro-batch's loss against its samples padded.
        size_eval: Size evaluation batches to memory too (with a memory probe). See "Evaluation" in the docs.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range, or arguments conflict (``min_batch_size > max_batch_size``,
            ``label_shift`` with ``loss_weight="samples"``, ``pack`` with another ``keep``, ``loss_weight="samples"`` or
            a ``split_batch``); at the start of training, if ``reserve_gib`` is all the device has.
        ~lightning_tune.batch.pack.PackingError: With ``pack``, at the first packed micro-batch, if its loss is not
            its samples' padded loss.

    Example:
        >>> from lightning_tune import DynamicBatchSize, SimulatedMemory
        >>> DynamicBatchSize(target_vram=0.9, min_batch_size=8, max_batch_size=64, adjust_every=100)
        DynamicBatchSize(target_vram=0.9, min_batch_size=8, max_batch_size=64, adjust_every=100, keep='effective')
    """

    # the arguments (settings), state and figures kept by the engine (:class:`~lightning_tune.batch.step.DynamicStep`)
    target_vram: Engine[float] = Engine(setting=True)
    min_batch_size: Engine[int] = Engine(setting=True)
    max_batch_size: Engine[int | None] = Engine(setting=True)
    adjust_every: Engine[int] = Engine(setting=True)
    keep: Engine[Keep] = Engine(setting=True)
    lr_rule: Engine[ScaleRule] = Engine(setting=True)
    multiple_of: Engine[int] = Engine(setting=True)
    reserve_gib: Engine[float] = Engine(setting=True)
    loss_weight: Engine[LossWeight] = Engine(setting=True)
    weighting: Engine[Weighting | None] = Engine()
    label_shift: Engine[int | None] = Engine(setting=True)
    pad_to_multiple_of: Engine[int] = Engine(setting=True)
    sync_oom: Engine[bool] = Engine(setting=True)
    agree_timeout: Engine[float] = Engine(setting=True)
    probe: Engine[MemoryProbe | None] = Engine()
    trim_keys: Engine[tuple[str, ...]] = Engine(setting=True)
    pack: Engine[bool] = Engine(setting=True)
    pack_guard: Engine[bool] = Engine(setting=True)
    size_eval: Engine[bool] = Engine(setting=True)
    controller: Engine[BatchSizeController] = Engine()
    tokens: Engine[TokenBudget] = Engine()
    batch_size: Engine[int | None] = Engine()
    oom_recoveries: Engine[int] = Engine()
    decisions: Engine[int] = Engine()
    last_decision: Engine[Decision | None] = Engine()
    step_tokens: Engine[tuple[int, int] | None] = Engine()
    step_shapes: Engine[list[tuple[int, int]] | None] = Engine()
    shapes: Engine[set[tuple[int, int]]] = Engine()
    micro_batches: Engine[int] = Engine()
    effective_batch_size: Engine[int | None] = Engine()
    micro_batch_tokens: Engine[int | None] = Engine()
    token_controller: Engine[BatchSizeController | None] = Engine()
    accumulate_grad_batches: Engine[int | None] = Engine()

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
        loss_weight: LossWeight = "auto",
        label_shift: int | None = None,
        trim_keys: Sequence[str] = (),
        pad_to_multiple_of: int = 8,
        per_batch: Sequence[str] = (),
        split_batch: Callable[[Any, list[int]], Sequence[Any]] | None = None,
        pack: bool = False,
        pack_guard: bool = True,
        size_eval: bool = True,
    ) -> None:
        knobs = {k: v for k, v in locals().items() if k not in ("self", "__class__", "probe")}
        settings = engine.DynamicBatchSettings(**knobs)  # checked here, at construction
        self.step = engine.DynamicStep(settings, probe=probe, warn=rank_zero_warn, info=rank_zero_info)
        self.runner: micro.MicroBatchRunner | None = None
        self._trainer: pl.Trainer | None = None
        self._sampler: ResizableBatchSampler | None = None
        self._loader: DataLoader | None = None
        self._original_batch_sampler: BatchSampler | None = None
        self._originals: dict[str, Callable[..., Any]] = {}
        self._restore: dict[str, Any] | None = None  # state from a checkpoint, applied at train start
        self._seed: int | None = None  # a shuffling sampler's base seed: epoch e draws with seed + e
        self._installed_epoch = -1
        self._quiet: Any = None  # the warnings filter silencing Lightning's false "not resumable" warning
        self._step_args: tuple[int, tuple[Any, ...], dict[str, Any]] = (0, (), {})
        self._gathered: GatheredStep | None = None  # FSDP2: parameters gathered once per step
        self._agree: Callable[[Sequence[float]], list[float]] = list  # the maximum over ranks
        self._logs = StepLogs()  # what the step's micro-batches log with self.log
        self._eval_originals: dict[str, Callable[..., Any]] = {}  # the module's evaluation steps, and their loaders'
        self._eval_loaders: list[tuple[DataLoader, Any]] = []  # batch samplers as given
        self._eval: tuple[str, EvalSizer, Any, DataLoader | None] | None = None  # the running loop, its sizer, loader
        self._eval_metrics: dict[str, float] = {}

    @property
    def metrics(self) -> dict[str, float]:
        """The decision keys of training, and ``tune/eval_batch_size`` of the last evaluation loop."""
        return {**self.step.metrics(), **self._eval_metrics}

    def __repr__(self) -> str:  # target_vram, min_batch_size, max_batch_size, adjust_every, keep
        shown = ", ".join(f"{name}={value!r}" for name, value in list(self.step.arguments().items())[:5])
        return f"{type(self).__name__}({shown})"

    def last_step_run(self) -> StepRun | None:
        """The micro-batches of the last training step (:class:`~lightning_tune.perf.step_run.StepRunSource`)."""
        return None if self.runner is None else self.step.step_run()

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer
        self._agree = functools.partial(plumbing.max_over_ranks, trainer, timeout=self.agree_timeout)
        if stage != "fit":
            if self.size_eval and (self.probe is not None or trainer.strategy.root_device.type == "cuda"):
                self.step.probe = plumbing.choose_probe(self.step.probe, trainer)
                self._wrap_eval(pl_module, _EVAL_STEPS[stage])
            return
        self.step.probe = plumbing.choose_probe(self.step.probe, trainer)
        agreeable, fsdp2 = plumbing.check_strategy(trainer, pl_module, self.sync_oom)
        if self.size_eval and self.probe is not None:
            self._wrap_eval(pl_module, "validation_step")
        # FSDP2: the parameters are gathered once per step, so the micro-batches run with no collective
        self._gathered = GatheredStep(pl_module) if fsdp2 else None
        self.runner = micro.MicroBatchRunner(
            forward=self._forward,
            backward=functools.partial(plumbing.micro_batch_backward, trainer),
            zero_grad=self._zero_grad,
            free=self._free_after_failure,
            shrink=self._shrink,
            min_size=self.min_batch_size,
            # without a memory target nothing is decided and no out-of-memory error recovered: nothing to agree on
            agree=self._agree if agreeable and self.sync_oom and self.probe else None,
            no_sync=getattr(trainer.strategy, "block_backward_sync", contextlib.nullcontext),
            on_failure=self.step.on_failure,
        )
        self.step.recoverable = trainer.world_size == 1 or self.runner.agree is not None
        for name in ("training_step", "backward", "optimizer_zero_grad"):  # the instance's, not its class's
            self._originals[name] = getattr(pl_module, name)
            setattr(pl_module, name, getattr(self, f"_{name}"))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        LAST_BATCH.clear()  # the last batch counted holds device memory: let it go with the run
        for name in [*self._eval_originals, *(self._originals if stage == "fit" else ())]:
            with contextlib.suppress(AttributeError):
                delattr(pl_module, name)  # back to the class's method
        for loader, given in self._eval_loaders:  # a DataLoader the module keeps comes back as it was given
            loaders.set_batch_sampler(loader, given)
        self._eval_originals.clear()
        self._eval_loaders.clear()
        if stage != "fit":
            return
        self._originals.clear()
        micro.undo_retry_steps(trainer.optimizers)
        if self.runner is not None:
            trainer.accumulate_grad_batches = self.step.user_accumulation
        if self._loader is not None and self._original_batch_sampler is not None:
            # a DataLoader the module or DataModule keeps must come back as it was given
            loaders.set_batch_sampler(self._loader, self._original_batch_sampler)
        self._loader = self._sampler = self._original_batch_sampler = self.runner = self._gathered = self._seed = None
        loaders.unsilence(self._quiet)
        self._quiet = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.runner is None:
            return
        self.step.start(pl_module, int(trainer.accumulate_grad_batches))
        self._install(trainer)
        if self.probe is not None:
            micro.retry_steps(trainer.optimizers, free=self.probe.free, warn=rank_zero_warn)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.runner is None:
            return
        loader = loaders.train_loader(trainer)
        self.step.consumed = self.step.batches_done = 0  # not called when a run resumes mid-epoch
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
        if self.runner is not None and self.probe is not None and trainer.state.fn == "fit":
            self.step.validation_starts()
        self._eval_start(trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_end(trainer)
        if self.runner is not None and self.probe is not None and trainer.state.fn == "fit":
            self.step.validation_ends()

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_start(trainer)

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_end(trainer)

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_start(trainer)

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_end(trainer)

    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, *_: Any) -> None:
        self._eval_batch_end()

    @override
    def on_test_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, *_: Any) -> None:
        self._eval_batch_end()

    @override
    def on_predict_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, *_: Any) -> None:
        self._eval_batch_end()

    # -- evaluation: the loop's loader made resizable, its batches run by the engine -----------------------------------
    def _wrap_eval(self, pl_module: pl.LightningModule, name: str) -> None:
        from lightning.pytorch.utilities.model_helpers import is_overridden
        from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

        if name in self._eval_originals or (name != "predict_step" and not is_overridden(name, pl_module)):
            return
        original = self._eval_originals[name] = getattr(pl_module, name)
        takes_idx = is_param_in_hook_signature(original, "batch_idx", min_args=2)
        setattr(pl_module, name, functools.partial(self._evaluate, name, takes_idx))

    def _eval_start(self, trainer: pl.Trainer) -> None:
        self._eval = None
        if not self._eval_originals or trainer.sanity_checking:
            return
        name, loop = loaders.eval_loop(trainer)
        sizer = self.step.eval_sizer(name)
        parts = loaders.eval_loader(trainer, loop)
        if parts is None:  # several loaders, limited batches, a custom batch sampler: the loader's batch is kept
            sizer.begin(loader_batch=loaders.eval_batch(loop), fixed=True, agree=self._agree)
            self._eval = (name, sizer, loop, None)
            return
        loader, original, given = parts
        if original is not None:  # the loader as set up: its batch sampler becomes resizable
            self._eval_loaders.append((loader, given))
            loaders.set_eval_sampler(loader, given, original)
        sampler = loaders.unwrapped(loader.batch_sampler)
        start, samples = self.step.eval_start(), sampler.epoch_samples()
        sizer.begin(loader_batch=sampler.granule, samples=samples, start=start, agree=self._agree)
        restart = original is not None or sampler.batch_size != sizer.size
        sampler.batch_size = sizer.size or sampler.granule
        if restart:
            loaders.set_eval_length(loop, loader, restart=True)
        self._eval = (name, sizer, loop, loader)

    def _eval_batch_end(self) -> None:
        if self._eval is None:
            return
        _, sizer, loop, loader = self._eval
        if sizer.batch_end(self._agree) and loader is not None and sizer.size is not None:
            loaders.unwrapped(loader.batch_sampler).batch_size = sizer.size
            loaders.set_eval_length(loop, loader, restart=False)

    def _eval_end(self, trainer: pl.Trainer) -> None:
        if self._eval is None:
            return
        name, sizer, _, _ = self._eval
        self._eval = None
        sizer.end(self._agree)
        self._eval_metrics = {} if sizer.size is None else {keys.EVAL_BATCH_SIZE: float(sizer.size)}
        log(trainer, self._eval_metrics)  # at the step Lightning logs the loop's own values
        if name != "fit":
            rank_zero_info(
                f"DynamicBatchSize: {name} settled at batches of {sizer.size} samples; {sizer.decisions} "
                f"decision{'s' * (sizer.decisions != 1)}, {sizer.oom_recoveries} out-of-memory "
                f"error{'s' * (sizer.oom_recoveries != 1)} recovered"
            )

    def _evaluate(self, name: str, takes_idx: bool, batch: Any, *args: Any, **kwargs: Any) -> Any:
        """The module's evaluation step ``name`` on ``batch``, in pieces after an out-of-memory error."""
        step, trainer = self._eval_originals[name], self._trainer
        args = args if takes_idx else args[1:]  # Lightning passes batch_idx to the wrapper
        if self._eval is None or trainer is None:
            return step(batch, *args, **kwargs)

        def piece(part: Any) -> Any:
            loaders.log_as(trainer, part)  # self.log weighs an epoch mean by the piece's samples
            return step(part, *args, **kwargs)

        try:
            return self._eval[1].run(batch, piece)
        finally:
            loaders.log_as(trainer, batch)

    def _install(self, trainer: pl.Trainer) -> None:
        loader, inner, loader_batch, drop_last, original = loaders.loader_parts(trainer)
        self._original_batch_sampler = original if original is not None else self._original_batch_sampler
        self.step.install(loader_batch)
        # Lightning limits the epoch in batches of the DataLoader's own size; the sampler limits it in samples
        batches = trainer.fit_loop.max_batches
        limit = None if trainer.limit_train_batches == 1.0 or batches == float("inf") else int(batches) * loader_batch
        if self._seed is None and hasattr(inner, "generator"):  # drawn as the sampler draws its own seed each epoch
            self._seed = int(torch.empty((), dtype=torch.int64).random_(generator=inner.generator).item())
        sampler = ResizableBatchSampler(
            inner, self.step.window_size(), drop_last=drop_last, granule=loader_batch, limit=limit, seed=self._seed
        )
        next_epoch = self._restore is not None and self._apply_restore(trainer, sampler)
        self._loader, self._sampler, self._installed_epoch = loader, sampler, trainer.current_epoch
        sampler.set_epoch(trainer.current_epoch)  # workers draw the order at once; Lightning sets the epoch only later
        loaders.set_batch_sampler(loader, sampler)
        trainer.accumulate_grad_batches = 1
        self._update_epoch_length(trainer)  # the new iterator's limits
        loaders.restart_train_iterator(trainer)
        self._update_epoch_length(trainer)  # the length the fetcher took from the old loader
        if next_epoch:
            loaders.start_epoch_from_its_first_batch(trainer)
        if self.probe is not None:
            self.step.new_interval()

    def _update_epoch_length(self, trainer: pl.Trainer) -> None:
        assert self._sampler is not None
        interval, accumulation = trainer.val_check_interval, self.step.user_accumulation
        every = interval // accumulation if isinstance(interval, int) and self.keep == "effective" else None
        loaders.set_epoch_length(trainer, len(self._sampler), every)

    def _resize(self) -> None:
        """The micro-batch in samples changed: unless the effective batch is held, the steps and schedules follow."""
        trainer, sampler, window = self._trainer, self._sampler, self.step.window_size()
        if self.keep != "effective" and sampler is not None and trainer is not None:
            sampler.batch_size = window
            self._update_epoch_length(trainer)
            loaders.retarget_schedules(trainer, sampler.epoch_samples(), window, self.step.batches_done)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        loaders.unsilence(self._quiet)  # Lightning's resume warning is behind us
        self._quiet = None
        if self.runner is not None and (ratio := self.step.lr_ratio(batch)) != 1.0:
            loaders.scale_learning_rates(trainer, ratio)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.runner is not None:
            drawn = None if self._sampler is None else self._sampler.pop_drawn()
            if self.step.step_done(batch, self.runner, agree=self._agree, drawn=drawn):
                self._resize()
            log_every_n_steps(trainer, self.step.metrics)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.runner is not None:
            rank_zero_info(self.step.summary())

    # -- the module's wrapped hooks, and what the runner calls --------------------------------------------------------
    def _training_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Any:
        trainer, runner, sampler = self._trainer, self.runner, self._sampler
        if runner is None or trainer is None or not trainer.training or self.batch_size is None:
            return self._originals["training_step"](batch, batch_idx, *args, **kwargs)
        self._step_args = (batch_idx, args, kwargs)
        if self._gathered is not None:
            self._gathered.begin()
        samples = None if sampler is None or sampler.drop_last else sampler.epoch_samples()
        last = trainer.world_size > 1 and self._gathered is None  # DDP: the last backward is Lightning's (it reduces)
        with self._logs.collecting(trainer.lightning_module):  # logged once per step, weighted as the loss
            drawn = None if sampler is None else sampler.next_drawn()  # a collate may have dropped some
            outcome = self.step.run(
                batch, runner, epoch_samples=samples, agree=self._agree, leave_last_backward=last, drawn=drawn
            )
        if self._gathered is not None:  # agreed: every backward ran, so reduce the gradients and reshard
            self._gathered.reduce()
        return outcome.output  # DDP: the last backward is Lightning's; else every backward ran (the loss is detached)

    def _forward(self, piece: micro.MicroBatch) -> Any:
        self.step.before_micro_batch(piece)
        self._logs.weight = piece.weight  # what it logs weighs as its loss
        batch_idx, args, kwargs = self._step_args
        training_step = self._originals["training_step"]
        assert self._trainer is not None
        quiet = functools.partial(_unlogged, self._trainer.lightning_module)
        return self.step.forward(piece, lambda batch: training_step(batch, batch_idx, *args, **kwargs), quiet=quiet)

    def _backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if self.runner is not None and not loss.requires_grad:  # the runner ran every backward of the step
            return None
        try:
            return self._originals["backward"](loss, *args, **kwargs)
        except (torch.OutOfMemoryError, RuntimeError) as err:
            fatal = self.runner and plumbing.last_backward_failure(self._trainer, err, self._gathered is not None)
            if not fatal:
                raise  # the runner recovers
            raise fatal from err

    def _optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        """Lightning zeroes gradients between ``training_step`` and backward: the runner zeroes them instead."""
        if self.batch_size is None:  # not driving yet (BatchSizeFinder's trials run before training starts)
            self._originals["optimizer_zero_grad"](epoch, batch_idx, optimizer)

    def _zero_grad(self) -> None:
        """Drop the step's gradients and what its micro-batches logged (an attempt at the step starts, or failed)."""
        assert self._trainer is not None
        self._logs.clear()
        for optimizer in self._trainer.optimizers:
            self._originals["optimizer_zero_grad"](self._trainer.current_epoch, self._step_args[0], optimizer)
        if self._gathered is not None:
            self._gathered.drop_grads()

    def _shrink(self, failed: int) -> int:
        smaller = self.step.shrink(failed)
        if self.micro_batch_tokens is None:
            self._resize()
        return smaller

    def _free_after_failure(self) -> None:
        if self.probe is not None:
            self.probe.free()
        if self._gathered is not None:  # every rank, after the agreement: FSDP2 starts the step again
            self._gathered.recover()

    # -- checkpoints -------------------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        trainer, sampler = self._trainer, self._sampler
        return {
            **self.step.state_dict(),  # the sizes, counters and controllers
            "order": sampler.saved_order() if sampler is not None and trainer and trainer.world_size == 1 else None,
            "epoch": None if trainer is None else trainer.current_epoch,  # the epoch `consumed` counts in
            "seed": self._seed,
            "epoch_counted": True,  # Lightning's epoch counter in the same checkpoint is right (no repair on load)
        }

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Lightning reads its loop counters after this hook: one it wrote an epoch behind is set right first
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        loaders.repair_epoch_counter(checkpoint, state, trainer.ckpt_path)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # a checkpoint saved before training started (as BatchSizeFinder saves one to go back to) holds nothing
        if state_dict.get("batch_size") is not None:
            self._restore = dict(state_dict)

    def _apply_restore(self, trainer: pl.Trainer, sampler: ResizableBatchSampler) -> bool:
        """Restore the checkpoint's state; whether Lightning goes on with the epoch after the checkpoint's."""
        state, self._restore = self._restore, None
        assert state is not None
        self.step.load_state_dict(state)  # this run's configuration wins
        if self.keep != "lr" and state["lr_factor"] != 1.0:  # the checkpoint's LR was scaled to its batch: undo that
            loaders.scale_learning_rates(trainer, 1.0 / state["lr_factor"])
        sampler.batch_size = self.step.window_size()
        # Lightning resumes the epoch the position counts in, or, from a checkpoint at an epoch's last batch, the next
        resumed, next_epoch = sampler.restore(state, trainer.current_epoch, trainer.fit_loop.restarted_mid_epoch)
        self._seed = sampler.seed
        if resumed:
            self.step.consumed, self.step.batches_done = state["consumed"], state["batches_done"]
            self._quiet = loaders.silence_not_resumable()
        return next_epoch


@contextlib.contextmanager
def _unlogged(module: pl.LightningModule) -> Iterator[None]:
    """What ``module`` logs inside is dropped (the packing guard's forwards are no training)."""
    own = vars(module).get("log")  # the instance's (StepLogs collects through it), else the class's
    module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own is None:
            del module.log
        else:
            module.log = own  # type: ignore[method-assign]
