"""Learning-rate schedules as pure functions of an explicit optimizer step.

Nothing here holds a counter, a tensor or an optimizer: ``step`` is the index of the optimizer step the learning rate
is used for (0, 1, 2, ...), and the same arguments always give the same value. The callbacks in
:mod:`lightning_tune.callbacks.lr_schedule` resolve the arguments from the Trainer and feed these functions through
:class:`~lightning_tune.lr.scheduler.ScheduleLR`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar, Final, Literal, Protocol, get_args, runtime_checkable

from lightning_tune._validation import check_bool, check_choice, check_float, check_int, check_numbers

AnnealStrategy = Literal["cos", "linear"]
ANNEAL_STRATEGIES: Final[tuple[str, ...]] = ("cos", "linear")
RampShape = Literal["linear", "cosine", "1-sqrt"]
RAMP_SHAPES: Final[tuple[str, ...]] = get_args(RampShape)


def warmup_cosine_lr(
    step: int,
    *,
    base_lr: float,
    warmup_steps: int,
    total_steps: int,
    min_lr: float = 0.0,
    num_cycles: float = 0.5,
    hard_restarts: bool = False,
) -> float:
    r"""Learning rate of a linear warm-up followed by a cosine decay (with Hugging Face's ``num_cycles`` and restarts).

    With warm-up :math:`W`, total :math:`T`, base LR :math:`b`, floor :math:`m`, cycles :math:`c` and progress
    :math:`p = (s - W) / (T - W)`, the LR used by step :math:`s` is :math:`b \cdot s / W` for :math:`s < W`, then
    :math:`m + (b - m) \cdot \tfrac12 \left(1 + \cos(2 \pi c p)\right)` (the default :math:`c = 1/2` is one
    half-wave, from :math:`b` down to :math:`m`), and the value of :math:`p = 1` from step :math:`T` on. With
    ``hard_restarts`` the decay is :math:`c` half-waves, each restarting from :math:`b`:
    :math:`m + (b - m) \cdot \tfrac12 \left(1 + \cos(\pi \cdot (c p \bmod 1))\right)`, and :math:`m` from
    :math:`T` on.

    Args:
        step: Index of the optimizer step (0-based).
        base_lr: Peak learning rate, reached at the end of warm-up.
        warmup_steps: Number of warm-up steps :math:`W` (0 for none).
        total_steps: Step :math:`T` at which the decay ends; greater than ``warmup_steps``.
        min_lr: Floor of the decay.
        num_cycles: Waves of the cosine over the decay (``get_cosine_schedule_with_warmup``'s ``num_cycles``), or the
            number of decays with ``hard_restarts`` (``get_cosine_with_hard_restarts_schedule_with_warmup``'s).
        hard_restarts: Jump back to ``base_lr`` at the start of each cycle.

    Returns:
        The learning rate for ``step``.

    Example:
        >>> [round(warmup_cosine_lr(s, base_lr=1.0, warmup_steps=2, total_steps=4), 3) for s in range(5)]
        [0.0, 0.5, 1.0, 0.5, 0.0]
        >>> [round(warmup_cosine_lr(s, base_lr=1.0, warmup_steps=0, total_steps=4, num_cycles=2, hard_restarts=True), 3)
        ...  for s in range(5)]
        [1.0, 0.5, 1.0, 0.5, 0.0]
    """
    _check_decay_step(step, base_lr=base_lr, warmup_steps=warmup_steps, total_steps=total_steps, min_lr=min_lr)
    check_float("num_cycles", num_cycles, low=0.0, low_inclusive=False)
    check_bool("hard_restarts", hard_restarts)
    if step < warmup_steps:
        return base_lr * step / warmup_steps
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    if hard_restarts:
        if progress >= 1.0:
            return min_lr
        return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * ((num_cycles * progress) % 1.0)))
    return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))


def warmup_polynomial_lr(
    step: int, *, base_lr: float, warmup_steps: int, total_steps: int, min_lr: float = 0.0, power: float = 1.0
) -> float:
    r"""Learning rate of a linear warm-up followed by a polynomial decay to ``min_lr``.

    :math:`b \cdot s / W` for :math:`s < W`, then :math:`m + (b - m) (1 - p)^{k}` with
    :math:`p = (s - W) / (T - W)` and power :math:`k`, and :math:`m` from step :math:`T` on. ``power=1`` with
    ``min_lr=0`` is Hugging Face's default ``get_linear_schedule_with_warmup``; other values are its
    ``get_polynomial_decay_schedule_with_warmup`` (``lr_end`` = ``min_lr``).

    Args:
        step: Index of the optimizer step (0-based).
        base_lr: Peak learning rate, reached at the end of warm-up.
        warmup_steps: Number of warm-up steps :math:`W` (0 for none).
        total_steps: Step :math:`T` at which the decay reaches ``min_lr``; greater than ``warmup_steps``.
        min_lr: Floor of the decay.
        power: Exponent :math:`k` of the decay (1 is linear).

    Returns:
        The learning rate for ``step``.

    Example:
        >>> [warmup_polynomial_lr(s, base_lr=1.0, warmup_steps=2, total_steps=6) for s in range(7)]
        [0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0]
    """
    _check_decay_step(step, base_lr=base_lr, warmup_steps=warmup_steps, total_steps=total_steps, min_lr=min_lr)
    check_float("power", power, low=0.0, low_inclusive=False)
    if step < warmup_steps:
        return base_lr * step / warmup_steps
    if step >= total_steps:
        return min_lr
    remaining = 1.0 - (step - warmup_steps) / (total_steps - warmup_steps)
    return min_lr + (base_lr - min_lr) * remaining**power


def _ramp(progress: float, shape: str) -> float:
    """A rise from 0 to 1 over ``progress`` in [0, 1]: ``linear``, ``cosine`` (half a wave) or ``1-sqrt``."""
    if shape == "linear":
        return progress
    if shape == "cosine":
        return 0.5 * (1.0 - math.cos(math.pi * progress))
    return 1.0 - math.sqrt(1.0 - progress)


def warmup_stable_decay_lr(
    step: int,
    *,
    base_lr: float,
    warmup_steps: int,
    decay_steps: int,
    total_steps: int,
    min_lr: float = 0.0,
    warmup_shape: RampShape = "linear",
    decay_shape: RampShape = "cosine",
) -> float:
    r"""Learning rate of warm-up, stable, decay (WSD), as Hugging Face's ``get_wsd_schedule``.

    The LR rises from ``min_lr`` to ``base_lr`` over the first ``warmup_steps`` (``warmup_shape``), stays at
    ``base_lr``, and falls back to ``min_lr`` over the last ``decay_steps`` before ``total_steps``
    (``decay_shape``: the warm-up's shape run backwards); ``min_lr`` from ``total_steps`` on. The shapes, over a
    phase's progress :math:`p`: ``"linear"`` :math:`p`, ``"cosine"`` :math:`\tfrac12(1 - \cos \pi p)`, ``"1-sqrt"``
    :math:`1 - \sqrt{1 - p}` for the rise.

    Args:
        step: Index of the optimizer step (0-based).
        base_lr: Learning rate of the stable phase.
        warmup_steps: Length of the warm-up (0 for none).
        decay_steps: Length of the decay (0 for none).
        total_steps: End of the decay; at least ``warmup_steps + decay_steps``.
        min_lr: Start of the warm-up and end of the decay.
        warmup_shape: ``"linear"``, ``"cosine"`` or ``"1-sqrt"``.
        decay_shape: ``"linear"``, ``"cosine"`` or ``"1-sqrt"``.

    Returns:
        The learning rate for ``step``.

    Example:
        >>> [warmup_stable_decay_lr(s, base_lr=1.0, warmup_steps=2, decay_steps=2, total_steps=6,
        ...                         decay_shape="linear") for s in range(7)]
        [0.0, 0.5, 1.0, 1.0, 1.0, 0.5, 0.0]
    """
    _check_decay_step(step, base_lr=base_lr, warmup_steps=warmup_steps, total_steps=total_steps, min_lr=min_lr)
    check_int("decay_steps", decay_steps, minimum=0, maximum=total_steps - warmup_steps)
    check_choice("warmup_shape", warmup_shape, RAMP_SHAPES)
    check_choice("decay_shape", decay_shape, RAMP_SHAPES)
    if step < warmup_steps:
        return min_lr + (base_lr - min_lr) * _ramp(step / warmup_steps, warmup_shape)
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return base_lr
    if step >= total_steps:
        return min_lr
    return min_lr + (base_lr - min_lr) * _ramp(1.0 - (step - decay_start) / decay_steps, decay_shape)


def linear_warmup_lr(step: int, *, base_lr: float, warmup_steps: int) -> float:
    """Learning rate of a linear warm-up to ``base_lr`` that stays constant afterwards.

    Args:
        step: Index of the optimizer step (0-based).
        base_lr: Learning rate after warm-up.
        warmup_steps: Number of warm-up steps (0 for none); step ``s < warmup_steps`` uses
            ``base_lr * s / warmup_steps``.

    Returns:
        The learning rate for ``step``.

    Example:
        >>> [linear_warmup_lr(s, base_lr=1.0, warmup_steps=4) for s in range(6)]
        [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    """
    _check_step(step, base_lr=base_lr, warmup_steps=warmup_steps)
    return base_lr * step / warmup_steps if step < warmup_steps else base_lr


def _check_step(step: int, **numbers: float) -> None:
    """Check the step (an integer >= 0) and the learning rates, momenta and step counts of a schedule function."""
    check_int("step", step, minimum=0)
    for name, value in numbers.items():
        if name.endswith("_steps"):
            check_int(name, value, minimum=0)
        else:
            check_float(name, value, low=0.0)


def _check_decay_step(step: int, *, base_lr: float, warmup_steps: int, total_steps: int, min_lr: float) -> None:
    """The checks of :func:`_check_step` for a schedule that warms up, then decays to ``min_lr`` by ``total_steps``."""
    _check_step(step, base_lr=base_lr, warmup_steps=warmup_steps, min_lr=min_lr)
    check_int("total_steps", total_steps, minimum=1)
    if warmup_steps >= total_steps:
        raise ValueError(f"`warmup_steps` must be smaller than `total_steps` ({total_steps}), got {warmup_steps}")


def _check_cycle(pct_start: float, anneal_strategy: str, three_phase: bool) -> None:
    check_float("pct_start", pct_start, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
    check_choice("anneal_strategy", anneal_strategy, ANNEAL_STRATEGIES)
    check_bool("three_phase", three_phase)


def _anneal(start: float, end: float, pct: float, strategy: str) -> float:
    if strategy == "cos":
        return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)
    return (end - start) * pct + start


def _one_cycle(
    step: int, total_steps: int, pct_start: float, three_phase: bool, strategy: str, a: float, b: float, c: float
) -> float:
    """The one-cycle value at ``step``: ``a`` to ``b``, then to ``c`` (with ``three_phase``, back to ``a`` first).

    The phase boundaries are those of ``torch.optim.lr_scheduler.OneCycleLR``; steps past the end stay at the end.
    """
    step = min(step, total_steps - 1)
    if three_phase:
        ends = [float(pct_start * total_steps) - 1, float(2 * pct_start * total_steps) - 2, float(total_steps - 1)]
        phases = [(a, b), (b, a), (a, c)]
    else:
        ends = [float(pct_start * total_steps) - 1, float(total_steps - 1)]
        phases = [(a, b), (b, c)]
    start = 0.0
    for index, end in enumerate(ends):
        if step <= end or index == len(ends) - 1:
            span = end - start
            return _anneal(*phases[index], (step - start) / span if span > 0 else 1.0, strategy)
        start = end
    raise AssertionError("unreachable")  # pragma: no cover


def one_cycle_lr(
    step: int,
    *,
    max_lr: float,
    total_steps: int,
    pct_start: float = 0.3,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
    anneal_strategy: AnnealStrategy = "cos",
    three_phase: bool = False,
) -> float:
    """Learning rate of the one-cycle policy (Smith & Topin), equal to ``torch.optim.lr_scheduler.OneCycleLR``.

    The LR rises from ``max_lr / div_factor`` to ``max_lr`` over the first ``pct_start`` of the run, then anneals to
    ``max_lr / div_factor / final_div_factor`` (with ``three_phase``: back to the initial LR first, then to the
    minimum). Steps at or past ``total_steps`` keep the final value instead of raising.

    Args:
        step: Index of the optimizer step (0-based).
        max_lr: Peak learning rate.
        total_steps: Length of the cycle in optimizer steps.
        pct_start: Fraction of the cycle spent rising.
        div_factor: ``initial_lr = max_lr / div_factor``.
        final_div_factor: ``min_lr = initial_lr / final_div_factor``.
        anneal_strategy: ``"cos"`` or ``"linear"``.
        three_phase: Use the three-phase variant.

    Returns:
        The learning rate for ``step``.

    Example:
        >>> round(one_cycle_lr(0, max_lr=1.0, total_steps=10), 6)
        0.04
    """
    _check_step(step, max_lr=max_lr)
    check_int("total_steps", total_steps, minimum=1)
    check_float("div_factor", div_factor, low=0.0, low_inclusive=False)
    check_float("final_div_factor", final_div_factor, low=0.0, low_inclusive=False)
    _check_cycle(pct_start, anneal_strategy, three_phase)
    initial = max_lr / div_factor
    return _one_cycle(
        step, total_steps, pct_start, three_phase, anneal_strategy, initial, max_lr, initial / final_div_factor
    )


def one_cycle_momentum(
    step: int,
    *,
    total_steps: int,
    base_momentum: float = 0.85,
    max_momentum: float = 0.95,
    pct_start: float = 0.3,
    anneal_strategy: AnnealStrategy = "cos",
    three_phase: bool = False,
) -> float:
    """Momentum (or Adam's ``beta1``) of the one-cycle policy, inversely to the learning rate.

    Args:
        step: Index of the optimizer step (0-based).
        total_steps: Length of the cycle in optimizer steps.
        base_momentum: Momentum at the LR peak.
        max_momentum: Momentum at the start and the end.
        pct_start: Fraction of the cycle spent rising.
        anneal_strategy: ``"cos"`` or ``"linear"``.
        three_phase: Use the three-phase variant.

    Returns:
        The momentum for ``step``.

    Example:
        >>> one_cycle_momentum(0, total_steps=10)
        0.95
    """
    _check_step(step, base_momentum=base_momentum, max_momentum=max_momentum)
    check_int("total_steps", total_steps, minimum=1)
    _check_cycle(pct_start, anneal_strategy, three_phase)
    return _one_cycle(
        step, total_steps, pct_start, three_phase, anneal_strategy, max_momentum, base_momentum, max_momentum
    )


def _own_floats(schedule: Any) -> None:
    """Store every per-group sequence of a frozen schedule as a tuple of Python floats.

    A tensor given as a group's value (an optimizer's tensor ``lr``) would otherwise stay shared with whoever owns it:
    the scheduler fills the optimizer's ``lr`` in place every step, and a schedule holding that same tensor as its
    peak would see the peak overwritten. ``float`` copies the value out.
    """
    for f in fields(schedule):
        values = getattr(schedule, f.name)
        if not isinstance(values, tuple | list):
            continue
        try:
            copied = tuple(float(v) for v in values)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"`{f.name}` must be a sequence of numbers, got {values!r}") from None
        object.__setattr__(schedule, f.name, copied)


def _for_group(function: Callable[..., float], step: int, schedule: Any, group: int) -> float:
    """``function`` at ``step`` with ``schedule``'s fields it takes, a per-group tuple (``base_lrs``) as ``base_lr``."""
    takes = inspect.signature(function).parameters
    arguments = {}
    for f in fields(schedule):
        value = getattr(schedule, f.name)
        name = f.name.removesuffix("s") if isinstance(value, tuple) else f.name
        if name in takes:
            arguments[name] = value[group] if isinstance(value, tuple) else value
    return function(step, **arguments)


@runtime_checkable
class Schedule(Protocol):
    """A resolved schedule: per-parameter-group values as pure functions of the optimizer step."""

    kind: ClassVar[str]

    def lr_at(self, step: int, group: int) -> float:
        """Learning rate of parameter group ``group`` at optimizer step ``step``."""

    def momentum_at(self, step: int, group: int) -> float | None:
        """Momentum of parameter group ``group`` at ``step``, or ``None`` when the schedule leaves it alone."""

    @property
    def num_groups(self) -> int:
        """Number of parameter groups the schedule was resolved for."""


class _LROnly:
    """What the schedules that leave momentum alone share: one parameter group per entry of ``base_lrs``."""

    base_lrs: tuple[float, ...]
    #: The pure function of the step whose arguments the schedule's fields are.
    _lr_function: ClassVar[Callable[..., float]]

    @property
    def num_groups(self) -> int:
        """Number of parameter groups."""
        return len(self.base_lrs)

    def lr_at(self, step: int, group: int) -> float:
        """Learning rate of ``group`` at ``step``."""
        return _for_group(self._lr_function, step, self, group)

    def momentum_at(self, step: int, group: int) -> float | None:
        """Not scheduled: always ``None``."""
        return None


@dataclass(frozen=True)
class WarmupCosineSchedule(_LROnly):
    """:func:`warmup_cosine_lr` resolved for every parameter group of one optimizer.

    Args:
        base_lrs: Peak LR of each group.
        min_lrs: Floor of each group.
        warmup_steps: Warm-up length in optimizer steps.
        total_steps: End of the decay in optimizer steps.
        num_cycles: Waves of the cosine (or, with ``hard_restarts``, decays), > 0.
        hard_restarts: Restart from the peak at each cycle.
    """

    kind: ClassVar[str] = "warmup_cosine"
    _lr_function = staticmethod(warmup_cosine_lr)
    base_lrs: tuple[float, ...]
    min_lrs: tuple[float, ...]
    warmup_steps: int
    total_steps: int
    num_cycles: float = 0.5
    hard_restarts: bool = False

    def __post_init__(self) -> None:
        _check_decay(self)
        check_float("num_cycles", self.num_cycles, low=0.0, low_inclusive=False)
        check_bool("hard_restarts", self.hard_restarts)


@dataclass(frozen=True)
class LinearWarmupSchedule(_LROnly):
    """:func:`linear_warmup_lr` resolved for every parameter group of one optimizer.

    Args:
        base_lrs: LR of each group after warm-up.
        warmup_steps: Warm-up length in optimizer steps.
    """

    kind: ClassVar[str] = "linear_warmup"
    _lr_function = staticmethod(linear_warmup_lr)
    base_lrs: tuple[float, ...]
    warmup_steps: int

    def __post_init__(self) -> None:
        _own_floats(self)
        check_numbers("base_lrs", self.base_lrs, low=0.0)
        check_int("warmup_steps", self.warmup_steps, minimum=0)


def _check_decay(schedule: WarmupCosineSchedule | WarmupPolynomialSchedule | WarmupStableDecaySchedule) -> None:
    """Checks of a schedule that warms up, then decays from ``base_lrs`` to ``min_lrs`` by ``total_steps``."""
    _own_floats(schedule)
    check_numbers("base_lrs", schedule.base_lrs, low=0.0)
    check_numbers("min_lrs", schedule.min_lrs, low=0.0)
    check_int("warmup_steps", schedule.warmup_steps, minimum=0)
    check_int("total_steps", schedule.total_steps, minimum=1)
    if schedule.warmup_steps >= schedule.total_steps:
        raise ValueError(
            f"`warmup_steps` must be smaller than `total_steps` ({schedule.total_steps}), got {schedule.warmup_steps}"
        )
    if len(schedule.min_lrs) != len(schedule.base_lrs):
        raise ValueError(f"`min_lrs` needs one value per group ({len(schedule.base_lrs)}), got {len(schedule.min_lrs)}")


@dataclass(frozen=True)
class WarmupPolynomialSchedule(_LROnly):
    """:func:`warmup_polynomial_lr` resolved for every parameter group of one optimizer.

    Args:
        base_lrs: Peak LR of each group.
        min_lrs: Floor of each group.
        warmup_steps: Warm-up length in optimizer steps.
        total_steps: End of the decay in optimizer steps.
        power: Exponent of the decay, > 0 (1 is linear).
    """

    kind: ClassVar[str] = "warmup_polynomial"
    _lr_function = staticmethod(warmup_polynomial_lr)
    base_lrs: tuple[float, ...]
    min_lrs: tuple[float, ...]
    warmup_steps: int
    total_steps: int
    power: float = 1.0

    def __post_init__(self) -> None:
        _check_decay(self)
        check_float("power", self.power, low=0.0, low_inclusive=False)


@dataclass(frozen=True)
class WarmupStableDecaySchedule(_LROnly):
    """:func:`warmup_stable_decay_lr` resolved for every parameter group of one optimizer.

    Args:
        base_lrs: Stable-phase LR of each group.
        min_lrs: Start and end LR of each group.
        warmup_steps: Warm-up length in optimizer steps.
        decay_steps: Decay length in optimizer steps.
        total_steps: End of the decay; at least ``warmup_steps + decay_steps``.
        warmup_shape: ``"linear"``, ``"cosine"`` or ``"1-sqrt"``.
        decay_shape: ``"linear"``, ``"cosine"`` or ``"1-sqrt"``.
    """

    kind: ClassVar[str] = "warmup_stable_decay"
    _lr_function = staticmethod(warmup_stable_decay_lr)
    base_lrs: tuple[float, ...]
    min_lrs: tuple[float, ...]
    warmup_steps: int
    decay_steps: int
    total_steps: int
    warmup_shape: str = "linear"
    decay_shape: str = "cosine"

    def __post_init__(self) -> None:
        _check_decay(self)
        check_int("decay_steps", self.decay_steps, minimum=0)
        if self.warmup_steps + self.decay_steps > self.total_steps:
            raise ValueError(
                f"`warmup_steps` + `decay_steps` must not exceed `total_steps` ({self.total_steps}), got "
                f"{self.warmup_steps} + {self.decay_steps}"
            )
        check_choice("warmup_shape", self.warmup_shape, RAMP_SHAPES)
        check_choice("decay_shape", self.decay_shape, RAMP_SHAPES)


@dataclass(frozen=True)
class OneCycleSchedule:
    """:func:`one_cycle_lr` (and optionally :func:`one_cycle_momentum`) resolved for every parameter group.

    Args:
        max_lrs: Peak LR of each group.
        total_steps: Cycle length in optimizer steps.
        pct_start: Fraction of the cycle spent rising, in (0, 1).
        div_factor: ``initial_lr = max_lr / div_factor``.
        final_div_factor: ``min_lr = initial_lr / final_div_factor``.
        anneal_strategy: ``"cos"`` or ``"linear"``.
        three_phase: Use the three-phase variant.
        base_momentums: Momentum of each group at the LR peak; empty when momentum is not cycled.
        max_momentums: Momentum of each group at the start and the end; empty when momentum is not cycled.
    """

    kind: ClassVar[str] = "one_cycle"
    max_lrs: tuple[float, ...]
    total_steps: int
    pct_start: float = 0.3
    div_factor: float = 25.0
    final_div_factor: float = 1e4
    anneal_strategy: str = "cos"
    three_phase: bool = False
    base_momentums: tuple[float, ...] = ()
    max_momentums: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        _own_floats(self)
        check_numbers("max_lrs", self.max_lrs, low=0.0)
        check_int("total_steps", self.total_steps, minimum=1)
        check_float("pct_start", self.pct_start, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
        check_float("div_factor", self.div_factor, low=0.0, low_inclusive=False)
        check_float("final_div_factor", self.final_div_factor, low=0.0, low_inclusive=False)
        check_choice("anneal_strategy", self.anneal_strategy, ANNEAL_STRATEGIES)
        check_bool("three_phase", self.three_phase)
        check_numbers("base_momentums", self.base_momentums, low=0.0, allow_empty=True)
        check_numbers("max_momentums", self.max_momentums, low=0.0, allow_empty=True)

    @property
    def num_groups(self) -> int:
        """Number of parameter groups."""
        return len(self.max_lrs)

    def lr_at(self, step: int, group: int) -> float:
        """Learning rate of ``group`` at ``step``."""
        return _for_group(one_cycle_lr, step, self, group)

    def momentum_at(self, step: int, group: int) -> float | None:
        """Momentum of ``group`` at ``step``, or ``None`` when momentum is not cycled."""
        return _for_group(one_cycle_momentum, step, self, group) if self.max_momentums else None


_SCHEDULE_TYPES: Final[dict[str, type[Any]]] = {
    cls.kind: cls
    for cls in (
        WarmupCosineSchedule,
        WarmupPolynomialSchedule,
        WarmupStableDecaySchedule,
        LinearWarmupSchedule,
        OneCycleSchedule,
    )
}


def schedule_to_dict(schedule: Schedule) -> dict[str, Any]:
    """Plain-data form of a schedule (strings, numbers, lists), safe for ``torch.load(weights_only=True)``.

    Args:
        schedule: One of the schedule classes of this module.

    Returns:
        A dictionary that :func:`schedule_from_dict` turns back into an equal schedule.
    """
    data = {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(schedule).items()}  # type: ignore[call-overload]
    return {"kind": schedule.kind, **data}


def schedule_from_dict(data: dict[str, Any]) -> Schedule:
    """Rebuild a schedule saved by :func:`schedule_to_dict`.

    Args:
        data: The saved dictionary.

    Returns:
        The schedule.

    Raises:
        ValueError: If the saved kind is unknown.
    """
    kind = data.get("kind")
    if kind not in _SCHEDULE_TYPES:
        raise ValueError(f"unknown schedule kind {kind!r} in saved state; known kinds are {sorted(_SCHEDULE_TYPES)}")
    cls = _SCHEDULE_TYPES[kind]
    names = {f.name for f in fields(cls)}
    kwargs: dict[str, Any] = {
        key: tuple(value) if isinstance(value, list) else value for key, value in data.items() if key in names
    }
    return cls(**kwargs)
