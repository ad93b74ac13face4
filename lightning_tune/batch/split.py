"""Cut a collated batch into micro-batches along its sample dimension.

Tensors whose first dimension is the batch's sample count are sliced; so are flat lists of per-sample Python
objects (strings, ids) of that length. Mappings, tuples, named tuples and lists of tensors are cut element by
element; anything else (scalars, ``None``, tensors of another length) is passed to every micro-batch unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from lightning_tune._validation import check_int
from lightning_tune.perf.batch import count_samples, map_children

__all__ = ["split_batch", "split_sizes"]


def _is_leaf_list(obj: Any) -> bool:
    return isinstance(obj, (list, tuple)) and not any(isinstance(x, (Tensor, Mapping, list, tuple)) for x in obj)


def _cut(obj: Any, start: int, stop: int, n: int) -> Any:
    if isinstance(obj, Tensor):
        return obj[start:stop] if obj.dim() > 0 and obj.shape[0] == n else obj
    if _is_leaf_list(obj):
        return obj[start:stop] if len(obj) == n else obj
    return map_children(obj, lambda child: _cut(child, start, stop, n))


def split_batch(batch: Any, size: int) -> list[Any]:
    """Split ``batch`` into consecutive micro-batches of at most ``size`` samples.

    Args:
        batch: A collated batch: a tensor, or mappings/sequences holding tensors.
        size: Largest micro-batch.

    Returns:
        The micro-batches, in order; ``[batch]`` itself when it is no larger than ``size``.

    Raises:
        TypeError: If the batch holds no tensor to count its samples by.

    Example:
        >>> import torch
        >>> parts = split_batch({"x": torch.arange(5), "id": ["a", "b", "c", "d", "e"], "scale": 2.0}, 2)
        >>> [(p["x"].tolist(), p["id"], p["scale"]) for p in parts]
        [([0, 1], ['a', 'b'], 2.0), ([2, 3], ['c', 'd'], 2.0), ([4], ['e'], 2.0)]
    """
    check_int("size", size, minimum=1)
    n = _count(batch)
    if n <= size:
        return [batch]
    return split_sizes(batch, [min(size, n - start) for start in range(0, n, size)])


def split_sizes(batch: Any, sizes: list[int]) -> list[Any]:
    """Cut ``batch`` into consecutive pieces of the given sizes (which add up to its sample count).

    Args:
        batch: A collated batch.
        sizes: Samples in each piece.

    Returns:
        The pieces, in order.

    Raises:
        TypeError: If the batch holds no tensor to count its samples by, or ``sizes`` is not a sequence of integers.
        ValueError: If a size is below 1, or ``sizes`` do not add up to the batch's samples.

    Example:
        >>> import torch
        >>> [p.tolist() for p in split_sizes(torch.arange(5), [3, 2])]
        [[0, 1, 2], [3, 4]]
    """
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        raise TypeError(f"`sizes` must be a sequence of integers, got {sizes!r} ({type(sizes).__name__})")
    for index, k in enumerate(sizes):
        check_int(f"sizes[{index}]", k, minimum=1)
    n = _count(batch)
    if sum(sizes) != n:
        raise ValueError(f"`sizes` must add up to the batch's {n} samples, got {sizes}")
    if len(sizes) == 1:
        return [batch]
    pieces, start = [], 0
    for k in sizes:
        pieces.append(_cut(batch, start, start + k, n))
        start += k
    return pieces


def _count(batch: Any) -> int:
    n = count_samples(batch)
    if n is None:
        raise TypeError(
            f"cannot split a batch of type {type(batch).__name__} into micro-batches: it holds no tensor whose first "
            "dimension counts the samples"
        )
    return n
