r"""Learning-rate schedules as factor functions of the optimizer step, as torchtitan writes them.

A factor function maps ``step``, the index of the optimizer step a learning rate is used for (0, 1, 2, ...), to the
multiple of a parameter group's base LR that step uses; every other argument is a keyword. It holds no counter, tensor
or optimizer, and checks nothing, since it runs every step: bind its arguments once with ``functools.partial`` and
hand the result to :class:`~lightning_tune.lr.scheduler.ScheduleLR` (or torch's ``LambdaLR``). Floors are ratios of
the base LR (``min_ratio``), so one factor serves every parameter group.

The ``*_lr`` functions give the same schedules in learning rates (``base_lr`` times the factor) and check their
arguments.

Example:
    >>> from functools import partial
    >>> cosine = partial(warmup_cosine, warmup_steps=2, total_steps=4)
    >>> [round(cosine(s), 3) for s in range(5)]
    [0.0, 0.5, 1.0, 0.5, 0.0]
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Final, Literal, get_args

from lightning_tune._validation import check_bool, check_choice, check_float, check_int

AnnealStrategy = Literal["cos", "linear"]
ANNEAL_STRATEGIES: Final[tuple[str, ...]] = ("cos", "linear")
RampShape = Literal["linear", "cosine", "1-sqrt"]
RAMP_SHAPES: Final[tuple[str, ...]] = get_args(RampShape)


def warmup_cosine(
    step: int,
    *,
    warmup_steps: int,
    total_steps: int,
    min_ratio: float = 0.0,
    num_cycles: float = 0.5,
    hard_restarts: bool = False,
) -> float:
    r"""A linear warm-up, then a cosine decay (with Hugging Face's ``num_cycles`` and restarts).

    With warm-up :math:`W`, total :math:`T`, floor :math:`r`, cycles :math:`c` and progress
    :math:`p = (s - W) / (T - W)`: :math:`s / W` for :math:`s < W`, then
    :math:`r + (1 - r) \cdot \tfrac12 \left(1 + \cos(2 \pi c p)\right)` (the default :math:`c = 1/2` is one
    half-wave, from 1 down to :math:`r`), and the value of :math:`p = 1` from step :math:`T` on. With
    ``hard_restarts`` the decay is :math:`c` half-waves, each restarting from 1:
    :math:`r + (1 - r) \cdot \tfrac12 \left(1 + \cos(\pi \cdot (c p \bmod 1))\right)`, and :math:`r` from :math:`T` on.

    Args:
        step: Index of the optimizer step (0-based).
        warmup_steps: Number of warm-up steps :math:`W` (0 for none).
        total_steps: Step :math:`T` at which the decay ends; greater than ``warmup_steps``.
        min_ratio: Floor of the decay, as a fraction of the base LR.
        num_cycles: Waves of the cosine over the decay (``get_cosine_schedule_with_warmup``'s ``num_cycles``), or the
            number of decays with ``hard_restarts`` (``get_cosine_with_hard_restarts_schedule_with_warmup``'s).
        hard_restarts: Jump back to the base LR at the start of each cycle.

    Returns:
        The factor for ``step``.
    """
    if step < warmup_steps:
        return step / warmup_steps
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    if hard_restarts:
        if progress >= 1.0:
            return min_ratio
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * ((num_cycles * progress) % 1.0)))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))


def warmup_polynomial(
    step: int, *, warmup_steps: int, total_steps: int, min_ratio: float = 0.0, power: float = 1.0
) -> float:
    r"""A linear warm-up, then a polynomial decay to ``min_ratio``.

    :math:`s / W` for :math:`s < W`, then :math:`r + (1 - r) (1 - p)^{k}` with :math:`p = (s - W) / (T - W)` and power
    :math:`k`, and :math:`r` from step :math:`T` on. ``power=1`` with ``min_ratio=0`` is Hugging Face's default
    ``get_linear_schedule_with_warmup``; other values are its ``get_polynomial_decay_schedule_with_warmup``.

    Args:
        step: Index of the optimizer step (0-based).
        warmup_steps: Number of warm-up steps :math:`W` (0 for none).
        total_steps: Step :math:`T` at which the decay reaches ``min_ratio``; greater than ``warmup_steps``.
        min_ratio: Floor of the decay, as a fraction of the base LR.
        power: Exponent :math:`k` of the decay (1 is linear).

    Returns:
        The factor for ``step``.
    """
    if step < warmup_steps:
        return step / warmup_steps
    if step >= total_steps:
        return min_ratio
    remaining = 1.0 - (step - warmup_steps) / (total_steps - warmup_steps)
    return min_ratio + (1.0 - min_ratio) * remaining**power


def _ramp(progress: float, shape: str) -> float:
    """A rise from 0 to 1 over ``progress`` in [0, 1]: ``linear``, ``cosine`` (half a wave) or ``1-sqrt``."""
    if shape == "linear":
        return progress
    if shape == "cosine":
        return 0.5 * (1.0 - math.cos(math.pi * progress))
    return 1.0 - math.sqrt(1.0 - progress)


def warmup_stable_decay(
    step: int,
    *,
    warmup_steps: int,
    decay_steps: int,
    total_steps: int,
    min_ratio: float = 0.0,
    warmup_shape: str = "linear",
    decay_shape: str = "cosine",
) -> float:
    r"""Warm-up, stable, decay (WSD), as Hugging Face's ``get_wsd_schedule``.

    The factor rises from ``min_ratio`` to 1 over the first ``warmup_steps`` (``warmup_shape``), stays at 1, and falls
    back to ``min_ratio`` over the last ``decay_steps`` before ``total_steps`` (``decay_shape``: the warm-up's shape
    run backwards); ``min_ratio`` from ``total_steps`` on. The shapes, over a phase's progress :math:`p`: ``"linear"``
    :math:`p`, ``"cosine"`` :math:`\tfrac12(1 - \cos \pi p)`, ``"1-sqrt"`` :math:`1 - \sqrt{1 - p}` for the rise.

    Args:
        step: Index of the optimizer step (0-based).
        warmup_steps: Length of the warm-up (0 for none).
        decay_steps: Length of the decay (0 for none).
        total_steps: End of the decay; at least ``warmup_steps + decay_steps``.
        min_ratio: Start of the warm-up and end of the decay, as a fraction of the base LR.
        warmup_shape: ``"linear"``, ``"cosine"`` or ``"1-sqrt"``.
        decay_shape: ``"linear"``, ``"cosine"`` or ``"1-sqrt"``.

    Returns:
        The factor for ``step``.
    """
    if step < warmup_steps:
        return min_ratio + (1.0 - min_ratio) * _ramp(step / warmup_steps, warmup_shape)
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return 1.0
    if step >= total_steps:
        return min_ratio
    return min_ratio + (1.0 - min_ratio) * _ramp(1.0 - (step - decay_start) / decay_steps, decay_shape)


def linear_warmup(step: int, *, warmup_steps: int) -> float:
    """A linear warm-up to 1 that stays there: ``step / warmup_steps`` for ``step < warmup_steps``, then 1.

    Args:
        step: Index of the optimizer step (0-based).
        warmup_steps: Number of warm-up steps (0 for none).

    Returns:
        The factor for ``step``.
    """
    return step / warmup_steps if step < warmup_steps else 1.0


def one_cycle(
    step: int,
    *,
    total_steps: int,
    pct_start: float = 0.3,
    anneal_strategy: str = "cos",
    three_phase: bool = False,
    start: float = 1 / 25,
    peak: float = 1.0,
    end: float = 1 / 25 / 1e4,
) -> float:
    """The one-cycle policy (Smith & Topin): ``start`` to ``peak``, then to ``end``, as ``OneCycleLR`` phases it.

    With ``three_phase`` the cycle returns to ``start`` before going to ``end``. The phase boundaries and the annealing
    are those of ``torch.optim.lr_scheduler.OneCycleLR``; steps at or past ``total_steps`` keep the final value. The
    defaults are ``OneCycleLR``'s LR as a factor of ``max_lr`` (``div_factor`` 25, ``final_div_factor`` 1e4); its
    momentum is the same function from ``max_momentum`` (``start``, ``end``) to ``base_momentum`` (``peak``).

    Args:
        step: Index of the optimizer step (0-based).
        total_steps: Length of the cycle in optimizer steps.
        pct_start: Fraction of the cycle spent rising.
        anneal_strategy: ``"cos"`` or ``"linear"``.
        three_phase: Use the three-phase variant.
        start: Value at step 0.
        peak: Value at the end of the first phase.
        end: Value at the last step.

    Returns:
        The factor (or momentum) for ``step``.
    """
    step = min(step, total_steps - 1)
    if three_phase:
        ends = [float(pct_start * total_steps) - 1, float(2 * pct_start * total_steps) - 2, float(total_steps - 1)]
        phases = [(start, peak), (peak, start), (start, end)]
    else:
        ends = [float(pct_start * total_steps) - 1, float(total_steps - 1)]
        phases = [(start, peak), (peak, end)]
    begin = 0.0
    for index, stop in enumerate(ends):
        if step <= stop or index == len(ends) - 1:
            span = stop - begin
            pct = (step - begin) / span if span > 0 else 1.0
            first, last = phases[index]
            if anneal_strategy == "cos":
                return last + (first - last) / 2.0 * (math.cos(math.pi * pct) + 1)
            return (last - first) * pct + first
        begin = stop
    raise AssertionError("unreachable")  # pragma: no cover


#: The factor functions by name: a checkpoint names the one a scheduler follows.
FACTORS: Final[dict[str, Callable[..., float]]] = {
    f.__name__: f for f in (warmup_cosine, warmup_polynomial, warmup_stable_decay, linear_warmup, one_cycle)
}


def _check_step(step: int, **numbers: float) -> None:
    """Check the step (an integer >= 0) and the learning rates, momenta and step counts of an ``*_lr`` function."""
    check_int("step", step, minimum=0)
    for name, value in numbers.items():
        if name.endswith("_steps"):
            check_int(name, value, minimum=0)
        else:
            check_float(name, value, low=0.0)


def _check_decay(step: int, *, base_lr: float, warmup_steps: int, total_steps: int, min_lr: float) -> float:
    """The checks of a schedule that warms up, then decays to ``min_lr`` by ``total_steps``; ``min_lr`` as a ratio."""
    _check_step(step, base_lr=base_lr, warmup_steps=warmup_steps, min_lr=min_lr)
    check_int("total_steps", total_steps, minimum=1)
    if warmup_steps >= total_steps:
        raise ValueError(f"`warmup_steps` must be smaller than `total_steps` ({total_steps}), got {warmup_steps}")
    return min_lr / base_lr if base_lr > 0 else 0.0


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
    """The learning rate of :func:`warmup_cosine` at ``step``: ``base_lr`` times it, floored at ``min_lr``.

    The arguments are the factor function's, with ``base_lr`` and the floor as learning rates; each is checked.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range.

    Example:
        >>> [round(warmup_cosine_lr(s, base_lr=1.0, warmup_steps=0, total_steps=4, num_cycles=2, hard_restarts=True), 3)
        ...  for s in range(5)]
        [1.0, 0.5, 1.0, 0.5, 0.0]
    """
    ratio = _check_decay(step, base_lr=base_lr, warmup_steps=warmup_steps, total_steps=total_steps, min_lr=min_lr)
    check_float("num_cycles", num_cycles, low=0.0, low_inclusive=False)
    check_bool("hard_restarts", hard_restarts)
    return base_lr * warmup_cosine(
        step,
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        min_ratio=ratio,
        num_cycles=num_cycles,
        hard_restarts=hard_restarts,
    )


def warmup_polynomial_lr(
    step: int, *, base_lr: float, warmup_steps: int, total_steps: int, min_lr: float = 0.0, power: float = 1.0
) -> float:
    """The learning rate of :func:`warmup_polynomial` at ``step``: ``base_lr`` times it, decaying to ``min_lr``.

    The arguments are the factor function's, with ``base_lr`` and the floor as learning rates; each is checked.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range.

    Example:
        >>> [warmup_polynomial_lr(s, base_lr=1.0, warmup_steps=2, total_steps=6) for s in range(7)]
        [0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0]
    """
    ratio = _check_decay(step, base_lr=base_lr, warmup_steps=warmup_steps, total_steps=total_steps, min_lr=min_lr)
    check_float("power", power, low=0.0, low_inclusive=False)
    return base_lr * warmup_polynomial(
        step, warmup_steps=warmup_steps, total_steps=total_steps, min_ratio=ratio, power=power
    )


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
    """The learning rate of :func:`warmup_stable_decay` at ``step``: from ``min_lr`` to ``base_lr`` and back.

    The arguments are the factor function's, with ``base_lr`` and the floor as learning rates; each is checked.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range or a shape unknown.

    Example:
        >>> [warmup_stable_decay_lr(s, base_lr=1.0, warmup_steps=2, decay_steps=2, total_steps=6,
        ...                         decay_shape="linear") for s in range(7)]
        [0.0, 0.5, 1.0, 1.0, 1.0, 0.5, 0.0]
    """
    ratio = _check_decay(step, base_lr=base_lr, warmup_steps=warmup_steps, total_steps=total_steps, min_lr=min_lr)
    check_int("decay_steps", decay_steps, minimum=0, maximum=total_steps - warmup_steps)
    check_choice("warmup_shape", warmup_shape, RAMP_SHAPES)
    check_choice("decay_shape", decay_shape, RAMP_SHAPES)
    return base_lr * warmup_stable_decay(
        step,
        warmup_steps=warmup_steps,
        decay_steps=decay_steps,
        total_steps=total_steps,
        min_ratio=ratio,
        warmup_shape=warmup_shape,
        decay_shape=decay_shape,
    )


def linear_warmup_lr(step: int, *, base_lr: float, warmup_steps: int) -> float:
    """The learning rate of :func:`linear_warmup` at ``step``: a linear warm-up to ``base_lr``, then ``base_lr``.

    The arguments are the factor function's, with ``base_lr`` and the floor as learning rates; each is checked.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range.

    Example:
        >>> [linear_warmup_lr(s, base_lr=1.0, warmup_steps=4) for s in range(6)]
        [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    """
    _check_step(step, base_lr=base_lr, warmup_steps=warmup_steps)
    return base_lr * linear_warmup(step, warmup_steps=warmup_steps)


def _checked_cycle(
    total_steps: int, pct_start: float, anneal_strategy: AnnealStrategy, three_phase: bool
) -> Callable[..., float]:
    """:func:`one_cycle` with these arguments, once they are checked."""
    check_int("total_steps", total_steps, minimum=1)
    check_float("pct_start", pct_start, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
    check_choice("anneal_strategy", anneal_strategy, ANNEAL_STRATEGIES)
    check_bool("three_phase", three_phase)
    return partial(
        one_cycle,
        total_steps=total_steps,
        pct_start=pct_start,
        anneal_strategy=anneal_strategy,
        three_phase=three_phase,
    )


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
    """The learning rate of the one-cycle policy at ``step``, as ``torch.optim.lr_scheduler.OneCycleLR`` gives it.

    The LR rises from ``max_lr / div_factor`` to ``max_lr`` over the first ``pct_start`` of the run, then anneals to
    ``max_lr / div_factor / final_div_factor`` (with ``three_phase``: back to the initial LR first). Steps at or past
    ``total_steps`` keep the final value instead of raising. It is ``max_lr`` times :func:`one_cycle` from
    ``1 / div_factor`` to 1 and down to ``1 / div_factor / final_div_factor``; the arguments are checked.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range or the strategy unknown.

    Example:
        >>> round(one_cycle_lr(0, max_lr=1.0, total_steps=10), 6)
        0.04
    """
    _check_step(step, max_lr=max_lr)
    check_float("div_factor", div_factor, low=0.0, low_inclusive=False)
    check_float("final_div_factor", final_div_factor, low=0.0, low_inclusive=False)
    cycle = _checked_cycle(total_steps, pct_start, anneal_strategy, three_phase)
    start = 1.0 / div_factor
    return max_lr * cycle(step, start=start, end=start / final_div_factor)


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
    """Momentum (or Adam's ``beta1``) of the one-cycle policy at ``step``, inversely to the learning rate.

    :func:`one_cycle` from ``max_momentum`` down to ``base_momentum`` at the LR peak, and back; the arguments are
    checked.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range or the strategy unknown.

    Example:
        >>> one_cycle_momentum(0, total_steps=10)
        0.95
    """
    _check_step(step, base_momentum=base_momentum, max_momentum=max_momentum)
    cycle = _checked_cycle(total_steps, pct_start, anneal_strategy, three_phase)
    return cycle(step, start=max_momentum, peak=base_momentum, end=max_momentum)
