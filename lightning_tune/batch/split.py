"""Cut a collated batch into micro-batches along its sample dimension, by one rule (:class:`BatchLayout`'s).

Tensors are cut on their first dimension, sequences of per-sample objects (a target dict per image, a
variable-length tensor per recording, strings, ragged lists) item by item; mappings, named tuples and tuples or lists
of values are walked; scalars, strings and values named in ``per_batch`` go whole to every micro-batch. What the rule
cannot cut safely is refused, naming its place in the batch (see :class:`~lightning_tune.perf.batch.BatchLayout`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_tune._validation import check_instance, check_int
from lightning_tune.perf.batch import BatchLayout, Path, children, is_record

__all__ = ["select", "split_batch", "split_sizes"]


def split_batch(batch: Any, size: int, *, per_batch: Sequence[str] = ()) -> list[Any]:
    """Split ``batch`` into consecutive micro-batches of at most ``size`` samples.

    Args:
        batch: A collated batch: a tensor, or mappings/sequences holding tensors and per-sample objects.
        size: Largest micro-batch.
        per_batch: Values that go whole to every micro-batch (mapping keys or places, as :class:`BatchLayout`).

    Returns:
        The micro-batches, in order; ``[batch]`` itself when it is no larger than ``size``.

    Raises:
        TypeError: If the batch holds nothing per-sample to count, or a value of a type the rule cannot cut.
        ValueError: If its per-sample values disagree on the sample count.

    Example:
        >>> parts = split_batch({"x": torch.arange(5), "id": ["a", "b", "c", "d", "e"], "scale": 2.0}, 2)
        >>> [(p["x"].tolist(), p["id"], p["scale"]) for p in parts]
        [([0, 1], ['a', 'b'], 2.0), ([2, 3], ['c', 'd'], 2.0), ([4], ['e'], 2.0)]
    """
    check_int("size", size, minimum=1)
    layout = BatchLayout(per_batch)
    n = _count(batch, layout)
    if n <= size:
        return [batch]
    return split_sizes(batch, [min(size, n - start) for start in range(0, n, size)], layout=layout)


def split_sizes(
    batch: Any, sizes: Sequence[int], *, per_batch: Sequence[str] = (), layout: BatchLayout | None = None
) -> list[Any]:
    """Cut ``batch`` into consecutive pieces of the given sizes (which add up to its sample count).

    Args:
        batch: A collated batch.
        sizes: Samples in each piece.
        per_batch: Values that go whole to every piece (mapping keys or places, as :class:`BatchLayout`).
        layout: The layout already read from the run's batches (it carries its own ``per_batch``).

    Returns:
        The pieces, in order.

    Raises:
        TypeError: If the batch cannot be counted or cut (as :func:`split_batch`), or ``sizes`` is not a sequence of
            integers.
        ValueError: If a size is below 1, ``sizes`` do not add up to the batch's samples, or its per-sample values
            disagree on the sample count.

    Example:
        >>> [p.tolist() for p in split_sizes(torch.arange(5), [3, 2])]
        [[0, 1, 2], [3, 4]]
    """
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        raise TypeError(f"`sizes` must be a sequence of integers, got {sizes!r} ({type(sizes).__name__})")
    for index, k in enumerate(sizes):
        check_int(f"sizes[{index}]", k, minimum=1)
    check_instance("layout", layout, BatchLayout, "a BatchLayout", allow_none=True)
    layout = layout if layout is not None else BatchLayout(per_batch)
    n = _count(batch, layout)
    if sum(sizes) != n:
        raise ValueError(f"`sizes` must add up to the batch's {n} samples, got {sizes}")
    if len(sizes) == 1:
        return [batch]
    pieces, start = [], 0
    for k in sizes:
        pieces.append(_Cut(layout, slice(start, start + k)).walk(batch, ()))
        start += k
    return pieces


def select(batch: Any, indices: Sequence[int], layout: BatchLayout) -> Any:
    """The samples at ``indices`` of a batch whose ``layout`` was read (:meth:`BatchLayout.samples`), in that order.

    Example:
        >>> batch = {"x": torch.arange(4), "id": ["a", "b", "c", "d"], "t": 0.5}
        >>> layout = BatchLayout()
        >>> layout.samples(batch)
        4
        >>> select(batch, [2, 0], layout)
        {'x': tensor([2, 0]), 'id': ['c', 'a'], 't': 0.5}
    """
    return _Cut(layout, list(indices)).walk(batch, ())


class _Cut:
    """One piece of a batch: the samples of a slice or of a list of indices."""

    def __init__(self, layout: BatchLayout, pick: slice | list[int]) -> None:
        self.layout, self.pick = layout, pick
        self.index: Tensor | None = None

    def walk(self, node: Any, path: Path) -> Any:
        if self.layout.whole(path):
            return node
        if isinstance(node, Tensor):
            return self.rows(node) if node.dim() else node
        if isinstance(node, (list, tuple)) and not is_record(node) and self.layout.per_sample(path):
            items = node[self.pick] if isinstance(self.pick, slice) else [node[i] for i in self.pick]
            return items if type(node) is list else type(node)(items)
        if isinstance(node, Mapping):
            out = {key: self.walk(value, (*path, key)) for key, value in node.items()}
            return out if type(node) is dict else type(node)(out)  # type: ignore[call-arg]
        if isinstance(node, (list, tuple)):
            parts = [self.walk(child, (*path, key)) for key, child in children(node)]
            return type(node)(*parts) if is_record(node) else type(node)(parts)
        return node

    def rows(self, tensor: Tensor) -> Tensor:
        if isinstance(self.pick, slice):
            return tensor[self.pick]
        if self.index is None or self.index.device != tensor.device:
            # non-blocking: a blocking host-to-device copy waits for the device's queue (a sync per micro-batch)
            self.index = torch.as_tensor(self.pick, dtype=torch.long).to(tensor.device, non_blocking=True)
        return tensor.index_select(0, self.index)


def _count(batch: Any, layout: BatchLayout) -> int:
    n = layout.samples(batch)
    if n is None:
        raise TypeError(
            f"cannot split a batch of type {type(batch).__name__} into micro-batches: it holds no tensor or sequence "
            "of per-sample objects to count its samples by"
        )
    return n
