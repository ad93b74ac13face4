"""Cut a collated batch into micro-batches along its sample dimension, by one rule (:class:`BatchLayout`'s).

What the rule cannot cut safely is refused, naming its place in the batch (see
:class:`~lightning_tune.perf.batch.BatchLayout` and ``docs/dynamic_batch.md``, "Batches the pack cuts").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_tune._validation import check_int
from lightning_tune.perf.batch import BatchLayout, Path, children, is_record


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


def split_sizes(batch: Any, sizes: Sequence[int], *, layout: BatchLayout | None = None) -> list[Any]:
    """Cut ``batch`` into consecutive pieces of ``sizes`` samples (which add up to its count) by ``layout``'s rule.

    Example:
        >>> [p.tolist() for p in split_sizes(torch.arange(5), [3, 2])]
        [[0, 1, 2], [3, 4]]
    """
    layout = layout if layout is not None else BatchLayout()
    _count(batch, layout)  # reads the places of the batch's sequences, which the cut follows
    if len(sizes) == 1:
        return [batch]
    pieces, start = [], 0
    for k in sizes:
        pieces.append(_Cut(layout, slice(start, start + k)).walk(batch, ()))
        start += k
    return pieces


def select(batch: Any, indices: Sequence[int], *, layout: BatchLayout | None = None) -> Any:
    """The samples at ``indices`` of a collated batch, in that order, by ``layout``'s rule (a fresh one by default).

    Example:
        >>> select({"x": torch.arange(4), "id": ["a", "b", "c", "d"], "t": 0.5}, [2, 0])
        {'x': tensor([2, 0]), 'id': ['c', 'a'], 't': 0.5}
    """
    layout = layout if layout is not None else BatchLayout()
    layout.samples(batch)  # reads the places of the batch's sequences, which the cut follows
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
