"""Cut a collated batch into micro-batches along its sample dimension.

Tensors whose first dimension is the batch's sample count are sliced; so are flat lists of per-sample Python
objects (strings, ids) of that length. Mappings, tuples, named tuples and lists of tensors are cut element by
element; anything else (scalars, ``None``, tensors of another length) is passed to every micro-batch unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from lightning_tune.perf.batch import count_samples

__all__ = ["split_batch"]


def _is_leaf_list(obj: Any) -> bool:
    return isinstance(obj, (list, tuple)) and not any(isinstance(x, (Tensor, Mapping, list, tuple)) for x in obj)


def _cut(obj: Any, start: int, stop: int, n: int) -> Any:
    if isinstance(obj, Tensor):
        return obj[start:stop] if obj.dim() > 0 and obj.shape[0] == n else obj
    if isinstance(obj, Mapping):
        cut = {k: _cut(v, start, stop, n) for k, v in obj.items()}
        return cut if type(obj) is dict else type(obj)(cut)  # type: ignore[call-arg]  # e.g. a tokenizer's BatchEncoding
    if _is_leaf_list(obj):
        return obj[start:stop] if len(obj) == n else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(_cut(x, start, stop, n) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cut(x, start, stop, n) for x in obj)
    return obj


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
    n = count_samples(batch)
    if n is None:
        raise TypeError(
            f"cannot split a batch of type {type(batch).__name__} into micro-batches: it holds no tensor whose first "
            "dimension counts the samples"
        )
    if n <= size:
        return [batch]
    return [_cut(batch, start, min(start + size, n), n) for start in range(0, n, size)]
