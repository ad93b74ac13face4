"""How many samples and tokens a batch holds, found without a host-device synchronisation.

Samples are the leading dimension of the first tensor found (Lightning's own rule). Tokens are counted once per
batch from the *inputs*: an attention mask (a ``bool`` tensor, or the value of an ``attention_mask`` key) gives the
number of real tokens, padding excluded; otherwise the first two-dimensional integer tensor (``(batch, seq)`` token
ids) gives ``batch * seq``. Targets of the same shape are not counted again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

MASK_KEYS = ("attention_mask",)


def _tensors(batch: Any) -> list[tuple[str | None, Tensor]]:
    """Tensors of a batch in order, with the mapping key that holds each (if any), depth first."""
    found: list[tuple[str | None, Tensor]] = []
    stack: list[tuple[str | None, Any]] = [(None, batch)]
    while stack:
        key, item = stack.pop()
        if isinstance(item, Tensor):
            found.append((key, item))
        elif isinstance(item, Mapping):
            stack.extend(reversed([(str(k), v) for k, v in item.items()]))
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed([(key, v) for v in item]))
    return found


def map_children(batch: Any, fn: Callable[[Any], Any]) -> Any:
    """``batch`` rebuilt with ``fn`` applied to each child: a mapping's values, a (named) tuple's or a list's items.

    A mapping keeps its type (a tokenizer's ``BatchEncoding``); anything else (a tensor, a number) is returned as it is.
    """
    if isinstance(batch, Mapping):
        out = {key: fn(value) for key, value in batch.items()}
        return out if type(batch) is dict else type(batch)(out)  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(fn(item) for item in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(fn(item) for item in batch)
    return batch


def count_samples(batch: Any) -> int | None:
    """Number of samples in a batch: the leading dimension of its first tensor.

    Args:
        batch: A tensor, or tuples, lists and mappings of them.

    Returns:
        The count, or ``None`` when the batch holds no tensor with a leading dimension.

    Example:
        >>> count_samples({"input_ids": torch.zeros(8, 16, dtype=torch.long)})
        8
    """
    for _, tensor in _tensors(batch):
        if tensor.dim() > 0:
            return int(tensor.shape[0])
    return None


def count_tokens(batch: Any) -> int | Tensor | None:
    """Number of input tokens in a batch, padding excluded when a mask is present.

    Args:
        batch: A tensor, or tuples, lists and mappings of them.

    Returns:
        An ``int`` when the count follows from shapes, a 0-dim tensor on the batch's device when it comes from a
        mask (read it when convenient, e.g. at logging time), or ``None`` when the batch holds no token ids.

    Example:
        >>> ids = torch.zeros(2, 5, dtype=torch.long)
        >>> count_tokens((ids, ids))
        10
        >>> int(count_tokens({"input_ids": ids, "attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])}))
        8
    """
    tensors = _tensors(batch)
    for key, tensor in tensors:
        if tensor.dim() == 2 and (tensor.dtype == torch.bool or (key in MASK_KEYS and not tensor.is_floating_point())):
            return tensor.sum()
    for _, tensor in tensors:
        if tensor.dim() == 2 and not tensor.is_floating_point() and not tensor.is_complex():
            return int(tensor.numel())
    return None


def sequence_length(batch: Any) -> int | None:
    """Sequence length of a batch: the second dimension of its first ``(batch, seq)`` integer tensor (token ids).

    Args:
        batch: A tensor, or tuples, lists and mappings of them.

    Returns:
        The length (padding included), or ``None`` when the batch holds no token ids.

    Example:
        >>> sequence_length({"input_ids": torch.zeros(2, 7, dtype=torch.long), "labels": torch.zeros(2, 7)})
        7
    """
    for _, tensor in _tensors(batch):
        if tensor.dim() == 2 and tensor.dtype != torch.bool and not (tensor.is_floating_point() or tensor.is_complex()):
            return int(tensor.shape[1])
    return None
