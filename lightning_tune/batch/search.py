"""A batch-size search before the fit, on the grid of the controller that sizes the batch during it.

It follows Lightning's ``BatchSizeFinder`` and accelerate's ``find_executable_batch_size``, but tries only sizes on a
:class:`~lightning_tune.batch.BatchSizeController`'s grid and bisects until the fitting and the failing size are
neighbours there (``docs/dynamic_batch.md``). It knows no Trainer: the callable decides what a trial is.

Example:
    >>> def try_batch(size: int) -> bool:  # a step that runs out of memory above 45 samples
    ...     return size <= 45
    >>> find_batch_size(try_batch).batch_size
    45
    >>> grid = BatchSizeController(target=0.9, min_batch_size=1, max_batch_size=None, multiple_of=8)
    >>> find_batch_size(try_batch, controller=grid).trials
    ((2, True), (4, True), (8, True), (16, True), (32, True), (64, False), (48, False), (40, True))
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal, get_args

from lightning_tune._validation import check_callable, check_choice, check_instance, check_int
from lightning_tune.batch.control import BatchSizeController
from lightning_tune.batch.runner import is_allocation_failure

SearchMode = Literal["power", "binsearch"]
SEARCH_MODES: Final[tuple[str, ...]] = get_args(SearchMode)
_MAX_SIZE: Final[int] = 2**31 - 1  # beyond any batch; a larger start would only be halved trial after trial


@dataclass(frozen=True)
class BatchSizeSearch:
    """What :func:`find_batch_size` found: the largest size that fitted, and every size tried with whether it did."""

    batch_size: int
    trials: tuple[tuple[int, bool], ...]


def find_batch_size(
    try_batch: Callable[[int], bool | None],
    *,
    mode: SearchMode = "binsearch",
    init_val: int = 2,
    max_trials: int = 25,
    controller: BatchSizeController | None = None,
) -> BatchSizeSearch:
    """Find the largest batch size that fits, growing by powers of two and then bisecting on the controller's grid.

    Args:
        try_batch: Runs a step at the given size; returns ``False`` (or raises an allocation failure) when it does
            not fit, anything else when it does. Other exceptions propagate.
        mode: ``"power"`` stops at the last size that fitted before the first failure (Lightning's ``power``);
            ``"binsearch"`` then bisects between it and the failing size.
        init_val: The first size tried (rounded down to the grid), at most ``2**31 - 1``.
        max_trials: At most this many calls of ``try_batch``.
        controller: Its grid decides the sizes tried (``DynamicBatchSize``'s controller, or one built with the same
            arguments); default: every size from 1 up.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If ``mode`` is unknown, ``init_val`` is not from 1 to ``2**31 - 1`` or ``max_trials`` < 1.
        RuntimeError: If no size fits, down to the grid's smallest, within ``max_trials``.
    """
    check_callable("try_batch", try_batch)
    check_choice("mode", mode, SEARCH_MODES)
    check_int("init_val", init_val, minimum=1, maximum=_MAX_SIZE)
    check_int("max_trials", max_trials, minimum=1)
    check_instance("controller", controller, BatchSizeController, "a BatchSizeController", allow_none=True)
    grid = controller or BatchSizeController(target=1.0, min_batch_size=1, max_batch_size=None, multiple_of=1)
    trials: list[tuple[int, bool]] = []

    def fits(size: int) -> bool:
        try:
            ok = try_batch(size) is not False
        except Exception as err:
            if not is_allocation_failure(err):
                raise
            ok = False
        trials.append((size, ok))
        return ok

    good, bad = 0, math.inf  # the largest size that fitted, the smallest that did not
    size = grid.round_down(init_val)
    while len(trials) < max_trials:  # powers of two up from init_val, or down from it until one fits
        if fits(size):
            good = size
            if bad < math.inf:
                break
            nxt = grid.round_down(2 * size)
        else:
            bad = size
            if good:
                break
            nxt = grid.round_down(size / 2)
        if nxt == size:  # the top of the grid, or its bottom
            break
        size = nxt
    while mode == "binsearch" and good and bad < math.inf and len(trials) < max_trials:
        mid = grid.round_down((good + bad) / 2)
        if mid <= good:  # neighbours on the grid
            break
        if fits(mid):
            good = mid
        else:
            bad = mid
    if not good:
        raise RuntimeError(
            f"find_batch_size: no batch size fits from `init_val`={init_val} within `max_trials`={max_trials}; tried "
            f"{', '.join(str(s) for s, _ in trials)} (the grid's smallest is {grid.min_batch_size})"
        )
    return BatchSizeSearch(good, tuple(trials))
