"""Learning-rate schedules as factor functions of the optimizer step, as torchtitan writes them.

A factor function maps ``step`` (0, 1, 2, ...) to the multiple of a parameter group's base LR that step uses, its
other arguments bound with ``functools.partial``; unchecked, as it runs every step (``docs/lr_schedules.md``).

Example:
    >>> from functools import partial
    >>> cosine = partial(warmup_cosine, warmup_steps=2, total_steps=4)
    >>> [round(cosine(s), 3) for s in range(5)]
    [0.0, 0.5, 1.0, 0.5, 0.0]
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Final, Literal, get_args

from lightning_tune._validation import check_bool, check_choice, check_float, check_int

AnnealStrategy = Literal["cos", "linear"]
ANNEAL_STRATEGIES: Final[tuple[str, ...]] = ("cos", "linear")
RampShape = Literal["linear", "cosine", "1-sqrt"]
RAMP_SHAPES: Final[tuple[str, ...]] = get_args(RampShape)


def floor_ratio(floor: float, peak: float) -> float:
    """A floor as the ``min_ratio`` of a factor function: its ratio to the peak, 0 for a peak of 0."""
    return floor / peak if peak > 0 else 0.0


def warmup_cosine(
    step: int,
    *,
    warmup_steps: int,
    total_steps: int,
    min_ratio: float = 0.0,
    num_cycles: float = 0.5,
    hard_restarts: bool = False,
) -> float:
    """Return the factor of ``step`` of a linear warm-up, then a cosine decay (formula: ``docs/lr_schedules.md``).

    Args:
        step: Index of the optimizer step (0-based).
        warmup_steps: Number of warm-up steps (0 for none).
        total_steps: Step at which the decay ends; greater than ``warmup_steps``.
        min_ratio: Floor of the decay, as a fraction of the base LR.
        num_cycles: Waves of the cosine over the decay; with ``hard_restarts``, the number of decays.
        hard_restarts: Jump back to the base LR at the start of each cycle.
    """
    if step < warmup_steps:
        return step / warmup_steps
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    if hard_restarts and progress >= 1.0:
        return min_ratio
    angle = math.pi * ((num_cycles * progress) % 1.0) if hard_restarts else math.pi * num_cycles * 2.0 * progress
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(angle))


def warmup_polynomial(
    step: int, *, warmup_steps: int, total_steps: int, min_ratio: float = 0.0, power: float = 1.0
) -> float:
    """Return the factor of ``step`` of a linear warm-up, then a polynomial decay to ``min_ratio``.

    Args:
        step: Index of the optimizer step (0-based).
        warmup_steps: Number of warm-up steps (0 for none).
        total_steps: Step at which the decay reaches ``min_ratio``; greater than ``warmup_steps``.
        min_ratio: Floor of the decay, as a fraction of the base LR.
        power: Exponent of the decay (1 is linear).
    """
    if step < warmup_steps:
        return step / warmup_steps
    if step >= total_steps:
        return min_ratio
    remaining = 1.0 - (step - warmup_steps) / (total_steps - warmup_steps)
    return min_ratio + (1.0 - min_ratio) * remaining**power


def _ramp(progress: float, shape: str) -> float:
    """A rise from 0 to 1 over ``progress`` in [0, 1], of one of :data:`RAMP_SHAPES`."""
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
    """Return the factor of ``step`` of a warm-up, stable, decay (WSD) schedule, as Hugging Face's ``get_wsd_schedule``.

    Args:
        step: Index of the optimizer step (0-based).
        warmup_steps: Length of the warm-up (0 for none).
        decay_steps: Length of the decay (0 for none).
        total_steps: End of the decay; at least ``warmup_steps + decay_steps``.
        min_ratio: Start of the warm-up and end of the decay, as a fraction of the base LR.
        warmup_shape: ``"linear"``, ``"cosine"`` or ``"1-sqrt"``.
        decay_shape: ``"linear"``, ``"cosine"`` or ``"1-sqrt"`` (run backwards).
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
    """Return the factor of ``step`` of a linear warm-up to 1 that stays there.

    Args:
        step: Index of the optimizer step (0-based).
        warmup_steps: Number of warm-up steps (0 for none).
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
    """Return the factor (or momentum) of ``step`` of the one-cycle policy: ``start`` to ``peak`` to ``end``.

    Phased as ``OneCycleLR``; steps at or past ``total_steps`` keep the final value. The defaults are ``OneCycleLR``'s
    LR as a factor of ``max_lr``.

    Args:
        step: Index of the optimizer step (0-based).
        total_steps: Length of the cycle in optimizer steps.
        pct_start: Fraction of the cycle spent rising.
        anneal_strategy: ``"cos"`` or ``"linear"``.
        three_phase: Return to ``start`` before going to ``end``.
        start: Value at step 0.
        peak: Value at the end of the first phase.
        end: Value at the last step.
    """
    step = min(step, total_steps - 1)
    if three_phase:
        ends = [float(pct_start * total_steps) - 1, float(2 * pct_start * total_steps) - 2, float(total_steps - 1)]
        phases = [(start, peak), (peak, start), (start, end)]
    else:
        ends = [float(pct_start * total_steps) - 1, float(total_steps - 1)]
        phases = [(start, peak), (peak, end)]
    index = 0
    while step > ends[index] and index < len(ends) - 1:
        index += 1
    begin = ends[index - 1] if index else 0.0
    span = ends[index] - begin
    pct = (step - begin) / span if span > 0 else 1.0
    first, last = phases[index]
    if anneal_strategy == "cos":
        return last + (first - last) / 2.0 * (math.cos(math.pi * pct) + 1)
    return (last - first) * pct + first


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


def _checked_decay(step: int, *, base_lr: float, warmup_steps: int, total_steps: int, min_lr: float) -> dict[str, Any]:
    """The keywords every warm-up-then-decay factor takes (the floor as a ratio), once checked."""
    _check_step(step, base_lr=base_lr, warmup_steps=warmup_steps, min_lr=min_lr)
    check_int("total_steps", total_steps, minimum=1)
    if warmup_steps >= total_steps:
        raise ValueError(f"`warmup_steps` must be smaller than `total_steps` ({total_steps}), got {warmup_steps}")
    if min_lr > 0 and base_lr == 0:  # the floor is a ratio of the peak: a peak of 0 has none
        raise ValueError(f"`min_lr` must be 0 when `base_lr` is 0 (the floor is a ratio of the peak), got {min_lr}")
    return {"warmup_steps": warmup_steps, "total_steps": total_steps, "min_ratio": floor_ratio(min_lr, base_lr)}


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
    """The learning rate of :func:`warmup_cosine` at ``step``: its arguments, with LRs for ratios, checked.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range.

    Example:
        >>> [round(warmup_cosine_lr(s, base_lr=1.0, warmup_steps=0, total_steps=4, num_cycles=2, hard_restarts=True), 3)
        ...  for s in range(5)]
        [1.0, 0.5, 1.0, 0.5, 0.0]
    """
    decay = _checked_decay(step, base_lr=base_lr, warmup_steps=warmup_steps, total_steps=total_steps, min_lr=min_lr)
    check_float("num_cycles", num_cycles, low=0.0, low_inclusive=False)
    check_bool("hard_restarts", hard_restarts)
    return base_lr * warmup_cosine(step, **decay, num_cycles=num_cycles, hard_restarts=hard_restarts)


def warmup_polynomial_lr(
    step: int, *, base_lr: float, warmup_steps: int, total_steps: int, min_lr: float = 0.0, power: float = 1.0
) -> float:
    """The learning rate of :func:`warmup_polynomial` at ``step``: its arguments, with LRs for ratios, checked.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range.

    Example:
        >>> [warmup_polynomial_lr(s, base_lr=1.0, warmup_steps=2, total_steps=6) for s in range(7)]
        [0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0]
    """
    decay = _checked_decay(step, base_lr=base_lr, warmup_steps=warmup_steps, total_steps=total_steps, min_lr=min_lr)
    check_float("power", power, low=0.0, low_inclusive=False)
    return base_lr * warmup_polynomial(step, **decay, power=power)


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
    """The learning rate of :func:`warmup_stable_decay` at ``step``: its arguments, with LRs for ratios, checked.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range or a shape unknown.

    Example:
        >>> [warmup_stable_decay_lr(s, base_lr=1.0, warmup_steps=2, decay_steps=2, total_steps=6,
        ...                         decay_shape="linear") for s in range(7)]
        [0.0, 0.5, 1.0, 1.0, 1.0, 0.5, 0.0]
    """
    decay = _checked_decay(step, base_lr=base_lr, warmup_steps=warmup_steps, total_steps=total_steps, min_lr=min_lr)
    check_int("decay_steps", decay_steps, minimum=0, maximum=total_steps - warmup_steps)
    check_choice("warmup_shape", warmup_shape, RAMP_SHAPES)
    check_choice("decay_shape", decay_shape, RAMP_SHAPES)
    shapes: dict[str, Any] = {"warmup_shape": warmup_shape, "decay_shape": decay_shape}
    return base_lr * warmup_stable_decay(step, **decay, decay_steps=decay_steps, **shapes)


def linear_warmup_lr(step: int, *, base_lr: float, warmup_steps: int) -> float:
    """The learning rate of :func:`linear_warmup` at ``step``: ``base_lr`` times it, the arguments checked.

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
) -> dict[str, Any]:
    """The keywords of :func:`one_cycle` beyond its values, once checked."""
    check_int("total_steps", total_steps, minimum=1)
    check_float("pct_start", pct_start, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
    check_choice("anneal_strategy", anneal_strategy, ANNEAL_STRATEGIES)
    check_bool("three_phase", three_phase)
    return dict(total_steps=total_steps, pct_start=pct_start, anneal_strategy=anneal_strategy, three_phase=three_phase)


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
    """The learning rate of the one-cycle policy at ``step``, as ``OneCycleLR`` gives it, the arguments checked.

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
    return max_lr * one_cycle(step, **cycle, start=start, end=start / final_div_factor)


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
    """Momentum (or Adam's ``beta1``) of the one-cycle policy at ``step``, as ``OneCycleLR`` gives it, checked.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range or the strategy unknown.

    Example:
        >>> one_cycle_momentum(0, total_steps=10)
        0.95
    """
    _check_step(step, base_momentum=base_momentum, max_momentum=max_momentum)
    cycle = _checked_cycle(total_steps, pct_start, anneal_strategy, three_phase)
    return one_cycle(step, **cycle, start=max_momentum, peak=base_momentum, end=max_momentum)
