"""Padding-free micro-batches: a step's samples packed into rows with sequence boundaries (``pack=True``).

A row is what ``transformers.DataCollatorWithFlattening`` makes of a padded Hugging Face batch (see
``docs/dynamic_batch.md``, "Packing"); :func:`check_packed` compares a packed loss with the unpacked one, so that an
attention that ignores the boundaries is caught instead of training on mixed samples.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_tune.batch.runner import MicroBatch, loss_of
from lightning_tune.batch.split import select
from lightning_tune.batch.trim import PaddingLayout, trim
from lightning_tune.perf.batch import BatchLayout

_MASK, _LABELS, _POSITIONS = "attention_mask", "labels", "position_ids"


class PackingError(RuntimeError):
    """A packed forward's loss differs from the unpacked forward's: the attention mixes the packed samples."""


def ignore_first_labels(batch: Any, layout: PaddingLayout | None) -> Any:
    """``batch`` with each sample's first real label set to -100, as a packed row has it.

    The packed and the unpacked step then weigh and average the same label tokens.

    Example:
        >>> mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
        >>> batch = {"input_ids": mask * 5, "attention_mask": mask, "labels": torch.tensor([[-100, 7, 8], [4, 5, 6]])}
        >>> from lightning_tune.batch.trim import padding_layout
        >>> ignore_first_labels(batch, padding_layout(batch))["labels"].tolist()
        [[-100, -100, 8], [-100, 5, 6]]

    Raises:
        TypeError: If the batch cannot be packed (see :func:`check_packable`).
    """
    check_packable(batch, layout)
    assert layout is not None
    labels = batch[_LABELS].clone()
    firsts = [(layout.span(layout.lengths[i]).start, i) for i in range(len(layout.lengths)) if layout.lengths[i]]
    if firsts:
        where = torch.tensor(firsts).T.to(labels.device, non_blocking=True)  # a list index would copy it blocking
        labels[where[1], where[0]] = -100
    out = {**batch, _LABELS: labels}
    return out if type(batch) is dict else type(batch)(out)


def pack(batch: Mapping[str, Any], layout: PaddingLayout, indices: Sequence[int]) -> dict[str, Any]:
    """One row of the real tokens of the samples at ``indices`` of a padded batch, with their boundaries.

    The row is what ``DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)`` collates
    from those samples; values that are not per-token go whole into it. The batch is one :func:`ignore_first_labels`
    accepted.

    Example:
        >>> mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
        >>> batch = {"input_ids": torch.tensor([[1, 2, 0], [3, 4, 5]]), "attention_mask": mask, "labels": mask * 9}
        >>> from lightning_tune.batch.trim import padding_layout
        >>> row = pack(batch, padding_layout(batch), [1, 0])
        >>> row["input_ids"].tolist(), row["labels"].tolist(), row["position_ids"].tolist()
        ([[3, 4, 5, 1, 2]], [[-100, 9, 9, -100, 9]], [[0, 1, 2, 0, 1]])
        >>> row["cu_seq_lens_q"].tolist(), row["max_length_q"]
        ([0, 3, 5], 3)
    """
    real = [layout.span(layout.lengths[i]) for i in indices]
    row: dict[str, Any] = {}
    for key, value in batch.items():
        if key in (_MASK, _POSITIONS):
            continue
        if key not in layout.keys:
            row[key] = value
            continue
        parts = [value[i, cut] for i, cut in zip(indices, real, strict=True)]
        if key == _LABELS:
            parts = [torch.cat([part.new_full(part[:1].shape, -100), part[1:]]) for part in parts]
        row[key] = torch.cat(parts)[None]
    lengths = [layout.lengths[i] for i in indices]
    device = batch[_LABELS].device  # made on the host, copied without waiting for the device
    positions = torch.cat([torch.arange(n) for n in lengths]) if lengths else torch.zeros(0, dtype=torch.long)
    row[_POSITIONS] = positions[None].to(device, non_blocking=True)
    bounds = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32).to(device, non_blocking=True)
    row["cu_seq_lens_q"], row["cu_seq_lens_k"] = bounds, bounds.clone()
    row["max_length_q"] = row["max_length_k"] = max(lengths, default=0)
    return row


def check_packable(batch: Any, layout: PaddingLayout | None) -> None:
    """Refuse a step ``pack=True`` cannot pack: without 2-D ``labels``, or with a per-sample value besides tokens.

    Raises:
        TypeError: Naming the key and what packing needs.
    """
    labels = batch.get(_LABELS) if isinstance(batch, Mapping) else None
    if layout is None or not isinstance(labels, Tensor) or _LABELS not in layout.keys:
        found = sorted(map(str, batch)) if isinstance(batch, Mapping) else type(batch).__name__
        raise TypeError(
            "`pack=True` needs mapping batches with a 2-D `attention_mask` and `labels` of the same shape (-100 where "
            f"ignored), as Hugging Face's collators make them; got {found}"
        )
    n = len(layout.lengths)  # the mask gives the layout; anything else per sample cannot go in a row
    for key, value in batch.items():
        per_sample = isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == n
        if per_sample and key not in layout.keys:
            raise TypeError(
                f"`pack=True` packs the per-token keys {list(layout.keys)}; batch key {key!r} holds a value per "
                "sample that a packed row cannot carry. Leave it out of the batch or train without `pack`"
            )


def pack_rows(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Samples in rows of at most ``budget`` tokens (first fit, longest first); a longer sample is a row of its own.

    Example:
        >>> pack_rows([5, 2, 7, 3, 1], 8)
        [[2, 4], [0, 3], [1]]
    """
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fit = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if fit is None:
            rows.append([i])
            room.append(budget - lengths[i])
        else:
            rows[fit].append(i)
            room[fit] -= lengths[i]
    return rows


def cut_packed(
    batch: Mapping[str, Any], layout: PaddingLayout, budget: int, *, tokens: Sequence[int]
) -> list[tuple[MicroBatch, list[int]]]:
    """A step's packed rows of at most ``budget`` tokens, each weighing its share of ``tokens``, with their samples."""
    total = float(sum(tokens))
    pieces = []
    for indices in pack_rows(layout.lengths, budget):
        weight = sum(tokens[i] for i in indices) / total if total else len(indices) / len(layout.lengths)
        row = pack(batch, layout, indices)
        pieces.append((MicroBatch(row, len(indices), weight, row["input_ids"].shape[1]), indices))
    return pieces


def unpacked(batch: Mapping[str, Any], layout: PaddingLayout, indices: Sequence[int], rule: BatchLayout) -> Any:
    """The samples at ``indices`` as a padded micro-batch, trimmed to their longest (what the guard compares with)."""
    part = select(batch, indices, layout=rule)
    return trim(part, layout, layout.longest(indices) + (layout.side == "left"))


@contextlib.contextmanager
def no_cache(modules: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Run with ``config.use_cache = False`` on each of ``modules`` (Hugging Face models), restored afterwards.

    With a cache, Hugging Face's mask functions do not read sequence boundaries from ``position_ids`` and a packed
    row attends across its samples.
    """
    configs: list[Any] = [getattr(m, "config", None) for m in modules]
    configs = [c for c in configs if getattr(c, "use_cache", None) is not None]
    saved = [c.use_cache for c in configs]
    for config in configs:
        config.use_cache = False
    try:
        yield
    finally:
        for config, value in zip(configs, saved, strict=True):
            config.use_cache = value


def check_packed(
    run: Callable[[Any], Any],
    packed: Any,
    padded: Any,
    *,
    model: str,
    precise: bool = True,
    module: torch.nn.Module | None = None,
) -> tuple[float, float]:
    """Compare the loss ``run`` gives a packed row with the loss of the same samples padded, without gradients.

    ``module`` (``None``: modes left alone) runs in eval mode for both (dropout would make them differ), and autocast
    is off, so that the comparison sees the model's own precision: relative tolerance ``1e-5`` when it computes in full
    precision (``precise``), ``1e-2`` otherwise. Returns the packed and the padded loss.

    Raises:
        PackingError: If they differ beyond the tolerance.
        TypeError: If ``run`` returns no loss.
    """
    device = packed["input_ids"].device.type
    modes = [(m, m.training) for m in module.modules()] if module is not None else []
    try:
        for sub, _ in modes:
            sub.training = False
        with torch.no_grad(), torch.autocast(device, enabled=False):
            losses = [loss_of(run(batch)) for batch in (packed, padded)]
    finally:
        for sub, mode in modes:
            sub.training = mode
    got, want = (float(loss.float()) if loss is not None else None for loss in losses)
    if got is None or want is None:
        raise TypeError("`pack=True` checks the packed loss against the padded one: `training_step` must return a loss")
    tolerance = 1e-5 if precise else 1e-2
    if not math.isclose(got, want, rel_tol=tolerance, abs_tol=1e-6):
        raise PackingError(
            f"DynamicBatchSize(pack=True): the packed loss {got:.6g} differs from the padded loss {want:.6g} of the "
            f"same samples (relative tolerance {tolerance:g}): {model} attends across the packed samples. Use an "
            "attention implementation that reads the sequence boundaries (`sdpa` or `eager` with `use_cache=False`, "
            "`flash_attention_2`), pass `position_ids` and the `cu_seq_lens_*`/`max_length_*` keys of the batch to "
            "the model, or train without `pack`. `pack_guard=False` turns this check off."
        )
    return got, want
