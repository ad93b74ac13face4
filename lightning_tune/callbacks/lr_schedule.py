"""Callbacks that install a learning-rate schedule onto the optimizer a LightningModule already configured.

The module is not edited: at fit start the callback builds a :class:`~lightning_tune.lr.scheduler.ScheduleLR` for
each optimizer and registers it with the Trainer as a step-interval scheduler, so it is stepped once per optimizer
step (gradient accumulation does not speed it up), saved in checkpoints and restored on resume, and shown by
``LearningRateMonitor``.

With ``log_lr=True`` each group's LR is logged (``tune/lr...``, ``docs/logged_keys.md``) every
``log_every_n_steps`` optimizer steps, at ``global_step``: the value is the LR the step uses.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch.optim import Optimizer
from typing_extensions import override

from lightning_tune._validation import check_bool, check_choice, check_float, check_int
from lightning_tune.callbacks._logging import learning_rates, log_every_n_steps
from lightning_tune.lr.scheduler import ScheduleLR
from lightning_tune.lr.schedules import (
    ANNEAL_STRATEGIES,
    AnnealStrategy,
    LinearWarmupSchedule,
    OneCycleSchedule,
    Schedule,
    WarmupCosineSchedule,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl


def base_lrs(optimizer: Optimizer) -> list[float]:
    """The learning rate each parameter group was configured with.

    A scheduler that ran before (one being replaced) leaves the configured value in ``initial_lr``, as torch's
    schedulers do; otherwise it is the current ``lr``.

    Args:
        optimizer: The optimizer.

    Returns:
        One value per parameter group.
    """
    return [float(group.get("initial_lr", group["lr"])) for group in optimizer.param_groups]


class ScheduleCallback(Callback, ABC):
    """Base of the schedule callbacks: installs one :class:`ScheduleLR` per optimizer at fit start.

    A run resumed from a checkpoint follows the arguments it is resumed with: the same arguments continue the saved
    schedule exactly; other arguments (another schedule class, another warm-up, peak or length) replace it from the
    restored step on, with one warning naming both schedules and the LR before and after; and with
    ``total_steps=None`` a Trainer that will now run longer or shorter (a new ``max_steps``) stretches the saved
    schedule to the new length, the warm-up unchanged, with one info line naming both lengths. An explicit
    ``total_steps`` below what the Trainer will run gets one warning at fit start: the LR would sit at the schedule's
    final value for the rest of the run.

    Args:
        total_steps: Optimizer steps the schedule spans; ``None`` means what the Trainer will actually run
            (``trainer.estimated_stepping_batches``: max_steps / max_epochs, dataset length, accumulation, devices).
        replace: Replace schedulers the module itself returned from ``configure_optimizers``; without it such a
            scheduler is an error.
        log_lr: Log every parameter group's LR at each optimizer step (keys in the module docstring).
    """

    def __init__(self, *, total_steps: int | None = None, replace: bool = False, log_lr: bool = True) -> None:
        check_int("total_steps", total_steps, minimum=1, allow_none=True)
        check_bool("replace", replace)
        check_bool("log_lr", log_lr)
        self.total_steps = total_steps
        self.replace = replace
        self.log_lr = log_lr
        self.schedulers: list[ScheduleLR] = []
        self._planned: int | None = None  # the Trainer's run length the schedules were resolved for, if it decided
        self._saved_planned: int | None = None  # the same, read from a checkpoint
        self._warned_restore = False

    @abstractmethod
    def build_schedule(self, optimizer: Optimizer, total_steps: int) -> Schedule:
        """Resolve the schedule for one optimizer.

        Args:
            optimizer: The optimizer, with the learning rates the module configured.
            total_steps: Resolved schedule length in optimizer steps.

        Returns:
            The schedule.
        """

    def resolve_total_steps(self, trainer: pl.Trainer) -> int:
        """Schedule length: ``total_steps`` if given, else what the Trainer will run.

        Args:
            trainer: The Trainer.

        Returns:
            The number of optimizer steps.

        Raises:
            MisconfigurationException: If the Trainer's run length is unbounded and ``total_steps`` was not given.
        """
        if self.total_steps is not None:
            return self.total_steps
        estimated = trainer.estimated_stepping_batches
        if not math.isfinite(estimated) or estimated < 1:
            raise MisconfigurationException(
                f"{type(self).__name__} could not tell how many optimizer steps this run will take "
                f"(the Trainer estimates {estimated}). Pass `total_steps=` to {type(self).__name__}, "
                "or bound the run with `max_steps` or `max_epochs`."
            )
        return int(estimated)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        name = type(self).__name__
        if not pl_module.automatic_optimization:
            raise MisconfigurationException(
                f"{name} schedules automatic optimization, but {type(pl_module).__name__} uses manual optimization, "
                "where Lightning leaves stepping schedulers to the module. Return "
                "`lightning_tune.lr.ScheduleLR(optimizer, schedule)` from `configure_optimizers` and step it "
                "yourself instead."
            )
        optimizers = list(trainer.optimizers)
        if not optimizers:
            raise MisconfigurationException(f"{name} found no optimizer: `configure_optimizers` returned none.")
        kept: list[LRSchedulerConfig] = []
        for config in trainer.lr_scheduler_configs:
            if not any(config.scheduler.optimizer is optimizer for optimizer in optimizers):
                kept.append(config)
                continue
            if not self.replace:
                raise MisconfigurationException(
                    f"{type(pl_module).__name__}.configure_optimizers already returns a learning-rate scheduler "
                    f"({type(config.scheduler).__name__}); {name} would fight it. Remove that scheduler, or pass "
                    f"`replace=True` to {name} to use {name}'s schedule instead."
                )
        total_steps = self.resolve_total_steps(trainer)
        self._planned = total_steps if self.total_steps is None else None
        self._warned_restore = False
        self.schedulers = [
            ScheduleLR(optimizer, self.build_schedule(optimizer, total_steps), on_restore=self._on_restore)
            for optimizer in optimizers
        ]
        if self.total_steps is not None:
            self._warn_if_shorter_than_run(trainer)
        # Lightning's own LearningRateFinder installs schedulers this way; configs are saved and restored by position.
        trainer.strategy.lr_scheduler_configs = kept + [
            LRSchedulerConfig(scheduler, interval="step", frequency=1) for scheduler in self.schedulers
        ]

    def _warn_if_shorter_than_run(self, trainer: pl.Trainer) -> None:
        """One warning when an explicit ``total_steps`` ends before the Trainer's run does."""
        assert self.total_steps is not None
        run = trainer.estimated_stepping_batches
        if not math.isfinite(run) or self.total_steps >= run:
            return
        final = self.schedulers[0].schedule.lr_at(self.total_steps, 0)
        rank_zero_warn(
            f"{type(self).__name__}(total_steps={self.total_steps}) ends after {self.total_steps} optimizer steps, but "
            f"the Trainer will run {int(run)}: the last {int(run) - self.total_steps} steps stay at the schedule's "
            f"final LR ({final:.3g}). Leave `total_steps=None` to span the whole run, or shorten the run.",
            category=UserWarning,
        )

    def _on_restore(self, saved: Schedule, configured: Schedule, step: int) -> Schedule:
        """Choose the schedule a resumed run follows (the ``on_restore`` hook of the installed schedulers)."""
        if saved == configured:
            return saved
        name = type(self).__name__
        if self._planned is not None and type(saved) is type(configured):
            ignored = {"total_steps"} | ({"warmup_steps"} if getattr(self, "warmup_ratio", None) is not None else set())
            if _fields(saved, ignored) == _fields(configured, ignored):  # the same arguments: only the length differs
                if self._saved_planned == self._planned:
                    return saved  # the Trainer's length is unchanged; the saved one may have been retargeted since
                resized = _with_length(saved, self._planned, step)
                rank_zero_info(
                    f"{name}: the run now takes {self._planned} optimizer steps, and the checkpoint's schedule "
                    f"ended at step {saved.total_steps}; it follows the new length from step {step} on (warm-up "  # type: ignore[attr-defined]
                    "unchanged)."
                )
                return resized
        if not self._warned_restore:
            self._warned_restore = True
            before, after = saved.lr_at(step, 0), configured.lr_at(step, 0)
            rank_zero_warn(
                f"{name} resumes at optimizer step {step} with other arguments than the checkpoint was saved with; "
                f"following the new schedule, so the LR of group 0 goes from {before:.4g} to {after:.4g}. "
                f"Checkpoint: {saved!r}. Now: {configured!r}. Resume with the checkpoint's arguments to continue its "
                "schedule unchanged.",
                category=UserWarning,
            )
        return configured

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"planned_steps": self._planned}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        planned = state_dict.get("planned_steps")
        self._saved_planned = planned if isinstance(planned, int) else None

    def retarget(self, total_steps: int) -> None:
        """Make the installed schedules end at ``total_steps`` (the run's length changed under them).

        Only a schedule whose length was left to the Trainer (``total_steps=None``) is changed; the warm-up keeps the
        length it was given. :class:`~lightning_tune.DynamicBatchSize` calls this when the number of optimizer
        steps per epoch changes (``keep="lr"`` or ``"none"``).

        Args:
            total_steps: The run's new length in optimizer steps.
        """
        if self.total_steps is not None:
            return
        for scheduler in self.schedulers:
            current = getattr(scheduler.schedule, "total_steps", None)
            if current is not None and current != total_steps:
                scheduler.schedule = _with_length(scheduler.schedule, total_steps, scheduler.last_epoch)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if self.log_lr and optimizer is trainer.optimizers[0]:
            log_every_n_steps(trainer, lambda: learning_rates(trainer))

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.schedulers = []


def _with_length(schedule: Schedule, total_steps: int, step: int) -> Schedule:
    """``schedule`` ending at ``total_steps``, but never before its warm-up is over or before ``step``."""
    floor = max(getattr(schedule, "warmup_steps", 0) + 1, step + 1)
    return dataclasses.replace(schedule, total_steps=max(total_steps, floor))  # type: ignore[type-var]


def _fields(schedule: Schedule, ignored: set[str]) -> dict[str, Any]:
    return {f.name: getattr(schedule, f.name) for f in dataclasses.fields(schedule) if f.name not in ignored}  # type: ignore[arg-type]


def _check_min_lr(min_lr: float, lrs: Sequence[float], owner: str) -> None:
    """Raise when ``min_lr`` is above the largest configured learning rate."""
    if min_lr > max(lrs):
        raise MisconfigurationException(
            f"`min_lr` of {owner} must not exceed the optimizer's learning rate ({max(lrs):g}), got {min_lr!r}"
        )


class WarmupCosine(ScheduleCallback):
    r"""Linear warm-up to the configured learning rate, then cosine decay to ``min_lr``.

    The LR used by optimizer step :math:`s`, with warm-up :math:`W`, total :math:`T`, the group's configured LR
    :math:`b` and floor :math:`m`: :math:`b \cdot s / W` for :math:`s < W`, then
    :math:`m + (b - m) \cdot \tfrac12 (1 + \cos(\pi (s - W) / (T - W)))`, and :math:`m` after :math:`T`.

    Every parameter group keeps its own configured LR as its peak. ``min_lr`` is the floor of the group with the
    largest LR; the other groups' floors are scaled in proportion, so the ratios between groups hold at every step.

    Args:
        warmup_steps: Warm-up length in optimizer steps (0 for a plain cosine decay). Give this or ``warmup_ratio``.
        warmup_ratio: Warm-up as a fraction of ``total_steps`` in [0, 1), rounded up to whole steps.
        min_lr: Floor of the decay, at most the configured LR.
        total_steps: Optimizer steps until the floor; ``None`` means what the Trainer will run.
        replace: Replace a scheduler the module already returns instead of raising.
        log_lr: Log the ``tune/lr`` keys.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range, both or neither of ``warmup_steps`` and ``warmup_ratio`` are
            given, or ``warmup_steps >= total_steps``.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[WarmupCosine(warmup_ratio=0.05, min_lr=1e-5)], logger=False)
    """

    def __init__(
        self,
        warmup_steps: int | None = None,
        *,
        warmup_ratio: float | None = None,
        min_lr: float = 0.0,
        total_steps: int | None = None,
        replace: bool = False,
        log_lr: bool = True,
    ) -> None:
        super().__init__(total_steps=total_steps, replace=replace, log_lr=log_lr)
        if (warmup_steps is None) == (warmup_ratio is None):
            raise ValueError(
                "give exactly one of `warmup_steps` and `warmup_ratio`, got "
                f"warmup_steps={warmup_steps!r} and warmup_ratio={warmup_ratio!r}"
            )
        check_int("warmup_steps", warmup_steps, minimum=0, allow_none=True)
        check_float("warmup_ratio", warmup_ratio, low=0.0, high=1.0, high_inclusive=False, allow_none=True)
        check_float("min_lr", min_lr, low=0.0)
        if warmup_steps is not None and total_steps is not None and warmup_steps >= total_steps:
            raise ValueError(f"`warmup_steps` must be smaller than `total_steps` ({total_steps}), got {warmup_steps!r}")
        self.warmup_steps = warmup_steps
        self.warmup_ratio = warmup_ratio
        self.min_lr = min_lr

    def resolve_warmup_steps(self, total_steps: int) -> int:
        """Warm-up length in optimizer steps for a run of ``total_steps``.

        Args:
            total_steps: Resolved schedule length.

        Returns:
            ``warmup_steps``, or ``ceil(warmup_ratio * total_steps)``.
        """
        if self.warmup_steps is not None:
            return self.warmup_steps
        assert self.warmup_ratio is not None
        return math.ceil(self.warmup_ratio * total_steps)

    @override
    def build_schedule(self, optimizer: Optimizer, total_steps: int) -> Schedule:
        lrs = base_lrs(optimizer)
        _check_min_lr(self.min_lr, lrs, type(self).__name__)
        warmup = self.resolve_warmup_steps(total_steps)
        if warmup >= total_steps:
            raise MisconfigurationException(
                f"the warm-up of {type(self).__name__} ({warmup} steps) must be shorter than the run "
                f"({total_steps} optimizer steps); lower `warmup_steps`/`warmup_ratio` or lengthen the run"
            )
        peak = max(lrs)
        ratio = self.min_lr / peak if peak > 0 else 0.0
        return WarmupCosineSchedule(
            base_lrs=tuple(lrs), min_lrs=tuple(lr * ratio for lr in lrs), warmup_steps=warmup, total_steps=total_steps
        )


class LinearWarmup(ScheduleCallback):
    """Linear warm-up to the configured learning rate, then constant.

    The LR used by optimizer step ``s`` is ``lr * s / warmup_steps`` for ``s < warmup_steps``, then ``lr``, for each
    parameter group's own configured ``lr``.

    Args:
        warmup_steps: Warm-up length in optimizer steps, at least 1.
        replace: Replace a scheduler the module already returns instead of raising.
        log_lr: Log the ``tune/lr`` keys.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If ``warmup_steps`` is below 1.

    Example:
        >>> callback = LinearWarmup(warmup_steps=500)
    """

    def __init__(self, warmup_steps: int, *, replace: bool = False, log_lr: bool = True) -> None:
        check_int("warmup_steps", warmup_steps, minimum=1)
        super().__init__(total_steps=None, replace=replace, log_lr=log_lr)
        self.warmup_steps = warmup_steps

    @override
    def resolve_total_steps(self, trainer: pl.Trainer) -> int:
        return self.warmup_steps  # a constant LR needs no run length

    @override
    def build_schedule(self, optimizer: Optimizer, total_steps: int) -> Schedule:
        return LinearWarmupSchedule(base_lrs=tuple(base_lrs(optimizer)), warmup_steps=self.warmup_steps)


class OneCycle(ScheduleCallback):
    """The one-cycle policy, equal step for step to ``torch.optim.lr_scheduler.OneCycleLR``.

    Args:
        max_lr: Peak LR, one number or one per parameter group. One number is the peak of the group with the largest
            configured LR; other groups peak in proportion to their configured LR, so group ratios hold (with equal
            configured LRs this is torch's behaviour exactly).
        total_steps: Cycle length in optimizer steps; ``None`` means what the Trainer will run.
        pct_start: Fraction of the cycle spent rising, in (0, 1) (below 0.5 with ``three_phase``).
        div_factor: ``initial_lr = max_lr / div_factor``, > 0.
        final_div_factor: ``min_lr = initial_lr / final_div_factor``, > 0.
        anneal_strategy: ``"cos"`` or ``"linear"``.
        three_phase: Anneal back to ``initial_lr`` before the final decay.
        cycle_momentum: Cycle momentum (or Adam's ``beta1``) inversely to the LR, as torch does by default.
        base_momentum: Momentum at the LR peak, in [0, 1).
        max_momentum: Momentum at start and end, in [``base_momentum``, 1).
        replace: Replace a scheduler the module already returns instead of raising.
        log_lr: Log the ``tune/lr`` keys.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range or an unknown ``anneal_strategy`` is given.

    Example:
        >>> callback = OneCycle(max_lr=1e-3, pct_start=0.25)
    """

    def __init__(
        self,
        max_lr: float | Sequence[float],
        *,
        total_steps: int | None = None,
        pct_start: float = 0.3,
        div_factor: float = 25.0,
        final_div_factor: float = 1e4,
        anneal_strategy: AnnealStrategy = "cos",
        three_phase: bool = False,
        cycle_momentum: bool = True,
        base_momentum: float = 0.85,
        max_momentum: float = 0.95,
        replace: bool = False,
        log_lr: bool = True,
    ) -> None:
        super().__init__(total_steps=total_steps, replace=replace, log_lr=log_lr)
        if isinstance(max_lr, Sequence) and not isinstance(max_lr, str):
            if len(max_lr) == 0:
                raise ValueError("`max_lr` must be a positive number or a non-empty sequence of them, got []")
            for index, value in enumerate(max_lr):
                check_float(f"max_lr[{index}]", value, low=0.0, low_inclusive=False)
            self.max_lr: float | tuple[float, ...] = tuple(float(v) for v in max_lr)
        else:
            check_float("max_lr", max_lr, low=0.0, low_inclusive=False)
            self.max_lr = float(max_lr)
        check_float("pct_start", pct_start, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
        check_float("div_factor", div_factor, low=0.0, low_inclusive=False)
        check_float("final_div_factor", final_div_factor, low=0.0, low_inclusive=False)
        check_choice("anneal_strategy", anneal_strategy, ANNEAL_STRATEGIES)
        check_bool("three_phase", three_phase)
        check_bool("cycle_momentum", cycle_momentum)
        check_float("base_momentum", base_momentum, low=0.0, high=1.0, high_inclusive=False)
        check_float("max_momentum", max_momentum, low=0.0, high=1.0, high_inclusive=False)
        if base_momentum > max_momentum:
            raise ValueError(
                f"`base_momentum` must not exceed `max_momentum` ({max_momentum!r}), got {base_momentum!r}"
            )
        if three_phase and pct_start >= 0.5:
            raise ValueError(f"`pct_start` must be in (0, 0.5) with `three_phase=True`, got {pct_start!r}")
        self.pct_start = float(pct_start)
        self.div_factor = float(div_factor)
        self.final_div_factor = float(final_div_factor)
        self.anneal_strategy = anneal_strategy
        self.three_phase = three_phase
        self.cycle_momentum = cycle_momentum
        self.base_momentum = float(base_momentum)
        self.max_momentum = float(max_momentum)

    def resolve_max_lrs(self, optimizer: Optimizer) -> tuple[float, ...]:
        """Peak LR of each parameter group of ``optimizer``.

        Args:
            optimizer: The optimizer.

        Returns:
            One peak per group.

        Raises:
            MisconfigurationException: If a sequence ``max_lr`` does not have one value per group.
        """
        lrs = base_lrs(optimizer)
        if isinstance(self.max_lr, tuple):
            if len(self.max_lr) != len(lrs):
                raise MisconfigurationException(
                    f"`max_lr` of OneCycle has {len(self.max_lr)} values but the optimizer has {len(lrs)} "
                    "parameter groups; give one value per group or a single number"
                )
            return self.max_lr
        peak = max(lrs)
        if peak <= 0:
            return tuple(self.max_lr for _ in lrs)
        return tuple(self.max_lr * lr / peak for lr in lrs)

    @override
    def build_schedule(self, optimizer: Optimizer, total_steps: int) -> Schedule:
        groups = len(optimizer.param_groups)
        if self.cycle_momentum and not all("momentum" in g or "betas" in g for g in optimizer.param_groups):
            raise MisconfigurationException(
                f"OneCycle cycles momentum by default, but {type(optimizer).__name__} has neither `momentum` nor "
                "`betas`; pass `cycle_momentum=False`"
            )
        return OneCycleSchedule(
            max_lrs=self.resolve_max_lrs(optimizer),
            total_steps=total_steps,
            pct_start=self.pct_start,
            div_factor=self.div_factor,
            final_div_factor=self.final_div_factor,
            anneal_strategy=self.anneal_strategy,
            three_phase=self.three_phase,
            base_momentums=(self.base_momentum,) * groups if self.cycle_momentum else (),
            max_momentums=(self.max_momentum,) * groups if self.cycle_momentum else (),
        )
