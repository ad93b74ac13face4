"""Variable-length batches: order a step's samples by length, trim each micro-batch to its own longest sequence.

A step's collated samples are all padded to its longest; :func:`cut_sequences` undoes that, reading lengths and
padding side from the ``attention_mask`` (:func:`padding_layout`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_tune.batch.runner import MicroBatch
from lightning_tune.batch.split import select
from lightning_tune.perf.batch import BatchLayout

#: Keys of a Hugging Face batch whose second dimension is the padded sequence, trimmed together.
TRIM_KEYS: tuple[str, ...] = ("input_ids", "attention_mask", "labels", "token_type_ids", "position_ids")
_MASK = "attention_mask"


@dataclass(frozen=True)
class PaddingLayout:
    """How a collated batch of sequences is padded."""

    lengths: tuple[int, ...]  # real tokens of each sample, in batch order
    side: Literal["right", "left"]
    padded: int  # the batch's second dimension
    keys: tuple[str, ...]  # the mapping keys whose tensors are cut along the sequence dimension

    def longest(self, indices: Sequence[int]) -> int:
        """The longest real length among the samples at ``indices``."""
        return max((self.lengths[i] for i in indices), default=0)

    def span(self, length: int) -> slice:
        """The ``length`` positions of a row next to its padding: where a sample of that length sits."""
        return slice(0, length) if self.side == "right" else slice(self.padded - length, self.padded)


def padding_layout(batch: Any, trim_keys: Sequence[str] = ()) -> PaddingLayout | None:
    """Read a batch's padding from its ``attention_mask``, or ``None`` when it cannot be trimmed safely.

    Another tensor with the padded length as its second dimension, neither in :data:`TRIM_KEYS` nor in ``trim_keys``,
    leaves the batch untrimmed and warns, naming the key, so that trimming never makes two tensors disagree in shape.

    Example:
        >>> mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
        >>> layout = padding_layout({"input_ids": torch.zeros(2, 4, dtype=torch.long), "attention_mask": mask})
        >>> layout.lengths, layout.side, layout.padded
        ((2, 3), 'right', 4)
    """
    if not isinstance(batch, Mapping):
        return None
    mask = batch.get(_MASK)
    if not isinstance(mask, Tensor) or mask.dim() != 2 or mask.shape[1] == 0:
        return None
    n, padded = mask.shape
    flags = mask.detach().to("cpu", torch.bool)
    lengths = flags.sum(1)
    positions = torch.arange(padded)
    right = bool((flags == (positions < lengths[:, None])).all())
    left = bool((flags == (positions >= padded - lengths[:, None])).all())
    if not (right or left):
        return None  # padded on both sides, or holes in the mask: nothing is safe to cut
    named = set(TRIM_KEYS) | set(trim_keys)
    keys = []
    for key, value in batch.items():
        if not isinstance(value, Tensor) or value.dim() < 2 or value.shape[0] != n or value.shape[1] != padded:
            continue
        if key not in named:
            warnings.warn(
                f"batch key {key!r} has the padded length {padded} as its second dimension but is not a known "
                f"sequence key; the batch is left untrimmed. Name it in `trim_keys=` to trim it with the others.",
                stacklevel=2,
            )
            return None
        keys.append(str(key))
    return PaddingLayout(tuple(int(v) for v in lengths), "right" if right else "left", int(padded), tuple(keys))


def length_order(lengths: Sequence[int]) -> list[int]:
    """Sample indices, longest first (ties keep batch order), so consecutive micro-batches hold similar lengths.

    Example:
        >>> length_order([3, 9, 3, 7])
        [1, 3, 0, 2]
    """
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])


def trim(batch: Mapping[str, Any], layout: PaddingLayout, length: int) -> Any:
    """Cut the layout's sequence tensors of a micro-batch to ``length`` positions, on the side the padding sits.

    Example:
        >>> mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])
        >>> batch = {"input_ids": mask * 7, "attention_mask": mask}
        >>> trim(batch, padding_layout(batch), 3)["input_ids"].tolist()
        [[0, 7, 7], [7, 7, 7]]
    """
    if length >= layout.padded:
        return batch
    # contiguous: a view of the wider batch has other strides, which a compiled graph guards on (a recompile)
    out = {k: (v[:, layout.span(length)].contiguous() if k in layout.keys else v) for k, v in batch.items()}
    return out if type(batch) is dict else type(batch)(out)  # type: ignore[call-arg]


def round_length(length: int, multiple: int, padded: int) -> int:
    """``length`` rounded up to a multiple of ``multiple``, never past the batch's padded length.

    Example:
        >>> round_length(65, 64, 1024), round_length(65, 64, 100), round_length(0, 8, 16)
        (128, 100, 8)
    """
    return min(max(-(-length // multiple) * multiple, multiple), padded)


def sample_tokens(batch: Any, shift: int = 0) -> list[int]:
    """Per-sample count of what a token-mean loss averages over (as :func:`label_tokens`), read on the host.

    Example:
        >>> sample_tokens({"labels": torch.tensor([[-100, 5, 6, -100], [1, 2, 3, 4]])}, shift=1)
        [2, 3]
    """
    counts = label_tokens(batch, shift, per_sample=True)
    return [int(v) for v in counts.tolist()]  # type: ignore[union-attr]


def cut_sequences(
    batch: Any,
    n: int,
    layout: PaddingLayout,
    fits: Callable[[int], int],
    *,
    sample_weight: float,
    tail: int = 0,
    tail_weight: float = 0.0,
    tokens: Sequence[int] | None = None,
    multiple: int = 1,
    batch_layout: BatchLayout | None = None,
) -> list[MicroBatch]:
    """Cut one optimizer step of ``n`` samples into micro-batches grouped by length, each trimmed to its longest.

    Samples are taken longest first (the step's gradient is a sum over them): a micro-batch whose longest sample,
    rounded up to ``multiple``, is ``L`` holds ``fits(L)`` samples (at least one) and ends before a sample shorter than
    half its longest. The weights and ``batch_layout`` are as :func:`~lightning_tune.batch.runner.cut_step`'s.

    Example:
        >>> mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
        >>> batch = {"input_ids": mask * 5, "attention_mask": mask}
        >>> parts = cut_sequences(batch, 3, padding_layout(batch), lambda length: 8 // length, sample_weight=1 / 3)
        >>> [(p.samples, p.seq_len, round(p.weight, 3)) for p in parts]
        [(2, 4, 0.667), (1, 1, 0.333)]
    """
    head, rest = list(range(n - tail)), list(range(n - tail, n))
    groups = [head + rest] if tokens is not None else [g for g in (head, rest) if g]
    total = float(sum(tokens)) if tokens is not None else 0.0
    pieces: list[MicroBatch] = []
    for group in groups:
        order = sorted(group, key=lambda i: -layout.lengths[i])
        start = 0
        while start < len(order):
            longest = layout.lengths[order[start]]
            # left padding keeps a padded position before the longest sample, if the step had one: a causal LM's
            # shifted labels make a row's first token a target only after padding
            length = round_length(longest + (layout.side == "left"), multiple, layout.padded)
            chosen = order[start : start + max(1, fits(length))]
            # no sample less than half the micro-batch's longest (before rounding, so that short samples rounded up to
            # `multiple` are not each given a micro-batch of their own)
            chosen = [i for k, i in enumerate(chosen) if k == 0 or 2 * layout.lengths[i] >= longest]
            start += len(chosen)
            part = trim(select(batch, chosen, layout=batch_layout), layout, length)
            if tokens is not None:
                weight = sum(tokens[i] for i in chosen) / total if total else len(chosen) / n
            else:
                weight = len(chosen) * (sample_weight if chosen[0] < n - tail else tail_weight)
            pieces.append(MicroBatch(part, len(chosen), weight, length))
    return pieces


def hf_models(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The Hugging Face models (``PreTrainedModel``) in ``module``, outermost first (none without ``transformers``)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return []
    return [m for m in module.modules() if isinstance(m, PreTrainedModel)]


def causal_lm_shift(module: torch.nn.Module) -> int:
    """1 when ``module`` holds a Hugging Face causal LM (its loss shifts labels, as the HF Trainer decides), else 0."""
    models = hf_models(module)  # the outermost decides: a causal LM's inner decoder is no LM of its own
    if not models:
        return 0
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return int(type(models[0]).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def label_tokens(batch: Any, shift: int = 0, *, per_sample: bool = False) -> int | Tensor:
    """Tokens a token-mean loss averages over: labels other than -100, or real tokens when there are no labels.

    ``shift`` is the leading positions of every row that are never a target (1 for causal LMs, whose loss compares
    position ``i`` with label ``i + 1``, as Hugging Face's Trainer counts for ``num_items_in_batch``). The count is a
    tensor on the batch's device (no host sync), 1-D with ``per_sample``.

    Raises:
        TypeError: If the batch has neither ``labels`` nor an ``attention_mask``.

    Example:
        >>> label_tokens({"labels": torch.tensor([[-100, 5, 6, -100], [1, 2, 3, 4]])}, shift=1)
        tensor(5)
    """
    if isinstance(batch, Mapping):
        labels = batch.get("labels")
        if isinstance(labels, Tensor) and labels.dim() >= 1:
            found = labels[..., shift:].ne(-100)
            return found.flatten(1).sum(1) if per_sample else found.sum()
        mask = batch.get(_MASK)
        if isinstance(mask, Tensor) and mask.dim() == 2:
            found = mask[:, shift:].bool()
            return found.sum(1) if per_sample else found.sum()
    raise TypeError(
        '`loss_weight="tokens"` needs batches with `labels` (-100 for ignored positions) or an `attention_mask`, '
        f"got {type(batch).__name__}" + (f" with keys {sorted(map(str, batch))}" if isinstance(batch, Mapping) else "")
    )
