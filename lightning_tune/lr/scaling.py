"""Learning-rate scaling rules for a change of batch size."""

from __future__ import annotations

import math
from typing import Final, Literal

from lightning_tune._validation import check_choice, check_finite_result, check_float, check_int

ScaleRule = Literal["sqrt", "linear"]
SCALE_RULES: Final[tuple[str, ...]] = ("sqrt", "linear")


def scale_lr(lr: float, old_batch_size: int, new_batch_size: int, *, rule: ScaleRule = "sqrt") -> float:
    """Return a learning rate scaled for a new batch size.

    Args:
        lr: The learning rate tuned for ``old_batch_size``.
        old_batch_size: Batch size ``lr`` was tuned for.
        new_batch_size: Batch size to scale to.
        rule: ``"sqrt"`` (times ``sqrt(new / old)``, for Adam-family optimizers) or ``"linear"`` (for SGD).

    Raises:
        TypeError: If a batch size is not an integer or ``lr`` not a number.
        ValueError: If ``lr`` is negative, a batch size below 1, ``rule`` unknown, or the scaled rate overflows.

    Example:
        >>> round(scale_lr(3e-4, 32, 64), 8)
        0.00042426
        >>> scale_lr(0.1, 256, 512, rule="linear")
        0.2
    """
    check_float("lr", lr, low=0.0)
    check_int("old_batch_size", old_batch_size, minimum=1)
    check_int("new_batch_size", new_batch_size, minimum=1)
    check_choice("rule", rule, SCALE_RULES)
    ratio = new_batch_size / old_batch_size
    scaled = lr * (math.sqrt(ratio) if rule == "sqrt" else ratio)
    inputs = f"`lr`={lr!r}, `old_batch_size`={old_batch_size!r}, `new_batch_size`={new_batch_size!r}"
    return check_finite_result("the scaled learning rate", scaled, inputs)
