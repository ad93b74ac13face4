"""How many samples and tokens a batch holds, found without a host-device synchronisation.

The rules are in ``docs/throughput.md`` (Samples, Tokens) and ``docs/dynamic_batch.md`` (Batches the pack cuts); a
step's readers (the monitor, ``DynamicBatchSize``) share the counts of the batch counted last (:data:`LAST_BATCH`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_tune._validation import check_strings

MASK_KEYS = ("attention_mask",)
#: Values that cannot be per-sample: they go whole to every micro-batch.
_SCALARS = (str, bytes, int, float, complex, type(None))
Path = tuple[Any, ...]


class _LastBatch:
    """The counts taken of the batch object a layout counted last, while it is the same object with the same values.

    Only a layout's count starts an entry, so the pieces a step is cut into do not push the batch out. It holds the
    batch, so that its identity cannot pass to another object, and the identities of its top level's values, so that
    a mapping or list refilled in place counts afresh.
    """

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Let go of the batch (at the end of a run)."""
        self.batch: Any = None
        self.top: tuple[int, ...] | None = None  # None: a batch whose top level cannot change (a tuple, a tensor)
        self.counts: dict[Any, Any] = {}

    def of(self, batch: Any) -> dict[Any, Any] | None:
        """The counts of ``batch`` taken so far, or ``None`` for another batch."""
        if batch is not self.batch or (self.top is not None and _top(batch) != self.top):
            return None
        return self.counts

    def start(self, batch: Any) -> dict[Any, Any]:
        """The counts of ``batch`` taken so far, or a new entry for it in place of the last batch's."""
        counts = self.of(batch)
        if counts is None:
            self.batch, self.top, self.counts = batch, _top(batch), {}
        return self.counts


LAST_BATCH = _LastBatch()


def _top(batch: Any) -> tuple[int, ...] | None:
    """The identities of a mapping's values or a list's items; ``None`` for a batch of another type."""
    if isinstance(batch, Mapping):
        return tuple(map(id, batch.values()))
    return tuple(map(id, batch)) if isinstance(batch, list) else None


def _tensors(batch: Any) -> list[tuple[str | None, Tensor]]:
    """Tensors of a batch in order, with the mapping key that holds each (if any), depth first; walked once a batch."""
    counts = LAST_BATCH.of(batch)
    if counts is None:
        return _walk_tensors(batch)
    found = counts.get(_tensors)
    if found is None:
        found = counts[_tensors] = _walk_tensors(batch)
    return found


def _walk_tensors(batch: Any) -> list[tuple[str | None, Tensor]]:
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
    """``batch`` rebuilt, of its own type, with ``fn`` applied to each of a mapping's values or a sequence's items."""
    if isinstance(batch, Mapping):
        out = {key: fn(value) for key, value in batch.items()}
        return out if type(batch) is dict else type(batch)(out)  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(fn(item) for item in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(fn(item) for item in batch)
    return batch


def count_samples(batch: Any) -> int | None:
    """Number of samples in a batch, by :class:`BatchLayout`'s rule (a layout's count of this batch, if it took one).

    Args:
        batch: A tensor, or tuples, lists and mappings of them and of per-sample objects.

    Returns:
        The count, or ``None`` when the batch holds nothing per-sample to count.

    Example:
        >>> count_samples({"class_weights": torch.ones(4), "x": torch.zeros(32, 8), "y": torch.zeros(32)})
        32
    """
    counts = LAST_BATCH.of(batch)
    return counts[BatchLayout] if counts and BatchLayout in counts else BatchLayout().samples(batch, check=False)


def path_text(path: Path) -> str:
    """A value's place in a batch, as Python indexes it: ``batch[1][0]['boxes']``."""
    return "batch" + "".join(f"[{key!r}]" for key in path)


def is_record(node: Any) -> bool:
    """Whether ``node`` holds named values (a mapping or a named tuple), not a sequence of items."""
    return isinstance(node, Mapping) or (isinstance(node, tuple) and hasattr(node, "_fields"))


def children(node: Any) -> list[tuple[Any, Any]]:
    """``node``'s (key, value) pairs: a mapping's items, else its items by index."""
    return list(node.items()) if isinstance(node, Mapping) else list(enumerate(node))


def _per_sample_by_kind(node: list[Any] | tuple[Any, ...]) -> bool:
    """Items no batched value can be: Python scalars and strings, or two or more mappings with the same keys."""
    if not any(isinstance(x, (Tensor, Mapping, list, tuple)) for x in node):
        return True
    return len(node) > 1 and all(isinstance(x, Mapping) for x in node) and len({tuple(x) for x in node}) == 1


class BatchLayout:
    """Which values of a collated batch are per-sample, and how many samples it holds.

    The rule and what it refuses: ``docs/dynamic_batch.md`` (Batches the pack cuts). The place of each sequence is
    read once and kept for the batches after it, so a short last batch cannot make a value's role ambiguous.

    Args:
        per_batch: Values that are per batch, not per sample: a mapping key (anywhere in the batch) or a place as
            refusals print it (``"batch[2]"``, ``"batch['meta']['scale']"``).

    Example:
        >>> images, targets = torch.zeros(3, 1, 4, 4), [{"boxes": torch.zeros(k, 4)} for k in (1, 5, 2)]
        >>> layout = BatchLayout()
        >>> layout.samples((images, targets)), layout.per_sample((1,))
        (3, True)
    """

    def __init__(self, per_batch: Sequence[str] = ()) -> None:
        if per_batch != ():  # the package builds many empty layouts; a user's value is always checked
            check_strings("per_batch", per_batch, what="mapping keys or places in the batch (strings)")
        self.per_batch = frozenset(per_batch)
        self._items: dict[Path, bool] = {}  # each sequence's place once read: per-sample objects (True) or values

    def whole(self, path: Path) -> bool:
        """Whether the value at ``path`` is declared per batch."""
        if not path or not self.per_batch:
            return False
        return path_text(path) in self.per_batch or (isinstance(path[-1], str) and path[-1] in self.per_batch)

    def per_sample(self, path: Path) -> bool:
        """Whether the sequence at ``path`` holds per-sample objects (as read by :meth:`samples`)."""
        return self._items.get(path, False)

    def samples(self, batch: Any, *, check: bool = True) -> int | None:
        """The batch's sample count (``None`` when nothing is per-sample); reads the places of new sequences.

        Args:
            batch: A collated batch.
            check: Refuse what the rule cannot cut (else count what can be counted and read nothing new).

        Raises:
            TypeError: With ``check``, if a value has a type the rule cannot cut.
            ValueError: With ``check``, if a per-sample value's length is not the count, or a sequence cannot be placed.
        """
        counts = LAST_BATCH.start(batch)
        seen = counts.get(self)  # this layout's count of this batch: (count, whether checked)
        if seen is not None and (seen[1] or not check):
            return seen[0]
        n = self._samples(batch, check)
        counts[self] = (n, check)
        counts[BatchLayout] = n  # the latest count by the rule, which count_samples reads
        return n

    def _samples(self, batch: Any, check: bool) -> int | None:
        found: list[tuple[Path, int, bool]] = []  # (place, length, whether a tensor) of the per-sample values
        open_: list[tuple[Path, Any]] = []  # sequences whose place needs the count
        self._scan(batch, (), found, open_, check)
        tensors = [(path, k) for path, k, tensor in found if tensor]
        counted = tensors or [(path, k) for path, k, _ in found] or [(path, len(seq)) for path, seq in open_]
        if not counted:
            return None
        tally = Counter(k for _, k in counted)
        n = max(tally, key=lambda k: (tally[k], k))
        while open_:
            path, seq = open_.pop(0)
            as_items = self._place(path, seq, n, check)
            if as_items:
                found.append((path, len(seq), False))
            else:
                for key, child in children(seq):
                    self._scan(child, (*path, key), found, open_, check)
        wrong = [(path, k, tensor) for path, k, tensor in found if k != n]
        if check and wrong:
            where = next(path_text(path) for path, k in counted if k == n)
            shown = "; ".join(
                f"{path_text(path)} has {k} {'rows' if tensor else 'items'}" for path, k, tensor in wrong[:4]
            )
            raise ValueError(
                f"DynamicBatchSize cannot cut this batch: it holds {n} samples (as {where} and most of its tensors "
                f"say), but {shown}{' ...' if len(wrong) > 4 else ''}. A value that is per batch, not per sample, "
                f"goes whole to every micro-batch when named in `per_batch=` (e.g. per_batch={[_name(wrong[0][0])]}); "
                "a batch the rule cannot cut needs `split_batch=`"
            )
        return n

    def _scan(self, node: Any, path: Path, found: list[Any], open_: list[Any], check: bool) -> None:
        if self.whole(path):
            return
        if isinstance(node, Tensor):
            if node.dim():
                found.append((path, int(node.shape[0]), True))
        elif is_record(node):
            for key, child in children(node):
                self._scan(child, (*path, key), found, open_, check)
        elif isinstance(node, (list, tuple)):
            items = self._items.get(path)
            if items is None and (not path or _per_sample_by_kind(node)):
                items = self._items[path] = _per_sample_by_kind(node)
            if items is None:
                open_.append((path, node))
            elif items:
                found.append((path, len(node), False))
            else:
                for key, child in children(node):
                    self._scan(child, (*path, key), found, open_, check)
        elif check and not isinstance(node, _SCALARS):
            raise TypeError(
                f"DynamicBatchSize cannot cut {path_text(path)}, a {type(node).__name__}: name it in `per_batch=` "
                f"(e.g. per_batch={[_name(path)]}) if it is per batch, or cut the batch with `split_batch=`"
            )

    def _place(self, path: Path, seq: list[Any] | tuple[Any, ...], n: int, check: bool) -> bool:
        """Read whether the sequence at ``path`` holds per-sample objects (True) or values of ``n`` rows (False)."""
        as_items, as_values = len(seq) == n, self._rows(seq, path, n) is True
        if as_items != as_values:
            self._items[path] = as_items
            return as_items
        if n > 1 and check:  # with one sample or none nothing is cut: read it when the count tells
            kind = type(seq).__name__
            why = (
                f"it can be {n} samples or {len(seq)} values of {n} rows each"
                if as_items
                else f"the batch has {n} samples and its items are not values of {n} rows"
            )
            raise ValueError(
                f"DynamicBatchSize cannot cut {path_text(path)}, a {kind} of {len(seq)} items: {why}. Name it in "
                f"`per_batch=` (e.g. per_batch={[_name(path)]}) if it is per batch, or cut the batch with "
                "`split_batch=`"
            )
        return as_items

    def _rows(self, node: Any, path: Path, n: int) -> bool | None:
        """Whether ``node``'s items are values of ``n`` rows: True, False (one cannot be), None (none is per-sample)."""
        seen: bool | None = None
        for key, child in children(node):
            place = (*path, key)
            if self.whole(place) or isinstance(child, _SCALARS) or (isinstance(child, Tensor) and not child.dim()):
                continue
            if isinstance(child, Tensor):
                fits: bool | None = child.shape[0] == n
            elif is_record(child):
                fits = self._rows(child, place, n)
            elif isinstance(child, (list, tuple)):
                fits = len(child) == n or self._rows(child, place, n) is True  # scalars of another length: no
            else:
                fits = False
            if fits is False:
                return False
            seen = seen or fits
        return seen


def _name(path: Path) -> str:
    """What ``per_batch`` names the value at ``path`` by: its mapping key, else its place."""
    return path[-1] if path and isinstance(path[-1], str) else path_text(path)


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
    """The second dimension (padding included) of a batch's first ``(batch, seq)`` integer tensor, else ``None``.

    Example:
        >>> sequence_length({"input_ids": torch.zeros(2, 7, dtype=torch.long), "labels": torch.zeros(2, 7)})
        7
    """
    for _, tensor in _tensors(batch):
        if tensor.dim() == 2 and tensor.dtype != torch.bool and not (tensor.is_floating_point() or tensor.is_complex()):
            return int(tensor.shape[1])
    return None
