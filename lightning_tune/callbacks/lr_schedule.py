"""Callbacks that install a learning-rate schedule onto the optimizer a LightningModule already configured."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Final

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_tune._validation import check_bool, check_choice, check_float, check_int
from lightning_tune.callbacks._logging import LRLogger
from lightning_tune.lr.scheduler import FACTOR_KEYS, Factor, Schedule, ScheduleLR, configured_lr, from_data, stretched
from lightning_tune.lr.schedules import (
    ANNEAL_STRATEGIES,
    RAMP_SHAPES,
    AnnealStrategy,
    RampShape,
    floor_ratio,
    linear_warmup,
    one_cycle,
    warmup_cosine,
    warmup_polynomial,
    warmup_stable_decay,
)
from lightning_tune.swaps.optimizer import name_lr_configs

if TYPE_CHECKING:
    import lightning.pytorch as pl


def base_lrs(optimizer: Optimizer) -> list[float]:
    """The learning rate each parameter group was configured with (:func:`configured_lr`)."""
    return [float(configured_lr(group)) for group in optimizer.param_groups]


def number_or_numbers(name: str, value: Any, *, positive: bool) -> float | tuple[float, ...]:
    """``value`` checked as one number, or as a non-empty sequence of them (one per parameter group)."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) == 0:
            what = "a positive number" if positive else "a number >= 0"
            raise ValueError(f"`{name}` must be {what} or a non-empty sequence of them, got []")
        for index, item in enumerate(value):
            check_float(f"{name}[{index}]", item, low=0.0, low_inclusive=not positive)
        return tuple(float(item) for item in value)
    check_float(name, value, low=0.0, low_inclusive=not positive)
    return float(value)


def per_group(owner: str, name: str, value: float | tuple[float, ...], optimizer: Optimizer) -> list[float]:
    """One value of ``owner``'s argument ``name`` per parameter group of ``optimizer``; a misfit is an error."""
    groups = len(optimizer.param_groups)
    if not isinstance(value, tuple):
        return [value] * groups
    if len(value) != groups:
        raise MisconfigurationException(
            f"`{name}` of {owner} has {len(value)} values but the optimizer has {groups} parameter groups; give one "
            "value per group or a single number"
        )
    return list(value)


def schedule_lrs(trainer: pl.Trainer) -> list[ScheduleLR]:
    """The Trainer's :class:`ScheduleLR` schedulers (a schedule callback's, or the module's own)."""
    return [config.scheduler for config in trainer.lr_scheduler_configs if isinstance(config.scheduler, ScheduleLR)]


class ScheduleCallback(LRLogger, ABC):
    """Base of the schedule callbacks: installs a step-interval :class:`ScheduleLR` per optimizer at fit start.

    Args:
        total_steps: Optimizer steps the schedule spans; ``None`` means what the Trainer will run.
        replace: Replace schedulers the module returns from ``configure_optimizers`` instead of raising.
        log_lr: Log the ``tune/lr`` keys.
    """

    def __init__(self, *, total_steps: int | None = None, replace: bool = False, log_lr: bool = True) -> None:
        check_int("total_steps", total_steps, minimum=1, allow_none=True)
        check_bool("replace", replace)
        check_bool("log_lr", log_lr)
        self.total_steps, self.replace, self.log_lr = total_steps, replace, log_lr
        self.schedulers: list[ScheduleLR] = []
        self._planned: int | None = None  # the Trainer's run length the schedules were resolved for, if it decided
        self._saved_planned: int | None = None  # the same, read from a checkpoint
        self._warned_restore = False

    @abstractmethod
    def factor(self, optimizer: Optimizer, total_steps: int) -> Factor:
        """Return ``optimizer``'s factor over ``total_steps`` optimizer steps: a ``partial`` of a schedules function."""

    def momentum(self, optimizer: Optimizer, total_steps: int) -> Factor | None:
        """Return the momentum as a factor like :meth:`factor`'s, or ``None`` (this default) to leave it."""
        return None

    def build_schedule(self, optimizer: Optimizer, total_steps: int) -> ScheduleLR:
        """Return the scheduler, at step 0, this callback installs on ``optimizer`` (with its configured LRs)."""
        momentum = self.momentum(optimizer, total_steps)
        flags = {"follows_run": self.total_steps is None, "log_lr": self.log_lr}
        return ScheduleLR(
            optimizer, self.factor(optimizer, total_steps), momentum=momentum, on_restore=self._on_restore, **flags
        )

    def resolve_total_steps(self, trainer: pl.Trainer) -> int:
        """Return the schedule length in optimizer steps: ``total_steps`` if given, else what the Trainer will run.

        Raises:
            MisconfigurationException: If the Trainer's run length is unbounded and ``total_steps`` was not given.
        """
        if self.total_steps is not None:
            return self.total_steps
        estimated = trainer.estimated_stepping_batches
        if not math.isfinite(estimated) or estimated < 1:
            name = type(self).__name__
            raise MisconfigurationException(
                f"{name} could not tell how many optimizer steps this run will take: {_unknown_length(trainer)}, "
                f"or pass `total_steps=` to {name}."
            )
        return int(estimated)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        name = type(self).__name__
        if not pl_module.automatic_optimization:
            raise MisconfigurationException(
                f"{name} schedules automatic optimization, but {type(pl_module).__name__} uses manual optimization, "
                "where Lightning leaves stepping schedulers to the module. Return "
                "`lightning_tune.lr.ScheduleLR(optimizer, factor)` from `configure_optimizers` and step it "
                "yourself instead."
            )
        optimizers = list(trainer.optimizers)
        if not optimizers:
            raise MisconfigurationException(f"{name} found no optimizer: `configure_optimizers` returned none.")
        kept: list[LRSchedulerConfig] = []
        for config in trainer.lr_scheduler_configs:
            if not any(config.scheduler.optimizer is optimizer for optimizer in optimizers):
                kept.append(config)
            elif not self.replace:
                raise MisconfigurationException(
                    f"{type(pl_module).__name__}.configure_optimizers already returns a learning-rate scheduler "
                    f"({type(config.scheduler).__name__}); {name} would fight it. Remove that scheduler, or pass "
                    f"`replace=True` to {name} to use {name}'s schedule instead."
                )
        total_steps = self.resolve_total_steps(trainer)
        self._planned = total_steps if self.total_steps is None else None
        self._warned_restore = False
        self.schedulers = [self.build_schedule(optimizer, total_steps) for optimizer in optimizers]
        if self.total_steps is not None and self.total_steps < (run := trainer.estimated_stepping_batches) < math.inf:
            final = self.schedulers[0].peaks[0] * self.schedulers[0].factor(self.total_steps)
            rank_zero_warn(
                f"{name}(total_steps={self.total_steps}) ends after {self.total_steps} optimizer steps, but the "
                f"Trainer will run {int(run)}: the last {int(run) - self.total_steps} steps stay at the schedule's "
                f"final LR ({final:.3g}). Leave `total_steps=None` to span the whole run, or shorten the run.",
                category=UserWarning,
            )
        # Lightning's own LearningRateFinder installs schedulers this way; configs are saved and restored by position.
        configs = kept + [LRSchedulerConfig(scheduler, interval="step", frequency=1) for scheduler in self.schedulers]
        name_lr_configs(configs)  # after an OptimizerSwap, LearningRateMonitor keeps the module's optimizer's name
        trainer.strategy.lr_scheduler_configs = configs

    def _on_restore(self, saved: Schedule, configured: Schedule, step: int) -> Schedule:
        """Choose the schedule a resumed run follows (the ``on_restore`` hook of the installed schedulers)."""
        if _same(saved, configured):
            return saved
        name = type(self).__name__
        if self._planned is not None and saved["factor"] is not None:
            ratios = {"warmup_steps": "warmup_ratio", "decay_steps": "decay_ratio"}  # those lengths follow the run
            ignored = frozenset({"total_steps", *(k for k, r in ratios.items() if getattr(self, r, None) is not None)})
            if _same(saved, configured, ignored):  # only the length differs
                if self._saved_planned == self._planned:
                    return saved  # the Trainer's length is unchanged; the saved one may have been retargeted since
                rank_zero_info(
                    f"{name}: the run now takes {self._planned} optimizer steps, and the checkpoint's schedule "
                    f"ended at step {saved['factor']['total_steps']}; it follows the new length from step {step} on "
                    "(warm-up unchanged)."
                )
                return saved | {key: saved[key] and stretched(saved[key], self._planned, step) for key in FACTOR_KEYS}
        if not self._warned_restore:
            self._warned_restore = True
            before, after = (s["peaks"][0] * from_data(s["factor"])(step) for s in (saved, configured))
            rank_zero_warn(
                f"{name} resumes at optimizer step {step} with other arguments than the checkpoint was saved with; "
                f"following the new schedule, so the LR of group 0 goes from {before:.4g} to {after:.4g}. "
                f"Checkpoint: {_describe(saved)}. Now: {_describe(configured)}. Resume with the checkpoint's "
                "arguments to continue its schedule unchanged.",
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
        """Make the installed schedules end at ``total_steps`` if their length was left to the Trainer."""
        if self.total_steps is None:
            for scheduler in self.schedulers:
                scheduler.retarget(total_steps)

    @override
    def logs_lr(self, trainer: pl.Trainer) -> bool:
        return self.log_lr

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.schedulers = []


def _unknown_length(trainer: pl.Trainer) -> str:
    """Why ``trainer.estimated_stepping_batches`` gives no run length, and what would give one."""
    if trainer.max_epochs == -1 and trainer.max_steps == -1:
        return "the Trainer runs without end (max_epochs=-1, max_steps=-1); set `max_steps` or `max_epochs`"
    if trainer.num_training_batches == 0:
        return (
            "the training DataLoader yields no batches (an empty dataset, or `limit_train_batches` of 0), so there "
            "is no optimizer step to schedule; give the run training data"
        )
    return (
        "the training DataLoader has no length (an IterableDataset without `__len__`), so the Trainer cannot count "
        f"an epoch's steps and `max_epochs={trainer.max_epochs}` does not bound them; set `max_steps`, give the "
        "dataset a `__len__`"
    )


def _same(saved: Any, configured: Any, ignored: frozenset[str] = frozenset()) -> bool:
    """Whether two schedules agree but for the keys ``ignored``, numbers to a relative 1e-12 (ratios computed twice)."""
    if isinstance(saved, Mapping) and isinstance(configured, Mapping):
        keys = saved.keys() - ignored
        return keys == configured.keys() - ignored and all(_same(saved[k], configured[k], ignored) for k in keys)
    if isinstance(saved, list) and isinstance(configured, list):
        return len(saved) == len(configured) and all(map(_same, saved, configured))  # peaks: numbers
    if isinstance(saved, float) or isinstance(configured, float):
        numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (saved, configured))
        return numbers and math.isclose(saved, configured, rel_tol=1e-12)
    return bool(saved == configured)


def _describe(schedule: Schedule) -> str:
    """``factor warmup_cosine(warmup_steps=5, ...); peak LRs [0.05]``: a schedule for a message."""
    parts = []
    for key in FACTOR_KEYS:
        if (data := schedule[key]) is not None:
            arguments = ", ".join(f"{name}={value!r}" for name, value in data.items() if name != "name")
            parts.append(f"{key} {data['name']}({arguments})")
    return "; ".join([*parts, f"peak LRs {schedule['peaks']}"])


#: The warm-up of a schedule given neither ``warmup_steps`` nor ``warmup_ratio`` (``docs/lr_schedules.md``).
DEFAULT_WARMUP_RATIO: Final[float] = 0.02


class WarmupDecay(ScheduleCallback):
    """Base of the schedules that warm up linearly to each group's configured LR, then decay to a floor.

    Args:
        warmup_steps: Warm-up length in optimizer steps; give this or ``warmup_ratio`` (neither: 2 % of the run).
        warmup_ratio: Warm-up as a fraction of ``total_steps`` in [0, 1), rounded up to whole steps.
        min_lr: Floor of the decay (of the group with the largest LR), at most the configured LR.
        total_steps: Optimizer steps until the floor; ``None`` means what the Trainer will run.
        replace: Replace a scheduler the module already returns instead of raising.
        log_lr: Log the ``tune/lr`` keys.
    """

    #: The Hugging Face schedule whose ``min_lr`` (``lr_end``) is relative to the optimizer's default LR, if any.
    hf_floor_reference: str | None = None

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
        if warmup_steps is not None and warmup_ratio is not None:
            raise ValueError(
                "give at most one of `warmup_steps` and `warmup_ratio` (neither: a warm-up of "
                f"{DEFAULT_WARMUP_RATIO:.0%} of the run), got warmup_steps={warmup_steps!r} and "
                f"warmup_ratio={warmup_ratio!r}"
            )
        if warmup_steps is None and warmup_ratio is None:
            warmup_ratio = DEFAULT_WARMUP_RATIO
        check_int("warmup_steps", warmup_steps, minimum=0, allow_none=True)
        check_float("warmup_ratio", warmup_ratio, low=0.0, high=1.0, high_inclusive=False, allow_none=True)
        check_float("min_lr", min_lr, low=0.0)
        if warmup_steps is not None and total_steps is not None and warmup_steps >= total_steps:
            raise ValueError(f"`warmup_steps` must be smaller than `total_steps` ({total_steps}), got {warmup_steps!r}")
        self.warmup_steps, self.warmup_ratio, self.min_lr = warmup_steps, warmup_ratio, min_lr

    def resolve(self, optimizer: Optimizer, total_steps: int) -> tuple[float, int]:
        """Return ``(min_ratio, warmup_steps)``: the floor as a ratio of each group's LR, and the warm-up length.

        Raises:
            MisconfigurationException: If ``min_lr`` exceeds the largest LR or the warm-up is not shorter than the run.
        """
        peak = max(base_lrs(optimizer))
        if self.min_lr > peak:
            raise MisconfigurationException(
                f"`min_lr` of {type(self).__name__} must not exceed the optimizer's learning rate ({peak:g}), got "
                f"{self.min_lr!r}"
            )
        warmup = self.warmup_steps
        if warmup is None:
            warmup = min(math.ceil(self.warmup_ratio * total_steps), total_steps - 1)  # type: ignore[operator]
        if warmup >= total_steps:
            raise MisconfigurationException(
                f"the warm-up of {type(self).__name__} ({warmup} steps) must be shorter than the run "
                f"({total_steps} optimizer steps); lower `warmup_steps`/`warmup_ratio` or lengthen the run"
            )
        self._warn_if_hf_floor_differs(optimizer, peak)
        return floor_ratio(self.min_lr, peak), warmup

    def _warn_if_hf_floor_differs(self, optimizer: Optimizer, peak: float) -> None:
        """One warning where Hugging Face would read ``min_lr`` against another LR than the largest group's."""
        default = optimizer.defaults.get("lr")
        if self.hf_floor_reference is None or self.min_lr == 0 or not isinstance(default, int | float | Tensor):
            return
        default = float(default)
        if default <= 0 or math.isclose(default, peak, rel_tol=1e-6):
            return
        rank_zero_warn(
            f"{type(self).__name__}(min_lr={self.min_lr:g}) is the floor of the parameter group with the largest LR "
            f"({peak:g}); the other groups' floors keep their LR ratios. Hugging Face's {self.hf_floor_reference} "
            f"reads `min_lr` against the optimizer's default LR ({default:g}) instead, so a configuration ported from "
            f"it gets floors {default / peak:.3g}x Hugging Face's here. For Hugging Face's floors, pass "
            f"min_lr={self.min_lr * peak / default:.6g}.",
            category=UserWarning,
        )


class WarmupCosine(WarmupDecay):
    """Linear warm-up to the configured learning rate, then cosine decay to ``min_lr``.

    Args:
        warmup_steps: Warm-up length in optimizer steps; give this or ``warmup_ratio`` (neither: 2 % of the run).
        warmup_ratio: Warm-up as a fraction of ``total_steps`` in [0, 1), rounded up to whole steps.
        min_lr: Floor of the decay (of the group with the largest LR), at most the configured LR.
        num_cycles: Waves of the cosine (with ``hard_restarts``: decays), > 0; ``None``: 0.5, or 1 with restarts.
        hard_restarts: Jump back to the peak at the start of each cycle.
        total_steps: Optimizer steps until the floor; ``None`` means what the Trainer will run.
        replace: Replace a scheduler the module already returns instead of raising.
        log_lr: Log the ``tune/lr`` keys.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range, both ``warmup_steps`` and ``warmup_ratio`` are given, or
            ``warmup_steps >= total_steps``.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[WarmupCosine(warmup_ratio=0.05, min_lr=1e-5)], logger=False)
    """

    hf_floor_reference = "get_cosine_with_min_lr_schedule_with_warmup"

    def __init__(
        self,
        warmup_steps: int | None = None,
        *,
        warmup_ratio: float | None = None,
        min_lr: float = 0.0,
        num_cycles: float | None = None,
        hard_restarts: bool = False,
        total_steps: int | None = None,
        replace: bool = False,
        log_lr: bool = True,
    ) -> None:
        super().__init__(
            warmup_steps,
            warmup_ratio=warmup_ratio,
            min_lr=min_lr,
            total_steps=total_steps,
            replace=replace,
            log_lr=log_lr,
        )
        check_float("num_cycles", num_cycles, low=0.0, low_inclusive=False, allow_none=True)
        check_bool("hard_restarts", hard_restarts)
        self.num_cycles = float(num_cycles) if num_cycles is not None else (1.0 if hard_restarts else 0.5)
        self.hard_restarts = hard_restarts

    @override
    def factor(self, optimizer: Optimizer, total_steps: int) -> Factor:
        ratio, warmup = self.resolve(optimizer, total_steps)
        cycles: dict[str, Any] = {"num_cycles": self.num_cycles, "hard_restarts": self.hard_restarts}
        return partial(warmup_cosine, warmup_steps=warmup, total_steps=total_steps, min_ratio=ratio, **cycles)


class WarmupPolynomial(WarmupDecay):
    """Linear warm-up to the configured learning rate, then a polynomial decay to ``min_lr``: linear by default.

    Args:
        warmup_steps: Warm-up length in optimizer steps; give this or ``warmup_ratio`` (neither: 2 % of the run).
        warmup_ratio: Warm-up as a fraction of ``total_steps`` in [0, 1), rounded up to whole steps.
        power: Exponent of the decay, > 0.
        min_lr: Floor of the decay (of the group with the largest LR), at most the configured LR.
        total_steps: Optimizer steps until the floor; ``None`` means what the Trainer will run.
        replace: Replace a scheduler the module already returns instead of raising.
        log_lr: Log the ``tune/lr`` keys.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range, or both ``warmup_steps`` and ``warmup_ratio`` are given.

    Example:
        >>> callback = WarmupPolynomial(warmup_ratio=0.06)  # Hugging Face's linear schedule
    """

    hf_floor_reference = "get_polynomial_decay_schedule_with_warmup"

    def __init__(
        self,
        warmup_steps: int | None = None,
        *,
        warmup_ratio: float | None = None,
        power: float = 1.0,
        min_lr: float = 0.0,
        total_steps: int | None = None,
        replace: bool = False,
        log_lr: bool = True,
    ) -> None:
        super().__init__(
            warmup_steps,
            warmup_ratio=warmup_ratio,
            min_lr=min_lr,
            total_steps=total_steps,
            replace=replace,
            log_lr=log_lr,
        )
        check_float("power", power, low=0.0, low_inclusive=False)
        self.power = float(power)

    @override
    def factor(self, optimizer: Optimizer, total_steps: int) -> Factor:
        ratio, warmup = self.resolve(optimizer, total_steps)
        return partial(
            warmup_polynomial, warmup_steps=warmup, total_steps=total_steps, min_ratio=ratio, power=self.power
        )


class WarmupStableDecay(WarmupDecay):
    """Warm-up, stable, decay (WSD): rise to the configured LR, hold it, and decay over the last steps of the run.

    Args:
        warmup_steps: Warm-up length in optimizer steps; give this or ``warmup_ratio`` (neither: 2 % of the run).
        warmup_ratio: Warm-up as a fraction of ``total_steps`` in [0, 1), rounded up to whole steps.
        decay_steps: Decay length in optimizer steps (0 for none). Give this or ``decay_ratio``.
        decay_ratio: Decay as a fraction of ``total_steps`` in [0, 1], rounded up to whole steps.
        min_lr: Start and end LR (of the group with the largest LR; Hugging Face's ``min_lr_ratio`` times that LR).
        warmup_shape: ``"linear"``, ``"cosine"`` or ``"1-sqrt"``.
        decay_shape: ``"linear"``, ``"cosine"`` or ``"1-sqrt"``.
        total_steps: End of the decay; ``None`` means what the Trainer will run.
        replace: Replace a scheduler the module already returns instead of raising.
        log_lr: Log the ``tune/lr`` keys.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range, both ``warmup_steps`` and ``warmup_ratio`` are given, or not
            exactly one of ``decay_steps`` and ``decay_ratio`` is.

    Example:
        >>> callback = WarmupStableDecay(warmup_steps=2000, decay_ratio=0.1, decay_shape="1-sqrt")
    """

    def __init__(
        self,
        warmup_steps: int | None = None,
        *,
        warmup_ratio: float | None = None,
        decay_steps: int | None = None,
        decay_ratio: float | None = None,
        min_lr: float = 0.0,
        warmup_shape: RampShape = "linear",
        decay_shape: RampShape = "cosine",
        total_steps: int | None = None,
        replace: bool = False,
        log_lr: bool = True,
    ) -> None:
        super().__init__(
            warmup_steps,
            warmup_ratio=warmup_ratio,
            min_lr=min_lr,
            total_steps=total_steps,
            replace=replace,
            log_lr=log_lr,
        )
        if (decay_steps is None) == (decay_ratio is None):
            raise ValueError(
                "give exactly one of `decay_steps` and `decay_ratio`, got "
                f"decay_steps={decay_steps!r} and decay_ratio={decay_ratio!r}"
            )
        check_int("decay_steps", decay_steps, minimum=0, allow_none=True)
        check_float("decay_ratio", decay_ratio, low=0.0, high=1.0, allow_none=True)
        check_choice("warmup_shape", warmup_shape, RAMP_SHAPES)
        check_choice("decay_shape", decay_shape, RAMP_SHAPES)
        if None not in (warmup_steps, decay_steps, total_steps) and warmup_steps + decay_steps > total_steps:  # type: ignore[operator]
            raise ValueError(
                f"`warmup_steps` + `decay_steps` must not exceed `total_steps` ({total_steps}), got "
                f"{warmup_steps} + {decay_steps}"
            )
        self.decay_steps, self.decay_ratio = decay_steps, decay_ratio
        self.warmup_shape, self.decay_shape = warmup_shape, decay_shape

    @override
    def factor(self, optimizer: Optimizer, total_steps: int) -> Factor:
        ratio, warmup = self.resolve(optimizer, total_steps)
        decay = self.decay_steps if self.decay_steps is not None else math.ceil(self.decay_ratio * total_steps)  # type: ignore[operator]
        if warmup + decay > total_steps:
            raise MisconfigurationException(
                f"the warm-up ({warmup} steps) and decay ({decay} steps) of {type(self).__name__} do not fit in the "
                f"run ({total_steps} optimizer steps); shorten them or lengthen the run"
            )
        return partial(
            warmup_stable_decay,
            warmup_steps=warmup,
            decay_steps=decay,
            total_steps=total_steps,
            min_ratio=ratio,
            warmup_shape=self.warmup_shape,
            decay_shape=self.decay_shape,
        )


class LinearWarmup(ScheduleCallback):
    """Linear warm-up to each parameter group's configured learning rate, then constant.

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
    def factor(self, optimizer: Optimizer, total_steps: int) -> Factor:
        return partial(linear_warmup, warmup_steps=self.warmup_steps)


class OneCycle(ScheduleCallback):
    """The one-cycle policy, equal step for step to ``torch.optim.lr_scheduler.OneCycleLR``.

    Args:
        max_lr: Peak LR, one per parameter group, or one number: the largest group's (``docs/lr_schedules.md``).
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
        self.max_lr = number_or_numbers("max_lr", max_lr, positive=True)
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
        self.pct_start, self.div_factor = float(pct_start), float(div_factor)
        self.final_div_factor, self.anneal_strategy = float(final_div_factor), anneal_strategy
        self.three_phase, self.cycle_momentum = three_phase, cycle_momentum
        self.base_momentum, self.max_momentum = float(base_momentum), float(max_momentum)

    def _cycle(self, total_steps: int, start: float, peak: float, end: float) -> Factor:
        """:func:`one_cycle` with this callback's phases, from ``start`` to ``peak`` to ``end``."""
        phases: dict[str, Any] = {
            "pct_start": self.pct_start,
            "anneal_strategy": self.anneal_strategy,
            "three_phase": self.three_phase,
        }
        return partial(one_cycle, total_steps=total_steps, **phases, start=start, peak=peak, end=end)

    @override
    def factor(self, optimizer: Optimizer, total_steps: int) -> Factor:
        """The cycle as a factor of each group's peak, set as the group's ``lr_scale`` times its configured LR.

        Raises:
            MisconfigurationException: If a sequence ``max_lr`` does not have one value per group, or a group whose
                peak is set relative to its configured LR is configured with an LR of 0.
        """
        lrs = base_lrs(optimizer)
        peaks = per_group("OneCycle", "max_lr", self.max_lr, optimizer)
        bases = lrs if isinstance(self.max_lr, tuple) else [max(lrs)] * len(lrs)
        for index, (group, peak, lr) in enumerate(zip(optimizer.param_groups, peaks, bases, strict=True)):
            if lr <= 0:
                raise MisconfigurationException(
                    f"OneCycle sets each parameter group's peak in proportion to its configured LR, but group {index} "
                    f"is configured with {lr:g}; configure every group with an LR > 0"
                )
            group["lr_scale"] = peak / lr
        start = 1.0 / self.div_factor
        return self._cycle(total_steps, start, 1.0, start / self.final_div_factor)

    @override
    def momentum(self, optimizer: Optimizer, total_steps: int) -> Factor | None:
        """The momentum cycled inversely to the LR, with ``cycle_momentum``.

        Raises:
            MisconfigurationException: If the optimizer has neither ``momentum`` nor ``betas``.
        """
        if not self.cycle_momentum:
            return None
        if not all("momentum" in g or "betas" in g for g in optimizer.param_groups):
            raise MisconfigurationException(
                f"OneCycle cycles momentum by default, but {type(optimizer).__name__} has neither `momentum` nor "
                "`betas`; pass `cycle_momentum=False`"
            )
        return self._cycle(total_steps, self.max_momentum, self.base_momentum, self.max_momentum)
